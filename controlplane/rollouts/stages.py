"""A rollout's plan: its stages and its analysis policy, validated and normalized."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from controlplane.core.errors import DomainError
from controlplane.rollouts import analysis
from controlplane.rollouts.models import REPLICAS_LIMIT, Rollout, Stage

DEFAULT_STAGES: tuple[Stage, ...] = (
    {"weight": 5, "min_duration_s": 60, "min_requests": 50, "tenants": []},
    {"weight": 25, "min_duration_s": 60, "min_requests": 100, "tenants": []},
    {"weight": 50, "min_duration_s": 60, "min_requests": 100, "tenants": []},
    {"weight": 100, "min_duration_s": 60, "min_requests": 100, "tenants": []},
)
# The analysis policy of a rollout that overrides nothing (read-only: shared by every caller).
DEFAULT_POLICY: Mapping[str, Any] = MappingProxyType(analysis.AnalysisPolicy().to_dict())


def stages_validate(
    stages: Sequence[Mapping[str, Any]] | None, *, model_id: int | None = None
) -> list[Stage]:
    """Normalize a stage plan; raise DomainError("invalid_stages") naming the bad stage. A
    tenant a stage names must exist and, given `model_id`, be allowed that model (a stage
    for a tenant that cannot call the model would never see a request)."""
    if stages is None:
        return [Stage(**stage) for stage in DEFAULT_STAGES]  # copies: callers may change them
    if not isinstance(stages, list | tuple) or not stages:
        raise DomainError("invalid_stages", "A stage plan is a non-empty list of stages.")
    normalized: list[Stage] = []
    known = {"weight", "min_duration_s", "min_requests", "tenants", "shadow"}
    for index, stage in enumerate(stages):

        def refuse(message: str, index: int = index) -> DomainError:
            return DomainError(
                "invalid_stages", f"Stage {index}: {message}", fields={"stages": {index: message}}
            )

        if not isinstance(stage, dict):
            raise refuse("must be an object.")
        unknown = sorted(set(stage) - known)
        if unknown:
            raise refuse(f"unknown fields {', '.join(unknown)}.")
        weight = stage.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight <= 100:
            raise refuse("weight must be an integer from 1 to 100.")
        duration = stage.get("min_duration_s", 60)
        if isinstance(duration, bool) or not isinstance(duration, int | float) or duration < 0:
            raise refuse("min_duration_s must be a number >= 0.")
        requests = stage.get("min_requests", 0)
        if isinstance(requests, bool) or not isinstance(requests, int) or requests < 0:
            raise refuse("min_requests must be an integer >= 0.")
        tenants = stage.get("tenants", [])
        if not isinstance(tenants, list) or not all(isinstance(t, str) and t for t in tenants):
            raise refuse("tenants must be a list of tenant slugs.")
        is_shadow = stage.get("shadow", False)
        if not isinstance(is_shadow, bool):
            raise refuse("shadow must be true or false.")
        normalized.append(
            Stage(
                weight=weight,
                min_duration_s=duration,
                min_requests=requests,
                tenants=sorted(set(tenants)),
            )
        )
        if is_shadow:  # kept only when true: plans without shadow stages read as before
            normalized[-1]["shadow"] = True
    last = len(normalized) - 1
    if normalized[last].get("shadow"):
        message = (
            "the last stage cannot be a shadow stage (the plan must end serving the candidate)."
        )
        raise DomainError(
            "invalid_stages", f"Stage {last}: {message}", fields={"stages": {last: message}}
        )
    if normalized[last]["tenants"]:
        raise DomainError(
            "invalid_stages", "The last stage must serve every tenant (no tenant list)."
        )
    named = {slug for stage in normalized for slug in stage["tenants"]}
    if named:
        from controlplane.tenants.models import Tenant

        found = Tenant.objects.filter(slug__in=named)
        unknown_slugs = named - set(found.values_list("slug", flat=True))
        if unknown_slugs:
            raise DomainError(
                "invalid_stages", f"Unknown tenants in stages: {', '.join(sorted(unknown_slugs))}."
            )
        if model_id is not None:
            allowed = set(found.filter(allowed_models=model_id).values_list("slug", flat=True))
            if named - allowed:
                raise DomainError(
                    "invalid_stages",
                    "Tenants in stages not allowed this model: "
                    f"{', '.join(sorted(named - allowed))}.",
                )
    return normalized


def policy_validate(policy: dict[str, Any] | None) -> dict[str, Any]:
    try:
        return analysis.AnalysisPolicy.from_dict(policy).to_dict()
    except (TypeError, ValueError) as exc:
        raise DomainError("invalid_policy", str(exc), fields={"policy": [str(exc)]}) from exc


def rollout_policy(rollout: Rollout) -> analysis.AnalysisPolicy:
    return analysis.AnalysisPolicy.from_dict(rollout.policy)


def replicas_validate(minimum: object, maximum: object, *, field: str) -> tuple[int, int]:
    """(min, max) as integers with 1 <= min <= max <= REPLICAS_LIMIT, else invalid_replicas
    naming `field`_min / `field`_max."""
    for name, value in ((f"{field}_min", minimum), (f"{field}_max", maximum)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise DomainError(
                "invalid_replicas", f"{name} must be an integer.", fields={name: [repr(value)]}
            )
        if not 1 <= value <= REPLICAS_LIMIT:
            raise DomainError(
                "invalid_replicas",
                f"{name} must be between 1 and {REPLICAS_LIMIT}.",
                fields={name: [str(value)]},
            )
    assert isinstance(minimum, int) and isinstance(maximum, int)
    if minimum > maximum:
        raise DomainError(
            "invalid_replicas",
            f"{field}_min ({minimum}) is more than {field}_max ({maximum}).",
            fields={f"{field}_min": [str(minimum)], f"{field}_max": [str(maximum)]},
        )
    return minimum, maximum
