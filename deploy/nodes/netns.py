"""Three hosts on one machine: network namespaces on a bridge, the test bed of `make nodes-smoke`.

`node-a`, `node-b` and `node-c` are network namespaces, each with one interface, `eth0` (a veth whose other
end is a port of the bridge `spk-br0` in the root namespace), an address from 198.18.0.0/24 (the range
reserved for network tests, RFC 2544), loopback up, and no route out: the bridge has no address and
nothing forwards, so traffic stays between the three. A command runs "on" a node through `ip netns exec`,
in a mount and UTS namespace of its own: its hostname is the node's, its /tmp is the node's own (Ray keeps
its sockets and session there, as on separate machines), and paths can be hidden from it (the model
directory on a node that should fetch it over HTTP). Everything else of the file system is shared, as
shared storage is on a cluster.

Built with `TestBed()` as a context manager: a previous run's leftovers are removed first, and everything
is torn down on the way out, also on an exception, Ctrl-C, SIGTERM or SIGHUP (and at exit). One test bed
at a time on a machine: an exclusive lock (/run/lock/sparkrl-nodes.lock) guards the fixed names.

    sudo python deploy/nodes/netns.py up      # the bed, left up (`down` removes it)
    sudo python deploy/nodes/netns.py exec node-b -- ip -br addr
    sudo python deploy/nodes/netns.py down
"""

from __future__ import annotations

import argparse
import atexit
import fcntl
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO

BRIDGE = "spk-br0"
PREFIX = 24
IFACE = "eth0"  # every node's interface, as on machines of one kind (GLOO_SOCKET_IFNAME names it)
LOCK_PATH = Path("/run/lock/sparkrl-nodes.lock")
STATE = Path("/tmp/sparkrl-nodes")  # each node's own /tmp, on the host
STOP_GRACE_S = 5.0


@dataclass(frozen=True)
class Node:
    """One host: its namespace (and hostname), its address and the veth's end on the bridge."""

    name: str
    address: str
    port: str  # the veth's end in the root namespace, a port of the bridge: a partition sets it down

    @property
    def tmp(self) -> Path:
        return STATE / self.name / "tmp"


NODES = (
    Node("node-a", "198.18.0.1", "spk-a"),
    Node("node-b", "198.18.0.2", "spk-b"),
    Node("node-c", "198.18.0.3", "spk-c"),
)


class BedError(RuntimeError):
    """The test bed could not be built or used; the message names the fix."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise BedError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def namespaces() -> set[str]:
    return {line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()}


def pids(node: Node) -> list[int]:
    """Every process whose network is this node's (Ray's daemons included, however they detached)."""
    done = ip("netns", "pids", node.name, check=False)
    return [int(pid) for pid in done.stdout.split()] if done.returncode == 0 else []


def signal_node(node: Node, sig: int) -> list[int]:
    """Send `sig` to every process of the node; the pids it went to."""
    sent = []
    for pid in pids(node):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue
        sent.append(pid)
    return sent


def stop_nodes(nodes: Sequence[Node], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to every process of the nodes, SIGKILL to what is left after `grace_s`."""
    if not [pid for node in nodes for pid in signal_node(node, signal.SIGTERM)]:
        return
    for sig in (signal.SIGKILL, None):
        deadline = time.monotonic() + grace_s
        while any(pids(node) for node in nodes) and time.monotonic() < deadline:
            time.sleep(0.2)
        if sig is not None:
            for node in nodes:
                signal_node(node, sig)


def remove_leftovers(nodes: Sequence[Node] = NODES) -> list[str]:
    """What an earlier bed left (processes, namespaces, links), removed; what was found, in words."""
    found = []
    present = [node for node in nodes if node.name in namespaces()]
    stop_nodes(present, grace_s=1.0)
    for node in present:
        ip("netns", "del", node.name, check=False)
        found.append(f"namespace {node.name}")
    for link in (BRIDGE, *(node.port for node in nodes)):
        if ip("link", "show", link, check=False).returncode == 0:
            ip("link", "del", link, check=False)  # a veth goes with its peer
            found.append(f"link {link}")
    shutil.rmtree(STATE, ignore_errors=True)
    return found


def _create(nodes: Sequence[Node]) -> None:
    # The bridge's frames skip iptables (br_netfilter is on here, and a FORWARD policy DROP, Docker's,
    # would cut the nodes off from each other): a per-bridge switch, the machine's settings untouched.
    ip("link", "add", BRIDGE, "type", "bridge", "nf_call_iptables", "0", "nf_call_ip6tables", "0")
    ip("link", "set", BRIDGE, "up")
    for node in nodes:
        ip("netns", "add", node.name)
        inside = f"{node.port}-ns"
        ip("link", "add", node.port, "type", "veth", "peer", "name", inside)
        ip("link", "set", inside, "netns", node.name)
        ip("-n", node.name, "link", "set", inside, "name", IFACE)
        ip("-n", node.name, "addr", "add", f"{node.address}/{PREFIX}", "dev", IFACE)
        ip("-n", node.name, "link", "set", IFACE, "up")
        ip("-n", node.name, "link", "set", "lo", "up")
        ip("link", "set", node.port, "master", BRIDGE, "up")
        node.tmp.mkdir(parents=True, exist_ok=True)
        node.tmp.chmod(0o1777)


def node_argv(node: Node, command: str, hide: Sequence[Path] = ()) -> list[str]:
    """`command` (a bash script) run on `node`: its network, its hostname, its own /tmp, `hide`'s paths
    empty (a tmpfs over each: that node does not have them)."""
    mounts = [f"mount --bind {shlex.quote(str(node.tmp))} /tmp"]
    mounts += [f"mount -t tmpfs -o size=1m,mode=0755 hidden {shlex.quote(str(path))}" for path in hide]
    prologue = f"hostname {node.name} && " + " && ".join(mounts)
    return [
        *("ip", "netns", "exec", node.name),
        *("unshare", "--mount", "--uts", "--propagation", "private", "--"),
        *("bash", "-c", f"{prologue} && exec bash -c {shlex.quote(command)}"),
    ]


def outside_tmp(checkout: Path) -> None:
    """Every node has its own /tmp: a checkout (and its .venv) under the host's /tmp is not there."""
    if checkout.is_relative_to("/tmp"):
        raise BedError(
            f"the checkout is under /tmp ({checkout}), and every node has a /tmp of its own, so the nodes "
            "cannot see it: clone it elsewhere (e.g. under your home directory)"
        )


class TestBed:
    """The three nodes, up while the context lasts; torn down on any way out."""

    def __init__(self, nodes: Sequence[Node] = NODES, keep: bool = False) -> None:
        self.nodes = tuple(nodes)
        self.keep = keep  # leave it up (the CLI's `up`)
        self._lock: IO[str] | None = None
        self._handlers: dict[int, object] = {}

    def node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name or node.name == f"node-{name.lower()}":
                return node
        raise BedError(f"no node {name!r}: the bed has {', '.join(n.name for n in self.nodes)}")

    def __enter__(self) -> TestBed:
        if os.geteuid() != 0:
            raise BedError("the test bed makes network namespaces: run it as root (sudo)")
        if shutil.which("ip") is None or shutil.which("unshare") is None:
            raise BedError("the test bed needs `ip` (iproute2) and `unshare` (util-linux): install them")
        outside_tmp(Path(__file__).resolve().parents[2])
        self._take_lock()
        if not self.keep:
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._handlers[sig] = signal.signal(sig, _raise_exit)
            atexit.register(self.down)
        found = remove_leftovers(self.nodes)
        if found:
            print(f"test bed: removed an earlier bed's leftovers ({', '.join(found)})", flush=True)
        try:
            _create(self.nodes)
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self.keep:
            self.down()

    def down(self) -> None:
        """Every process of every node stopped, namespaces and links removed; safe to call again."""
        if self._lock is None:
            return
        remove_leftovers(self.nodes)
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._handlers.clear()
        self._lock.close()
        self._lock = None

    def _take_lock(self) -> None:
        LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
        lock = LOCK_PATH.open("a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            raise BedError(f"another test bed is up ({holder}): wait for it, or `netns.py down`") from None
        lock.truncate(0)
        lock.write(f"pid {os.getpid()}: {' '.join(sys.argv)}\n")
        lock.flush()
        self._lock = lock

    def cut(self, name: str) -> None:
        """A partition: the node's cable pulled at the switch (its bridge port down); processes untouched."""
        ip("link", "set", self.node(name).port, "down")

    def mend(self, name: str) -> None:
        ip("link", "set", self.node(name).port, "up")

    def popen(
        self, name: str, command: str, log: Path, env: dict[str, str], hide: Sequence[Path] = ()
    ) -> subprocess.Popen[bytes]:
        """Start `command` on a node, its output appended to `log`."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            return subprocess.Popen(
                node_argv(self.node(name), command, hide),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # a Ctrl-C at the terminal reaches the smoke, which tears down
            )

    def run(
        self,
        name: str,
        command: str,
        env: dict[str, str],
        hide: Sequence[Path] = (),
        timeout_s: float = 120.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run `command` on a node to its end; its output returned."""
        return subprocess.run(
            node_argv(self.node(name), command, hide),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
            check=False,
        )


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    # SIGTERM and SIGHUP unwind like Ctrl-C does, so every `finally` (the teardown) runs.
    raise SystemExit(128 + signum)


def main() -> None:
    parser = argparse.ArgumentParser(description="The three-node test bed (network namespaces).")
    parser.add_argument("action", choices=("up", "down", "exec"))
    parser.add_argument("node", nargs="?")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.action == "down":
        found = remove_leftovers()
        print(f"removed: {', '.join(found) or 'nothing was up'}")
        return
    if args.action == "up":
        TestBed(keep=True).__enter__()
        for node in NODES:
            print(f"{node.name}: {node.address}/{PREFIX} on {IFACE} (bridge port {node.port})")
        return
    if args.node is None:
        raise SystemExit("exec needs a node: netns.py exec node-b -- COMMAND")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    node = next((n for n in NODES if n.name == args.node), None)
    if node is None:
        raise SystemExit(f"no node {args.node!r}: {', '.join(n.name for n in NODES)}")
    os.execvp("ip", node_argv(node, shlex.join(command)))


if __name__ == "__main__":
    main()
