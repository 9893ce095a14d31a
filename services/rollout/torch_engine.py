"""The CPU engine: any Hugging Face causal LM, sampled by a hand-written KV-cache loop.

Why not `model.generate`: the loop is as fast on CPU and hands us the raw logits, from which the
sampled token's log-prob and the top-k come out of one distribution, `log_softmax(logits / T)`.
Top-p only restricts what is *sampled*; the recorded log-probs stay those of the temperature-scaled
distribution before truncation, which is what the learner recomputes (`old_logp`) and what the Lp-Reg
proxy is built from (docs/architecture.md, "Lp-Reg, exactly": π_old at the sampling temperature).
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from sparkrl.proto import Completion
from sparkrl.services.common.modeling import load_model, load_tokenizer
from sparkrl.services.common.settings import SamplingSettings, TorchEngineSettings
from sparkrl.services.common.weight_sync import weights_checksum
from sparkrl.services.rollout.engine import Engine, make_completion


@dataclass
class _Sampled:
    """One batched decoding run: per-step tensors, each row valid up to its `lengths` entry."""

    tokens: torch.Tensor  # [B, S] int64
    logprobs: torch.Tensor  # [B, S] float32
    topk_ids: torch.Tensor  # [B, S, K] int64
    topk_logprobs: torch.Tensor  # [B, S, K] float32
    lengths: list[int]
    stopped: list[bool]  # finished by EOS or a stop string (else: max_new_tokens)
    by_stop_string: list[bool]

    @classmethod
    def empty(cls, B: int, S: int, K: int, device: torch.device) -> _Sampled:
        return cls(
            tokens=torch.zeros((B, S), dtype=torch.long, device=device),
            logprobs=torch.zeros((B, S), dtype=torch.float32, device=device),
            topk_ids=torch.zeros((B, S, K), dtype=torch.long, device=device),
            topk_logprobs=torch.zeros((B, S, K), dtype=torch.float32, device=device),
            lengths=[S] * B,
            stopped=[False] * B,
            by_stop_string=[False] * B,
        )


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    k: int,
    generator: torch.Generator,
    banned: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoding step from `logits` [B, V]: (token [B], its logp [B], top-k logps [B, K], ids [B, K]).

    All log-probs come from `log_softmax(logits / T)` in float32; top-p and `banned` (token ids never to
    sample, e.g. EOS before `min_new_tokens`) mask only the sampling.
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [B, V]
    topk_logp, topk_ids = torch.topk(logp, k, dim=-1)  # sorted descending
    probs = logp.exp()
    if banned is not None:
        probs[:, banned] = 0.0
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the mass strictly before it already reaches top_p; the first always stays.
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    token = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # [B]
    token_logp = logp.gather(1, token[:, None]).squeeze(1)
    return token, token_logp, topk_logp, topk_ids


class TorchEngine(Engine):
    """Batched sampling on one device; `max_batch_sequences` rows are decoded together."""

    settings: TorchEngineSettings
    device: torch.device
    model: PreTrainedModel
    _tokenizer: PreTrainedTokenizerBase
    _vocab_size: int
    _eos_ids: torch.Tensor  # [E] every id that ends a completion
    _pad_id: int
    _cache_arg: str
    _logits_to_keep: dict[str, int]
    _generator: torch.Generator
    _closed: bool

    def __init__(self, model_path: str | Path, settings: TorchEngineSettings) -> None:
        self.settings = settings
        self.device = torch.device(settings.device)
        if settings.threads is not None:
            torch.set_num_threads(settings.threads)
        self.model = load_model(model_path, settings.dtype, settings.device)
        self._tokenizer = load_tokenizer(model_path)
        self.policy_version = 0
        self._vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self._eos_ids = self._find_eos_ids()
        self._pad_id = int(self._tokenizer.pad_token_id)
        # transformers 5 renamed `past_key_values` to `cache` (argument and output); older ones have only
        # the former. Passing the wrong name silently decodes without context.
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        # Prefill needs the last position's logits only: skip the [B, L, V] output projection.
        self._logits_to_keep = {"logits_to_keep": 1} if "logits_to_keep" in forward_args else {}
        # Unseeded calls draw from this one stream, itself seeded at random per engine.
        self._generator = torch.Generator(self.device).manual_seed(random.SystemRandom().getrandbits(63))
        self._closed = False

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def _find_eos_ids(self) -> torch.Tensor:
        ids = {self._tokenizer.eos_token_id}
        configured = self.model.generation_config.eos_token_id
        ids.update(configured if isinstance(configured, list) else [configured])
        return torch.tensor(sorted(i for i in ids if i is not None), dtype=torch.long, device=self.device)

    def _check_inputs(self, prompts: list[list[int]], sampling: SamplingSettings) -> None:
        if self._closed:
            raise RuntimeError("engine is closed")
        self.check_request(prompts, sampling)

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[list[Completion]]:
        self._check_inputs(prompts, sampling)
        generator = self._generator
        if sampling.seed is not None:
            generator = torch.Generator(self.device).manual_seed(sampling.seed)
        version = self.policy_version
        rows = [prompt for prompt in prompts for _ in range(sampling.n)]  # group members are adjacent
        completions: list[Completion] = []
        step = self.settings.max_batch_sequences
        for start in range(0, len(rows), step):
            sampled = self._sample_batch(rows[start : start + step], sampling, generator)
            completions.extend(self._to_completions(sampled, sampling, version))
        return [completions[i * sampling.n : (i + 1) * sampling.n] for i in range(len(prompts))]

    def _prefill(self, prompts: list[list[int]]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """One forward pass over the left-padded prompts: (model output, attention mask [B, L], next
        position ids [B, 1]). Left padding puts every row's next-token logits in the last column;
        position ids skip the pads, so a row's numbers do not depend on its neighbours' lengths."""
        B, L = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((B, L), self._pad_id, dtype=torch.long)
        attention_mask = torch.zeros((B, L), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, L - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, L - len(prompt) :] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, L]
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **self._logits_to_keep,
        )
        return out, attention_mask, position_ids[:, -1:] + 1

    @torch.inference_mode()
    def _sample_batch(
        self, prompts: list[list[int]], sampling: SamplingSettings, generator: torch.Generator
    ) -> _Sampled:
        """Decode `prompts` (a group's rows adjacent) together. Each distinct prompt is prefilled once and
        its cache shared by its rows; rows that finished leave the batch once half of it has."""
        B, S, K = len(prompts), sampling.max_new_tokens, sampling.topk_logprobs
        logits, cache, attention_mask, next_position = self._prefill_shared(prompts)
        result = _Sampled.empty(B, S, K, self.device)
        rows = torch.arange(B, device=self.device)  # the result row of each batch row
        active = torch.ones(B, dtype=torch.bool, device=self.device)  # per batch row
        for t in range(S):
            too_short = t < sampling.min_new_tokens  # EOS may not be among the first min_new_tokens
            token, token_logp, topk_logp, topk_ids = sample_next(
                logits,
                sampling.temperature,
                sampling.top_p,
                K,
                generator,
                banned=self._eos_ids if too_short else None,
            )
            result.tokens[rows, t], result.logprobs[rows, t] = token, token_logp
            result.topk_ids[rows, t], result.topk_logprobs[rows, t] = topk_ids, topk_logp
            finished = active & torch.isin(token, self._eos_ids)
            if sampling.stop:
                candidates = torch.zeros(B, dtype=torch.bool, device=self.device)
                candidates[rows] = active & ~finished
                finished |= self._stop_string_hits(result, candidates, t, sampling.stop)[rows]
            for row in rows[finished].tolist():
                result.lengths[row], result.stopped[row] = t + 1, True
            active &= ~finished
            alive = int(active.sum())
            if t + 1 == S or alive == 0:
                break
            if alive <= len(rows) // 2 and hasattr(cache, "batch_select_indices"):
                keep = active.nonzero().flatten()  # the finished rows leave: the rest decode cheaper
                cache.batch_select_indices(keep)
                rows, active, token = rows[keep], active[keep], token[keep]
                attention_mask, next_position = attention_mask[keep], next_position[keep]
            # Finished rows still in the batch keep decoding (their tokens are cut off later).
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(rows), 1))], dim=1)
            out = self.model(
                input_ids=token[:, None],
                attention_mask=attention_mask,
                position_ids=next_position,
                use_cache=True,
                **{self._cache_arg: cache},
            )
            logits, cache = out.logits[:, -1, :], getattr(out, self._cache_arg)
            next_position = next_position + 1
        return result

    def _prefill_shared(
        self, prompts: list[list[int]]
    ) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor]:
        """The first token's logits, the cache, attention mask and next positions of every row of `prompts`,
        each distinct (adjacent) prompt prefilled once and its cache copied to its rows."""
        distinct, owner = _distinct_adjacent(prompts)
        out, attention_mask, next_position = self._prefill(distinct)
        logits, cache = out.logits[:, -1, :], getattr(out, self._cache_arg)
        if len(distinct) == len(prompts):
            return logits, cache, attention_mask, next_position
        if hasattr(cache, "batch_select_indices"):  # transformers' Cache: one row per completion
            expand = torch.tensor(owner, device=self.device)
            cache.batch_select_indices(expand)
            return logits[expand], cache, attention_mask[expand], next_position[expand]
        out, attention_mask, next_position = self._prefill(prompts)  # its own cache type: prefill every row
        return out.logits[:, -1, :], getattr(out, self._cache_arg), attention_mask, next_position

    def _stop_string_hits(
        self, result: _Sampled, candidates: torch.Tensor, t: int, stops: list[str]
    ) -> torch.Tensor:
        """Rows whose text now contains a stop string; only a tail of tokens is decoded per step.

        A stop string ending in token t lies within its last max(len(stop)) characters, and every token
        but a special one adds at least a character: a tail of that many tokens (+ margin) suffices.
        """
        hits = torch.zeros_like(candidates)
        rows = candidates.nonzero().flatten().tolist()
        if not rows:
            return hits
        window = max(len(s) for s in stops) + 8
        tails = result.tokens[rows, max(0, t + 1 - window) : t + 1].tolist()
        texts = self._tokenizer.batch_decode(tails, skip_special_tokens=True)
        for row, text in zip(rows, texts, strict=True):
            if any(stop in text for stop in stops):
                hits[row] = True
                result.by_stop_string[row] = True
        return hits

    def _to_completions(
        self, sampled: _Sampled, sampling: SamplingSettings, version: int
    ) -> list[Completion]:
        completions = []
        tokens, logprobs = sampled.tokens.cpu(), sampled.logprobs.cpu()
        topk_ids, topk_logprobs = sampled.topk_ids.cpu(), sampled.topk_logprobs.cpu()
        for row, length in enumerate(sampled.lengths):
            ids = tokens[row, :length]
            text = self._tokenizer.decode(ids.tolist(), skip_special_tokens=True)
            if sampled.by_stop_string[row]:
                # The stop string stays out of the text; its tokens stay in token_ids (as vLLM does).
                cuts = [i for i in (text.find(stop) for stop in sampling.stop) if i >= 0]
                text = text[: min(cuts)] if cuts else text
            completions.append(
                make_completion(
                    ids.numpy(),
                    logprobs[row, :length].numpy(),
                    topk_ids[row, :length].numpy(),
                    topk_logprobs[row, :length].numpy(),
                    version,
                    text,
                    "stop" if sampled.stopped[row] else "length",
                )
            )
        return completions

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy by state-dict name into the live tensors (any dtype/device; cast on copy). An unknown name
        or a shape mismatch raises before that tensor is copied; the version changes only on success."""
        # state_dict(keep_vars=True): the live parameters and persistent buffers, a tied lm_head under its
        # own name too: exactly the names the learner broadcasts (its state_dict).
        targets = self.model.state_dict(keep_vars=True)
        for name, tensor in named_tensors:
            if name not in targets:
                raise KeyError(f"load_weights: the model has no tensor {name!r}")
            if tuple(tensor.shape) != tuple(targets[name].shape):
                expected = list(targets[name].shape)
                raise ValueError(f"load_weights: {name} has shape {list(tensor.shape)}, model has {expected}")
            targets[name].copy_(tensor)
        self.policy_version = version

    def weights_checksum(self) -> str:
        """`weight_sync.weights_checksum(model.state_dict().items())`: raw bytes in state-dict order and
        the engine's dtype, equal to the announcement's checksum when the learner broadcasts the same
        weights in the same dtype."""
        return weights_checksum(self.model.state_dict().items())

    def close(self) -> None:
        self._closed = True
        self.model = self.model.to("meta")  # drops the weights' memory; the object stays inspectable
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _distinct_adjacent(prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """(the prompts with adjacent repeats collapsed, the index in it of every row): a group's rows share
    one prefill."""
    distinct: list[list[int]] = []
    owner: list[int] = []
    for prompt in prompts:
        if not distinct or distinct[-1] != prompt:
            distinct.append(prompt)
        owner.append(len(distinct) - 1)
    return distinct, owner
