"""The ingest handler of the requests stream (`telemetry:requests`)."""

import logging
from collections.abc import Mapping, Sequence

from contracts.routing import RequestRecord, RoutingContractError, parse_request_record
from controlplane.core.events import publish_event, tenant_live_group
from controlplane.rollouts.decisions import rollout_check_hard_breach
from controlplane.telemetry.streams import MalformedEntry
from controlplane.telemetry.usage import request_records_apply

logger = logging.getLogger(__name__)


class RequestsStreamHandler:
    """Parses `RequestRecord` entries; applies a batch in one idempotent transaction.

    After the batch commits: the rollout fast path looks at each version that had
    traffic (a canary whose recent requests breach the hard limit rolls back now, not
    at the next analysis interval), and each tenant's dashboard hears of new usage.
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
            rollout_check_hard_breach(version_id=version_id)
        for tenant_id in sorted({item.tenant_id for item in items}):
            publish_event(tenant_live_group(tenant_id), "usage.updated", {"tenant": tenant_id})
