"""The "Start a rollout" form of a version's page.

It has no rules of its own: it turns what the browser sent into the body of
`POST /api/v1/rollouts/` and hands it to the API's serializer (`RolloutCreateSerializer`)
and service (`deployments.rollout_create`). Their refusals come back next to the fields
they name, with what the user typed kept.

Stage rows are named `stages-<n>-<field>`; rows are taken in the order of `n` (gaps are
fine, so a script may add and remove rows), and a row left wholly blank is no stage. A
stage or policy field left blank is left out of the body, so it takes the API's default.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.http import QueryDict

from controlplane.core.errors import DomainError
from controlplane.registry import selectors as registry_selectors
from controlplane.registry.models import DEPLOYABLE_STATUSES, ModelVersion
from controlplane.rollouts import analysis, deployments
from controlplane.rollouts import selectors as rollout_selectors
from controlplane.rollouts.models import ACTIVE_STATES, Rollout
from controlplane.rollouts.serializers import RolloutCreateSerializer
from controlplane.rollouts.stages import DEFAULT_POLICY, DEFAULT_STAGES
from controlplane.tenants import selectors as tenant_selectors

STAGE_NUMBER_FIELDS = ("weight", "min_duration_s", "min_requests")
STAGE_FIELD_PATTERN = re.compile(
    r"^stages-(\d{1,4})-(weight|min_duration_s|min_requests|tenants|shadow)$"
)
# Blank rows under the plan, so that a browser without JavaScript can add stages too.
SPARE_STAGE_ROWS = 2
# Refusals the service names no field for, placed next to the field they are about.
FIELD_OF_ERROR_CODE = {
    "candidate_is_stable": "deployment",
    "candidate_wrong_model": "deployment",
    "rollout_in_progress": "deployment",
    "invalid_stages": "stages",
    "invalid_policy": "policy",
}
REPLICA_FIELDS = (("canary_replicas_min", "Minimum"), ("canary_replicas_max", "Maximum"))


@dataclass
class StageRow:
    weight: str = ""
    min_duration_s: str = ""
    min_requests: str = ""
    tenants: list[str] = field(default_factory=list)
    is_shadow: bool = False  # the checkbox: mirror the weight's share, answer from stable
    errors: dict[str, list[str]] = field(default_factory=dict)  # field, or "row" for the stage

    @property
    def is_blank(self) -> bool:
        has_number = any(getattr(self, name) for name in STAGE_NUMBER_FIELDS)
        return not has_number and not self.tenants and not self.is_shadow

    def body(self) -> dict[str, Any]:
        """The stage as the API takes it: blank fields left out (the API's defaults)."""
        stage: dict[str, Any] = {
            name: getattr(self, name) for name in STAGE_NUMBER_FIELDS if getattr(self, name)
        }
        stage["tenants"] = list(self.tenants)
        if self.is_shadow:
            stage["shadow"] = True
        return stage


@dataclass
class PolicyField:
    name: str
    default: Any
    value: str = ""
    errors: list[str] = field(default_factory=list)

    @property
    def choices(self) -> list[str] | None:
        if self.name != "on_inconclusive":
            return None
        return [choice.value for choice in analysis.OnInconclusive]

    def body_value(self) -> Any:
        """The typed text as the JSON value the API expects: a number where the default is
        one. Text that is no number goes as typed, for the policy's own check to refuse."""
        kind = type(self.default)
        if kind not in (int, float):
            return self.value
        try:
            return kind(self.value)
        except ValueError:
            return self.value


def _number_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _messages(detail: Any) -> list[str]:
    """Every message in a DRF error detail (a list, a dict by field or index, or text)."""
    if isinstance(detail, Mapping):
        return [message for value in detail.values() for message in _messages(value)]
    if isinstance(detail, list | tuple):
        return [message for value in detail for message in _messages(value)]
    return [str(detail)]


class RolloutStartForm:
    """Unbound: the product's default plan. Bound (`data`): what the user sent."""

    def __init__(self, *, version: ModelVersion, user: Any, data: QueryDict | None = None):
        self.version = version
        self.deployments = list(
            rollout_selectors.deployment_list().filter(stable_version__model=version.model)
        )
        busy = set(
            rollout_selectors.rollout_list()
            .filter(deployment__in=self.deployments, state__in=ACTIVE_STATES)
            .values_list("deployment_id", flat=True)
        )
        self.deployment_choices = [
            {"deployment": deployment, "is_busy": deployment.pk in busy}
            for deployment in self.deployments
        ]
        self.tenant_slugs = list(
            tenant_selectors.tenant_list(user=user)
            .filter(allowed_models=version.model)
            .order_by("slug")
            .values_list("slug", flat=True)
        )
        self.suite_names = list(registry_selectors.eval_suite_list().values_list("name", flat=True))
        self.errors: dict[str, list[str]] = {}  # field name, or "form" for the whole form
        if data is None:
            self.deployment = self.deployments[0].name if len(self.deployments) == 1 else ""
            self.rows = [
                StageRow(
                    weight=str(stage["weight"]),
                    min_duration_s=_number_text(stage["min_duration_s"]),
                    min_requests=str(stage["min_requests"]),
                    tenants=list(stage["tenants"]),
                    is_shadow=bool(stage.get("shadow", False)),
                )
                for stage in DEFAULT_STAGES
            ]
            self.policy = [PolicyField(name, default) for name, default in DEFAULT_POLICY.items()]
            self.required_suites: list[str] = []
            self.reason = ""
            self.replicas = {name: "1" for name, _ in REPLICA_FIELDS}
        else:
            self.deployment = data.get("deployment", "").strip()
            self.rows = self._rows_from(data)
            self.policy = [
                PolicyField(name, default, data.get(f"policy-{name}", "").strip())
                for name, default in DEFAULT_POLICY.items()
            ]
            self.required_suites = data.getlist("required_suites")
            self.reason = data.get("reason", "").strip()
            self.replicas = {name: data.get(name, "").strip() for name, _ in REPLICA_FIELDS}

    @staticmethod
    def _rows_from(data: QueryDict) -> list[StageRow]:
        rows: dict[int, StageRow] = {}
        for key in data:
            match = STAGE_FIELD_PATTERN.match(key)
            if match is None:
                continue
            row = rows.setdefault(int(match[1]), StageRow())
            name = match[2]
            if name == "tenants":
                row.tenants = [slug for slug in data.getlist(key) if slug]
            elif name == "shadow":  # a checkbox: sent only when ticked
                row.is_shadow = True
            else:
                setattr(row, name, data.get(key, "").strip())
        return [rows[number] for number in sorted(rows) if not rows[number].is_blank]

    @property
    def is_version_deployable(self) -> bool:
        return self.version.status in DEPLOYABLE_STATUSES

    @property
    def shown_rows(self) -> list[dict[str, Any]]:
        """The plan's rows, then blank spare ones (which the page's script takes away)."""
        rows = [*self.rows, *(StageRow() for _ in range(SPARE_STAGE_ROWS))]
        return [
            {"row": row, "index": str(number), "is_spare": number >= len(self.rows)}
            for number, row in enumerate(rows)
        ]

    @property
    def replica_fields(self) -> list[tuple[str, str, str, list[str]]]:
        """(input name, label, typed value, errors) of the canary's replica bounds."""
        return [
            (name, label, self.replicas[name], self.errors.get(name, []))
            for name, label in REPLICA_FIELDS
        ]

    @property
    def is_policy_changed(self) -> bool:
        return any(item.value or item.errors for item in self.policy) or "policy" in self.errors

    def body(self) -> dict[str, Any]:
        """The request body of `POST /api/v1/rollouts/` this form stands for."""
        body: dict[str, Any] = {
            "candidate": self.version.pk,
            "stages": [row.body() for row in self.rows],
            "policy": {item.name: item.body_value() for item in self.policy if item.value},
            "required_suites": list(self.required_suites),
            "reason": self.reason,
        }
        for name, text in self.replicas.items():
            if text:  # blank: the API's default; text that is no number goes as typed
                body[name] = int(text) if text.isdigit() else text
        if self.deployment:
            body["deployment"] = self.deployment
        return body

    def save(self, *, actor: Any) -> Rollout | None:
        """The new rollout, or None with `errors` (and rows' and policy fields') filled."""
        serializer = RolloutCreateSerializer(data=self.body())
        try:
            if not serializer.is_valid():
                self._add_serializer_errors(serializer.errors)
                return None
            return deployments.rollout_create(actor=actor, **serializer.service_arguments())
        except DomainError as error:
            self._add_domain_error(error)
            return None

    # Errors, next to their fields.

    def _add(self, name: str, messages: Iterable[str]) -> None:
        self.errors.setdefault(name, []).extend(messages)

    def _add_serializer_errors(self, errors: Mapping[str, Any]) -> None:
        for name, detail in errors.items():
            by_row = self._stage_errors_by_row(detail) if name == "stages" else None
            if by_row is not None:
                for row, row_detail in by_row:
                    if not isinstance(row_detail, Mapping):  # about the stage as a whole
                        row_detail = {"row": row_detail}
                    for stage_field, messages in row_detail.items():
                        row.errors.setdefault(stage_field, []).extend(_messages(messages))
            elif name in {"deployment", "stages", "policy", "required_suites", "reason"} | set(
                self.replicas
            ):
                self._add(name, _messages(detail))
            else:
                self._add("form", _messages(detail))

    def _stage_errors_by_row(self, detail: Any) -> list[tuple[StageRow, Any]] | None:
        """Each stage's errors with its row: DRF reports them by the stage's index (a
        dict of the failing ones); None when the errors are about the plan as a whole."""
        if not isinstance(detail, Mapping):
            return None
        if not all(isinstance(index, int) and 0 <= index < len(self.rows) for index in detail):
            return None
        return [(self.rows[index], detail[index]) for index in sorted(detail)]

    def _add_domain_error(self, error: DomainError) -> None:
        named = [name for name in error.fields if name in self.replicas]
        if error.code == "invalid_replicas" and named:
            self._add(named[0], [error.message])
            return
        name = FIELD_OF_ERROR_CODE.get(error.code)
        if name == "stages":
            by_index = error.fields.get("stages")
            rows = [
                (self.rows[int(index)], message)
                for index, message in (by_index.items() if isinstance(by_index, Mapping) else ())
                if 0 <= int(index) < len(self.rows)
            ]
            for row, message in rows:
                row.errors.setdefault("row", []).append(str(message))
            if rows:
                return
        if name == "policy":
            # The policy's messages start with the field they are about.
            first_word = error.message.split(" ", 1)[0]
            for item in self.policy:
                if item.name == first_word:
                    item.errors.append(error.message)
                    return
        self._add(name or "form", [error.message])
