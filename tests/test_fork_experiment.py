"""The planted-fork experiment of issue 47 (bench/fork_experiment.py, fork_probe.py, fork_report.py): every
arm on-policy with a seed's prompts and sampling the same in every arm, the fork's numbers as defined, each
seed's fate and the pre-registered predictions from hand-written records with known numbers, the section
written in place; and (slow) a real run at the smoke scale, recorded, then skipped from its record alone."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparkrl.proto.telemetry import EvalRecord, StepMetrics
from sparkrl.services.common.settings import load_settings

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from fork_experiment import ARMS, CHECKPOINT_EVERY, RHO, Spec, overrides, plan  # noqa: E402
from fork_probe import fork_numbers, probe_problems  # noqa: E402
from fork_report import BEGIN, END, EXTINCT, fate, verdicts, write_report  # noqa: E402
from fork_task import SPARK  # noqa: E402

from sparkrl.services.common.tiny_model import build_tokenizer  # noqa: E402


def test_every_arm_runs_on_policy_and_a_seed_samples_alike_in_every_arm(tmp_path: Path) -> None:
    paths = (tmp_path / "model", tmp_path / "train.jsonl", tmp_path / "heldout.jsonl")
    specs = plan((1, 2))
    assert len(specs) == 2 * 2 * len(ARMS) and specs[0] == Spec("tail", "grpo", 1)  # seed-major, tail first
    by_arm: dict[str, list[str]] = {}
    for spec in specs:
        given = overrides(spec, 300, *paths)
        cfg = load_settings("onpolicy", given)
        assert cfg.learner.max_staleness == 0 and cfg.rollout.lockstep_groups == cfg.learner.prompts_per_step
        assert (cfg.prompts.seed, cfg.rollout.sampling.seed, cfg.learner.seed) == (spec.seed,) * 3
        assert cfg.learner.checkpoint_every == CHECKPOINT_EVERY and cfg.learner.proxy_source == "logits"
        assert cfg.prompts.task == cfg.eval.task == "math" and cfg.eval.path == str(paths[2])
        loss = cfg.learner.loss
        assert loss.name == {"grpo": "grpo", "dppo": "dppo"}.get(spec.arm, "lp_reg")
        if spec.arm.startswith("lpreg"):
            assert loss.rho == RHO[spec.condition] and loss.beta == (0.0 if spec.arm == "lpreg-b0" else 1.0)
        if spec.condition == "tail" and spec.seed == 1:
            by_arm[spec.arm] = [o for o in given if not o.startswith("learner.loss.")]
    # The arms of a seed differ in their loss alone.
    assert all(rest == by_arm["grpo"] for rest in by_arm.values())


class _Logits(torch.nn.Module):
    """A model whose next-token logits are fixed: the fork's numbers are then known by hand."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, input_ids: torch.Tensor) -> object:
        out = self.logits.expand(len(input_ids), input_ids.shape[1], -1)
        return type("Out", (), {"logits": out})()


def test_the_fork_numbers_are_the_sparks_probability_and_the_mass_min_p_keeps() -> None:
    tokenizer = build_tokenizer()
    spark = tokenizer.convert_tokens_to_ids(SPARK)
    probs = torch.full((len(tokenizer),), 0.30 / (len(tokenizer) - 4))  # a flat tail of 0.30
    probs[[tokenizer.convert_tokens_to_ids(d) for d in "012"]] = 0.20  # three answers at 0.2 each
    probs[spark] = 0.10  # the spark: kept (0.10 ≥ κ · 0.2 = 0.004); each tail token (0.0012) is not
    probs /= probs.sum()
    kept = [tokenizer.convert_tokens_to_ids(d) for d in "012"] + [spark]
    numbers = fork_numbers(_Logits(probs.log()), tokenizer, probe_problems({"n_digits": 5}, 4), kappa=0.02)
    assert numbers["p_spark"] == pytest.approx(float(probs[spark]), rel=1e-5)
    assert numbers["z_kept_mass"] == pytest.approx(float(probs[kept].sum()), rel=1e-5)
    assert 0.6 < numbers["z_kept_mass"] < 0.75  # the tail, ≈ 0.3, is what min-p drops


def _record(records: Path, spec: Spec, p_spark: list[float], reward: float, heldout: float) -> None:
    """A record as fork_experiment.py writes one: a probe every 10 steps, flat step rows."""
    folder = records / spec.name
    folder.mkdir(parents=True)
    about = {"run": spec.name, "spec": {"condition": spec.condition, "arm": spec.arm, "seed": spec.seed}}
    (folder / "record.json").write_text(json.dumps(about | {"steps": 10 * (len(p_spark) - 1)}))
    probe = [{"step": 10 * i, "p_spark": p, "z_kept_mass": 0.65} for i, p in enumerate(p_spark)]
    probe[-1] |= {"success_spark": 0.5, "success_common": 0.16}
    (folder / "probe.jsonl").write_text("".join(json.dumps(row) + "\n" for row in probe))
    rows = [
        StepMetrics(step=s, policy_version=s, time=100.0 + s,
                    metrics={"rollout/reward_mean": reward, "loss/reg_tokens": 4.0}).model_dump_json()
        for s in range(1, 10 * (len(p_spark) - 1) + 1)
    ]  # fmt: skip
    (folder / "metrics.jsonl.gz").write_bytes(gzip.compress(("\n".join(rows) + "\n").encode()))
    final = EvalRecord(policy_version=len(rows), time=200.0, task="math", problems=256, n=4, temperature=1.0,
                       greedy=heldout, pass_at={"1": heldout}, seconds=1.0)  # fmt: skip
    (folder / "eval.jsonl").write_text(final.model_dump_json() + "\n")


def test_each_seeds_fate_and_the_predictions_from_the_records(tmp_path: Path) -> None:
    records, out = tmp_path / "fork", tmp_path
    previous = f"# Report\n\nPre-registered.\n\n{BEGIN}\nthe previous section\n{END}\n\nAfter.\n"
    (out / "report.md").write_text(previous)
    fates = {"grpo": [0.02, 0.001], "lpreg-b0": [0.02, 0.004], "lpreg": [0.02, 0.6], "dppo": [0.02, 0.015]}
    specs = [Spec("tail", arm, seed) for seed in (1, 2, 3, 4) for arm in ARMS]
    for spec in specs:
        _record(records, spec, fates[spec.arm], reward=0.2, heldout=0.3)
    runs = {spec.arm: fate({"start": {"p_spark": fates[spec.arm][0]},
                            "final": {"p_spark": fates[spec.arm][1]}}) for spec in specs}  # fmt: skip
    assert runs == {"grpo": "extinguished", "lpreg-b0": "extinguished", "lpreg": "taken over", "dppo": "kept"}
    assert fate({"start": {"p_spark": 0.02}, "final": {"p_spark": 0.009}}) == "declining"
    assert EXTINCT < 0.02 * 0.5

    stats = write_report(records, out, [s.name for s in specs] + ["plain-grpo-s1"], steps=10)
    text = (out / "report.md").read_text()
    assert stats["recorded"] == 16 and stats["planned"] == 17
    assert text.startswith("# Report\n\nPre-registered.\n\n") and text.endswith("\n\nAfter.\n")
    assert "the previous section" not in text
    assert "16 of 17 runs recorded (10 steps each): the verdict is preliminary" in text
    assert (
        "| tail | GRPO | 4 | 4 extinguished | 0.001 / 0.001 / 0.001 / 0.001 | 0.200 (0.200–0.200) | 0.300"
        in text
    )
    assert "| tail | Lp-Reg β = 1 | 4 | 4 taken over |" in text and "| plain | GRPO | 0 |" in text
    lines = [line for line in text.splitlines() if line.startswith("- H")]
    assert "4 of 4 — **held** (forecast: holds at most marginally)" in lines[0]
    assert "4 of 4 — **held** (forecast: refuted)" in lines[2]
    assert "0 of 0 — **not yet testable**" in lines[4]  # the plain condition has no seed yet
    # DPPO kept the spark where GRPO lost it, seed by seed: "ends as GRPO" is refuted.
    assert lines[5].startswith("- H4: DPPO ends as GRPO") and "0 of 4 — **refuted**" in lines[5]
    # Every arm's reward equals GRPO's at every step here: the paired runs never leave its trajectory.
    assert "tail, DPPO: s1 never, s2 never, s3 never, s4 never" in text
    assert "Tokens DPPO's mask acted on, over each whole run" in text and "tail s1 0 of " in text
    assert (out / "fork_p_spark.png").is_file() and (out / "fork_reward.png").is_file()


def test_a_prediction_the_records_contradict_is_refuted() -> None:
    def run(arm: str, final: float) -> dict[str, object]:
        return {"start": {"p_spark": 0.02}, "final": {"p_spark": final}, "condition": "tail", "arm": arm}

    by = {("tail", "lpreg"): [run("lpreg", 0.001)] * 3 + [run("lpreg", 0.02)]}
    lines = verdicts(by)  # type: ignore[arg-type]
    assert "1 of 4 — **refuted**" in lines[2]  # kept in one seed of four: H2 needs three


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_real_run_is_recorded_then_skipped_from_its_record_alone() -> None:
    """`--quick --arms grpo`: one run of 6 steps from a tail start model warmed up for seconds (the
    pipeline, not the experiment's state), probed and recorded; a second call starts nothing."""
    command = [sys.executable, "bench/fork_experiment.py", "--quick", "--arms", "grpo"]
    subprocess.run(["rm", "-rf", "runs/fork-quick"], cwd=ROOT, check=True)
    first = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=560, check=False)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    record = ROOT / "runs/fork-quick/report/fork/tail-grpo-s1"
    probe = [json.loads(line) for line in (record / "probe.jsonl").read_text().splitlines()]
    assert [row["step"] for row in probe] == [0, 6] and "success_spark" in probe[-1]
    assert json.loads((record / "record.json").read_text())["rho"] == RHO["tail"]
    subprocess.run(["rm", "-rf", "runs/fork-quick/tail-grpo-s1"], cwd=ROOT, check=True)
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert again.returncode == 0 and "tail-grpo-s1" not in again.stdout.split("{")[0], again.stdout[-2000:]
