"""The three-node test bed (deploy/nodes/): the document's commands as the smoke reads them, and the bed
itself — three network namespaces on a bridge, each reachable from the others on its own address and
nothing else, a partition that cuts one off and mends, and a teardown that leaves nothing behind (also
after an earlier bed was left half up). `make nodes-smoke` runs the whole stack on it."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "deploy" / "nodes"))

import netns  # noqa: E402
import recipe  # noqa: E402

# What deploy/nodes/plain.py and on_ray.py run: (subsection, `# on` where, a text of the chunk).
USED = [
    ("", "A", "install -d"),
    ("Plain", "A and B", "build-tiny-model"),
    ("Plain", "A", "config show"),
    ("Plain", "A", "torchrun"),
    ("Plain", "B", "torchrun"),
    ("Plain", "C", "sparkrl rollout"),
    ("Plain", "any", "sparkrl stop"),
    ("Ray", "A", "ray start --head"),
    ("Ray", "B and C", "ray start"),
    ("Ray", "A", "sparkrl up --ray"),
    ("Ray", "any", "sparkrl stop"),
]


def test_the_smoke_finds_every_command_it_runs_in_the_deployment_doc() -> None:
    doc = recipe.read(ROOT / "docs" / "deployment.md")
    for part, where, says in USED:
        chunk = doc.find(part, where, says)
        assert chunk.machines, (part, where)
    values = {name: f"<{name}>" for name in recipe.VALUES}
    ray_node = recipe.script(doc, doc.find("Ray", "B and C", "ray start"), values, ROOT)
    # The test bed's values first, then what every Ray terminal typed (the token), then the command.
    assert (
        ray_node.index("THIS='<THIS>'") < ray_node.index("RAY_AUTH_TOKEN_PATH") < ray_node.index("ray start")
    )
    assert "10.0.0.1" not in ray_node  # the document's example values are replaced, never run
    assert "ray stop" not in ray_node  # `# on each machine, once the run is over` opens nothing
    with pytest.raises(recipe.RecipeError, match="no `# on B` block with 'sparkrl learner'"):
        doc.find("Plain", "B", "sparkrl learner")


def test_a_checkout_under_tmp_is_refused_naming_the_fix() -> None:
    with pytest.raises(netns.BedError, match=r"under /tmp .* clone it elsewhere"):
        netns.outside_tmp(Path("/tmp/clone"))
    netns.outside_tmp(Path("/work/clone"))  # elsewhere: fine


def test_a_values_block_that_names_another_variable_is_refused(tmp_path: Path) -> None:
    text = (ROOT / "docs" / "deployment.md").read_text().replace("IFACE=eth0", "NIC=eth0", 1)
    (tmp_path / "d.md").write_text(text)
    with pytest.raises(recipe.RecipeError, match="in place of exactly A, B, C, THIS, IFACE"):
        recipe.read(tmp_path / "d.md")


def _on(node: str, code: str, timeout_s: float = 20) -> subprocess.CompletedProcess[str]:
    """Python code run on a node of the bed (its network, hostname and /tmp)."""
    command = f"{sys.executable} -c {shlex.quote(code)}"
    return subprocess.run(
        netns.node_argv(netns.TestBed().node(node), command),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


SERVER = "import socket, time; s = socket.create_server(('198.18.0.3', 7000)); time.sleep(60)"
CONNECT = """
import socket, time
deadline = time.monotonic() + {timeout}
while True:  # refused: the server on the other node may not listen yet
    try:
        socket.create_connection(("{host}", {port}), timeout=deadline - time.monotonic())
        print("connected")
        break
    except ConnectionRefusedError:
        time.sleep(0.1)
    except OSError as exc:
        print(type(exc).__name__, exc.errno)
        break
"""


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="network namespaces need root")
def test_three_nodes_reach_each_other_only_and_a_cut_one_is_cut_off() -> None:
    netns.remove_leftovers()
    subprocess.run(["ip", "netns", "add", "node-b"], check=True)  # an earlier bed, left half up
    with netns.TestBed() as bed:
        assert {"node-a", "node-b", "node-c"} <= netns.namespaces()
        server = subprocess.Popen(
            netns.node_argv(
                bed.node("node-c"),
                f"{sys.executable} -c {shlex.quote(SERVER)}",
            )
        )
        try:
            hello = _on("node-a", "import socket; print(socket.gethostname())")
            assert hello.stdout.strip() == "node-a", hello.stderr
            reach = CONNECT.format(host="198.18.0.3", port=7000, timeout=3)
            assert _on("node-a", reach).stdout.strip() == "connected"
            out = CONNECT.format(host="192.0.2.1", port=7000, timeout=3)  # TEST-NET-1: outside the bed
            assert _on("node-b", out).stdout.strip() == "OSError 101", "a node must have no route out"
            bed.cut("node-c")
            assert _on("node-a", reach).stdout.strip().startswith("TimeoutError")  # the cable is out
            bed.mend("node-c")
            assert _on("node-a", reach).stdout.strip() == "connected"
        finally:
            server.kill()
            server.wait()
    assert not {"node-a", "node-b", "node-c"} & netns.namespaces()
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True).stdout
    assert "spk-" not in links and not netns.STATE.exists()
