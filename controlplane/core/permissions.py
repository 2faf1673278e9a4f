"""Use the access functions in DRF views: `permission_classes = [allows(can_view_fleet)]`."""

from collections.abc import Callable
from typing import Any

from rest_framework.permissions import BasePermission


def allows(check: Callable[[Any], bool]) -> type[BasePermission]:
    """A DRF permission class granting the request when `check(request.user)` is true."""

    class Allowed(BasePermission):
        message = "You may not do this."

        def has_permission(self, request: Any, view: Any) -> bool:
            return bool(request.user and request.user.is_authenticated and check(request.user))

    Allowed.__name__ = f"Allows_{check.__name__}"
    Allowed.__qualname__ = Allowed.__name__
    return Allowed


def allows_by_method(
    *, read: Callable[[Any], bool], write: Callable[[Any], bool]
) -> type[BasePermission]:
    """`read` decides safe methods (GET, HEAD, OPTIONS), `write` every other one."""

    class AllowedByMethod(BasePermission):
        message = "You may not do this."

        def has_permission(self, request: Any, view: Any) -> bool:
            if not (request.user and request.user.is_authenticated):
                return False
            check = read if request.method in {"GET", "HEAD", "OPTIONS"} else write
            return bool(check(request.user))

    AllowedByMethod.__name__ = f"Allows_{read.__name__}_or_{write.__name__}"
    AllowedByMethod.__qualname__ = AllowedByMethod.__name__
    return AllowedByMethod
