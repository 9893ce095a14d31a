"""A reward model served by the reward service itself (issue 49): a sequence classifier in Hugging Face
format (`AutoModelForSequenceClassification`, as trained RMs are published) scores `task: reward_model`
items by a batched forward pass, on the CPU or a GPU (`reward.model`).

An item is the conversation the policy had: the question (`task_data.question`) as the user's turn and
the completion as the assistant's, through the tokenizer's chat template when it has one (else the two
joined by a blank line), cut from the left to `max_length` tokens so the completion's end is kept. One
logit is the score through a sigmoid (`score: sigmoid`, in [0, 1]) or raw (`score: raw`); two labels give
label 1's probability. `correct` at or above `pass_score`. A forward pass that fails makes its items
`error`, with the reason — never a silent 0.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from sparkrl.proto.reward import RewardItem, RewardResult
from sparkrl.services.common.settings.reward import RewardModelSettings

log = logging.getLogger("sparkrl.reward.model")


class RewardModel:
    """The classifier and its tokenizer, loaded once; `score` runs one forward pass at a time."""

    def __init__(self, settings: RewardModelSettings) -> None:
        if settings.path is None:
            raise ValueError("reward.model.path is not set")
        path = Path(settings.path)
        if not (path / "config.json").is_file():
            raise ValueError(f"reward.model.path {path}: no config.json there (a Hugging Face model folder)")
        self.settings = settings
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.truncation_side = "left"  # the completion's end is what it scores
        self.tokenizer.padding_side = "right"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path)
        if self.model.config.num_labels not in (1, 2):
            raise ValueError(
                f"reward.model.path {path}: {self.model.config.num_labels} labels; a reward model has one "
                "(a score) or two (label 1's probability)"
            )
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(settings.device).eval()
        self._lock = threading.Lock()  # one forward pass at a time: requests take turns
        labels = self.model.config.num_labels
        log.info("reward model %s on %s (%d labels)", path.name, settings.device, labels)

    def score(self, items: list[RewardItem]) -> list[RewardResult]:
        """Every item's result, in order, `batch_size` items a forward pass."""
        size = self.settings.batch_size
        results: list[RewardResult] = []
        for start in range(0, len(items), size):
            results += self._batch(items[start : start + size])
        return results

    def text(self, item: RewardItem) -> str:
        """What the classifier reads for `item`: the question and the completion as a conversation."""
        question = str((item.task_data or {}).get("question", ""))
        if self.tokenizer.chat_template:
            chat = [{"role": "user", "content": question}, {"role": "assistant", "content": item.completion}]
            return str(self.tokenizer.apply_chat_template(chat, tokenize=False))
        return f"{question}\n\n{item.completion}" if question else item.completion

    def _batch(self, items: list[RewardItem]) -> list[RewardResult]:
        started = time.perf_counter()
        try:
            scores = self._forward([self.text(item) for item in items])
        except (RuntimeError, ValueError) as exc:  # out of memory, a tokenizer refusal: named, not a 0
            log.warning("reward model forward failed on %d items: %s", len(items), exc)
            took = time.perf_counter() - started
            detail = f"reward model forward failed: {exc}"[:2000]
            return [RewardResult(score=0.0, status="error", detail=detail, elapsed_s=took) for _ in items]
        took = (time.perf_counter() - started) / len(items)
        passing = self.settings.pass_score
        return [
            RewardResult(
                score=score,
                status="correct" if score >= passing else "incorrect",
                detail=f"reward model: {score:.4g}",
                elapsed_s=took,
            )
            for score in scores
        ]

    @torch.no_grad()
    def _forward(self, texts: list[str]) -> list[float]:
        with self._lock:
            batch = self.tokenizer(
                texts,
                padding=True,
                truncation=True,
                max_length=self.settings.max_length,
                return_tensors="pt",
                add_special_tokens=not self.tokenizer.chat_template,
            ).to(self.settings.device)
            logits = self.model(**batch).logits.float()
        if logits.shape[-1] == 2:
            return logits.softmax(dim=-1)[:, 1].tolist()
        column = logits[:, 0]
        return (column.sigmoid() if self.settings.score == "sigmoid" else column).tolist()
