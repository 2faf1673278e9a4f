"""The ingest handler of the requests stream (`telemetry:requests`)."""

from collections.abc import Mapping, Sequence

from contracts.routing import RequestRecord, RoutingContractError, parse_request_record
from controlplane.core.streams import MalformedEntry
from controlplane.gateway.services import request_records_apply


class RequestsStreamHandler:
    """Parses `RequestRecord` entries; applies a batch in one idempotent transaction."""

    def parse(self, entry_id: str, fields: Mapping[str, str]) -> RequestRecord:
        try:
            return parse_request_record(fields)
        except RoutingContractError as exc:
            raise MalformedEntry(str(exc)) from exc

    def apply(self, items: Sequence[RequestRecord]) -> None:
        request_records_apply(records=items)
