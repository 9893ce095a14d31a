"""How old the tokens a step trains on are, token by token: an in-flight update (`rollout.weight_updates`)
leaves a sample with tokens of two versions, a continued one (`rollout.partial`) with another worker's
prefix. The learner reads them as any group (its staleness rule takes the oldest token, its ratios are per
token); these are the step row's numbers of it."""

from __future__ import annotations

import numpy as np

from sparkrl.proto import TrajectoryGroup

LAGS_COUNTED = 3  # token_lag_{0,1,2}_share, then token_lag_3plus_share


def version_stats(groups: list[TrajectoryGroup], version: int) -> dict[str, float]:
    """Over the generated tokens of `groups`, trained against policy `version`: `rollout/token_lag_mean`
    and `_max` (versions between the one that sampled a token and `version`), the share of tokens at each
    lag (`token_lag_0_share` … `token_lag_3plus_share`); over their samples, the share holding more than
    one version (`mixed_version_share`) and the share continued from saved partial work (`resumed_share`)."""
    samples = [(g, i) for g in groups for i in range(len(g.completions))]
    if not samples:
        return {}
    versions = [g.completions[i].policy_versions for g, i in samples]
    lags = version - np.concatenate(versions).astype(np.int64)
    stats: dict[str, float] = {}
    if lags.size:
        stats["rollout/token_lag_mean"] = float(lags.mean())
        stats["rollout/token_lag_max"] = float(lags.max())
        for lag in range(LAGS_COUNTED):
            stats[f"rollout/token_lag_{lag}_share"] = float((lags == lag).mean())
        stats[f"rollout/token_lag_{LAGS_COUNTED}plus_share"] = float((lags >= LAGS_COUNTED).mean())
    mixed = sum(int(v.size > 0 and v[0] != v[-1]) for v in versions)  # versions never go back in a sample
    resumed = sum(int(g.resumed_tokens is not None and g.resumed_tokens[i] > 0) for g, i in samples)
    stats["rollout/mixed_version_share"] = mixed / len(samples)
    stats["rollout/resumed_share"] = resumed / len(samples)
    return stats
