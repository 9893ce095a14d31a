"""What another node must reach is a setting (issue 31): `sparkrl up`'s private Redis binds `bus.host` and
its URL names it; a relative model path is made absolute (a Ray actor starts where `ray start` ran); `up
--ray` joining a cluster says, before it starts, what a worker on another node would fail to reach; the Ray
actors take custom resources from the settings. `make nodes-smoke` runs all of it across three network
namespaces; these are the plan's and the preflight's parts, without a network."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from _tiny import tiny_model_dir  # noqa: F401  (fixture)

from sparkrl.client import format_status
from sparkrl.plan import StackPlan, plan_stack
from sparkrl.preflight import warnings
from sparkrl.services.common.settings import load_settings

EVERY_ADDRESS = ["bus.host=198.18.0.1", "reward.host=198.18.0.1", "sync.host=198.18.0.1"]


def _redis_conf(plan: StackPlan) -> str:
    return next(spec.config for spec in plan.services if spec.name == "redis")


def test_the_private_redis_binds_bus_host_and_its_url_names_it(tmp_path: Path) -> None:
    default = plan_stack(load_settings("smoke", [f"run_dir={tmp_path}"]), workers=1, private_redis=True)
    assert "\nbind 127.0.0.1\n" in _redis_conf(default)
    assert urlsplit(default.settings.bus.url).hostname == "127.0.0.1"
    cfg = load_settings("smoke", [f"run_dir={tmp_path}", "bus.host=198.18.0.1"])
    plan = plan_stack(cfg, workers=2, private_redis=True)
    assert "\nbind 198.18.0.1\n" in _redis_conf(plan)
    url = urlsplit(plan.settings.bus.url)
    assert url.hostname == "198.18.0.1" and url.password and f"port {url.port}\n" in _redis_conf(plan)
    # Every service and worker gets that URL: the workers on other nodes dial it.
    workers = [spec.config for spec in plan.services if spec.role == "rollout"]
    assert {w.bus.url for w in workers} == {plan.settings.bus.url}  # type: ignore[union-attr]


def test_a_relative_model_path_is_made_absolute_a_hub_name_is_kept(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tiny_model_dir.parent)
    plan = plan_stack(load_settings("smoke", [f"run_dir={tmp_path}", f"model={tiny_model_dir.name}"]), 1)
    assert plan.settings.model == os.path.abspath(tiny_model_dir)
    hub = plan_stack(load_settings("smoke", [f"run_dir={tmp_path}", "model=Qwen/Qwen2.5-0.5B"]), 1)
    assert hub.settings.model == "Qwen/Qwen2.5-0.5B"


def test_joining_a_cluster_says_what_another_node_would_fail_to_reach() -> None:
    said = {w.setting: w.message for w in warnings(load_settings("demo"), cluster=True)}
    assert set(said) == {"bus.host", "reward.host", "sync.host"}
    assert "would fail to reach Redis (the bus)" in said["bus.host"]
    assert "would fail to reach the reward service" in said["reward.host"]
    assert "weight broadcast and weight files" in said["sync.host"]
    assert all("127.0.0.1 is this machine alone" in message for message in said.values())
    # A bus of one's own is named by its URL.
    own = load_settings("demo", ["bus.url=redis://localhost:6379/0"])
    assert "bus.url" in {w.setting for w in warnings(own, cluster=True)}
    # Every address another node's: the learner must still be pinned to sync.host's node.
    reachable = load_settings("demo", EVERY_ADDRESS)
    assert [w.setting for w in warnings(reachable, cluster=True)] == ["ray.learner.resources"]
    pinned = load_settings("demo", [*EVERY_ADDRESS, "ray.learner.resources={learner: 1}"])
    assert warnings(pinned, cluster=True) == []
    assert not [w for w in warnings(load_settings("demo")) if w.setting.endswith(".host")]  # one machine


def test_ray_actors_and_replicas_take_custom_resources_from_the_settings() -> None:
    cfg = load_settings("demo", ["ray.rollout.resources={rollout: 1}", "ray.reward.resources={reward: 0.5}"])
    assert cfg.ray.rollout.resources == {"rollout": 1.0}
    assert cfg.ray.reward.resources == {"reward": 0.5} and cfg.ray.learner.resources == {}


def test_status_keeps_a_ray_worker_id_apart_from_its_state() -> None:
    status = {"state": "training", "step": 3, "policy_version": 3, "paused": False}
    status |= {"generation_tokens_per_s": 0.0, "hyperparameters": {}, "sampling": {}}
    worker = {"worker_id": "worker-0.123456", "state": "generating", "policy_version": 3, "lag": 0}
    worker |= {"sync_failures": 0, "heartbeat_age_s": 0.5, "tokens_per_s": 0.0, "prompts_in_flight": 0}
    row = format_status(status, {"workers": [worker]}).splitlines()[4]
    assert row.split()[:2] == ["worker-0.123456", "generating"]
