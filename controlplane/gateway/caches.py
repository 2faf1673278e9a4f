"""In-memory key grants and routing tables: no database or Redis read per request.

Key grants come from the database on first use (one query, in a worker thread) and stay
for `ttl_s`; a stale grant is served once more while a background lookup refreshes it.
Unknown keys are remembered for a few seconds in a small LRU of their own.
Messages on `gateway:invalidate` drop grants at once (a revoked key, changed limits).
Routing tables come from Redis: all of them at start and every `refresh_s`, one of them
when `routing:changed` names it.
"""

import asyncio
import hashlib
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from hashlib import blake2b

import redis.asyncio as aioredis
from asgiref.sync import sync_to_async
from django.db import close_old_connections

from contracts.routing import (
    ROUTING_INDEX_KEY,
    Affinity,
    RoutingContractError,
    RoutingTable,
    VersionRoute,
    parse_routing_table,
    routing_key,
)
from controlplane.gateway.selectors import KeyGrant, key_grant_for_raw_key

logger = logging.getLogger(__name__)

NEGATIVE_TTL_S = 5.0
MAX_GRANTS = 100_000  # keys that exist: bounded by the keys tenants hold
MAX_UNKNOWN = 10_000  # keys that do not: anyone can make up more, so a separate, small LRU


def _lookup(raw_key: str) -> KeyGrant | None:
    close_old_connections()
    try:
        return key_grant_for_raw_key(raw_key)
    finally:
        close_old_connections()


class KeyCache:
    """Grants of real keys, and a short memory of unknown ones, kept apart: a flood of
    made-up keys fills only the small unknown-key LRU and never evicts a grant."""

    def __init__(self, *, ttl_s: float, lookup: Callable[[str], KeyGrant | None] = _lookup) -> None:
        self.ttl_s = ttl_s
        self._lookup = sync_to_async(lookup, thread_sensitive=False)
        # sha256(raw key) -> (fresh until, grant), least recently used first
        self._grants: OrderedDict[str, tuple[float, KeyGrant]] = OrderedDict()
        self._unknown: OrderedDict[str, float] = OrderedDict()  # sha256 -> unknown until
        self._loading: dict[str, asyncio.Future[KeyGrant | None]] = {}

    async def get(self, raw_key: str, *, may_look_up: bool = True) -> KeyGrant | None:
        """The key's grant, or None: unknown, revoked, expired, or (with `may_look_up`
        False) not in memory, when the database must not be asked."""
        digest = hashlib.sha256(raw_key.encode()).hexdigest()
        now = time.monotonic()
        entry = self._grants.get(digest)
        if entry is not None:
            self._grants.move_to_end(digest)
            fresh_until, grant = entry
            if fresh_until > now:
                return self._live(grant)
            if fresh_until + self.ttl_s > now:
                if may_look_up:
                    self._load(raw_key, digest)  # refresh in the background, serve the stale
                return self._live(grant)
        if self._unknown.get(digest, 0.0) > now or not may_look_up:
            return None
        return await asyncio.shield(self._load(raw_key, digest))

    @staticmethod
    def _live(grant: KeyGrant) -> KeyGrant | None:
        if grant.expires_at is not None and grant.expires_at <= time.time():
            return None
        return grant

    def _load(self, raw_key: str, digest: str) -> "asyncio.Future[KeyGrant | None]":
        future = self._loading.get(digest)
        if future is None:
            future = asyncio.ensure_future(self._fetch(raw_key, digest))
            self._loading[digest] = future
        return future

    async def _fetch(self, raw_key: str, digest: str) -> KeyGrant | None:
        try:
            grant = await self._lookup(raw_key)
            now = time.monotonic()
            if grant is None:
                self._grants.pop(digest, None)
                self._unknown[digest] = now + NEGATIVE_TTL_S
                self._unknown.move_to_end(digest)
                while len(self._unknown) > MAX_UNKNOWN:
                    self._unknown.popitem(last=False)
                return None
            self._unknown.pop(digest, None)
            self._grants[digest] = (now + self.ttl_s, grant)
            self._grants.move_to_end(digest)
            while len(self._grants) > MAX_GRANTS:
                self._grants.popitem(last=False)
            return self._live(grant)
        finally:
            self._loading.pop(digest, None)

    def invalidate(self, message: str) -> None:
        """ "all", or "tenant:<id>" (also forgets unknown keys: one may just have been made)."""
        self._unknown.clear()
        if message == "all" or not message.startswith("tenant:"):
            self._grants.clear()
            return
        try:
            tenant_id = int(message.split(":", 1)[1])
        except ValueError:
            self._grants.clear()
            return
        for digest, (_, grant) in list(self._grants.items()):
            if grant.tenant_id == tenant_id:
                self._grants.pop(digest, None)


class RoutingCache:
    def __init__(self) -> None:
        self.tables: dict[str, RoutingTable] = {}
        self.by_model: dict[str, str] = {}

    def _index(self) -> None:
        by_model: dict[str, str] = {}
        for name in sorted(self.tables):
            model = self.tables[name].model
            if model in by_model:
                logger.warning(
                    "two deployments serve one model; the first wins",
                    extra={"model": model, "kept": by_model[model], "ignored": name},
                )
                continue
            by_model[model] = name
        self.by_model = by_model

    def is_servable(self, deployment: str, tenant_slug: str | None) -> bool:
        table = self.tables.get(deployment)
        if table is None:
            return False
        weights = table.weights_for(tenant_slug)
        return any(weights.get(v.version_id, 0) > 0 and v.endpoints for v in table.versions)

    @staticmethod
    def _parse(name: str, raw: bytes | str | None) -> RoutingTable | None:
        if raw is None:
            return None
        try:
            return parse_routing_table(raw)
        except RoutingContractError as exc:
            logger.error("unreadable routing table", extra={"deployment": name, "error": str(exc)})
            return None

    async def refresh_all(self, client: aioredis.Redis) -> None:
        names = sorted(
            n.decode() if isinstance(n, bytes) else n
            for n in await client.smembers(ROUTING_INDEX_KEY)
        )
        raws = await client.mget([routing_key(name) for name in names]) if names else []
        tables = {}
        for name, raw in zip(names, raws, strict=True):
            table = self._parse(name, raw)
            if table is not None:
                tables[name] = table
        self.tables = tables
        self._index()

    async def refresh_one(self, client: aioredis.Redis, deployment: str) -> None:
        table = self._parse(deployment, await client.get(routing_key(deployment)))
        tables = dict(self.tables)
        if table is None:
            tables.pop(deployment, None)
        else:
            tables[deployment] = table
        self.tables = tables
        self._index()


def choose_version(
    table: RoutingTable, affinity_value: str | None, tenant_slug: str | None = None
) -> VersionRoute | None:
    """A version drawn by weight among those with ready agents.

    The weights are the ones that apply to the tenant (`RoutingTable.weights_for`: its own
    in a tenant-scoped stage, else the versions'). With an affinity value (tenant id or
    session id), the draw is a hash of it, so the same caller lands on the same version
    while the weights stay; when the canary's share grows, callers already on it stay on
    it (its slice only widens).
    """
    weights = table.weights_for(tenant_slug)  # shadow routes have none: never chosen
    candidates = [v for v in table.versions if weights.get(v.version_id, 0) > 0 and v.endpoints]
    if not candidates:
        return None
    total = sum(weights[v.version_id] for v in candidates)
    if affinity_value is not None and table.affinity is not Affinity.NONE:
        digest = blake2b(f"{table.deployment}\0{affinity_value}".encode(), digest_size=8).digest()
        point = int.from_bytes(digest, "big") / 2**64 * total
    else:
        point = random.random() * total
    for version in candidates:
        point -= weights[version.version_id]
        if point < 0:
            return version
    return candidates[-1]


def choose_endpoint(
    version: VersionRoute, outstanding: dict[str, int], exclude: list[str]
) -> str | None:
    """The version's agent with the fewest requests in flight from this process."""
    best: list[str] = []
    best_load = 0
    for endpoint in version.endpoints:
        if endpoint in exclude:
            continue
        load = outstanding.get(endpoint, 0)
        if not best or load < best_load:
            best, best_load = [endpoint], load
        elif load == best_load:
            best.append(endpoint)
    if not best:
        return None
    return best[0] if len(best) == 1 else random.choice(best)
