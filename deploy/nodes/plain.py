"""The plain layout across the bed, as docs/deployment.md types it: Redis, reward, control, the feeder and
the learner's rank 0 on A, rank 1 on B (torchrun --nnodes=2 over the bridge), a rollout worker on C that
has no model of its own; then the document's one-step equality, one rank against two across the bridge."""

from __future__ import annotations

import json
import subprocess
import time

import torch
from observe import SmokeFailed, placement, step_times, trained_once
from runner import Smoke, alive, say, tail

PART = "Plain"
STEPS = 8  # learner.max_steps of this run
TOLERANCE = 1e-5  # tests/test_learner_ranks.py's: parameters after the step, absolute


def run_plain(s: Smoke) -> dict:
    model = s.root / ".cache" / "tiny-countdown"
    for letter in ("A", "B"):
        # Minutes on a busy machine when not built yet (`make nodes-smoke` builds it first).
        s.run(
            PART,
            "A and B",
            "build-tiny-model",
            on=letter,
            label=f"plain-model-{letter.lower()}",
            timeout_s=900,
        )
    s.run(PART, "A", "config show", on="A", label="plain-settings")
    cluster, run_dir = s.shared / "cluster.yaml", s.shared / "runs" / "cluster"
    a = s.start(PART, "A", "torchrun", on="A", label="plain-a")
    b = s.start(PART, "B", "torchrun", on="B", label="plain-b")
    c = s.start(PART, "C", "sparkrl rollout", on="C", label="plain-c", hide=[model])
    watch = s.watch(cluster, "plain-watch", env_file=s.secrets / "env")
    started = time.time()

    def running() -> None:
        for proc, label in ((b, "plain-b"), (c, "plain-c")):
            alive(proc, label, s.log(label))

    watch.until("the learner's step 2", lambda w: (w.get("learner") or {}).get("step", 0) >= 2, 420, running)
    where, wide, others = placement(s.bed.nodes, {})
    say("placement (plain):\n  " + "\n  ".join(where))
    say("on every interface, not sparkrl's (torch's, Ray's own): " + ("; ".join(others) or "none"))
    try:
        code = a.wait(300)
    except subprocess.TimeoutExpired:
        raise SmokeFailed(
            f"the learner did not finish {STEPS} steps in 300 s:\n{tail(s.log('plain-a'))}"
        ) from None
    if code != 0 or b.wait(60) != 0:
        raise SmokeFailed(f"torchrun exited {code} on A, {b.returncode} on B:\n{tail(s.log('plain-a'))}")
    final = watch.until(
        "worker-c to hold the final version",
        lambda w: (w.get("workers", {}).get("worker-c") or {}).get("version") == w.get("announced") == STEPS,
        60,
        lambda: alive(c, "plain-c", s.log("plain-c")),
    )
    status = s.run(PART, "any", "sparkrl stop", on="C", label="plain-steer")
    audit = json.loads(
        s.own(
            "A",
            f"set -a; . {s.secrets}/env; set +a\nSETTINGS={cluster} python deploy/docker/audit_run.py",
            "audit",
        )
    )
    if not audit["ok"]:
        raise SmokeFailed(f"the audit of {run_dir} found: {audit['problems']}")
    if c.wait(60) != 0:
        raise SmokeFailed(f"worker-c did not stop cleanly after `sparkrl stop`:\n{tail(s.log('plain-c'))}")
    steps, groups = trained_once(run_dir)
    rank1, worker = s.log("plain-b").read_text(), s.log("plain-c").read_text()
    fetched = "model from the learner at http://198.18.0.1:29601" in worker
    if "learner rank 1 of 2 up" not in rank1 or not fetched or "worker-c" not in status:
        raise SmokeFailed(
            f"rank 1 on B up: {'learner rank 1 of 2 up' in rank1}; worker-c fetched A's model over HTTP: "
            f"{fetched}; `sparkrl status` from C named worker-c: {'worker-c' in status}"
        )
    if wide:
        raise SmokeFailed("listening on every interface: " + "; ".join(wide))
    s.end_nodes()
    times = step_times(run_dir)
    return {
        "placement": where,
        "others_on_every_interface": others,
        "steps": steps,
        "groups_trained_once": groups,
        "audit": audit,
        "worker_c_final_version_at_s": round(final - started, 1),
        "seconds": round(times[-1][1] - started, 1) if times else None,
    }


def _dp_step(s: Smoke, out: str, on: str, rank: int | None) -> str:
    """tests/_dp_step.py (the product's trainer, one step on fixed groups): alone, or one rank of two."""
    step = f"tests/_dp_step.py --model .cache/tiny-countdown --out {out} --zero 2"
    if rank is None:
        return f"OMP_NUM_THREADS=1 python {step}"
    return (
        f"OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth0 torchrun --nnodes=2 --node-rank={rank} "
        f"--nproc-per-node=1 --master-addr={s.node('A').address} --master-port=29500 {step}"
    )


def run_equality(s: Smoke) -> dict:
    """One optimizer step on the same fixed groups: one rank on A, and one rank on A plus one on B over the
    bridge; every parameter after it, and the step's statistics, compared."""
    out = s.work / "equality"
    out.mkdir(parents=True, exist_ok=True)
    s.own("A", "sparkrl build-tiny-model --out .cache", "equality-model")  # built already after `plain`
    began = time.monotonic()
    s.own("A", _dp_step(s, f"{out}/one.pt", "A", None), "equality-one")
    one_s = time.monotonic() - began
    b = s.bed.popen(
        "node-b",
        f"cd {s.root} && source .venv/bin/activate && " + _dp_step(s, f"{out}/two.pt", "B", 1),
        s.log("equality-two-b"),
        s.env(),
    )
    s.own("A", _dp_step(s, f"{out}/two.pt", "A", 0), "equality-two-a")
    if b.wait(120) != 0:
        raise SmokeFailed(f"rank 1 on B exited {b.returncode}:\n{tail(s.log('equality-two-b'))}")
    one, two = torch.load(out / "one.pt"), torch.load(out / "two.pt")
    if two["size"] != 2:
        raise SmokeFailed(f"the two-node step ran on {two['size']} ranks")
    diff = max(float((two["weights"][k] - w).abs().max()) for k, w in one["weights"].items())
    stats = {k: (one["stats"][k], two["stats"][k]) for k in ("loss", "grad_norm", "tokens")}
    if diff > TOLERANCE or any(abs(x - y) > TOLERANCE * max(1.0, abs(x)) for x, y in stats.values()):
        raise SmokeFailed(f"two nodes' step differs from one rank's: max |Δparameter| {diff:.3g}, {stats}")
    s.end_nodes()
    return {
        "max_abs_param_diff": diff,
        "tolerance": TOLERANCE,
        "stats": stats,
        "one_rank_s": round(one_s, 1),
        "two_nodes_s": round(time.monotonic() - began - one_s, 1),
    }
