"""The wide experiment's records: what of a finished run outlives the checkout that ran it (issue 29).

`runs/` is git-ignored, so a run's folder stays on the machine that made it. A record is the part the
report reads, small enough to commit (OUT/wide/RUN/, docs/learning-quality/wide/RUN/ for the experiment):

    record.json        the run's name and spec, the scale, its finished steps and final version, when it
                       finished, when and at which commit it was recorded, what was removed or left out
    metrics.jsonl.gz   the step rows, whole (every metric, hparams, sparks), one per step: the last written
                       for it, as `sparkrl.run_files.read_steps` reads them
    eval.jsonl         the held-out evaluations, one per version
    summary.json       what `sparkrl up` wrote at the run's end
    config/*.yaml      the resolved configs, their secrets removed: credentials in any URL (`bus.url`'s
                       Redis password) and every `secret` / `token` / `password` value (`sync.secret`) set
                       to null; `redis.conf` (its `requirepass`) left out

No weights, checkpoints, journal, samples or logs. A record is written into a hidden `.partial-` folder
beside it and renamed into place, so a folder named for a run is a whole record or absent.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import shutil
import subprocess
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from sparkrl.proto.telemetry import StepMetrics
from sparkrl.run_files import SUMMARY_FILE, Steps, read_evals, read_steps

RECORD_FILE = "record.json"  # written last into the partial folder: its presence marks a record
STEPS_FILE = "metrics.jsonl.gz"
EVAL_FILE = "eval.jsonl"  # the run's own name, so `sparkrl.run_files.read_evals` reads a record too
CONFIG_DIR = "config"
PARTIAL_PREFIX = ".partial-"
STALE_PARTIAL_S = 600.0  # a record takes well under a second to write: older partials are a killed write's
SECRET_NAMES = frozenset({"secret", "token", "read_token", "password"})
URL_CREDENTIALS = re.compile(r"^([a-z][a-z0-9+.-]*://)[^/@\s]*@", re.IGNORECASE)
LEFT_OUT = "weights, checkpoints, journal, samples, logs, redis.conf (its requirepass)"


def recorded_steps(record_dir: Path) -> int | None:
    """The finished steps a record holds; None when `record_dir` is no record."""
    try:
        return int(json.loads((record_dir / RECORD_FILE).read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_record_steps(record_dir: Path) -> Steps:
    """The record's step rows, in step order (one per step already: the record kept the last of each)."""
    with gzip.open(record_dir / STEPS_FILE, "rt", encoding="utf-8") as file:
        rows = [StepMetrics.model_validate_json(line) for line in file if line.strip()]
    return Steps(rows, superseded=0, skipped=0)


def write_record(run_dir: Path, record_dir: Path, about: dict[str, Any], extra: tuple[str, ...] = ()) -> bool:
    """Records the finished run in `run_dir` at `record_dir`; `about` (its spec, the scale) goes into
    record.json, and the files of `run_dir` named in `extra` (an experiment's own measurements) are copied
    beside it. False when another process recorded it first (the experiment and `--record-only` may both
    try)."""
    if record_dir.exists():
        if recorded_steps(record_dir) is not None:
            return False
        raise SystemExit(f"{record_dir} exists but holds no {RECORD_FILE}: not a record; move it away")
    record_dir.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f"{PARTIAL_PREFIX}{record_dir.name}-", dir=record_dir.parent))
    try:
        _fill(run_dir, partial, about)
        for name in extra:
            shutil.copyfile(run_dir / name, partial / name)
        partial.chmod(0o755)  # mkdtemp's 0700 would follow the folder into a checkout
        partial.rename(record_dir)
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
        if recorded_steps(record_dir) is not None:
            return False  # renamed into place by the other writer between our check and our rename
        raise
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return True


def remove_stale_partials(records: Path) -> list[Path]:
    """The `.partial-` folders a killed write left (older than STALE_PARTIAL_S), removed: a hidden folder
    must not be committed with the records. A younger one may be another process's write in flight."""
    removed = []
    for partial in records.glob(f"{PARTIAL_PREFIX}*") if records.is_dir() else ():
        if time.time() - partial.stat().st_mtime > STALE_PARTIAL_S:
            shutil.rmtree(partial, ignore_errors=True)
            removed.append(partial)
    return removed


def _fill(run_dir: Path, record_dir: Path, about: dict[str, Any]) -> None:
    rows = read_steps(run_dir).rows
    evals = read_evals(run_dir)
    text = "".join(row.model_dump_json() + "\n" for row in rows).encode()
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", compresslevel=9, mtime=0) as gz:  # mtime 0: same bytes
        gz.write(text)
    (record_dir / STEPS_FILE).write_bytes(buffer.getvalue())
    (record_dir / EVAL_FILE).write_text("".join(e.model_dump_json() + "\n" for e in evals))
    shutil.copyfile(run_dir / SUMMARY_FILE, record_dir / SUMMARY_FILE)
    removed = _copy_configs(run_dir / CONFIG_DIR, record_dir / CONFIG_DIR)
    record = {
        **about,
        "steps": rows[-1].step if rows else 0,
        "final_version": evals[-1].policy_version if evals else None,
        "finished_at": _iso(rows[-1].time) if rows else None,
        "recorded_at": _iso(time.time()),
        "recorded_at_commit": _commit(),  # the recording checkout's: the run's own is not in its files
        "removed": removed,
        "left_out": LEFT_OUT,
    }
    (record_dir / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")


def _copy_configs(source: Path, target: Path) -> list[str]:
    """config/*.yaml with the secrets removed; the dotted names of what was removed, file by file."""
    target.mkdir()
    removed: list[str] = []
    for path in sorted(source.glob("*.yaml")):
        text = path.read_text()
        scrubbed, names = scrub(yaml.safe_load(text))
        removed += [f"{path.name}: {name}" for name in names]
        head = [line for line in text.splitlines() if line.startswith("#")][:4]  # `sparkrl up`'s header
        note = "# Recorded by bench/lq_records.py without secrets, removed: " + (", ".join(names) or "none")
        body = yaml.safe_dump(scrubbed, sort_keys=False, allow_unicode=True)
        (target / path.name).write_text("\n".join([*head, note, body]))
    return removed


def scrub(value: Any, at: str = "") -> tuple[Any, list[str]]:
    """`value` (a loaded YAML tree) without secrets: a secret-named key's value set to None, a URL's
    `user:password@` cut; the dotted names of what was removed."""
    if isinstance(value, dict):
        out, removed = {}, []
        for key, item in value.items():
            name = f"{at}.{key}" if at else str(key)
            if str(key) in SECRET_NAMES and item is not None:
                out[key] = None
                removed.append(name)
            else:
                out[key], inner = scrub(item, name)
                removed += inner
        return out, removed
    if isinstance(value, list):
        pairs = [scrub(item, f"{at}[{i}]") for i, item in enumerate(value)]
        return [item for item, _ in pairs], [name for _, names in pairs for name in names]
    if isinstance(value, str) and URL_CREDENTIALS.match(value):
        return URL_CREDENTIALS.sub(r"\1", value), [f"{at} (credentials)"]
    return value, []


def _iso(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, tz=timezone.utc).isoformat(timespec="seconds")


def _commit() -> str | None:
    """HEAD of the checkout this script runs from; None outside a git checkout."""
    done = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, check=False
    )
    commit = done.stdout.strip()
    return commit if done.returncode == 0 and commit else None
