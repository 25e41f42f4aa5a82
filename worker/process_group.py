"""Islands that span processes (and hosts): the process group, its start and its liveness.

An island may run on JAX's multi-controller runtime: N processes, each with its
own devices, call `jax.distributed.initialize` and see one mesh of every
device. Process 0 alone talks to the parameter server; `worker.leader_sync` keeps
the other processes' parameters identical to its own through JAX collectives.

Who belongs to the group comes from the island's settings (`coordinator`,
`num_processes`, `process_id`), else from JAX's own variables
(JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); settings win.

Liveness: every process runs a `Watchdog` thread that bumps its own heartbeat
counter in the coordination service's key-value store every interval and reads
the others'. A process whose counter has not moved for the liveness timeout
(heartbeat_interval_s x ClientConfig.liveness, the same rule the client applies
to shards), or a coordination service that no longer answers (process 0 is
gone), ends the process with one line naming the missing process. JAX's own
failure propagation would abort the process without a word, so the group runs
with `jax_enable_recoverability` and this watchdog decides instead.

Nothing here names a device type.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping

from paramserver.client import ClientConfig

logger = logging.getLogger(__name__)

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
HEARTBEAT_KEY = "diloco/heartbeat/"
EXIT_PROCESS_GONE = 3  # exit status of a process that stops because another one is gone


class GroupError(ValueError):
    """The process-group settings are inconsistent; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """Who the island's processes are: a coordinator, how many, and which one this is."""

    coordinator: str = ""
    num_processes: int = 1
    process_id: int = 0

    @property
    def multi(self) -> bool:
        """Whether the island spans more than one process."""
        return self.num_processes > 1

    @property
    def leader(self) -> bool:
        """Whether this process talks to the parameter server (process 0)."""
        return self.process_id == 0


def resolve_group(
    coordinator: str, num_processes: int, process_id: int, environ: Mapping[str, str]
) -> GroupSpec:
    """The island's process group from its settings, falling back to JAX's variables.

    Args:
        coordinator: HOST:PORT of process 0's coordination service; "" = from the env.
        num_processes: processes in the island; 0 = from the env (1 when unset).
        process_id: this process's index; -1 = from the env (0 when unset).
        environ: the environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID).

    Returns:
        The resolved GroupSpec.

    Raises:
        GroupError: a value is malformed, the id is out of range, or a multi-process
            group has no coordinator.
    """

    def env_int(name: str, default: int) -> int:
        raw = environ.get(name, "").strip()
        if not raw:
            return default
        try:
            return int(raw)
        except ValueError:
            raise GroupError(f"{name} must be an integer, got {raw!r}") from None

    coord = coordinator or environ.get(ENV_COORDINATOR, "").strip()
    count = num_processes if num_processes > 0 else env_int(ENV_NUM_PROCESSES, 1)
    index = process_id if process_id >= 0 else env_int(ENV_PROCESS_ID, 0)
    if count < 1:
        raise GroupError(f"num_processes must be >= 1, got {count}")
    if not 0 <= index < count:
        raise GroupError(
            f"process_id must be in [0, {count - 1}] for {count} processes, got {index}"
        )
    if count > 1 and (not coord or ":" not in coord):
        raise GroupError(
            f"an island of {count} processes needs --coordinator HOST:PORT (process 0's "
            f"address, the same on every process) or {ENV_COORDINATOR}"
        )
    return GroupSpec(coord, count, index)


def liveness_timeout_s(heartbeat_interval_s: float) -> float:
    """Seconds of silence after which a process of the island counts as gone.

    Args:
        heartbeat_interval_s: the island's heartbeat period.

    Returns:
        heartbeat_interval_s x ClientConfig.liveness (the client's rule for shards).
    """
    return heartbeat_interval_s * ClientConfig.liveness


def initialize(spec: GroupSpec, liveness_s: float) -> None:
    """Join this process to the island's JAX process group (call before any JAX work).

    Args:
        spec: the resolved group (multi-process only).
        liveness_s: heartbeat timeout given to JAX's coordination service.
    """
    import jax

    # CPU islands reduce across processes with gloo; GPU and TPU use their own collectives.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # A dead process must not abort the others silently: the Watchdog decides and says why.
    jax.config.update("jax_enable_recoverability", True)
    jax.distributed.initialize(
        coordinator_address=spec.coordinator,
        num_processes=spec.num_processes,
        process_id=spec.process_id,
        heartbeat_timeout_seconds=max(1, math.ceil(liveness_s)),
        initialization_timeout=max(60, math.ceil(10 * liveness_s)),
    )
    logger.info(
        "process %d of %d joined the island's group at %s: %d device(s) here, %d in all",
        spec.process_id,
        spec.num_processes,
        spec.coordinator,
        jax.local_device_count(),
        jax.device_count(),
    )


def silent_processes(now: float, last_change: Mapping[int, float], liveness_s: float) -> list[int]:
    """Processes whose heartbeat counter has not moved for longer than the liveness timeout.

    Args:
        now: current monotonic time.
        last_change: process id -> monotonic time its counter last changed (or the
            watchdog started, for one not heard yet).
        liveness_s: the liveness timeout in seconds.

    Returns:
        The silent process ids, sorted.
    """
    return sorted(p for p, t in last_change.items() if now - t > liveness_s)


def gone_line(island: str, missing: list[int], num_processes: int, liveness_s: float) -> str:
    """The one line a process prints when another process of its island is gone.

    Args:
        island: the island id.
        missing: the missing process ids (non-empty).
        num_processes: processes in the island.
        liveness_s: the liveness timeout.

    Returns:
        The line (no newline).
    """
    names = ", ".join(
        f"process {p}" + (" (the coordinator, which talks to the shards)" if p == 0 else "")
        for p in missing
    )
    return (
        f"island {island}: {names} of {num_processes} is gone (no heartbeat for "
        f"{liveness_s:g} s); stopping this process. Restart every process of the island"
    )


class Watchdog(threading.Thread):
    """Heartbeats through the coordination service; ends the process when a peer is gone."""

    def __init__(
        self,
        island: str,
        spec: GroupSpec,
        liveness_s: float,
        interval_s: float,
        on_gone: Callable[[str], None] | None = None,
    ) -> None:
        """Set up (not start) the watchdog.

        Args:
            island: island id, for the line.
            spec: the group.
            liveness_s: silence after which a peer is gone.
            interval_s: heartbeat and check period.
            on_gone: called with the line before the process exits (process 0 uses
                it to say bye to the shards and keep its unacked deltas).
        """
        super().__init__(name="island-watchdog", daemon=True)
        self.island, self.spec = island, spec
        self.liveness_s, self.interval_s = liveness_s, interval_s
        self.on_gone = on_gone
        self.stopped = threading.Event()
        self.fired = threading.Event()

    def _client(self):  # JAX's coordination-service client (the runtime's own KV store)
        from jax._src import distributed

        return distributed.global_state.client

    def run(self) -> None:  # noqa: D102 (threading.Thread)
        client = self._client()
        me = self.spec.process_id
        peers = [p for p in range(self.spec.num_processes) if p != me]
        start = time.monotonic()
        last_value: dict[int, str | None] = dict.fromkeys(peers)
        last_change = dict.fromkeys(peers, start)
        beat, last_ok = 0, start
        while not self.stopped.wait(self.interval_s if beat else 0):
            beat += 1
            try:
                client.key_value_set(f"{HEARTBEAT_KEY}{me}", str(beat), allow_overwrite=True)
                now = last_ok = time.monotonic()
                beats = self._read_beats(client)
                for p in peers:
                    value = beats.get(p)
                    if value is not None and value != last_value[p]:
                        last_value[p], last_change[p] = value, now
            except Exception as exc:  # the coordination service (process 0) does not answer
                logger.warning("island %s: heartbeat failed: %s", self.island, exc)
                if me != 0 and time.monotonic() - last_ok > self.liveness_s:
                    self._fire([0])
                    return
                continue
            missing = silent_processes(time.monotonic(), last_change, self.liveness_s)
            if missing:
                self._fire(missing)
                return

    @staticmethod
    def _read_beats(client) -> dict[int, str]:
        """Process -> its last heartbeat value (a process not heard yet has none).

        One directory read: a missing key is absence, not an error to tell apart.
        """
        beats = {}
        for key, value in client.key_value_dir_get(HEARTBEAT_KEY):
            process = str(key).rsplit("/", 1)[-1]
            if process.isdigit():
                beats[int(process)] = str(value)
        return beats

    def _fire(self, missing: list[int]) -> None:
        line = gone_line(self.island, missing, self.spec.num_processes, self.liveness_s)
        self.fired.set()
        logger.error("%s", line)
        print(f"diloco-worker: {line}", file=sys.stderr, flush=True)
        try:
            if self.on_gone is not None:
                self.on_gone(line)
        finally:
            logging.shutdown()
            os._exit(EXIT_PROCESS_GONE)

    def stop(self) -> None:
        """Stop heartbeating (a clean end of the island)."""
        self.stopped.set()


def mesh_info(
    spec: GroupSpec, devices: list, batch_size: int, param_sharding: str
) -> dict[str, dict]:
    """What the island's processes and mesh are (status, `--dry-run`).

    Args:
        spec: the group.
        devices: the mesh's devices (every process's, in mesh order).
        batch_size: the global batch.
        param_sharding: "replicated" or "fsdp".

    Returns:
        {"processes": {count, index, coordinator}, "mesh": {axis, devices, local_devices,
        platform, param_sharding, global_batch, per_device_batch}}.
    """
    local = sum(1 for d in devices if getattr(d, "process_index", 0) == spec.process_id)
    return {
        "processes": {
            "count": spec.num_processes,
            "index": spec.process_id,
            "coordinator": spec.coordinator,
        },
        "mesh": {
            "axis": "data",
            "devices": len(devices),
            "local_devices": local,
            "platform": devices[0].platform if devices else "",
            "param_sharding": param_sharding,
            "global_batch": batch_size,
            "per_device_batch": batch_size / len(devices) if devices else 0,
        },
    }


def dry_run_text(cfg, spec: GroupSpec) -> str:
    """What `diloco-worker start --dry-run` prints: the group, the mesh, the batch split.

    Args:
        cfg: the island's settings (`IslandConfig`).
        spec: the group (already initialised when multi-process).

    Returns:
        A line for people, then the same as JSON.
    """
    import json

    import jax

    devices = jax.devices()
    if cfg.devices and not spec.multi:
        devices = devices[: cfg.devices]
    info = mesh_info(spec, devices, cfg.batch_size, cfg.param_sharding)
    mesh = info["mesh"]
    split = (
        f"{mesh['per_device_batch']:g} per device"
        if cfg.batch_size % len(devices) == 0
        else f"NOT divisible by {len(devices)} devices: change --batch-size"
    )
    line = (
        f"island {cfg.island}: process {spec.process_id} of {spec.num_processes}, mesh "
        f"{mesh['axis']}={mesh['devices']} ({mesh['local_devices']} here, {mesh['platform']}), "
        f"{cfg.param_sharding} parameters, global batch {cfg.batch_size} = {split}"
    )
    return line + "\n" + json.dumps(info, sort_keys=True)


BYE_KEY = "diloco/bye/"


def leave(spec: GroupSpec, code: int, timeout_s: float) -> None:
    """End this process's part in the group without tripping JAX's shutdown.

    Process 0 hosts the coordination service: if it exits first, another
    process's own shutdown call fails and JAX aborts it. So every other process
    leaves a note and ends at once (no shutdown call), and process 0 waits, up
    to `timeout_s`, for every note before it exits.

    Args:
        spec: the group (nothing happens for one process).
        code: the exit status of a process other than 0.
        timeout_s: how long process 0 waits for the others' notes.
    """
    if not spec.multi:
        return
    from jax._src import distributed

    client = distributed.global_state.client
    if not spec.leader:
        try:
            client.key_value_set(f"{BYE_KEY}{spec.process_id}", str(code))
        finally:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + timeout_s
    waiting = set(range(1, spec.num_processes))
    while waiting and time.monotonic() < deadline:
        for p in sorted(waiting):
            try:
                client.key_value_try_get(f"{BYE_KEY}{p}")
                waiting.discard(p)
            except Exception:  # not there yet
                pass
        if waiting:
            time.sleep(0.05)
    if waiting:
        logger.warning("processes %s did not say bye within %.1f s", sorted(waiting), timeout_s)
