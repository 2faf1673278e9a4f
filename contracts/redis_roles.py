"""Who may touch which Redis keys: one ACL user per role, each limited to what it needs.

- `controlplane` (web, Celery worker and beat): every key except the requests stream,
  which carries tenants' prompts; no administrative commands.
- `ingest`: the three telemetry streams it consumes (heartbeats, command results,
  request records) and their bookkeeping, the live-event layer and the task queue.
- `gateway`: appends request records, reads routing tables, its rate-limit counters and
  the two channels it listens on.
- `agent:<name>`: appends heartbeats and command results (write only: it cannot read
  other agents' entries), and reads only its own command stream and command records.

Redis patterns cannot exclude a key, so "every key except K" is written as the keys that
differ from K at some position (`[^t]*`, `t[^e]*`, ...).
"""

from __future__ import annotations

from collections.abc import Iterable

from contracts.commands import RESULTS_STREAM, commands_stream
from contracts.routing import REQUESTS_STREAM, ROUTING_CHANNEL, ROUTING_KEY_PREFIX
from contracts.streams import HEARTBEATS_STREAM

CONTROLPLANE_USER = "controlplane"
INGEST_USER = "ingest"
GATEWAY_USER = "gateway"
ROLE_USERS = (CONTROLPLANE_USER, INGEST_USER, GATEWAY_USER)
AGENT_USER_PREFIX = "agent:"
GATEWAY_INVALIDATE_CHANNEL = "gateway:invalidate"

# Every role may authenticate, choose its database and check its connection.
_CONNECTION = ["+ping", "+select", "+hello", "+auth", "+client|setname", "+client|getname"]
# A service role runs ordinary commands; none may reconfigure, inspect or empty the server.
_SERVICE_COMMANDS = ["+@all", "-@dangerous", "-@admin", "+info", *_CONNECTION]
_AGENT_COMMANDS = [
    "-@all",
    *_CONNECTION,
    "+xadd",
    "+xreadgroup",
    "+xack",
    "+xgroup|create",
    "+get",
    "+set",
    "+multi",
    "+exec",
    "+discard",
]


def agent_user(agent_name: str) -> str:
    return f"{AGENT_USER_PREFIX}{agent_name}"


def keys_except(key: str) -> list[str]:
    """Patterns matching every key but `key` itself and the keys that start with it."""
    patterns = [f"{_escape(key[:index])}[^{_escape(key[index])}]*" for index in range(len(key))]
    # Proper prefixes of `key` are keys too ("telemetry", say).
    patterns += [_escape(key[:index]) for index in range(1, len(key))]
    return patterns


def _escape(text: str) -> str:
    return "".join(f"\\{char}" if char in "*?[]\\^" else char for char in text)


def role_rules(role: str, *, channels_prefix: str, celery_queue: str) -> list[str]:
    """The ACL rules (after `reset`) of a service role, without its password."""
    if role == CONTROLPLANE_USER:
        keys = [f"~{pattern}" for pattern in keys_except(REQUESTS_STREAM)]
        return [*keys, "&*", *_SERVICE_COMMANDS]
    if role == INGEST_USER:
        keys = [
            f"~{HEARTBEATS_STREAM}",
            f"~{RESULTS_STREAM}",
            f"~{REQUESTS_STREAM}",
            f"~{{{REQUESTS_STREAM}}}:*",  # its loss counters (telemetry/stream_trim.py)
            f"~{{{HEARTBEATS_STREAM}}}:*",
            f"~{{{RESULTS_STREAM}}}:*",
            *_live_events_and_tasks(channels_prefix, celery_queue),
        ]
        return [*keys, f"&{channels_prefix}*", *_SERVICE_COMMANDS]
    if role == GATEWAY_USER:
        keys = [f"~{REQUESTS_STREAM}", f"%R~{ROUTING_KEY_PREFIX}*", "~ratelimit:*"]
        channels = [f"&{ROUTING_CHANNEL}", f"&{GATEWAY_INVALIDATE_CHANNEL}"]
        return [*keys, *channels, *_SERVICE_COMMANDS]
    raise ValueError(f"unknown Redis role {role!r}")


def agent_rules(agent_name: str) -> list[str]:
    """The ACL rules (after `reset`) of one agent, without its password."""
    own = commands_stream(agent_name).removesuffix("commands")
    return [
        f"%W~{HEARTBEATS_STREAM}",
        f"%W~{RESULTS_STREAM}",
        f"~{_escape(own)}commands",
        f"~{_escape(own)}completed:*",
        *_AGENT_COMMANDS,
    ]


def _live_events_and_tasks(channels_prefix: str, celery_queue: str) -> Iterable[str]:
    # channels_redis keeps groups and channels under its prefix; a Celery producer pushes
    # onto the queue's list (and its priority lists) after reading the exchange bindings.
    yield f"~{_escape(channels_prefix)}*"
    yield f"~{_escape(celery_queue)}*"
    yield "~_kombu.binding.*"


def setuser_arguments(user: str, rules: list[str], *, password_sha256: str) -> list[str]:
    """`ACL SETUSER` arguments replacing the user entirely: a stale rule never survives."""
    return [user, "reset", "on", f"#{password_sha256}", *rules]
