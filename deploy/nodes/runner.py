"""The smoke's hands: the document's chunks run on the test bed's nodes with the bed's values, each one's
output in its own log, a line per change of state on the console."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from netns import IFACE, Node, TestBed
from observe import SmokeFailed, Watch
from recipe import Recipe, script

LETTER_NODE = {"A": "node-a", "B": "node-b", "C": "node-c"}


def say(line: str) -> None:
    print(f"[nodes-smoke {time.strftime('%H:%M:%S')}] {line}", flush=True)


def tail(path: Path, lines: int = 25) -> str:
    if not path.is_file():
        return f"({path} is empty)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Smoke:
    """One smoke: the bed, the document's recipe, where its files go, the environment every node gets."""

    bed: TestBed
    recipe: Recipe
    root: Path
    work: Path  # runs/nodes-smoke: SHARED, SECRETS and the logs live here
    tuning: dict[str, str] = field(default_factory=dict)  # the smoke's own SPARKRL_* settings
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def shared(self) -> Path:
        return self.work / "shared"

    @property
    def secrets(self) -> Path:
        return self.work / "secrets"

    def node(self, letter: str) -> Node:
        return self.bed.node(LETTER_NODE[letter])

    def values(self, letter: str) -> dict[str, str]:
        """The first block's values on the bed, for the machine `letter`."""
        addresses = {name: self.node(name).address for name in LETTER_NODE}
        return addresses | {
            "THIS": addresses[letter],
            "IFACE": IFACE,
            "SHARED": str(self.shared),
            "SECRETS": str(self.secrets),
        }

    def env(self) -> dict[str, str]:
        """A new terminal's environment: nothing of the caller's but HOME, plus the smoke's settings."""
        return {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": os.environ.get("HOME", "/root"),
            "LANG": "C.UTF-8",
            # DeepSpeed's compiled op, built once per checkout (the Makefile's own setting).
            "TORCH_EXTENSIONS_DIR": str(self.root / ".cache" / "torch_extensions"),
            **self.tuning,
        }

    def log(self, label: str) -> Path:
        return self.work / "logs" / f"{label}.log"

    def start(
        self, part: str, where: str, says: str, on: str, label: str, hide: Sequence[Path] = ()
    ) -> subprocess.Popen[bytes]:
        """The document's chunk (subsection `part`, `# on where`, containing `says`) started on machine
        `on`, left running."""
        chunk = self.recipe.find(part, where, says)
        command = script(self.recipe, chunk, self.values(on), self.root)
        say(f"{LETTER_NODE[on]}: {chunk.lines[0].strip()[:90]} …  (log {self.log(label)})")
        proc = self.bed.popen(LETTER_NODE[on], command, self.log(label), self.env(), hide)
        self.procs.append(proc)
        return proc

    def run(
        self,
        part: str,
        where: str,
        says: str,
        on: str,
        label: str,
        hide: Sequence[Path] = (),
        timeout_s: float = 180.0,
    ) -> str:
        """The chunk run to its end on `on`; its output (SmokeFailed when it fails)."""
        proc = self.start(part, where, says, on, label, hide)
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise SmokeFailed(
                f"{label} did not end within {timeout_s:.0f}s:\n{tail(self.log(label))}"
            ) from None
        if code != 0:
            raise SmokeFailed(f"{label} exited {code}:\n{tail(self.log(label))}")
        return self.log(label).read_text(errors="replace")

    def own(self, on: str, command: str, label: str, timeout_s: float = 300.0) -> str:
        """A command of the smoke's own (not the document's) on machine `on`, to its end; its output."""
        full = f"set -e\ncd {self.root} && source .venv/bin/activate\n{command}"
        done = self.bed.run(LETTER_NODE[on], full, self.env(), timeout_s=timeout_s)
        self.log(label).parent.mkdir(parents=True, exist_ok=True)
        self.log(label).write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            raise SmokeFailed(f"{label} exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
        return done.stdout

    def watch(self, settings: Path, label: str, env_file: Path | None = None) -> Watch:
        """deploy/nodes/watch.py on node-a, read on a thread."""
        source = f"set -a; . {env_file}; set +a\n" if env_file else ""
        command = (
            f"cd {self.root} && source .venv/bin/activate\n{source}"
            f"exec python deploy/nodes/watch.py --settings {settings}"
        )
        proc = subprocess.Popen(
            ["ip", "netns", "exec", "node-a", "bash", "-c", command],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self.log(label + "-errors").open("ab"),
            env=self.env(),
            start_new_session=True,
        )
        self.procs.append(proc)
        watch = Watch(self.log(label))
        watch.follow(proc.stdout)
        return watch

    def end_nodes(self) -> None:
        """Every node's processes stopped (SIGTERM, then SIGKILL): what the document's Ctrl-C and `ray
        stop` do on each machine, by namespace instead of by name."""
        from netns import stop_nodes

        stop_nodes(self.bed.nodes)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                say(f"warning: pid {proc.pid} outlived its node's processes")
        self.procs.clear()


def alive(proc: subprocess.Popen[bytes], label: str, log: Path) -> None:
    """Raise when `proc` (a chunk that should still run) has ended."""
    if proc.poll() is not None:
        raise SmokeFailed(f"{label} ended (exit {proc.returncode}) while the smoke needed it:\n{tail(log)}")


if __name__ == "__main__":
    sys.exit("deploy/nodes/runner.py is a module of deploy/nodes/smoke.py")
