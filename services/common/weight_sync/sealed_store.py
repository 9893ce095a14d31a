"""The learner's store, sealed: every value of the contract carries an HMAC made with `sync.secret`.

Anyone who reaches `sync.port` can read and write the learner's `TCPStore` (it has no access control). So
every value the contract writes there — a member's joined key (its offer) and acknowledgements, the
learner's start, its current record, a transport's plan — is written through `SealedStore.set`, which
prefixes the value with an HMAC-SHA256 over (the learner's incarnation, the key, the value), keyed by a
key derived from the secret; and read through `value` / `get` / `wait`, which take only values that
verify. One that does not (written without the secret, or copied from another key or another learner's
store) is refused: logged, counted (`refused`), and treated as not there, since the genuine writer may
still overwrite it. The incarnation binds a value to one learner: a member's acknowledgement recorded
from a learner that was restarted cannot be written back into its successor's store.

What this does not stop: a writer without the secret can still delete or overwrite a genuine value, so a
member's acknowledgement can be destroyed (the member is then left out of that broadcast) — denial, not
forgery. Nor are the keys a transport's own rendezvous writes under `group_prefix` sealed (gloo's and
NCCL's, which those libraries write themselves): a writer there can break an epoch's link (the learner
drops its members and forms a new epoch), and the bytes that then arrive are still checked against the
signed announcement's checksum, so no member loads weights the learner did not send.

With no secret (tests, an unauthenticated run) the same seal is made with an empty key: one format, one
code path, and no protection.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import time
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger("sparkrl.weight_sync")

SEAL_BYTES = 32  # an HMAC-SHA256 digest, in front of the value
UNSCOPED = -1  # the scope of a value that names its own learner (`rendezvous.Current`)
POLL_S = 0.05  # how often `wait` looks again at a key that holds a refused value


class ForgedValue(RuntimeError):
    """A key holds a value whose seal does not verify (written without `sync.secret`, or moved from
    another key or learner). A RuntimeError, as every store error is to the contract: one failed sync."""


def seal_key(secret: str | None) -> bytes:
    """The HMAC key of the store's seals: derived from the run's secret, never the secret itself."""
    return hmac.new((secret or "").encode(), b"sparkrl weight-sync store", hashlib.sha256).digest()


def seal(mac_key: bytes, scope: int, key: str, value: bytes) -> bytes:
    """`value` as stored under `key`: its HMAC over (scope, key, value), then the value."""
    # Neither an int nor one of the contract's keys holds a NUL: the message splits one way only.
    message = f"{scope}\0{key}\0".encode() + value
    return hmac.new(mac_key, message, hashlib.sha256).digest() + value


def unseal(mac_key: bytes, scope: int, key: str, stored: bytes) -> bytes | None:
    """The value `seal` wrapped, or None when `stored` is not a seal of it under `key` and `scope`."""
    value = stored[SEAL_BYTES:]
    if len(stored) < SEAL_BYTES or not hmac.compare_digest(stored, seal(mac_key, scope, key, value)):
        return None
    return value


class SealedStore:
    """The contract's view of the learner's store: sealed writes, verified reads. `raw` is the store
    itself, for a transport's own rendezvous (the library writes those keys; see the module docstring)."""

    raw: dist.Store
    incarnation: int  # the learner's (`WeightAnnouncement.incarnation`): the scope of every sealed value
    refused: int  # values refused so far, each distinct one counted once
    _mac_key: bytes
    _last_refused: dict[str, bytes]  # key → the last value refused there: each is logged and counted once

    def __init__(self, raw: dist.Store, secret: str | None, incarnation: int) -> None:
        self.raw, self.incarnation, self._mac_key = raw, incarnation, seal_key(secret)
        self.refused, self._last_refused = 0, {}

    def set(self, key: str, value: bytes, *, scoped: bool = True) -> None:
        """Writes `value` sealed. `scoped=False` only for a value that names its own learner."""
        self.raw.set(key, seal(self._mac_key, self._scope(scoped), key, value))

    def value(self, key: str, *, scoped: bool = True) -> bytes | None:
        """The verified value under `key`, without waiting; None when there is none or it was refused."""
        if not self.raw.check([key]):
            return None
        return self._open(key, self.raw.get(key), scoped)

    def get(self, key: str, *, scoped: bool = True) -> bytes:
        """The verified value under `key`, waiting for it like `TCPStore.get`; raises ForgedValue when what
        is there does not verify."""
        value = self._open(key, self.raw.get(key), scoped)
        if value is None:
            raise ForgedValue(f"the learner's store holds a value under {key} whose seal does not verify")
        return value

    def wait(self, keys: Mapping[str, str], timeout: timedelta) -> dict[str, bytes]:
        """Waits up to `timeout` for a verified value under every key (`keys`: name → key); returns name →
        value for those that came. A refused value is waited past: the genuine writer may overwrite it."""
        deadline = time.monotonic() + timeout.total_seconds()
        pending, found = dict(keys), {}
        while pending and (left := deadline - time.monotonic()) > 0:
            # Some never came (DistStoreError): take the ones that did, and stop.
            with contextlib.suppress(dist.DistStoreError):
                self.raw.wait(list(pending.values()), timedelta(seconds=left))
            for name, key in list(pending.items()):
                value = self.value(key)
                if value is not None:
                    found[name] = value
                    del pending[name]
            if pending and all(self.raw.check([key]) for key in pending.values()):
                time.sleep(POLL_S)  # only refused values left: look again shortly
        return found

    def delete_key(self, key: str) -> None:
        self.raw.delete_key(key)

    def _scope(self, scoped: bool) -> int:
        return self.incarnation if scoped else UNSCOPED

    def _open(self, key: str, stored: bytes, scoped: bool) -> bytes | None:
        value = unseal(self._mac_key, self._scope(scoped), key, stored)
        if value is None and self._last_refused.get(key) != stored:
            self._last_refused[key] = stored
            self.refused += 1
            log.warning(
                "refused a value under %s in the learner's store: its seal does not verify (written "
                "without sync.secret, or sync.secret differs)",
                key,
            )
        return value
