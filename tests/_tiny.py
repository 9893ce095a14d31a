"""The tiny countdown model, built once under the repo's `.cache/` and shared by every test and run.

Import the fixture into a test module (`from _tiny import tiny_model_dir`); pytest puts `tests/` on the
path. The first session builds it (about 20 s on 2 cores); later ones reuse it while the recipe holds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkrl.services.common.tiny_model import ensure_tiny_model

CACHE_DIR = Path(__file__).resolve().parents[1] / ".cache"


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return ensure_tiny_model(CACHE_DIR)


@pytest.fixture(scope="session")
def babbling_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model made to ramble: its weights noised, its output layer ×3 with the end-of-sequence
    row at 0, so every completion runs to max_new_tokens (measured: 64 of 64 at 96 tokens) — long batches
    for an engine that cannot hold EOS back (vLLM refuses min_new_tokens). Rewards are ~0 on it: train it
    with a loss that reaches A = 0 tokens (entropy_bonus) for versions that differ."""
    import shutil

    import torch

    from sparkrl.services.common.modeling import load_model, load_tokenizer

    out = tmp_path_factory.mktemp("babbling") / "model"
    shutil.copytree(tiny_model_dir, out)
    model = load_model(tiny_model_dir, "float32", "cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=generator))
        head = model.get_output_embeddings().weight
        head.mul_(3.0)
        head[load_tokenizer(tiny_model_dir).eos_token_id] = 0.0
    model.save_pretrained(out)
    return out
