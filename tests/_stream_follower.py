"""A test's copy of every group published on a run's trajectory stream, taken as it is added.

The learner acknowledges and deletes each entry once trained, so the test cannot read the stream after
the run: a thread follows it with plain XREAD (not a consumer group: the run's own reads are untouched),
blocking, so it is handed each entry as Redis adds it.
"""

from __future__ import annotations

import threading

import redis

from sparkrl.proto import TrajectoryGroup, decode_group
from sparkrl.services.common.settings import BusSettings

BLOCK_MS = 200


class StreamFollower(threading.Thread):
    """Collects (entry id, group) of every entry added to the trajectory stream after `start()`."""

    def __init__(self, bus: BusSettings) -> None:
        super().__init__(name="stream-follower", daemon=True)
        self.client = redis.Redis.from_url(bus.url, socket_timeout=5)
        self.key = f"{bus.namespace}:trajectories"  # RedisBus.stream_key("trajectories")
        self.groups: list[TrajectoryGroup] = []
        self.done = threading.Event()

    def run(self) -> None:
        last = "0-0"
        while not self.done.is_set():
            try:
                reply = self.client.xread({self.key: last}, block=BLOCK_MS, count=100)
            except redis.ConnectionError:  # the run's Redis is gone: nothing more will come
                return
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    last = entry_id.decode()
                    self.groups.append(decode_group(fields[b"payload"]))

    def stop(self) -> list[TrajectoryGroup]:
        self.done.set()
        self.join(5)
        self.client.close()
        return self.groups
