"""The namespace's owner: one run at a time holds `{ns}:value:owner`, a lease its learner renews and that
expires when nobody does; `{ns}:value:owner-generation` counts the claims, so each holder has a number no
earlier one had (the fencing token). The record is JSON the caller writes (`sparkrl.proto.run_files.RunOwner`)
with at least `run_id`; the bus adds `generation` and compares the rest as text.

A claim by the run that holds the lease already (a restarted or resumed learner of the same run) takes it
over at once, under a new generation; a claim by another run is refused while the lease lives."""

from __future__ import annotations

from typing import NamedTuple

from sparkrl.services.common.bus._part import BusPart
from sparkrl.services.common.bus._text import text

OWNER = "owner"
GENERATION = "owner-generation"

# KEYS: owner, generation. ARGV: run id, the claimant's record (JSON), ttl ms. A record Redis cannot read as
# JSON (written by hand) counts as another run's: it is never overwritten silently.
_CLAIM_LUA = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local ok, owner = pcall(cjson.decode, cur)
  if not ok or type(owner) ~= 'table' or owner['run_id'] ~= ARGV[1] then return {0, cur} end
end
local mine = cjson.decode(ARGV[2])
mine['generation'] = redis.call('INCR', KEYS[2])
local record = cjson.encode(mine)
redis.call('SET', KEYS[1], record, 'PX', ARGV[3])
return {1, record}
"""

# KEYS: owner, generation. ARGV: the holder's record, ttl ms, its generation. A lease that lapsed (the holder
# could not reach Redis for a while) is taken back only if nobody claimed the namespace since: the count is
# still the holder's, or below it (a Redis that lost its data counts from 0 again, and gets it back).
_RENEW_LUA = """
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, cur}
end
local count = tonumber(redis.call('GET', KEYS[2]) or '0')
if not cur and count <= tonumber(ARGV[3]) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  redis.call('SET', KEYS[2], ARGV[3])
  return {1, ARGV[1]}
end
return {0, cur or ''}
"""

_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Claim(NamedTuple):
    held: bool  # True: the record is ours now (or still); False: another run's
    record: str  # the owner's record as stored (ours, with its generation), '' when there is none


class Owners(BusPart):
    """The owner lease of one namespace. Thread-safe like the client it wraps."""

    def _keys(self) -> list[str]:
        return [f"{self._namespace}:value:{OWNER}", f"{self._namespace}:value:{GENERATION}"]

    def claim(self, run_id: str, record: str, ttl_s: float) -> Claim:
        """Take the namespace for `run_id` (its record without the generation), unless another run holds
        it."""
        args = [run_id, record, max(1, int(ttl_s * 1000))]
        held, stored = self._run(lambda: self._redis.eval(_CLAIM_LUA, 2, *self._keys(), *args))
        return Claim(bool(held), text(stored))

    def renew(self, record: str, generation: int, ttl_s: float) -> Claim:
        """Extend our lease; `held` False (and the new owner's record, or '') once another run took it."""
        args = [record, max(1, int(ttl_s * 1000)), generation]
        held, stored = self._run(lambda: self._redis.eval(_RENEW_LUA, 2, *self._keys(), *args))
        return Claim(bool(held), text(stored))

    def release(self, record: str) -> bool:
        """Give the namespace up at a clean end (only if the lease is still ours)."""
        key = self._keys()[0]
        return bool(self._run(lambda: self._redis.eval(_RELEASE_LUA, 1, key, record)))

    def current(self) -> str | None:
        """The owner's record, None when nobody holds the namespace."""
        raw = self._run(lambda: self._redis.get(self._keys()[0]))
        return None if raw is None else text(raw)
