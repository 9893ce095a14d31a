"""The `long` workload's model: a 3.3M-parameter Qwen2 with the tiny model's tokenizer, randomly initialised
(seeded), saved in Hugging Face format under `.cache/long-countdown`. Built once; nothing is downloaded.

It only has to cost what a real small model costs per token: its completions are fixed at 128 tokens
(EOS suppressed on both sides), so what it says does not matter to the benchmark.
"""

from __future__ import annotations

import json
from pathlib import Path

from sparkrl.services.common.tiny_model import build_model, build_tokenizer

SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
DIRNAME = "long-countdown"


def ensure_long_model(cache: Path, seed: int = 0) -> Path:
    """`cache/long-countdown`, built unless a build of this shape and seed is there."""
    out = cache / DIRNAME
    stamp = {"shape": SHAPE, "seed": seed}
    info = out / "build_info.json"
    if info.is_file() and json.loads(info.read_text()) == stamp:
        return out
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed, SHAPE)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out, safe_serialization=True)
    info.write_text(json.dumps(stamp))
    params = sum(p.numel() for p in model.parameters())
    print(f"[long-model] built {out}: {params / 1e6:.1f}M parameters", flush=True)
    return out


if __name__ == "__main__":
    print(ensure_long_model(Path(__file__).resolve().parents[1] / ".cache"))
