"""`sparkrl up --ray`: the same stack on Ray. The learner and each rollout worker run as Ray actors with
the resource requests of the `ray` settings (restarted by Ray when their process dies), the reward
service as a Ray Serve deployment behind Serve's HTTP proxy on reward.host:reward.port; Redis (private,
started for the run, or `bus.url`), the control service and the feeder run beside them as processes,
exactly as `sparkrl up` runs them. Same settings tree, same run directory layout (RUN_DIR/logs/*.log).

An actor drives the same `build` / `step` / `close` of its service as the plain process; the driver (the
CLI) owns the signals and turns Ctrl-C into an ordered stop: the learner finishes its step and
checkpoints, then the workers, then Serve.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import httpx

from sparkrl.launcher import Stack, StackError, logtail_bytes, supervise
from sparkrl.plan import StackPlan, plan_stack, write_configs
from sparkrl.services.common.bus._text import mask_password
from sparkrl.services.common.settings import RewardSettings, SparkSettings
from sparkrl.services.common.settings.roles import LearnerConfig, RolloutConfig

BESIDE = ("redis", "judge", "control", "env", "prompts", "evaluator")  # plain processes beside the actors
STOP_GRACE_S = 30.0


class ServiceActor:
    """One learner or rollout worker in a Ray actor process; `run()` is its loop, `stop()` ends it.

    Made a Ray actor class by `ray.remote` at launch (so importing this module needs no Ray). Its output
    goes to RUN_DIR/logs/<name>.log, as a process of `sparkrl up` writes it.
    """

    cfg: LearnerConfig | RolloutConfig

    def __init__(self, role: str, name: str, config: dict[str, Any], resume: bool) -> None:
        """`config`: the role's config (`roles.py`) as the driver resolved it, dumped to JSON."""
        import ray

        self.role, self.name = role, name
        # The driver's settings, validated as they are: not this process's environment.
        self.cfg = (LearnerConfig if role == "learner" else RolloutConfig).model_validate(config)
        log_path = Path(self.cfg.run_dir) / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        from sparkrl.services.common.logs import setup_logging

        with warnings.catch_warnings():  # Ray's own property trips its deprecation of `actor_id`
            warnings.simplefilter("ignore")
            restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        label = role
        if isinstance(self.cfg, RolloutConfig):
            # A new id per incarnation: a restarted worker joins the next broadcast epoch as a new member,
            # and the prompts the dead one held are reclaimed after bus.claim_idle_ms.
            self.cfg.rollout.worker_id = f"{name}.{os.getpid()}"
            label = f"rollout[{self.cfg.rollout.worker_id}]"
        setup_logging(label)
        # A learner that Ray restarts goes on from its checkpoint and journal, as `--resume` does.
        self.resume = resume or (role == "learner" and restarted)
        self.stopping = threading.Event()
        if restarted:
            import logging

            logging.getLogger("sparkrl").warning("%s restarted by Ray (its process had died)", name)

    def run(self) -> str:
        if isinstance(self.cfg, LearnerConfig):
            from sparkrl.services.learner.service import main as learner_main

            learner_main(self.cfg, resume=self.resume, stop=self.stopping)
        else:
            from sparkrl.services.rollout.service import main as worker_main

            worker_main(self.cfg, stop=self.stopping)
        sys.stdout.flush()
        return self.name

    def stop(self) -> None:
        self.stopping.set()

    def pid(self) -> int:
        return os.getpid()

    def worker_id(self) -> str | None:
        return self.cfg.rollout.worker_id if isinstance(self.cfg, RolloutConfig) else None


class RewardIngress:
    """The reward service's FastAPI app as a Ray Serve ingress, built in each replica."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = RewardSettings.model_validate(settings)

    def __serve_build_asgi_app__(self) -> Any:
        from sparkrl.services.reward.app import create_app

        return create_app(self.settings)


def _actor_configs(s: SparkSettings) -> dict[str, LearnerConfig | RolloutConfig]:
    """The configs of the actors' roles, from the root tree."""
    return {"learner": LearnerConfig.of(s), "rollout": RolloutConfig.of(s)}


def _ray_said(address: str | None) -> str:
    """One line on the Ray the run uses, and its token authentication (Ray's default)."""
    where = f"the cluster at {address}" if address else "a local cluster for this run"
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        auth = "token authentication on (its token: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
    else:
        auth = "token authentication off (RAY_AUTH_MODE)"
    return f"Ray: {where}, {auth}"


def start_reward(cfg: SparkSettings, timeout_s: float = 180.0) -> str:
    """Deploy the reward service on Serve (proxy on reward.host:reward.port); its URL once healthy."""
    from ray import serve

    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # its INFO lines are Serve's bookkeeping

    rs, opts = cfg.reward, cfg.ray.reward
    # One proxy, on the head: by default Serve runs one on every node that holds a replica, and each binds
    # reward.host, which is one machine's address (the workers call reward.url, the head's).
    serve.start(proxy_location="HeadOnly", http_options={"host": rs.host, "port": rs.port}, detached=False)
    replica = {"num_cpus": opts.num_cpus, **({"resources": opts.resources} if opts.resources else {})}
    options: dict[str, Any] = {"name": "reward", "ray_actor_options": replica}
    if opts.autoscaling is not None:
        a = opts.autoscaling
        options["autoscaling_config"] = {
            "min_replicas": a.min_replicas,
            "max_replicas": a.max_replicas,
            "target_ongoing_requests": a.target_ongoing_requests,
        }
    else:
        options["num_replicas"] = opts.num_replicas
    deployment = serve.deployment(serve.ingress()(RewardIngress)).options(**options)
    serve.run(deployment.bind(rs.model_dump(mode="json")), name="reward", route_prefix="/")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            healthy = httpx.get(f"{rs.url}/healthz", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            healthy = False  # the proxy is not listening yet
        if healthy:
            return rs.url
        time.sleep(0.5)
    raise StackError(f"the reward deployment did not answer {rs.url}/healthz within {timeout_s:.0f}s")


def fit_to_cluster(s: SparkSettings, workers: int, cpus: float) -> tuple[list[str], list[str]]:
    """Make the actors' CPU requests fit a cluster of `cpus` CPUs: a request left at its default (1 CPU)
    becomes a fair share (`cpus` over every actor and reward replica); explicit ones are kept. Changes
    `s.ray` in place; (what was fitted, why it cannot fit) — the second empty when it fits."""
    r = s.ray
    replicas = r.reward.autoscaling.min_replicas if r.reward.autoscaling else r.reward.num_replicas
    parts = [
        (r.learner, 1, "ray.learner"),
        (r.rollout, workers, "ray.rollout"),
        (r.reward, replicas, "ray.reward"),
    ]

    def asked() -> float:
        return sum(section.num_cpus * count for section, count, _ in parts)

    fitted: list[str] = []
    if asked() > cpus:
        share = max(0.01, int(100 * cpus / max(1, 1 + workers + replicas)) / 100)
        for section, count, name in parts:
            if "num_cpus" not in section.model_fields_set and count and section.num_cpus > share:
                fitted.append(f"{name}.num_cpus {section.num_cpus:g} → {share:g}")
                section.num_cpus = share
    if asked() <= cpus + 1e-9:
        return fitted, []
    asks = ", ".join(
        f"{name.removeprefix('ray.')} {count} × {section.num_cpus:g}" for section, count, name in parts
    )
    return fitted, [
        f"the actors ask for {asked():g} CPUs ({asks}) and the Ray cluster has {cpus:g}: lower "
        "ray.learner.num_cpus / ray.rollout.num_cpus / ray.reward.num_cpus (fractions work), start fewer "
        "workers, or give Ray more CPUs (ray.num_cpus)"
    ]


def _actor_env() -> dict[str, str]:
    keep = ("TORCH_EXTENSIONS_DIR", "SPARKRL_LOG_LEVEL", "PYTHONPATH")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env["PYTHONUNBUFFERED"] = "1"
    return env


class RayStack:
    """The actors and the Serve app of one run, beside the plain processes of `Stack`."""

    def __init__(self, plan: StackPlan, address: str | None, resume: bool) -> None:
        self.plan, self.address, self.resume = plan, address, resume
        self.beside = Stack(plan, services=[s.name for s in plan.services if s.role in BESIDE])
        self.learner: Any = None
        self.workers: dict[str, Any] = {}
        self.runs: dict[str, Any] = {}  # name → the ObjectRef of its run()
        self.placing: dict[str, tuple[Any, str]] = {}  # name → (its pid() ref, what it asks): not placed yet
        self.started_at = time.monotonic()

    def start(self) -> None:
        import ray

        s = self.plan.settings
        self.beside.start()
        address = self.address or s.ray.address
        ray.init(
            address=address,
            num_cpus=s.ray.num_cpus if address is None else None,
            include_dashboard=False,
            runtime_env={"env_vars": _actor_env()},
            log_to_driver=False,  # each actor writes RUN_DIR/logs/<name>.log
            # Ray's own start-up lines (a token "enabled ... to opt out" warning, "Started a local Ray
            # instance") alarmed more than they told: said once below, in the run's terms.
            logging_level=logging.ERROR,
        )
        logging.getLogger("ray").setLevel(logging.WARNING)  # what goes wrong later is still said
        self.beside.report(_ray_said(address))
        # ray.init installs its own SIGTERM handler (a stack dump, then abort): take it back, so SIGTERM is
        # the ordered stop Ctrl-C is (learner's step and checkpoint, workers, Serve) and ends in a summary.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        cpus = float(ray.cluster_resources().get("CPU", 0))
        workers = sum(1 for spec in self.plan.services if spec.role == "rollout")
        fitted, refused = fit_to_cluster(s, workers, cpus)
        if refused:
            raise StackError(refused[0])
        if fitted:
            self.beside.report(f"Ray cluster of {cpus:g} CPUs: requests fitted ({'; '.join(fitted)})")
        start_reward(s)
        # Each actor its role's part of the root tree (as before the per-role files: no worker id, no
        # planned /metrics port, which need not be free on the node Ray places it on).
        configs = {role: config.model_dump(mode="json") for role, config in _actor_configs(s).items()}
        actor = ray.remote(ServiceActor)
        for spec in self.plan.services:
            if spec.role not in ("learner", "rollout"):
                continue
            res = s.ray.learner if spec.role == "learner" else s.ray.rollout
            handle = actor.options(
                name=f"sparkrl-{spec.name}",
                num_cpus=res.num_cpus,
                num_gpus=res.num_gpus,
                resources=res.resources or None,  # custom resources: which nodes may hold it
                max_restarts=res.max_restarts,
                max_task_retries=-1,  # run() goes on in the restarted actor
                max_concurrency=2,  # stop() arrives while run() loops
            ).remote(spec.role, spec.name, configs[spec.role], self.resume)
            if spec.role == "learner":
                self.learner = handle
            else:
                self.workers[spec.name] = handle
            asks = ", ".join([f"{res.num_cpus:g} CPU", *(f"{k} {v:g}" for k, v in res.resources.items())])
            self.placing[spec.name] = (handle.pid.remote(), asks)
            self.runs[spec.name] = handle.run.remote()
        self.started_at = time.monotonic()

    def check_placement(self, after_s: float = 20.0) -> None:
        """Say, once, which actors Ray has not placed after `after_s`: what they ask, what is free."""
        import ray

        if not self.placing:
            return
        refs = [ref for ref, _ in self.placing.values()]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for name in [n for n, (ref, _) in self.placing.items() if ref in done]:
            del self.placing[name]
        if not self.placing or time.monotonic() - self.started_at < after_s:
            return
        free, total = ray.available_resources().get("CPU", 0.0), ray.cluster_resources().get("CPU", 0.0)
        for name, (_, asks) in sorted(self.placing.items()):
            self.beside.report(
                f"{name} not schedulable yet: asks for {asks}, the cluster has {free:g} of {total:g} CPUs "
                "free (ray.learner / ray.rollout .num_cpus and .resources, which only nodes started with "
                "`ray start --resources` offer; other jobs on a shared cluster count too)"
            )
        self.placing.clear()

    def wait(self, poll_s: float = 0.5) -> int:
        """Until the learner's run() returns (0), it fails for good, or a process beside fails."""
        import ray

        try:
            while True:
                done, _ = ray.wait([self.runs["learner"]], timeout=poll_s)
                if done:
                    try:
                        ray.get(done[0])
                    except ray.exceptions.RayError as exc:
                        self.beside.report(f"error: the learner failed: {exc}\n{self._log('learner')}")
                        return 1
                    self.beside.report("learner finished")
                    return 0
                code = self.beside.poll()
                if code is not None:
                    return code
                self.check_placement()
                self.beside.show_progress(self.beside.progress())
        except KeyboardInterrupt:
            self.beside.report("interrupted: stopping the learner (it finishes its step and checkpoints)")
            return 130
        finally:
            self.beside.end_line()

    def shutdown(self) -> None:
        import ray

        if not ray.is_initialized():
            self.beside.shutdown()
            return
        try:
            if self.learner is not None:
                self._stop(["learner"], [self.learner])
            self._stop(list(self.workers), list(self.workers.values()))
            # No serve.shutdown(): Serve was started for this job (detached=False), so ray.shutdown ends
            # it with the job; its own graceful shutdown raced its controller's kill and printed a
            # "(raylet) Task ServeController.graceful_shutdown failed" line at every clean end.
        except KeyboardInterrupt:
            self.beside.report("interrupted again: tearing Ray down now")
        finally:
            ray.shutdown()
            self.beside.shutdown()

    def _stop(self, names: list[str], handles: list[Any]) -> None:
        import ray

        refs = [self.runs[n] for n in names]
        stops = []
        for name, handle in zip(names, handles, strict=True):
            try:
                stops.append(handle.stop.remote())
            except ray.exceptions.RayError as exc:
                self.beside.report(f"{name} is gone already: {exc}")
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=STOP_GRACE_S)
        # The stop calls end too before anything is killed: one killed while its stop() was still queued
        # made Ray print "(raylet) Task ServiceActor.stop failed ... killed by ray.kill" at a clean end.
        # An actor that stopped is left to ray.shutdown (its job's end), only a stuck one is killed.
        ray.wait(stops, num_returns=len(stops), timeout=5.0)
        for name, handle, ref in zip(names, handles, refs, strict=True):
            if ref in pending:
                self.beside.report(f"{name} did not stop within {STOP_GRACE_S:g}s: killing it")
                ray.kill(handle, no_restart=True)

    def _log(self, name: str) -> str:
        return f"last lines of {self.plan.run_dir / 'logs' / f'{name}.log'}:\n" + logtail_bytes(
            self.plan.run_dir / "logs" / f"{name}.log"
        )


def run_on_ray(
    cfg: SparkSettings,
    workers: int,
    private_redis: bool | None,
    preset_name: str | None,
    resume: bool = False,
    address: str | None = None,
) -> int:
    """`sparkrl up --ray`: plan, start the processes beside, Ray, Serve and the actors; supervise until the
    learner ends; stop in order; summarize. The exit code."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as exc:
        raise SystemExit(
            f"sparkrl up --ray needs Ray Serve ({exc}): pip install torch==2.13.0 'sparkrl[ray]'"
        ) from exc
    plan = plan_stack(cfg, workers, private_redis, resume)
    write_configs(plan)
    s = plan.settings
    where = address or s.ray.address or f"a local Ray ({s.ray.num_cpus or 'all'} CPUs)"
    print(
        f"sparkrl up --ray: preset {preset_name or '(defaults)'}, run dir {plan.run_dir}, {workers} worker "
        f"actors on {where}\n  redis {mask_password(s.bus.url)} | reward (Ray Serve) {s.reward.url}"
        f" | logs {plan.run_dir / 'logs'}/\n  live page {plan.page_url} | token {plan.token_path}",
        flush=True,
    )
    stack = RayStack(plan, address, resume)
    return supervise(stack, stack.beside.report, plan.run_dir)
