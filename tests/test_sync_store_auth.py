"""The weight-sync store, attacked: anyone who reaches `sync.port` can write into the learner's TCPStore.

Every value of the contract is sealed with `sync.secret` (`weight_sync/sealed_store.py`). Here an
unauthenticated client connects to the learner's real store and writes what a member or the learner
would — a joined key, a start, acknowledgements, the current record — and the rendezvous refuses each:
the member the forgery names is not counted as joined or acknowledged by it, and the broadcast goes on
for the genuine member. The learner and the member are real (a gloo link between two threads).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from sparkrl.proto import WeightAnnouncement, sign_announcement
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.settings import BusSettings
from sparkrl.services.common.weight_sync import (
    ANNOUNCEMENT_KEY,
    LoadedInPlace,
    SyncFailed,
    SyncReport,
    WeightReceiver,
    WeightSender,
)
from sparkrl.services.common.weight_sync.rendezvous import CURRENT_KEY, ack_key, joined_key, start_key
from sparkrl.services.common.weight_sync.sealed_store import SealedStore, seal, seal_key, unseal
from sparkrl.services.rollout.announcements import AnnouncementGate

SECRET = "store-auth-test-secret-0123456789"
TIMEOUT_S = 20.0  # nothing here should wait it out: every wait below ends on an event
WEIGHTS = {"layer.weight": torch.arange(12.0).reshape(3, 4), "layer.bias": torch.ones(3)}


def _attacker(sender: WeightSender) -> dist.TCPStore:
    """A client of the learner's real store that does not know the secret."""
    return dist.TCPStore(
        "127.0.0.1", sender.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5)
    )


def _until(condition: Callable[[], bool], what: str, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_seal_holds_only_for_its_key_learner_and_secret() -> None:
    key = seal_key(SECRET)
    sealed = seal(key, 7, "epoch/1/ack/3/w", b"ok")
    assert unseal(key, 7, "epoch/1/ack/3/w", sealed) == b"ok"
    assert unseal(key, 7, "epoch/1/ack/3/w", b"ok") is None  # written without a seal
    assert unseal(key, 7, "epoch/1/ack/3/other", sealed) is None  # moved to another member's key
    assert unseal(key, 8, "epoch/1/ack/3/w", sealed) is None  # replayed into another learner's store
    assert unseal(seal_key("another-secret-0123456789"), 7, "epoch/1/ack/3/w", sealed) is None
    assert unseal(key, 7, "epoch/1/ack/3/w", sealed[:-1] + b"x") is None  # the value changed
    assert unseal(key, 7, "epoch/1/ack/3/w", sealed[:10]) is None  # truncated
    assert seal_key(SECRET) != SECRET.encode() and len(seal_key(None)) == 32


def test_a_forged_ack_is_refused_and_the_genuine_member_is_synced(caplog: pytest.LogCaptureFixture) -> None:
    """The probe of issue 45: forged acknowledgements kept a worker out of 240 of 256 broadcasts. The
    attacker also forges the member's joined key and an abort of the epoch before the member shows up."""
    release = threading.Event()  # the member's engine holds the version until the test has seen the refusals

    def install(tensors: dict[str, torch.Tensor], announcement: WeightAnnouncement) -> str:
        assert release.wait(TIMEOUT_S), "the test never released the member"
        return announcement.checksum  # what an engine that took the version reports

    with WeightSender(timeout_s=TIMEOUT_S, straggler_s=1.0, secret=SECRET) as sender:
        receiver = WeightReceiver("w", timeout_s=TIMEOUT_S, install=install, secret=SECRET)
        announcement = sender.announce(WEIGHTS, version=1, epoch=1, members=["w"])
        sender.published(announcement)
        attacker = _attacker(sender)
        attacker.set(joined_key(1, "w"), b"1")  # "w joined" (it has not)
        attacker.set(start_key(1), b"abort")  # sent to "w": the learner gave up on the epoch
        attacker.set(ack_key(1, 1, "w"), b"bad " + b"0" * 64)  # "w refused the version" (checksum mismatch)
        with ThreadPoolExecutor(2) as pool, caplog.at_level(logging.WARNING, "sparkrl.weight_sync"):
            broadcast: Future[SyncReport] = pool.submit(sender.broadcast, WEIGHTS, announcement)
            _until(lambda: sender.refused_writes >= 1, "the learner to refuse the forged joined key")
            assert not broadcast.done()  # the forged joined key did not start the epoch
            received = pool.submit(receiver.receive, announcement)
            _until(lambda: sender.refused_writes >= 2, "the learner to refuse the forged acknowledgement")
            attacker.set(ack_key(1, 1, "w"), b"ok")  # "w verified the version" (it is still loading it)
            _until(lambda: sender.refused_writes >= 3, "the learner to refuse the forged ok")
            wrong = SealedStore(attacker, "a-guessed-secret-0123456789", announcement.incarnation)
            wrong.set(ack_key(1, 1, "w"), b"ok")  # sealed, with the wrong secret
            _until(lambda: sender.refused_writes >= 4, "the learner to refuse the wrongly sealed ok")
            time.sleep(0.2)  # a few more polls of the acknowledgement: none of the forgeries counts
            assert not broadcast.done() and not received.done()
            release.set()
            report, delivery = broadcast.result(TIMEOUT_S), received.result(TIMEOUT_S)
        receiver.close()
    assert report.members == ("w",) and report.version == 1
    assert isinstance(delivery, LoadedInPlace) and delivery.checksum == announcement.checksum
    assert sender.refused_writes == 4
    assert "refused a value under epoch/1/ack/1/w" in caplog.text
    assert "refused a value under epoch/1/start" in caplog.text  # the member refused the forged abort


def test_a_forged_joined_key_does_not_make_a_member(caplog: pytest.LogCaptureFixture) -> None:
    """A member that never came, 'joined' by a forgery: named missing at the join, not after the link's
    own rendezvous timed out without a name."""
    with WeightSender(timeout_s=2.0, secret=SECRET) as sender:
        receiver = WeightReceiver("w", timeout_s=TIMEOUT_S, secret=SECRET)
        announcement = sender.announce(WEIGHTS, version=1, epoch=1, members=["w", "ghost"])
        sender.published(announcement)
        _attacker(sender).set(joined_key(1, "ghost"), b"1")
        with ThreadPoolExecutor(1) as pool:
            received = pool.submit(receiver.receive, announcement)
            with pytest.raises(SyncFailed) as failure:
                sender.broadcast(WEIGHTS, announcement)
            with pytest.raises(SyncFailed, match="aborted the epoch"):
                received.result(TIMEOUT_S)
        receiver.close()
    assert (failure.value.phase, failure.value.missing) == ("join", ["ghost"])
    assert sender.refused_writes == 1


def test_a_forged_current_record_is_refused_by_the_gate(
    bus_settings: BusSettings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A fresh worker asks the learner's store what is current, to refuse a replayed announcement; a
    record written there without the secret is a refusal (looked at again later), never a pass."""
    with WeightSender(secret=SECRET) as sender, RedisBus(bus_settings) as bus:
        old = sign_announcement(sender.announce(WEIGHTS, version=1, epoch=1, members=[]), SECRET)
        new = sign_announcement(sender.announce(WEIGHTS, version=2, epoch=1, members=[]), SECRET)
        sender.published(new)
        # The replay: the old announcement back in Redis, and a record in the store that calls it current.
        bus.set_value(ANNOUNCEMENT_KEY, old.model_dump_json())
        _attacker(sender).set(CURRENT_KEY, f"{old.incarnation} {old.sequence} {old.group_epoch}".encode())
        with caplog.at_level(logging.WARNING, "sparkrl.rollout"):
            assert AnnouncementGate(bus, SECRET, tmp_path).latest() is None
        assert "the current record in its learner's store" in caplog.text and "does not verify" in caplog.text
        sender.published(new)  # the learner's next record: the genuine one again
        bus.set_value(ANNOUNCEMENT_KEY, new.model_dump_json())
        assert AnnouncementGate(bus, SECRET, tmp_path).latest() == new
