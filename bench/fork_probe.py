"""What the planted fork (issue 47) measures of a model: at the fork (the first answer token) on a fixed
probe set, and by sampling each path. fork_model.py reads the start state with it; fork_experiment.py
reads every checkpoint of a run with it, and chooses Lp-Reg's ρ from the start model.

- `fork_numbers`: p(spark) and Z, the mass of the tokens min-p keeps (p ≥ κ · p_max), averaged over the
  probe problems; one forward pass per problem, no sampling.
- `path_success`: the mean score of samples at T = 1 on the common path (`?` masked), the spark path (`?`
  forced) or free.
- `start_state`: both, and E[A | spark] = (success_spark − mean) / std of a group's reward (GRPO's
  normalization at the mean rate): the experiment needs it negative.
- `needed_rho`: the smallest ρ on a grid whose k = int(N_neg · ρ) covers the failing spark tokens of a
  step sampled from the start model (Lp-Reg regularizes the k lowest-probability A < 0 tokens).

    python bench/fork_probe.py .cache/fork-tail          # the start state of a model fork_model.py built
    python bench/fork_probe.py .cache/fork-tail --rho    # and the ρ Lp-Reg needs on it
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path
from typing import Any

import torch
from fork_task import SPARK, ForkProblem, generate, score

PROBE_SEED = 12345  # the probe problems: the same for every model and run


def probe_problems(recipe: dict[str, Any], count: int | None = None) -> list[ForkProblem]:
    rng = random.Random(PROBE_SEED)
    return [generate(rng, recipe["n_digits"]) for _ in range(count or recipe["probe_problems"])]


@torch.no_grad()
def fork_numbers(model: Any, tokenizer: Any, problems: list[ForkProblem], kappa: float) -> dict[str, float]:
    """p(spark) and Z at the fork, averaged over `problems` (every prompt has the same length)."""
    spark_id = tokenizer.convert_tokens_to_ids(SPARK)
    ids = torch.tensor([tokenizer(p.prompt(), add_special_tokens=False)["input_ids"] for p in problems])
    probs = torch.softmax(model(input_ids=ids).logits[:, -1].float(), dim=-1)
    kept = probs >= kappa * probs.max(dim=-1, keepdim=True).values
    return {
        "p_spark": float(probs[:, spark_id].mean()),
        "z_kept_mass": float((probs * kept).sum(dim=-1).mean()),
    }


@torch.no_grad()
def path_success(
    model: Any, tokenizer: Any, problems: list[ForkProblem], samples: int, prefix: str | None, seed: int
) -> float:
    """Mean score of `samples` samples per problem at T = 1: free (`prefix` None), the common path (`""`:
    `?` masked, so a digit or anything else but the spark) or the spark path (`?` forced)."""
    torch.manual_seed(seed)
    total, count = 0.0, 0
    spark_id = tokenizer.convert_tokens_to_ids(SPARK)
    n_digits = len(problems[0].digits)
    for problem in problems:
        ids = tokenizer(problem.prompt() + (prefix or ""), add_special_tokens=False)["input_ids"]
        out = model.generate(
            input_ids=torch.tensor([ids] * samples),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=4 * n_digits + 6,
            bad_words_ids=[[spark_id]] if prefix == "" else None,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        texts = tokenizer.batch_decode(out[:, len(ids) :], skip_special_tokens=True)
        total += sum(score((prefix or "") + text, problem) for text in texts)
        count += len(texts)
    return total / count


def start_state(
    model: Any,
    tokenizer: Any,
    recipe: dict[str, Any],
    problems: int | None = None,
    samples: int | None = None,
) -> dict[str, float]:
    """The fork's numbers and each path's success on the probe set (module docstring)."""
    chosen = probe_problems(recipe, problems)
    n = samples or recipe["probe_samples"]
    common = path_success(model, tokenizer, chosen, n, prefix="", seed=PROBE_SEED)
    spark = path_success(model, tokenizer, chosen, n, prefix=SPARK, seed=PROBE_SEED + 1)
    free = path_success(model, tokenizer, chosen, n, prefix=None, seed=PROBE_SEED + 2)
    std = math.sqrt(max(free * (1 - free), 1e-12))
    return {
        **fork_numbers(model, tokenizer, chosen, recipe["kappa"]),
        "success_common": common,
        "success_spark": spark,
        "success_sampled": free,
        "advantage_given_spark": (spark - free) / std,
    }


RHO_GRID = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5)


@torch.no_grad()
def needed_rho(
    model_dir: Path, recipe: dict[str, Any], prompts: int, n: int, steps: int, cover: float = 0.9
) -> dict[str, Any]:
    """The smallest ρ of RHO_GRID whose k = int(N_neg · ρ) holds at least `cover` of the failing spark
    tokens (`?` in a completion with A < 0) among the k lowest-probability A < 0 tokens, pooled over
    `steps` simulated first steps of `prompts` × `n` samples from the start model (group advantages
    (r − mean) / std, as the learner's; every completion token and its EOS is a token the loss sees)."""
    from sparkrl.services.common.modeling import load_model, load_tokenizer

    model, tokenizer = load_model(model_dir).eval(), load_tokenizer(model_dir)
    spark_id = tokenizer.convert_tokens_to_ids(SPARK)
    rng, covered = random.Random(PROBE_SEED + 7), dict.fromkeys(RHO_GRID, 0)
    failing_sparks, negatives = 0, 0
    torch.manual_seed(PROBE_SEED + 7)
    for _ in range(steps):
        logps, is_spark = [], []
        for problem in (generate(rng, recipe["n_digits"]) for _ in range(prompts)):
            ids = tokenizer(problem.prompt(), add_special_tokens=False)["input_ids"]
            out = model.generate(
                input_ids=torch.tensor([ids] * n), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=4 * recipe["n_digits"] + 6, pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id, output_scores=True, return_dict_in_generate=True,
            )  # fmt: skip
            new = out.sequences[:, len(ids) :]
            texts = tokenizer.batch_decode(new, skip_special_tokens=True)
            rewards = torch.tensor([score(text, problem) for text in texts])
            adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
            step_logp = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)
            token_logp = step_logp.gather(-1, new.unsqueeze(-1)).squeeze(-1)
            for row in range(n):
                if adv[row] >= 0:
                    continue
                length = _length(new[row], tokenizer)
                logps += token_logp[row, :length].tolist()
                is_spark += [position == 0 and int(new[row, 0]) == spark_id for position in range(length)]
        order = sorted(range(len(logps)), key=logps.__getitem__)
        rank = {index: place for place, index in enumerate(order)}
        sparks = [rank[i] for i, spark in enumerate(is_spark) if spark]
        failing_sparks, negatives = failing_sparks + len(sparks), negatives + len(logps)
        for rho in RHO_GRID:
            k = int(len(logps) * rho)
            covered[rho] += sum(place < k for place in sparks) if k > 1 else 0
    share = {rho: covered[rho] / max(failing_sparks, 1) for rho in RHO_GRID}
    chosen = next((rho for rho in RHO_GRID if share[rho] >= cover), RHO_GRID[-1])
    return {
        "rho": chosen,
        "covered_share": share,
        "failing_spark_tokens_per_step": failing_sparks / steps,
        "negative_tokens_per_step": negatives / steps,
    }


def _length(tokens: torch.Tensor, tokenizer: Any) -> int:
    """Tokens up to and with the first EOS (the rest is padding)."""
    eos = (tokens == tokenizer.eos_token_id).nonzero()
    return int(eos[0]) + 1 if len(eos) else len(tokens)


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("model", type=Path, help="a model fork_model.py built (its fork_build.json beside)")
    parser.add_argument("--rho", action="store_true", help="also the ρ that covers the failing sparks")
    parser.add_argument("--steps", type=int, default=32, help="--rho: simulated first steps")
    args = parser.parse_args()
    from sparkrl.services.common.modeling import load_model, load_tokenizer

    torch.set_num_threads(1)
    recipe = json.loads((args.model / "fork_build.json").read_text())["recipe"]
    model, tokenizer = load_model(args.model).eval(), load_tokenizer(args.model)
    print(json.dumps({"start_state": start_state(model, tokenizer, recipe)}), flush=True)
    if args.rho:
        print(json.dumps({"needed_rho": needed_rho(args.model, recipe, 16, 8, args.steps)}), flush=True)


if __name__ == "__main__":
    main()
