"""Reading one field of a Redis stream entry (every value a string), for every contract.

Each contract raises its own error class (the consumer tells a bad command from a bad
request record), so a reader is made for an error class; every message names the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from enum import StrEnum
from typing import Any


class FieldReader:
    def __init__(self, error: type[ValueError]) -> None:
        self.error = error

    def required(self, data: Mapping[str, str], name: str) -> str:
        value = data.get(name)
        if value is None:
            raise self.error(f"{name}: missing")
        if not isinstance(value, str):
            raise self.error(f"{name}: must be a string, got {type(value).__name__}")
        return value

    def integer(self, data: Mapping[str, str], name: str, *, minimum: int = 0, maximum: int) -> int:
        raw = self.required(data, name)
        try:
            value = int(raw)
        except ValueError as exc:
            raise self.error(f"{name}: not an integer: {raw[:40]!r}") from exc
        if value < minimum:
            raise self.error(f"{name}: must be >= {minimum}, got {value}")
        if value > maximum:
            raise self.error(f"{name}: must be <= {maximum}, got {value}")
        return value

    def number(
        self,
        data: Mapping[str, str],
        name: str,
        *,
        minimum: float = 0.0,
        maximum: float | None = None,
    ) -> float:
        """A finite float within [minimum, maximum]."""
        raw = self.required(data, name)
        try:
            value = float(raw)
        except ValueError as exc:
            raise self.error(f"{name}: not a number: {raw[:40]!r}") from exc
        if not math.isfinite(value) or value < minimum:
            raise self.error(f"{name}: must be a finite number >= {minimum:g}, got {raw[:40]!r}")
        if maximum is not None and value > maximum:
            raise self.error(f"{name}: must be <= {maximum}, got {value}")
        return value

    def choice(self, data: Mapping[str, str], name: str, enum: type[StrEnum]) -> Any:
        raw = self.required(data, name)
        try:
            return enum(raw)
        except ValueError as exc:
            allowed = ", ".join(member.value for member in enum)
            raise self.error(f"{name}: {raw[:40]!r} is not one of {allowed}") from exc

    def no_nul(self, name: str, value: str) -> str:
        if "\x00" in value:  # PostgreSQL text cannot hold it
            raise self.error(f"{name}: contains a NUL character")
        return value

    def text(self, data: Mapping[str, str], name: str, *, max_length: int) -> str:
        value = self.required(data, name)
        if len(value) > max_length:
            raise self.error(f"{name}: longer than {max_length} characters")
        return self.no_nul(name, value)
