"""`manage.py demo_story`: walk the demo through its story, on real signals.

1. Wait until the `smollm2` deployment's stable version (float32) is served by a ready
   agent (the reconciler loads it) and traffic has flowed for `--warmup` seconds.
2. Start a rollout of the bfloat16 version with a stage plan short enough to watch.
3. Print each transition as it happens; the analysis task promotes or rolls it back.

It never starts a second rollout of a candidate that already had one, so restarting
the demo resumes the story instead of repeating it. Drills (a fault injected into the
canary) are the dashboard's and the fleet API's job.
"""

import json
import time
from typing import Any

import redis
from django.core.management.base import BaseCommand, CommandError, CommandParser

from contracts.routing import routing_key
from controlplane.core.redis_clients import redis_client
from controlplane.registry.models import ModelVersion
from controlplane.rollouts import deployments
from controlplane.rollouts.models import Deployment, Rollout

# Sized for two CPU agents on one thread each: the demo traffic reaches about half a
# request a second, so the canary's first stage takes a quarter of it and analysis
# judges on a handful of samples (the statistics say "inconclusive" below that).
DEMO_STAGES = [
    {"weight": 25, "min_duration_s": 60, "min_requests": 5, "tenants": []},
    {"weight": 50, "min_duration_s": 60, "min_requests": 8, "tenants": []},
    {"weight": 75, "min_duration_s": 60, "min_requests": 10, "tenants": []},
    {"weight": 100, "min_duration_s": 45, "min_requests": 10, "tenants": []},
]
# CPU serving is slower than the GPU defaults; the relative tests still compare versions.
DEMO_POLICY = {
    "ttft_p95_max_ms": 8000.0,
    "itl_p95_max_ms": 1000.0,
    "min_samples": 5,
    "window_s": 90.0,
    "max_extensions": 6,
    "on_inconclusive": "hold",
}


class Command(BaseCommand):
    help = "Drive the demo: wait for the stable version to serve, then roll out bfloat16."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--deployment", default="smollm2")
        parser.add_argument("--candidate-label", default="q4_1-bf16")
        parser.add_argument("--warmup", type=float, default=30.0, help="seconds of traffic first")
        parser.add_argument("--poll", type=float, default=2.0)

    def handle(self, *args: Any, **options: Any) -> None:
        if options["warmup"] < 0 or options["poll"] <= 0:
            raise CommandError("--warmup must be >= 0 and --poll > 0")
        deployment = Deployment.objects.filter(name=options["deployment"]).first()
        if deployment is None:
            raise CommandError(f"No deployment {options['deployment']!r}: run seed_demo first.")
        candidate = ModelVersion.objects.filter(
            model_id=deployment.stable_version.model_id, label=options["candidate_label"]
        ).first()
        if candidate is None:
            raise CommandError(f"No version labelled {options['candidate_label']!r}.")
        client = redis_client(decode_responses=True)

        self._say(f"waiting for {deployment.name}'s stable version to be served")
        while not self._stable_served(client, deployment.name):
            time.sleep(options["poll"])
        self._say(f"stable version served; {options['warmup']:.0f} s of baseline traffic")
        time.sleep(options["warmup"])

        rollout = Rollout.objects.filter(deployment=deployment, candidate=candidate).first()
        if rollout is None:
            rollout = deployments.rollout_create(
                actor=None,
                deployment=deployment,
                candidate=candidate,
                stages=DEMO_STAGES,
                policy=DEMO_POLICY,
                reason="demo: roll out the bfloat16 build",
            )
            self._say(f"started rollout {rollout.pk}: {candidate.label} over {deployment.name}")
        else:
            self._say(f"rollout {rollout.pk} exists ({rollout.state}); following it")

        last = None
        while True:
            rollout.refresh_from_db()
            now = (rollout.state, rollout.stage_index)
            if now != last:
                weight = rollout.stage_weight
                self._say(
                    f"rollout {rollout.pk}: {rollout.state}, stage {rollout.stage_index + 1}"
                    f"/{len(rollout.stages)} (canary {weight} %)"
                )
                last = now
            time.sleep(options["poll"])

    def _stable_served(self, client: redis.Redis, deployment: str) -> bool:
        try:
            raw = client.get(routing_key(deployment))
        except redis.RedisError:
            return False
        if not raw:
            return False
        table = json.loads(raw)
        return any(version.get("endpoints") for version in table.get("versions", []))

    def _say(self, message: str) -> None:
        self.stdout.write(message)
        self.stdout.flush()
