"""Times of a shard's published updates, from a raw SUB socket that reads only their headers.

`UpdateWatcher` follows one shard's PUB (protocol: `paramserver.wire.protocol`,
docs/protocol.md section 5) in its own thread and records when each
(fragment, version) `update` first arrived, without decoding its payload,
so a harness can time a shard's steps from outside (`bench.scale_shard`).
"""

from __future__ import annotations

import threading
import time

import zmq

from bench.launcher import LaunchError
from paramserver.wire import protocol

WAIT_S = 1800.0  # bound on any one wait (a step of 1B parameters on 2 busy cores is slow)


class UpdateWatcher(threading.Thread):
    """A raw SUB on the shard's PUB: when each (fragment, version) update arrived (monotonic)."""

    def __init__(self, pub: str) -> None:
        """Args:
        pub: the shard's PUB endpoint.
        """
        super().__init__(name="update-watcher", daemon=True)
        self.pub = pub
        self.arrived: dict[tuple[int, int], float] = {}
        self.latest: dict[int, int] = {}
        self.cond = threading.Condition()
        self.heard = threading.Event()  # a first message arrived: the subscription is live
        self.stop_event = threading.Event()

    def run(self) -> None:
        """Receive until stopped; only the header frame is read."""
        ctx = zmq.Context()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self.pub)
        try:
            while not self.stop_event.is_set():
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart(copy=False)
                now = time.monotonic()
                header, _ = protocol.unpack(frames[:1], role=protocol.PUB)
                self.heard.set()
                if header["kind"] != "update":
                    continue
                with self.cond:
                    key = (int(header["fragment"]), int(header["version"]))
                    self.arrived.setdefault(key, now)
                    self.latest[key[0]] = max(self.latest.get(key[0], 0), key[1])
                    self.cond.notify_all()
        finally:
            sock.close(0)
            ctx.term()

    def version(self, fragment: int) -> int:
        """The newest version of `fragment` seen (0 before any update)."""
        with self.cond:
            return self.latest.get(fragment, 0)

    def wait_all(self, versions: dict[int, int], timeout_s: float = WAIT_S) -> float:
        """Wait until every fragment reached its version.

        Args:
            versions: fragment -> the version to wait for (or a newer one).
            timeout_s: bound on the wait.

        Returns:
            When the last of them arrived (monotonic seconds): for each fragment the
            first arrival of a version at least the one asked for, the latest of those.

        Raises:
            LaunchError: not within `timeout_s`.
        """
        with self.cond:
            done = self.cond.wait_for(
                lambda: all(self.latest.get(f, 0) >= v for f, v in versions.items()), timeout_s
            )
            if not done:
                raise LaunchError(f"no update to versions {versions} within {timeout_s:g}s")
            return max(
                min(t for (f2, v2), t in self.arrived.items() if f2 == f and v2 >= v)
                for f, v in versions.items()
            )
