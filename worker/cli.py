"""`diloco-worker`: start, stop and inspect one island daemon; evaluate the global model.

    diloco-worker start --connect tcp://HOST:PORT --island NAME [--speed F]
                        [--model tiny|small|base] [--config FILE] [--detach --data-dir D]
                        [--compile-cache-dir DIR|off]  (default: D/jax-cache)
                        [--coordinator HOST:PORT --num-processes N --process-id I]
                        [--param-sharding replicated|fsdp] [--dry-run]
    diloco-worker stop --data-dir D
    diloco-worker status --data-dir D [--json]   (exit 3: the island does not run)
    diloco-worker eval --connect tcp://HOST:PORT [--wait-s 120] [--json]
                       [--model ... --seq-len ... --batch-size ... --eval-batches ...
                        --data ... --data-dtype ... --vocab-size ... --heldout-fraction ...
                        --data-shards ... --config FILE]
    diloco-worker export --connect tcp://HOST:PORT --out DIR  (an Orbax checkpoint; worker.export)

`eval` is the final evaluation of a run (docs/design.md, "Goodput, uptime and the final loss"):
once every island has stopped, it waits until no shard holds a pending delta,
reads the global parameters from the shards and evaluates them once on the
common held-out set; run it with the islands' model and data settings. On a
CURVE cluster give an island's keys (--curve-secret-key-file,
--curve-server-key-file) and its --island: the probe says hello as that id.
`start` and `eval` refuse a --connect that is not loopback without those keys
unless --insecure (plain TCP, a trusted network only), before connecting.

An island of several processes (worker.process_group; JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES and JAX_PROCESS_ID serve when the flags are not given): every
process runs `start` with its own --data-dir; process 0 alone talks to the shards.
`--dry-run` joins the process group, prints the mesh and the per-device batch, exits.

Settings: defaults <- TOML file (--config; keys at top level or under [worker])
<- environment (DILOCO_WORKER_<FIELD>) <- flags. Every IslandConfig field is a flag.
`stop` and `status` import no JAX.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from paramserver.client import ClientError
from paramserver.plumbing import daemon, dir_kind, settings
from worker import export as export_cli
from worker import island_files
from worker.config import IslandConfig

ENV_PREFIX = "DILOCO_WORKER_"
PROGRESS_S = 10.0  # a detached start says what it waits for this often
STARTUP_S = 180.0  # a detached island's imports and first compile, on top of its join timeout
# eval's held-out batches unless given: 8x the islands' periodic eval (4) for a steadier final
# figure, whose standard error over the batches eval reports
EVAL_BATCHES = 32
EXIT_NOT_RUNNING = 3  # `status` of an island that does not run (as LSB init scripts say it)
# the IslandConfig fields `eval` reads (model, held-out data, devices, a CURVE island's keys)
EVAL_SETTINGS = (
    "island",
    "data_dir",
    "model",
    "vocab_size",
    "data",
    "data_dtype",
    "data_shards",
    "heldout_fraction",
    "batch_size",
    "seq_len",
    "eval_batches",
    "devices",
    "curve_secret_key_file",
    "curve_server_key_file",
    "insecure",
    "log_level",
)


def _parser() -> argparse.ArgumentParser:
    parser = settings.OneLineErrorParser(
        prog="diloco-worker",
        description="Run one island: local AdamW rounds, deltas to the parameter server.",
    )
    sub = parser.add_subparsers(
        dest="command", required=True, parser_class=settings.OneLineErrorParser
    )
    start = sub.add_parser("start", help="start an island (foreground, or --detach)")
    start.add_argument("--config", help="TOML file with island settings ([worker] or top level)")
    start.add_argument(
        "--detach", action="store_true", help="run in the background; return once it has joined"
    )
    start.add_argument(
        "--dry-run",
        action="store_true",
        help="join the island's process group, print the mesh and the per-device batch, exit",
    )
    settings.add_flags(start, IslandConfig)
    stop = sub.add_parser("stop", help="SIGTERM the island of a data dir and wait for it")
    stop.add_argument("--data-dir", required=True, help="the island's data directory")
    stop.add_argument("--timeout", type=float, default=60.0, help="seconds to wait (default 60)")
    status = sub.add_parser(
        "status",
        help="show an island's progress (exit 3 when it does not run)",
        description="Show an island's last status and whether its process runs. Exit 0 "
        "while it runs, 3 when it does not: 'not running (stopped ... ago)' after a stop, "
        "'not running (last seen ... ago, was training)' when it ended without one "
        "(killed, crashed).",
    )
    status.add_argument("--data-dir", required=True, help="the island's data directory")
    status.add_argument(
        "--json", action="store_true", help="print the whole status file as JSON instead of a table"
    )
    evaluate = sub.add_parser(
        "eval",
        help="final eval loss: wait until merged, read the global model, evaluate it once",
        description="Wait until every shard has merged every acked delta, read the global "
        "parameters from the shards and evaluate them once on the common held-out set. "
        "Run it after the islands stopped, with their model and data settings (the other "
        "flags of `start` are accepted and ignored, so one flag list serves both). Unless "
        f"given, --eval-batches is {EVAL_BATCHES} here; the result carries its standard error "
        "over the batches (eval_loss_se) and the held-out set's identity (data_id); with an "
        "island's --data-dir it warns when that island trained on another held-out set.",
    )
    evaluate.add_argument(
        "--connect", required=True, help="ROUTER endpoint of any shard, e.g. tcp://HOST:5555"
    )
    evaluate.add_argument(
        "--wait-s",
        type=float,
        default=120.0,
        help="seconds to wait for pending deltas to be merged (default 120)",
    )
    evaluate.add_argument("--json", action="store_true", help="print one JSON line")
    evaluate.add_argument("--config", help="TOML file with island settings (model, data, ...)")
    others = tuple(k for k in settings.setting_keys(IslandConfig) if k not in EVAL_SETTINGS)
    group = evaluate.add_argument_group("model and data settings")
    group.add_argument(  # its own default here (EVAL_BATCHES), not the islands' periodic one
        "--eval-batches",
        dest="eval_batches",
        metavar="INT",
        default=argparse.SUPPRESS,
        help=f"held-out batches of the final eval (default {EVAL_BATCHES})",
    )
    settings.add_flags(  # the islands' other flags are accepted (one flag list) and ignored
        group, IslandConfig, exclude=("connect", "eval_batches"), hide=others
    )
    export_cli.add_parser(sub)
    return parser


def _load_config(args: argparse.Namespace) -> IslandConfig:
    section = None
    if args.config:
        data = settings.read_toml(args.config)
        section = "worker" if "worker" in data else None
    return settings.load_settings(
        IslandConfig, file=args.config, section=section, env_prefix=ENV_PREFIX, flags=args
    )


def _usable_data_dir(data_dir: Path) -> None:
    """Create `data_dir` if needed and check that files can be written in it.

    Raises:
        DaemonError: it cannot be created or written (one line naming it and why).
    """
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=data_dir, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise daemon.DaemonError(
            f"cannot use --data-dir {data_dir}: {exc.strerror or exc}"
            f"{f' ({exc.filename})' if exc.filename else ''}; give a writable directory"
        ) from None


def _start(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = _load_config(args)
    data_dir = Path(cfg.data_dir)
    created = daemon.first_missing(data_dir)  # what a failed start removes again
    dir_kind.check(data_dir, dir_kind.ISLAND)
    _usable_data_dir(data_dir)
    if args.detach:
        running = daemon.running_pid(daemon.pid_path(data_dir))
        if running:
            raise daemon.DaemonError(f"an island already runs in {data_dir} (pid {running})")
        child = [a for a in argv if a != "--detach"]
        log = daemon.log_path(data_dir)
        print(
            f"island {cfg.island}: starting in the background; it joins {cfg.connect} "
            f"(gives up after {cfg.join_timeout_s:g}s); log {log}",
            flush=True,
        )
        proc = daemon.spawn(
            [sys.executable, "-m", "worker.cli", *child], log, data_dir / "ready.json"
        )
        try:
            _wait_joined(proc, cfg, log, data_dir / "ready.json")
        except daemon.DaemonError:
            if proc.poll() is not None:  # a failed start leaves nothing it created
                daemon.remove_created(created)
            raise
        print(f"island {cfg.island} running (pid {proc.pid}), data dir {data_dir}")
        return 0
    return _run_foreground(cfg, dry_run=args.dry_run, created=created)


def _wait_joined(proc: subprocess.Popen, cfg: IslandConfig, log: Path, ready: Path) -> None:
    """Wait until a detached island has joined, saying every `PROGRESS_S` what it waits for.

    Raises:
        DaemonError: it exited first (with its error line), or did not join in time.
    """
    from paramserver.plumbing.peer_peek import silence_cause

    started = time.monotonic()
    deadline, said = started + cfg.join_timeout_s + STARTUP_S, started
    while True:
        try:
            if daemon.check_ready(proc, ready, log) is not None:
                return
        except daemon.DaemonStartError as exc:  # it exited: say why, in one line
            if not exc.reason:
                raise daemon.DaemonError(f"island {cfg.island} {exc}") from None
            reason = exc.reason.removeprefix("diloco-worker: ")  # its own one-line error
            raise daemon.DaemonError(f"island {cfg.island} not started: {reason}") from None
        now = time.monotonic()
        if now > deadline:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10.0)
            raise daemon.DaemonError(
                f"island {cfg.island} did not join within {now - started:.0f}s and was stopped; "
                f"see {log}"
            )
        if now - said >= PROGRESS_S:
            said = now
            why = silence_cause(cfg.connect) or "no answer yet (compiling or joining)"
            print(
                f"island {cfg.island}: waiting for {cfg.connect} ({now - started:.0f}s): {why}",
                flush=True,
            )
        time.sleep(0.1)


def _run_foreground(cfg: IslandConfig, dry_run: bool = False, created: Path | None = None) -> int:
    """Run the island in this process until SIGTERM / SIGINT (or `max_rounds`).

    A start that fails before the island trains leaves nothing it created
    (`created`: `daemon.first_missing` of its data dir, taken before anything was written).
    """
    from worker import cpu_dispatch, process_group  # no JAX yet: the group must start first

    spec = process_group.resolve_group(
        cfg.coordinator, cfg.num_processes, cfg.process_id, os.environ
    )
    if spec.multi and cfg.devices:
        raise ValueError(
            f"devices must be 0 (every device of every process) in an island of "
            f"{spec.num_processes} processes, got {cfg.devices}"
        )
    # before JAX's CPU client exists: a step's scratch stays in the calling thread's arena
    dispatch = cpu_dispatch.configure()
    if spec.multi:
        process_group.initialize(spec, process_group.liveness_timeout_s(cfg.heartbeat_interval_s))
    goodbye_s = max(10.0, process_group.liveness_timeout_s(cfg.heartbeat_interval_s))
    if dry_run:
        print(process_group.dry_run_text(cfg, spec), flush=True)
        process_group.leave(spec, 0, goodbye_s)
        daemon.remove_created(created)  # a dry run leaves nothing
        return 0
    from worker.island import Island  # imports JAX: only when an island really starts

    data_dir = Path(cfg.data_dir)
    try:
        stop = daemon.enter_foreground(data_dir, cfg.log_level)
    except BaseException:
        daemon.remove_created(created)
        raise
    logging.getLogger("worker.island").info("JAX dispatches CPU computations: %s", dispatch)
    ready = False

    def notify() -> None:
        nonlocal ready
        ready = True
        dir_kind.mark(data_dir, dir_kind.ISLAND)
        daemon.notify_ready({"island": cfg.island, "process": spec.process_id})

    try:
        if cfg.cpu >= 0 and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {cfg.cpu % os.cpu_count()})
        island = Island(cfg, group=spec)
        if not spec.leader:  # runs the same loop; only process 0 opens sockets to the shards
            notify()
        code = island.run(stop, on_ready=notify if spec.leader else None)
    finally:
        daemon.release_pid_file(daemon.pid_path(data_dir))
        if not ready:  # a failed start (or a stop while joining) leaves nothing it created
            daemon.remove_created(created)
    process_group.leave(spec, code, goodbye_s)  # the others exit here; process 0 waits for them
    return code


def _status(args: argparse.Namespace) -> int:
    """`status`: the island's status file, and whether its process runs.

    Returns:
        0 while the island runs; `EXIT_NOT_RUNNING` when it does not (stopped,
        or gone without stopping: killed, crashed).
    """
    data_dir = Path(args.data_dir)
    dir_kind.check(data_dir, dir_kind.ISLAND)
    pid = daemon.running_pid(daemon.pid_path(data_dir))
    status = island_files.read_status(data_dir)
    if status is None:
        raise daemon.DaemonError(
            f"no island status in {data_dir}: start one with diloco-worker start"
        )
    status["running"] = pid is not None
    code = 0 if pid is not None else EXIT_NOT_RUNNING
    if args.json:
        print(json.dumps(status, indent=2))
        return code
    print("\n".join(status_lines(status, time.time())))
    return code


def not_running_line(status: dict, now: float) -> str:
    """What `status` says of an island whose process is not running.

    Args:
        status: its last status file.
        now: wall-clock time.

    Returns:
        "not running (stopped 5 min ago)" after a clean stop, else "not running
        (last seen 12 s ago, was training)": it ended without stopping (killed, crashed).
    """
    updated = status.get("updated")
    age = f"{_age(now - updated)} ago" if isinstance(updated, int | float) else "at an unknown time"
    state = status.get("state", "unknown")
    if state == "stopped":
        return f"not running (stopped {age})"
    return f"not running (last seen {age}, was {state})"


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} days"


_STATUS_FIELDS = (
    "island",
    "running",
    "state",
    "round",
    "steps",
    "tokens",
    "loss",
    "eval_global",
    "version_lag",
    "shards_down",
    "pending",
    "bytes_sent",
    "bytes_received",
    "goodput",
)


def status_lines(status: dict, now: float) -> list[str]:
    """The human view of an island's status file (`diloco-worker status` without --json).

    Args:
        status: the status mapping (`worker.island_files.read_status`) plus "running".
        now: wall-clock time, for the age of the file.

    Returns:
        One "key: value" line per known field; the shards the island's client
        counts as down (and the deltas waiting for them) in the state line too,
        and for an island that does not run, "not running (...)" there.
    """
    view = dict(status)
    if status.get("running") is False:
        view["state"] = not_running_line(status, now)
    down = int(dict(status.get("client") or {}).get("shards_down", 0))
    view["shards_down"] = down
    if down and status.get("running") and status.get("state") == "training":
        view["state"] = (
            f"training without the server: {down} shard(s) down, "
            f"{status.get('pending', 0)} delta(s) wait to be sent again"
        )
    if isinstance(status.get("updated"), int | float):
        view["updated"] = f"{max(0.0, now - status['updated']):.0f} s ago"
    lines = []
    for key in (*_STATUS_FIELDS[:3], "updated", *_STATUS_FIELDS[3:]):
        if key in view:
            value = view[key]
            lines.append(
                f"{key:>15}: {value:.4f}" if isinstance(value, float) else f"{key:>15}: {value}"
            )
    if "processes" in status:
        procs, mesh = status["processes"], status["mesh"]
        coordinator = f" (coordinator {procs['coordinator']})" if procs["coordinator"] else ""
        lines.append(
            f"{'processes':>15}: process {procs['index']} of {procs['count']}{coordinator}"
        )
        lines.append(
            f"{'mesh':>15}: {mesh['devices']} device(s) on axis {mesh['axis']}, "
            f"{mesh['local_devices']} here ({mesh['platform']}), {mesh['param_sharding']}, "
            f"batch {mesh['global_batch']} = {mesh['per_device_batch']:g} per device"
        )
    return lines


def _eval_batches_given(args: argparse.Namespace) -> bool:
    """Whether --eval-batches came from a flag, the environment or the --config file."""
    if "eval_batches" in vars(args) or f"{ENV_PREFIX}EVAL_BATCHES" in os.environ:
        return True
    data = settings.read_toml(args.config) if args.config else {}
    return "eval_batches" in data.get("worker", data)


def _eval(args: argparse.Namespace) -> int:
    if not _eval_batches_given(args):
        args.eval_batches = str(EVAL_BATCHES)
    cfg = _load_config(args)
    if not args.wait_s >= 0:  # every check of the arguments before the JAX import below
        raise ValueError(f"wait_s must be >= 0, got {args.wait_s!r}")
    from worker import evaluate  # imports JAX: only for eval

    try:
        result = evaluate.evaluate_global(cfg, cfg.connect, args.wait_s)
    except evaluate.EvalError as exc:
        print(f"diloco-worker eval: {exc}", file=sys.stderr)
        return 1
    if "data_warning" in result:
        print(f"diloco-worker eval: warning: {result['data_warning']}", file=sys.stderr)
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    se = result["eval_loss_se"]
    line = (
        f"eval_loss {result['eval_loss']:.4f}"
        + (f" +- {se:.4f} (standard error over its batches)" if se is not None else "")
        + f" {result['unit']} (model {cfg.model}, "
        f"{cfg.eval_batches} x {cfg.batch_size} x {cfg.seq_len} held-out tokens) at "
        f"version sum {result['version_sum']} over {len(result['versions'])} fragments"
    )
    print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `diloco-worker`; returns the exit code (2 for bad settings)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    try:
        if args.command == "start":
            return _start(args, argv)
        if args.command == "stop":
            dir_kind.check(args.data_dir, dir_kind.ISLAND)
            pid = daemon.stop(args.data_dir, timeout_s=args.timeout)
            print(f"island stopped (pid {pid})")
            return 0
        if args.command == "eval":
            return _eval(args)
        if args.command == "export":
            return export_cli.run(args)
        return _status(args)
    except (settings.SettingsError, ValueError) as exc:
        print(f"diloco-worker: {exc}", file=sys.stderr)
        return 2
    except (daemon.DaemonError, ClientError) as exc:
        print(f"diloco-worker: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
