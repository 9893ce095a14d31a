"""Wire encoding: trajectory groups as a msgpack header plus raw tensor buffers; small messages as JSON.

Trajectory group layout (all integers little-endian)::

    offset 0   8 bytes   magic b"SPRKLTG1"
    offset 8   uint32    H, length of the header
    offset 12  H bytes   msgpack map {"schema_version": 1, "prompt_len": P, "lengths": [T_0, …, T_n-1],
                                      "group": <the group without its arrays, as JSON-mode values>,
                                      "wire": {"logprobs": …, "topk_logprobs": …}}
               0-7 zero bytes, so the tensor block starts 8-byte aligned
               tensor block, each field of every completion concatenated in completion order, each
               field starting 8-byte aligned:
                   prompt_token_ids  int32   [P]
                   token_ids         ids     [N]      N = sum of T_i
                   logprobs          floats  [N]
                   policy_versions   int32   [N]
                   topk_ids          ids     [N, K]   K = group["topk"]
                   topk_logprobs     floats  [N, K]

`ids` is uint16 when the group's vocab_size is at most 65,536, else int32; `floats` is what the header's
`wire` names for the field: float32, float16 or bfloat16 (the upper half of a float32, as uint16). The
decoder widens them back to int32 / float32. A header without `wire` (an older writer) means every field
4 bytes wide, packed without padding.

One buffer per field instead of one per array keeps the per-completion overhead to a slice, lets the
decoder check each field of the whole group in one vectorized pass, and makes the decoded arrays
zero-copy, read-only views of the payload (`np.frombuffer`). The payload's size must match the header
exactly, so truncation is caught before any array is built.

Measured with `python bench/codec_bench.py` (one `random_group`, n=8 × T=1024 tokens, best of 30, on
a shared 2-core x86 VM, Python 3.11, numpy 2.4). Throughput is MB/s of raw tensor data (1.41 MB per
group at k=20, 4.29 MB at k=64), so a bigger payload does not look faster:

    format (framing only, no checks)    k=20: B/token  enc MB/s  dec MB/s    k=64: B/token  enc MB/s  dec MB/s
    msgpack header + raw block (this)         176.5     17000     57000            528.5     16000    176000
    msgpack, one bin per array                176.7      6800     12000            528.6      7500     20000
    np.savez, uncompressed                    178.0       900       450            529.9      1500       910
    JSON + base64                             234.2       200       190            703.5       210       190
    this, validated (encode/decode_group)     176.5      3900      5500            528.5      6300     10300

This format's framing is one copy to encode and none to decode (views), so the validated numbers are
the checks' cost: ≈0.36 ms to encode and ≈0.26 ms to decode such a group at k=20. Both check each field
of the whole group in one vectorized pass (encoding did it completion by completion until 2026-12: 2600
and 4900 MB/s then; `bench/publish_bench.py` measures what that means for a worker's small groups).
A group costs 4·(3 + 2K) bytes per generated token on the float32 wire with int32 ids, plus its header
(texts, prompt ids: a few bytes per token); with `rollout.wire`'s default (float16 top-k log-probs) and
uint16 ids, 10 + 4K (k = 20: 90, from 172), or 12 + 6K with int32 ids (V = 151,936: 132). The table
above was measured on the float32 wire before the narrower one (`bench/wire_bench.py` measures that).
"""

import struct
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, get_args

import msgpack
import numpy as np
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticSerializationError

from sparkrl.proto.checks import check_ids, check_token_arrays
from sparkrl.proto.errors import CodecError, FieldError, codec_error_from
from sparkrl.proto.group import TrajectoryGroup
from sparkrl.proto.trajectory import TRAJECTORY_SCHEMA_VERSION, Completion, prechecked_context

M = TypeVar("M", bound=BaseModel)

MAGIC = b"SPRKLTG1"
_PREAMBLE = struct.Struct("<8sI")
_ALIGN = 8
_HEADER_KEYS = frozenset({"schema_version", "prompt_len", "lengths", "group"})
# Per-token fields in tensor-block order, with their wire dtype; topk fields are [N, K], the rest [N].
TOKEN_FIELDS: tuple[tuple[str, str], ...] = (
    ("token_ids", "<i4"),
    ("logprobs", "<f4"),
    ("policy_versions", "<i4"),
    ("topk_ids", "<i4"),
    ("topk_logprobs", "<f4"),
)
_TOPK_FIELDS = frozenset({"topk_ids", "topk_logprobs"})
_OPTIONAL_HEADER_KEYS = frozenset({"wire"})

# How the per-token fields travel (issue 50, item 3): ids in the narrowest type the vocabulary allows
# (uint16 up to 65,536 tokens: lossless), log-probs in float32 or, as `rollout.wire` chooses, rounded to
# float16 or bfloat16. A decoder widens them back to int32 / float32, so everything past it is unchanged.
WireFloat = Literal["float32", "float16", "bfloat16"]
WIRE_FLOATS: tuple[str, ...] = get_args(WireFloat)
_FLOAT16_MIN = float(np.finfo(np.float16).min)  # a finite log-prob below it would round to -inf


@dataclass(frozen=True)
class Wire:
    """The log-prob fields' precision on the wire (`rollout.wire`); ids are always as narrow as lossless."""

    logprobs: WireFloat = "float32"
    topk_logprobs: WireFloat = "float32"


def _ids_dtype(vocab_size: int | None) -> str:
    return "<u2" if vocab_size is not None and vocab_size <= 1 << 16 else "<i4"


def _narrow_float(values: np.ndarray, kind: str) -> np.ndarray:
    """float32 values as `kind` on the wire: float16 (clipped to its finite range), bfloat16 (the upper
    half of each float32, rounded to nearest even, carried as uint16) or float32."""
    values = np.ascontiguousarray(values, dtype="<f4")
    if kind == "float16":
        return np.maximum(values, _FLOAT16_MIN).astype("<f2")
    if kind == "bfloat16":
        bits = values.view("<u4")
        return ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype("<u2")
    return values


def _widen_float(raw: np.ndarray, kind: str) -> np.ndarray:
    if kind == "bfloat16":
        return (raw.astype("<u4") << 16).view("<f4")
    return raw.astype("<f4") if kind == "float16" else raw


def _wire_dtypes(wire: dict[str, str], vocab_size: int | None) -> dict[str, str]:
    """Each per-token field's dtype in the tensor block (bfloat16 travels as uint16)."""
    floats = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}
    ids = _ids_dtype(vocab_size)
    return {
        "token_ids": ids,
        "logprobs": floats[wire["logprobs"]],
        "policy_versions": "<i4",
        "topk_ids": ids,
        "topk_logprobs": floats[wire["topk_logprobs"]],
    }


_ARRAY_EXCLUDE = {
    "prompt_token_ids": True,
    "completions": {"__all__": {name for name, _ in TOKEN_FIELDS}},
}


def header_meta(group: TrajectoryGroup) -> dict[str, Any]:
    """The header's `group` entry: every field but the arrays, as JSON-mode values."""
    try:
        return group.model_dump(mode="json", exclude=_ARRAY_EXCLUDE)
    except PydanticSerializationError as exc:
        raise CodecError("", f"cannot serialize: {exc}") from None


def encode_group(group: TrajectoryGroup, wire: Wire | None = None) -> bytes:
    """The binary form of a group (`wire`: the log-probs' precision, float32 by default). Validates
    exactly what it writes; raises `CodecError` if invalid."""
    meta = header_meta(group)
    arrays = [{name: getattr(c, name) for name, _ in TOKEN_FIELDS} for c in group.completions]
    # Re-validate from the dumped values: arrays and lists can be edited in place after construction,
    # which no validator sees, and a bad group must never reach the bus. As `decode_group` does: the
    # models for the fields and shapes, then the values of each field of every completion in one pass.
    checked = _validate(meta, group.prompt_token_ids, arrays, prechecked=True)
    lengths = [c.num_tokens for c in checked.completions]
    try:
        check_ids(checked.prompt_token_ids, "prompt_token_ids", checked.vocab_size)
        if checked.completions:
            flat = {
                name: np.concatenate([getattr(c, name) for c in checked.completions])
                for name, _ in TOKEN_FIELDS
            }
            check_token_arrays(**flat, vocab_size=checked.vocab_size, lengths=lengths)
    except FieldError as exc:
        raise CodecError(exc.path, exc.reason) from None
    return frame(meta, checked.prompt_token_ids, checked.completions, wire)


def frame(
    meta: dict[str, Any],
    prompt_token_ids: np.ndarray,
    completions: list[Completion],
    wire: Wire | None = None,
) -> bytes:
    """The binary layout around already-validated parts (no checks: `encode_group` is the public way)."""
    chosen = wire or Wire()
    said = {"logprobs": chosen.logprobs, "topk_logprobs": chosen.topk_logprobs}
    vocab = meta.get("vocab_size")
    dtypes = _wire_dtypes(said, vocab if _is_count(vocab) else None)
    header = {
        "schema_version": TRAJECTORY_SCHEMA_VERSION,
        "prompt_len": int(prompt_token_ids.shape[0]),
        "lengths": [c.num_tokens for c in completions],
        "group": meta,
        "wire": said,
    }
    packed = msgpack.packb(header, use_bin_type=True)
    pad = -(_PREAMBLE.size + len(packed)) % _ALIGN
    parts: list[Any] = [_PREAMBLE.pack(MAGIC, len(packed)), packed, b"\0" * pad]
    parts.append(np.ascontiguousarray(prompt_token_ids, dtype="<i4"))
    written = 4 * len(prompt_token_ids)
    for name, _ in TOKEN_FIELDS:
        parts.append(b"\0" * (-written % _ALIGN))  # each field starts aligned: its views need no copy
        written += -written % _ALIGN
        if name in said:
            fields = [_narrow_float(getattr(c, name), said[name]) for c in completions]
        else:
            fields = [np.ascontiguousarray(getattr(c, name), dtype=dtypes[name]) for c in completions]
        parts.extend(fields)
        written += sum(f.nbytes for f in fields)
    return b"".join(parts)  # one copy (and a narrowing's): join reads the arrays' buffers directly


def decode_group(data: bytes | bytearray | memoryview) -> TrajectoryGroup:
    """A group from its binary form, fully validated; raises `CodecError` naming the bad field.

    The returned arrays are read-only views of `data` (writable if `data` is a bytearray).
    """
    if isinstance(data, memoryview) and (data.format != "B" or data.ndim != 1):
        data = data.cast("B")  # lengths and offsets below count bytes
    meta, lengths, prompt_ids, flat = unframe(data)
    arrays, start = [], 0
    for T in lengths:
        arrays.append({name: array[start : start + T] for name, array in flat.items()})
        start += T
    group = _validate(meta, prompt_ids, arrays, prechecked=True)
    try:
        check_ids(prompt_ids, "prompt_token_ids", group.vocab_size)
        check_token_arrays(**flat, vocab_size=group.vocab_size, lengths=lengths)
    except FieldError as exc:
        raise CodecError(exc.path, exc.reason) from None
    return group


def encode_message(message: BaseModel) -> bytes:
    """UTF-8 JSON of a small message (status, control, announcement, prompt, reward), validated first."""
    try:
        payload = message.model_dump_json()
    except PydanticSerializationError as exc:
        raise CodecError("", f"cannot serialize: {exc}") from None
    try:
        type(message).model_validate_json(payload)  # catches fields edited in place after construction
    except ValidationError as exc:
        raise codec_error_from(exc) from None
    return payload.encode("utf-8")


def decode_message(data: bytes | bytearray | memoryview | str, cls: type[M]) -> M:
    """A message of type `cls` from its JSON form; raises `CodecError` naming the bad field."""
    if isinstance(data, bytes | bytearray | memoryview) and bytes(data[: len(MAGIC)]) == MAGIC:
        raise CodecError("", "this is a binary trajectory group: use decode_group")
    try:
        return cls.model_validate_json(bytes(data) if isinstance(data, memoryview) else data)
    except ValidationError as exc:
        raise codec_error_from(exc) from None


def unframe(
    data: bytes | bytearray | memoryview,
) -> tuple[dict[str, Any], list[int], np.ndarray, dict[str, np.ndarray]]:
    """(group meta, lengths, prompt ids, per-token fields concatenated) with the layout checked, values
    not (`decode_group` is the public way)."""
    header, tensor_offset = _read_header(data)
    meta, lengths, prompt_len, topk = _header_fields(header)
    wire = _header_wire(header)
    dtypes = _wire_dtypes(wire, meta.get("vocab_size") if _is_count(meta.get("vocab_size")) else None)
    if "wire" not in header:  # an older writer: every field 4 bytes wide, packed without padding
        dtypes = dict(TOKEN_FIELDS)
    align = _ALIGN if "wire" in header else 1
    prompt_ids, flat = _tensor_views(data, tensor_offset, prompt_len, lengths, topk, dtypes, align)
    for name in ("logprobs", "topk_logprobs"):
        flat[name] = _widen_float(flat[name], wire[name])
    for name in ("token_ids", "topk_ids"):
        if flat[name].dtype != np.dtype("<i4"):
            flat[name] = flat[name].astype("<i4")
    return meta, lengths, prompt_ids, flat


def _validate(
    meta: dict[str, Any], prompt_ids: np.ndarray, arrays: list[dict[str, np.ndarray]], prechecked: bool
) -> TrajectoryGroup:
    completions = meta.get("completions")
    if not isinstance(completions, list) or len(completions) != len(arrays):
        raise CodecError("completions", f"header must list {len(arrays)} completions")
    merged = []
    for i, (fields, tensors) in enumerate(zip(completions, arrays, strict=True)):
        if not isinstance(fields, dict):
            raise CodecError(f"completions[{i}]", "must be a map")
        if fields.keys() & tensors.keys():
            raise CodecError(f"completions[{i}]", "per-token arrays belong in the tensor block")
        merged.append({**fields, **tensors})
    if "prompt_token_ids" in meta:
        raise CodecError("prompt_token_ids", "belongs in the tensor block, not the header")
    obj = {**meta, "prompt_token_ids": prompt_ids, "completions": merged}
    try:
        return TrajectoryGroup.model_validate(obj, context=prechecked_context() if prechecked else None)
    except ValidationError as exc:
        raise codec_error_from(exc) from None


def _read_header(data: bytes | bytearray | memoryview) -> tuple[dict[str, Any], int]:
    """The unpacked header and where the tensor block starts."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CodecError("", f"expected bytes, got {type(data).__name__}")
    if len(data) < _PREAMBLE.size or bytes(data[: len(MAGIC)]) != MAGIC:
        head = bytes(data[: len(MAGIC)])
        hint = " (looks like JSON: use decode_message)" if head.lstrip().startswith(b"{") else ""
        raise CodecError(
            "", f"not a sparkrl trajectory group: starts with {head!r}, expected {MAGIC!r}{hint}"
        )
    _, header_len = _PREAMBLE.unpack_from(data)
    header_end = _PREAMBLE.size + header_len
    if header_end > len(data):
        raise CodecError("", f"truncated: the header needs {header_end} bytes, the payload has {len(data)}")
    try:
        header = msgpack.unpackb(data[_PREAMBLE.size : header_end], raw=False)
    except Exception as exc:  # msgpack raises many types (ExtraData, FormatError, ValueError, TypeError…)
        raise CodecError("header", f"not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise CodecError("header", f"must be a map, got {type(header).__name__}")
    version = header.get("schema_version")
    if type(version) is not int or version != TRAJECTORY_SCHEMA_VERSION:  # not True, not 1.0
        raise CodecError(
            "schema_version",
            f"unsupported schema_version {version!r}; this build reads {TRAJECTORY_SCHEMA_VERSION}",
        )
    if not _HEADER_KEYS <= header.keys() <= _HEADER_KEYS | _OPTIONAL_HEADER_KEYS:
        raise CodecError(
            "header",
            f"keys must be {sorted(_HEADER_KEYS)} (and optionally {sorted(_OPTIONAL_HEADER_KEYS)}), got "
            f"{sorted(map(str, header))}",
        )
    return header, header_end + (-header_end % _ALIGN)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _header_fields(header: dict[str, Any]) -> tuple[dict[str, Any], list[int], int, int]:
    """(group meta, lengths, P, K), with the types the tensor layout depends on checked."""
    meta, lengths, prompt_len = header["group"], header["lengths"], header["prompt_len"]
    if not isinstance(meta, dict):
        raise CodecError("header.group", "must be a map")
    if not isinstance(lengths, list) or not all(_is_count(T) for T in lengths):
        raise CodecError("header.lengths", "must be a list of non-negative integers")
    if not _is_count(prompt_len):
        raise CodecError("header.prompt_len", "must be a non-negative integer")
    topk = meta.get("topk")
    if not _is_count(topk):
        raise CodecError("topk", f"must be a non-negative integer, got {topk!r}")
    return meta, lengths, prompt_len, topk


def _header_wire(header: dict[str, Any]) -> dict[str, str]:
    """The log-prob fields' precision the header names (float32 when it names none: an older writer)."""
    wire = header.get("wire", {"logprobs": "float32", "topk_logprobs": "float32"})
    if not isinstance(wire, dict) or wire.keys() != {"logprobs", "topk_logprobs"}:
        raise CodecError("header.wire", "must map logprobs and topk_logprobs to their precision")
    for name, kind in wire.items():
        if kind not in WIRE_FLOATS:
            raise CodecError(f"header.wire.{name}", f"must be one of {list(WIRE_FLOATS)}, got {kind!r}")
    return wire


def _tensor_views(
    data: bytes | bytearray | memoryview,
    offset: int,
    prompt_len: int,
    lengths: list[int],
    topk: int,
    dtypes: dict[str, str],
    align: int,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Zero-copy views of the tensor block: the prompt ids and each per-token field, concatenated, in
    their wire dtypes, each field starting at a multiple of `align` bytes."""
    N = sum(lengths)
    width = {name: np.dtype(dtype).itemsize for name, dtype in dtypes.items()}
    starts, end = {}, 4 * prompt_len
    for name, _ in TOKEN_FIELDS:
        starts[name] = end + (-end % align)
        end = starts[name] + width[name] * N * (topk if name in _TOPK_FIELDS else 1)
    if len(data) - offset != end:
        raise CodecError(
            "",
            f"tensor block has {len(data) - offset} bytes, the header describes {end} "
            f"(P={prompt_len}, N={N}, K={topk})",
        )
    prompt_ids = np.frombuffer(data, dtype="<i4", count=prompt_len, offset=offset)
    flat = {}
    for name, _ in TOKEN_FIELDS:
        count = N * (topk if name in _TOPK_FIELDS else 1)
        array = np.frombuffer(data, dtype=dtypes[name], count=count, offset=offset + starts[name])
        flat[name] = array.reshape(N, topk) if name in _TOPK_FIELDS else array  # [N, K] or [N]
    return prompt_ids, flat
