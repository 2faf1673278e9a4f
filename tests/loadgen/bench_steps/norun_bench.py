def main() -> None:
    print("a script, not a step")
