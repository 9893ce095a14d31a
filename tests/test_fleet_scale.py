"""`bench/fleet_scale.py --quick` runs end to end and ends with its JSON line (issue 35). Its figures are
measured, never asserted here; what is checked is that each part ran and what does not depend on speed:
the bytes the kernel counted for the broadcast, which gloo's binomial tree fixes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import clean_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_quick_run_ends_with_its_json_line(tmp_path: Path) -> None:
    env = clean_env() | {"FLEET_DATA_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "fleet_scale.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    points = summary["intake"]["points"]["this"]
    assert [p["flat_out"] for p in points] == [False, True]
    assert all(p["groups_in"] > 0 for p in points)  # the simulated workers published
    assert summary["saturation_this"]["profile"]["samples"] > 0  # py-spy read the intake
    for row in summary["broadcast"]:
        # gloo's broadcast is a binomial tree: the sender sends the whole state once per round, and every
        # receiver gets it once (the kernel's count of bytes acknowledged, within framing).
        assert row["sender_gb"] == pytest.approx(row["tree_rounds"] * row["bytes"] / 1e9, rel=0.02)
        assert row["wire_gb"] == pytest.approx(row["receivers"] * row["bytes"] / 1e9, rel=0.02)
    (control,) = summary["control"]
    assert set(control["requests"]) == {"workers", "scrape", "page", "learner_view"}
    assert not list(tmp_path.iterdir())  # Redis' files, journals and profiles: all removed
