"""The learner's journal write (issue 50, item 2): a step's raw entries written after a small header, as
they came from the bus, against the baseline, the layout before it: every entry packed again into one
msgpack map, then written. Both fsync'd, into the same folder, alternately, best of `--repeats`; the
step is `--groups` groups of a realistic size (1.41 MB: n = 8 × T = 1024 at k = 20, the float32 wire,
so 64 groups are the 93 MB step fleet_scale.py measured).

    .venv/bin/python bench/journal_bench.py [--groups 64] [--repeats 5] [--dir runs/bench-journal]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import msgpack
import numpy as np

from sparkrl.proto import encode_group
from sparkrl.proto.testing import random_group
from sparkrl.services.common.bus import Entry
from sparkrl.services.learner.ledger import Journal


def packed_write(directory: Path, step: int, entries: list[Entry]) -> None:
    """The journal's write before issue 50: the records packed into one msgpack buffer, then written."""
    records = [
        {"entry_id": e.entry_id, "item_id": e.item_id, "payload": e.payload, "deliveries": e.deliveries}
        for e in entries
    ]
    data = msgpack.packb({"step": step, "entries": records}, use_bin_type=True)
    tmp = directory / f".step-{step:06d}.tmp"
    with tmp.open("wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, directory / f"step-{step:06d}.bin")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path("runs/bench-journal"))
    args = parser.parse_args()
    payload = encode_group(random_group(np.random.default_rng(0), n=8, T=1024, k=20, vocab_size=151_936))
    entries = [Entry(f"1-{i}", f"g-{i}", payload, 1) for i in range(args.groups)]
    size = len(payload) * args.groups
    shutil.rmtree(args.dir, ignore_errors=True)
    journal = Journal(args.dir)
    before_dir = args.dir / "before"
    before_dir.mkdir()
    best = {"before: packed again": float("inf"), "after: raw entries": float("inf")}
    for step in range(1, args.repeats + 1):
        for name, write in (
            ("before: packed again", lambda s=step: packed_write(before_dir, s, entries)),
            ("after: raw entries", lambda s=step: journal.write(s, entries)),
        ):
            started = time.perf_counter()
            write()
            best[name] = min(best[name], time.perf_counter() - started)
    assert journal.read(1) == entries
    base = best["before: packed again"]
    print(f"a step of {args.groups} groups, {size / 1e6:.0f} MB, written and fsync'd; best of {args.repeats}")
    for name, seconds in best.items():
        print(
            f"  {name:<22} {seconds * 1000:8.1f} ms  {size / seconds / 1e6:8.0f} MB/s  {base / seconds:5.2f}×"
        )
    print(json.dumps({"bytes": size, "seconds": best}))
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
