"""Dashboard pages: thin views that check access, call one selector or service and render.

Every permission comes from `controlplane.core.access`. A page the role may not open is
403, except tenants' pages: a tenant member asking for another tenant gets 404, so that
they cannot learn it exists. Domain refusals (a stale rollout, a lost agent) come back as a
message on the page they were made from.

A page may be asked for one of its fragments (`?fragment=<name>`): the live client
(static/dashboard/live.js) refetches them when a websocket event says they changed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import redis
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from contracts.routing import REQUESTS_STREAM
from controlplane.audit.selectors import audit_event_list
from controlplane.core import access
from controlplane.core.errors import DomainError, NotFound
from controlplane.core.redis_clients import redis_client
from controlplane.dashboard import forms, presenters
from controlplane.dashboard.pages import domain_error_show, render_page, require
from controlplane.dashboard.rollout_forms import RolloutStartForm
from controlplane.fleet import enrolment
from controlplane.fleet import selectors as fleet_selectors
from controlplane.fleet import services as fleet_services
from controlplane.fleet.models import AgentState
from controlplane.registry import selectors as registry_selectors
from controlplane.registry.models import DEPLOYABLE_STATUSES
from controlplane.rollouts import selectors as rollout_selectors
from controlplane.rollouts import stages, transitions, undo
from controlplane.rollouts.models import ACTIVE_STATES, Rollout
from controlplane.telemetry.stream_trim import StreamLoss, stream_loss_get

SPARKLINE_WINDOW = timedelta(minutes=10)
ENERGY_WINDOW = timedelta(minutes=5)
AUDIT_PAGE_SIZE = 50
REVISIONS_SHOWN = 10
ANALYSIS_RUNS_SHOWN = 200
USAGE_LOST_ALERT_WINDOW = timedelta(days=7)


# Overview.


def _fleet_summary() -> dict[str, Any]:
    agents = list(fleet_selectors.agent_list())
    now = timezone.now()
    by_state = Counter(agent.state for agent in agents)
    live_agents = [agent for agent in agents if agent.state != AgentState.LOST]
    power = sum(float((agent.figures or {}).get("power_watts") or 0.0) for agent in live_agents)
    joules = 0.0
    tokens = 0
    for agent in live_agents:
        for bucket in fleet_selectors.agent_history(
            agent=agent, since=now - ENERGY_WINDOW, until=now
        ):
            joules += bucket["energy_joules"]
            tokens += bucket["generated_tokens"]
    return {
        "agent_count": len(agents),
        "by_state": [
            {"state": state, "label": label, "count": by_state.get(state, 0)}
            for state, label in AgentState.choices
            if by_state.get(state)
        ],
        "ready_count": by_state.get(AgentState.READY, 0),
        "power_watts": power,
        "joules_per_token": joules / tokens if tokens else None,
        "tokens_window": tokens,
    }


def _active_rollouts() -> list[dict[str, Any]]:
    rows = []
    for rollout in rollout_selectors.rollout_list().filter(state__in=ACTIVE_STATES):
        last_run = rollout_selectors.analysis_run_list(rollout=rollout).first()
        rows.append({"rollout": rollout, "stage": presenters.stage_label(rollout), "run": last_run})
    return rows


def _usage_lost() -> StreamLoss | None:
    """Requests-stream entries ingest found gone before it read them, for the alert: shown
    for a week after the last such gap; not at all when Redis cannot say."""
    client = redis_client(decode_responses=True)
    try:
        loss = stream_loss_get(client, REQUESTS_STREAM)
    except (redis.RedisError, OSError):
        return None
    finally:
        client.close()
    if loss is None or timezone.now() - loss.last_at > USAGE_LOST_ALERT_WINDOW:
        return None
    return loss


@login_required
@require_GET
def overview(request: HttpRequest) -> HttpResponse:
    own_tenant = access.tenant_for_user(request.user)
    if own_tenant is not None:
        return redirect("dashboard:tenant-detail", tenant_id=own_tenant.pk)
    require(access.is_staff_reader(request.user))
    context = {
        "fleet": _fleet_summary(),
        "active_rollouts": _active_rollouts(),
        "recent_events": audit_event_list(user=request.user)[:12],
        "usage_lost": _usage_lost(),
    }
    return render_page(
        request,
        "dashboard/overview.html",
        context,
        fragments={
            "fleet": "dashboard/partials/overview_fleet.html",
            "rollouts": "dashboard/partials/overview_rollouts.html",
            "audit": "dashboard/partials/audit_rows.html",
        },
    )


# Rollouts.


@login_required
@require_GET
def rollout_list(request: HttpRequest) -> HttpResponse:
    require(access.is_staff_reader(request.user))
    rollouts = rollout_selectors.rollout_list()[:100]
    rows = [{"rollout": rollout, "stage": presenters.stage_label(rollout)} for rollout in rollouts]
    context = {"rows": rows, "deployments": rollout_selectors.deployment_list()}
    return render_page(
        request,
        "dashboard/rollout_list.html",
        context,
        fragments={"table": "dashboard/partials/rollout_table.html"},
    )


def _rollout_or_404(rollout_id: int) -> Any:
    return get_object_or_404(rollout_selectors.rollout_list(), pk=rollout_id)


@login_required
@require_GET
def rollout_detail(request: HttpRequest, rollout_id: int) -> HttpResponse:
    require(access.is_staff_reader(request.user))
    rollout = _rollout_or_404(rollout_id)
    runs = list(rollout_selectors.analysis_run_list(rollout=rollout)[:ANALYSIS_RUNS_SHOWN])
    context = {
        "rollout": rollout,
        "stages": presenters.stage_plan(rollout),
        "runs": runs,
        "actions": presenters.rollout_actions(request.user, rollout),
        "policy": stages.rollout_policy(rollout),
        "events": audit_event_list(user=request.user).filter(
            object_type="rollout", object_id=str(rollout.pk)
        )[:20],
        "is_active": rollout.state in ACTIVE_STATES,
    }
    return render_page(
        request,
        "dashboard/rollout_detail.html",
        context,
        fragments={
            "status": "dashboard/partials/rollout_status.html",
            "runs": "dashboard/partials/rollout_runs.html",
            "events": "dashboard/partials/audit_rows.html",
        },
    )


@login_required
@require_GET
def rollout_series(request: HttpRequest, rollout_id: int) -> JsonResponse:
    """Canary against baseline per analysis run, oldest first, for the live charts."""
    require(access.is_staff_reader(request.user))
    rollout = _rollout_or_404(rollout_id)
    runs = list(rollout_selectors.analysis_run_list(rollout=rollout)[:ANALYSIS_RUNS_SHOWN])
    return JsonResponse(presenters.analysis_series(reversed(runs), rollout))


# The rollout actions the dashboard offers (promote advances one stage, or all with `full`).
ROLLOUT_ACTIONS: dict[str, Callable[..., Rollout]] = {
    "promote": transitions.rollout_advance,
    "pause": transitions.rollout_pause,
    "resume": transitions.rollout_resume,
    "abort": transitions.rollout_abort,
    "rollback": transitions.rollout_rollback,
}


@login_required
@require_POST
def rollout_transition(request: HttpRequest, rollout_id: int, action: str) -> HttpResponse:
    if action not in ROLLOUT_ACTIONS:
        raise Http404("No such action.")
    require(presenters.may_transition(request.user, action))
    rollout = _rollout_or_404(rollout_id)
    form = forms.ReasonForm(request.POST)
    if not form.is_valid():
        messages.error(request, "A reason is required.")
        return redirect("dashboard:rollout-detail", rollout_id=rollout.pk)
    data = form.cleaned_data
    extra: dict[str, Any] = {}
    if data["expected_revision"] is not None:
        extra["expected_revision"] = data["expected_revision"]
    if action == "promote":
        extra["full"] = data["full"]
    try:
        result = ROLLOUT_ACTIONS[action](
            actor=request.user, rollout_id=rollout.pk, reason=data["reason"], **extra
        )
    except DomainError as error:
        domain_error_show(request, error)
    else:
        messages.success(request, f"Rollout {result.pk} is {result.get_state_display()}.")
    return redirect("dashboard:rollout-detail", rollout_id=rollout.pk)


# Deployments.


def deployment_page(
    request: HttpRequest,
    name: str,
    *,
    form: forms.UndoForm | None = None,
    undo_error: str = "",
    status: int = 200,
) -> HttpResponse:
    """The deployment's stable version, its last stables and the undo form (with any
    refusal shown next to it)."""
    require(access.is_staff_reader(request.user))
    deployment = get_object_or_404(rollout_selectors.deployment_list(), name=name)
    revisions = rollout_selectors.deployment_revision_list(deployment=deployment)
    target_id = undo.undo_target(deployment)
    context = {
        "deployment": deployment,
        "revisions": revisions[:REVISIONS_SHOWN],
        "active_rollout": rollout_selectors.rollout_list()
        .filter(deployment=deployment, state__in=ACTIVE_STATES)
        .first(),
        "undo_target": registry_selectors.version_list().filter(pk=target_id).first()
        if target_id is not None
        else None,
        "replicas": presenters.deployment_replicas(deployment),
        "scaling_decisions": rollout_selectors.scaling_decision_list(deployment=deployment)[
            :REVISIONS_SHOWN
        ],
        "may_undo": access.can_undo_deployment(request.user),
        "form": form or forms.UndoForm(),
        "undo_error": undo_error,
    }
    return render(request, "dashboard/deployment_detail.html", context, status=status)


@login_required
@require_GET
def deployment_detail(request: HttpRequest, name: str) -> HttpResponse:
    return deployment_page(request, name)


@login_required
@require_POST
def deployment_undo(request: HttpRequest, name: str) -> HttpResponse:
    require(access.can_undo_deployment(request.user))
    form = forms.UndoForm(request.POST)
    if not form.is_valid():
        return deployment_page(request, name, form=form, status=400)
    try:
        result = undo.deployment_undo(
            actor=request.user, deployment_name=name, reason=form.cleaned_data["reason"]
        )
    except DomainError as error:
        if isinstance(error, NotFound):
            raise Http404(error.message) from error
        return deployment_page(
            request, name, form=form, undo_error=error.message, status=error.status_code
        )
    restored = result.deployment.stable_version
    when = "now" if result.switch == undo.Switch.IMMEDIATE else "once an agent has loaded it"
    messages.success(request, f"{name} is back on {restored.label}: it takes the traffic {when}.")
    return redirect("dashboard:deployment-detail", name=name)


# Registry.


@login_required
@require_GET
def registry(request: HttpRequest) -> HttpResponse:
    require(access.can_view_registry(request.user))
    versions = list(registry_selectors.version_list().order_by("model__name", "-created_at", "-id"))
    evaluations = presenters.evaluations_by_version(
        registry_selectors.evaluation_list().filter(version__in=versions)
    )
    models = []
    for model in registry_selectors.model_list():
        rows = [
            {"version": version, "evaluations": evaluations.get(version.pk, [])}
            for version in versions
            if version.model_id == model.pk
        ]
        models.append({"model": model, "versions": rows})
    return render(request, "dashboard/registry.html", {"models": models, "versions": versions})


@login_required
@require_GET
def version_detail(request: HttpRequest, version_id: int) -> HttpResponse:
    require(access.can_view_registry(request.user))
    version = get_object_or_404(registry_selectors.version_list(), pk=version_id)
    rollout_form = None
    if access.can_steer_rollouts(request.user):
        rollout_form = RolloutStartForm(version=version, user=request.user)
    return version_page(request, version, rollout_form=rollout_form)


def version_page(
    request: HttpRequest,
    version: Any,
    *,
    rollout_form: RolloutStartForm | None,
    status: int = 200,
) -> HttpResponse:
    context = {
        "version": version,
        "evaluations": registry_selectors.evaluation_list().filter(version=version),
        "siblings": registry_selectors.version_list()
        .filter(model=version.model)
        .exclude(pk=version.pk),
        "fits": presenters.version_fits(version, fleet_selectors.agent_list()),
        "rollout_form": rollout_form,
    }
    return render(request, "dashboard/version_detail.html", context, status=status)


@login_required
@require_POST
def version_rollout_create(request: HttpRequest, version_id: int) -> HttpResponse:
    """The version's "Start a rollout" form: the REST API's validation and service."""
    require(access.can_steer_rollouts(request.user))
    version = get_object_or_404(registry_selectors.version_list(), pk=version_id)
    form = RolloutStartForm(version=version, user=request.user, data=request.POST)
    rollout = form.save(actor=request.user)
    if rollout is None:
        return version_page(request, version, rollout_form=form, status=400)
    messages.success(request, f"Rollout {rollout.pk} of {version} on {rollout.deployment} started.")
    return redirect("dashboard:rollout-detail", rollout_id=rollout.pk)


@login_required
@require_GET
def version_compare(request: HttpRequest) -> HttpResponse:
    require(access.can_view_registry(request.user))
    versions = registry_selectors.version_list()
    ids = [request.GET.get("a", ""), request.GET.get("b", "")]
    if not all(value.isdigit() for value in ids):
        raise Http404("Name two versions: ?a=<id>&b=<id>.")
    left = get_object_or_404(versions, pk=int(ids[0]))
    right = get_object_or_404(versions, pk=int(ids[1]))
    evaluations = presenters.evaluations_by_version(
        registry_selectors.evaluation_list().filter(version__in=[left, right])
    )
    context = {
        "left": left,
        "right": right,
        "rows": presenters.version_comparison(left, right),
        "metric_rows": presenters.evaluation_comparison(
            evaluations.get(left.pk, []), evaluations.get(right.pk, [])
        ),
        "all_versions": versions,
    }
    return render(request, "dashboard/version_compare.html", context)


# Fleet.


@login_required
@require_GET
def fleet(request: HttpRequest) -> HttpResponse:
    return fleet_page(request)


def fleet_page(
    request: HttpRequest, *, created_enrolment: Any = None, status: int = 200
) -> HttpResponse:
    require(access.can_view_fleet(request.user))
    now = timezone.now()
    rows = []
    for agent in fleet_selectors.agent_list():
        history = fleet_selectors.agent_history(
            agent=agent, since=now - SPARKLINE_WINDOW, until=now
        )
        rows.append({"agent": agent, "figures": agent.figures or {}, "history": history})
    context = {
        "rows": rows,
        "spark_window_s": SPARKLINE_WINDOW.total_seconds(),
        "spark_minutes": round(SPARKLINE_WINDOW.total_seconds() / 60),
        "may_command": access.can_command_agents(request.user),
        "may_enrol": access.can_enrol_agents(request.user),
        "loadable_versions": registry_selectors.version_list().filter(
            status__in=DEPLOYABLE_STATUSES
        ),
    }
    context["created_enrolment"] = created_enrolment
    return render_page(
        request,
        "dashboard/fleet.html",
        context,
        fragments={"table": "dashboard/partials/fleet_table.html"},
        status=status,
    )


@login_required
@require_POST
def agent_command(request: HttpRequest, agent_name: str) -> HttpResponse:
    require(access.can_command_agents(request.user))
    form = forms.AgentCommandForm(request.POST)
    if not form.is_valid():
        messages.error(request, presenters.form_errors(form))
        return redirect("dashboard:fleet")
    data = form.cleaned_data
    try:
        command = fleet_services.agent_command_send(
            actor=request.user,
            agent_name=agent_name,
            kind=data["kind"],
            version_id=data["version_id"],
            latency_ms_per_token=data["latency_ms_per_token"],
            error_rate=data["error_rate"],
            reason=data["reason"],
        )
    except DomainError as error:
        domain_error_show(request, error)
    else:
        messages.success(request, f"Sent {command.kind} to {agent_name}.")
    return redirect("dashboard:fleet")


@login_required
@require_POST
def agent_enrolment_create(request: HttpRequest) -> HttpResponse:
    require(access.can_enrol_agents(request.user))
    form = forms.AgentEnrolmentForm(request.POST)
    if not form.is_valid():
        messages.error(request, presenters.form_errors(form))
        return redirect("dashboard:fleet")
    try:
        created = enrolment.agent_enrolment_create(
            actor=request.user, agent_name=form.cleaned_data["agent_name"]
        )
    except DomainError as error:
        domain_error_show(request, error)
        return redirect("dashboard:fleet")
    # The raw token is in this response only: never stored, never in a cookie or the session.
    response = fleet_page(request, created_enrolment=created, status=201)
    response["Cache-Control"] = "no-store"
    return response


# Audit.


@login_required
@require_GET
def audit_log(request: HttpRequest) -> HttpResponse:
    require(access.can_view_audit(request.user))
    form = forms.AuditFilterForm(request.GET)
    events = audit_event_list(user=request.user)
    if form.is_valid():
        events = presenters.audit_filter(events, **form.cleaned_data)
    page = Paginator(events, AUDIT_PAGE_SIZE).get_page(request.GET.get("page"))
    query = request.GET.copy()
    query.pop("page", None)
    context = {
        "form": form,
        "page": page,
        "events": page.object_list,
        "query": query.urlencode(),
        "audit_url": reverse("dashboard:audit"),
    }
    return render_page(
        request,
        "dashboard/audit.html",
        context,
        fragments={"rows": "dashboard/partials/audit_rows.html"},
    )
