"""`bench/learning_quality.py --quick`: the experiment's whole pipeline at the smoke scale — Lp-Reg and
its baseline GRPO through a real `sparkrl up` with the in-training evaluator, read back into a report with
a row per loss and its plots. (Two losses keep `make test` in budget; every loss of the registry trains
through DeepSpeed in test_learner_step.py, and `--quick` alone runs all seven.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _tiny import tiny_model_dir  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from learning_quality import QUICK  # noqa: E402
from lq_verdict import LABELS  # noqa: E402

LOSSES = ("grpo", "lp_reg")  # in the experiment's order


@pytest.mark.timeout(900)
def test_quick_runs_lp_reg_and_grpo_end_to_end(tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    out, runs = tmp_path / "report", tmp_path / "runs"
    command = [sys.executable, str(ROOT / "bench" / "learning_quality.py"), "--quick", "--losses", *LOSSES]
    done = subprocess.run(
        [*command, "--out", str(out), "--runs", str(runs)], capture_output=True, text=True, timeout=880
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(summary["runs"]) == sorted(f"{loss}-s0" for loss in LOSSES)

    report = (out / "report.md").read_text()
    rows = [line for line in report.splitlines() if re.match(r"\| .+ \(`[a-z_0-9]+`\) \|", line)]
    assert [re.search(r"\(`([a-z_0-9]+)`\)", row).group(1) for row in rows] == list(LOSSES)
    assert all(LABELS[loss] in report for loss in LOSSES) and "## Verdict" in report
    for image in ("heldout_pass.png", "entropy.png", "low_prob_share.png"):
        assert (out / image).stat().st_size > 1000 and f"]({image})" in report

    # The in-training evaluator saw the initial model and the final version of every run.
    for loss in LOSSES:
        versions = [
            json.loads(line)["policy_version"]
            for line in (runs / f"{loss}-s0" / "eval.jsonl").read_text().splitlines()
        ]
        assert versions[0] == 0 and versions[-1] == QUICK.steps and versions == sorted(versions)
