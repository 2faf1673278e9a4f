"""Evaluation jobs call an engine with its serving secret, from its agent's load command."""

from controlplane.fleet.models import AgentCommand
from controlplane.rollouts.evaluation_jobs import _ready_engine
from tests.rollouts.test_reconciler import agent, secrets_of


def test_the_engine_measured_is_a_ready_one_whose_serving_secret_is_known(versions) -> None:
    stable, candidate = versions
    unknown = agent("gpu-0", candidate)  # first by name, but no load of it is recorded
    AgentCommand.objects.filter(agent=unknown).delete()
    known = agent("gpu-1", candidate)
    agent("gpu-2", stable)

    target = _ready_engine(candidate.pk)

    assert target is not None
    serving, admin = secrets_of(AgentCommand.objects.get(agent=known))
    assert (target.endpoint, target.serving_secret) == (known.endpoint, serving)
    assert serving not in repr(target)
    with target.client() as client:
        assert client.headers["authorization"] == f"Bearer {serving}"
    assert admin != serving
    AgentCommand.objects.filter(agent=known).delete()
    assert _ready_engine(candidate.pk) is None
