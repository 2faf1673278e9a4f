"""One Redis client shared by the agent's threads, with reconnection backoff.

While Redis is away every call fails fast (RedisUnavailable) until the next attempt is
due, so the threads keep their own rhythm and nothing piles up. The first successful
call after an outage runs `on_reconnect` (the agent re-registers and re-creates its
command consumer group, which a Redis restarted empty no longer has).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis

logger = logging.getLogger(__name__)

T = TypeVar("T")
INITIAL_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0


class RedisUnavailable(RuntimeError):
    pass


class RedisLink:
    def __init__(self, url: str, *, on_reconnect: Callable[[], None]) -> None:
        self.client = redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=5,
            socket_connect_timeout=2,
            health_check_interval=15,
        )
        self._on_reconnect = on_reconnect
        self._lock = threading.Lock()
        self._is_connected = False
        self._has_connected_before = False
        self._next_attempt_at = 0.0
        self._backoff_s = INITIAL_BACKOFF_S

    def call(self, operation: Callable[[redis.Redis], T]) -> T:
        with self._lock:
            if not self._is_connected and time.monotonic() < self._next_attempt_at:
                raise RedisUnavailable("redis unavailable; waiting before the next attempt")
        try:
            result = operation(self.client)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            with self._lock:
                if self._is_connected or not self._has_connected_before:
                    logger.warning("redis unavailable: %s", exc)
                self._is_connected = False
                self._next_attempt_at = time.monotonic() + self._backoff_s
                self._backoff_s = min(self._backoff_s * 2, MAX_BACKOFF_S)
            raise RedisUnavailable(str(exc)) from exc
        is_reconnection = False
        with self._lock:
            if not self._is_connected:
                is_reconnection = self._has_connected_before
                if is_reconnection:
                    logger.warning("redis reachable again")
                self._is_connected = True
                self._has_connected_before = True
                self._backoff_s = INITIAL_BACKOFF_S
        if is_reconnection:
            self._on_reconnect()
        return result

    def close(self) -> None:
        self.client.close()
