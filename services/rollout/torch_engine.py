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
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from sparkrl.proto import Completion, completions_of_rows
from sparkrl.services.common.modeling import load_model, load_tokenizer, stop_token_ids
from sparkrl.services.common.settings import SamplingSettings, TorchEngineSettings
from sparkrl.services.common.weight_sync import distinct_tensors, weights_checksum
from sparkrl.services.rollout.engine import (
    Engine,
    Interrupts,
    Prefixes,
    WeightsDoNotFit,
    cut_short,
    finished,
)
from sparkrl.services.rollout.torch_rows import Live, Row, Sampled, distinct_adjacent, sample_next


class TorchEngine(Engine):
    """Batched sampling on one device; `max_batch_sequences` rows are decoded together."""

    continues_prefixes = True
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

    def __init__(
        self,
        model_path: str | Path,
        settings: TorchEngineSettings,
        *,
        eos_tokens: Sequence[str | int] | None = None,
    ) -> None:
        """`eos_tokens`: `rollout.eos_tokens`, exactly the tokens that end a completion (None: the model's
        generation config's and the tokenizer's EOS); a string the vocabulary lacks is a ValueError."""
        self.settings = settings
        self.device = torch.device(settings.device)
        if settings.threads is not None:
            torch.set_num_threads(settings.threads)
        self.model = load_model(model_path, settings.dtype, settings.device)
        self._tokenizer = load_tokenizer(model_path)
        self.policy_version = 0
        self._vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self._eos_ids = self._find_eos_ids(eos_tokens)
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

    def _find_eos_ids(self, eos_tokens: Sequence[str | int] | None) -> torch.Tensor:
        # modeling.stop_token_ids, as the vLLM engine's: both stop at the same ids.
        configured = self.model.generation_config.eos_token_id  # generation_eos_ids(model_path)'s source
        ids = stop_token_ids(self._tokenizer, configured, eos_tokens)
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def _check_inputs(self, prompts: list[list[int]], sampling: SamplingSettings) -> None:
        if self._closed:
            raise RuntimeError("engine is closed")
        self.check_request(prompts, sampling)

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingSettings,
        *,
        prefixes: Prefixes | None = None,
        interrupts: Interrupts | None = None,
    ) -> list[list[Completion]]:
        self._check_inputs(prompts, sampling)
        self.check_prefixes(prompts, sampling, prefixes)
        generator = self._generator
        if sampling.seed is not None:
            generator = torch.Generator(self.device).manual_seed(sampling.seed)
        n, K = sampling.n, sampling.topk_logprobs
        samples = prefixes or [[None] * n for _ in prompts]
        rows = [Row(p, prefix) for p, group in zip(prompts, samples, strict=True) for prefix in group]
        out: list[Completion | None] = [row.prefix if finished(row.prefix) else None for row in rows]
        todo = [i for i, made in enumerate(out) if made is None]  # a group's rows stay adjacent
        stopped, step = False, self.settings.max_batch_sequences
        for start in range(0, len(todo), step):
            chunk = todo[start : start + step]
            # Before a chunk's prefill a swap costs nothing: no cache yet.
            stopped = stopped or (interrupts is not None and interrupts.poll())
            if stopped:
                for i in chunk:
                    out[i] = cut_short(rows[i].prefix, K)
                continue
            sampled, stopped = self._sample_batch([rows[i] for i in chunk], sampling, generator, interrupts)
            for i, completion in zip(chunk, self._to_completions(sampled, sampling), strict=True):
                out[i] = completion
        made = [c for c in out if c is not None]
        return [made[i * n : (i + 1) * n] for i in range(len(prompts))]

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
        self,
        rows: list[Row],
        sampling: SamplingSettings,
        generator: torch.Generator,
        interrupts: Interrupts | None,
    ) -> tuple[Sampled, bool]:
        """Decode `rows` together: (what was sampled, whether `interrupts` stopped it). Each distinct
        prompt is prefilled once and its cache shared by its rows; rows that finished leave the batch once
        half of it has. Between two steps `interrupts.poll()` may swap the weights (later tokens carry the
        new version; with kv_cache recompute the cache is rebuilt under them first) or stop the batch."""
        result = Sampled.start([row.prefix for row in rows], sampling.max_new_tokens,
                                sampling.topk_logprobs, self.device)  # fmt: skip
        version = self.policy_version
        live = self._start(rows, result, torch.arange(len(rows), device=self.device))
        while True:
            self._step(live, result, sampling, generator, version)
            alive = int(live.active.sum())
            if alive == 0:
                return result, False
            if alive <= len(live.rows) // 2 and hasattr(live.cache, "batch_select_indices"):
                self._shrink(live)  # the finished rows leave: the rest decode cheaper
            if interrupts is not None:
                before = self.policy_version
                if interrupts.poll():
                    return result, True
                if self.policy_version != before:
                    version = self.policy_version
                    if interrupts.kv_cache == "recompute":  # the swap's point: no token sampled is undone
                        live = self._start(rows, result, live.rows[live.active])
                        continue
            self._advance(live)

    def _start(self, rows: list[Row], result: Sampled, which: torch.Tensor) -> Live:
        """Prefill the rows `which` (result rows) over their prompt and the tokens they hold so far."""
        inputs = [rows[i].prompt + result.tokens[i, : int(result.length[i])].tolist() for i in which.tolist()]
        logits, cache, attention_mask, next_position = self._prefill_shared(inputs)
        active = torch.ones(len(inputs), dtype=torch.bool, device=self.device)
        return Live(which, active, logits, cache, attention_mask, next_position)

    def _step(
        self,
        live: Live,
        result: Sampled,
        sampling: SamplingSettings,
        generator: torch.Generator,
        version: int,
    ) -> None:
        """Sample one token for every active row from `live.logits`, record it, and end the rows it ends."""
        position = result.length[live.rows]  # [b]: where each row's token goes
        too_short = position < sampling.min_new_tokens  # EOS may not be among the first min_new_tokens
        token, token_logp, topk_logp, topk_ids = sample_next(
            live.logits,
            sampling.temperature,
            sampling.top_p,
            sampling.topk_logprobs,
            generator,
            banned=self._eos_ids if bool(too_short.any()) else None,
            banned_rows=too_short,
        )
        live.token = token  # finished rows still in the batch keep decoding; nothing of theirs is kept
        write = live.active.nonzero().flatten()
        rows, at = live.rows[write], position[write]
        result.tokens[rows, at], result.logprobs[rows, at] = token[write], token_logp[write]
        result.topk_ids[rows, at], result.topk_logprobs[rows, at] = topk_ids[write], topk_logp[write]
        result.versions[rows, at] = version
        result.length[rows] += 1
        ended = torch.isin(token[write], self._eos_ids)
        if sampling.stop:
            ended |= self._stop_string_hits(result, rows, ~ended, sampling.stop)
        done = ended | (result.length[rows] == sampling.max_new_tokens)
        for row, by_eos_or_stop in zip(rows[done].tolist(), ended[done].tolist(), strict=True):
            result.finish[row] = "stop" if by_eos_or_stop else "length"
        live.active[write[done]] = False

    @staticmethod
    def _shrink(live: Live) -> None:
        keep = live.active.nonzero().flatten()
        live.cache.batch_select_indices(keep)
        live.rows, live.active = live.rows[keep], live.active[keep]
        live.attention_mask, live.next_position = live.attention_mask[keep], live.next_position[keep]
        if live.token is not None:
            live.token = live.token[keep]

    def _advance(self, live: Live) -> None:
        """Run the tokens just sampled: the next step's logits and the grown cache."""
        assert live.token is not None
        ones = live.attention_mask.new_ones((len(live.rows), 1))
        live.attention_mask = torch.cat([live.attention_mask, ones], dim=1)
        out = self.model(
            input_ids=live.token[:, None],
            attention_mask=live.attention_mask,
            position_ids=live.next_position,
            use_cache=True,
            **{self._cache_arg: live.cache},
        )
        live.logits, live.cache = out.logits[:, -1, :], getattr(out, self._cache_arg)
        live.next_position = live.next_position + 1

    def _prefill_shared(
        self, prompts: list[list[int]]
    ) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor]:
        """The first token's logits, the cache, attention mask and next positions of every row of `prompts`,
        each distinct (adjacent) prompt prefilled once and its cache copied to its rows."""
        distinct, owner = distinct_adjacent(prompts)
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
        self, result: Sampled, rows: torch.Tensor, candidates: torch.Tensor, stops: list[str]
    ) -> torch.Tensor:
        """Which of `rows` (those `candidates` marks) now hold a stop string; only a tail is decoded.

        A stop string ending in the last token lies within its last max(len(stop)) characters, and every
        token but a special one adds at least a character: a tail of that many tokens (+ margin) suffices.
        """
        hits = torch.zeros_like(candidates)
        picked = candidates.nonzero().flatten().tolist()
        if not picked:
            return hits
        window = max(len(s) for s in stops) + 8
        ends = result.length[rows[picked]].tolist()
        tails = [
            result.tokens[int(rows[i]), max(0, end - window) : end].tolist()
            for i, end in zip(picked, ends, strict=True)
        ]
        texts = self._tokenizer.batch_decode(tails, skip_special_tokens=True)
        for i, text in zip(picked, texts, strict=True):
            if any(stop in text for stop in stops):
                hits[i] = True
                result.by_stop_string[int(rows[i])] = True
        return hits

    def _to_completions(self, sampled: Sampled, sampling: SamplingSettings) -> list[Completion]:
        """The batch's rows as completions, checked in one pass (`completions_of_rows`), every row's text
        decoded in one call."""
        tokens = sampled.tokens.cpu().numpy()
        lengths = sampled.length.tolist()
        # A stop token's text stays out of the text (a `rollout.eos_tokens` entry need not be special), as
        # vLLM leaves it out; it stays in token_ids.
        ends = [
            length - int(finish == "stop" and not by_string)
            for length, finish, by_string in zip(lengths, sampled.finish, sampled.by_stop_string, strict=True)
        ]
        texts = self._tokenizer.batch_decode(
            [tokens[row, :end].tolist() for row, end in enumerate(ends)], skip_special_tokens=True
        )
        for row, text in enumerate(texts):
            if sampled.by_stop_string[row]:
                # The stop string stays out of the text; its tokens stay in token_ids (as vLLM does).
                cuts = [i for i in (text.find(stop) for stop in sampling.stop) if i >= 0]
                texts[row] = text[: min(cuts)] if cuts else text
        return completions_of_rows(
            tokens,
            sampled.logprobs.cpu().numpy(),
            sampled.topk_ids.cpu().numpy(),
            sampled.topk_logprobs.cpu().numpy(),
            sampled.versions.cpu().numpy(),
            lengths,
            texts,
            sampled.finish,
        )

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy by state-dict name into the live tensors (any dtype/device; cast on copy). An unknown name
        or a shape mismatch raises WeightsDoNotFit before that tensor is copied; the version changes only
        on success."""
        # state_dict(keep_vars=True): the live parameters and persistent buffers, a tied lm_head under its
        # own name too (it shares the embedding's storage: the learner sends it once, as the embedding).
        targets = self.model.state_dict(keep_vars=True)
        model = type(self.model).__name__
        for name, tensor in named_tensors:
            if name not in targets:
                raise WeightsDoNotFit(f"the learner sent tensor {name!r}, which {model} does not have")
            if tuple(tensor.shape) != tuple(targets[name].shape):
                expected = list(targets[name].shape)
                raise WeightsDoNotFit(f"the learner sent {name} of shape {list(tensor.shape)}; {model}'s "
                                      f"is {expected}")  # fmt: skip
            targets[name].copy_(tensor)
        self.policy_version = version

    def weights_checksum(self) -> str:
        """`weight_sync.weights_checksum` of the state dict's distinct tensors (a tied head once, as its
        embedding) in order, raw bytes in the engine's dtype: the announcement's checksum when the learner
        broadcasts the same weights in the same dtype."""
        return weights_checksum(distinct_tensors(self.model.state_dict()).items())

    def close(self) -> None:
        self._closed = True
        self.model = self.model.to("meta")  # drops the weights' memory; the object stays inspectable
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
