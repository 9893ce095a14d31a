"""Codec benchmark: `python bench/codec_bench.py` prints the numbers quoted in `codec.py`.

For each K it builds one `random_group` (n completions × T tokens) and times, best of `--repeats`:
the four framings alone (no validation), then `encode_group` / `decode_group` with their full checks.
Throughput is MB/s of raw tensor data (the numpy arrays' bytes), the same denominator for every format,
so a format with a bigger payload does not look faster; bytes/token is each payload's own size.
"""

import argparse
import base64
import io
import json
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from sparkrl.proto.codec import TOKEN_FIELDS, decode_group, encode_group, frame, header_meta, unframe
from sparkrl.proto.group import TrajectoryGroup
from sparkrl.proto.testing import random_group

Codec = tuple[Callable[[TrajectoryGroup], bytes], Callable[[bytes], Any]]


def _arrays(group: TrajectoryGroup) -> dict[str, np.ndarray]:
    out = {"prompt_token_ids": group.prompt_token_ids}
    for i, c in enumerate(group.completions):
        out.update({f"{i}.{name}": getattr(c, name) for name, _ in TOKEN_FIELDS})
    return out


def _raw_frame(group: TrajectoryGroup) -> bytes:
    return frame(header_meta(group), group.prompt_token_ids, group.completions)


def _msgpack_encode(group: TrajectoryGroup) -> bytes:
    arrays = {key: [a.dtype.str, list(a.shape), a.tobytes()] for key, a in _arrays(group).items()}
    return msgpack.packb({"group": header_meta(group), "arrays": arrays}, use_bin_type=True)


def _msgpack_decode(data: bytes) -> dict[str, np.ndarray]:
    obj = msgpack.unpackb(data, raw=False)
    return {
        key: np.frombuffer(raw, dtype=dt).reshape(shape) for key, (dt, shape, raw) in obj["arrays"].items()
    }


def _savez_encode(group: TrajectoryGroup) -> bytes:
    buffer = io.BytesIO()
    meta = np.frombuffer(json.dumps(header_meta(group)).encode(), dtype=np.uint8)
    np.savez(buffer, meta=meta, **_arrays(group))
    return buffer.getvalue()


def _savez_decode(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data)) as archive:
        return {key: archive[key] for key in archive.files}


def _json_encode(group: TrajectoryGroup) -> bytes:
    arrays = {
        key: [a.dtype.str, list(a.shape), base64.b64encode(a.tobytes()).decode()]
        for key, a in _arrays(group).items()
    }
    return json.dumps({"group": header_meta(group), "arrays": arrays}).encode()


def _json_decode(data: bytes) -> dict[str, np.ndarray]:
    obj = json.loads(data)
    return {
        key: np.frombuffer(base64.b64decode(b64), dtype=dt).reshape(shape)
        for key, (dt, shape, b64) in obj["arrays"].items()
    }


FORMATS: dict[str, Codec] = {
    "msgpack header + raw block (ours)": (_raw_frame, unframe),
    "msgpack, one bin per array": (_msgpack_encode, _msgpack_decode),
    "np.savez (uncompressed)": (_savez_encode, _savez_decode),
    "JSON + base64": (_json_encode, _json_decode),
    "ours, validated (encode_group/decode_group)": (encode_group, decode_group),
}


def _best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run(k: int, n: int, T: int, repeats: int, seed: int = 0) -> list[dict[str, Any]]:
    """One row per format: bytes per generated token, encode and decode MB/s of raw tensor data."""
    group = random_group(np.random.default_rng(seed), n=n, T=T, k=k)
    tensor_bytes = sum(a.nbytes for a in _arrays(group).values())
    rows = []
    for name, (encode, decode) in FORMATS.items():
        payload = encode(group)
        rows.append(
            {
                "format": name,
                "bytes_per_token": len(payload) / group.num_tokens,
                "encode_MBps": tensor_bytes / _best_seconds(lambda e=encode: e(group), repeats) / 1e6,
                "decode_MBps": tensor_bytes / _best_seconds(lambda d=decode, p=payload: d(p), repeats) / 1e6,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, nargs="+", default=[20, 64])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--T", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    for k in args.k:
        print(f"k={k}, n={args.n}, T={args.T}")
        for row in run(k, args.n, args.T, args.repeats):
            print(
                f"  {row['format']:<46} {row['bytes_per_token']:7.1f} B/token  "
                f"encode {row['encode_MBps']:7.0f} MB/s  decode {row['decode_MBps']:7.0f} MB/s"
            )


if __name__ == "__main__":
    main()
