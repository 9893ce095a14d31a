"""The bus and the learner's intake under a simulated fleet (bench/fleet_scale.py, part 1): the processes.

Simulated workers publish real-shaped trajectory groups (the wire codec's frame around a validated
template, a fresh prompt and group id and `published_at` each time) through the product's `RedisBus` into
a private redis-server configured as `sparkrl up` configures its own (append-only file, fsync on every
write). The learner's real intake drains it in a process of its own: `BatchCollector.fill` (read, decode,
validate, dedup, keep-alive; with `learner.read_ahead_mb`, as the learner runs it, the reads on a thread
of their own), `samples_from_groups` → `partition` → `update_micro_batches` (collation),
then `Ledger.commit` (journal, trained marks, ack) — everything a step does but the update.

Publishers run in a few processes, each holding its share of the N workers on a fixed schedule (a random
phase each, `rate` groups/s each); a publisher behind schedule publishes at once and reports how late it
was, so a run says whether the simulator kept up (`sim_late_ms`) or the parts held it back.
"""

from __future__ import annotations

import heapq
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, astuple, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import redis

from sparkrl.proto import TrajectoryGroup, encode_group, group_id_for
from sparkrl.proto.codec import frame, header_meta
from sparkrl.proto.testing import random_group
from sparkrl.services.common.bus import BusBackpressureTimeout, RedisBus
from sparkrl.services.common.settings import BusSettings, LearnerSettings

MB = 1e6


@dataclass(frozen=True)
class Shape:
    """One group as a GPU worker would publish it for a reasoning run."""

    samples: int = 8  # the GRPO group
    tokens: int = 1024  # generated tokens per sample
    prompt_tokens: int = 256
    topk: int = 20
    vocab: int = 151_936  # Qwen2's

    @property
    def generated(self) -> int:
        return self.samples * self.tokens


def template_group(shape: Shape, seed: int = 0) -> TrajectoryGroup:
    """A valid group of the shape, every token sampled by version 0 (the intake's learner never moves)."""
    rng = np.random.default_rng(seed)
    group = random_group(rng, n=shape.samples, T=shape.tokens, k=shape.topk, vocab_size=shape.vocab)
    completions = [
        c.model_copy(update={"policy_versions": np.zeros(c.num_tokens, dtype=np.int32)})
        for c in group.completions
    ]
    prompt = rng.integers(0, shape.vocab, size=shape.prompt_tokens).astype(np.int32)
    group = group.model_copy(update={"completions": completions, "prompt_token_ids": prompt})
    encode_group(group)  # raises if the template is not a valid group
    return group


class Framer:
    """The template's wire form with a new prompt id (so a new group id) and `published_at` each time:
    the codec's own `frame` around the validated arrays, so the simulator costs a join, not a model."""

    def __init__(self, group: TrajectoryGroup) -> None:
        self.meta = header_meta(group)
        self.prompt_ids, self.completions = group.prompt_token_ids, group.completions
        self.wire = worker_wire()

    def payload(self, prompt_id: str) -> tuple[str, bytes]:
        group_id = group_id_for(prompt_id)
        prompt = {**self.meta["prompt"], "prompt_id": prompt_id}
        meta = {**self.meta, "group_id": group_id, "prompt": prompt, "published_at": time.time()}
        if self.wire is None:  # a commit from before the narrower wire (--baseline)
            return group_id, frame(meta, self.prompt_ids, self.completions)
        return group_id, frame(meta, self.prompt_ids, self.completions, self.wire)


def worker_wire() -> Any:
    """The wire a worker publishes on by default (`rollout.wire`, issue 50); None before it existed."""
    try:
        from sparkrl.proto.codec import Wire
        from sparkrl.services.common.settings.rollout import WireSettings
    except ImportError:
        return None
    chosen = WireSettings()
    return Wire(chosen.logprobs, chosen.topk_logprobs)


def scratch(prefix: str) -> Path:
    """A temporary folder on disk, under $FLEET_DATA_DIR when set (the tests point it at their own)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=os.environ.get("FLEET_DATA_DIR")))


# ── Redis as `sparkrl up` runs it ─────────────────────────────────────────────────────────────────────


@dataclass
class Redis:
    proc: subprocess.Popen[bytes]
    url: str
    data_dir: Path

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=10)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        shutil.rmtree(self.data_dir, ignore_errors=True)


def start_redis(fsync: str = "always") -> Redis:
    """A private redis-server on a free loopback port, as `sparkrl up` runs its own (sparkrl/plan.py): the
    append-only file in a temporary folder on disk, fsynced as `bus.aof_fsync` says (`always`, its
    default, or `everysec`)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not on PATH; run `make test`, which installs it")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    data_dir = scratch("fleet-redis-")
    persistence = ["--appendonly", "yes", "--appendfsync", fsync]
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(data_dir)]
    proc = subprocess.Popen([*args, *persistence], stdout=subprocess.DEVNULL)
    server = Redis(proc, f"redis://127.0.0.1:{port}/0", data_dir)
    client = server.client()
    for _ in range(500):
        try:
            client.ping()
            return server
        except redis.ConnectionError:
            time.sleep(0.01)
    server.stop()
    raise SystemExit("private redis-server did not answer PING")


# ── the two sides, each in processes of their own ─────────────────────────────────────────────────────


@dataclass(frozen=True)
class Run:
    """One fleet size's settings, passed to every process."""

    url: str
    namespace: str
    shape: Shape
    rate: float | None  # groups/s per simulated worker; None: as fast as the bus takes them
    prompts_per_step: int
    micro_batch_tokens: int
    trajectory_maxlen: int

    def bus_settings(self) -> BusSettings:
        return BusSettings(url=self.url, namespace=self.namespace, trajectory_maxlen=self.trajectory_maxlen)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Run:
        fields = json.loads(text)
        return cls(**{**fields, "shape": Shape(**fields["shape"])})


@dataclass
class Published:
    """One publish: when it began (unix s), how long the call took, its bytes, how late it started."""

    at: float
    seconds: float
    nbytes: int
    late_s: float


def publisher_main() -> None:
    """A process of simulated workers, kept across fleet sizes, over stdin/stdout like the intake's: per
    size, {"run", "workers", "seed"}; it answers ready, takes the window (start, stop), publishes in it,
    each worker on its own schedule, and answers with what it published."""
    framers: dict[Shape, Framer] = {}
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        run, workers, seed = Run.from_json(command["run"]), command["workers"], command["seed"]
        if run.shape not in framers:
            framers[run.shape] = Framer(template_group(run.shape, seed))
        with RedisBus(run.bus_settings()) as bus:
            print(json.dumps({"ready": os.getpid()}), flush=True)
            start_at, stop_at = map(float, sys.stdin.readline().split())
            window = (start_at, stop_at)
            published = publish(bus, framers[run.shape], run, workers, random.Random(seed), window)
        print(json.dumps({"published": [astuple(p) for p in published]}), flush=True)


def publish(
    bus: RedisBus,
    framer: Framer,
    run: Run,
    workers: list[int],
    rng: random.Random,
    window: tuple[float, float],
) -> list[Published]:
    """`workers` publishing from `window`'s start to its end, each `run.rate` groups/s at a random phase
    (back to back without a rate); a worker behind schedule publishes at once."""
    start_at, stop_at = window
    period = 1.0 / run.rate if run.rate else 0.0
    due = [(start_at + rng.random() * period, w, 0) for w in workers]
    heapq.heapify(due)
    published: list[Published] = []
    while due:
        at, worker, seq = heapq.heappop(due)
        if at >= stop_at or time.time() >= stop_at:
            continue
        if at > time.time():
            time.sleep(at - time.time())
        began = time.time()
        group_id, payload = framer.payload(f"{run.namespace}/w{worker}/{seq}")
        try:  # a full stream holds a publisher until the intake reads, never past the window's end
            bus.publish_group(group_id, payload, timeout_s=max(0.01, stop_at - began))
        except BusBackpressureTimeout:
            break
        published.append(Published(began, time.time() - began, len(payload), max(0.0, began - at)))
        heapq.heappush(due, (at + period if period else time.time(), worker, seq + 1))
    return published


@dataclass
class Taken:
    """One group through the intake (unix s): published, read off the stream, collated, committed."""

    published: float
    read: float
    collated: float
    committed: float
    nbytes: int


@dataclass
class Phases:
    """The intake's wall seconds by phase, over the whole run."""

    fill: float = 0.0  # BatchCollector.fill: waiting, reading, decoding, validating, dedup
    collate: float = 0.0  # samples_from_groups, partition, update_micro_batches
    commit: float = 0.0  # Ledger.commit: journal (fsync), trained marks, ack
    steps: int = 0


def intake_main() -> None:
    """The learner's intake, no update, in a process kept across fleet sizes (its imports take seconds).
    Talks over stdin/stdout, a JSON line each way, so that it can run another commit's code
    (`--baseline`): per size, the run and its folder; it answers ready, takes the window's end, drains
    until then (fill → collate → commit, step after step) and answers with what it took."""
    import torch

    torch.set_num_threads(1)  # the intake is one thread of the learner process
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        taken, phases, reads = drain(Run.from_json(command["run"]), Path(command["run_dir"]))
        answer = {"taken": [astuple(t) for t in taken], "phases": asdict(phases), "reads": reads}
        print(json.dumps(answer), flush=True)


def drain(run: Run, run_dir: Path) -> tuple[list[Taken], Phases, list[tuple[float, float]]]:
    from sparkrl.proto import decode_group
    from sparkrl.services.learner.batch import partition, samples_from_groups, update_micro_batches
    from sparkrl.services.learner.collect import BatchCollector
    from sparkrl.services.learner.ledger import Ledger
    from sparkrl.services.learner.prompt_sharing import collator
    from sparkrl.services.learner.state import TrainState
    from sparkrl.services.learner.validate import ModelLimits

    read_at: dict[str, float] = {}
    reads: list[tuple[float, float]] = []  # (published, read) of every group read, collated or not

    def stamped(data: bytes) -> TrajectoryGroup:  # the real decoder, plus when each group came off
        group = decode_group(data)
        read_at[group.group_id] = time.time()
        reads.append((group.published_at, read_at[group.group_id]))
        return group

    class StampedBus(RedisBus):
        def read_decoded(self, kind, consumer, count, decode, block_ms=None):  # type: ignore[no-untyped-def]
            return super().read_decoded(kind, consumer, count, stamped, block_ms)

    cfg = LearnerSettings(prompts_per_step=run.prompts_per_step, micro_batch_tokens=run.micro_batch_tokens)
    limits = ModelLimits(vocab_size=run.shape.vocab, max_len=32_768, needs_topk=True)
    collate_fn = collator(pad_id=0, pack_length=None, shared=False)
    taken: list[Taken] = []
    phases = Phases()
    with StampedBus(run.bus_settings()) as bus:
        collector = BatchCollector(bus, cfg, limits)
        ledger, state = Ledger(bus, run_dir, saved_step=0, fresh=True), TrainState()
        print(json.dumps({"ready": os.getpid()}), flush=True)
        stop_at = float(sys.stdin.readline())
        if hasattr(collector, "start_read_ahead"):  # learner.read_ahead_mb (issue 50): as the learner does
            collector.start_read_ahead()
        while time.time() < stop_at:
            t0 = time.perf_counter()
            batch = collector.fill(0, cfg.max_staleness, lambda: time.time() >= stop_at)
            if batch is None:
                break
            t1 = time.perf_counter()
            samples = samples_from_groups(batch.groups)
            update_micro_batches(partition(samples, cfg.micro_batch_tokens), collate_fn, False)
            collated, t2 = time.time(), time.perf_counter()
            state.step += 1
            ledger.commit(state, batch)
            if state.step % 4 == 0:
                ledger.checkpointed(state.step)  # trims the journal as checkpoints would
            committed, t3 = time.time(), time.perf_counter()
            phases.fill += t1 - t0
            phases.collate += t2 - t1
            phases.commit += t3 - t2
            phases.steps += 1
            for group, entry in zip(batch.groups, batch.entries, strict=True):
                read = read_at.pop(group.group_id, collated)
                taken.append(Taken(group.published_at, read, collated, committed, len(entry.payload)))
        if hasattr(collector, "stop_read_ahead"):
            collector.stop_read_ahead()
    return taken, phases, reads


if __name__ == "__main__":  # `python bench/fleet_intake.py intake|publisher`: a process of fleet_bus's
    intake_main() if sys.argv[1] == "intake" else publisher_main()
