"""The preflight of a vLLM rollout engine: what the workers' environment holds, asked of it once.

`probe(python)` runs one short script in the workers' interpreter (`rollout.python`, or this one) that
imports vLLM and reports its distribution and version, whether it is the CPU build, the head sizes its
CPU attention supports and the model architectures its registry knows. `problems(cfg, found,
model_config)` turns that into lines naming the setting and the fix: no environment, a vLLM too old for
the weight-update session API, a build for the wrong device, an architecture it does not run, a head size
the CPU kernels lack, a block size they reject, sampling the engine refuses.

`python -m sparkrl.vllm_check` (what `make vllm-env` ends with) checks the environment it runs in.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkrl.services.common.settings import SparkSettings, VllmEngineSettings
from sparkrl.services.rollout.vllm_fit import cpu_update_problem

MIN_VERSION = (0, 32)  # the weight-update session API (start/update/finish_weight_update) on the worker
MARK = "SPARKRL_VLLM_PROBE "
PROBE = f"""
import importlib.metadata as md, json
import vllm
from vllm.platforms import current_platform
dist = (md.packages_distributions().get("vllm") or ["vllm"])[0]
cpu = current_platform.is_cpu()
sizes = None
if cpu:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    sizes = list(CPUAttentionBackend.get_supported_head_sizes())
try:  # the registry's names (`LlamaForCausalLM`, ...): what config.json's `architectures` must name
    from vllm.model_executor.models import ModelRegistry
    archs = sorted(ModelRegistry.get_supported_archs())
except Exception:  # a vLLM without it: the architecture is left to the workers' start
    archs = None
found = {{"dist": dist, "version": md.version(dist), "cpu": cpu, "head_sizes": sizes, "archs": archs}}
print({MARK!r} + json.dumps(found))
"""
INSTALL_HINT = (
    "`make vllm-env` builds .venv-vllm (vLLM's CPU build); configs/vllm-cpu.yaml points rollout.python at it"
)


@dataclass(frozen=True)
class Found:
    """What the probe saw in the workers' interpreter; `error` set when vLLM does not import there."""

    python: str
    dist: str | None = None
    version: str | None = None
    cpu: bool | None = None
    head_sizes: list[int] | None = None
    archs: list[str] | None = None  # the architectures vLLM's model registry supports (None: not asked)
    error: str | None = None


def probe(python: str) -> Found:
    """vLLM as `python` sees it (its import takes ~10 s)."""
    if not Path(python).exists():
        return Found(python, error=f"{python} does not exist")
    done = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=300)
    for line in done.stdout.splitlines():
        if line.startswith(MARK):
            return Found(python, **json.loads(line[len(MARK) :]))
    last = (done.stderr.strip().splitlines() or ["it printed nothing"])[-1]
    return Found(python, error=f"vLLM does not import in {python} ({last[-300:]})")


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def head_size(model_config: dict[str, Any]) -> int | None:
    """The attention head size a Hugging Face config implies (`head_dim`, else hidden / heads)."""
    if model_config.get("head_dim"):
        return int(model_config["head_dim"])
    hidden, heads = model_config.get("hidden_size"), model_config.get("num_attention_heads")
    return int(hidden // heads) if hidden and heads else None


def problems(cfg: SparkSettings, found: Found, model_config: dict[str, Any] | None) -> list[tuple[str, str]]:
    """(setting, what is wrong and the fix) for each thing that would stop a vLLM worker."""
    if found.error is not None:
        return [("rollout.python", f"{found.error}: {INSTALL_HINT}")]
    engine = cfg.rollout.engine
    assert isinstance(engine, VllmEngineSettings)
    out: list[tuple[str, str]] = []
    if _version(found.version or "0") < MIN_VERSION:
        want = ".".join(map(str, MIN_VERSION))
        why = (
            f"{found.dist} {found.version} in {found.python}: sparkrl needs vLLM ≥ {want} (its weight-update"
        )
        out.append(("rollout.python", f"{why} session API): {INSTALL_HINT}"))
    if engine.device == "cuda" and found.cpu:
        out.append(
            ("rollout.engine.device", f"cuda, but {found.python} holds vLLM's CPU build ({found.dist})")
        )
    if engine.device == "cpu" and not found.cpu:
        out.append(
            ("rollout.engine.device", f"cpu, but {found.python} holds a GPU build of vLLM: {INSTALL_HINT}")
        )
    out += _architecture_problems(found, model_config)
    if found.cpu:
        out += _cpu_problems(engine, found, model_config)
    sampling = cfg.rollout.sampling
    if sampling.topk_logprobs > engine.max_logprobs:
        out.append(
            ("rollout.sampling.topk_logprobs", f"exceeds rollout.engine.max_logprobs ({engine.max_logprobs})")
        )
    if sampling.top_p < 1.0:
        out.append(
            ("rollout.sampling.top_p", "vLLM's log-probs would be of the truncated distribution: use 1.0")
        )
    if sampling.min_new_tokens > 0:
        why = "vLLM's log-probs would carry its EOS mask: use 0, or the torch engine"
        out.append(("rollout.sampling.min_new_tokens", why))
    return out


def _architecture_problems(found: Found, model_config: dict[str, Any] | None) -> list[tuple[str, str]]:
    """config.json's architectures when the installed vLLM's registry knows none of them (vLLM takes the
    first it knows)."""
    wanted = (model_config or {}).get("architectures") or []
    if found.archs is None or not wanted or any(arch in found.archs for arch in wanted):
        return []
    why = f"architecture {', '.join(wanted)} is not in the model registry of {found.dist} {found.version}"
    return [("model", f"{why} ({found.python}): use rollout.engine.kind=torch, or a vLLM that lists it")]


def _cpu_problems(
    engine: VllmEngineSettings, found: Found, model_config: dict[str, Any] | None
) -> list[tuple[str, str]]:
    out = []
    moe = cpu_update_problem(model_config or {})
    if moe is not None:
        out.append(("model", moe))
    size = head_size(model_config or {})
    if size is not None and found.head_sizes and size not in found.head_sizes:
        why = f"head size {size} is not one vLLM's CPU attention runs ({found.head_sizes})"
        out.append(("model", f"{why}: use the torch engine for this model"))
    if engine.block_size is not None and engine.block_size % 32:
        out.append(
            ("rollout.engine.block_size", f"{engine.block_size}: vLLM's CPU build needs a multiple of 32")
        )
    return out


def main() -> int:
    """Checks this interpreter's vLLM: it imports (no torchvision clash) and is recent enough."""
    found = probe(sys.executable)
    if found.error is not None:
        print(f"error: {found.error}", file=sys.stderr)
        return 1
    if _version(found.version or "0") < MIN_VERSION:
        print(f"error: {found.dist} {found.version} is older than {MIN_VERSION}", file=sys.stderr)
        return 1
    build = "CPU build" if found.cpu else "GPU build"
    print(f"ok: {found.dist} {found.version} ({build}) imports in {sys.executable}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
