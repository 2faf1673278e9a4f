"""Refused agent traffic: commands an agent would not run, heartbeats and results ingest
would not take. Each refusal is counted; each agent's are audited at most once a minute
(the first in a minute is recorded with what is pending; Prometheus has every one).
"""

from __future__ import annotations

import logging
import time
from collections import Counter as Tally
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta

from django.db import DatabaseError
from django.utils import timezone
from prometheus_client import Counter

from controlplane.audit.models import AuditEvent
from controlplane.audit.services import audit_event_record

logger = logging.getLogger(__name__)

COMMANDS_REFUSED_TOTAL = Counter(
    "fleet_commands_refused_total",
    "Commands agents refused unrun (unsigned, badly signed, expired, untrusted release key), "
    "and results for commands the control plane never sent",
    ["reason"],
)
AUDIT_EVERY = timedelta(seconds=60)
# Names remembered by a stream's refusals (forged entries can name any agent).
MAX_REMEMBERED_AGENTS = 10_000


def agent_refusals_audit(
    *,
    action: str,
    agent_name: str,
    by_reason: Mapping[str, int],
    detail: str,
    now: datetime | None = None,
) -> bool:
    """Audit `agent_name`'s refusals unless an `action` event of it is under a minute old;
    whether it did. Call it inside the transaction that decided the refusals, if any."""
    now = now or timezone.now()
    is_recent = AuditEvent.objects.filter(
        action=action,
        object_type="agent",
        object_id=agent_name,
        created_at__gte=now - AUDIT_EVERY,
    ).exists()
    if is_recent:
        return False
    counts = dict(sorted(by_reason.items()))
    audit_event_record(
        actor=None,
        action=action,
        object_type="agent",
        object_id=agent_name,
        object_repr=agent_name,
        after={
            "reason": max(counts, key=lambda reason: counts[reason]),
            "refused": sum(counts.values()),
            "by_reason": counts,
        },
        reason=detail,
    )
    return True


class StreamRefusals:
    """One ingest stream's refused entries: counted in `counter{reason}`, audited as
    `action` at most once per agent per minute. Between audits nothing is asked of the
    database, so a flood of forged entries costs it one query per agent per minute."""

    def __init__(
        self,
        *,
        action: str,
        counter: Counter,
        detail: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._action = action
        self._counter = counter
        self._detail = detail
        self._clock = clock
        self._pending: dict[str, Tally[str]] = {}
        self._checked_at: dict[str, float] = {}

    def refuse(self, agent_name: str, reason: str) -> None:
        self._counter.labels(reason).inc()
        self._pending.setdefault(agent_name, Tally())[reason] += 1
        now = self._clock()
        checked_at = self._checked_at.get(agent_name)
        if checked_at is not None and now - checked_at < AUDIT_EVERY.total_seconds():
            return
        try:
            agent_refusals_audit(
                action=self._action,
                agent_name=agent_name,
                by_reason=self._pending[agent_name],
                detail=self._detail,
            )
        except DatabaseError as exc:  # kept for the next refusal; the entry is dropped anyway
            logger.warning("refusals not audited", extra={"error": str(exc)})
            return
        if len(self._checked_at) >= MAX_REMEMBERED_AGENTS:
            self._checked_at.clear()
        self._checked_at[agent_name] = now
        del self._pending[agent_name]
