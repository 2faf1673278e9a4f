"""Query-string filters shared by the API's list views."""

from datetime import UTC, datetime
from typing import Any

import django_filters
from django import forms


class UtcIsoDateTimeField(forms.DateTimeField):
    """An ISO 8601 time, given in UTC to the database: PostgreSQL refuses offsets beyond
    +-15:59 that Python parses (a 500 before), and a time whose UTC falls outside the
    years 1 to 9999 is refused here, naming the parameter."""

    input_formats = [django_filters.fields.IsoDateTimeField.ISO_8601]

    def strptime(self, value: str, format: str) -> datetime:
        return django_filters.fields.IsoDateTimeField().strptime(value, format)

    def to_python(self, value: Any) -> datetime | None:
        parsed = super().to_python(value)
        if parsed is None:
            return None
        try:
            return parsed.astimezone(UTC)
        except (OverflowError, ValueError) as exc:
            raise forms.ValidationError("Not a time between the years 1 and 9999 UTC.") from exc


class UtcIsoDateTimeFilter(django_filters.DateTimeFilter):
    field_class = UtcIsoDateTimeField
