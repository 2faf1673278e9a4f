"""Evaluation jobs call an engine with its serving secret, from its agent's load command,
at an endpoint the reconciler verified."""

from controlplane.fleet.models import Agent, AgentCommand
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


def test_an_endpoint_not_verified_for_the_engines_load_is_not_measured(versions) -> None:
    _, candidate = versions
    unverified = agent("gpu-0", candidate)
    Agent.objects.filter(pk=unverified.pk).update(verified_endpoint="")
    assert _ready_engine(candidate.pk) is None
    verified = agent("gpu-1", candidate)
    target = _ready_engine(candidate.pk)
    assert target is not None
    assert target.endpoint == verified.endpoint
