"""The ingest handler of the requests stream (`telemetry:requests`)."""

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from django.conf import settings
from django.db import DatabaseError
from prometheus_client import Counter

from contracts.routing import (
    REQUESTS_STREAM,
    RequestMacError,
    RequestRecord,
    RoutingContractError,
    parse_request_record,
    request_fields_verify,
)
from controlplane.audit.services import audit_event_record
from controlplane.core.events import publish_event, tenant_live_group
from controlplane.telemetry.streams import MalformedEntry, RefusedEntry
from controlplane.telemetry.usage import request_records_apply

logger = logging.getLogger(__name__)

REFUSED_TOTAL = Counter(
    "ingest_requests_refused_total",
    "Requests-stream entries refused before parsing: no mac, or one that does not match",
    ["reason"],
)
REFUSED_AUDIT_EVERY_S = 60.0


# What looks at a version after a batch with its traffic commits. The rollouts app adds
# its hard-breach fast path at start-up (RolloutsConfig.ready): telemetry is a floor below
# rollouts, whose analysis reads the request samples, so it does not import rollouts.
class VersionCheck(Protocol):
    def __call__(self, *, version_id: int) -> object: ...


VERSION_CHECKS: list[VersionCheck] = []


def version_check_add(check: VersionCheck) -> None:
    """Run `check(version_id=...)` after each committed batch with that version's traffic."""
    if check not in VERSION_CHECKS:
        VERSION_CHECKS.append(check)


class RequestsStreamHandler:
    """Parses `RequestRecord` entries; applies a batch in one idempotent transaction.

    An entry without a valid gateway signature (`mac`) is refused before it is parsed:
    counted in `ingest_requests_refused_total{reason}` (and as a usage gap,
    `ingest_usage_gaps_total{reason="refused"}`), logged without its fields, dropped
    like a malformed entry, and audited at most once per `audit_every_s` per process (one
    event counting every refusal since the last).

    After the batch commits: each of VERSION_CHECKS looks at each version that had
    traffic (the rollout fast path: a canary whose recent requests breach the hard limit
    rolls back now, not at the next analysis interval), and each tenant's dashboard hears
    of new usage.
    """

    # Its entries are usage: gateways add them without MAXLEN, and ingest trims the
    # stream only below what it acknowledged (streams.StreamIngestor.trim_acknowledged).
    is_trimmed_by_ingest = True

    def __init__(
        self,
        *,
        audit_every_s: float = REFUSED_AUDIT_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._audit_every_s = audit_every_s
        self._clock = clock
        self._last_audit_at: float | None = None
        self._refused_unaudited: dict[str, int] = {}  # reason -> entries not yet audited

    def parse(self, entry_id: str, fields: Mapping[str, str]) -> RequestRecord:
        try:
            request_fields_verify(fields, settings.TELEMETRY_RECORD_KEY)
        except RequestMacError as exc:
            self._refuse(entry_id, exc.reason)
            raise RefusedEntry(str(exc)) from exc
        self._audit_refused()  # what earlier refusals left unaudited, once the minute is up
        try:
            return parse_request_record(fields)
        except RoutingContractError as exc:
            raise MalformedEntry(str(exc)) from exc

    def _refuse(self, entry_id: str, reason: str) -> None:
        """Count, log (the entry id and reason only: never its fields, which can hold a
        prompt) and audit, the audit at most once per `audit_every_s` for this process."""
        REFUSED_TOTAL.labels(reason).inc()
        logger.warning(
            "refusing an unsigned or forged request entry",
            extra={"stream": REQUESTS_STREAM, "entry_id": entry_id, "reason": reason},
        )
        self._refused_unaudited[reason] = self._refused_unaudited.get(reason, 0) + 1
        self._audit_refused()

    def _audit_refused(self) -> None:
        if not self._refused_unaudited:
            return
        now = self._clock()
        if self._last_audit_at is not None and now - self._last_audit_at < self._audit_every_s:
            return
        counts = dict(sorted(self._refused_unaudited.items()))
        try:
            audit_event_record(
                actor=None,
                action="telemetry.requests_refused",
                object_type="stream",
                object_id=REQUESTS_STREAM,
                object_repr=REQUESTS_STREAM,
                after={"refused": sum(counts.values()), "by_reason": counts},
                reason="request entries without a valid gateway signature were dropped",
            )
        except DatabaseError as exc:  # kept for the next attempt; the entry is dropped anyway
            logger.warning("refused request entries not audited", extra={"error": str(exc)})
            return
        self._last_audit_at = now
        self._refused_unaudited = {}

    def apply(self, items: Sequence[RequestRecord]) -> None:
        if request_records_apply(records=items) == 0:
            return
        for version_id in sorted({item.version_id for item in items}):
            for check in VERSION_CHECKS:
                check(version_id=version_id)
        for tenant_id in sorted({item.tenant_id for item in items if not item.is_shadow}):
            publish_event(tenant_live_group(tenant_id), "usage.updated", {"tenant": tenant_id})
