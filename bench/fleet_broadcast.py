"""Part 2 of bench/fleet_scale.py: the weight broadcast's fan-out, one sender to R receivers over gloo.

The state is Qwen2.5-0.5B's shapes in bf16 (494 M parameters, tied embeddings: 0.99 GB), sent by the
product's `WeightSender` in the default buckets (`sync.bucket_mb`) to R `WeightReceiver` processes that
verify the checksum as buckets arrive, as workers do. Per R: the first version forms the epoch's group
(its time is `group_s`), the next `repeats` are timed. The bytes each process moved are read from the
kernel (`ss -ti`: bytes_acked of each TCP socket the process owns, before and after a version), so the
sender's share of the traffic is measured, not assumed.

torch's ProcessGroupGloo broadcast is `gloo::broadcast` (gloo/broadcast.cc): a binomial tree, not
pipelined: the root sends the whole bucket to ceil(log2(R + 1)) peers in turn, each receiver forwards
it whole after it has all of it. NCCL's broadcast pipelines chunks along a ring, so the root sends each
byte once and a version takes about size / link bandwidth for any R (nccl-tests doc/PERFORMANCE.md:
broadcast bus bandwidth = algorithm bandwidth, t = S/B).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import re
import subprocess
import time
from typing import Any

import psutil
import torch

from sparkrl.proto import WeightAnnouncement
from sparkrl.services.common.settings import WeightSyncSettings
from sparkrl.services.common.weight_sync import WeightReceiver, WeightSender

TIMEOUT_S = 300.0
GB = 1e9


def qwen_like_state(
    layers: int = 24, hidden: int = 896, ffn: int = 4864, kv: int = 128, vocab: int = 151_936
) -> dict[str, torch.Tensor]:
    """Qwen2.5-0.5B's tensors (names and shapes; the embedding tied to the output), bf16. Values are a
    constant: the broadcast and the checksum cost the same whatever the bytes."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.q_proj.bias": (hidden,),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (ffn, hidden),
            p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    shapes["model.norm.weight"] = (hidden,)
    return {name: torch.full(shape, 0.5, dtype=torch.bfloat16) for name, shape in shapes.items()}


def receiver_main(worker_id: str, commands: Any, results: Any) -> None:
    """A worker's side: receive each announced version into reused buckets, verify, acknowledge."""
    torch.set_num_threads(1)
    receiver = WeightReceiver(worker_id, timeout_s=TIMEOUT_S, reuse_buffers=True)
    results.put(("ready", os.getpid()))
    while (announcement := commands.get()) is not None:
        receiver.receive(WeightAnnouncement.model_validate_json(announcement))
        results.put(("ok", os.getpid()))
    receiver.close()


_SOCKET = re.compile(r"pid=(\d+),")
_ACKED = re.compile(r"bytes_acked:(\d+)")


def sent_bytes() -> dict[int, int]:
    """Bytes acknowledged by the peer, summed over each process's TCP sockets (loopback included)."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    totals: dict[int, int] = {}
    pids: list[int] = []
    for line in out.splitlines():
        if not line[:1].isspace():  # a socket's line names its owners; its details follow, indented
            pids = [int(p) for p in _SOCKET.findall(line)]
            continue
        acked = _ACKED.search(line)
        for pid in pids if acked else []:
            totals[pid] = totals.get(pid, 0) + int(acked.group(1))  # type: ignore[union-attr]
    return totals


def _cpu_s(pids: list[int]) -> float:
    return sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids)


def measure(
    sizes: list[int], repeats: int, state: dict[str, torch.Tensor] | None = None
) -> list[dict[str, Any]]:
    """The broadcast to each R of `sizes`: time per version, bytes the sender and everyone moved, CPU."""
    state = state if state is not None else qwen_like_state()
    total = sum(t.numel() * t.element_size() for t in state.values())
    ctx = mp.get_context("spawn")
    channels = [(ctx.Queue(), ctx.Queue()) for _ in range(max(sizes))]
    procs = [
        ctx.Process(target=receiver_main, args=(f"w{i}", commands, results), daemon=True)
        for i, (commands, results) in enumerate(channels)
    ]
    for proc in procs:
        proc.start()
    rows = []
    try:
        pids = [results.get(timeout=120)[1] for _, results in channels]
        bucket_bytes = WeightSyncSettings().bucket_mb << 20
        for epoch, size in enumerate(sizes, start=1):
            with WeightSender(timeout_s=TIMEOUT_S, bucket_bytes=bucket_bytes) as sender:
                started = time.perf_counter()
                announcement = sender.announce(
                    state, version=0, epoch=epoch, members=[f"w{i}" for i in range(size)]
                )
                announce_s = time.perf_counter() - started
                row = _versions(sender, state, announcement, channels[:size], pids[:size], repeats)
            rows.append(row | {"receivers": size, "bytes": total, "announce_s": round(announce_s, 2)})
    finally:
        for commands, _ in channels:
            commands.put(None)
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return rows


def _versions(
    sender: WeightSender,
    state: dict[str, torch.Tensor],
    announcement: WeightAnnouncement,
    channels: list[tuple[Any, Any]],
    pids: list[int],
    repeats: int,
) -> dict[str, Any]:
    """Version 0 forms the group; versions 1..repeats are timed (the fastest counts, with the sender's
    and everyone's bytes and CPU of that version)."""
    me = os.getpid()
    timed: list[dict[str, float]] = []
    for version in range(repeats + 1):
        announcement = announcement.model_copy(update={"version": version})
        for commands, _ in channels:
            commands.put(announcement.model_dump_json())
        before, cpu_before = sent_bytes(), (_cpu_s([me]), _cpu_s(pids))
        report = sender.broadcast(state, announcement)
        for _, results in channels:
            assert results.get(timeout=TIMEOUT_S)[0] == "ok"
        after, cpu_after = sent_bytes(), (_cpu_s([me]), _cpu_s(pids))
        moved = {pid: after.get(pid, 0) - before.get(pid, 0) for pid in after}
        if version == 0:
            group_s = report.group_seconds
            continue
        timed.append(
            {
                "seconds": report.seconds,
                "transfer_s": report.transfer_seconds,
                "sender_gb": moved.get(me, 0) / GB,
                "wire_gb": sum(v for pid, v in moved.items() if pid in (me, *pids)) / GB,
                "sender_cpu_s": cpu_after[0] - cpu_before[0],
                "receivers_cpu_s": cpu_after[1] - cpu_before[1],
            }
        )
    best = min(timed, key=lambda t: t["seconds"])
    rounds = math.ceil(math.log2(len(channels) + 1))
    return {k: round(v, 3) for k, v in best.items()} | {"group_s": round(group_s, 2), "tree_rounds": rounds}
