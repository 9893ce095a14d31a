"""The families × engines table of docs/models.md, from a run of tests/test_families.py's JUnit XML.

`make test-families` runs the suite with `--junitxml=.cache/families.xml` and prints this table; paste
it into docs/models.md with the commit and date it came from.

    python tests/families_table.py .cache/families.xml
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

CASE = re.compile(r"test_a_family_trains_on_an_engine\[(\w+)-(torch|vllm)\]")
LORA = re.compile(r"test_lora_on_a_tied_family\[(torch|vllm)\]")
REFUSED = re.compile(r"test_a_family_an_engine_cannot_train_is_refused_before_start\[(\w+)-(torch|vllm)\]")


def outcome(case: ET.Element) -> str:
    """passed / failed / error / skipped, and for a pass the largest log-prob difference measured."""
    for kind in ("failure", "error", "skipped"):
        if case.find(kind) is not None:
            return {"failure": "**failed**", "error": "**error**", "skipped": "skipped"}[kind]
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    if "refused" in props:
        return "refused before start, as it must be (see below)"
    seconds = float(case.get("time", "0"))
    diff = props.get("max_logprob_diff")
    return f"passed ({seconds:.0f} s" + (f", max Δlogp {diff})" if diff else ")")


def table(report: Path) -> str:
    cells: dict[tuple[str, str], str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name", "")
        if found := CASE.fullmatch(name):
            cells[found.group(1), found.group(2)] = outcome(case)
        elif found := REFUSED.fullmatch(name):
            cells[found.group(1), found.group(2)] = outcome(case)
        elif found := LORA.fullmatch(name):
            cells["qwen3 + LoRA (adapter sync)", found.group(1)] = outcome(case)
    families = list(dict.fromkeys(key for key, _ in cells))
    lines = ["| family | torch engine | vLLM (CPU build) |", "|---|---|---|"]
    for key in families:
        torch_cell, vllm_cell = (cells.get((key, engine), "not run") for engine in ("torch", "vllm"))
        lines.append(f"| {key} | {torch_cell} | {vllm_cell} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(Path(sys.argv[1] if len(sys.argv) > 1 else ".cache/families.xml")))
