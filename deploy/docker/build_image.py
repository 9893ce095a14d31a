"""Build one of the Dockerfiles with this host's pip configuration, served to the build on loopback.

    python3 deploy/docker/build_image.py deploy/docker/Dockerfile.cpu --tag sparkrl-cpu \
        [--base sparkrl-base:bookworm] [--build-arg KEY=VALUE ...] [--no-host-pip] [--context .]

A host whose pip reads wheels from a local directory (`find-links = /opt/wheels`, a `file://` index) has
nothing a container can reach: this script serves each such directory over HTTP on 127.0.0.1 (a free port,
for the length of the build), builds with `--network host` so the build reaches it, and passes the
rewritten settings as the build arguments PIP_INDEX_URL / PIP_EXTRA_INDEX_URL / PIP_FIND_LINKS /
PIP_TRUSTED_HOST (the Dockerfiles declare them; none is kept in the image). Remote index URLs pass through
as they are. When a served directory holds the CPU torch wheel, TORCH_INDEX_URL is set empty: the build
takes torch from there instead of the public CPU index. Standard library only; never pulls an image
(`docker build --pull=false`, and the base must be local or public on a site that has a registry).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

PIP_KEYS = ("index-url", "extra-index-url", "find-links", "trusted-host")
# The served URLs are build arguments, and a build argument's value is part of every later layer's cache
# key: one fixed port keeps them equal from build to build (another is taken only when this one is busy).
DEFAULT_PORT = 38117


def host_pip_config() -> dict[str, list[str]]:
    """pip's own view of its configuration (files and PIP_* environment), as `pip config list` prints
    it: `global.find-links='/opt/wheels'`, `:env:.find-links='...'`; the environment wins, as in pip."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        out = ""
    found: dict[str, tuple[int, list[str]]] = {}
    for line in out.splitlines():
        name, sep, raw = line.partition("=")
        if not sep:
            continue
        scope, _, key = name.rpartition(".")
        if key not in PIP_KEYS:
            continue
        rank = {":env:": 3, "install": 2, "global": 1}.get(scope, 0)
        values = shlex.split(raw.strip().strip("'\""))
        if rank >= found.get(key, (-1, []))[0]:
            found[key] = (rank, values)
    for key in PIP_KEYS:  # a variable set after pip was configured (this process's own environment)
        env = os.environ.get("PIP_" + key.upper().replace("-", "_"))
        if env:
            found[key] = (4, env.split())
    return {key: values for key, (_, values) in found.items()}


def local_dir(location: str) -> Path | None:
    """The directory behind a local find-links / index location (a path or a file:// URL), else None."""
    parts = urlsplit(location)
    if parts.scheme in ("http", "https"):
        return None
    path = Path(unquote(parts.path) if parts.scheme == "file" else location)
    return path if path.is_dir() else None


@dataclass
class Served:
    """The directories served to the build, each under its own prefix of one HTTP root."""

    root: Path
    prefixes: dict[Path, str] = field(default_factory=dict)

    def url(self, base: str, path: Path, index: bool = False) -> str:
        """The URL of `path`. An index (`simple/`) is served with its parent: its pages may link to files
        beside it (`../../files/x.whl`)."""
        top = path.resolve().parent if index else path.resolve()
        if top not in self.prefixes:
            self.prefixes[top] = f"d{len(self.prefixes)}"
            (self.root / self.prefixes[top]).symlink_to(top, target_is_directory=True)
        return f"{base}/{self.prefixes[top]}/" + (f"{path.resolve().name}/" if index else "")


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """pip's requests are not news: nothing is logged."""


@contextlib.contextmanager
def serve(root: Path, port: int = DEFAULT_PORT) -> Iterator[str]:
    """HTTP on 127.0.0.1:`port` (a free one if it is taken), serving `root` (symlinks followed) until the
    block ends."""
    handler = functools.partial(_QuietHandler, directory=str(root))
    try:
        server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    except OSError:
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        warning = f"build_image: port {port} is taken: the layers after the pip settings will rebuild"
        print(warning, file=sys.stderr)
    thread = threading.Thread(target=server.serve_forever, name="pip-files", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def pip_build_args(config: dict[str, list[str]], served: Served, base: str) -> dict[str, str]:
    """The host's pip settings with every local directory replaced by its served URL."""

    def rewrite(location: str, index: bool) -> str:
        directory = local_dir(location)
        return location if directory is None else served.url(base, directory, index)

    args: dict[str, str] = {}
    for key in ("index-url", "extra-index-url", "find-links"):
        index = key != "find-links"
        values = [rewrite(v, index) for v in config.get(key, []) if local_dir(v) or urlsplit(v).scheme]
        if values:
            args["PIP_" + key.upper().replace("-", "_")] = " ".join(values)
    trusted = [*config.get("trusted-host", []), *(["127.0.0.1"] if served.prefixes else [])]
    if trusted:
        args["PIP_TRUSTED_HOST"] = " ".join(trusted)
    if any(any(p.glob("torch-*+cpu-*.whl")) for p in served.prefixes) or any(
        any(p.glob("*/torch-*+cpu-*.whl")) for p in served.prefixes
    ):
        args["TORCH_INDEX_URL"] = ""  # the CPU wheel is served: no need for (or access to) the public index
    return args


def docker_build(
    dockerfile: Path, tag: str, context: Path, build_args: dict[str, str], extra: list[str]
) -> int:
    command = ["docker", "build", "--network", "host", "--pull=false", "-f", str(dockerfile), "-t", tag]
    for key, value in build_args.items():
        command += ["--build-arg", f"{key}={value}"]
    command += [*extra, str(context)]
    shown = " ".join(shlex.quote(part) for part in command)
    print(f"build_image: {shown}", file=sys.stderr, flush=True)
    return subprocess.call(command)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dockerfile", type=Path)
    parser.add_argument("--tag", "-t", required=True)
    parser.add_argument("--base", help="BASE_IMAGE build argument (default: the Dockerfile's)")
    parser.add_argument("--context", type=Path, default=Path("."))
    parser.add_argument("--build-arg", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--no-host-pip", action="store_true", help="pass none of the host's pip settings")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="loopback port of the served files")
    parser.add_argument("docker_args", nargs="*", help="more `docker build` options, after --")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="sparkrl-pip-") as tmp, serve(Path(tmp), args.port) as base:
        served = Served(Path(tmp))
        build_args = {} if args.no_host_pip else pip_build_args(host_pip_config(), served, base)
        declared = set(re.findall(r"^\s*ARG\s+([A-Za-z_][A-Za-z0-9_]*)", args.dockerfile.read_text(), re.M))
        build_args = {k: v for k, v in build_args.items() if k in declared}  # e.g. no TORCH_INDEX_URL
        for name, url in ((p, served.prefixes[p]) for p in served.prefixes):
            print(f"build_image: serving {name} at {base}/{url}/", file=sys.stderr)
        if args.base:
            build_args["BASE_IMAGE"] = args.base
        for item in args.build_arg:
            key, sep, value = item.partition("=")
            if not sep:
                parser.error(f"--build-arg {item!r} is not KEY=VALUE")
            build_args[key] = value
        return docker_build(args.dockerfile, args.tag, args.context, build_args, args.docker_args)


if __name__ == "__main__":
    sys.exit(main())
