"""Where the learner and its members meet: the announcement's bus key and the keys of the learner's store.

The learner hosts a `TCPStore`; every key below lives in it, its value sealed with `sync.secret`
(`sealed_store.py`: anyone who reaches the port can write there, and a value that does not verify is
refused). A group epoch is one membership: rank 0 is
the learner, ranks 1..N are the members in announced order. An epoch's link is never formed twice (gloo's
own rendezvous keys stay in the store under the epoch's prefix and would be reused), so any change of
membership, and any failure, moves to a new epoch.
"""

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from sparkrl.services.common.weight_sync.sealed_store import SealedStore

ANNOUNCEMENT_KEY = "weights"  # bus value: the latest WeightAnnouncement (JSON). Learner writes, workers read
CURRENT_KEY = "current"  # store value: the learner's newest published announcement (`Current.encode`)

START_GO = b"go"
START_ABORT = b"abort"
ACK_OK = b"ok"
JOINED = b"1"  # a joined key's plain value (a transport may say more: see `Transport.offer`)


def joined_key(epoch: int, member: str) -> str:
    """Written by a member (its transport's offer) before it forms the epoch's link; read by the learner."""
    return f"epoch/{epoch}/joined/{member}"


def start_key(epoch: int) -> str:
    """Written by the learner: START_GO once every member joined, START_ABORT when some never did."""
    return f"epoch/{epoch}/start"


def ack_key(epoch: int, version: int, member: str) -> str:
    """Written by a member after it verified `version`: ACK_OK or b"bad <checksum it computed>"."""
    return f"epoch/{epoch}/ack/{version}/{member}"


def group_prefix(epoch: int) -> str:
    """The keys a transport's own rendezvous writes for `epoch` live under this prefix."""
    return f"epoch/{epoch}/group/"


@dataclass(frozen=True)
class Current:
    """What the learner's store says its newest published announcement is. Written by the learner once the
    announcement is in Redis; read by a worker, which cannot trust Redis to be fresh (anyone who can write
    there can write back a genuine old announcement), while the store is the learner's own process."""

    incarnation: int
    sequence: int
    epoch: int

    def encode(self) -> bytes:
        return f"{self.incarnation} {self.sequence} {self.epoch}".encode()

    @classmethod
    def decode(cls, raw: bytes) -> "Current":
        incarnation, sequence, epoch = (int(part) for part in raw.split())
        return cls(incarnation, sequence, epoch)


def read_current(store: SealedStore) -> Current | None:
    """The store's record of the newest announcement; None before the learner published one. Raises
    ForgedValue when the record there does not verify. Unscoped: the record names its own learner, and a
    worker reads it to learn whether the store still serves the learner it knows."""
    return Current.decode(store.get(CURRENT_KEY, scoped=False)) if store.raw.check([CURRENT_KEY]) else None


def ask_current(host: str, port: int, timeout_s: float, secret: str | None) -> Current | None:
    """`read_current` from the learner's store at host:port, over a connection of its own. Raises OSError
    or RuntimeError when nothing answers there within `timeout_s`; ForgedValue (a RuntimeError) when the
    record there does not verify with `secret`."""
    # A plain connect first: a closed port is refused at once, where TCPStore would retry until its timeout.
    socket.create_connection((host, port), timeout=timeout_s).close()
    store = connect_store(host, port, timedelta(seconds=timeout_s))
    return read_current(SealedStore(store, secret, incarnation=0))  # the current record is unscoped


def epoch_over(store: SealedStore, epoch: int) -> str | None:
    """Why the announced `epoch` of learner `store.incarnation` can no longer be joined, or None. A joiner
    must not wait for it: its members formed their link without it, and only a timeout would say so.
    Call before writing the joined key."""
    current = read_current(store)
    if current is not None and current.incarnation != store.incarnation:
        return f"the learner that announced epoch {epoch} is gone: its store now serves another learner"
    if current is not None and current.epoch > epoch:
        return f"epoch {epoch} is over: the learner announced epoch {current.epoch} since"
    # The learner starts an epoch only once every member wrote its joined key: a start already there means
    # an earlier process under this worker's id joined it (a replayed or late announcement).
    if store.value(start_key(epoch)) is not None:
        return f"epoch {epoch} started without this process (an earlier one under its id joined it)"
    return None


def learner_still_there(store: SealedStore, epoch: int) -> bool:
    """Whether the learner behind `store` is the one that started `epoch`: a restarted learner has a new
    store, so the old connection errors, or the epoch was never started in it (by this learner: a start
    sealed by another does not verify)."""
    try:
        return store.value(start_key(epoch)) is not None
    except RuntimeError:
        return False


def connect_store(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A worker's connection to the learner's store (`host_store`). `timeout` bounds every store wait."""
    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)


def host_store(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """The learner's store, listening on `host` only (port 0: a free one). TCPStore alone would listen on
    every interface; handed a socket already bound, it listens on that one."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(128)
    bound = listener.getsockname()[1]
    # The store takes the descriptor over (and closes it with itself): Python must let go of it, or its
    # socket object would close the number again later, when it may belong to another connection.
    fd = listener.detach()
    return dist.TCPStore(
        host, bound, is_master=True, wait_for_workers=False, timeout=timeout, master_listen_fd=fd
    )


def local_address_towards(host: str, port: int) -> str:
    """This machine's address on the route to `host` (no packet sent): where a member's link listens."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]
