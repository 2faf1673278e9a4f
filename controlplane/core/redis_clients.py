"""The control plane's Redis clients, made in one place, with their timeouts in settings.

- `redis_client()`: short commands from any process (routing tables, agent commands,
  probes, the demo story): `REDIS_SOCKET_TIMEOUT_S` (5 s) for a reply,
  `REDIS_CONNECT_TIMEOUT_S` (2 s) to connect.
- `stream_reader(url)`: ingest's: replies decoded by hiredis (in C), bytes that are not
  UTF-8 replaced by U+FFFD (so such an entry is refused as malformed rather than failing
  every read of its batch), `REDIS_STREAM_TIMEOUT_S` (10 s) for blocking reads.
- `async_redis_client(url)`: the gateway's asyncio client, failing fast
  (`GATEWAY_REDIS_TIMEOUT_S`, 2 s: a request waits on it), its commands packed by hiredis.
- `async_pubsub_client(url)`: a subscription waits for messages, so no reply timeout;
  a health check every 15 s finds a dead connection.

Each takes the URL of its role's Redis user from settings unless given one: REDIS_URL,
INGEST_REDIS_URL for the stream reader, GATEWAY_REDIS_URL for the gateway's clients.
"""

from typing import Any
from urllib.parse import urlsplit

import redis
import redis.asyncio as aioredis
from django.conf import settings
from redis.connection import HiredisRespSerializer
from redis.utils import HIREDIS_AVAILABLE

_SERIALIZER = HiredisRespSerializer()


class HiredisPackingConnection(aioredis.Connection):
    """redis-py's asyncio connection packs every argument in Python: a requests-stream
    entry (an XADD of some 25 fields) cost the gateway more CPU than the rest of the
    request's bookkeeping. The sync client already packs with hiredis; this does the same
    for plain `redis://` URLs (TLS and Unix sockets keep redis-py's own classes)."""

    def pack_command(self, *args):
        return _SERIALIZER.pack(*args)

    def pack_commands(self, commands):
        return [b"".join(_SERIALIZER.pack(*command)[0] for command in commands)]


def redis_client(
    *, url: str | None = None, decode_responses: bool = False, timeout_s: float | None = None
) -> redis.Redis:
    return redis.Redis.from_url(
        url or settings.REDIS_URL,
        socket_timeout=timeout_s or settings.REDIS_SOCKET_TIMEOUT_S,
        socket_connect_timeout=min(
            timeout_s or settings.REDIS_CONNECT_TIMEOUT_S, settings.REDIS_CONNECT_TIMEOUT_S
        ),
        decode_responses=decode_responses,
    )


def stream_reader(url: str | None = None) -> redis.Redis:
    return redis.Redis.from_url(
        url or settings.INGEST_REDIS_URL,
        socket_timeout=settings.REDIS_STREAM_TIMEOUT_S,
        socket_connect_timeout=settings.REDIS_CONNECT_TIMEOUT_S,
        decode_responses=True,
        encoding_errors="replace",
    )


def async_redis_client(url: str | None = None, **options: Any) -> aioredis.Redis:
    url = url or settings.GATEWAY_REDIS_URL
    options.setdefault("socket_timeout", settings.GATEWAY_REDIS_TIMEOUT_S)
    options.setdefault("socket_connect_timeout", min(1.0, settings.GATEWAY_REDIS_TIMEOUT_S))
    if HIREDIS_AVAILABLE and urlsplit(url).scheme == "redis":
        options["connection_class"] = HiredisPackingConnection
    return aioredis.Redis.from_url(url, **options)


def async_pubsub_client(url: str | None = None) -> aioredis.Redis:
    return aioredis.Redis.from_url(
        url or settings.REDIS_URL,
        socket_connect_timeout=settings.REDIS_CONNECT_TIMEOUT_S,
        health_check_interval=15,
    )


def reply_text(value: Any) -> str:
    # Undecodable bytes become U+FFFD: an entry that cannot be decoded must still be
    # parsed (and refused), or it would come back forever.
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
