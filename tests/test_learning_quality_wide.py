"""`bench/learning_quality.py --wide` (issue 24): the report section written from the runs' own files, in
place in an existing report.md (the rest kept), and the experiment resumable.

The first test writes two tiny runs' files by hand (their numbers known, so the section's are checked
exactly); the second, slow, runs two real ones at the smoke scale and starts the experiment again."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _tiny import tiny_model_dir  # noqa: F401  (fixture)

from sparkrl.proto.telemetry import EvalRecord, StepMetrics

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from learning_quality import WIDE_BEGIN, WIDE_END, wide_section  # noqa: E402
from learning_quality_wide import WIDE_QUICK, Spec, finished, run_wide, specs  # noqa: E402

K_NEG = (24.0, 30.0, 36.0, 42.0)  # Lp-Reg's k per micro-batch, one a step: median 33, lowest 24
REG_TOKENS = (2.0, 4.0, 6.0, 8.0)  # a step's regularized tokens: 5 on average
OLD_REPORT = "# Learning quality\n\nThe explore experiment's report, kept as it is.\n"


def write_run(run_dir: Path, loss: str, pass1: float, steps: int = 4, rho: float = 0.01) -> None:
    """A finished run's files as `sparkrl up` leaves them: step rows, evaluations, summary, config."""
    run_dir.mkdir(parents=True)
    rows = []
    for step in range(1, steps + 1):
        metrics: dict[str, float | None] = {
            "loss/entropy": 1.0 - 0.1 * step,
            "explore/low_prob_share": 0.05,
            "rollout/tokens": 20_000.0,
        }
        hparams: dict[str, float | str] = {"loss": loss, "lr": 1e-3}
        if loss == "lp_reg":
            metrics |= {"loss/k_neg": K_NEG[step - 1], "loss/reg_tokens": REG_TOKENS[step - 1]}
            hparams |= {"rho": rho, "kappa": 0.02}
        row = StepMetrics(
            step=step, policy_version=step, time=1000.0 + 10.0 * step, metrics=metrics, hparams=hparams
        )
        rows.append(row.model_dump_json())
    (run_dir / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    evals = [
        EvalRecord(policy_version=v, time=1000.0 + v, task="countdown", problems=16, n=4, temperature=1.0,
                   greedy=pass1, pass_at={"1": pass1 * v / steps, "2": 0.5, "4": 0.6}, seconds=1.0)
        for v in (0, 2, steps)
    ]  # fmt: skip
    (run_dir / "eval.jsonl").write_text("".join(e.model_dump_json() + "\n" for e in evals))
    (run_dir / "summary.json").write_text(json.dumps({"steps": steps, "wall_seconds": 60.0}))
    (run_dir / "config").mkdir()
    learner = {"learner": {"loss": {"name": loss}, "skip_zero_advantage": False}}
    (run_dir / "config" / "learner.yaml").write_text(yaml.safe_dump(learner))


def args(runs: Path, out: Path, report_only: bool) -> argparse.Namespace:
    return argparse.Namespace(
        quick=True, out=out, runs=runs, losses=["lp_reg", "grpo"], seeds=None, steps=None,
        report_only=report_only, wide=True, rhos=[],
    )  # fmt: skip


def test_the_section_is_written_from_two_runs_files_and_replaced_in_place(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs, out = tmp_path / "runs", tmp_path / "report"
    write_run(runs / "lp_reg-s1", "lp_reg", pass1=0.4)
    write_run(runs / "grpo-s1", "grpo", pass1=0.3)
    out.mkdir()
    (out / "report.md").write_text(OLD_REPORT)

    run_wide(args(runs, out, report_only=True))
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sorted(summary["runs"]) == ["grpo-s1", "lp_reg-s1"]
    report = (out / "report.md").read_text()
    assert report.startswith(OLD_REPORT) and report.count(WIDE_BEGIN) == report.count(WIDE_END) == 1

    # A row per loss, mean ± std, and every run's row.
    rows = re.findall(r"^\| .+ \(`([a-z_]+)`\) \|", report, flags=re.M)
    assert rows == ["lp_reg", "grpo"] and "| 0.400 ± 0.000 |" in report
    assert re.search(r"^\| lp_reg-s1 \| 4 \| 10\.0 \| 0 \| 0\.400 \|", report, flags=re.M)
    assert re.search(r"^\| grpo-s1 \| 4 \|", report, flags=re.M)
    # k per micro-batch from the step rows (not computed from the settings), regularized tokens per step.
    assert "median 33, lowest 24, ≥ 20 at every step; of those candidates 5.0 a step" in report
    assert "ρ = 1%, κ = 2%" in report and "`learner.skip_zero_advantage: false` in every run" in report
    assert re.search(r"^\| 1% \(`lp_reg-s1`\) \| 33\.0 \| 5\.0 \| 0\.900 → 0\.600 \|", report, flags=re.M)
    for image in ("wide_heldout_pass.png", "wide_entropy.png", "wide_low_prob_share.png", "wide_dose.png"):
        assert (out / image).stat().st_size > 1000 and f"]({image})" in report

    # Written again: the same single section; the explore writer keeps it when it rewrites the file.
    run_wide(args(runs, out, report_only=True))
    again = (out / "report.md").read_text()
    assert again == report
    block = wide_section(out / "report.md")
    assert block.strip().startswith(WIDE_BEGIN) and block.strip().endswith(WIDE_END)


def test_what_counts_as_finished_and_the_plan(tmp_path: Path) -> None:
    write_run(tmp_path / "done", "grpo", pass1=0.3, steps=4)
    write_run(tmp_path / "cut", "grpo", pass1=0.3, steps=2)  # summarized when stopped at step 2
    assert finished(tmp_path / "done", 4) and not finished(tmp_path / "cut", 4)
    assert not finished(tmp_path / "absent", 4)
    names = [s.name for s in specs(("lp_reg", "grpo", "kl_cov"), (1, 2), (0.03, 0.10))]
    assert names == [
        "lp_reg-s1", "grpo-s1", "kl_cov-s1", "lp_reg-s2", "grpo-s2", "kl_cov-s2",
        "lp_reg-rho0.03-s1", "lp_reg-rho0.10-s1",
    ]  # fmt: skip
    assert Spec("lp_reg", 1, 0.1).extra == ("learner.loss.rho=0.1",)
    (tmp_path / "cut").rename(tmp_path / "grpo-s1")
    only_grpo = argparse.Namespace(**{**vars(args(tmp_path, tmp_path / "out", True)), "losses": ["grpo"]})
    with pytest.raises(SystemExit, match="not finished: grpo-s1"):
        run_wide(only_grpo)  # --report-only names the runs still to finish


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_real_runs_then_the_experiment_started_again_keeps_them(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    out, runs = tmp_path / "report", tmp_path / "runs"
    command = [sys.executable, str(ROOT / "bench" / "learning_quality.py"), "--wide", "--quick"]
    command += ["--losses", "lp_reg", "grpo", "--rhos", "--out", str(out), "--runs", str(runs)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=580)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for name in ("lp_reg-s1", "grpo-s1"):
        versions = [json.loads(line)["policy_version"] for line in (runs / name / "eval.jsonl").open()]
        assert versions[0] == 0 and versions[-1] == WIDE_QUICK.steps
        assert f"| {name} | {WIDE_QUICK.steps} |" in (out / "report.md").read_text()

    again = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count("finished before, kept") == 2


def test_the_wide_preset_is_the_papers_lp_reg_with_a_whole_step_in_one_micro_batch(
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    """ρ 1% and κ 2% (the paper's, untuned), entropy over the same tokens for every loss, ≥ 300 steps, and
    Lp-Reg's k counted over a whole step: 256 × 16 rows of the longest prompt plus the longest answer fit
    one micro-batch (batch.py packs B · L positions)."""
    import itertools

    from transformers import AutoTokenizer

    from sparkrl.services.common.datasets import countdown_prompts
    from sparkrl.services.common.modeling import apply_chat_template_if_any
    from sparkrl.services.common.settings import load_settings

    wide = load_settings("explore-wide")
    learner, sampling = wide.learner, wide.rollout.sampling
    assert (learner.loss.name, learner.loss.rho, learner.proxy_kappa) == ("lp_reg", 0.01, 0.02)
    assert learner.skip_zero_advantage is False and learner.max_steps >= 300
    assert learner.prompts_per_step * sampling.n == 8 * 32 * 16  # 8× explore's 32 prompts × 16
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    prompts = itertools.islice(countdown_prompts(wide.prompts), 2000)
    longest = max(len(apply_chat_template_if_any(tokenizer, p.text or "")) for p in prompts)
    rows = learner.prompts_per_step * sampling.n
    assert rows * (longest + sampling.max_new_tokens) <= learner.micro_batch_tokens
