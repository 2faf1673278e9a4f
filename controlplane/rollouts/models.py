"""Deployments, rollouts, analysis runs and outgoing webhooks.

A Deployment is a public model name with its stable version and its *desired routing*
(`desired_routing`, `routing_revision`): what the reconciler makes Redis and the agents
match. Every rollout transition rewrites the desired routing and bumps the revision in
the same transaction as the state change and its audit event.
"""

from typing import Any, NotRequired, TypedDict

from django.conf import settings
from django.db import models
from django.utils import timezone


class Stage(TypedDict):
    """One stage of a rollout's plan (`Rollout.stages`), as stages.stages_validate keeps it."""

    weight: int  # percent of requests to the candidate (mirrored to it when shadow), 1-100
    min_duration_s: float
    min_requests: int
    tenants: list[str]  # tenant slugs the stage applies to; [] = every tenant
    # True: the stable version answers every request and `weight` percent of them are
    # mirrored to the candidate, whose answers are discarded. Present only when true.
    shadow: NotRequired[bool]


class DesiredRouting(TypedDict):
    """`Deployment.desired_routing`: what the reconciler makes Redis and the agents match."""

    stable_version_id: int
    canary_version_id: int | None
    canary_weight: int  # 0-100
    canary_tenants: list[str]  # [] = every tenant
    # True during a shadow stage: the canary weight is a mirror share, and the stable
    # version answers every request. Absent in rows written before shadow stages.
    canary_shadow: bool
    preload_version_ids: list[int]  # versions an agent must serve (the candidate while gating)
    # How many agents serve each of them: {str(version id): replicas}; absent for rows
    # written before replicas (one each).
    replicas: dict[str, int]


class RolloutState(models.TextChoices):
    PENDING = "pending", "Pending"
    GATING = "gating", "Gating"
    RUNNING = "running", "Running"
    PAUSED = "paused", "Paused"
    PROMOTED = "promoted", "Promoted"
    ROLLED_BACK = "rolled_back", "Rolled back"
    ABORTED = "aborted", "Aborted"
    FAILED = "failed", "Failed"


ACTIVE_STATES = frozenset(
    {RolloutState.PENDING, RolloutState.GATING, RolloutState.RUNNING, RolloutState.PAUSED}
)
FINAL_STATES = frozenset(
    {RolloutState.PROMOTED, RolloutState.ROLLED_BACK, RolloutState.ABORTED, RolloutState.FAILED}
)


# The most replicas one version of a deployment may ask for.
REPLICAS_LIMIT = 64


class Deployment(models.Model):
    # The public model name tenants call (`model` in an OpenAI request).
    name = models.CharField(max_length=100, unique=True)
    stable_version = models.ForeignKey(
        "registry.ModelVersion", on_delete=models.PROTECT, related_name="stable_deployments"
    )
    # The stable version's replicas: the autoscaler moves `stable_replicas` within the
    # bounds (controlplane/rollouts/replicas.py); without a policy it stays at the minimum.
    stable_replicas_min = models.PositiveSmallIntegerField(default=1)
    stable_replicas_max = models.PositiveSmallIntegerField(default=1)
    stable_replicas = models.PositiveSmallIntegerField(default=1)
    autoscaling = models.JSONField(default=dict, blank=True)  # autoscaling.AutoscalingPolicy
    desired_routing = models.JSONField(default=dict)  # a DesiredRouting
    # Bumped on every change of desired_routing; the routing table carries it.
    routing_revision = models.PositiveBigIntegerField(default=0)
    # The revision the reconciler last published to Redis.
    applied_revision = models.PositiveBigIntegerField(default=0)
    # Versions it needs that no agent has the memory for, each with the figures
    # (rollouts.placement.Unplaced.to_dict()); [] when every one is placed or loading.
    unplaced_versions = models.JSONField(default=list, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(stable_replicas_min__gte=1)
                & models.Q(stable_replicas_min__lte=models.F("stable_replicas_max"))
                & models.Q(stable_replicas_max__lte=REPLICAS_LIMIT)
                & models.Q(stable_replicas__gte=models.F("stable_replicas_min"))
                & models.Q(stable_replicas__lte=models.F("stable_replicas_max")),
                name="rollouts_deployment_stable_replicas_in_bounds",
            ),
        ]

    def __str__(self) -> str:
        return self.name


class RevisionSource(models.TextChoices):
    CREATE = "create", "Created"
    PROMOTE = "promote", "Promoted"
    UNDO = "undo", "Undone"


class DeploymentRevision(models.Model):
    """One change of a deployment's stable version, appended in the change's transaction.

    The latest row names the current stable version and the one before it: what an undo
    restores, and what the reconciler keeps warm for ROLLOUTS_PREVIOUS_STABLE_WARM_S.
    """

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="revisions")
    version = models.ForeignKey("registry.ModelVersion", on_delete=models.PROTECT, related_name="+")
    previous_version = models.ForeignKey(
        "registry.ModelVersion", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    source = models.CharField(max_length=20, choices=RevisionSource.choices)
    rollout = models.ForeignKey(
        "Rollout", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor_name = models.CharField(max_length=150)  # kept when the user is deleted
    reason = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-id"]  # newest first: rows are appended under the deployment's lock
        indexes = [models.Index(fields=["deployment", "-id"], name="rollouts_revision_latest")]

    def __str__(self) -> str:
        return f"{self.deployment_id}: {self.previous_version_id} -> {self.version_id}"


class Rollout(models.Model):
    deployment = models.ForeignKey(Deployment, on_delete=models.PROTECT, related_name="rollouts")
    baseline = models.ForeignKey(
        "registry.ModelVersion", on_delete=models.PROTECT, related_name="+"
    )
    candidate = models.ForeignKey(
        "registry.ModelVersion", on_delete=models.PROTECT, related_name="rollouts_as_candidate"
    )
    # [{"weight": 5, "min_duration_s": 60, "min_requests": 50, "tenants": []}, ...]
    stages = models.JSONField()  # a list of Stage
    policy = models.JSONField(default=dict)  # analysis.AnalysisPolicy fields
    required_suites = models.ManyToManyField("registry.EvalSuite", blank=True, related_name="+")
    state = models.CharField(
        max_length=20, choices=RolloutState.choices, default=RolloutState.PENDING
    )
    stage_index = models.PositiveIntegerField(default=0)
    stage_started_at = models.DateTimeField(null=True, blank=True)
    stage_extensions = models.PositiveIntegerField(default=0)
    # The state a paused rollout resumes to.
    paused_from = models.CharField(max_length=20, choices=RolloutState.choices, blank=True)
    # Why the rollout is where it is (the last transition's reason).
    state_reason = models.TextField(blank=True)
    # Why gating has not passed yet (one line per missing or failed suite).
    gate_reasons = models.JSONField(default=list, blank=True)
    # Bumped by every transition: an expected-revision check refuses stale callers.
    revision = models.PositiveIntegerField(default=0)
    attempt = models.PositiveIntegerField(default=1)
    # The candidate's replicas while it is loaded (gating and on); `canary_replicas` is
    # moved by the autoscaler within the bounds, down to 0 when its policy allows an idle
    # canary to scale to zero.
    canary_replicas_min = models.PositiveSmallIntegerField(default=1)
    canary_replicas_max = models.PositiveSmallIntegerField(default=1)
    canary_replicas = models.PositiveSmallIntegerField(default=1)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["deployment"],
                condition=models.Q(state__in=["pending", "gating", "running", "paused"]),
                name="rollouts_one_active_rollout_per_deployment",
            ),
            models.CheckConstraint(
                condition=models.Q(canary_replicas_min__gte=1)
                & models.Q(canary_replicas_min__lte=models.F("canary_replicas_max"))
                & models.Q(canary_replicas_max__lte=REPLICAS_LIMIT)
                & models.Q(canary_replicas__lte=models.F("canary_replicas_max")),
                name="rollouts_rollout_canary_replicas_in_bounds",
            ),
        ]
        indexes = [models.Index(fields=["state"]), models.Index(fields=["candidate", "state"])]

    def __str__(self) -> str:
        return f"rollout {self.pk} of {self.deployment_id}: {self.state}"

    @property
    def current_stage(self) -> Stage | None:
        if 0 <= self.stage_index < len(self.stages):
            return self.stages[self.stage_index]
        return None

    @property
    def stage_weight(self) -> int | None:
        """The current stage's canary weight (percent); None past the plan."""
        stage = self.current_stage
        return stage["weight"] if stage is not None else None

    def snapshot(self) -> dict[str, Any]:
        """The fields an audit event records before and after a transition."""
        return {
            "state": self.state,
            "stage_index": self.stage_index,
            "canary_weight": self.stage_weight
            if self.state in {RolloutState.RUNNING, RolloutState.PAUSED}
            else None,
            "revision": self.revision,
            "attempt": self.attempt,
        }


class ReplicaRole(models.TextChoices):
    STABLE = "stable", "Stable"
    CANARY = "canary", "Canary"


class ScalingDecision(models.Model):
    """A change of a deployment's desired replicas: by its autoscaling policy (no actor)
    or by an operator changing the bounds, always with the reason and the figures."""

    deployment = models.ForeignKey(
        Deployment, on_delete=models.CASCADE, related_name="scaling_decisions"
    )
    rollout = models.ForeignKey(
        Rollout, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    role = models.CharField(max_length=10, choices=ReplicaRole.choices)
    version = models.ForeignKey("registry.ModelVersion", on_delete=models.PROTECT, related_name="+")
    previous_replicas = models.PositiveSmallIntegerField()
    replicas = models.PositiveSmallIntegerField()
    reason = models.TextField()
    figures = models.JSONField(default=dict, blank=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-id"]
        indexes = [
            models.Index(fields=["deployment", "role", "-id"], name="rollouts_scaling_latest")
        ]

    def __str__(self) -> str:
        return f"{self.deployment_id} {self.role}: {self.previous_replicas} -> {self.replicas}"


class Verdict(models.TextChoices):
    PASS = "pass", "Pass"
    FAIL = "fail", "Fail"
    INCONCLUSIVE = "inconclusive", "Inconclusive"


class AnalysisRun(models.Model):
    rollout = models.ForeignKey(Rollout, on_delete=models.CASCADE, related_name="analysis_runs")
    stage_index = models.PositiveIntegerField()
    attempt = models.PositiveIntegerField(default=1)
    window_start = models.DateTimeField()
    window_end = models.DateTimeField()
    baseline = models.JSONField()  # figures: requests, errors, p50/p95 TTFT and ITL, J/token
    canary = models.JSONField()
    tests = models.JSONField(default=dict)  # p-values and statistics
    signals = models.JSONField(default=dict)  # analysis.SIGNALS -> each one's own verdict
    verdict = models.CharField(max_length=20, choices=Verdict.choices)
    reasons = models.JSONField(default=list)
    action = models.CharField(max_length=20)  # analysis.Action
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-window_end", "-id"]
        constraints = [
            # One run per analysis tick: a task delivered twice records nothing new.
            models.UniqueConstraint(
                fields=["rollout", "attempt", "window_end"], name="rollouts_one_run_per_window"
            )
        ]

    def __str__(self) -> str:
        return f"analysis of rollout {self.rollout_id} at {self.window_end}: {self.verdict}"


class WebhookEndpoint(models.Model):
    name = models.CharField(max_length=100, unique=True)
    url = models.URLField(max_length=500)
    secret = models.CharField(max_length=200)  # HMAC key; never returned by the API
    events = models.JSONField(default=list)  # event names, or ["*"]
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def wants(self, event: str) -> bool:
        return "*" in self.events or event in self.events


class DeliveryStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"


class DeliveryError(models.TextChoices):
    """Why the last attempt failed, as a category: the receiver's or resolver's own error
    text never leaves the worker (it would map internal networks for whoever reads it)."""

    TARGET_FORBIDDEN = "target_forbidden", "Target forbidden"
    DNS_ERROR = "dns_error", "DNS error"
    CONNECT_ERROR = "connect_error", "Connect error"
    TLS_ERROR = "tls_error", "TLS error"
    TIMEOUT = "timeout", "Timeout"
    TRANSPORT_ERROR = "transport_error", "Transport error"
    HTTP_3XX = "http_3xx", "HTTP 3xx"
    HTTP_4XX = "http_4xx", "HTTP 4xx"
    HTTP_5XX = "http_5xx", "HTTP 5xx"
    INTERRUPTED = "interrupted", "Interrupted"


class WebhookDelivery(models.Model):
    """An outbox row written in the transition's transaction; a Celery task sends it, and
    the sweep sends again any whose task was lost."""

    endpoint = models.ForeignKey(
        WebhookEndpoint, on_delete=models.CASCADE, related_name="deliveries"
    )
    event_id = models.UUIDField()
    event = models.CharField(max_length=100)
    payload = models.JSONField()
    status = models.CharField(
        max_length=20, choices=DeliveryStatus.choices, default=DeliveryStatus.PENDING
    )
    attempts = models.PositiveIntegerField(default=0)
    last_status_code = models.PositiveIntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=32, choices=DeliveryError.choices, blank=True)
    # When a pending delivery is due; while an attempt runs, the end of its lease.
    next_attempt_at = models.DateTimeField(default=timezone.now)
    created_at = models.DateTimeField(auto_now_add=True)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["endpoint", "event_id"], name="rollouts_one_delivery_per_event"
            )
        ]
        indexes = [
            models.Index(
                fields=["next_attempt_at"],
                condition=models.Q(status="pending"),
                name="rollouts_delivery_pending_due",
            )
        ]

    def __str__(self) -> str:
        return f"{self.event} to {self.endpoint_id}: {self.status}"
