"""`bench/gpu_check.sh --device cpu`: the GPU check's reduced form runs here and prints its one JSON line
(on a GPU machine, `bash bench/gpu_check.sh` is the same script at full size)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from _tiny import CACHE_DIR, tiny_model_dir  # noqa: F401  (fixture: the model is built once, reused)
from conftest import clean_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_the_cpu_form_prints_one_json_line_with_every_check(tiny_model_dir: Path) -> None:  # noqa: F811
    env = clean_env() | {"GPU_CHECK_DIR": str(CACHE_DIR)}
    done = subprocess.run(
        [
            "bash",
            str(ROOT / "bench" / "gpu_check.sh"),
            "--device",
            "cpu",
            "--tokens",
            "64",
            "--broadcast-mb",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout + done.stderr[-3000:]
    report = json.loads(lines[0])
    checks = report["checks"]
    broadcasts = {f"broadcast_{backend}" for backend in ("gloo", "nccl", "nccl4py")}
    assert set(checks) == {"env", "torch_engine", "learner_step", "lp_reg", "logprob_memory"} | broadcasts
    assert {c["status"] for c in checks.values()} <= {"ok", "skipped", "failed"}
    failed = {name: c["reason"] for name, c in checks.items() if c["status"] == "failed"}
    assert report["ok"] and not failed and done.returncode == 0, failed
    assert checks["lp_reg"]["shape"][-1] == 151_936 and checks["lp_reg"]["max_abs_logits_vs_topk"] < 1e-4
    assert checks["broadcast_gloo"]["gbps"] > 0
    assert checks["broadcast_nccl"]["status"] == "skipped" and checks["broadcast_nccl"]["reason"]
