"""Shared API pieces: refuse unknown request fields once, for every serializer."""

from typing import Any

from rest_framework import serializers

from controlplane.core.errors import DomainError


class StrictFieldsMixin:
    """Refuse request bodies carrying fields the serializer does not declare as writable.

    A typo (`max_model_lenght`) must not be silently dropped. Answered as 400 with the code
    `unknown_fields` and one entry per unknown field in `fields`. Text fields also refuse
    numbers and booleans, which DRF would otherwise turn into strings.
    """

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            writable = {name for name, field in self.fields.items() if not field.read_only}  # type: ignore[attr-defined]
            unknown = sorted(str(key) for key in data if key not in writable)
            if unknown:
                raise DomainError(
                    "unknown_fields",
                    f"Unknown fields: {', '.join(unknown)}.",
                    fields={name: ["Unknown field."] for name in unknown},
                )
            wrong_type = {
                name: ["Not a valid string."]
                for name, field in self.fields.items()  # type: ignore[attr-defined]
                if isinstance(field, serializers.CharField)
                and name in data
                and data[name] is not None
                and not isinstance(data[name], str)
            }
            if wrong_type:
                raise serializers.ValidationError(wrong_type)
        return super().to_internal_value(data)  # type: ignore[misc]


class StrictSerializer(StrictFieldsMixin, serializers.Serializer):
    pass


class StrictBooleanField(serializers.BooleanField):
    """A JSON boolean only: DRF's BooleanField would also take "yes", "on", 1 or "0"."""

    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            self.fail("invalid", input=data)
        return data
