"""One error type for the domain and one JSON shape for every API error.

Shape: {"error": {"code": "<stable_code>", "message": "<human text>", "fields": {...}}}
"""

from typing import Any

from django.core.exceptions import PermissionDenied
from django.http import Http404
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler


class DomainError(Exception):
    """A refusal by domain code. Services raise it; the API maps it to a 4xx."""

    status_code = status.HTTP_400_BAD_REQUEST

    def __init__(
        self,
        code: str,
        message: str,
        *,
        fields: dict[str, Any] | None = None,
        status_code: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.fields = fields or {}
        if status_code is not None:
            self.status_code = status_code


class NotFound(DomainError):
    status_code = status.HTTP_404_NOT_FOUND

    def __init__(self, message: str = "Not found.") -> None:
        super().__init__("not_found", message)


class Conflict(DomainError):
    status_code = status.HTTP_409_CONFLICT


class Unavailable(DomainError):
    """A store the write needs (Redis, an agent) did not answer: worth retrying."""

    status_code = status.HTTP_503_SERVICE_UNAVAILABLE


class Forbidden(DomainError):
    status_code = status.HTTP_403_FORBIDDEN

    def __init__(self, message: str = "You may not do this.") -> None:
        super().__init__("permission_denied", message)


def error_body(code: str, message: str, fields: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "fields": fields or {}}}


def _flatten(detail: Any) -> Any:
    if isinstance(detail, list):
        return [_flatten(item) for item in detail]
    if isinstance(detail, dict):
        return {key: _flatten(value) for key, value in detail.items()}
    return str(detail)


def api_exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, DomainError):
        return Response(error_body(exc.code, exc.message, exc.fields), status=exc.status_code)
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, PermissionDenied):
        exc = exceptions.PermissionDenied()
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    assert isinstance(exc, exceptions.APIException)
    if isinstance(exc, exceptions.ValidationError):
        detail = _flatten(exc.detail)
        fields = detail if isinstance(detail, dict) else {"non_field_errors": detail}
        response.data = error_body("invalid", "The request is not valid.", fields)
    else:
        codes = exc.get_codes()
        code = codes if isinstance(codes, str) else "error"
        response.data = error_body(code, str(exc.detail))
    return response
