"""What every dashboard page does the same way: refuse, render (or render a fragment),
and show a domain refusal."""

from typing import Any

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render

from controlplane.core.errors import DomainError, Forbidden, NotFound


def require(allowed: bool) -> None:
    if not allowed:
        raise PermissionDenied


def render_page(
    request: HttpRequest,
    template: str,
    context: dict[str, Any],
    fragments: dict[str, str] | None = None,
    status: int = 200,
) -> HttpResponse:
    """The page, or one of its fragments when the live client asks for it."""
    fragment = request.GET.get("fragment")
    if fragment:
        if not fragments or fragment not in fragments:
            raise Http404("No such fragment.")
        template = fragments[fragment]
    return render(request, template, context, status=status)


def domain_error_show(request: HttpRequest, error: DomainError) -> None:
    if isinstance(error, Forbidden):
        raise PermissionDenied(error.message)
    if isinstance(error, NotFound):
        raise Http404(error.message)
    messages.error(request, error.message)
