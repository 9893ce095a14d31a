"""The monitoring profile agrees with the code: every dashboard query names metrics the services export,
every service is a scrape target on both networks, Grafana's data source is the one the panels name.
The queries themselves run against the profile's live Prometheus in `make compose-smoke`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
GRAFANA = ROOT / "deploy" / "grafana"
PROMETHEUS = ROOT / "deploy" / "prometheus"
sys.path.insert(0, str(GRAFANA))
from check_dashboard import targets  # noqa: E402

METRIC = re.compile(r"\bsparkrl_[a-z_]+")
SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def exported_metrics() -> set[str]:
    """Every metric name the services define (a quoted `sparkrl_...` string in services/)."""
    names: set[str] = set()
    for path in (ROOT / "services").rglob("*.py"):
        names |= set(re.findall(r"[\"'](sparkrl_[a-z_]+)[\"']", path.read_text()))
    return names


def base_name(series: str) -> str:
    for suffix in SUFFIXES:
        if series.endswith(suffix):
            return series.removesuffix(suffix)
    return series


def test_every_query_names_metrics_the_services_export() -> None:
    exported = exported_metrics()
    queries = targets()
    assert len(queries) >= 12
    for target in queries:
        names = METRIC.findall(target.expr)
        assert names or target.expr.startswith("up"), target
        unknown = [n for n in names if base_name(n) not in exported and n not in exported]
        assert not unknown, f"{target.panel}: {unknown} are not exported by any service"


def test_the_dashboard_shows_what_an_operator_asks_for() -> None:
    exprs = " ".join(t.expr for t in targets())
    for metric in (
        "sparkrl_learner_step_seconds",  # step time
        "sparkrl_learner_tokens_trained_total",  # throughput
        "sparkrl_learner_reward_mean",
        "sparkrl_learner_entropy",
        "sparkrl_fleet_worker_lag",  # per-worker version lag
        "sparkrl_sync_seconds",
        "sparkrl_sync_bytes_total",
        "sparkrl_learner_groups_dropped_stale_total",
        "sparkrl_reward_request_seconds_bucket",  # reward-service latency
    ):
        assert metric in exprs, metric


def test_grafana_is_provisioned_with_the_panels_data_source() -> None:
    dashboard = json.loads((GRAFANA / "dashboards" / "sparkrl.json").read_text())
    source = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    uid = source["datasources"][0]["uid"]
    assert source["datasources"][0]["url"] == "$PROMETHEUS_URL"
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == uid and all(
            t["datasource"]["uid"] == uid for t in panel["targets"]
        )
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "sparkrl.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_prometheus_scrapes_every_service_on_the_bridge_network() -> None:
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"learner", "reward", "control", "rollout"}
    static = {
        name: job["static_configs"][0]["targets"] for name, job in jobs.items() if "static_configs" in job
    }
    assert static == {"learner": ["learner:9100"], "reward": ["reward:8100"], "control": ["control:8200"]}
    assert jobs["rollout"]["dns_sd_configs"][0] == {
        "names": ["rollout"],
        "type": "A",
        "port": 9101,
        "refresh_interval": "10s",
    }


def test_the_host_network_config_follows_the_stacks_ports(tmp_path: Path) -> None:
    """hostnet.sh writes the config from the stack's port variables, then execs Prometheus (here a stand-in
    on PATH that prints the config it was given)."""
    stand_in = tmp_path / "prometheus"
    stand_in.write_text('#!/bin/sh\nfor a; do case "$a" in --config.file=*) cat "${a#*=}";; esac; done\n')
    stand_in.chmod(0o755)
    env = {
        "PATH": f"{tmp_path}:/usr/bin:/bin",
        "LEARNER_METRICS_PORT": "19100",
        "REWARD_PORT": "18100",
        "CONTROL_PORT": "18200",
        "ROLLOUT_METRICS_PORTS": "9110-9113",
        "PROMETHEUS_PORT": "19090",
        "HOME": os.environ.get("HOME", "/tmp"),
    }
    done = subprocess.run(["sh", str(PROMETHEUS / "hostnet.sh")], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    config = yaml.safe_load(done.stdout)
    got = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    assert got == {
        "learner": ["127.0.0.1:19100"],
        "reward": ["127.0.0.1:18100"],
        "control": ["127.0.0.1:18200"],
        "rollout": [f"127.0.0.1:{port}" for port in range(9110, 9114)],
    }
