"""How the shared parts grow with the fleet: the bus and the learner's intake, the weight broadcast, the
control plane. Tables per fleet size, then one JSON line.

    .venv/bin/python bench/fleet_scale.py                      # the full run (≈ 10 min here)
    .venv/bin/python bench/fleet_scale.py --baseline REF       # + the intake as commit REF, per N, before
    .venv/bin/python bench/fleet_scale.py --quick              # the smoke: small N, small state (≈ 30 s)

1. Intake (fleet_intake.py, fleet_bus.py): N simulated GPU workers, each publishing `--rate` groups/s
   (default: `--worker-tokens-per-s` / the group's generated tokens) of 8 samples × 1,024 tokens, top-20
   over a 151,936-token vocabulary, through the product's bus into a private Redis run as `sparkrl up`
   runs its own (append-only file, fsync always); the learner's real intake drains it (collector,
   decode, validation, collation, journal, trained marks, ack; no update). Then the same fleet publishing
   as fast as the bus takes it: the intake's ceiling, profiled with py-spy (wall time, idle included).
2. Broadcast (fleet_broadcast.py): a Qwen2.5-0.5B-shaped bf16 state to R receivers over gloo.
3. Control plane (fleet_control.py): the control service's reads and Prometheus' scrape with N workers
   beating, and the learner's fleet view.

With `--baseline REF`, each fleet size runs the intake of REF (a git worktree, bench/e2e_baseline.py) and
this checkout's back to back, so the change between them is measured in one invocation.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

import fleet_broadcast
import fleet_bus
import fleet_control
from e2e_baseline import checkout, commit_of, remove
from fleet_intake import Redis, Run, Shape, scratch, start_redis

# One H100 running a 7-8B model under vLLM: ~12,500 output tokens/s (Llama 3.1 8B, BF16; see
# docs/benchmarks.md, "How far one learner goes"), for this bench a worker's default pace.
WORKER_TOKENS_PER_S = 12_500.0


def intake_sweep(server: Redis, args: argparse.Namespace, baseline: Path | None) -> dict[str, Any]:
    """Each fleet size at the workers' rate, then flat out; with `baseline`, REF's intake first each time."""
    shape = Shape()
    rate = args.rate or args.worker_tokens_per_s / shape.generated
    sides = {"baseline": fleet_bus.Side(4, baseline)} if baseline else {}
    sides["this"] = fleet_bus.Side(4)
    points: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    profiles = scratch("fleet-profiles-")
    # Paced sizes once each; flat out `ceiling_rounds` times, the variants' order alternating per round
    # (a run right after another is not on the same footing: the machine is shared).
    plan = [(w, list(sides)) for w in args.sizes]
    plan += [(0, list(sides)[:: 1 if r % 2 == 0 else -1]) for r in range(args.ceiling_rounds)]
    try:
        for workers, order in plan:
            for name in order:
                run = Run(
                    server.url, f"fleet-{name}-{workers}", shape, rate if workers else None, *args.intake
                )
                profile = profiles / f"{name}-{workers}.txt"
                window = (args.warmup, args.seconds)
                size = workers or max(args.sizes)
                point = fleet_bus.measure(server, sides[name], run, size, window, profile)
                point["flat_out"] = not workers
                point["profile"] = fleet_bus.profile_summary(profile) if profile.exists() else {}
                profile.unlink(missing_ok=True)
                points[name].append(point)
                done = f"{point['read_gps']:.1f} groups/s read, {point['out_gps']:.1f} collated"
                print(f"  {name}, N = {workers or 'flat out'}: {done}", flush=True)
    finally:
        for side in sides.values():
            side.close()
        shutil.rmtree(profiles, ignore_errors=True)
    print()
    table(INTAKE_HEADERS, [point_row(name, p) for name, rows in points.items() for p in rows])
    return {"rate_gps": rate, "shape": shape.__dict__, "points": points}


def table(headers: list[str], rows: list[list[Any]]) -> None:
    """Right-aligned columns as wide as their widest cell."""
    cells = [headers, *[[str(cell) for cell in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))


INTAKE_HEADERS = [
    "intake", "N", "offered g/s", "in g/s", "read g/s", "collated g/s", "in MB/s", "out MB/s",
    "Redis MB mean/max", "stream max", "CPU ms/group: intake", "Redis", "simulator", "read age ms p50/p99",
    "collated age p50/p99", "publish ms p50",
]  # fmt: skip


def point_row(name: str, p: dict[str, Any]) -> list[Any]:
    cpu = p["cpu_ms_per_group"]
    return [
        name,
        p["workers"],
        "flat out" if p["flat_out"] else f"{p['offered_gps']:.1f}",
        f"{p['in_gps']:.1f}",
        f"{p['read_gps']:.1f}",
        f"{p['out_gps']:.1f}",
        f"{p['in_mbps']:.1f}",
        f"{p['out_mbps']:.1f}",
        f"{p['redis_memory_mb']:.0f}/{p['redis_memory_mb_max']:.0f}",
        p["stream_max"],
        f"{cpu['intake']:.1f}",
        f"{cpu['redis']:.1f}",
        f"{cpu['simulator']:.1f}",
        "{:.0f}/{:.0f}".format(*p["read_ms"]),
        "{:.0f}/{:.0f}".format(*p["collated_ms"]),
        f"{p['publish_call_ms']:.1f}",
    ]


def saturation(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The first fleet size whose groups the intake no longer reads as fast as the workers offer them (a
    tenth short), else the flat-out run; with that run's profile. The ceiling: the median flat-out
    round's read rate."""
    paced = [p for p in points if not p["flat_out"]]
    first = next((p for p in paced if p["read_gps"] < 0.9 * p["offered_gps"]), None)
    flats = sorted((p for p in points if p["flat_out"]), key=lambda p: p["read_gps"])
    flat = flats[len(flats) // 2]
    at = first or flat
    busiest = max(at["cpu_share"], key=at["cpu_share"].get)
    return {
        "workers": at["workers"] if first else None,
        "ceiling_gps": flat["read_gps"],
        "ceiling_rounds_gps": [p["read_gps"] for p in flats],
        "ceiling_profile": flat["profile"],
        "busiest_process": busiest,
        "cpu_share": at["cpu_share"],
        "profile": at["profile"],
        "redis_ms": dict(sorted(at["redis_ms"].items(), key=lambda kv: -kv[1])[:6]),
    }


def print_saturation(name: str, s: dict[str, Any]) -> None:
    where = f"at N = {s['workers']}" if s["workers"] else "not within the sizes run"
    rounds = ", ".join(f"{g:.1f}" for g in s["ceiling_rounds_gps"])
    print(f"\n{name}: saturates {where}; flat out it reads {s['ceiling_gps']:.1f} groups/s ({rounds})")
    print(f"  CPU share of a core: {s['cpu_share']}  (busiest: {s['busiest_process']})")
    print(f"  the intake's wall time by call (py-spy), there: {s['profile'].get('calls', {})}")
    print(f"  flat out: {s['ceiling_profile'].get('calls', {})}")
    print(f"  Redis' time by command (ms in the window): {s['redis_ms']}")


def broadcast(args: argparse.Namespace) -> list[dict[str, Any]]:
    state = fleet_broadcast.qwen_like_state(**({"layers": 2, "vocab": 8192} if args.quick else {}))
    rows = fleet_broadcast.measure(args.receivers, args.repeats, state)
    print()
    headers = ["R", "GB", "s/version", "transfer s", "tree rounds", "sender GB", "wire GB", "sender CPU s"]
    headers += ["receivers CPU s", "GB/s each"]
    table(headers, [broadcast_row(r) for r in rows])
    return rows


def broadcast_row(r: dict[str, Any]) -> list[Any]:
    gb = r["bytes"] / 1e9
    return [
        r["receivers"],
        f"{gb:.2f}",
        f"{r['seconds']:.2f}",
        f"{r['transfer_s']:.2f}",
        r["tree_rounds"],
        f"{r['sender_gb']:.2f}",
        f"{r['wire_gb']:.2f}",
        f"{r['sender_cpu_s']:.2f}",
        f"{r['receivers_cpu_s']:.2f}",
        f"{gb / r['seconds']:.2f}",
    ]


def control(server: Redis, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = [fleet_control.measure(server, n, args.calls) for n in args.control_workers]
    print()
    cells = []
    for row in rows:
        for name, r in row["requests"].items():
            cpu = f"{r['cpu_ms']:.1f}" if "cpu_ms" in r else "(learner's)"
            cells.append([row["workers"], name, f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}", cpu])
        share = f"Redis {100 * row['redis_cpu_share_heartbeats']:.1f}% of a core"
        cells.append([row["workers"], f"heartbeats ({row['heartbeats_per_s']:.0f}/s)", share, "", ""])
    table(["N", "request", "p50 ms", "p99 ms", "control CPU ms"], cells)
    return rows


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small N, short windows, a small state")
    sizes = [1, 2, 4, 8, 16, 32, 64]
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=sizes)
    parser.add_argument("--worker-tokens-per-s", type=float, default=WORKER_TOKENS_PER_S)
    parser.add_argument("--rate", type=float, help="groups/s per worker (default: from the tokens/s)")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured window per fleet size")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--receivers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=2, help="timed versions per R (the fastest counts)")
    parser.add_argument("--control-workers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    parser.add_argument("--calls", type=int, default=100, help="requests of each kind")
    parser.add_argument(
        "--ceiling-rounds", type=int, help="flat-out runs per intake (default 3 with --baseline)"
    )
    parser.add_argument("--step-groups", type=int, default=64, help="the intake's learner.prompts_per_step")
    parser.add_argument("--parts", default="intake,broadcast,control")
    parser.add_argument(
        "--aof-fsync", choices=["always", "everysec"], default="always", help="bus.aof_fsync of the Redis"
    )
    parser.add_argument("--baseline", help="also run the intake of this commit, before this one's")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.seconds, args.warmup = [2], 2.0, 1.0
        args.receivers, args.repeats, args.control_workers, args.calls = [1, 2], 1, [4], 5
        args.step_groups = 4
    args.ceiling_rounds = args.ceiling_rounds or (4 if args.baseline and not args.quick else 1)
    args.intake = (
        args.step_groups,
        16_384,
        512,
    )  # groups per step, micro-batch tokens, bus.trajectory_maxlen
    return args


def main() -> None:
    args = parse()
    started = time.monotonic()
    summary: dict[str, Any] = {"quick": args.quick, "aof_fsync": args.aof_fsync}
    parts = set(args.parts.split(","))
    server = start_redis(args.aof_fsync)
    workdir = scratch("fleet-baseline-") if args.baseline else None
    try:
        if "intake" in parts:
            code = checkout(args.baseline, workdir) if workdir and args.baseline else None
            intake = intake_sweep(server, args, code)
            summary["intake"] = intake
            for name, points in intake["points"].items():
                summary[f"saturation_{name}"] = sat = saturation(points)
                print_saturation(f"intake ({name})", sat)
            if args.baseline:
                summary["baseline"] = commit_of(args.baseline)
                summary["ratio_ceiling_vs_baseline"] = round(
                    summary["saturation_this"]["ceiling_gps"]
                    / max(summary["saturation_baseline"]["ceiling_gps"], 1e-9),
                    2,
                )
        if "broadcast" in parts:
            summary["broadcast"] = broadcast(args)
        if "control" in parts:
            summary["control"] = control(server, args)
    finally:
        server.stop()
        if workdir is not None:
            remove(workdir)
            shutil.rmtree(workdir, ignore_errors=True)
    summary["bench_seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
