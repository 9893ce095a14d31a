"""JSON Schema of every top-level message, for workers written in other languages.

`python -m sparkrl.proto.schema` rewrites `proto/schema/*.schema.json` from the models;
`python -m sparkrl.proto.schema --check` exits 1 when the files on disk differ (tests run the same check).
The schemas describe the JSON form; a `TrajectoryGroup` on the bus is binary (`codec.py`), and its
JSON form, with arrays as `{"dtype", "shape", "data": base64}` objects, is what the schema describes.
"""

import argparse
import json
import sys
from pathlib import Path

from pydantic import BaseModel

from sparkrl.proto.control import ControlCommand, ControlState
from sparkrl.proto.environment import EpisodeEnded, EpisodeReply, EpisodeStart, EpisodeStarted, EpisodeTurn
from sparkrl.proto.group import TrajectoryGroup
from sparkrl.proto.partial import PartialGroup
from sparkrl.proto.reward import RewardRequest, RewardResponse
from sparkrl.proto.run_files import RunOwner
from sparkrl.proto.status import LearnerStatus, WorkerStatus
from sparkrl.proto.telemetry import CommandResult, EvalRecord, StateEvent, StepMetrics, SyncEvent
from sparkrl.proto.trajectory import Completion, Prompt
from sparkrl.proto.weights import WeightAnnouncement

SCHEMA_DIR = Path(__file__).parent / "schema"
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
REGENERATE_COMMAND = "python -m sparkrl.proto.schema"

MESSAGES: tuple[type[BaseModel], ...] = (
    Prompt,
    Completion,
    TrajectoryGroup,
    PartialGroup,
    RewardRequest,
    RewardResponse,
    EpisodeStart,
    EpisodeStarted,
    EpisodeTurn,
    EpisodeReply,
    EpisodeEnded,
    WeightAnnouncement,
    ControlCommand,
    ControlState,
    WorkerStatus,
    LearnerStatus,
    StepMetrics,
    EvalRecord,
    SyncEvent,
    CommandResult,
    StateEvent,
    RunOwner,
)


def render_schema(model: type[BaseModel]) -> str:
    """The schema file's exact text: what a producer must send (validation mode), sorted keys."""
    schema = {"$schema": JSON_SCHEMA_DIALECT, **model.model_json_schema(mode="validation")}
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def schema_filename(model: type[BaseModel]) -> str:
    return f"{model.__name__}.schema.json"


def export_schemas(out_dir: Path | str = SCHEMA_DIR) -> list[Path]:
    """Write one `<Model>.schema.json` per message into `out_dir` (created if missing); returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for model in MESSAGES:
        path = out / schema_filename(model)
        path.write_text(render_schema(model), encoding="utf-8")
        paths.append(path)
    return paths


def schema_drift(out_dir: Path | str = SCHEMA_DIR) -> list[str]:
    """Names of schema files in `out_dir` that are missing, stale, or belong to no message."""
    out = Path(out_dir)
    expected = {schema_filename(model): render_schema(model) for model in MESSAGES}
    drift = [
        name
        for name, text in expected.items()
        if not (out / name).is_file() or (out / name).read_text(encoding="utf-8") != text
    ]
    extra = sorted(p.name for p in out.glob("*.schema.json") if p.name not in expected)
    return sorted(drift) + extra


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Export the wire messages' JSON Schemas.")
    parser.add_argument("--out", type=Path, default=SCHEMA_DIR, help="Directory to write (or check).")
    parser.add_argument("--check", action="store_true", help="Only compare; exit 1 on any difference.")
    args = parser.parse_args(argv)
    if args.check:
        drift = schema_drift(args.out)
        if drift:
            print(f"schemas out of date: {', '.join(drift)}; run `{REGENERATE_COMMAND}`", file=sys.stderr)
            return 1
        return 0
    for path in export_schemas(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
