"""The binary trajectory-group codec: exact round trips, and one rejection test per rule, field named."""

import struct
from collections.abc import Callable

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from pydantic import ValidationError

from sparkrl.proto import (
    MAGIC,
    CodecError,
    Completion,
    LearnerStatus,
    TrajectoryGroup,
    completions_of_rows,
    decode_group,
    decode_message,
    encode_group,
    encode_message,
    group_id_for,
)
from sparkrl.proto.codec import Wire, frame, header_meta
from sparkrl.proto.errors import FieldError
from sparkrl.proto.testing import random_group

ARRAY_FIELDS = ("token_ids", "logprobs", "policy_versions", "topk_ids", "topk_logprobs")
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def small_group(seed: int = 0, n: int = 4, T: int = 20, k: int = 5) -> TrajectoryGroup:
    return random_group(np.random.default_rng(seed), n=n, T=T, k=k, vocab_size=1000, max_new_tokens=T)


def unchecked_payload(group: TrajectoryGroup, edit_meta: Callable[[dict], None] | None = None) -> bytes:
    """The wire bytes of `group` as a buggy or hostile producer could write them: no validation."""
    meta = header_meta(group)
    if edit_meta:
        edit_meta(meta)
    return frame(meta, group.prompt_token_ids, group.completions)


def decode_error(payload: bytes) -> CodecError:
    with pytest.raises(CodecError) as info:
        decode_group(payload)
    return info.value


def assert_bitwise_equal(a: TrajectoryGroup, b: TrajectoryGroup) -> None:
    assert a == b
    pairs = [(a.prompt_token_ids, b.prompt_token_ids)]
    pairs += [
        (getattr(x, f), getattr(y, f))
        for x, y in zip(a.completions, b.completions, strict=True)
        for f in ARRAY_FIELDS
    ]
    for x, y in pairs:  # == treats -0.0 and 0.0 alike; the wire must not
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


# ---- round trips --------------------------------------------------------------------------------

finite = {"allow_nan": False, "allow_infinity": False}
json_values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(**finite), st.text()
)
# Every float32 a log-prob may be: -0.0, subnormals, the accepted rounding above 0, the most negative float32.
logprob = st.floats(
    min_value=float(np.finfo(np.float32).min), max_value=float(np.float32(1e-4)), width=32, **finite
)


@st.composite
def completions(draw: st.DrawFn, T: int, K: int, vocab_size: int) -> Completion:
    topk = draw(hnp.arrays(np.float32, (T, K), elements=logprob))
    return Completion(
        token_ids=draw(hnp.arrays(np.int32, T, elements=st.integers(0, vocab_size - 1))),
        logprobs=draw(hnp.arrays(np.float32, T, elements=logprob)),
        topk_ids=draw(hnp.arrays(np.int32, (T, K), elements=st.integers(0, vocab_size - 1))),
        topk_logprobs=-np.sort(-topk, axis=1),  # [T, K] descending
        policy_versions=draw(hnp.arrays(np.int32, T, elements=st.integers(0, 2**31 - 1))),
        text=draw(st.text(max_size=20)),
        finish_reason=draw(st.sampled_from(["stop", "length", "abort"])),
    )


@st.composite
def groups(draw: st.DrawFn) -> TrajectoryGroup:
    K = draw(st.integers(0, 6))
    vocab_size = draw(st.sampled_from([max(K, 1), 1000, 151936, 2**31 - 1]))
    lengths = draw(st.lists(st.integers(0, 12), min_size=1, max_size=4))
    prompt_id = draw(st.text(min_size=1, max_size=30))
    form = draw(st.sampled_from(["text", "messages"]))
    prompt = {"prompt_id": prompt_id, "task": "math", "answer": draw(st.none() | st.text(max_size=10))}
    prompt[form] = draw(st.text()) if form == "text" else [{"role": "user", "content": draw(st.text())}]
    prompt["task_data"] = draw(st.none() | st.dictionaries(st.text(max_size=5), json_values, max_size=3))
    rewards = draw(st.lists(st.floats(**finite), min_size=len(lengths), max_size=len(lengths)))
    return TrajectoryGroup(
        group_id=group_id_for(prompt_id),
        prompt=prompt,
        prompt_token_ids=draw(
            hnp.arrays(np.int32, draw(st.integers(1, 8)), elements=st.integers(0, vocab_size - 1))
        ),
        completions=[draw(completions(T, K, vocab_size)) for T in lengths],
        rewards=rewards,
        reward_details=[
            {"score": r, "status": "incorrect", "detail": draw(st.text()), "elapsed_s": 0.5} for r in rewards
        ],
        task="math",
        producer=draw(st.text(min_size=1, max_size=10)),
        vocab_size=vocab_size,
        topk=K,
        sampling={
            "temperature": draw(st.floats(0.01, 10)),
            "top_p": draw(st.floats(1e-6, 1.0)),
            "max_new_tokens": max(lengths) + draw(st.integers(0, 3)),
        },
        created_at=draw(st.floats(0, 2e9)),
        scored_at=draw(st.floats(0, 2e9)),
        published_at=draw(st.floats(0, 2e9)),
    )


@FAST
@given(groups())
def test_round_trip_is_exact_and_stable(group: TrajectoryGroup) -> None:
    payload = encode_group(group)
    decoded = decode_group(payload)
    assert_bitwise_equal(decoded, group)
    assert encode_group(decoded) == payload


def test_round_trip_of_a_realistic_group() -> None:
    group = random_group(np.random.default_rng(7), n=8, k=20)
    assert_bitwise_equal(decode_group(encode_group(group)), group)


def test_layout_is_magic_header_then_aligned_tensor_block() -> None:
    group = small_group()
    payload = encode_group(group)
    tensor_bytes = group.prompt_token_ids.nbytes + sum(
        getattr(c, f).nbytes for c in group.completions for f in ARRAY_FIELDS
    )
    assert payload.startswith(MAGIC)
    assert (len(payload) - tensor_bytes) % 8 == 0
    (header_len,) = struct.unpack_from("<I", payload, len(MAGIC))
    header = msgpack.unpackb(payload[12 : 12 + header_len])
    assert header["schema_version"] == 1 and header["lengths"] == [20] * 4


def test_decoded_arrays_are_views_of_the_payload() -> None:
    """Fields that travel 4 bytes wide are views; ids narrowed to uint16 (a vocabulary of ≤ 65,536) are
    widened back into int32 copies."""
    wide = random_group(np.random.default_rng(0), n=4, T=20, k=5, vocab_size=151_936, max_new_tokens=20)
    payload = bytearray(encode_group(wide))
    decoded = decode_group(payload)
    whole = np.frombuffer(payload, dtype=np.uint8)
    assert all(np.shares_memory(whole, getattr(c, f)) for c in decoded.completions for f in ARRAY_FIELDS)
    assert not decode_group(bytes(payload)).completions[0].topk_ids.flags.writeable
    assert decode_group(memoryview(payload)) == decoded
    narrow = decode_group(bytearray(encode_group(small_group())))  # vocabulary 1000: uint16 ids
    assert narrow.completions[0].topk_ids.dtype == np.int32
    assert np.shares_memory(whole, decoded.completions[0].logprobs)


@pytest.mark.parametrize("kind", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("vocab_size", [1000, 65_536, 151_936])
def test_a_narrower_wire_rounds_log_probs_and_keeps_ids_exact(kind: str, vocab_size: int) -> None:
    """Issue 50 item 3: ids in uint16 when the vocabulary allows (lossless), log-probs rounded to the
    chosen precision (to nearest: float16's relative error ≤ 2^-11, bfloat16's ≤ 2^-8), the bytes shrink
    accordingly, and what decodes is float32 / int32 as before."""
    group = random_group(np.random.default_rng(3), n=4, T=50, k=8, vocab_size=vocab_size, max_new_tokens=50)
    wire = Wire(logprobs=kind, topk_logprobs=kind)  # type: ignore[arg-type]
    payload = encode_group(group, wire)
    decoded = decode_group(payload)
    bound = {"float32": 0.0, "float16": 2.0**-11, "bfloat16": 2.0**-8}[kind]
    for got, want in zip(decoded.completions, group.completions, strict=True):
        for f in ("token_ids", "topk_ids", "policy_versions"):
            assert getattr(got, f).dtype == np.int32 and np.array_equal(getattr(got, f), getattr(want, f))
        for f in ("logprobs", "topk_logprobs"):
            values, exact = getattr(got, f), getattr(want, f)
            assert values.dtype == np.float32
            assert np.all(np.abs(values - exact) <= bound * np.abs(exact) + 1e-7), f
    N, K, P = 4 * 50, 8, len(group.prompt_token_ids)
    ids = 2 if vocab_size <= 65_536 else 4
    floats = {"float32": 4, "float16": 2, "bfloat16": 2}[kind]
    block = 4 * P + N * (ids + floats + 4 + K * (ids + floats))
    assert block <= len(payload) - 12 - struct.unpack_from("<I", payload, 8)[0] < block + 8 * 6 + 8
    assert encode_group(decoded, wire) == payload  # a rounded value rounds to itself: stable


def test_a_payload_from_before_the_wire_setting_still_decodes() -> None:
    """An older writer's layout (no `wire` in the header: every field 4 bytes, no padding between fields),
    as a journal of a run started before an upgrade holds it."""
    group = small_group()
    header = {"schema_version": 1, "prompt_len": len(group.prompt_token_ids),
              "lengths": [c.num_tokens for c in group.completions], "group": header_meta(group)}  # fmt: skip
    packed = msgpack.packb(header, use_bin_type=True)
    parts: list[bytes] = [MAGIC, struct.pack("<I", len(packed)), packed, b"\0" * (-(12 + len(packed)) % 8)]
    parts.append(group.prompt_token_ids.astype("<i4").tobytes())
    for f, dtype in (("token_ids", "<i4"), ("logprobs", "<f4"), ("policy_versions", "<i4"),
                     ("topk_ids", "<i4"), ("topk_logprobs", "<f4")):  # fmt: skip
        parts.extend(getattr(c, f).astype(dtype).tobytes() for c in group.completions)
    assert_bitwise_equal(decode_group(b"".join(parts)), group)


# ---- corrupt payloads: always a CodecError, never anything else ---------------------------------

VALID = encode_group(small_group(n=2, T=4, k=3))


@FAST
@given(st.data())
def test_corrupted_payload_raises_only_codec_error(data: st.DataObject) -> None:
    payload = bytearray(VALID)
    kind = data.draw(st.sampled_from(["flip", "truncate", "extend", "random"]))
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            payload[data.draw(st.integers(0, len(payload) - 1))] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        del payload[data.draw(st.integers(0, len(payload) - 1)) :]
    elif kind == "extend":
        payload += data.draw(st.binary(min_size=1, max_size=16))
    else:
        payload = bytearray(data.draw(st.binary(max_size=64)))
    try:
        decoded = decode_group(bytes(payload))
    except CodecError:
        return
    assert isinstance(decoded, TrajectoryGroup)  # a flipped mantissa bit can still be a valid group


# ---- framing rules ------------------------------------------------------------------------------


def test_rejects_wrong_magic_and_json() -> None:
    assert "not a sparkrl trajectory group" in str(decode_error(b"NOTMAGIC" + VALID[8:]))
    assert "use decode_message" in str(decode_error(encode_message(small_group())))
    assert decode_error(b"SPR").path == ""


def test_rejects_a_header_that_is_not_msgpack() -> None:
    error = decode_error(MAGIC + struct.pack("<I", 1) + b"\xc1")  # 0xc1 is never valid msgpack
    assert error.path == "header" and "not valid msgpack" in error.reason
    not_a_map = msgpack.packb([1, 2])
    assert decode_error(MAGIC + struct.pack("<I", len(not_a_map)) + not_a_map).path == "header"


def test_rejects_an_unsupported_schema_version() -> None:
    (header_len,) = struct.unpack_from("<I", VALID, 8)
    header = msgpack.unpackb(VALID[12 : 12 + header_len]) | {"schema_version": 2}
    packed = msgpack.packb(header)
    error = decode_error(MAGIC + struct.pack("<I", len(packed)) + packed)
    assert error.path == "schema_version"
    assert error.reason == "unsupported schema_version 2; this build reads 1"


def test_rejects_truncated_or_padded_tensor_blocks() -> None:
    assert "tensor block has" in decode_error(VALID[:-4]).reason
    assert "tensor block has" in decode_error(VALID + b"\0\0\0\0").reason
    assert "truncated" in decode_error(VALID[:14]).reason


def test_rejects_topk_that_disagrees_with_the_arrays() -> None:
    # K is read from the header; a wrong K makes the [N, K] blocks disagree with the payload's size.
    error = decode_error(unchecked_payload(small_group(), lambda meta: meta.update(topk=6)))
    assert "(P=" in error.reason and "K=6" in error.reason


# ---- value rules, decode side: each names completions[i].<field> and the position ---------------


def payload_with(i: int, field: str, index: tuple[int, ...], value: float) -> bytes:
    group = small_group()
    getattr(group.completions[i], field)[index] = value  # in place: no validator runs
    return unchecked_payload(group)


BAD_VALUES = [
    (1, "token_ids", (3,), 1000, "token id 1000 at position 3 is not below vocab_size=1000"),
    (0, "token_ids", (0,), -7, "negative token id -7 at position 0"),
    (2, "topk_ids", (5, 1), 5000, "token id 5000 at position 5, rank 1 is not below vocab_size=1000"),
    (0, "logprobs", (9,), 0.001, "log-prob 0.001 at position 9 is positive (more than 0.0001 above 0)"),
    (3, "logprobs", (2,), np.nan, "log-prob nan at position 2 is not finite"),
    (1, "topk_logprobs", (4, 0), np.inf, "log-prob inf at position 4, rank 0 is not finite"),
    (2, "topk_logprobs", (6, 4), -np.inf, "log-prob -inf at position 6, rank 4 is not finite"),
    (3, "topk_logprobs", (17, 4), 0.0, "not sorted descending at position 17: rank 3 is"),
    (1, "policy_versions", (11,), -1, "negative policy version -1 at position 11"),
]


def test_decode_rejects_a_negative_id_of_a_wide_vocabulary() -> None:
    group = random_group(np.random.default_rng(0), n=2, T=8, k=3, vocab_size=151_936, max_new_tokens=8)
    group.completions[1].topk_ids[2, 1] = -7  # int32 on the wire
    error = decode_error(unchecked_payload(group))
    assert error.path == "completions[1].topk_ids" and "negative token id -7 at position 2" in error.reason


@pytest.mark.parametrize(("i", "field", "index", "value", "message"), BAD_VALUES)
def test_decode_rejects_bad_values(
    i: int, field: str, index: tuple[int, ...], value: float, message: str
) -> None:
    error = decode_error(payload_with(i, field, index, value))
    if field.endswith("ids") and value < 0:  # uint16 on the wire (1000 tokens): it arrives as value + 2^16
        message = f"token id {int(value) + (1 << 16)} at position 0 is not below vocab_size=1000"
    assert error.path == f"completions[{i}].{field}"
    assert message in error.reason
    assert str(error).startswith(f"completions[{i}].{field}: ")


def test_decode_accepts_rounding_above_zero() -> None:
    decoded = decode_group(payload_with(0, "logprobs", (0,), 5e-5))
    assert decoded.completions[0].logprobs[0] == np.float32(5e-5)


def test_decode_rejects_prompt_ids_outside_the_vocabulary() -> None:
    group = small_group()
    group.prompt_token_ids[-1] = 1000
    assert decode_error(unchecked_payload(group)).path == "prompt_token_ids"


@pytest.mark.parametrize(
    ("edit", "path", "message"),
    [
        (lambda m: m["completions"][1].update(finish_reason="eos"), "completions[1].finish_reason", "'stop'"),
        (lambda m: m["rewards"].pop(), "rewards", "has 3 entries for 4 completions"),
        (lambda m: m.update(vocab_size="big"), "vocab_size", "valid integer"),
        (lambda m: m.update(group_id="g-other"), "group_id", "group_id_for"),
        (lambda m: m["completions"][0].update(token_ids=[1]), "completions[0]", "belong in the tensor block"),
        (lambda m: m["completions"].pop(), "completions", "header must list 4 completions"),
        (lambda m: m.update(topk=-1), "topk", "non-negative integer"),
        (lambda m: m.update(surprise=1), "surprise", "Extra inputs are not permitted"),
    ],
)
def test_decode_rejects_bad_header_fields(edit: Callable[[dict], object], path: str, message: str) -> None:
    error = decode_error(unchecked_payload(small_group(), edit))
    assert error.path == path and message in error.reason


# ---- encode side: never writes a bad group ------------------------------------------------------


def encode_error(group: TrajectoryGroup) -> CodecError:
    with pytest.raises(CodecError) as info:
        encode_group(group)
    return info.value


@pytest.mark.parametrize(("i", "field", "index", "value", "message"), BAD_VALUES)
def test_encode_rejects_the_bad_values_decode_rejects(
    i: int, field: str, index: tuple[int, ...], value: float, message: str
) -> None:
    group = small_group()
    getattr(group.completions[i], field)[index] = value  # in place: no validator runs
    error = encode_error(group)
    assert error.path == f"completions[{i}].{field}" and message in error.reason


def test_encode_revalidates_in_place_edits() -> None:
    group = small_group()
    group.completions[2].topk_logprobs[17, 2] = 0.5
    error = encode_error(group)
    assert error.path == "completions[2].topk_logprobs" and "position 17, rank 2 is positive" in error.reason
    group = small_group()
    group.rewards.append(1.0)
    assert encode_error(group).path == "rewards"


def test_encode_rejects_shapes_that_bypassed_validation() -> None:
    group = small_group()
    good = group.completions[1]
    short = Completion.model_construct(**(dict(good) | {"logprobs": good.logprobs[:-1]}))
    group.completions[1] = short
    error = encode_error(group)
    assert error.path == "completions[1].logprobs" and "has 19 entries, token_ids has T=20" in error.reason
    group = small_group()
    wide = Completion.model_construct(**(dict(good) | {"topk_ids": np.zeros((20, 6), np.int32)}))
    group.completions[0] = wide
    assert encode_error(group).path == "completions[0].topk_logprobs"


def test_empty_completions_and_no_topk_round_trip() -> None:
    group = small_group(T=0, k=0)
    assert group.num_tokens == 0 and group.oldest_policy_version is None
    assert_bitwise_equal(decode_group(encode_group(group)), group)


def test_messages_reject_group_payloads_and_garbage() -> None:
    with pytest.raises(CodecError, match="use decode_group"):
        decode_message(VALID, LearnerStatus)
    with pytest.raises(CodecError, match="Invalid JSON"):
        decode_message(b"{", LearnerStatus)


# ── a worker's group, built from completions its engine just made ────────────────────────────────────


def _fields(group: TrajectoryGroup) -> dict:
    return {name: getattr(group, name) for name in type(group).model_fields}


def test_a_worker_built_group_skips_the_completions_value_scan_that_encoding_then_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sparkrl.proto.trajectory as trajectory

    group = random_group(np.random.default_rng(3), n=4, T=5, k=4, vocab_size=260, max_new_tokens=8)
    scans: list[int] = []
    real = trajectory.check_token_arrays
    monkeypatch.setattr(trajectory, "check_token_arrays", lambda *a, **k: (scans.append(1), real(*a, **k)))
    built = TrajectoryGroup.of_made_completions(**_fields(group))
    assert built == group and scans == []  # pydantic re-ran each completion's validator: shapes only
    TrajectoryGroup(**_fields(group))
    assert len(scans) == 4  # the plain constructor scans every completion again

    # What the skipped scan would have caught, encoding catches: nothing bad reaches the bus.
    built.completions[1].token_ids[2] = 260  # past vocab_size, edited in place after construction
    with pytest.raises(CodecError, match=r"token_ids"):
        encode_group(built)


def test_a_worker_built_group_still_checks_shapes_and_the_groups_own_fields() -> None:
    group = random_group(np.random.default_rng(4), n=2, T=3, k=4, vocab_size=260, max_new_tokens=8)
    with pytest.raises(ValidationError, match=r"topk"):
        TrajectoryGroup.of_made_completions(**(_fields(group) | {"topk": 5}))
    with pytest.raises(ValidationError, match=r"rewards"):
        TrajectoryGroup.of_made_completions(**(_fields(group) | {"rewards": [1.0]}))


# ── an engine's batch as completions, checked in one pass ────────────────────────────────────────────


def _batch(B: int = 4, S: int = 6, K: int = 3) -> tuple[dict[str, np.ndarray], list[int]]:
    rng = np.random.default_rng(5)
    topk_logprobs = -np.sort(rng.random((B, S, K)), axis=-1).astype(np.float32)
    arrays = {
        "token_ids": rng.integers(0, 50, (B, S)),  # int64, as torch hands them over
        "logprobs": topk_logprobs[:, :, 0].copy(),
        "topk_ids": rng.integers(0, 50, (B, S, K)),
        "topk_logprobs": topk_logprobs,
        "policy_versions": np.full((B, S), 3, dtype=np.int32),
    }
    return arrays, [6, 0, 2, 4]


def test_completions_of_rows_are_each_rows_valid_part() -> None:
    arrays, lengths = _batch()
    made = completions_of_rows(**arrays, lengths=lengths, texts=list("abcd"), finish_reasons=["stop"] * 4)
    for row, (completion, length) in enumerate(zip(made, lengths, strict=True)):
        alone = Completion(
            **{name: a[row, :length].astype(completion_dtype(name)) for name, a in arrays.items()},
            text="abcd"[row],
            finish_reason="stop",
        )
        assert completion == alone and completion.num_tokens == length


def completion_dtype(name: str) -> type:
    return np.float32 if "logprobs" in name else np.int32


def test_completions_of_rows_name_the_row_of_a_bad_value_and_ignore_padding() -> None:
    arrays, lengths = _batch()
    arrays["logprobs"][1, 3] = 0.5  # row 1 holds no token: padding, never read
    arrays["topk_logprobs"][3, 5, 0] = np.nan  # row 3 holds 4 tokens: padding too
    completions_of_rows(**arrays, lengths=lengths, texts=list("abcd"), finish_reasons=["stop"] * 4)
    arrays["logprobs"][2, 1] = 0.5  # row 2's second token
    with pytest.raises(FieldError) as info:
        completions_of_rows(**arrays, lengths=lengths, texts=list("abcd"), finish_reasons=["stop"] * 4)
    assert info.value.path == "completions[2].logprobs" and "position 1 is positive" in info.value.reason
