"""Member statuses (the heartbeats of workers and the learner): one key per member that expires `ttl_s`
after its last put, so a dead member disappears by itself, and one set per kind naming the members.

Reading a kind is one round trip whatever else the namespace holds (reading by key pattern would SCAN
every dedup and trained mark of the run, thousands of keys, on every call): a script reads the members'
keys and drops from the set the members whose key expired, atomically, so a member that comes back puts
itself in again with its next status.
"""

from __future__ import annotations

from typing import Any

import redis

from sparkrl.services.common.bus._part import BusPart, Runner
from sparkrl.services.common.bus._text import text

# KEYS[1]: the kind's member set; ARGV[1]: the prefix of the members' status keys. Returns member, value,
# member, value… for the live ones.
READ_LIVE_LUA = """
local out = {}
for _, member in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local value = redis.call('GET', ARGV[1] .. member)
  if value then
    out[#out + 1] = member
    out[#out + 1] = value
  else
    redis.call('SREM', KEYS[1], member)
  end
end
return out
"""


class Statuses(BusPart):
    """The statuses of one namespace: `{ns}:status:<kind>:<member>` and `{ns}:members:<kind>`."""

    def __init__(self, client: redis.Redis, run: Runner[Any], namespace: str) -> None:
        super().__init__(client, run, namespace)
        self._read_live = client.register_script(READ_LIVE_LUA)

    def _prefix(self, kind: str) -> str:
        return f"{self._namespace}:status:{kind}:"

    def _members(self, kind: str) -> str:
        return f"{self._namespace}:members:{kind}"

    def put(self, kind: str, member_id: str, payload_json: str, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")

        def put() -> None:
            pipe = self._redis.pipeline(transaction=False)
            pipe.set(self._prefix(kind) + member_id, payload_json, px=max(1, int(ttl_s * 1000)))
            pipe.sadd(self._members(kind), member_id)
            pipe.execute()

        self._run(put)

    def live(self, kind: str) -> dict[str, str]:
        """member id → status JSON of every live member of `kind`."""
        flat = self._run(lambda: self._read_live(keys=[self._members(kind)], args=[self._prefix(kind)]))
        return {text(flat[i]): text(flat[i + 1]) for i in range(0, len(flat), 2)}

    def get(self, kind: str, member_id: str) -> str | None:
        """One member's status JSON, None when it is not live."""
        raw = self._run(lambda: self._redis.get(self._prefix(kind) + member_id))
        return None if raw is None else text(raw)
