"""A rollout worker's score-and-publish of one prompt batch, this checkout against a git revision, in one
invocation.

    .venv/bin/python bench/publish_bench.py --baseline HEAD~1

What a wide run's worker does after generating, as `Worker._generate_score_publish` calls it: the batch's
completions scored (`score_groups`: one HTTP call to a real reward service, then each group built) and
the groups published with their prompts acknowledged (`publish_groups`, into a private redis-server).
The batch is the wide preset's: 16 countdown prompts × 16 answers of 3-8 tokens, top-20. Each side runs in
its own process from its own tree (the baseline's from `git archive`), alternating `--rounds` times, on
the same completions, reward service and Redis. Per side: wall and CPU milliseconds per batch — the
worker's process and Redis's (`INFO cpu`), both on the cores the fleet shares. Prints each round, the
medians and the ratios. Pause a running experiment first (`bench/hold_experiment.py stop`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bus_bench import start_private_redis
from reward_bench import _baseline_tree, _service

ROOT = Path(__file__).resolve().parents[1]

# Run inside each side's tree: only APIs both sides share (score_groups, publish_groups, the bus).
_SIDE = r"""
import json, sys, threading, time, types
import numpy as np, redis
from sparkrl.proto import Completion, Prompt, encode_message
from sparkrl.proto.testing import random_topk
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.reward_client import RewardClient
from sparkrl.services.common.settings import BusSettings, RolloutSettings
from sparkrl.services.rollout.batch import PromptBatch, score_groups
from sparkrl.services.rollout.publish import publish_groups

args = json.loads(sys.argv[1])
PROMPTS, N, K, VOCAB = 16, 16, 20, 512
cfg = RolloutSettings.model_validate({"sampling": {"n": N, "max_new_tokens": 24, "topk_logprobs": K}})
engine = types.SimpleNamespace(vocab_size=VOCAB)
reward = RewardClient(args["reward_url"])
settings = BusSettings(url=args["redis_url"], namespace=args["namespace"], trajectory_maxlen=1_000_000)
rng = np.random.default_rng(0)

def completion(T):
    topk_ids, topk_lp = random_topk(rng, T, K, VOCAB)
    ids = topk_ids[:, 0].copy()
    return Completion(token_ids=ids, logprobs=topk_lp[:, 0].copy(), topk_ids=topk_ids,
                      topk_logprobs=topk_lp, policy_versions=np.zeros(T, dtype=np.int32),
                      text=["(3 + 5) * 7", "3 * 5 + 7", "5 * 7 - 3"][int(rng.integers(0, 3))],
                      finish_reason="stop")

def prompt(b, i):
    return Prompt(prompt_id=f"bench-{args['namespace']}-{b}-{i}", text="Using 3, 5, 7, make 22.",
                  task="countdown", task_data={"numbers": [3, 5, 7], "target": 22},
                  source="countdown")

batches = [([prompt(b, i) for i in range(PROMPTS)],
            [[completion(int(rng.integers(3, 9))) for _ in range(N)] for _ in range(PROMPTS)])
           for b in range(args["batches"])]
server = redis.Redis.from_url(args["redis_url"])
wall = cpu = redis_cpu = 0.0
with RedisBus(settings) as bus:
    for b, (prompts, made) in enumerate(batches):
        for p in prompts:
            bus.publish_prompt(p.prompt_id, encode_message(p))
        entries = bus.read("prompts", "worker", PROMPTS, block_ms=0)
        batch = PromptBatch(entries, prompts, [[1, 2, 3, 4, 5, 6, 7, 8]] * PROMPTS)
        info = server.info("cpu")
        r0 = info["used_cpu_user"] + info["used_cpu_sys"]
        w0, c0 = time.perf_counter(), time.process_time()
        groups = score_groups(reward, engine, batch, made, cfg, "worker")
        out = publish_groups(bus, groups, batch.entries, threading.Event(), lambda left: None)
        w1, c1 = time.perf_counter(), time.process_time()
        info = server.info("cpu")
        if b:  # the first batch warms the connections
            wall, cpu = wall + w1 - w0, cpu + c1 - c0
            redis_cpu += info["used_cpu_user"] + info["used_cpu_sys"] - r0
        assert len(out.done) == PROMPTS, out
n = args["batches"] - 1
print(json.dumps({"wall_ms": 1000 * wall / n, "cpu_ms": 1000 * cpu / n,
                  "redis_cpu_ms": 1000 * redis_cpu / n}))
"""


@dataclass
class Side:
    wall_ms: float
    cpu_ms: float
    redis_cpu_ms: float


def _run_side(tree: Path | None, redis_url: str, reward_url: str, namespace: str, batches: int) -> Side:
    env = {**os.environ, "PYTHONPATH": str(tree) if tree else os.environ.get("PYTHONPATH", "")}
    spec = {"redis_url": redis_url, "reward_url": reward_url, "namespace": namespace, "batches": batches}
    done = subprocess.run([sys.executable, "-c", _SIDE, json.dumps(spec)], env=env, cwd=tree or ROOT,
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"a side failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return Side(**json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="HEAD", help="the git revision to compare with (default HEAD)")
    parser.add_argument("--batches", type=int, default=40, help="prompt batches per side and round")
    parser.add_argument("--rounds", type=int, default=3, help="runs per side, alternating")
    args = parser.parse_args()
    results: dict[str, list[Side]] = {"baseline": [], "this checkout": []}
    redis_process, redis_url = start_private_redis()
    try:
        with tempfile.TemporaryDirectory(prefix="publish-bench-") as tmp, _service(None) as (client, _):
            baseline = _baseline_tree(args.baseline, Path(tmp))
            print(f"{args.batches} batches of 16 prompts × 16 answers a side and round; "
                  f"baseline {args.baseline}")  # fmt: skip
            for round_ in range(args.rounds):
                for name, tree in (("baseline", baseline), ("this checkout", None)):
                    namespace = f"r{round_}-{'base' if tree else 'this'}"
                    side = _run_side(tree, redis_url, str(client.base_url), namespace, args.batches)
                    results[name].append(side)
                    print(f"  round {round_ + 1} {name:>13}: {side.wall_ms:6.1f} ms wall, {side.cpu_ms:6.1f} "
                          f"ms CPU, Redis {side.redis_cpu_ms:5.1f} ms CPU per batch")  # fmt: skip
    finally:
        redis_process.terminate()
        redis_process.wait(timeout=30)
    fields = ("wall_ms", "cpu_ms", "redis_cpu_ms")
    median = {
        name: Side(*(statistics.median(getattr(s, f) for s in sides) for f in fields))
        for name, sides in results.items()
    }
    for name, side in median.items():
        print(f"median {name:>13}: {side.wall_ms:6.1f} ms wall, {side.cpu_ms:6.1f} ms CPU, "
              f"Redis {side.redis_cpu_ms:5.1f} ms CPU per batch")  # fmt: skip
    base, this = median["baseline"], median["this checkout"]
    ratios = [this.wall_ms / base.wall_ms, this.cpu_ms / base.cpu_ms, this.redis_cpu_ms / base.redis_cpu_ms]
    print("ratio (this / baseline): wall ×{:.2f}, worker CPU ×{:.2f}, Redis CPU ×{:.2f}".format(*ratios))


if __name__ == "__main__":
    main()
