"""A worker that cannot see the learner's disk (as in a container or a pod) catches up over the network:
the learner's weight files over real HTTP, verified against the signed announcement; and, on the real
stack, a worker given neither the model directory nor the learner's run directory fetches both."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from _faults import settings, steps_done, wait
from _tiny import tiny_model_dir  # noqa: F401  (fixture)
from conftest import clean_env

from sparkrl.launcher import Stack, plan_stack, write_configs
from sparkrl.proto import WorkerStatus
from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.settings import write_resolved
from sparkrl.services.common.telemetry import Telemetry
from sparkrl.services.common.weight_sync.files import (
    FetchFailed,
    WeightFileServer,
    fetch_bytes,
    fetch_model,
    files_token,
)
from sparkrl.services.learner.publisher import write_snapshot

SECRET = "s" * 32


@pytest.fixture
def server(tiny_model_dir: Path, tmp_path: Path):  # noqa: F811
    snapshot = write_snapshot({"w": torch.arange(6.0)}, 3, tmp_path / "snapshots")
    files = WeightFileServer("127.0.0.1", 0, tiny_model_dir, snapshot, SECRET)
    files.start()
    assert files.wait_listed(30) and files.model_sha256 is not None
    yield files
    files.close()


def status_of(url: str, token: str | None = None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_weight_files_need_the_token_and_verify(server: WeightFileServer, tmp_path: Path) -> None:
    assert status_of(f"{server.url}/healthz") == 200
    assert status_of(f"{server.url}/snapshot") == 401
    assert status_of(f"{server.url}/snapshot", "wrong") == 401
    token = files_token(SECRET)
    assert status_of(f"{server.url}/snapshot", token) == 200
    assert status_of(f"{server.url}/model/..%2Fsnapshots", token) == 404  # only listed names are served
    assert status_of(f"{server.url}/model/.hidden", token) == 404
    from safetensors.torch import load

    assert torch.equal(load(fetch_bytes(f"{server.url}/snapshot", SECRET))["w"], torch.arange(6.0))

    dest = fetch_model(server.url, server.model_sha256 or "", tmp_path / "fetched", SECRET)
    assert (dest / "config.json").read_bytes() == (server.model_dir / "config.json").read_bytes()
    assert server.listing is not None and sorted(p.name for p in dest.iterdir()) == sorted(server.listing)
    with pytest.raises(FetchFailed, match="does not match the announcement"):
        fetch_model(server.url, "0" * 64, tmp_path / "other", SECRET)
    with pytest.raises(FetchFailed, match="HTTP 401"):
        fetch_model(server.url, server.model_sha256 or "", tmp_path / "other", "another secret long enough")


@pytest.mark.slow
def test_a_worker_without_the_learners_disk_or_model_catches_up(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    # The learner trains on while the newcomer starts (however slow the machine); the test ends once the
    # newcomer holds the learner's current version.
    cfg = settings(
        tiny_model_dir,
        tmp_path / "run",
        "learner.max_steps=1000",
        "prompts.count=5000",
        "sync.timeout_s=15",
    )
    plan = plan_stack(cfg, workers=1, private_redis=True)
    write_configs(plan)
    stack = Stack(plan, ready_timeout_s=180)
    newcomer: subprocess.Popen[bytes] | None = None
    elsewhere = tmp_path / "elsewhere"  # the newcomer's own run directory: none of the learner's files
    try:
        stack.start()
        wait("step 1", lambda: steps_done(plan.run_dir) >= 1, plan.run_dir)
        own = plan.settings.model_copy(deep=True)
        own.run_dir, own.model = str(elsewhere), str(tmp_path / "no-such-model")
        config = write_resolved(own, elsewhere / "worker.yaml")
        log = (elsewhere / "newcomer.log").open("wb")
        env = clean_env()
        newcomer = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sparkrl.cli",
                "rollout",
                "--preset",
                str(config),
                "--worker-id",
                "newcomer",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        bus = RedisBus(plan.settings.bus)

        telemetry = Telemetry(bus)

        def newcomer_current() -> bool:
            raw = bus.statuses("worker").get("newcomer")
            learner = telemetry.learner()
            if raw is None or learner is None:
                return False
            held = WorkerStatus.model_validate_json(raw).policy_version
            return held is not None and held >= max(learner.policy_version, 2)  # caught up, not at its start

        wait("the newcomer on the learner's current version", newcomer_current, plan.run_dir, timeout_s=300)
        assert stack.procs["learner"].poll() is None  # it caught up with a live learner, not a finished one
        bus.close()
    finally:
        if newcomer is not None:
            newcomer.terminate()
            newcomer.wait(30)
        stack.shutdown()
    text = (elsewhere / "newcomer.log").read_text()
    assert "fetching the learner's" in text and "model from the learner" in text, text[-3000:]
    assert "over HTTP" in text, text[-3000:]  # the snapshot too came over the network
    fetched = elsewhere / "model-from-learner"
    assert json.loads((fetched / "config.json").read_text()) == json.loads(
        (tiny_model_dir / "config.json").read_text()
    )
    assert not (elsewhere / "snapshots").exists()  # nothing of the learner's disk was needed
