"""Vectorized value checks of the per-token arrays, shared by the models' validators and the codec.

Each check first runs one cheap reduction over the whole array (min / max / all) and only on failure
looks for the first bad element to name it. The arrays may be one completion's, or every completion of
a group concatenated (the codec's layout); `lengths` maps a flat row back to `completions[i]`, position.
"""

from collections.abc import Sequence

import numpy as np

from sparkrl.proto.errors import FieldError

# A log-probability is ≤ 0; engines compute it in float32/bf16, so a top-1 token with p ≈ 1 can come
# out a hair above zero. Up to this much is rounding and accepted; more is a bug upstream.
LOGPROB_SLACK = 1e-4


class RowLocator:
    """Names a row of a (possibly concatenated) per-token array: `completions[i].field`, position."""

    ends: np.ndarray | None  # [n] cumulative token counts; None for a single completion

    def __init__(self, lengths: Sequence[int] | None) -> None:
        self.ends = None if lengths is None else np.cumsum(np.asarray(lengths, dtype=np.int64))

    def locate(self, field: str, row: int) -> tuple[str, int]:
        if self.ends is None:
            return field, row
        i = int(np.searchsorted(self.ends, row, side="right"))
        start = int(self.ends[i - 1]) if i > 0 else 0
        return f"completions[{i}].{field}", row - start


def _first(mask: np.ndarray) -> tuple[int, int]:
    """(row, column) of the first True of a 1-D or 2-D mask; column is -1 for 1-D."""
    flat = int(np.argmax(mask.reshape(-1)))
    if mask.ndim == 1:
        return flat, -1
    return divmod(flat, mask.shape[1])


def _where(rows: RowLocator, field: str, mask: np.ndarray) -> tuple[str, str]:
    row, col = _first(mask)
    path, position = rows.locate(field, row)
    return path, f"position {position}" + (f", rank {col}" if col >= 0 else "")


def check_ids(ids: np.ndarray, field: str, vocab_size: int | None, rows: RowLocator | None = None) -> None:
    """Token ids lie in [0, vocab_size) (only ≥ 0 when vocab_size is None)."""
    if ids.size == 0:
        return
    rows = rows or RowLocator(None)
    if ids.min() < 0:
        path, where = _where(rows, field, ids < 0)
        raise FieldError(path, f"negative token id {ids[ids < 0][0]} at {where}")
    if vocab_size is not None and ids.max() >= vocab_size:
        path, where = _where(rows, field, ids >= vocab_size)
        bad = ids[ids >= vocab_size][0]
        raise FieldError(path, f"token id {bad} at {where} is not below vocab_size={vocab_size}")


def check_logprobs(values: np.ndarray, field: str, rows: RowLocator | None = None) -> None:
    """Log-probabilities are finite and ≤ 0 (up to `LOGPROB_SLACK` of rounding)."""
    if values.size == 0:
        return
    rows = rows or RowLocator(None)
    # max() propagates NaN and finds +inf; min() finds -inf: two passes, no temporaries when all is well.
    if values.max() <= LOGPROB_SLACK and np.isfinite(values.min()):
        return
    if not np.isfinite(values).all():
        path, where = _where(rows, field, ~np.isfinite(values))
        raise FieldError(path, f"log-prob {values[~np.isfinite(values)][0]} at {where} is not finite")
    path, where = _where(rows, field, values > LOGPROB_SLACK)
    bad = float(values[values > LOGPROB_SLACK][0])
    raise FieldError(path, f"log-prob {bad:.6g} at {where} is positive (more than {LOGPROB_SLACK} above 0)")


def check_sorted_descending(values: np.ndarray, field: str, rows: RowLocator | None = None) -> None:
    """Each row of a [T, K] top-k is sorted by log-prob, highest first; ties are allowed."""
    if values.shape[0] == 0 or values.shape[1] < 2:
        return
    rising = values[:, 1:] > values[:, :-1]  # [T, K-1]
    if not rising.any():
        return
    row, col = _first(rising)
    path, position = (rows or RowLocator(None)).locate(field, row)
    raise FieldError(
        path,
        f"not sorted descending at position {position}: rank {col} is {values[row, col]:.6g}, "
        f"rank {col + 1} is {values[row, col + 1]:.6g}",
    )


def check_policy_versions(versions: np.ndarray, field: str, rows: RowLocator | None = None) -> None:
    if versions.size and versions.min() < 0:
        path, where = _where(rows or RowLocator(None), field, versions < 0)
        raise FieldError(path, f"negative policy version {versions[versions < 0][0]} at {where}")


def check_token_arrays(
    token_ids: np.ndarray,
    logprobs: np.ndarray,
    policy_versions: np.ndarray,
    topk_ids: np.ndarray,
    topk_logprobs: np.ndarray,
    vocab_size: int | None,
    lengths: Sequence[int] | None = None,
) -> None:
    """All value checks of a completion's arrays, or of every completion's arrays concatenated.

    With `lengths` (tokens per completion, summing to the arrays' first dimension) errors name
    `completions[i].<field>`; without it they name `<field>`. Shapes must already agree.
    """
    rows = RowLocator(lengths)
    check_ids(token_ids, "token_ids", vocab_size, rows)
    check_logprobs(logprobs, "logprobs", rows)
    check_policy_versions(policy_versions, "policy_versions", rows)
    check_ids(topk_ids, "topk_ids", vocab_size, rows)
    check_logprobs(topk_logprobs, "topk_logprobs", rows)
    check_sorted_descending(topk_logprobs, "topk_logprobs", rows)
