"""The gateway's asyncio Redis client, with commands packed by hiredis rather than Python.

redis-py's asyncio connection packs every argument in Python: a requests-stream entry
(an XADD of some 25 fields) cost more CPU than the rest of the request's bookkeeping,
and on a busy gateway that CPU is taken from the requests being proxied. The sync
client already packs with hiredis (a declared dependency); this gives the asyncio
client the same, for plain `redis://` URLs (TLS and Unix-socket URLs keep redis-py's
own connection classes).
"""

from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.connection import HiredisRespSerializer
from redis.utils import HIREDIS_AVAILABLE

_SERIALIZER = HiredisRespSerializer()


class HiredisPackingConnection(aioredis.Connection):
    def pack_command(self, *args):  # type: ignore[no-untyped-def]
        return _SERIALIZER.pack(*args)

    def pack_commands(self, commands):  # type: ignore[no-untyped-def]
        return [b"".join(_SERIALIZER.pack(*command)[0] for command in commands)]


def redis_from_url(url: str, **options) -> aioredis.Redis:
    if HIREDIS_AVAILABLE and urlsplit(url).scheme == "redis":
        options["connection_class"] = HiredisPackingConnection
    return aioredis.Redis.from_url(url, **options)
