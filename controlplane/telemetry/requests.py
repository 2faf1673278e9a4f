"""The ingest handler of the requests stream (`telemetry:requests`)."""

import logging
from collections.abc import Mapping, Sequence
from typing import Protocol

from contracts.routing import RequestRecord, RoutingContractError, parse_request_record
from controlplane.core.events import publish_event, tenant_live_group
from controlplane.telemetry.streams import MalformedEntry
from controlplane.telemetry.usage import request_records_apply

logger = logging.getLogger(__name__)


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

    After the batch commits: each of VERSION_CHECKS looks at each version that had
    traffic (the rollout fast path: a canary whose recent requests breach the hard limit
    rolls back now, not at the next analysis interval), and each tenant's dashboard hears
    of new usage.
    """

    # Its entries are usage: gateways add them without MAXLEN, and ingest trims the
    # stream only below what it acknowledged (streams.StreamIngestor.trim_acknowledged).
    is_trimmed_by_ingest = True

    def parse(self, entry_id: str, fields: Mapping[str, str]) -> RequestRecord:
        try:
            return parse_request_record(fields)
        except RoutingContractError as exc:
            raise MalformedEntry(str(exc)) from exc

    def apply(self, items: Sequence[RequestRecord]) -> None:
        if request_records_apply(records=items) == 0:
            return
        for version_id in sorted({item.version_id for item in items}):
            for check in VERSION_CHECKS:
                check(version_id=version_id)
        for tenant_id in sorted({item.tenant_id for item in items}):
            publish_event(tenant_live_group(tenant_id), "usage.updated", {"tenant": tenant_id})
