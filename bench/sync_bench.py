"""Weight-sync throughput: the learner (this process) broadcasts a ~224 MB state dict to 1 and 2 receiver
processes over gloo, in buckets of 16, 64 and 256 MB, against the baseline: one plain broadcast of the
same bytes as one pre-touched flat buffer on a raw `ProcessGroupGloo` (no packing, no checksum).

Receivers reuse their buckets between versions (`reuse_buffers`; one row shows fresh buffers).
`transfer` is first bucket sent → last bucket delivered (payload bytes / seconds, whatever the number of
receivers); `e2e` is the whole `broadcast` call, which also waits for every receiver's checksum (hashed
as buckets arrive, on every core, so on a slow CPU it is the bound). Prints a table, then one JSON line.

    .venv/bin/python bench/sync_bench.py [--repeats 2]
"""

import argparse
import json
import multiprocessing as mp
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from sparkrl.proto import WeightAnnouncement
from sparkrl.services.common.weight_sync import WeightReceiver, WeightSender

MB = 1 << 20
BUCKET_SIZES_MB = (16, 64, 256)
TIMEOUT_S = 60.0
TIMEOUT = timedelta(seconds=TIMEOUT_S)


def model_like_state(layers: int = 24) -> dict[str, torch.Tensor]:
    """A transformer-shaped state dict: an embedding, big projections and small norms (float32)."""
    state = {"embed.weight": torch.randn(8192, 1024)}  # 32 MB
    for layer in range(layers):
        state[f"layers.{layer}.proj.weight"] = torch.randn(2048, 1024)  # 8 MB
        state[f"layers.{layer}.norm.weight"] = torch.randn(1024)
    return state


def receiver_main(worker_id: str, commands: Any, results: Any) -> None:
    receivers = {
        reuse: WeightReceiver(worker_id, timeout_s=TIMEOUT_S, reuse_buffers=reuse) for reuse in (True, False)
    }
    results.put("ready")
    while (command := commands.get()) is not None:
        if command[0] == "plain":
            plain_receive(*command[1:])
        else:
            announcement_json, reuse = command
            receivers[reuse].receive(WeightAnnouncement.model_validate_json(announcement_json))
        results.put("ok")
    for receiver in receivers.values():
        receiver.close()


def plain_group(store: dist.Store, rank: int) -> Any:
    return dist.ProcessGroupGloo(dist.PrefixStore("plain/", store), rank, 2, TIMEOUT)


def plain_receive(port: int, nbytes: int, repeats: int) -> None:
    """The baseline's receiver: one buffer, touched once, received into `repeats` times."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    group = plain_group(store, rank=1)
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    for _ in range(repeats):
        group.broadcast(buffer, 0).wait()


def plain_broadcast_gbps(worker: tuple[Any, Any], nbytes: int, repeats: int) -> float:
    """Baseline: one flat, pre-touched buffer, one raw gloo broadcast to one receiver, best of `repeats`."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    commands, results = worker
    commands.put(("plain", store.port, nbytes, repeats))
    group = plain_group(store, rank=0)
    buffer = torch.ones(nbytes, dtype=torch.uint8)
    best = 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        group.broadcast(buffer, 0).wait()
        best = max(best, nbytes / (time.perf_counter() - started) / 1e9)
    assert results.get(timeout=TIMEOUT_S) == "ok"
    return best


def measure(
    workers: list[tuple[Any, Any]],
    state: dict[str, torch.Tensor],
    bucket_bytes: int,
    repeats: int,
    reuse_buffers: bool = True,
) -> dict[str, float]:
    """Best transfer and end-to-end GB/s over `repeats` broadcasts (the first also forms the group, which
    `transfer` excludes and `e2e` includes)."""
    members = [f"w{i}" for i in range(len(workers))]
    best = {"transfer_gbps": 0.0, "e2e_gbps": 0.0}
    with WeightSender(timeout_s=TIMEOUT_S, bucket_bytes=bucket_bytes) as sender:
        announcement = sender.announce(state, version=0, epoch=1, members=members)
        for version in range(repeats):
            announcement = announcement.model_copy(update={"version": version})
            for commands, _ in workers:
                commands.put((announcement.model_dump_json(), reuse_buffers))
            report = sender.broadcast(state, announcement)
            for _, results in workers:
                assert results.get(timeout=TIMEOUT_S) == "ok"
            best["transfer_gbps"] = max(best["transfer_gbps"], report.gbps)
            best["e2e_gbps"] = max(best["e2e_gbps"], report.bytes / report.seconds / 1e9)
    return best


def print_row(receivers: int, bucket: str, result: dict[str, float], note: str = "") -> None:
    print(f"{receivers:>9} {bucket:>9} {result['transfer_gbps']:>13.2f} {result['e2e_gbps']:>9.2f}{note}")


def run(repeats: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    workers = [(ctx.Queue(), ctx.Queue()) for _ in range(2)]
    processes = [
        ctx.Process(target=receiver_main, args=(f"w{i}", commands, results), daemon=True)
        for i, (commands, results) in enumerate(workers)
    ]
    for process in processes:
        process.start()
    try:
        for _, results in workers:
            assert results.get(timeout=120) == "ready"
        state = model_like_state()
        total = sum(t.numel() * t.element_size() for t in state.values())
        print(f"state dict: {len(state)} tensors, {total / MB:.0f} MB")
        print(f"{'receivers':>9} {'bucket MB':>9} {'transfer GB/s':>13} {'e2e GB/s':>9}")
        summary: dict[str, float] = {}
        for receivers in (1, 2):
            for bucket_mb in BUCKET_SIZES_MB:
                result = measure(workers[:receivers], state, bucket_mb * MB, repeats)
                print_row(receivers, str(bucket_mb), result)
                key = "gbps_1_receiver" if receivers == 1 else "gbps_2_receivers"
                summary[key] = max(summary.get(key, 0.0), result["transfer_gbps"])
                summary[f"{key}_{bucket_mb}mb"] = round(result["transfer_gbps"], 3)
        fresh = measure(workers[:1], state, 64 * MB, repeats, reuse_buffers=False)
        print_row(1, "64", fresh, "  (fresh receive buffers every version: page faults)")
        summary["gbps_1_receiver_64mb_fresh_buffers"] = fresh["transfer_gbps"]
        # Through the sender, one flat tensor: one zero-copy bucket, checksums.
        flat = {"flat": torch.cat([t.reshape(-1) for t in state.values()])}
        print_row(1, "1 flat", measure(workers[:1], flat, total, repeats))
        baseline = plain_broadcast_gbps(workers[0], total, repeats)
        print_row(1, "plain", {"transfer_gbps": baseline, "e2e_gbps": baseline}, "  (baseline: raw gloo)")
        summary["baseline_gbps"] = baseline
        summary["bytes"] = total
        return {key: round(value, 3) for key, value in summary.items()}
    finally:
        for commands, _ in workers:
            commands.put(None)
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="broadcasts per configuration (best counts)")
    args = parser.parse_args()
    started = time.monotonic()
    summary = run(args.repeats)
    summary["bench_seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
