"""Named values on the bus (the weight announcement, the control state, trained marks): `{ns}:value:<name>`,
each with an optional expiry."""

from __future__ import annotations

from sparkrl.services.common.bus._part import BusPart

CHUNK = 1000  # values written or read per round trip


class NamedValues(BusPart):
    """The named values of one namespace. Thread-safe like the client it wraps."""

    def key(self, name: str) -> str:
        return f"{self._namespace}:value:{name}"

    def set(self, name: str, payload: str | bytes, ttl_s: float | None, only_if_absent: bool) -> bool:
        px = None if ttl_s is None else max(1, int(ttl_s * 1000))
        return bool(self._run(lambda: self._redis.set(self.key(name), payload, px=px, nx=only_if_absent)))

    def set_many(self, values: dict[str, str], ttl_s: float | None) -> None:
        px = None if ttl_s is None else max(1, int(ttl_s * 1000))
        items = list(values.items())
        for start in range(0, len(items), CHUNK):

            def write(chunk: list[tuple[str, str]] = items[start : start + CHUNK]) -> None:
                pipe = self._redis.pipeline(transaction=False)
                for name, payload in chunk:
                    pipe.set(self.key(name), payload, px=px)
                pipe.execute()

            self._run(write)

    def get(self, name: str) -> bytes | None:
        return self._run(lambda: self._redis.get(self.key(name)))

    def get_many(self, names: list[str]) -> list[bytes | None]:
        """The values of `names`, in order (None where there is none): one round trip per thousand."""
        values: list[bytes | None] = []
        for start in range(0, len(names), CHUNK):
            keys = [self.key(name) for name in names[start : start + CHUNK]]
            values.extend(self._run(lambda keys=keys: self._redis.mget(keys)))
        return values

    def delete_many(self, names: list[str]) -> int:
        if not names:
            return 0
        return int(self._run(lambda: self._redis.delete(*(self.key(name) for name in names))))
