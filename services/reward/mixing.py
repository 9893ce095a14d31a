"""Tasks scored by several verifiers (`reward.mixes`, docs/rewards.md).

An item of a mixed task is scored by its parts, each as an item of its own task (a rule verifier, the
judge, the reward model), and their results combine into the item's:

- `weighted`: every part scores it at once; the score is the parts' weighted mean, `correct` at or above
  the mix's `pass_score`, `no_answer` when no part found an answer. A part that failed (`timeout`,
  `error`, `unparseable`) makes the item that failure, naming the part: a mean over a missing score would
  be a silent partial zero.
- `fallback`: the parts in order, the next one only for the items the last said `no_answer` of (e.g. the
  rule, and the judge only where the rule finds nothing to check): the first that finds one decides.

Every part's status and score stay in the result's detail.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from sparkrl.proto.reward import UNSCORED, RewardItem, RewardResult
from sparkrl.services.common.settings.reward import MixSettings

MAX_DETAIL = 2000

# Scores plain items (no mixed task among them): their results in order, or None when the client went away.
ScoreItems = Callable[[list[RewardItem]], Awaitable[list[RewardResult] | None]]


@dataclass
class _Mixed:
    """One item of a mixed task while its parts are scored."""

    item: RewardItem
    mix: MixSettings
    results: list[RewardResult] = field(default_factory=list)  # the parts scored so far, in order

    def parts_now(self) -> list[int]:
        """The parts to score in the next round: all of them at first (weighted), or the next one while
        the last said `no_answer` (fallback)."""
        done = len(self.results)
        if self.mix.combine == "weighted":
            return [] if done else list(range(len(self.mix.parts)))
        if done == len(self.mix.parts) or (done and self.results[-1].status != "no_answer"):
            return []
        return [done]


async def score_mixed(
    items: list[RewardItem], mixes: dict[str, MixSettings], score: ScoreItems
) -> list[RewardResult] | None:
    """Every item's result, in order: those of a mixed task from their parts' (rounds of `score`, one per
    fallback step), the rest by `score` as they are. None when `score` says the client went away."""
    mixed = {i: _Mixed(item, mixes[item.task]) for i, item in enumerate(items) if item.task in mixes}
    plain = [i for i in range(len(items)) if i not in mixed]
    results: dict[int, RewardResult] = {}
    first = True
    while first or any(m.parts_now() for m in mixed.values()):
        asked = [(i, part) for i, m in mixed.items() for part in m.parts_now()]
        batch = [items[i] for i in plain] if first else []
        batch += [mixed[i].item.model_copy(update={"task": mixed[i].mix.parts[p].verifier}) for i, p in asked]
        got = await score(batch) if batch else []
        if got is None:
            return None
        if first:
            results.update(zip(plain, got[: len(plain)], strict=True))
            got = got[len(plain) :]
        for (i, _), result in zip(asked, got, strict=True):
            mixed[i].results.append(result)
        first = False
    results.update({i: combine(m.mix, m.results) for i, m in mixed.items()})
    return [results[i] for i in range(len(items))]


def combine(mix: MixSettings, results: list[RewardResult]) -> RewardResult:
    """The item's result from its parts' (`results`: one per part scored, in the mix's order)."""
    names = [part.verifier for part in mix.parts]
    said = "; ".join(f"{name}: {r.status} {r.score:g}" for name, r in zip(names, results, strict=False))
    elapsed = sum(r.elapsed_s for r in results)
    if mix.combine == "fallback":
        last = results[-1]
        detail = f"{said} — {last.detail}" if last.detail else said
        return RewardResult(
            score=last.score, status=last.status, detail=detail[:MAX_DETAIL], elapsed_s=elapsed
        )
    for name, r in zip(names, results, strict=True):
        if r.status in UNSCORED:  # named, never averaged in as a 0
            detail = f"{said} — {name} {r.status}: {r.detail or ''}"
            return RewardResult(score=0.0, status=r.status, detail=detail[:MAX_DETAIL], elapsed_s=elapsed)
    weights = [part.weight for part in mix.parts]
    mean = sum(w * r.score for w, r in zip(weights, results, strict=True)) / sum(weights)
    if all(r.status == "no_answer" for r in results):
        status = "no_answer"
    else:
        status = "correct" if mean >= mix.pass_score else "incorrect"
    details = " | ".join(r.detail for r in results if r.detail)  # each says whose it is
    detail = f"{said} — {details}" if details else said
    return RewardResult(score=mean, status=status, detail=detail[:MAX_DETAIL], elapsed_s=elapsed)
