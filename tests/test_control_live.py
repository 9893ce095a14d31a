"""The control plane on the real stack (private redis-server, two workers, the learner under DeepSpeed,
the control service over HTTP): Prometheus everywhere, pause / resume, checkpoint, live hyperparameters,
422s, auth on every mutating route, and a clean stop with a final checkpoint — in that order, on one run.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import httpx
import psutil
import pytest
import redis
from _live import Live, live_stack, tiny_model_dir  # noqa: F401  (fixtures)
from prometheus_client.parser import text_string_to_metric_families

from sparkrl.proto import WeightAnnouncement, announcement_verifies
from sparkrl.services.common.settings import load_settings

pytestmark = pytest.mark.slow

OPERATIONS_DOC = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
MUTATING = [
    ("POST", "/api/v1/pause"),
    ("POST", "/api/v1/resume"),
    ("POST", "/api/v1/stop"),
    ("POST", "/api/v1/checkpoint"),
    ("PATCH", "/api/v1/hyperparameters"),
]


def scrape(url: str) -> dict[str, float]:
    """`/metrics` parsed by prometheus_client: sample name (with labels) → value."""
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def endpoints(live: Live) -> dict[str, str]:
    worker = load_settings(str(live.run_dir / "config" / "worker-0.yaml")).rollout.metrics
    learner = live.plan.settings.learner.metrics
    return {
        "learner": f"http://{learner.host}:{learner.port}",
        "worker-0": f"http://{worker.host}:{worker.port}",
        "reward": live.plan.settings.reward.url,
        "control": live.url,
    }


def documented_metric_names() -> set[str]:
    """The metric names docs/operations.md lists under "Prometheus metrics"."""
    section = OPERATIONS_DOC.read_text().split("## Prometheus metrics", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`(sparkrl_[a-z0-9_]+)[`{]", section))


def acked(live: Live) -> float:
    url = endpoints(live)["learner"] + "/metrics"
    return scrape(url)["sparkrl_learner_trajectories_acked_total"]


def test_pause_holds_the_step_and_the_acks_resume_goes_on(live_stack: Live) -> None:  # noqa: F811
    response = live_stack.send("POST", "/api/v1/pause", {"reason": "test"})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["outcome"] == "applied"
    assert {r["target"] for r in answer["results"]} == {"learner", "worker:worker-0", "worker:worker-1"}
    live_stack.wait(
        "the learner to report paused", lambda: live_stack.get("/api/v1/status")["state"] == "paused"
    )
    step, acks = live_stack.step(), acked(live_stack)
    time.sleep(5.5)
    status = live_stack.get("/api/v1/status")
    assert (status["step"], acked(live_stack)) == (step, acks), "a paused learner trained or acknowledged"
    assert status["paused"] and status["state"] == "paused"
    workers = live_stack.get("/api/v1/workers")["workers"]
    assert [w["state"] for w in workers] == ["paused", "paused"]
    assert all(w["heartbeat_age_s"] < 5 for w in workers), "paused workers must stay alive and reporting"
    assert all(live_stack.stack.procs[name].poll() is None for name in ("learner", "worker-0", "worker-1"))

    response = live_stack.send("POST", "/api/v1/resume")
    assert response.status_code == 200 and response.json()["outcome"] == "applied", response.text
    live_stack.wait("training to go on", lambda: live_stack.step() >= step + 2)
    assert acked(live_stack) > acks


def test_a_checkpoint_on_request(live_stack: Live) -> None:  # noqa: F811
    response = live_stack.send("POST", "/api/v1/checkpoint", {"tag": "from-api"})
    assert response.status_code == 200, response.text
    [result] = response.json()["results"]
    path = live_stack.run_dir / "checkpoints" / "from-api"
    assert result["target"] == "learner" and result["detail"] == f"checkpoint {path}"
    assert (path / "trainer_state.json").is_file() and (path / "hf" / "model.safetensors").is_file()
    assert live_stack.get("/api/v1/status")["last_checkpoint"] == str(path)
    untagged = live_stack.send("POST", "/api/v1/checkpoint").json()["results"][0]
    assert re.fullmatch(r"checkpoint .*/checkpoints/step-\d{6}", untagged["detail"])


def test_live_hyperparameters_show_in_the_next_row(live_stack: Live) -> None:  # noqa: F811
    response = live_stack.send(
        "PATCH", "/api/v1/hyperparameters", {"lr": 2e-4, "beta": 0.5, "temperature": 0.8}
    )
    assert response.status_code == 200, response.text
    results = {r["target"]: r for r in response.json()["results"]}
    assert results["learner"]["values"] == {"lr": 2e-4, "beta": 0.5}
    assert (
        results["worker:worker-0"]["values"] == results["worker:worker-1"]["values"] == {"temperature": 0.8}
    )
    applied_at = results["learner"]["step"]
    live_stack.wait("the next row", lambda: live_stack.step() > applied_at)
    [row, *_] = live_stack.get("/api/v1/metrics", since=applied_at)["rows"]
    assert row["hparams"]["lr"] == pytest.approx(2e-4) and row["hparams"]["beta"] == 0.5
    assert live_stack.get("/api/v1/status")["hyperparameters"]["beta"] == 0.5
    on_disk = (live_stack.run_dir / "metrics.jsonl").read_text()
    assert '"beta":0.5' in on_disk  # the record of the run carries it too

    def sampled_at_new_temperature() -> bool:
        rows = live_stack.get("/api/v1/metrics", since=applied_at)["rows"]
        return any(r["hparams"].get("temperature") == pytest.approx(0.8) for r in rows)

    live_stack.wait("groups sampled at the new temperature", sampled_at_new_temperature)
    # A worker-side change is in the step rows too (what the step's groups were made with): the report's
    # "hyperparameter changes" names it.
    from sparkrl.proto import StepMetrics
    from sparkrl.report import hparam_changes

    lines = (live_stack.run_dir / "metrics.jsonl").read_text().splitlines()
    changes = hparam_changes([StepMetrics.model_validate_json(line) for line in lines])
    assert [c for c in changes if c.startswith("temperature: 1 → 0.8 at step")], changes


def test_a_bad_value_is_a_422_naming_the_field(live_stack: Live) -> None:  # noqa: F811
    response = live_stack.send("PATCH", "/api/v1/hyperparameters", {"beta": -1})
    assert response.status_code == 422
    [error] = response.json()["detail"]
    assert error["loc"] == ["body", "beta"] and error["msg"].startswith("beta must be ≥ 0: a negative weight")
    response = live_stack.send("PATCH", "/api/v1/hyperparameters", {"entropy_coef": 0.1})
    assert response.status_code == 422 and "not a parameter of the active loss 'lp_reg'" in response.text
    assert live_stack.get("/api/v1/status")["hyperparameters"]["beta"] == 0.5  # nothing changed


def test_every_service_serves_prometheus_metrics_named_in_the_docs(live_stack: Live) -> None:  # noqa: F811
    # Late in the run: every command has been issued once, so the labelled series exist.
    scraped: dict[str, dict[str, float]] = {
        name: scrape(url + "/metrics") for name, url in endpoints(live_stack).items()
    }
    assert scraped["learner"]["sparkrl_learner_steps_total"] >= 3
    assert scraped["learner"]["sparkrl_sync_seconds_count"] >= 1
    assert scraped["worker-0"]["sparkrl_rollout_tokens_generated_total{worker=worker-0}"] > 0
    assert scraped["worker-0"]["sparkrl_rollout_generation_seconds_count{worker=worker-0}"] >= 1
    assert (
        scraped["control"]["sparkrl_fleet_learner_up"] == 1
        and scraped["control"]["sparkrl_fleet_workers"] == 2
    )
    assert "sparkrl_fleet_worker_policy_version{worker=worker-1}" in scraped["control"]
    assert sum(v for k, v in scraped["reward"].items() if k.startswith("sparkrl_reward_items_total")) > 0
    for name in ("learner", "worker-0"):
        health = httpx.get(endpoints(live_stack)[name] + "/healthz", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "ok"
    # Every name docs/operations.md lists exists in some scrape (a histogram or counter as its own samples).
    present = {re.sub(r"\{.*", "", sample) for samples in scraped.values() for sample in samples}
    families = present | {re.sub(r"_(total|count|sum|bucket|created)$", "", name) for name in present}
    missing = documented_metric_names() - families
    assert not missing, f"docs/operations.md lists metrics no service serves: {sorted(missing)}"
    assert len(documented_metric_names()) >= 25


def test_every_mutating_route_needs_the_token(live_stack: Live) -> None:  # noqa: F811
    for method, path in MUTATING:
        body = {"lr": 1e-5} if method == "PATCH" else None
        assert live_stack.send(method, path, body, token=None).status_code == 401, path
        assert live_stack.send(method, path, body, token="not-the-token").status_code == 403, path
    assert live_stack.get("/api/v1/status")["state"] == "training"  # none of them did anything
    mode = (live_stack.run_dir / "control-token").stat().st_mode & 0o777
    assert mode == 0o600
    assert live_stack.token not in (live_stack.run_dir / "config" / "control.yaml").read_text()


def test_no_service_listens_beyond_loopback(live_stack: Live) -> None:  # noqa: F811
    """Every listening socket of the stack's processes (their children included: the verifier pool, the
    forkserver) is bound to 127.0.0.1: Redis, HTTP servers, the weight-sync store and gloo's devices."""
    pids: set[int] = set()
    for proc in live_stack.stack.procs.values():
        if proc.poll() is None:
            parent = psutil.Process(proc.pid)
            pids |= {parent.pid} | {child.pid for child in parent.children(recursive=True)}
    listening = [
        (conn.laddr.ip, conn.laddr.port, psutil.Process(pid).name())
        for pid in pids
        for conn in psutil.Process(pid).net_connections("inet")
        if conn.status == psutil.CONN_LISTEN
    ]
    assert len(listening) >= 8, listening  # redis, control, reward, learner (metrics, store), 2 workers, ...
    outside = [entry for entry in listening if entry[0] not in ("127.0.0.1", "::ffff:127.0.0.1")]
    assert not outside, f"listening beyond loopback: {outside}"


def test_a_forged_announcement_is_refused(live_stack: Live) -> None:  # noqa: F811
    client = redis.Redis.from_url(live_stack.plan.settings.bus.url)
    key = f"{live_stack.plan.settings.bus.namespace}:value:weights"
    real = WeightAnnouncement.model_validate_json(client.get(key))
    assert real.signature is not None  # `sparkrl up` gave the run a secret; the learner signs
    forged = real.model_copy(update={"version": real.version + 1000, "snapshot_path": "/tmp/elsewhere.bin"})
    log = live_stack.run_dir / "logs" / "worker-0.log"

    def refused() -> bool:
        # The learner rewrites the announcement at every version: write the forgery until a worker,
        # looking between batches, has seen (and refused) it.
        client.set(key, forged.model_dump_json())
        return "its signature does not verify" in log.read_text()  # a refusal of this forgery, no other

    live_stack.wait("worker-0 to refuse a forged announcement", refused, timeout_s=60)
    versions = {w["policy_version"] for w in live_stack.get("/api/v1/workers")["workers"]}
    assert real.version + 1000 not in versions
    unsigned = forged.model_copy(update={"signature": None})
    assert not announcement_verifies(unsigned, live_stack.plan.settings.sync.secret)
    client.close()


def test_stop_is_a_clean_exit_with_a_final_checkpoint(live_stack: Live) -> None:  # noqa: F811
    response = live_stack.send("POST", "/api/v1/stop")
    assert response.status_code == 200, response.text
    results = {r["target"]: r for r in response.json()["results"]}
    match = re.fullmatch(r"stopped at step (\d+); checkpoint (.*)", results["learner"]["detail"])
    assert match, results["learner"]["detail"]
    step, path = int(match.group(1)), Path(match.group(2))
    learner = live_stack.stack.procs["learner"]
    live_stack.wait("the learner to exit", lambda: learner.poll() is not None, timeout_s=60)
    assert learner.returncode == 0
    for name in ("worker-0", "worker-1"):
        process = live_stack.stack.procs[name]
        live_stack.wait(f"{name} to exit", lambda p=process: p.poll() is not None, timeout_s=60)
        assert process.returncode == 0
    assert os.readlink(live_stack.run_dir / "checkpoints" / "latest") == path.name
    assert path.name == f"step-{step:06d}" and (path / "trainer_state.json").is_file()
    status = live_stack.get("/api/v1/status")  # the control service outlives the learner
    assert status["state"] == "stopped" and status["step"] == step
