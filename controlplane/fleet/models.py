"""The fleet: agents (one per accelerator), their 10-second rollups, and commands sent to them."""

from typing import Any

from django.conf import settings
from django.db import models

# Rollup bucket width. Changing it makes older rows incomparable; it is not a setting.
ROLLUP_SECONDS = 10


class AgentState(models.TextChoices):
    IDLE = "idle", "Idle"
    LOADING = "loading", "Loading"
    WARMING = "warming", "Warming"
    READY = "ready", "Ready"
    DRAINING = "draining", "Draining"
    FAILED = "failed", "Failed"
    # Decided by ingest, never reported: no heartbeat for MISSED_HEARTBEATS_FOR_LOST intervals.
    LOST = "lost", "Lost"


class Agent(models.Model):
    name = models.CharField(max_length=63, unique=True)
    host = models.CharField(max_length=255)
    endpoint = models.CharField(max_length=255, blank=True)  # the serving engine, "" when none
    ports = models.JSONField(default=list, blank=True)
    advertise_host = models.CharField(max_length=253, blank=True)  # how its engines are reached
    # The URLs its engines may serve at (advertise host x ports), set by registration only:
    # a heartbeat naming any other endpoint is refused.
    endpoints = models.JSONField(default=list, blank=True)
    # The endpoint whose engine last proved (GET /identity) that it holds the admin secret of
    # the load command named here: routed without being challenged again.
    verified_endpoint = models.CharField(max_length=255, blank=True)
    verified_load_command_id = models.CharField(max_length=32, blank=True)
    inventory = models.JSONField(default=dict, blank=True)  # accelerator, memory, driver, CPU
    accelerator = models.CharField(max_length=200, blank=True)  # inventory["accelerator"]
    energy_source = models.CharField(max_length=20, blank=True)  # nvml, rapl or estimate
    state = models.CharField(
        max_length=20, choices=AgentState.choices, default=AgentState.IDLE, db_index=True
    )
    detail = models.TextField(blank=True)  # why it failed or was lost
    # Its engine's last failure as the agent reports it (contracts.streams.EngineError),
    # until an engine next serves there: a reason code (EngineFailure) and its message.
    engine_error = models.CharField(max_length=20, blank=True)
    engine_error_message = models.CharField(max_length=500, blank=True)
    loaded_version = models.ForeignKey(
        "registry.ModelVersion",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    loaded_digest = models.CharField(max_length=64, blank=True)
    # The latest heartbeat's figures (contracts.streams.Heartbeat.figures()).
    figures = models.JSONField(default=dict, blank=True)
    # When ingest last heard of it (the Redis entry's time), and the agent's own send time and
    # sequence number of that heartbeat (which orders heartbeats applied out of order).
    # Not indexed: every heartbeat changes it, and an index on it would make every one of
    # those updates write all the table's indexes (no HOT update); the lost-agent check
    # reads the whole (small) table anyway.
    last_seen = models.DateTimeField(null=True, blank=True)
    last_sent_at = models.DateTimeField(null=True, blank=True)
    last_seq = models.PositiveBigIntegerField(default=0)
    registered_at = models.DateTimeField()
    registered_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Set at enrolment: the agent's own service account (its API token belongs to it; only it
    # registers this name) and the SHA-256 of its Redis password (its ACL user's, re-applied
    # by `manage.py redis_users`).
    account = models.OneToOneField(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="fleet_agent",
    )
    redis_password_hash = models.CharField(max_length=64, blank=True)
    enrolled_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def snapshot(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "host": self.host,
            "endpoint": self.endpoint,
            "loaded_version_id": self.loaded_version_id,
        }


class AgentSample(models.Model):
    """One agent over one 10-second bucket.

    Every column merges with min, max or "latest by sent_at", so applying a heartbeat twice,
    or two batches in either order, gives the same row. Sums over the bucket (energy, tokens,
    requests) are differences of the agent's cumulative totals: see selectors.agent_history.
    """

    # Indexed by the unique (agent, bucket_start) constraint; a second index would only
    # slow the upserts ingest makes for every heartbeat.
    agent = models.ForeignKey(
        Agent, on_delete=models.CASCADE, related_name="samples", db_index=False
    )
    bucket_start = models.DateTimeField()
    first_sent_at = models.DateTimeField()
    last_sent_at = models.DateTimeField()
    # Latest values (by last_sent_at).
    state = models.CharField(max_length=20, choices=AgentState.choices)
    version_id = models.BigIntegerField(null=True, blank=True)
    energy_source = models.CharField(max_length=20)
    # Peaks over the bucket.
    running_max = models.PositiveIntegerField()
    waiting_max = models.PositiveIntegerField()
    kv_cache_usage_max = models.FloatField()
    tokens_per_second_max = models.FloatField()
    power_watts_max = models.FloatField()
    ttft_p95_max_s = models.FloatField(null=True, blank=True)
    itl_p95_max_s = models.FloatField(null=True, blank=True)
    # Cumulative totals: lowest and highest seen in the bucket.
    energy_joules_min = models.FloatField()
    energy_joules_max = models.FloatField()
    generated_tokens_total_min = models.BigIntegerField()
    generated_tokens_total_max = models.BigIntegerField()
    prompt_tokens_total_min = models.BigIntegerField()
    prompt_tokens_total_max = models.BigIntegerField()
    requests_ok_total_min = models.BigIntegerField()
    requests_ok_total_max = models.BigIntegerField()
    requests_failed_total_min = models.BigIntegerField()
    requests_failed_total_max = models.BigIntegerField()

    class Meta:
        ordering = ["agent", "bucket_start"]
        constraints = [
            models.UniqueConstraint(
                fields=["agent", "bucket_start"], name="fleet_sample_unique_agent_bucket"
            )
        ]
        indexes = [models.Index(fields=["bucket_start"], name="fleet_sample_bucket_idx")]

    def __str__(self) -> str:
        return f"{self.agent_id}@{self.bucket_start.isoformat()}"


class CommandKind(models.TextChoices):
    LOAD = "load", "Load version"
    DRAIN = "drain", "Drain"
    UNLOAD = "unload", "Unload"
    FAULTS = "faults", "Set fault injection"


class CommandStatus(models.TextChoices):
    PENDING = "pending", "Pending"  # in the agent's stream, not read yet
    ACCEPTED = "accepted", "Accepted"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    REJECTED = "rejected", "Rejected"


FINAL_COMMAND_STATUSES = frozenset(
    {CommandStatus.SUCCEEDED, CommandStatus.FAILED, CommandStatus.REJECTED}
)


class AgentCommand(models.Model):
    command_id = models.CharField(max_length=32, unique=True)  # uuid4 hex, also in the stream
    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="commands")
    kind = models.CharField(max_length=20, choices=CommandKind.choices)
    payload = models.JSONField(default=dict, blank=True)
    version = models.ForeignKey(
        "registry.ModelVersion",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    status = models.CharField(
        max_length=20, choices=CommandStatus.choices, default=CommandStatus.PENDING, db_index=True
    )
    detail = models.TextField(blank=True)
    reason = models.TextField(blank=True)
    stream_entry_id = models.CharField(max_length=40, blank=True)
    issued_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    accepted_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.kind} {self.command_id} -> {self.agent_id}"


class AgentEnrolment(models.Model):
    """A one-time token that lets one agent name enrol (or enrol again, rotating its
    credentials). Only the token's SHA-256 is stored."""

    agent_name = models.CharField(max_length=63, db_index=True)
    token_hash = models.CharField(max_length=64, unique=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"enrolment of {self.agent_name}"
