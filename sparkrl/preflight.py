"""`sparkrl check` (and the first thing `sparkrl up` does): what would fail later, found before anything is
spawned, each as one line that names the setting and the fix.

Checked: the model directory and its tokenizer (sparkrl/model_check.py: the tokenizer files, a vocabulary that
fits the embedding, prompts rendered as `rollout.chat_template` / `chat_template_kwargs` / `system_prompt`
ask, `rollout.eos_tokens` known); the prompt file exists and has the fields; the prompts (rendered by the
workers' own `modeling.render_prompt`) and the longest completion fit the model's context; the rollout engine
imports in the interpreter that will run the workers (`rollout.python` for a separate vLLM environment), and
for vLLM what that environment holds (`vllm_check.py`: its version, CPU or GPU build, the model's
architecture, its head size on CPU); requested GPUs exist and the learner's do not overlap the workers'; the
sync backend is there (torch's NCCL, nccl4py in both environments, vLLM on both sides for its weight transfer)
with a GPU; the top-k fits the vocabulary. Cheap by design: config files and the tokenizer, never the weights
(vLLM's import, in the workers' interpreter, is the dearest part: ~10 s).
"""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from sparkrl import model_check, ports, reward_check
from sparkrl.services.common.prompt_limits import PromptBudgetError, context_of, resolve_max_prompt_tokens
from sparkrl.services.common.settings import SparkSettings

ENGINE_MODULES = {"torch": "torch", "vllm": "vllm"}
CONTEXT_SAMPLE = 2000  # prompts looked at for the longest (a file's first rows, or generated ones)
LONGEST = 20  # of those, the longest by characters are tokenized


@dataclass(frozen=True)
class Problem:
    setting: str
    message: str  # what is wrong and how to fix it

    def __str__(self) -> str:
        return f"{self.setting}: {self.message}"


def _model(cfg: SparkSettings) -> tuple[list[Problem], dict | None, object | None]:
    path = Path(cfg.model)
    if not (path / "config.json").is_file():
        where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
        fix = "point model at a Hugging Face model directory"
        if path.name == "tiny-countdown":
            fix = "build it first: sparkrl build-tiny-model --out " + str(path.parent)
        if path.name == "tiny-agent":
            fix = "build it first: sparkrl build-tiny-model --agent --out " + str(path.parent)
        what = (
            "has no config.json (not a Hugging Face model directory)" if path.is_dir() else "does not exist"
        )
        return [Problem("model", f"{path}{where} {what}: {fix}")], None, None
    config = json.loads((path / "config.json").read_text())
    found, tokenizer = model_check.load(path, cfg.rollout)
    return [Problem(*finding) for finding in found], config, tokenizer


def _prompt_texts(cfg: SparkSettings) -> tuple[list[Problem], list[str]]:
    from sparkrl.services.common.tasks.datasets import DatasetError, MalformedFile, iter_prompts

    p = cfg.prompts
    if p.task != "countdown" and p.path is None:
        fix = f"task {p.task} reads a file: set prompts.path (jsonl or parquet)"
        return [Problem("prompts.path", fix)], []
    if p.path is not None and not Path(p.path).is_file():
        where = "" if Path(p.path).is_absolute() else f" (relative to {Path.cwd()})"
        return [Problem("prompts.path", f"{p.path}{where} does not exist: point it at your prompt file")], []
    texts = []
    try:
        for index, prompt in enumerate(iter_prompts(p)):
            if index >= CONTEXT_SAMPLE:
                break
            texts.append(prompt.text or "\n".join(m.content for m in prompt.messages or []))
    except MalformedFile as exc:  # its message names the line and the fix
        return [Problem("prompts.path", str(exc))], []
    except DatasetError as exc:
        return [Problem("prompts.prompt_field / prompts.answer_field", f"{exc}: map the file's fields")], []
    return [], texts


def _tokens(tokenizer: object, text: str, cfg: SparkSettings) -> int:
    """The prompt's tokens as a worker renders it; the `tokenizers` library's tokenizer is loaded only
    where no chat template or system prompt is in force (`model_check.load`): the text alone."""
    if hasattr(tokenizer, "encode") and not hasattr(tokenizer, "apply_chat_template"):  # `tokenizers`
        return len(tokenizer.encode(text).ids)  # type: ignore[attr-defined]
    from sparkrl.services.common.modeling import render_prompt

    return len(render_prompt(tokenizer, text, cfg.rollout.prompt_format))  # type: ignore[arg-type]


def _context(cfg: SparkSettings, config: dict, tokenizer: object, texts: list[str]) -> list[Problem]:
    limit = context_of(config, getattr(cfg.rollout.engine, "max_model_len", None))
    explicit, new_tokens = cfg.rollout.max_prompt_tokens, cfg.rollout.sampling.max_new_tokens
    if limit and explicit is not None and new_tokens < limit:  # an answer budget too big is said below
        try:
            resolve_max_prompt_tokens(explicit, limit, new_tokens)
        except PromptBudgetError as exc:  # the workers would refuse to start
            return [Problem("rollout.max_prompt_tokens", str(exc))]
    if not limit or not texts:
        return []
    longest = max(_tokens(tokenizer, text, cfg) for text in sorted(texts, key=len)[-LONGEST:])
    if explicit is not None:  # longer ones are dropped or cut by the feeder and the workers
        longest = min(longest, explicit)
    need = longest + new_tokens
    if need <= limit:
        return []
    return [Problem("rollout.sampling.max_new_tokens", _context_fix(longest, new_tokens, limit))]


def _context_fix(longest: int, new_tokens: int, limit: int) -> str:
    """What to change when prompt + answer overflow the context: a smaller answer budget where the prompts
    fit with one, else a prompt budget (`rollout.max_prompt_tokens`) and what happens to longer prompts."""
    said = f"the longest prompt ({longest} tokens) + max_new_tokens ({new_tokens}) exceeds the model's "
    said += f"context ({limit})"
    if longest + 16 <= limit:  # the prompts fit beside a smaller answer budget
        return f"{said}: lower rollout.sampling.max_new_tokens to {limit - longest} or less"
    fixes = []
    if limit - new_tokens < 16:  # the answer budget alone fills the context
        new_tokens = limit // 4
        fixes.append(
            f"lower rollout.sampling.max_new_tokens (e.g. to {new_tokens}): alone it fills the context"
        )
    room = limit - new_tokens
    fixes.append(
        f"give prompts at most {room} tokens: rollout.max_prompt_tokens={room} with rollout.overlong=drop "
        f"(longer ones are dead-lettered, with their length) or rollout.overlong=truncate (their last {room} "
        "tokens are kept)"
    )
    if longest > limit:  # no answer budget makes such a prompt fit
        fixes.append("or use a model with a longer context")
    return f"{said}; " + "; ".join(fixes)


def _engine(cfg: SparkSettings, model_config: dict | None) -> tuple[list[Problem], bool | None]:
    """The engine's problems, and (vLLM) whether the workers' vLLM is its CPU build (None: unknown)."""
    kind = cfg.rollout.engine.kind
    if kind == "vllm":
        problems, cpu = _vllm(cfg, model_config)
        return problems + _vllm_lora(cfg), cpu
    return _torch_engine(cfg), None


def _vllm_lora(cfg: SparkSettings) -> list[Problem]:
    """vLLM serving adapters (`max_lora_rank`) takes only adapter versions: vLLM's reload in place does not
    reach the layers its LoRA wraps, so a whole version could not be loaded."""
    engine, lora = cfg.rollout.engine, cfg.learner.lora
    rank = getattr(engine, "max_lora_rank", None)
    if rank is None:
        return []
    if lora.r == 0 or lora.sync != "adapter":
        why = "learner.lora.r is 0" if lora.r == 0 else "learner.lora.sync is merged"
        what = f"is set but {why}: every version is a whole model, which vLLM cannot reload in place "
        return [Problem("rollout.engine.max_lora_rank", what + "while serving LoRA; unset max_lora_rank")]
    if lora.r > rank:
        return [Problem("rollout.engine.max_lora_rank", f"{rank} is below learner.lora.r={lora.r}: raise it")]
    return []


def _vllm(cfg: SparkSettings, model_config: dict | None) -> tuple[list[Problem], bool | None]:
    """vLLM in the workers' interpreter, probed there (sparkrl/vllm_check.py)."""
    from sparkrl import vllm_check

    python = cfg.rollout.python
    if python is None and importlib.util.find_spec("vllm") is None:  # not here: no probe needed
        fix = "install it in its own environment and set rollout.python: " + vllm_check.INSTALL_HINT
        return [Problem("rollout.engine.kind", f"vllm is not installed in {sys.executable}: {fix}")], None
    found = vllm_check.probe(python or sys.executable)
    return [Problem(*p) for p in vllm_check.problems(cfg, found, model_config)], found.cpu


def _torch_engine(cfg: SparkSettings) -> list[Problem]:
    kind = cfg.rollout.engine.kind
    if cfg.rollout.python is None:  # the workers run in this interpreter: look here, without importing
        if importlib.util.find_spec(ENGINE_MODULES[kind]) is not None:
            return []
        return [Problem("rollout.engine.kind", f"{kind} is not installed in {sys.executable}")]
    python = cfg.rollout.python
    probe = subprocess.run(
        [python, "-c", f"import {ENGINE_MODULES[kind]}"], capture_output=True, text=True, timeout=120
    )
    if probe.returncode == 0:
        return []
    last = (probe.stderr.strip().splitlines() or ["it failed"])[-1]
    fix = "set rollout.python to an interpreter with sparkrl's rollout extra"
    return [Problem("rollout.engine.kind", f"{kind} does not import in {python} ({last}): {fix}")]


def _devices(cfg: SparkSettings, vllm_on_cpu: bool | None) -> list[Problem]:
    problems = []
    engine = cfg.rollout.engine
    if engine.kind == "vllm":  # a GPU engine unless its vLLM is the CPU build (or it is asked to be)
        gpu_engine = engine.device == "cuda" or (engine.device == "auto" and vllm_on_cpu is False)
    else:
        gpu_engine = engine.device.startswith("cuda")
    wants_gpu = cfg.learner.device != "cpu" or gpu_engine or bool(cfg.learner.gpus or cfg.rollout.gpus)
    if not wants_gpu:
        return []
    overlap = sorted(set(cfg.learner.gpus) & set(cfg.rollout.gpus))
    if overlap:
        problems.append(Problem("rollout.gpus", f"shares GPUs {overlap} with learner.gpus: one each"))
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        who = "learner.device" if cfg.learner.device != "cpu" else "rollout.engine"
        problems.append(Problem(who, "asks for a GPU and this machine has none: use the CPU settings (demo)"))
        return problems
    for name, gpus in (("learner.gpus", cfg.learner.gpus), ("rollout.gpus", cfg.rollout.gpus)):
        missing = [g for g in gpus if g >= count]
        if missing:
            problems.append(Problem(name, f"GPUs {missing} do not exist (this machine has {count})"))
    have = len(cfg.learner.gpus) or count
    if cfg.learner.device != "cpu" and cfg.learner.ranks > have:
        problems.append(
            Problem(
                "learner.ranks",
                f"{cfg.learner.ranks} ranks need a GPU each and the learner has {have}: list them in "
                "learner.gpus, or lower learner.ranks",
            )
        )
    if cfg.learner.device != "cpu" and gpu_engine and not (cfg.learner.gpus and cfg.rollout.gpus):
        problems.append(
            Problem(
                "learner.gpus / rollout.gpus",
                "the learner and the workers all default to GPU 0: place them, e.g. learner.gpus=[0] "
                "rollout.gpus=[1]",
            )
        )
    return problems


def _sync(cfg: SparkSettings) -> list[Problem]:
    backend = cfg.sync.backend
    if backend == "gloo":
        return []
    import torch
    import torch.distributed as dist

    # What the backend's libraries need first: each is its own fix, found whatever the devices.
    problems = {"nccl4py": _nccl4py, "vllm_nccl": _vllm_transfer}.get(backend, lambda cfg: [])(cfg)
    if backend == "nccl" and not dist.is_nccl_available():
        problems.append(Problem("sync.backend", "nccl is not built into this torch (a CPU build): use gloo"))
    elif cfg.learner.device == "cpu":
        why = f"{backend} sends GPU tensors; the learner is on the CPU: use gloo"
        problems.append(Problem("sync.backend", why))
    elif backend != "nccl" and torch.cuda.device_count() == 0:
        why = f"{backend} needs a CUDA device and this machine has none: use gloo"
        problems.append(Problem("sync.backend", why))
    return problems


def _nccl4py(cfg: SparkSettings) -> list[Problem]:
    """nccl4py in the learner's interpreter (this one) and, when it differs, the workers'."""
    from importlib.metadata import PackageNotFoundError, version

    from sparkrl.services.common.weight_sync.nccl4py_group import INSTALL_HINT

    try:
        version("nccl4py")
    except PackageNotFoundError:
        return [Problem("sync.backend", f"nccl4py is not installed in {sys.executable}: {INSTALL_HINT}")]
    python = cfg.rollout.python
    if python is None:
        return []
    probe = subprocess.run([python, "-c", "import nccl.core"], capture_output=True, text=True, timeout=120)
    if probe.returncode == 0:
        return []
    last = (probe.stderr.strip().splitlines() or ["it failed"])[-1]
    return [
        Problem(
            "sync.backend", f"nccl4py does not import in rollout.python {python} ({last}): {INSTALL_HINT}"
        )
    ]


def _vllm_transfer(cfg: SparkSettings) -> list[Problem]:
    """vLLM's weight-transfer engine: vLLM workers, and vLLM importable by the learner (it sends)."""
    problems = []
    if cfg.rollout.engine.kind != "vllm":
        problems.append(
            Problem(
                "sync.backend", "vllm_nccl loads weights into vLLM: set rollout.engine.kind=vllm, or use nccl"
            )
        )
    if importlib.util.find_spec("vllm") is None:
        fix = "install vLLM ≥ 0.32 in the learner's environment too (it sends through vLLM), or use nccl"
        problems.append(
            Problem("sync.backend", f"vllm_nccl: vLLM is not installed in {sys.executable}: {fix}")
        )
    if cfg.learner.lora.r > 0 and cfg.learner.lora.sync == "adapter":  # it loads whole state dicts only
        fix = "use nccl (the workers merge the adapter), or learner.lora.sync=merged"
        problems.append(Problem("sync.backend", f"vllm_nccl does not carry LoRA adapter versions: {fix}"))
    return problems


def _this_machine_only(host: str) -> bool:
    """Whether clients on other machines cannot dial `host`: loopback, or "every interface" (a client is
    then told 127.0.0.1)."""
    if host in ("", "localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False  # a name: whether other nodes resolve it is theirs to say
    return address.is_loopback or address.is_unspecified


def unreachable(cfg: SparkSettings) -> list[Problem]:
    """What a worker actor Ray places on another node would fail to reach (`up --ray` joining a cluster):
    every address it dials is a setting, and each left on this machine's loopback is one warning."""
    said = []
    private = "url" not in cfg.bus.model_fields_set  # `up` starts its own Redis, on bus.host
    bus = ("bus.host", cfg.bus.host) if private else ("bus.url", urlsplit(cfg.bus.url).hostname or "")
    dialled = [
        (*bus, "Redis (the bus)"),
        ("reward.host", cfg.reward.host, "the reward service"),
        ("sync.host", cfg.sync.host, "the learner's weight broadcast and weight files (model, snapshots)"),
    ]
    for setting, host, what in dialled:
        if _this_machine_only(host):
            said.append(
                Problem(
                    setting,
                    f"{host or 'every interface'} is this machine alone: a worker on another node of the Ray "
                    f"cluster would fail to reach {what}; set it to an address of this machine the other "
                    "nodes reach (docs/deployment.md, Several nodes)",
                )
            )
    if not _this_machine_only(cfg.sync.host) and not cfg.ray.learner.resources:
        said.append(
            Problem(
                "ray.learner.resources",
                f"none: Ray may place the learner on any node, and it binds sync.host ({cfg.sync.host}) "
                "there; pin it to that address's node with a resource only that node offers (`ray start "
                "--resources '{\"learner\": 1}'`, ray.learner.resources={learner: 1})",
            )
        )
    return said


def warnings(cfg: SparkSettings, cluster: bool = False) -> list[Problem]:
    """What would run but likely not as meant: said before the start, nothing refused. `cluster`: `up
    --ray` joins a Ray cluster, whose other nodes must reach what the workers dial."""
    said = unreachable(cfg) if cluster else []
    if cfg.rollout.sampling.n == 1 and cfg.learner.advantage.level == "group":
        said.append(
            Problem(
                "rollout.sampling.n",
                "1 completion a prompt: every group's advantage is 0 (a reward minus its group's mean), so "
                "nothing is learned; sample n >= 2 (the paper: 8), or set learner.advantage.level=batch",
            )
        )
    p = cfg.prompts
    if p.path is not None and Path(p.path).is_file():
        from sparkrl.services.common.tasks.datasets import DatasetError, iter_prompts

        try:
            count = sum(1 for _ in zip(range(CONTEXT_SAMPLE), iter_prompts(p), strict=False))
        except DatasetError:
            count = CONTEXT_SAMPLE  # said by check()
        steps = -(-count * p.epochs // cfg.learner.prompts_per_step)
        if count < CONTEXT_SAMPLE and steps <= 2:
            said.append(
                Problem(
                    "prompts.epochs",
                    f"{count} prompts × {p.epochs} epoch(s) make {steps} step(s) of up to "
                    f"{cfg.learner.prompts_per_step} groups (learner.prompts_per_step), then the run ends: "
                    "`--epochs N` passes over the data N times, or lower learner.prompts_per_step",
                )
            )
    return said


def check(cfg: SparkSettings) -> list[Problem]:
    """Every problem found; empty: good to go."""
    problems, config, tokenizer = _model(cfg)
    found, texts = _prompt_texts(cfg)
    problems += found
    problems += [Problem(*problem) for problem in ports.problems(cfg)]
    if config is not None and tokenizer is not None:
        sample = texts[0] if texts else None
        findings = model_check.findings(Path(cfg.model), config, tokenizer, cfg.rollout, sample)
        problems += [Problem(*finding) for finding in findings]
        if not any(setting in model_check.RENDERING for setting, _ in findings):  # else nothing to count
            problems += _context(cfg, config, tokenizer, texts)
        vocab = config.get("vocab_size")
        if vocab and cfg.rollout.sampling.topk_logprobs > vocab:
            problems.append(
                Problem("rollout.sampling.topk_logprobs", f"exceeds the vocabulary ({vocab}): lower it")
            )
    engine_problems, vllm_on_cpu = _engine(cfg, config)
    problems += [Problem(*problem) for problem in reward_check.problems(cfg)]
    return problems + engine_problems + _devices(cfg, vllm_on_cpu) + _sync(cfg) + _environment(cfg)


def _environment(cfg: SparkSettings) -> list[Problem]:
    """The episodes' environment loads here, has its tools' schemas and the reward asked of it (where
    `sparkrl up` runs it: in the workers, or in the environment service it starts)."""
    from sparkrl.services.common.environments import check_environment

    agent = cfg.rollout.agent
    if agent.environment is None or (agent.url is not None and not cfg.env.enabled):
        return []  # none, or played by a service started elsewhere
    try:
        check_environment(agent.environment, agent.reward)
    except ValueError as exc:
        return [Problem("rollout.agent.environment", str(exc))]
    return []
