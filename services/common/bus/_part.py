"""What every part of the bus (logs, statuses, named values) holds: the Redis client, the bus's retrying
executor and the namespace its keys live under."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import redis

T = TypeVar("T")
Runner = Callable[[Callable[[], T]], T]


class BusPart:
    """One kind of key in one namespace. Thread-safe like the client it wraps."""

    _redis: redis.Redis
    _run: Runner[Any]
    _namespace: str

    def __init__(self, client: redis.Redis, run: Runner[Any], namespace: str) -> None:
        """`run` is the bus's retrying executor, so a call survives a reconnect like any other."""
        self._redis, self._run, self._namespace = client, run, namespace
