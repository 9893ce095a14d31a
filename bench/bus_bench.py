"""Bus throughput: publish N trajectory groups, then read and ack them in batches; prints entries/s and MB/s.

    .venv/bin/python bench/bus_bench.py --count 5000 --payload-kb 64

Without --url it starts a private redis-server on a free loopback port (never the shared 6379).
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import time
import uuid

import redis

from sparkrl.services.common.bus import RedisBus
from sparkrl.services.common.settings import BusSettings


def start_private_redis() -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not on PATH; run `make test`, which installs it")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url, socket_timeout=1)
    for _ in range(500):
        try:
            client.ping()
            return proc, url
        except redis.ConnectionError:
            time.sleep(0.01)
    proc.terminate()
    raise SystemExit("private redis-server did not answer PING")


def run(url: str, count: int, payload_kb: int, batch: int) -> None:
    settings = BusSettings(url=url, namespace=f"bench-{uuid.uuid4().hex[:8]}", trajectory_maxlen=count + 1)
    payload = bytes(payload_kb * 1024)
    mb = count * payload_kb / 1024
    with RedisBus(settings) as bus:
        started = time.perf_counter()
        for i in range(count):
            bus.publish_group(f"g{i}", payload)
        publish_s = time.perf_counter() - started
        started, seen = time.perf_counter(), 0
        while seen < count:
            entries = bus.read("trajectories", "bench", count=batch, block_ms=100)
            bus.ack("trajectories", [e.entry_id for e in entries])
            seen += len(entries)
        consume_s = time.perf_counter() - started
    for name, seconds in (("publish", publish_s), ("read+ack", consume_s)):
        print(f"bus/{name}: {count / seconds:,.0f} entries/s, {mb / seconds:,.1f} MB/s ({seconds:.2f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="Redis URL; default: a private redis-server")
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--payload-kb", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32, help="entries per read")
    args = parser.parse_args()
    proc, url = (None, args.url) if args.url else start_private_redis()
    try:
        run(url, args.count, args.payload_kb, args.batch)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=5)


if __name__ == "__main__":
    main()
