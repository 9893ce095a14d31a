"""A data-parallel learner (`learner.ranks` > 1) under torchrun: the command `sparkrl up` starts, and the
process its stop goes to.

torchrun's agent, signalled, stops its ranks and exits 1 whatever they did; so a stop goes to rank 0
instead: it finishes its step, orders the final checkpoint and the other ranks' exit, and the agent then
exits 0 with them. Linux only (`/proc`); elsewhere, or before rank 0 exists, the agent is signalled.
"""

from __future__ import annotations

from pathlib import Path


def torchrun_command(ranks: int, command: tuple[str, ...]) -> tuple[str, ...]:
    """`command` (python, `-m`, module, args…) as `ranks` processes on this machine: torchrun picks its
    rendezvous port itself (`--standalone`) and stops them all if one fails."""
    python, _, module, *args = command
    return (
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        "-m",
        module,
        *args,
    )


def is_torchrun(command: tuple[str, ...]) -> bool:
    return "torch.distributed.run" in command[:3]


def rank_zero(agent_pid: int) -> int | None:
    """The pid of the agent's child with RANK=0, or None (not started yet, gone, or no /proc)."""
    for child in _children(agent_pid):
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"RANK=0" in environ:
            return child
    return None


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []
