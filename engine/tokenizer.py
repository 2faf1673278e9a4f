"""The engine's tokenizer: the one the control plane counts tokens with (contracts/tokenizer.py)."""

from contracts.tokenizer import END_OF_TURN_TOKENS, SPECIAL_TOKEN_TYPES, TextTokenizer

__all__ = ["END_OF_TURN_TOKENS", "SPECIAL_TOKEN_TYPES", "TextTokenizer"]
