"""What ingest writes from the requests stream: one sample per request, the prompts of
tenants that log them, and energy bookkeeping.

Usage itself lives in `tenants.UsageRecord`; ingest adds to it in the same transaction
that inserts the request's sample, so a sample exists exactly when its usage was counted
(a mirrored request's sample, `is_shadow`, is never usage).
The tables keep the names they had in the gateway app (moved with their data in place).
"""

from django.db import models


class RequestSample(models.Model):
    """One finished, routed request: the per-version SLO signals rollout analysis reads."""

    request_id = models.CharField(max_length=32, unique=True)  # hex uuid4 from the gateway
    tenant = models.ForeignKey(
        "tenants.Tenant", on_delete=models.PROTECT, related_name="request_samples"
    )
    version = models.ForeignKey(
        "registry.ModelVersion", on_delete=models.PROTECT, related_name="request_samples"
    )
    deployment = models.CharField(max_length=100)
    agent = models.CharField(max_length=255, blank=True)  # endpoint that served it
    endpoint_kind = models.CharField(max_length=20)  # chat, completions, embeddings
    status = models.PositiveSmallIntegerField()
    # contracts.routing.is_server_fault: 5xx, the agent's or the gateway's fault; never a
    # request's own (4xx). The canary analysis and the fast path read this.
    is_error = models.BooleanField()
    error_code = models.CharField(max_length=64, blank=True, default="")  # why, when it failed
    is_stream = models.BooleanField()
    ttft_s = models.FloatField(null=True)  # streamed responses only
    itl_mean_s = models.FloatField(null=True)
    itl_p95_s = models.FloatField(null=True)
    e2e_s = models.FloatField()
    prompt_tokens = models.PositiveIntegerField()
    completion_tokens = models.PositiveIntegerField()
    finished_at = models.DateTimeField()
    # A copy mirrored to a shadow version (its answer went to no one): a sample of that
    # version for the canary analysis, never usage, energy or a tenant's request count.
    is_shadow = models.BooleanField(default=False)

    class Meta:
        db_table = "gateway_requestsample"
        ordering = ["-finished_at", "-id"]
        indexes = [
            models.Index(fields=["version", "finished_at"], name="gateway_req_version_cb2669_idx"),
            models.Index(fields=["agent", "finished_at"], name="gateway_req_agent_6ad60b_idx"),
        ]

    def __str__(self) -> str:
        return self.request_id


class PromptRecord(models.Model):
    """A prompt and its completion, kept only for tenants whose policy says so."""

    request_id = models.CharField(max_length=32, unique=True)
    tenant = models.ForeignKey(
        "tenants.Tenant", on_delete=models.CASCADE, related_name="prompt_records"
    )
    version = models.ForeignKey(
        "registry.ModelVersion", on_delete=models.PROTECT, related_name="prompt_records"
    )
    prompt = models.TextField()
    completion = models.TextField()
    finished_at = models.DateTimeField()

    class Meta:
        db_table = "gateway_promptrecord"
        ordering = ["-finished_at", "-id"]
        indexes = [
            models.Index(fields=["tenant", "finished_at"], name="gateway_pro_tenant__042579_idx")
        ]

    def __str__(self) -> str:
        return self.request_id


class EnergyAllocation(models.Model):
    """One measured energy interval of one agent, attributed once to tenants by tokens.

    `source_key` names the measurement (e.g. the fleet sample's id), so attributing the
    same interval twice is refused by the unique constraint instead of double counting.
    """

    source_key = models.CharField(max_length=200, unique=True)
    agent = models.CharField(max_length=255)  # endpoint, as in RequestSample.agent
    interval_start = models.DateTimeField()
    interval_end = models.DateTimeField()
    energy_joules = models.FloatField()
    attributed_joules = models.FloatField()  # == energy_joules when any tokens were served
    tokens = models.PositiveBigIntegerField()
    shares = models.JSONField()  # [{"tenant_id", "version_id", "tokens", "joules"}]
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "gateway_energyallocation"
        ordering = ["-interval_start", "-id"]

    def __str__(self) -> str:
        return self.source_key
