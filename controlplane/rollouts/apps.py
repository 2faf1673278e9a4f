from django.apps import AppConfig


class RolloutsConfig(AppConfig):
    name = "controlplane.rollouts"
    label = "rollouts"

    def ready(self) -> None:
        from controlplane.core.state_metrics import state_metrics_add
        from controlplane.rollouts.decisions import rollout_check_hard_breach
        from controlplane.rollouts.metrics import DecisionsCollector
        from controlplane.rollouts.retention import request_samples_in_use
        from controlplane.telemetry.requests import version_check_add
        from controlplane.telemetry.retention import request_samples_in_use_add

        # Ingest's requests handler runs the hard-breach fast path after each batch.
        version_check_add(rollout_check_hard_breach)
        # Retention keeps the request samples running analyses still read.
        request_samples_in_use_add(request_samples_in_use)
        # Web's /metrics reports the decisions from their rows.
        state_metrics_add(DecisionsCollector())
