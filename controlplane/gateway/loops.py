"""The gateway's background work, beside the requests: routing tables and key grants
kept fresh (pub/sub messages, and a periodic refresh in case one is lost), the spool
replayed into the requests stream, and API keys' last-used times written.

Every loop ends at its next turn once `stopping` is set, cancelled or not.
"""

import asyncio
import contextlib
import logging

import redis
import redis.asyncio as aioredis
from django.conf import settings

from contracts.routing import ROUTING_CHANNEL
from controlplane.gateway.caches import KeyCache, RoutingCache
from controlplane.gateway.recorder import (
    KeyUses,
    RequestsStreamFull,
    keys_touch,
    spooled_entries_write,
)
from controlplane.gateway.spool import Spool
from controlplane.tenants.services import INVALIDATE_CHANNEL, api_key_touch

logger = logging.getLogger(__name__)

KEY_TOUCH_INTERVAL_S = 60.0  # ApiKey.last_used_at: at most one write a minute per key
KEY_TOUCH_FLUSH_S = 1.0


class GatewayLoops:
    def __init__(
        self,
        *,
        redis_client: aioredis.Redis,
        pubsub_redis: aioredis.Redis,
        sync_redis: redis.Redis,
        routing: RoutingCache,
        keys: KeyCache,
        spool: Spool,
        key_uses: KeyUses,
    ) -> None:
        self.redis = redis_client
        self.pubsub_redis = pubsub_redis
        self.sync_redis = sync_redis  # the spool's replay, in a worker thread
        self.routing = routing
        self.keys = keys
        self.spool = spool
        self.key_uses = key_uses
        self.stopping = asyncio.Event()

    def start(self) -> list[asyncio.Task]:
        return [
            asyncio.create_task(self.listen()),
            asyncio.create_task(self.refresh_periodically()),
            asyncio.create_task(self.replay_spool_periodically()),
            asyncio.create_task(self.touch_keys_periodically()),
        ]

    async def pause(self, seconds: float) -> None:
        """Sleep, or return as soon as the gateway stops."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), timeout=seconds)

    async def listen(self) -> None:
        backoff = 0.5
        while not self.stopping.is_set():
            try:
                async with self.pubsub_redis.pubsub() as pubsub:
                    await pubsub.subscribe(ROUTING_CHANNEL, INVALIDATE_CHANNEL)
                    # Catch up on what changed while we were not listening.
                    await self.routing.refresh_all(self.redis)
                    self.keys.invalidate("all")
                    backoff = 0.5
                    async for message in pubsub.listen():
                        if message.get("type") != "message":
                            continue
                        channel = message["channel"]
                        channel = channel.decode() if isinstance(channel, bytes) else channel
                        data = message["data"]
                        data = data.decode() if isinstance(data, bytes) else str(data)
                        if channel == ROUTING_CHANNEL:
                            await self.routing.refresh_one(self.redis, data)
                        else:
                            self.keys.invalidate(data)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self.stopping.is_set():
                    return
                logger.warning("gateway pub/sub lost; reconnecting", extra={"error": str(exc)})
                await self.pause(backoff)
                backoff = min(backoff * 2, 10.0)

    async def refresh_periodically(self) -> None:
        while not self.stopping.is_set():
            await self.pause(settings.GATEWAY_ROUTING_REFRESH_S)
            try:
                await self.routing.refresh_all(self.redis)
            except (redis.RedisError, OSError) as exc:
                logger.warning("routing refresh failed", extra={"error": str(exc)})

    def write_entries(self, entries: list[dict[str, str]]) -> None:
        spooled_entries_write(self.sync_redis, entries)

    async def replay_spool_periodically(self) -> None:
        while not self.stopping.is_set():
            try:
                if self.spool.size_bytes():
                    await asyncio.to_thread(self.spool.replay, self.write_entries)
            except asyncio.CancelledError:
                raise
            except RequestsStreamFull:
                pass  # the batcher logs when the stream fills and when it drains
            except Exception as exc:
                logger.warning("spool replay failed; will retry", extra={"error": str(exc)})
            await self.pause(settings.GATEWAY_SPOOL_RETRY_S)

    async def touch_keys(self) -> None:
        used = self.key_uses.take()
        if used:
            await asyncio.to_thread(keys_touch, used, api_key_touch)

    async def touch_keys_periodically(self) -> None:
        while not self.stopping.is_set():
            await self.pause(KEY_TOUCH_FLUSH_S)
            try:
                await self.touch_keys()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("key last-used times not written", extra={"error": str(exc)})
