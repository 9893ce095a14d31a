"""deploy/k8s: both overlays and the KubeRay variant build with `kubectl kustomize`, every object validates
offline against Kubernetes 1.32's schemas (kubernetes-validate, strict: an unknown field fails), and the
manifests agree with the code they run. Each container's command is a real `sparkrl` command with real
options (parsed by the CLI's own click command, nothing spawned); each SPARKRL_* variable names a settings
field (walked from SparkSettings, so the test follows the code); the ConfigMap's file loads as
SparkSettings with each container's environment; ports agree across Services, containerPorts, probes and
settings. A RayJob is a custom resource, without a schema here: its structure is checked against the
fields of KubeRay's ray.io/v1 types, and its pod templates validate as core/v1 PodTemplates.
"""

from __future__ import annotations

import base64
import os
import re
import shlex
import shutil
import subprocess
import typing
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import typer.main
import yaml
from _deploy import settings_field
from conftest import clean_env

from sparkrl.cli import app
from sparkrl.services.common.settings import SparkSettings, load_settings

K8S = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
KUBECTL = shutil.which("kubectl")
K8S_VERSION = "1.32"
OVERLAYS = ("cpu", "gpu", "agents")
WORKLOADS = ("Deployment", "StatefulSet", "Job")
# Stand-ins for the user's own deploy/k8s/base/secrets.env, which the test never reads.
SECRETS = {
    "CONTROL_TOKEN": "test-control-token",
    "CONTROL_READ_TOKEN": "test-control-read-token",
    "REDIS_PASSWORD": "test-redis-password",
    "SYNC_SECRET": "test-sync-secret-0123456789abcdef",
}
# The HTTP services and the container port their /healthz probes use.
HTTP_ROLES = {"reward": "http", "control": "http", "env": "http", "learner": "metrics", "rollout": "metrics"}
CLI: Any = typer.main.get_command(app)  # typer's group: `.commands` by name, each a click command
Obj = dict[str, Any]


def _kustomize(path: Path) -> list[Obj]:
    command = [KUBECTL or "kubectl", "kustomize", str(path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, f"kubectl kustomize {path}:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Obj]]:
    """Every kustomization rendered, from a copy of deploy/k8s with stand-in secrets."""
    if KUBECTL is None:
        pytest.skip("kubectl is not installed: the kustomizations cannot be built")
    tree = tmp_path_factory.mktemp("deploy") / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns("secrets.env"))
    (tree / "base" / "secrets.env").write_text("".join(f"{k}={v}\n" for k, v in SECRETS.items()))
    rendered = {name: _kustomize(tree / "overlays" / name) for name in OVERLAYS}
    rendered["ray"] = _kustomize(tree / "ray")
    return rendered


# ── reading the rendered objects ──────────────────────────────────────────────────────────────────────


def of_kind(objs: list[Obj], kind: str) -> list[Obj]:
    return [obj for obj in objs if obj["kind"] == kind]


def one(objs: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = [obj for obj in of_kind(objs, kind) if name is None or obj["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def containers(objs: list[Obj]) -> Iterator[tuple[Obj, Obj, Obj]]:
    """(workload, pod spec, container) of every workload's pod template."""
    for obj in objs:
        if obj["kind"] in WORKLOADS:
            pod = obj["spec"]["template"]["spec"]
            for container in pod["containers"]:
                yield obj, pod, container


def argv(container: Obj) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


def by_role(objs: list[Obj]) -> dict[str, tuple[Obj, Obj, Obj]]:
    """sparkrl containers keyed by their command (`learner`, `rollout`, ...); one each."""
    roles: dict[str, tuple[Obj, Obj, Obj]] = {}
    for workload, pod, container in containers(objs):
        words = argv(container)
        if words[:1] == ["sparkrl"]:
            assert words[1] not in roles, f"two containers run `sparkrl {words[1]}`"
            roles[words[1]] = (workload, pod, container)
    return roles


def secrets_of(objs: list[Obj]) -> dict[str, dict[str, str]]:
    return {
        s["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in s.get("data", {}).items()}
        for s in of_kind(objs, "Secret")
    }


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion of an env value or argument (an unknown name stays as written)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)


def container_env(container: Obj, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            assert ref["key"] in secrets.get(ref["name"], {}), f"{var['name']}: no Secret key {ref}"
            env[var["name"]] = secrets[ref["name"]][ref["key"]]
    return env


def port_number(container: Obj, port: int | str) -> int:
    """A port by number or by name, which must be one of the container's ports."""
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    number = ports.get(port) if isinstance(port, str) else port
    assert number in ports.values(), f"{container['name']}: port {port!r} is none of its ports {ports}"
    return typing.cast(int, number)


def mounted_file(objs: list[Obj], pod: Obj, container: Obj, path: str) -> str:
    """The text of `path` inside the container, which must come from a mounted ConfigMap."""
    parent, name = str(PurePosixPath(path).parent), PurePosixPath(path).name
    mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"] == parent]
    assert mounts, f"{container['name']}: nothing mounted at {parent}"
    volume = next(v for v in pod["volumes"] if v["name"] == mounts[0]["name"])
    assert "configMap" in volume, f"{container['name']}: {parent} is not a ConfigMap"
    data = one(objs, "ConfigMap", volume["configMap"]["name"])["data"]
    assert name in data, f"ConfigMap {volume['configMap']['name']} has no {name}"
    return typing.cast(str, data[name])


def preset_of(words: list[str]) -> str:
    assert "--preset" in words, f"{words}: no --preset"
    return words[words.index("--preset") + 1]


# ── the code the manifests must agree with ────────────────────────────────────────────────────────────


def load_with_env(text: str, env: dict[str, str], tmp_path: Path) -> SparkSettings:
    """The settings a container sees: its preset file under its own SPARKRL_* environment only."""
    path = tmp_path / f"preset-{abs(hash((text, tuple(sorted(env.items())))))}.yaml"
    path.write_text(text)
    environ = clean_env()
    environ |= {k: v for k, v in env.items() if k.startswith("SPARKRL_")}
    with mock.patch.dict(os.environ, environ, clear=True):
        return load_settings(str(path))


def check_command(words: list[str]) -> dict[str, Any]:
    """Parse `sparkrl CMD OPTIONS...` with the CLI's own command (nothing runs): its parameters' values."""
    assert words[:1] == ["sparkrl"], f"{words}: not a sparkrl command"
    assert len(words) > 1 and words[1] in CLI.commands, f"{words}: no such sparkrl command"
    try:
        return typing.cast(dict[str, Any], CLI.commands[words[1]].make_context(words[1], words[2:]).params)
    except Exception as exc:  # typer's own click: a UsageError names the unknown option or bad value
        pytest.fail(f"{shlex.join(words)}: {exc}")


def settings_by_role(objs: list[Obj], tmp_path: Path) -> dict[str, SparkSettings]:
    secrets = secrets_of(objs)
    return {
        role: load_with_env(
            mounted_file(objs, pod, container, preset_of(argv(container))),
            container_env(container, secrets),
            tmp_path,
        )
        for role, (_, pod, container) in by_role(objs).items()
    }


# ── the tests ─────────────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_objects_validate_against_kubernetes_schemas(built: dict[str, list[Obj]], overlay: str) -> None:
    objs = built[overlay]
    kinds = {obj["kind"] for obj in objs}
    assert {"Namespace", "ConfigMap", "Secret", "Service", "Deployment", "StatefulSet", "Job"} <= kinds
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "sparkrl"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_runs_a_real_sparkrl_command(built: dict[str, list[Obj]], overlay: str) -> None:
    roles = by_role(built[overlay])
    agents = {"env"} if overlay == "agents" else set()
    assert set(roles) == {"reward", "control", "learner", "rollout", "evaluator", "prompts"} | agents
    for _, _, container in roles.values():
        check_command(argv(container))
    # The first start on an empty PVC is a fresh run; a restart goes on from the checkpoint and journal.
    learner = check_command(argv(roles["learner"][2]))
    assert learner["auto_resume"] is True and learner["resume"] is False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_evaluator_follows_the_learner_over_http(
    built: dict[str, list[Obj]], overlay: str, tmp_path: Path
) -> None:
    """It cannot mount the learner's PVC (ReadWriteOnce): it reads the snapshots from the learner's weight
    server, authenticated by the sync secret, and scores through the reward service."""
    objs = built[overlay]
    workload, pod, _ = by_role(objs)["evaluator"]
    cfg = settings_by_role(objs, tmp_path)
    evaluator, learner = cfg["evaluator"], cfg["learner"]
    assert workload["kind"] == "Deployment" and workload["spec"]["replicas"] == 1
    assert evaluator.eval.every is not None, "the preset gives the evaluator nothing to do"
    assert evaluator.sync.secret == learner.sync.secret and evaluator.sync.host == learner.sync.host
    assert evaluator.bus.url == learner.bus.url and evaluator.reward.url == cfg["rollout"].reward.url
    assert not [v for v in pod["volumes"] if "persistentVolumeClaim" in v]  # run_dir: an emptyDir


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_sparkrl_variable_names_a_settings_field(built: dict[str, list[Obj]], overlay: str) -> None:
    names = {
        var["name"]
        for _, _, container in containers(built[overlay])
        for var in container.get("env", [])
        if var["name"].startswith("SPARKRL_")
    }
    assert {"SPARKRL_BUS__URL", "SPARKRL_CONTROL__TOKEN", "SPARKRL_SYNC__SECRET"} <= names
    unknown = sorted(name for name in names if not settings_field(name))
    assert not unknown, f"not settings fields: {unknown}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_references_and_ports_resolve(built: dict[str, list[Obj]], overlay: str) -> None:
    """Services select a pod and target its ports; probes, annotations, Secrets and ConfigMaps exist."""
    objs = built[overlay]
    pods = list(containers(objs))
    for service in of_kind(objs, "Service"):
        selector = service["spec"]["selector"].items()
        chosen = [
            (w, c) for w, _, c in pods if selector <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(chosen) == 1, f"Service {service['metadata']['name']} selects {len(chosen)} containers"
        for port in service["spec"]["ports"]:
            assert port_number(chosen[0][1], port["targetPort"]) == port["port"], port
    secrets = secrets_of(objs)
    for workload, pod, container in pods:
        container_env(container, secrets)  # every secretKeyRef names a rendered Secret key
        for volume in pod.get("volumes", []):
            if "configMap" in volume:
                one(objs, "ConfigMap", volume["configMap"]["name"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            action = container.get(probe, {}).get("httpGet") or container.get(probe, {}).get("tcpSocket")
            if action:
                port_number(container, action["port"])
        annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
        if "prometheus.io/port" in annotations:
            scraped = int(annotations["prometheus.io/port"])
            assert scraped == port_number(container, container["readinessProbe"]["httpGet"]["port"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_are_non_root_with_requests_probes_and_mounted_config(
    built: dict[str, list[Obj]], overlay: str
) -> None:
    objs = built[overlay]
    for workload, pod, container in containers(objs):
        what = f"{workload['kind']}/{workload['metadata']['name']}"
        assert pod["securityContext"]["runAsNonRoot"] is True, what
        assert pod["securityContext"]["runAsUser"] != 0, what
        assert pod["enableServiceLinks"] is False, what  # the environment is only what is declared
        assert container["securityContext"]["allowPrivilegeEscalation"] is False, what
        assert {"cpu", "memory"} <= container["resources"]["requests"].keys(), what
    for role, (_, pod, container) in by_role(objs).items():
        mounted_file(objs, pod, container, preset_of(argv(container)))  # config from the ConfigMap
        if role in HTTP_ROLES:
            for probe in ("readinessProbe", "livenessProbe"):
                assert container[probe]["httpGet"]["path"] == "/healthz", (role, probe)
                assert port_number(container, container[probe]["httpGet"]["port"]) == port_number(
                    container, HTTP_ROLES[role]
                )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_settings_load_and_ports_agree(built: dict[str, list[Obj]], overlay: str, tmp_path: Path) -> None:
    """Each container's settings (ConfigMap + its environment) against the Services and its own ports."""
    objs = built[overlay]
    roles, cfg = by_role(objs), settings_by_role(objs, tmp_path)
    services = {s["metadata"]["name"]: s for s in of_kind(objs, "Service")}

    def service_port(url: str) -> int:
        parts = urlsplit(url)
        assert parts.hostname in services, f"{url}: no Service {parts.hostname}"
        ports = [p["port"] for p in services[parts.hostname]["spec"]["ports"]]
        assert parts.port in ports, f"{url}: Service {parts.hostname} has ports {ports}"
        return typing.cast(int, parts.port)

    for role in ("reward", "control"):
        server, container = getattr(cfg[role], role), roles[role][2]
        assert server.host == "0.0.0.0"
        assert server.port == port_number(container, "http") == service_port(server.url)
    assert service_port(cfg["rollout"].reward.url) == cfg["reward"].reward.port  # what the workers call

    redis_container = one(objs, "StatefulSet", "redis")["spec"]["template"]["spec"]["containers"][0]
    redis_env = container_env(redis_container, secrets_of(objs))
    redis_args = [expand(word, redis_env) for word in argv(redis_container)]
    for role in ("control", "learner", "rollout", "prompts"):
        url = urlsplit(cfg[role].bus.url)
        assert service_port(cfg[role].bus.url) == int(redis_args[redis_args.index("--port") + 1]), role
        assert url.password == redis_args[redis_args.index("--requirepass") + 1], role

    learner_set = one(objs, "StatefulSet", "learner")
    headless = services[learner_set["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    dns = f"learner-0.{headless['metadata']['name']}.{learner_set['metadata']['namespace']}.svc.cluster.local"
    learner, sync, container = cfg["learner"].learner, cfg["learner"].sync, roles["learner"][2]
    assert sync.host == cfg["rollout"].sync.host == dns
    assert sync.secret == cfg["rollout"].sync.secret == SECRETS["SYNC_SECRET"]
    named = {"sync-store": sync.port, "sync-http": sync.http_port, "metrics": learner.metrics.port}
    for name, number in named.items():
        assert port_number(container, name) == number
        assert {"name": name, "port": number, "targetPort": name} in headless["spec"]["ports"]
    assert learner.metrics.host == cfg["rollout"].rollout.metrics.host == "0.0.0.0"
    assert port_number(roles["rollout"][2], "metrics") == cfg["rollout"].rollout.metrics.port
    claims = {c["metadata"]["name"] for c in learner_set["spec"]["volumeClaimTemplates"]}
    run_mount = [m for m in container["volumeMounts"] if m["mountPath"] == cfg["learner"].run_dir]
    assert run_mount and run_mount[0]["name"] in claims  # checkpoints live on the learner's PVC


def test_the_agents_overlay_plays_episodes_with_the_environment_service(
    built: dict[str, list[Obj]], tmp_path: Path
) -> None:
    """overlays/agents: `sparkrl env` behind its Service, and the workers and the evaluator calling it."""
    objs = built["agents"]
    cfg, container = settings_by_role(objs, tmp_path), by_role(objs)["env"][2]
    (service,) = [s for s in of_kind(objs, "Service") if s["metadata"]["name"] == "env"]
    assert cfg["env"].env.host == "0.0.0.0" and port_number(container, "http") == cfg["env"].env.port
    for role in ("rollout", "evaluator"):
        agent = cfg[role].rollout.agent
        url = urlsplit(agent.url)
        assert agent.environment == "countdown_retry", role
        assert (
            url.hostname == "env" and url.port == service["spec"]["ports"][0]["port"] == cfg["env"].env.port
        )
    assert cfg["rollout"].rollout.agent.environment not in cfg["env"].env.custom_environments  # shipped


def test_gpu_overlay_gives_gpus_and_gpu_settings(built: dict[str, list[Obj]]) -> None:
    objs, roles = built["gpu"], by_role(built["gpu"])
    tree = yaml.safe_load(one(objs, "ConfigMap")["data"]["sparkrl.yaml"])
    assert (tree["learner"]["device"], tree["learner"]["dtype"]) == ("cuda", "bfloat16")
    assert tree["sync"]["backend"] == "nccl"
    assert tree["rollout"]["engine"]["kind"] == "vllm"
    images = {"learner": "sparkrl-learner:", "rollout": "sparkrl-rollout:"}
    for role, (_, _, container) in roles.items():
        gpus = int(container["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
        assert gpus == (1 if role in images else 0), role
        assert container["image"].startswith(images.get(role, "sparkrl-cpu:")), (role, container["image"])


def test_cpu_overlay_runs_the_cpu_image(built: dict[str, list[Obj]]) -> None:
    objs = built["cpu"]
    tree = yaml.safe_load(one(objs, "ConfigMap")["data"]["sparkrl.yaml"])
    assert tree["sync"]["backend"] == "gloo" and tree["rollout"]["engine"]["kind"] == "torch"
    for _, _, container in by_role(objs).values():
        assert container["image"].startswith("sparkrl-cpu:"), container["image"]
        assert "nvidia.com/gpu" not in container["resources"].get("limits", {})


# ── KubeRay ───────────────────────────────────────────────────────────────────────────────────────────

# The fields of KubeRay's ray.io/v1 types (ray-operator/apis/ray/v1: RayJobSpec, RayClusterSpec,
# HeadGroupSpec, WorkerGroupSpec): a misspelt one would be dropped by the API server without a word.
RAYJOB_SPEC = {
    "activeDeadlineSeconds", "backoffLimit", "rayClusterSpec", "submitterPodTemplate", "metadata",
    "clusterSelector", "submitterConfig", "managedBy", "deletionStrategy", "entrypoint", "runtimeEnvYAML",
    "jobId", "submissionMode", "entrypointResources", "entrypointNumCpus", "entrypointNumGpus",
    "ttlSecondsAfterFinished", "shutdownAfterJobFinishes", "suspend",
}  # fmt: skip
RAYCLUSTER_SPEC = {
    "headGroupSpec", "workerGroupSpecs", "rayVersion", "enableInTreeAutoscaling", "autoscalerOptions",
    "headServiceAnnotations", "suspend",
}  # fmt: skip
HEAD_GROUP = {"serviceType", "headService", "enableIngress", "rayStartParams", "template"}
WORKER_GROUP = {
    "groupName", "replicas", "minReplicas", "maxReplicas", "numOfHosts", "rayStartParams", "template",
    "scaleStrategy",
}  # fmt: skip


def test_rayjob_structure_and_its_objects(built: dict[str, list[Obj]], tmp_path: Path) -> None:
    objs = built["ray"]
    for obj in objs:
        if obj["kind"] != "RayJob":
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    job = one(objs, "RayJob")
    assert job["apiVersion"] == "ray.io/v1" and job["metadata"]["namespace"] == "sparkrl"
    spec = job["spec"]
    assert spec.keys() <= RAYJOB_SPEC, spec.keys() - RAYJOB_SPEC
    assert spec.get("submissionMode", "K8sJobMode") in {"K8sJobMode", "HTTPMode", "InteractiveMode"}
    assert isinstance(spec["entrypoint"], str) and spec["shutdownAfterJobFinishes"] is True
    assert isinstance(spec.get("ttlSecondsAfterFinished", 0), int)
    cluster = spec["rayClusterSpec"]
    assert cluster.keys() <= RAYCLUSTER_SPEC, cluster.keys() - RAYCLUSTER_SPEC
    head = cluster["headGroupSpec"]
    assert head.keys() <= HEAD_GROUP and {"rayStartParams", "template"} <= head.keys()
    groups = [("head", head)]
    for group in cluster["workerGroupSpecs"]:
        assert group.keys() <= WORKER_GROUP and {"groupName", "rayStartParams", "template"} <= group.keys()
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]
        groups.append((group["groupName"], group))
    assert len({name for name, _ in groups}) == len(groups)
    preset = preset_of(shlex.split(spec["entrypoint"]))
    for name, group in groups:
        assert all(isinstance(v, str) for v in group["rayStartParams"].values()), name
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}}
        kubernetes_validate.validate(template | {"template": group["template"]}, K8S_VERSION, strict=True)
        pod = group["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        text = mounted_file(objs, pod, pod["containers"][0], preset)  # every node can read the preset
    settings = load_with_env(text, {}, tmp_path)
    head_pod = head["template"]["spec"]
    run_mount = [m for m in head_pod["containers"][0]["volumeMounts"] if m["mountPath"] == settings.run_dir]
    assert run_mount, "the head (where `sparkrl up` runs) has no volume at run_dir"
    volume = next(v for v in head_pod["volumes"] if v["name"] == run_mount[0]["name"])
    one(objs, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])


def test_rayjob_entrypoint_is_a_real_command(built: dict[str, list[Obj]]) -> None:
    words = shlex.split(one(built["ray"], "RayJob")["spec"]["entrypoint"])
    assert words[:2] == ["sparkrl", "up"] and "--ray" in words
    assert check_command(words)["ray"] is True
