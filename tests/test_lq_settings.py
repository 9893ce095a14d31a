"""bench/lq_settings.py: the wide report checks, from the records' recorded settings, that no loss got a
setting the others did not and that every run of a seed was fed the same prompts."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from lq_settings import compare, settings_line, staleness_line  # noqa: E402


def record(root: Path, name: str, seed: int, loss: dict[str, Any], **learner: Any) -> Path:
    """A record's config folder as `sparkrl up` writes it (only the files compared here)."""
    folder = root / name
    (folder / "config").mkdir(parents=True)
    port = 20000 + len(list(root.iterdir()))  # every run its own addresses and paths
    learner_file = {
        "model": f"/work/{name}/.cache/tiny-countdown",
        "run_dir": f"/work/runs/{name}",
        "bus": {"url": f"redis://127.0.0.1:{port}/0", "trajectory_maxlen": 416},
        "sync": {"port": port + 1},
        "learner": {"seed": seed, "lr": 1e-3, "loss": loss, "skip_zero_advantage": True} | learner,
    }
    prompts_file = {"bus": {"url": f"redis://127.0.0.1:{port}/0"}, "prompts": {"seed": seed + 1, "count": 9}}
    (folder / "config" / "learner.yaml").write_text(yaml.safe_dump(learner_file))
    (folder / "config" / "prompts.yaml").write_text(yaml.safe_dump(prompts_file))
    return folder


def series(tmp_path: Path, **grpo_learner: Any) -> dict[str, tuple[int, Path]]:
    runs = {
        "lp_reg-s1": (1, record(tmp_path, "lp_reg-s1", 1, {"name": "lp_reg", "rho": 0.01})),
        "grpo-s1": (1, record(tmp_path, "grpo-s1", 1, {"name": "grpo", "clip_low": 0.2}, **grpo_learner)),
        "lp_reg-s2": (2, record(tmp_path, "lp_reg-s2", 2, {"name": "lp_reg", "rho": 0.01})),
    }
    return runs


def test_runs_alike_but_for_the_loss_seeds_and_addresses_are_said_to_share_every_setting(
    tmp_path: Path,
) -> None:
    line = settings_line(series(tmp_path))
    assert "from the 3 records' `config/*.yaml`" in line
    assert "of 7 settings, none differs besides the loss" in line  # model, maxlen, 3 learner, 2 prompts
    assert "every loss of a seed is fed the same prompt stream" in line
    assert "Work-only" not in line and "recorded by some runs only" not in line


def test_a_setting_one_loss_got_is_named_with_each_runs_value(tmp_path: Path) -> None:
    line = settings_line(series(tmp_path, lr=3e-3))
    said = "**1 differs besides the loss**: `learner.lr`: 0.001 (lp_reg-s1, lp_reg-s2); 0.003 (grpo-s1)."
    assert said in line


def test_runs_of_one_seed_fed_different_prompts_are_flagged(tmp_path: Path) -> None:
    runs = series(tmp_path)
    prompts = runs["grpo-s1"][1] / "config" / "prompts.yaml"
    prompts.write_text(prompts.read_text().replace("seed: 2", "seed: 7"))
    assert not compare(runs).seeds_shared
    assert "**Runs of the same seed do not share their seeds**" in settings_line(runs)


def test_work_only_settings_and_settings_new_to_some_runs_are_told_apart(tmp_path: Path) -> None:
    line = settings_line(series(tmp_path, skip_zero_advantage=False, filter_groups="zero_variance"))
    assert "none differs besides the loss" in line
    assert "Work-only settings (the same gradient, less work) differ: `learner.skip_zero_advantage`: " in line
    assert "True (lp_reg-s1, lp_reg-s2); False (grpo-s1)" in line
    assert "1 setting is recorded by some runs only" in line


def test_one_run_has_nothing_to_compare_with(tmp_path: Path) -> None:
    folder = record(tmp_path, "lp_reg-s1", 1, {"name": "lp_reg"})
    assert settings_line({"lp_reg-s1": (1, folder)}) == ""


def test_each_runs_staleness_is_said_once_there_are_runs_to_compare() -> None:
    stats = {"lp_reg-s1": {"staleness": 0.25}, "kl_cov-s1": {"staleness": 0.614}}
    line = staleness_line(stats)
    assert line.endswith("lagged): lp_reg-s1 0.25, kl_cov-s1 0.61.")
    assert staleness_line({"lp_reg-s1": {"staleness": 0.25}}) == ""
