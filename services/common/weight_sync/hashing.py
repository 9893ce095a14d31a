"""The weights checksum on several cores (its tree: `sparkrl.proto.weights`).

Every leaf (`CHUNK_BYTES` of a tensor) is hashed on a thread of one shared pool: hashlib lets go of the GIL
while it hashes a buffer, so the leaves of one tensor, and of the next ones, hash on every core at once.
The learner hashes a version before it announces it (`digests`); a receiver hands each tensor over as
its bucket lands (`submit`) and reads the digests at the end, so hashing overlaps receiving.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from sparkrl.proto.weights import Bytes, chunks, leaf_digest, root_checksum, tensor_digest

MAX_THREADS = 16  # past this, the memory bus, not the cores, is what a host runs out of


def default_threads() -> int:
    """The cores this process may run on, up to `MAX_THREADS`."""
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere every core counts
    cores = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_THREADS))


class PendingDigest:
    """A tensor's digest while its leaves hash; `result()` waits for them."""

    def __init__(self, data: Bytes, leaves: list[Future[bytes]]) -> None:
        self._data, self._leaves = data, leaves  # the data stays alive until its leaves are hashed

    def result(self) -> bytes:
        return tensor_digest(self._data, [leaf.result() for leaf in self._leaves])


class ParallelHasher:
    """Hashes tensors' bytes into the checksum tree, `threads` leaves at a time."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or default_threads()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="weights-hash")

    def submit(self, data: Bytes) -> PendingDigest:
        """Starts hashing one tensor's bytes (kept alive until they are hashed)."""
        return PendingDigest(data, [self._pool.submit(leaf_digest, chunk) for chunk in chunks(data)])

    def digests(self, tensors: Iterable[Bytes]) -> list[bytes]:
        """Each tensor's digest, in order. At most a few tensors per thread are held at once, so a
        generator that copies each tensor off a GPU holds a bounded number of copies."""
        done: list[bytes] = []
        pending: deque[PendingDigest] = deque()
        for data in tensors:
            pending.append(self.submit(data))
            if len(pending) > 2 * self.threads:
                done.append(pending.popleft().result())
        done.extend(p.result() for p in pending)
        return done

    def checksum(self, tensors: Iterable[Bytes]) -> str:
        """The weights checksum of the tensors' bytes, in order."""
        return root_checksum(self.digests(tensors))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_shared: ParallelHasher | None = None
_shared_lock = threading.Lock()


def shared_hasher() -> ParallelHasher:
    """The process's hasher (one pool for every caller: the sender, the receiver, the engines)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = ParallelHasher()
        return _shared
