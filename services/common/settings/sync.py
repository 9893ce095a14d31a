"""The `sync` section of the settings: how new weights reach the fleet. The learner and every rollout
worker read it (the one section the two sides share); re-exported by `settings.py`.

`backend` is the variant: it names the transport (`weight_sync.backends.make_transport`, the one place a
name picks an implementation), and a name that is not one of them fails when the config loads. Every
backend reads the same other fields.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from sparkrl.services.common.settings.section import Section

SyncBackend = Literal["gloo", "nccl", "nccl4py", "vllm_nccl"]  # `WeightAnnouncement.backend` too


class WeightSyncSettings(Section):
    """How new weights reach the fleet: the learner's own link to the workers, and its weight files over
    HTTP for a worker that cannot see its disk. Both the learner and the workers read this section."""

    backend: SyncBackend = Field(
        "gloo",
        description="gloo on CPU. On GPU: nccl (torch's ProcessGroupNCCL); nccl4py (an NVIDIA nccl4py "
        "communicator: non-blocking, every call bounded by timeout_s, shrunk when members only leave; "
        "`pip install 'nccl4py[cu12]'`); vllm_nccl (vLLM's own NCCL weight-transfer engine receives "
        "straight into the workers' vLLM; needs rollout.engine.kind vllm, and vLLM in the learner's "
        "environment too).",
    )
    host: str = Field(
        "127.0.0.1", description="Address workers reach the learner at (its TCPStore and weight files)."
    )
    port: int = Field(29600, ge=1, le=65535, description="TCPStore port the learner hosts.")
    http_port: int = Field(
        29601,
        ge=0,
        le=65535,
        description="Port of the learner's weight files (snapshot, model directory) for workers that "
        "cannot see its disk; 0: any free one.",
    )
    bucket_mb: int = Field(64, ge=1, le=4096, description="Tensors travel packed in buckets of this size.")
    timeout_s: float = Field(
        60.0, gt=0, description="A member that does not join or finish within this is dropped from the group."
    )
    straggler_s: float = Field(
        5.0,
        gt=0,
        description="Once a member has acknowledged a version, how long the others get before they are "
        "named and dropped (a hung member costs seconds, not `timeout_s`).",
    )
    progress_timeout_s: float = Field(
        300.0,
        gt=0,
        description="A worker whose loop made no progress for this long (heartbeat alive, generation hung) "
        "is left out of broadcasts; longer than its slowest batch.",
    )
    snapshot_every: int = Field(
        1, ge=1, description="Write the weights a late joiner loads every N policy versions."
    )
    delta: bool = Field(
        False,
        description="Send a version as what changed since the last one (positions + values of the elements "
        "whose bits changed; a tensor whole when that is smaller), when every member acknowledged the last "
        "one in the same group epoch; else whole. Applied exactly: a worker checks the whole version's "
        "checksum. Each side keeps a CPU copy of the version held. Pays in bf16 (few elements change a "
        "step at RL learning rates); in float32 nearly all do (docs/benchmarks.md). Not with vllm_nccl.",
    )
    secret: str | None = Field(
        None,
        repr=False,
        min_length=16,
        description="Shared secret of the learner and the workers: announcements are HMAC-signed with it and "
        "workers refuse any that does not verify. None: unauthenticated (`sparkrl up` generates one).",
    )

    @model_validator(mode="after")
    def _delta_needs_our_transfer(self) -> WeightSyncSettings:
        if self.delta and self.backend == "vllm_nccl":
            raise ValueError(
                "sync.delta needs a transport that hands the worker the tensors (gloo, nccl, nccl4py): "
                "vllm_nccl loads each version straight into vLLM; set sync.delta false or another backend"
            )
        return self
