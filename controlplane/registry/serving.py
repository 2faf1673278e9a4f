"""The serving configuration a version carries (and its signature covers)."""

from typing import Any

from controlplane.core.errors import DomainError

# the dtypes a version may name (int8 on the built-in engine only: contracts.engines.INT8_ENGINES;
# each engine adapter in agent/engines/ refuses a dtype its engine does not take)
DTYPES = ("float32", "bfloat16", "int8")

# integer fields: (minimum, maximum)
LIMITS: dict[str, tuple[int, int]] = {
    "max_model_len": (1, 1_048_576),
    "kv_block_size": (1, 1024),
    "max_num_seqs": (1, 4096),
    "max_num_batched_tokens": (1, 1_048_576),
}
FIELDS = ("dtype", *LIMITS)


def serving_config_validate(config: Any) -> dict[str, Any]:
    """The normalised config (exactly FIELDS), or DomainError naming each bad field."""
    if not isinstance(config, dict):
        raise DomainError("invalid", "serving_config must be an object.")
    errors: dict[str, list[str]] = {}
    for name in sorted(set(config) - set(FIELDS)):
        errors[name] = ["Unknown field."]
    for name in FIELDS:
        if name not in config:
            errors[name] = ["This field is required."]
    if "dtype" in config and config["dtype"] not in DTYPES:
        errors["dtype"] = [f"Must be one of {', '.join(DTYPES)}."]
    for name, (low, high) in LIMITS.items():
        value = config.get(name)
        if name not in config:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            errors[name] = ["Must be an integer."]
        elif not low <= value <= high:
            errors[name] = [f"Must be between {low} and {high}."]
    if errors:
        raise DomainError("invalid", "The serving configuration is not valid.", fields=errors)
    return {name: config[name] for name in FIELDS}


def context_length(config: Any) -> int:
    """A stored config's max_model_len, or 0 when it has none (rows made before validation)."""
    value = config.get("max_model_len") if isinstance(config, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
