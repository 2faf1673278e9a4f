"""Which spare agent a version goes to: one whose memory holds it (docs/capacity.md).

An agent offers `memory_offered_bytes` (its device's memory, capped by the operator); a
version needs its footprint (`ModelVersion.footprint`, contracts/capacity.py). A version
fits an agent when, beside the engines it already runs (a loaded engine keeps serving
until its replacement is warm, so a swap briefly holds both):

- the agent's engines need no more than it offers, and
- every engine on its device (agents sharing a GPU, or CPU agents sharing a host) needs
  no more than the device's memory.

Of the agents it fits, the one that offers least takes it (the large ones stay free for
large versions). A version whose footprint is unknown goes to the first spare agent, as
before footprints. When none fits, the reason names the figures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from contracts.capacity import footprint_describe, footprint_total, gib
from controlplane.fleet.inventory import device_key, memory_offered, memory_total
from controlplane.fleet.models import Agent


@dataclass(frozen=True, slots=True)
class Unplaced:
    """Why a version has no agent: every figure an operator needs to act on it."""

    version_id: int
    needed_bytes: int
    largest_offer_bytes: int
    largest_agent: str
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "version_id": self.version_id,
            "needed_bytes": self.needed_bytes,
            "largest_offer_bytes": self.largest_offer_bytes,
            "largest_agent": self.largest_agent,
            "message": self.message,
        }


@dataclass(frozen=True, slots=True)
class AgentMemory:
    """What each agent offers, its device's memory and the agents sharing that device:
    fixed while a pass runs, so a pass over many deployments reads it once."""

    offered: dict[int, int]  # agent id -> bytes it offers its engines
    total: dict[int, int]  # agent id -> bytes of its device
    device: dict[int, str]  # agent id -> device key
    on_device: dict[str, list[int]]  # device key -> the ids of the agents on it

    @classmethod
    def of(cls, agents: Iterable[Agent]) -> AgentMemory:
        memory = cls(offered={}, total={}, device={}, on_device={})
        for agent in agents:
            device = device_key(host=agent.host, inventory=agent.inventory)
            memory.offered[agent.id] = memory_offered(agent.inventory)
            memory.total[agent.id] = memory_total(agent.inventory)
            memory.device[agent.id] = device
            memory.on_device.setdefault(device, []).append(agent.id)
        return memory


class Placement:
    """The fleet's memory as one reconcile pass sees it: what each agent's engines need
    (its loaded version, and loads sent to it and not finished), and what each device has."""

    def __init__(
        self,
        *,
        agents: Iterable[Agent],
        footprints: Mapping[int, Any],
        engines: Mapping[int, set[int]],
        memory: AgentMemory | None = None,
    ) -> None:
        """`footprints`: version id -> stored footprint; `engines`: agent id -> the version
        ids its engines serve or are loading; `memory`: the agents' (read from `agents`
        when not given)."""
        self._footprints = footprints
        self._engines = {agent_id: set(versions) for agent_id, versions in engines.items()}
        self._memory = memory if memory is not None else AgentMemory.of(agents)

    def need(self, version_id: int | None) -> int:
        return (footprint_total(self._footprints.get(version_id)) or 0) if version_id else 0

    def _agent_need(self, agent_id: int) -> int:
        return sum(self.need(version_id) for version_id in self._engines.get(agent_id, ()))

    def _room(self, agent: Agent) -> int:
        """What a new engine on `agent` may take, beside the engines there now."""
        memory = self._memory
        if agent.id in memory.device:
            offered, total = memory.offered[agent.id], memory.total[agent.id]
            sharing = memory.on_device[memory.device[agent.id]]
        else:  # not among the agents it was made for
            offered, total = memory_offered(agent.inventory), memory_total(agent.inventory)
            device = device_key(host=agent.host, inventory=agent.inventory)
            sharing = [*memory.on_device.get(device, []), agent.id]
        own = offered - self._agent_need(agent.id)
        return min(own, total - sum(self._agent_need(other) for other in sharing))

    def offered(self, agent: Agent) -> int:
        """The bytes `agent` offers its engines."""
        offered = self._memory.offered.get(agent.id)
        return memory_offered(agent.inventory) if offered is None else offered

    def choose(
        self,
        version_id: int,
        spare: list[Agent],
        *,
        preference: Callable[[Agent], tuple[Any, ...]] | None = None,
    ) -> tuple[Agent | None, Unplaced | None]:
        """The spare agent to load `version_id` on, or why none will do: of those it fits,
        the first by `preference` (a key: lowest first), then the one that offers least (a
        stable sort: among equals, the first spare one). The first that fits is the one,
        without reckoning the room of the rest. A version whose footprint is unknown goes
        to the first spare agent by `preference`."""
        if not spare:
            return None, None
        footprint = self._footprints.get(version_id)
        needed = footprint_total(footprint)
        if needed is None or footprint is None:
            return (spare[0] if preference is None else min(spare, key=preference)), None
        ordered = sorted(spare, key=self.offered)
        if preference is not None:
            ordered.sort(key=preference)  # stable: the least offer first among equals
        for chosen in ordered:
            if self._room(chosen) >= needed:
                self._engines.setdefault(chosen.id, set()).add(version_id)
                return chosen, None
        largest = max(spare, key=lambda agent: (self._room(agent), agent.name))
        offer, room = self.offered(largest), max(self._room(largest), 0)
        message = (
            f"version {version_id} needs {footprint_describe(footprint)}; "
            f"largest spare agent {largest.name} offers {gib(offer)}"
        )
        if room < offer:
            message += f", of which {gib(room)} is free beside the engines on its device"
        return None, Unplaced(
            version_id=version_id,
            needed_bytes=needed,
            largest_offer_bytes=room,
            largest_agent=largest.name,
            message=message,
        )
