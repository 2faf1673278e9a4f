"""The request samples running rollouts still read, which retention keeps past their
tenant's `retention_days` (registered with telemetry in `RolloutsConfig.ready`)."""

from datetime import timedelta

from controlplane.rollouts.models import Rollout, RolloutState
from controlplane.rollouts.stages import rollout_policy
from controlplane.telemetry.retention import SamplesInUse


def request_samples_in_use() -> list[SamplesInUse]:
    """Per running rollout, its baseline's and candidate's samples since one analysis window
    before its stage started: the stage counts the canary's requests since it started, and
    a full-weight stage compares with the baseline's window before it. A paused rollout
    restarts its stage when it resumes, so it reads nothing older."""
    running = Rollout.objects.filter(state=RolloutState.RUNNING, stage_started_at__isnull=False)
    in_use = []
    for rollout in running.only("baseline_id", "candidate_id", "stage_started_at", "policy"):
        if rollout.stage_started_at is None:  # filtered out above; this tells the type checker
            continue
        window = timedelta(seconds=rollout_policy(rollout).window_s)
        in_use.append(
            SamplesInUse(
                version_ids=(rollout.baseline_id, rollout.candidate_id),
                since=rollout.stage_started_at - window,
            )
        )
    return in_use
