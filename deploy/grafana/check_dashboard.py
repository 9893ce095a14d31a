"""Every query of the Grafana dashboard, asked of a live Prometheus: each must return a series.

    python3 deploy/grafana/check_dashboard.py --prometheus http://127.0.0.1:9090 [--since-s 600]

Grafana cannot be installed on every machine, but its panels are only PromQL: this reads each panel's
targets from deploy/grafana/dashboards/sparkrl.json and runs them as range queries (`/api/v1/query_range`,
the last `--since-s` seconds, a point every 2 s) against the Prometheus of the compose profile
`monitoring`. A target passes when it returns at least one series with at least one finite value. Prints
one line per target; exits 1 when any fails. Standard library only (`make compose-smoke` runs it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parent / "dashboards" / "sparkrl.json"


@dataclass(frozen=True)
class Target:
    panel: str
    legend: str
    expr: str


@dataclass(frozen=True)
class Answer:
    target: Target
    series: int  # series returned
    finite: int  # of them, with at least one finite value
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finite > 0


def targets(dashboard: Path = DASHBOARD) -> list[Target]:
    """Every (panel, query) of the dashboard, rows' nested panels included."""
    found: list[Target] = []
    panels = list(json.loads(dashboard.read_text())["panels"])
    while panels:
        panel = panels.pop(0)
        panels.extend(panel.get("panels", []))
        for target in panel.get("targets", []):
            if target.get("expr"):
                found.append(Target(panel["title"], target.get("legendFormat", ""), target["expr"]))
    return found


def ask(prometheus: str, target: Target, start: float, end: float, step_s: float = 2.0) -> Answer:
    query = urllib.parse.urlencode({"query": target.expr, "start": start, "end": end, "step": step_s})
    try:
        with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{query}", timeout=10) as response:
            body = json.load(response)
    except (OSError, ValueError) as exc:
        return Answer(target, 0, 0, f"{type(exc).__name__}: {exc}")
    if body.get("status") != "success":
        return Answer(target, 0, 0, str(body.get("error", body)))
    series = body["data"]["result"]
    finite = sum(any(math.isfinite(float(value)) for _, value in s["values"]) for s in series)
    return Answer(target, len(series), finite)


def check(prometheus: str, since_s: float, until: float | None = None) -> list[Answer]:
    end = until if until is not None else time.time()
    return [ask(prometheus, target, end - since_s, end) for target in targets()]


def report(answers: list[Answer]) -> str:
    lines = []
    for a in answers:
        verdict = "ok " if a.ok else "NO "
        detail = a.error or f"{a.series} series, {a.finite} with values"
        lines.append(f"  {verdict} {a.target.panel} / {a.target.legend or a.target.expr}: {detail}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--since-s", type=float, default=600.0, help="the window queried, ending now")
    args = parser.parse_args(argv)
    answers = check(args.prometheus.rstrip("/"), args.since_s)
    print(report(answers))
    failed = [a for a in answers if not a.ok]
    print(f"{len(answers) - len(failed)} of {len(answers)} dashboard queries returned a series")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
