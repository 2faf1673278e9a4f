"""Dashboard pages of tenants: usage, API keys, the data policy. A tenant member asking
for another tenant's page gets 404, so that they cannot learn it exists."""

from datetime import timedelta
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from controlplane.core import access
from controlplane.core.errors import DomainError, NotFound
from controlplane.dashboard import forms, presenters
from controlplane.dashboard.pages import domain_error_show, render_page, require
from controlplane.rollouts import selectors as rollout_selectors
from controlplane.rollouts.models import ACTIVE_STATES
from controlplane.telemetry.retention import retention_days_of
from controlplane.tenants import selectors as tenant_selectors
from controlplane.tenants import services as tenant_services
from controlplane.tenants.models import PromptLogging


@login_required
@require_GET
def tenant_list(request: HttpRequest) -> HttpResponse:
    own_tenant = access.tenant_for_user(request.user)
    if own_tenant is not None:
        return redirect("dashboard:tenant-detail", tenant_id=own_tenant.pk)
    require(access.can_list_tenants(request.user))
    tenants = tenant_selectors.tenant_list(user=request.user)
    since = timezone.now() - timedelta(days=1)
    rows = [
        {
            "tenant": tenant,
            "totals": presenters.usage_totals(
                tenant_selectors.usage_aggregate(tenant=tenant, granularity="day", since=since)
            ),
        }
        for tenant in tenants
    ]
    return render(request, "dashboard/tenant_list.html", {"rows": rows})


def _visible_tenant(request: HttpRequest, tenant_id: int) -> Any:
    try:
        return tenant_selectors.tenant_get_visible(user=request.user, tenant_id=tenant_id)
    except NotFound as error:
        raise Http404(error.message) from error


def _tenant_context(request: HttpRequest, tenant: Any) -> dict[str, Any]:
    filters = forms.UsageFilterForm(request.GET)
    granularity = "hour"
    if filters.is_valid() and filters.cleaned_data["granularity"]:
        granularity = filters.cleaned_data["granularity"]
    # Whole buckets only: the first starts at or before the span's start.
    buckets = presenters.usage_buckets(granularity=granularity, until=timezone.now())
    usage = list(
        tenant_selectors.usage_aggregate(tenant=tenant, granularity=granularity, since=buckets[0])
    )
    active_rollouts = rollout_selectors.rollout_list().filter(state__in=ACTIVE_STATES)
    may_manage_keys = access.can_manage_api_keys(request.user, tenant)
    return {
        "tenant": tenant,
        "filters": filters,
        "granularity": granularity,
        "usage": usage,
        "usage_series": presenters.usage_series(
            usage,
            granularity=granularity,
            buckets=buckets,
            roles=presenters.version_roles(active_rollouts),
        ),
        "totals": presenters.usage_totals(usage),
        "keys": tenant_selectors.api_key_list(tenant=tenant),
        "may_manage_keys": may_manage_keys,
        "key_form": forms.ApiKeyCreateForm() if may_manage_keys else None,
        "live_group_tenant": tenant.pk,
        "retention_days": retention_days_of(tenant),
        "is_prompt_logging_on": tenant.prompt_logging == PromptLogging.FULL,
    }


@login_required
@require_GET
def tenant_detail(request: HttpRequest, tenant_id: int) -> HttpResponse:
    tenant = _visible_tenant(request, tenant_id)
    return render_page(
        request,
        "dashboard/tenant_detail.html",
        _tenant_context(request, tenant),
        fragments={"usage": "dashboard/partials/tenant_usage.html"},
    )


@login_required
@require_POST
def api_key_create(request: HttpRequest, tenant_id: int) -> HttpResponse:
    tenant = _visible_tenant(request, tenant_id)
    require(access.can_manage_api_keys(request.user, tenant))
    form = forms.ApiKeyCreateForm(request.POST)
    if not form.is_valid():
        messages.error(request, presenters.form_errors(form))
        return redirect("dashboard:tenant-detail", tenant_id=tenant.pk)
    try:
        created = tenant_services.api_key_create(
            actor=request.user,
            tenant=tenant,
            name=form.cleaned_data["name"],
            scopes=form.cleaned_data["scopes"],
            expires_at=form.cleaned_data["expires_at"],
        )
    except DomainError as error:
        domain_error_show(request, error)
        return redirect("dashboard:tenant-detail", tenant_id=tenant.pk)
    # The raw key is in this response only: never stored, never in a cookie or the session.
    context = _tenant_context(request, tenant)
    context["created_key"] = created
    response = render(request, "dashboard/tenant_detail.html", context, status=201)
    response["Cache-Control"] = "no-store"
    return response


@login_required
@require_POST
def api_key_revoke(request: HttpRequest, tenant_id: int, key_id: int) -> HttpResponse:
    tenant = _visible_tenant(request, tenant_id)
    require(access.can_manage_api_keys(request.user, tenant))
    key = get_object_or_404(tenant_selectors.api_key_list(tenant=tenant), pk=key_id)
    form = forms.ApiKeyRevokeForm(request.POST)
    reason = form.cleaned_data["reason"] if form.is_valid() else ""
    try:
        tenant_services.api_key_revoke(actor=request.user, key=key, reason=reason)
    except DomainError as error:
        domain_error_show(request, error)
    else:
        messages.success(request, f"Key {key.prefix}… is revoked.")
    return redirect("dashboard:tenant-detail", tenant_id=tenant.pk)
