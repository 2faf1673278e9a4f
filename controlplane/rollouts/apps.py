from django.apps import AppConfig


class RolloutsConfig(AppConfig):
    name = "controlplane.rollouts"
    label = "rollouts"

    def ready(self) -> None:
        from controlplane.rollouts.decisions import rollout_check_hard_breach
        from controlplane.telemetry.requests import version_check_add

        # Ingest's requests handler runs the hard-breach fast path after each batch.
        version_check_add(rollout_check_hard_breach)
