"""`Authorization: Bearer <token>` with a personal access token (stored hashed)."""

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication, exceptions

from controlplane.accounts import selectors


class BearerTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request: Any) -> tuple[Any, Any] | None:
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].lower() != self.keyword.lower().encode():
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("Authorization must be 'Bearer <token>'.")
        try:
            raw = header[1].decode()
        except UnicodeDecodeError as exc:
            raise exceptions.AuthenticationFailed("The token is not valid.") from exc
        token = selectors.access_token_authenticate(raw)
        if token is None:
            raise exceptions.AuthenticationFailed("The token is not valid, expired or revoked.")
        return token.user, token

    def authenticate_header(self, request: Any) -> str:
        return self.keyword


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "controlplane.accounts.authentication.BearerTokenAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer", "bearerFormat": "cpt-…"}
