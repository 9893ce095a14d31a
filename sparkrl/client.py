"""The CLI clients of the control API: `sparkrl status`, `pause`, `resume`, `stop`, `checkpoint`, `set`.

Where to call and with which token, highest priority first: `--url` / `--token`; the environment
(`SPARKRL_CONTROL__URL`, `SPARKRL_CONTROL__TOKEN`, `SPARKRL_CONTROL__TOKEN_FILE`); the run directory
(`--run-dir`: its `config/control.yaml` and `control-token`, as `sparkrl up` wrote them); without any of
them, the newest live run under the working directory (`./`, `./*/`, `./runs/*/`: a `run.lock` whose
`sparkrl up` still runs). A run directory that no live `sparkrl up` holds is not dialled: the client says
why the run ended (its `ended.json`) instead of "cannot reach".
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from sparkrl.proto.control import HyperparameterPatch
from sparkrl.run_files import MISSING, fmt, read_ended
from sparkrl.run_lock import LOCK_FILE, live_holder, read_lock


class ClientError(RuntimeError):
    """The API could not be reached or answered an error; the message says what to do."""


class RunEnded(ClientError):
    """The run directory's run is over: no control service to call. The message says when and why."""


@dataclass(frozen=True)
class Endpoint:
    url: str
    token: str | None
    found: Path | None = None  # the live run found under the working directory (none was named)


def _run_dir_endpoint(run_dir: Path) -> tuple[str | None, str | None]:
    config = run_dir / "config" / "control.yaml"
    if not config.is_file():
        raise ClientError(f"{config} not found: is {run_dir} a run directory written by `sparkrl up`?")
    control = (yaml.safe_load(config.read_text()) or {}).get("control", {})
    token_file = Path(control.get("token_file") or run_dir / "control-token")
    token = token_file.read_text().strip() if token_file.is_file() else None
    return control.get("url"), token


def resolve_endpoint(url: str | None, token: str | None, run_dir: Path | None) -> Endpoint:
    env = os.environ
    url = url or env.get("SPARKRL_CONTROL__URL")
    found = None
    if url is None and run_dir is None:
        run_dir = found = newest_live_run(Path.cwd())
    if url is None and run_dir is not None:
        refuse_ended(run_dir)
    from_dir: tuple[str | None, str | None] = _run_dir_endpoint(run_dir) if run_dir else (None, None)
    token_file = env.get("SPARKRL_CONTROL__TOKEN_FILE")
    env_token = env.get("SPARKRL_CONTROL__TOKEN") or (
        Path(token_file).read_text().strip() if token_file and Path(token_file).is_file() else None
    )
    if url is None and from_dir[0] is None:
        raise ClientError(f"{run_dir}/config/control.yaml names no control.url: pass --url")
    return Endpoint((url or from_dir[0] or "").rstrip("/"), token or env_token or from_dir[1], found)


def newest_live_run(where: Path) -> Path:
    """The run directory under `where` (itself, `*/`, `runs/*/`) that a live `sparkrl up` took last."""
    candidates = [where, *where.glob("*/"), *where.glob("runs/*/")]
    live = [d for d in candidates if (d / "config" / "control.yaml").is_file() and live_holder(d) is not None]
    if not live:
        raise ClientError(
            f"no live run under {where} (looked for a live {LOCK_FILE} in ./, ./*/ and ./runs/*/): pass "
            "--run-dir RUN_DIR (the one `sparkrl up` printed), or --url for a control service elsewhere"
        )
    newest = max(live, key=lambda d: read_lock(d).since if read_lock(d) else 0.0)  # type: ignore[union-attr]
    return Path(os.path.relpath(newest, where)) if newest.is_relative_to(where) else newest


def refuse_ended(run_dir: Path) -> None:
    """RunEnded (or ClientError) when no live `sparkrl up` holds `run_dir`: its ended.json says why."""
    if not (run_dir / "config").is_dir() or live_holder(run_dir) is not None:
        return  # not a run directory (said when its config is read), or live: call it
    ended = read_ended(run_dir)
    if not ended:
        raise RunEnded(
            f"the run in {run_dir} is not running (no live `sparkrl up` holds it) and wrote no ended.json: "
            f"it was killed; `sparkrl up --resume --run-dir {run_dir}` continues it"
        )
    at = f" at step {ended['step']}" if isinstance(ended.get("step"), int) else ""
    raise RunEnded(f"the run in {run_dir} ended{at}: {ended.get('reason') or 'no reason recorded'}")


def call(endpoint: Endpoint, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """One API call; the decoded JSON answer, or ClientError with the server's reason."""
    headers = {"Authorization": f"Bearer {endpoint.token}"} if endpoint.token else {}
    try:
        # The server waits up to control.command_timeout_s for every target; do not give up before it.
        response = httpx.request(method, endpoint.url + path, json=body, headers=headers, timeout=3600)
    except httpx.HTTPError as exc:
        where = f" (the run in {endpoint.found} is live: it may still be starting)" if endpoint.found else ""
        raise ClientError(f"cannot reach the control service at {endpoint.url}{where}: {exc}") from exc
    try:
        answer = response.json()
    except ValueError:
        answer = {"detail": response.text}
    if response.status_code >= 400:
        raise ClientError(f"{method} {path}: HTTP {response.status_code}: {_detail(answer)}")
    return answer


def _detail(answer: Any) -> str:
    detail = answer.get("detail", answer) if isinstance(answer, dict) else answer
    if isinstance(detail, list):  # 422: one entry per rejected field
        return "; ".join(f"{'.'.join(str(x) for x in e.get('loc', [])[1:])}: {e.get('msg')}" for e in detail)
    if isinstance(answer, dict) and answer.get("waiting_for"):
        return f"{detail} (waiting for: {', '.join(answer['waiting_for'])})"
    return str(detail)


def parse_assignments(pairs: list[str]) -> dict[str, int | float]:
    """`lr=2e-6 max_staleness=3` → {"lr": 2e-06, "max_staleness": 3}. Every live value is a number and the
    API takes JSON numbers only, so each is converted here (YAML would leave `2e-6` a string)."""
    values: dict[str, int | float] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name.strip():
            raise ClientError(f"{pair!r} is not name=value (e.g. lr=2e-6)")
        values[_live_name(name.strip())] = _number(name.strip(), raw.strip())
    return values


def _live_name(name: str) -> str:
    """`name` if the control API takes it live (HyperparameterPatch's fields), else ClientError with the
    closest names and the whole list: the API would only answer a bare 422."""
    live = list(HyperparameterPatch.model_fields)
    if name in live:
        return name
    close = difflib.get_close_matches(name, live, n=2, cutoff=0.6)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    raise ClientError(
        f"{name}: not a live-settable name{hint}; live-settable: {', '.join(live)} (a loss's own parameters "
        "only while that loss runs; everything else is set at start: `sparkrl up --set learner.NAME=...`)"
    )


def _number(name: str, raw: str) -> int | float:
    try:
        return int(raw)
    except ValueError:
        pass
    try:
        value = float(raw)
    except ValueError:
        raise ClientError(f"{name}={raw!r}: not a number (e.g. {name}=2e-6)") from None
    if not math.isfinite(value):
        raise ClientError(f"{name}={raw!r}: a value must be finite")
    return value


def format_command(answer: dict[str, Any]) -> str:
    lines = [f"{answer['command']}: {answer['outcome']}"]
    for result in answer.get("results", []):
        values = " ".join(f"{k}={v}" for k, v in result.get("values", {}).items())
        lines.append(
            f"  {result['target']}: {result['outcome']} — {result['detail']}"
            + (f" [{values}]" if values else "")
        )
    for target in answer.get("gone", []):
        lines.append(f"  {target}: gone before it answered")
    return "\n".join(lines)


def format_status(status: dict[str, Any], workers: dict[str, Any]) -> str:
    # The id column fits the longest id (a Ray worker's is `worker-N.<pid>`) and a space.
    width = max([14, *(len(w["worker_id"]) + 2 for w in workers["workers"])])
    total = f"/{status['max_steps']}" if status.get("max_steps") else ""
    lines = [
        f"learner {status['state']} | step {status['step']}{total} | version {status['policy_version']}"
        f" | loss {fmt(status.get('last_loss'), '.4g')} | reward {fmt(status.get('last_reward'), '.3f')}"
        f" | entropy {fmt(status.get('last_entropy'), '.3f')}"
        f" | {fmt(status.get('tokens_per_s'), '.0f')} tok/s trained,"
        f" {status['generation_tokens_per_s']:.0f} tok/s generated"
        + (" | PAUSED" if status["paused"] else ""),
        "hyperparameters: " + (" ".join(f"{k}={v}" for k, v in status["hyperparameters"].items()) or MISSING),
        "sampling: " + (" ".join(f"{k}={v}" for k, v in status["sampling"].items()) or MISSING),
        f"{'worker':<{width}}{'state':<12}{'version':>8}{'lag':>5}{'sync s':>8}{'sync MB':>9}{'fails':>6}"
        f"{'beat s':>8}{'tok/s':>8}{'in flight':>10}",
    ]
    for w in workers["workers"]:
        mb = None if w.get("last_sync_bytes") is None else w["last_sync_bytes"] / 1e6
        lines.append(
            f"{w['worker_id']:<{width}}{w['state']:<12}"
            f"{fmt(w.get('policy_version'), 'd'):>8}{fmt(w.get('lag'), 'd'):>5}"
            f"{fmt(w.get('last_sync_seconds'), '.2f'):>8}{fmt(mb, '.1f'):>9}{w['sync_failures']:>6}"
            f"{w['heartbeat_age_s']:>8.1f}{w['tokens_per_s']:>8.0f}{w['prompts_in_flight']:>10}"
            + (f"  dropped: {w['dropped_reason']}" if w.get("dropped_reason") else "")
        )
    return "\n".join(lines)
