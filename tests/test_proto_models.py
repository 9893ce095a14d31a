"""The wire models: what they accept, what they reject (with the field named), and JSON round trips."""

import base64

import numpy as np
import pytest
from pydantic import BaseModel, ValidationError

from sparkrl.proto import (
    CheckpointCommand,
    CodecError,
    Completion,
    ControlCommand,
    LearnerStatus,
    PauseCommand,
    Prompt,
    ResumeCommand,
    RewardRequest,
    RewardResponse,
    SetHparamsCommand,
    StopCommand,
    TensorSpec,
    TrajectoryGroup,
    WeightAnnouncement,
    WorkerStatus,
    decode_message,
    encode_message,
    group_id_for,
    weights_checksum,
)
from sparkrl.proto.errors import validation_problems
from sparkrl.proto.testing import random_group


def problems(model: type[BaseModel], data: dict) -> list[tuple[str, str]]:
    with pytest.raises(ValidationError) as info:
        model.model_validate(data)
    return validation_problems(info.value)


def small_group(seed: int = 0, n: int = 4, T: int = 20, k: int = 5) -> TrajectoryGroup:
    return random_group(np.random.default_rng(seed), n=n, T=T, k=k, vocab_size=1000, max_new_tokens=T)


def completion_dict(T: int = 3, K: int = 2) -> dict:
    return {
        "token_ids": np.arange(T, dtype=np.int32),
        "logprobs": np.full(T, -0.5, dtype=np.float32),
        "topk_ids": np.arange(T * K, dtype=np.int32).reshape(T, K),
        "topk_logprobs": np.tile(-np.arange(1, K + 1, dtype=np.float32), (T, 1)),
        "policy_versions": np.zeros(T, dtype=np.int32),
        "text": "abc",
        "finish_reason": "stop",
    }


# ---- Prompt -------------------------------------------------------------------------------------


def test_prompt_needs_exactly_one_of_text_and_messages() -> None:
    assert Prompt(prompt_id="p", task="math", text="1+1=").messages is None
    chat = Prompt(prompt_id="p", task="math", messages=[{"role": "user", "content": "1+1?"}])
    assert chat.messages[0].role == "user"
    assert problems(Prompt, {"prompt_id": "p", "task": "math"})[0][0] == "text"
    both = {"prompt_id": "p", "task": "math", "text": "x", "messages": [{"role": "user", "content": "x"}]}
    assert problems(Prompt, both)[0] == ("text", "exactly one of `text` and `messages` must be set")


def test_prompt_rejects_unknown_keys_and_roles() -> None:
    assert problems(Prompt, {"prompt_id": "p", "task": "m", "text": "x", "prompt": "x"})[0][0] == "prompt"
    bad_role = {"prompt_id": "p", "task": "m", "messages": [{"role": "robot", "content": "x"}]}
    assert problems(Prompt, bad_role)[0][0] == "messages[0].role"


# ---- Completion ---------------------------------------------------------------------------------


def test_completion_accepts_t_zero_and_casts_lists() -> None:
    empty = Completion.model_validate(completion_dict(T=0))
    assert empty.num_tokens == 0 and empty.topk_ids.shape == (0, 2)
    data = completion_dict() | {"token_ids": [1, 2, 3], "policy_versions": np.array([0, 0, 1])}
    completion = Completion.model_validate(data)
    assert completion.token_ids.dtype == np.int32 and completion.policy_versions.dtype == np.int32


def test_completion_keeps_arrays_of_the_right_dtype_without_copying() -> None:
    data = completion_dict()
    assert Completion.model_validate(data).topk_logprobs is data["topk_logprobs"]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("token_ids", np.array([0.0, 1.0, 2.0]), "expected dtype int32, got float64"),
        ("token_ids", np.array([0, 1, 2**40]), "outside the int32 range"),
        ("token_ids", np.zeros((3, 1), dtype=np.int32), "expected a 1-D array"),
        ("topk_logprobs", np.zeros(3, dtype=np.float32), "expected a 2-D array"),
        ("logprobs", "nope", "got str"),
        ("topk_ids", [[1, 2], [3]], "not a rectangular"),
    ],
)
def test_completion_array_type_errors_name_the_field(field: str, value: object, message: str) -> None:
    [(path, reason)] = problems(Completion, completion_dict() | {field: value})
    assert path == field and message in reason


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("logprobs", np.zeros(2, dtype=np.float32), "has 2 entries, token_ids has T=3"),
        ("policy_versions", np.zeros(4, dtype=np.int32), "has 4 entries"),
        ("topk_ids", np.zeros((2, 2), dtype=np.int32), "has 2 rows"),
        ("topk_logprobs", np.zeros((3, 3), dtype=np.float32), "differs from topk_ids"),
    ],
)
def test_completion_shape_errors_name_the_field(field: str, value: np.ndarray, message: str) -> None:
    [(path, reason)] = problems(Completion, completion_dict() | {field: value})
    assert path == field and message in reason


def test_completion_value_errors_name_field_and_position() -> None:
    def with_value(field: str, index: tuple[int, ...], value: float) -> dict:
        data = completion_dict(T=4, K=3)
        data[field] = data[field].copy()
        data[field][index] = value
        return data

    cases = [
        (with_value("token_ids", (2,), -1), "token_ids", "negative token id -1 at position 2"),
        (with_value("logprobs", (1,), 0.01), "logprobs", "log-prob 0.01 at position 1 is positive"),
        (with_value("logprobs", (3,), np.nan), "logprobs", "log-prob nan at position 3 is not finite"),
        (
            with_value("topk_logprobs", (0, 2), -np.inf),
            "topk_logprobs",
            "at position 0, rank 2 is not finite",
        ),
        (with_value("topk_logprobs", (2, 2), -0.5), "topk_logprobs", "not sorted descending at position 2"),
        (
            with_value("policy_versions", (3,), -2),
            "policy_versions",
            "negative policy version -2 at position 3",
        ),
        (with_value("topk_ids", (1, 0), -5), "topk_ids", "negative token id -5 at position 1, rank 0"),
    ]
    for data, field, message in cases:
        [(path, reason)] = problems(Completion, data)
        assert path == field and message in reason, (path, reason)


def test_completion_accepts_rounding_above_zero_and_ties() -> None:
    data = completion_dict(T=2, K=3)
    data["logprobs"] = np.array([5e-5, 0.0], dtype=np.float32)
    data["topk_logprobs"] = np.array([[5e-5, 5e-5, -1.0], [-1.0, -1.0, -1.0]], dtype=np.float32)
    Completion.model_validate(data)


def test_completion_json_array_form() -> None:
    completion = Completion.model_validate(completion_dict())
    dumped = completion.model_dump(mode="json")["topk_ids"]
    assert dumped["dtype"] == "int32" and dumped["shape"] == [3, 2]
    assert base64.b64decode(dumped["data"]) == completion.topk_ids.astype("<i4").tobytes()
    for bad, message in [
        ({**dumped, "data": "!!"}, "not valid base64"),
        ({**dumped, "shape": [3, 3]}, "needs 36"),
        ({**dumped, "dtype": "int64"}, "expected dtype int32"),
        ({**dumped, "extra": 1}, "exactly the keys"),
    ]:
        [(path, reason)] = problems(Completion, completion.model_dump(mode="json") | {"topk_ids": bad})
        assert path == "topk_ids" and message in reason


def test_models_with_arrays_compare_by_value() -> None:
    a, b = Completion.model_validate(completion_dict()), Completion.model_validate(completion_dict())
    assert a == b
    b.token_ids = np.array([0, 1, 9], dtype=np.int32)
    assert a != b


# ---- TrajectoryGroup ----------------------------------------------------------------------------


def test_group_invariants_name_the_field() -> None:
    base = small_group().model_dump()
    detail = base["reward_details"][0]
    cases = [
        ({"rewards": base["rewards"][:-1]}, "rewards", "has 3 entries for 4 completions"),
        ({"reward_details": [*base["reward_details"], detail]}, "reward_details", "has 5 entries"),
        ({"task": "math"}, "task", "differs from prompt.task"),
        ({"group_id": "g-random"}, "group_id", "group_id_for(prompt.prompt_id)"),
        ({"prompt_token_ids": np.zeros(0, dtype=np.int32)}, "prompt_token_ids", "is empty"),
        (
            {"prompt_token_ids": np.array([5, 1000], dtype=np.int32)},
            "prompt_token_ids",
            "not below vocab_size",
        ),
        ({"topk": 6}, "completions[0].topk_ids", "has K=5 columns, the group's topk is 6"),
        ({"sampling": base["sampling"] | {"max_new_tokens": 19}}, "completions[0].token_ids", "T=20 exceeds"),
        ({"rewards": [1.0, float("nan"), 0.0, 0.0]}, "rewards[1]", "finite"),
        ({"completions": []}, "completions", "at least 1"),
    ]
    for change, field, message in cases:
        found = problems(TrajectoryGroup, base | change)
        assert found[0][0] == field and message in found[0][1], found


def test_group_checks_ids_against_vocab_size() -> None:
    data = small_group().model_dump()
    data["completions"][2]["topk_ids"] = data["completions"][2]["topk_ids"].copy()
    data["completions"][2]["topk_ids"][7, 4] = 1000
    [(path, reason)] = problems(TrajectoryGroup, data)
    assert path == "completions[2].topk_ids"
    assert reason == "token id 1000 at position 7, rank 4 is not below vocab_size=1000"


def test_group_id_is_deterministic_and_summaries() -> None:
    assert group_id_for("gsm8k/1@0") == group_id_for("gsm8k/1@0") != group_id_for("gsm8k/1@1")
    group = small_group()
    assert group.num_tokens == 4 * 20
    assert group.oldest_policy_version == min(int(c.policy_versions.min()) for c in group.completions)


# ---- Weights, control, status -------------------------------------------------------------------


def announcement(**change: object) -> dict:
    manifest = [
        {"name": "a", "dtype": "bfloat16", "shape": [4, 8], "numel": 32, "bucket": 0, "offset": 0},
        {"name": "b", "dtype": "float32", "shape": [8], "numel": 8, "bucket": 0, "offset": 64},
        {"name": "c", "dtype": "float32", "shape": [64], "numel": 64, "bucket": 1, "offset": 0},
    ]
    data = {
        "incarnation": 1_764_000_000_000_000_000,
        "sequence": 7,
        "version": 3,
        "manifest": manifest,
        "total_bytes": 64 + 32 + 256,
        "bucket_bytes": 128,
        "num_buckets": 2,
        "checksum": weights_checksum([b"\0" * 64, b"\0" * 32, b"\0" * 256]),
        "group_epoch": 1,
        "rendezvous_host": "learner",
        "rendezvous_port": 29500,
        "world_size": 3,
        "members": ["worker-a", "worker-b"],
        "backend": "gloo",
        "created_at": 1.7e9,
    }
    return data | change


def test_weight_announcement_layout_rules() -> None:
    valid = WeightAnnouncement.model_validate(announcement())
    assert valid.bucket_sizes() == [96, 256]  # bucket 1 holds one oversized tensor alone: allowed
    manifest = announcement()["manifest"]
    cases = [
        ({"total_bytes": 1}, "total_bytes", "sum of tensor sizes"),
        ({"num_buckets": 3}, "num_buckets", "bucket 2 carries no tensor"),
        ({"manifest": [*manifest[:2], manifest[2] | {"bucket": 5}]}, "manifest[2].bucket", "not below"),
        (
            {"manifest": [manifest[0], manifest[1] | {"offset": 60}, manifest[2]]},
            "manifest[1].offset",
            "overlaps",
        ),
        (
            {"manifest": [*manifest[:2], manifest[2] | {"name": "a"}]},
            "manifest",
            "'a' appears more than once",
        ),
        ({"bucket_bytes": 90}, "bucket_bytes", "bucket 0 holds 2 tensors and ends at byte 96"),
        ({"manifest": [manifest[0] | {"numel": 31}, *manifest[1:]]}, "manifest[0].numel", "product of shape"),
        ({"checksum": "abc"}, "checksum", "pattern"),
        ({"backend": "mpi"}, "backend", "'gloo', 'nccl', 'nccl4py' or 'vllm_nccl'"),
    ]
    for change, field, message in cases:
        found = problems(WeightAnnouncement, announcement(**change))
        assert found[0][0] == field and message in found[0][1], found


def test_tensor_spec_nbytes() -> None:
    spec = TensorSpec(name="w", dtype="bfloat16", shape=[3, 5], numel=15, bucket=0, offset=0)
    assert spec.nbytes == 30


def test_control_union_discriminates_on_command() -> None:
    expected = {
        "pause": PauseCommand,
        "resume": ResumeCommand,
        "stop": StopCommand,
        "checkpoint": CheckpointCommand,
        "set_hparams": SetHparamsCommand,
    }
    for name, cls in expected.items():
        body = {"command": name} | ({"values": {"lr": 1e-6}} if name == "set_hparams" else {})
        command = ControlCommand.model_validate({"command_id": "c1", "issued_at": 1.0, "body": body})
        assert type(command.body) is cls
    [(path, reason)] = problems(
        ControlCommand, {"command_id": "c", "issued_at": 1, "body": {"command": "boom"}}
    )
    assert path == "body" and "'pause', 'resume', 'stop', 'checkpoint', 'set_hparams'" in reason
    extra = {"command_id": "c", "issued_at": 1, "body": {"command": "resume", "tag": "x"}}
    assert problems(ControlCommand, extra)[0][0] == "body.resume.tag"


def test_set_hparams_keeps_value_types_through_json() -> None:
    values = {"lr": 2e-6, "use_tis": True, "micro_batch": 4, "loss": "lp_reg"}
    command = ControlCommand(
        command_id="c", issued_at=1.0, body=SetHparamsCommand(command="set_hparams", values=values)
    )
    decoded = decode_message(encode_message(command), ControlCommand)
    assert decoded.body.values == values
    assert [type(v) for v in decoded.body.values.values()] == [float, bool, int, str]
    for bad in ({}, {"lr": float("inf")}, {"": 1}):
        body = {"command": "set_hparams", "values": bad}
        assert problems(ControlCommand, {"command_id": "c", "issued_at": 1, "body": body})


def test_status_bounds() -> None:
    worker = {
        "worker_id": "w0",
        "engine": "torch",
        "state": "generating",
        "tokens_per_s": 10.0,
        "groups_published": 1,
        "prompts_in_flight": 2,
        "heartbeat_at": 1.7e9,
    }
    assert WorkerStatus.model_validate(worker).policy_version is None
    assert problems(WorkerStatus, worker | {"state": "sleeping"})[0][0] == "state"
    assert problems(WorkerStatus, worker | {"prompts_in_flight": -1})[0][0] == "prompts_in_flight"
    learner = {"step": 0, "policy_version": 0, "state": "training", "groups_trained": 0, "group_epoch": 0}
    learner |= {"heartbeat_at": 1.0}
    assert problems(LearnerStatus, learner | {"last_loss": float("nan")})[0][0] == "last_loss"


# ---- Round trips and versions -------------------------------------------------------------------


def every_message() -> list[BaseModel]:
    group = small_group()
    return [
        group.prompt,
        Prompt(prompt_id="p", task="math", messages=[{"role": "system", "content": "be brief"}], answer="2"),
        group.completions[0],
        Completion.model_validate(completion_dict(T=0)),
        group,
        RewardRequest(items=[{"task": "math", "completion": "2", "answer": "2"}], timeout_s=5),
        RewardResponse(results=group.reward_details),
        WeightAnnouncement.model_validate(announcement(snapshot_path="/runs/x/snapshot")),
        ControlCommand(
            command_id="c", issued_at=2.0, body=PauseCommand(command="pause", reason="maintenance")
        ),
        ControlCommand(
            command_id="d", issued_at=2.0, body=CheckpointCommand(command="checkpoint", tag="s-10")
        ),
        WorkerStatus(
            worker_id="w0",
            engine="vllm",
            state="syncing",
            policy_version=4,
            weights_checksum="ab" * 32,
            tokens_per_s=1234.5,
            groups_published=10,
            prompts_in_flight=3,
            queue_lag=7,
            last_sync_seconds=0.8,
            heartbeat_at=1.7e9,
        ),
        LearnerStatus(
            step=5,
            policy_version=5,
            state="training",
            groups_trained=80,
            last_loss=-0.25,
            last_sync_seconds=1.5,
            group_epoch=2,
            members=["w0", "w1"],
            heartbeat_at=1.7e9,
        ),
    ]


@pytest.mark.parametrize("message", every_message(), ids=lambda m: type(m).__name__)
def test_json_round_trip(message: BaseModel) -> None:
    assert type(message).model_validate_json(message.model_dump_json()) == message
    assert decode_message(encode_message(message), type(message)) == message


def test_unsupported_schema_version_is_named() -> None:
    with pytest.raises(CodecError) as info:
        decode_message(b'{"schema_version": 2, "command_id": "c", "issued_at": 1}', ControlCommand)
    assert info.value.path == "schema_version"
    assert info.value.reason.startswith("unsupported schema_version 2; this build reads 1")


def test_encode_message_refuses_a_message_edited_in_place() -> None:
    status = LearnerStatus(
        step=1, policy_version=1, state="training", groups_trained=0, group_epoch=0, heartbeat_at=1
    )
    status.__dict__["step"] = -1  # what an in-place edit does: no validator sees it
    with pytest.raises(CodecError) as info:
        encode_message(status)
    assert info.value.path == "step"
