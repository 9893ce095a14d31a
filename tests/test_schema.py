"""The committed JSON Schemas match the models, and every field of every message is documented."""

import json
from pathlib import Path

from sparkrl.proto import schema
from sparkrl.proto.schema import MESSAGES, REGENERATE_COMMAND, SCHEMA_DIR, export_schemas, schema_drift

EXPECTED_FILES = {
    "Prompt.schema.json",
    "Completion.schema.json",
    "TrajectoryGroup.schema.json",
    "PartialGroup.schema.json",
    "RewardRequest.schema.json",
    "RewardResponse.schema.json",
    "EpisodeStart.schema.json",
    "EpisodeStarted.schema.json",
    "EpisodeTurn.schema.json",
    "EpisodeReply.schema.json",
    "EpisodeEnded.schema.json",
    "WeightAnnouncement.schema.json",
    "ControlCommand.schema.json",
    "WorkerStatus.schema.json",
    "LearnerStatus.schema.json",
    "ControlState.schema.json",
    "StepMetrics.schema.json",
    "EvalRecord.schema.json",
    "SyncEvent.schema.json",
    "CommandResult.schema.json",
    "StateEvent.schema.json",
    "RunOwner.schema.json",
}


def test_committed_schemas_match_the_models() -> None:
    drift = schema_drift(SCHEMA_DIR)
    assert not drift, f"proto/schema/ is out of date ({', '.join(drift)}): run `{REGENERATE_COMMAND}`"


def test_export_writes_one_sorted_file_per_message(tmp_path: Path) -> None:
    paths = export_schemas(tmp_path / "out")
    assert {p.name for p in paths} == EXPECTED_FILES
    for path in paths:
        text = path.read_text(encoding="utf-8")
        assert text.endswith("}\n")
        assert text == json.dumps(json.loads(text), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        assert json.loads(text)["title"] == path.name.removesuffix(".schema.json")


def test_drift_is_detected(tmp_path: Path) -> None:
    export_schemas(tmp_path)
    assert schema_drift(tmp_path) == [] and schema.main(["--check", "--out", str(tmp_path)]) == 0
    stale = tmp_path / "WorkerStatus.schema.json"
    stale.write_text(stale.read_text().replace('"tokens_per_s"', '"tokens_per_sec"'))
    (tmp_path / "Old.schema.json").write_text("{}\n")
    (tmp_path / "Prompt.schema.json").unlink()
    assert schema_drift(tmp_path) == ["Prompt.schema.json", "WorkerStatus.schema.json", "Old.schema.json"]
    assert schema.main(["--check", "--out", str(tmp_path)]) == 1


def _undocumented(node: object, where: str) -> list[str]:
    """Paths of properties without a description, anywhere in a schema (including $defs)."""
    missing = []
    if isinstance(node, dict):
        for name, prop in node.get("properties", {}).items():
            if "description" not in prop:
                missing.append(f"{where}.{name}")
        for key, child in node.items():
            missing += _undocumented(child, f"{where}.{key}")
    elif isinstance(node, list):
        for i, child in enumerate(node):
            missing += _undocumented(child, f"{where}[{i}]")
    return missing


def test_every_field_is_documented_and_versioned() -> None:
    for model in MESSAGES:
        generated = model.model_json_schema()
        assert not _undocumented(generated, model.__name__)
        # Completion only travels inside a TrajectoryGroup, which carries the version.
        if model.__name__ != "Completion":
            assert "schema_version" in generated["properties"], model.__name__
