"""Per-tenant requests-per-minute and tokens-per-minute limits, atomic across gateways.

Fixed one-minute windows aligned to Redis's own clock (`TIME` inside the script), so
every gateway process agrees on the window whatever its own clock says. One Lua script
checks both counters and, only when both allow it, counts the request and reserves its
estimated tokens: a refused request leaves no trace. After the response, `settle`
replaces the estimate with the real token count in the same window.

Keys: `ratelimit:{<tenant_id>}:r:<window_start>` and `...:t:<window_start>` (the hash
tag keeps one tenant's keys on one cluster slot); they expire two minutes after use.
"""

from dataclasses import dataclass

import redis.asyncio as aioredis

WINDOW_S = 60

_ADMIT = """
local now = tonumber(redis.call('TIME')[1])
local window = now - (now % 60)
local prefix = 'ratelimit:{' .. ARGV[1] .. '}:'
local requests_key = prefix .. 'r:' .. window
local tokens_key = prefix .. 't:' .. window
local requests_limit = tonumber(ARGV[2])
local tokens_limit = tonumber(ARGV[3])
local estimate = tonumber(ARGV[4])
local retry_after = window + 60 - now
local requests_used = tonumber(redis.call('GET', requests_key) or '0')
if requests_used + 1 > requests_limit then
  return {0, retry_after, window, 'requests'}
end
local tokens_used = tonumber(redis.call('GET', tokens_key) or '0')
if tokens_used + estimate > tokens_limit then
  return {0, retry_after, window, 'tokens'}
end
redis.call('INCR', requests_key)
redis.call('EXPIRE', requests_key, 120)
redis.call('INCRBY', tokens_key, estimate)
redis.call('EXPIRE', tokens_key, 120)
return {1, 0, window, ''}
"""

_SETTLE = """
local key = 'ratelimit:{' .. ARGV[1] .. '}:t:' .. ARGV[2]
if redis.call('EXISTS', key) == 1 then
  redis.call('INCRBY', key, tonumber(ARGV[3]))
end
return 1
"""


@dataclass(slots=True, frozen=True)
class Admission:
    is_allowed: bool
    retry_after_s: int
    window: int  # start of the window the request was counted in (unix seconds)
    limit: str  # "requests" or "tokens" when refused


class RateLimiter:
    def __init__(self, client: aioredis.Redis) -> None:
        self._admit = client.register_script(_ADMIT)
        self._settle = client.register_script(_SETTLE)

    async def admit(
        self, *, tenant_id: int, requests_per_minute: int, tokens_per_minute: int, estimate: int
    ) -> Admission:
        allowed, retry_after, window, limit = await self._admit(
            args=[tenant_id, requests_per_minute, tokens_per_minute, max(0, estimate)]
        )
        limit_name = limit.decode() if isinstance(limit, bytes) else str(limit)
        return Admission(bool(allowed), max(1, int(retry_after)), int(window), limit_name)

    async def settle(self, *, tenant_id: int, window: int, delta: int) -> None:
        """Correct the window's token count by `delta` (actual minus estimate)."""
        if delta:
            await self._settle(args=[tenant_id, window, delta])
