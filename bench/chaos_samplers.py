"""The chaos run's two pollers, each a thread: fragment versions, and daemon resources.

`VersionSampler` asks every shard for its status a few times a second and
keeps each fragment's version over time (None while its shard does not
answer): the material of `bench.analysis.step_uptime`, of the fixed-window
uptime and of a shard's recovery. `ResourceSampler` reads, every few seconds,
the resident memory of every shard and island process (their pid files: a
daemon killed and restarted is a new pid) and the sizes of each shard's
write-ahead log segments and checkpoints: the material of `bench.soak`.
Neither touches what it polls beyond reading it; both stop on `stop_event`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import zmq

from paramserver.plumbing import daemon, probe

VERSION_PERIOD_S = 0.25
RESOURCE_PERIOD_S = 5.0


class VersionSampler(threading.Thread):
    """Polls every shard's fragment versions; keeps (time, shard, versions or None) samples."""

    def __init__(self, routers: list[str]) -> None:
        """Args:
        routers: every shard's loopback ROUTER, in shard order.
        """
        super().__init__(name="version-sampler", daemon=True)
        self.routers = routers
        self.samples: list[tuple[float, int, dict[int, int] | None]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        """Sample until `stop_event` is set (each sample is timed at its request)."""
        ctx = zmq.Context()
        try:
            while not self.stop_event.is_set():
                for i, router in enumerate(self.routers):
                    asked = time.time()
                    try:
                        st = probe.shard_status(ctx, router, timeout_s=0.3)
                    except probe.ProbeError:
                        self.samples.append((asked, i, None))
                        continue
                    versions = {int(f): int(v) for f, v in st.get("versions", {}).items()}
                    self.samples.append((asked, i, versions))
                self.stop_event.wait(VERSION_PERIOD_S)
        finally:
            ctx.destroy(linger=0)

    def fragments(self) -> dict[int, list[tuple[float, int | None]]]:
        """Fragment -> (time, version) samples; None while its shard did not answer."""
        owned: dict[int, set[int]] = {}
        out: dict[int, list[tuple[float, int | None]]] = {}
        for t, shard, versions in list(self.samples):
            if versions is None:
                for f in owned.get(shard, ()):
                    out[f].append((t, None))
                continue
            owned.setdefault(shard, set()).update(versions)
            for f, v in versions.items():
                out.setdefault(f, []).append((t, v))
        return out

    def timeline(self) -> list[tuple[float, int]]:
        """(time, sum over shards of the latest known version sum), one point per answer."""
        last: dict[int, int] = {}
        out = []
        for t, shard, versions in list(self.samples):
            if versions is None:
                continue
            last[shard] = max(sum(versions.values()), last.get(shard, 0))
            out.append((t, sum(last.values())))
        return out

    def advances(self, shard: int) -> list[float]:
        """Times at which `shard`'s version sum was seen grown."""
        prev, out = None, []
        for t, s, versions in list(self.samples):
            if s != shard or versions is None:
                continue
            total = sum(versions.values())
            if prev is not None and total > prev:
                out.append(t)
            prev = total if prev is None else max(prev, total)
        return out


def dir_sizes(directory: Path) -> dict[str, float]:
    """Bytes and files of a shard's log segments and checkpoints (its layout:
    `paramserver.server.storage.shard_storage`; a file removed meanwhile is skipped).

    Args:
        directory: the shard's data directory.

    Returns:
        dict: wal_bytes, checkpoint_bytes, wal_segments, checkpoints.
    """
    out = {"wal_bytes": 0.0, "checkpoint_bytes": 0.0, "wal_segments": 0.0, "checkpoints": 0.0}
    for pattern, size_key, count_key in (
        ("wal-*.log", "wal_bytes", "wal_segments"),
        ("checkpoint-*.ckpt", "checkpoint_bytes", "checkpoints"),
    ):
        for path in directory.glob(pattern):
            with contextlib.suppress(OSError):
                out[size_key] += path.stat().st_size
                out[count_key] += 1
    return out


class ResourceSampler(threading.Thread):
    """Polls the RSS of every daemon and the sizes of every shard's log and checkpoints."""

    def __init__(
        self,
        daemons: Callable[[], dict[str, Path]],
        shard_dirs: dict[str, Path],
        period_s: float = RESOURCE_PERIOD_S,
    ) -> None:
        """Args:
        daemons: returns name -> data dir (holding its pid file) of each shard and island now.
        shard_dirs: shard name -> its data directory (log segments and checkpoints).
        period_s: seconds between two polls.
        """
        super().__init__(name="resource-sampler", daemon=True)
        self.daemons = daemons
        self.shard_dirs = shard_dirs
        self.period_s = period_s
        self.rss: dict[str, list[tuple[float, int, float]]] = {}
        self.dirs: dict[str, list[tuple[float, dict[str, float]]]] = {}
        self.stop_event = threading.Event()

    def poll(self) -> None:
        """One poll of every daemon and directory (a daemon that is down is skipped)."""
        now = time.time()
        for name, directory in self.daemons().items():
            pid = daemon.running_pid(daemon.pid_path(directory))
            if pid is None:
                continue
            with contextlib.suppress(psutil.Error):
                rss = psutil.Process(pid).memory_info().rss
                self.rss.setdefault(name, []).append((now, pid, float(rss)))
        for name, directory in self.shard_dirs.items():
            self.dirs.setdefault(name, []).append((now, dir_sizes(directory)))

    def run(self) -> None:
        """Poll until `stop_event` is set."""
        while not self.stop_event.is_set():
            self.poll()
            self.stop_event.wait(self.period_s)

    def latest_mb(self) -> dict[str, float]:
        """Each daemon's latest RSS in MB (for the progress line)."""
        return {n: round(s[-1][2] / 1e6, 1) for n, s in list(self.rss.items()) if s}

    def raw(self) -> dict[str, Any]:
        """The samples, JSON-ready."""
        return {"rss": self.rss, "dirs": self.dirs}
