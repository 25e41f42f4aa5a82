"""`diloco-server`: start, inspect and stop the sharded outer parameter server.

This module owns the command line only: parsing, loading settings (defaults
<- TOML --config <- DILOCO_SERVER_* environment <- flags), and turning every
error into one line on stderr with a non-zero exit (2: bad usage or
configuration; 3: a port to bind is taken, nothing was started; 1: the server
could not be started, reached or stopped otherwise).
The work is done by `supervisor` (local cluster), `serve` (one shard),
`probe` (status) and `daemon` (pid files, detach, stop).

    diloco-server start --shards 2 --port 5555 --data-dir runs/server [--detach]
    diloco-server start --cluster cluster.toml --shard 0 [--detach]
        (a bind host off loopback needs --curve-secret-key-file + --curve-allow-dir,
         or --insecure)
    diloco-server status --connect tcp://127.0.0.1:5555 [--json]
        [--curve-secret-key-file K.key_secret --curve-server-key-file server.key]
    diloco-server stop --data-dir runs/server
    diloco-server keys --out keys --islands a,b        # a cluster's CURVE keys + the lines to use
    diloco-server keys --out keys/ [--name server]     # one CURVE key pair (see README, Security)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from paramserver.plumbing import clusterfile, daemon, dir_kind
from paramserver.plumbing.daemon import DaemonError, PortInUse
from paramserver.plumbing.settings import (
    OneLineErrorParser,
    SettingsError,
    add_flags,
    load_settings,
)
from paramserver.plumbing.validate import endpoint_problem
from paramserver.server.config import ShardConfig

if TYPE_CHECKING:
    from paramserver.plumbing.curve import ClientKeys

PROG = "diloco-server"
ENV_PREFIX = "DILOCO_SERVER_"
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_PORT_IN_USE = 3  # a launcher that picked the port may pick another and start again
READY_TIMEOUT_S = 120.0


def _cluster_help() -> str:
    doc = clusterfile.__doc__ or ""
    return "cluster file format (--cluster):\n" + doc[doc.index("Format (TOML)::") + 15 :]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `diloco-server`.

    Returns:
        The parser (sub-commands start, status, stop).
    """
    parser = OneLineErrorParser(
        prog=PROG,
        description="Asynchronous, sharded outer parameter server (DiLoCo-style training).",
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(
        dest="command", metavar="{start,status,stop,keys}", parser_class=OneLineErrorParser
    )
    sub.required = True

    start = sub.add_parser(
        "start",
        help="start the shards (foreground, or --detach)",
        description=(
            "Start a local cluster of --shards processes (shard i: ROUTER port+2i, PUB port+2i+1), "
            "or one shard of a multi-host cluster (--cluster FILE --shard I). Settings: defaults "
            f"<- --config TOML <- {ENV_PREFIX}<FIELD> environment <- flags. Binding a host that is "
            "not loopback (--host, or a cluster file's binds) needs CURVE keys "
            "(--curve-secret-key-file, --curve-allow-dir; `diloco-server keys --islands` writes "
            "them) or --insecure (plain TCP: a trusted, firewalled network only)."
        ),
        epilog=_cluster_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    start.add_argument("--config", metavar="FILE", help="TOML settings file (ShardConfig fields)")
    start.add_argument(
        "--detach", action="store_true", help="run in the background; return once serving"
    )
    start.add_argument("--cluster", metavar="FILE", help="cluster file of a multi-host cluster")
    start.add_argument(
        "--shard", metavar="I", type=int, help="with --cluster: which shard this process runs"
    )
    start.add_argument(
        "--ready-timeout",
        metavar="S",
        type=float,
        default=READY_TIMEOUT_S,
        help=f"with --detach: seconds to wait until serving (default {READY_TIMEOUT_S:g})",
    )
    add_flags(start.add_argument_group("server settings"), ShardConfig)
    start.set_defaults(func=cmd_start)

    status = sub.add_parser(
        "status", help="show every shard's versions and counters", allow_abbrev=False
    )
    status.add_argument(
        "--connect", required=True, metavar="ENDPOINT", help="ROUTER of shard 0, tcp://HOST:PORT"
    )
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument(
        "--timeout", type=float, default=5.0, metavar="S", help="reply timeout per shard"
    )
    status.add_argument(
        "--curve-secret-key-file",
        metavar="FILE",
        default="",
        help="CURVE shards: a key pair they admit (NAME.key_secret of an allow-listed key, "
        "or the server's own server.key_secret)",
    )
    status.add_argument(
        "--curve-server-key-file",
        metavar="FILE",
        default="",
        help="CURVE shards: the server's public key (server.key)",
    )
    status.set_defaults(func=cmd_status)

    stop = sub.add_parser(
        "stop", help="SIGTERM the server of a data dir and wait for it", allow_abbrev=False
    )
    stop.add_argument("--data-dir", metavar="DIR", help="the server's data dir")
    stop.add_argument("--config", metavar="FILE", help="read data_dir from this TOML file")
    stop.add_argument(
        "--timeout", type=float, default=60.0, metavar="S", help="seconds to wait for the drain"
    )
    stop.set_defaults(func=cmd_stop)

    keys = sub.add_parser(
        "keys",
        help="create CURVE keys: a pair (NAME.key, NAME.key_secret), or a whole cluster's "
        "(--islands)",
        description=(
            "With --islands a,b: the keys of a whole cluster in one command: the server pair "
            "OUT/NAME.key(_secret) (kept if it exists), a pair per island in "
            "OUT/islands/ISLAND/ (with a copy of the server's .key: copy that directory to the "
            "island's host) and the allow dir OUT/allow/ (the islands' public keys); then it "
            "prints the diloco-server start, diloco-worker start and status lines that use them. "
            "Without --islands: one key pair for a shard (--name server) or an island. Give shards "
            "curve_secret_key_file=NAME.key_secret and curve_allow_dir=a directory holding the "
            "islands' NAME.key files; give islands their own NAME.key_secret and the server's .key. "
            "No key file is ever overwritten; secret files are mode 0600. "
            "A key NAME.key in the allow dir may act only as island NAME; to let it act as more "
            "ids, give shards curve_allow_map=a TOML file with one line per key, "
            'NAME = ["id-b", "id-c"]. Any other id is refused forbidden_island. '
            "diloco-server status speaks CURVE with --curve-secret-key-file (an allowed key, or "
            "the server's own pair) and --curve-server-key-file (the server's .key)."
        ),
        allow_abbrev=False,
    )
    keys.add_argument("--out", required=True, metavar="DIR", help="directory for the key files")
    keys.add_argument(
        "--name",
        default="server",
        metavar="NAME",
        help="file stem of the pair: NAME.key and NAME.key_secret (default server; with "
        "--islands: the server pair's)",
    )
    keys.add_argument(
        "--islands",
        metavar="A,B,...",
        help="also a key pair per island and the shards' allow dir, and print the lines to use",
    )
    keys.set_defaults(func=cmd_keys)

    shard = sub.add_parser("shard", allow_abbrev=False)  # internal: one shard of a local cluster
    shard.add_argument("--index", type=int, required=True, help="which shard of the cluster to run")
    shard.add_argument(
        "--settings-json", required=True, help="the ShardConfig fields as one JSON object"
    )
    shard.set_defaults(func=cmd_shard)
    return parser


def _child_argv(argv: Sequence[str]) -> list[str]:
    """This command again, without --detach (what a detached daemon runs)."""
    return [sys.executable, "-m", "paramserver.ops.cli", *[a for a in argv if a != "--detach"]]


def cmd_start(args: argparse.Namespace) -> int:
    """`start`: a local cluster, or one shard of a multi-host cluster.

    Args:
        args: the parsed command line.

    Returns:
        Exit code.
    """
    if args.cluster is not None or args.shard is not None:
        return _start_cluster_shard(args)
    from paramserver.ops import supervisor

    cfg = load_settings(ShardConfig, file=args.config, env_prefix=ENV_PREFIX, flags=args)
    data_dir = Path(cfg.data_dir)
    created = daemon.first_missing(data_dir)  # what a failed start removes again
    dir_kind.check(data_dir, dir_kind.SERVER)
    supervisor.check_not_running(data_dir)
    supervisor.check_binds(supervisor.local_binds(cfg))
    if not args.detach:
        return supervisor.run_local(cfg, created=created)
    _check_ready_timeout(args)
    pid, info = _detach(args, data_dir, created)
    router = info.get("endpoints", [["?"]])[0][0]
    print(
        f"{PROG}: {cfg.shards} shard(s) serving; islands connect to {router}; "
        f"pid {pid}; log {daemon.log_path(data_dir)}"
    )
    if "page" in info:
        print(f"{PROG}: cluster page {info['page']} (Prometheus metrics at {info['page']}metrics)"
              + _token_note(cfg))  # fmt: skip
    return 0


def _token_note(cfg: ShardConfig) -> str:
    """Off loopback the page asks for a token: where the log says it is; "" on loopback."""
    from paramserver.plumbing.exposure import is_loopback

    if is_loopback(cfg.metrics_bind_host):
        return ""
    return f"; off loopback it asks for a token (?token=...): see {daemon.log_path(cfg.data_dir)}"


def _detach(args: argparse.Namespace, directory: Path, created: Path | None) -> tuple[int, dict]:
    """Run this command again as a daemon of `directory`; wait until it serves.

    Raises:
        DaemonError: it did not start, with the reason from its log in one line.
    """
    from paramserver.ops import supervisor

    try:
        return daemon.detach(
            _child_argv(args.argv),
            daemon.log_path(directory),
            directory / supervisor.READY_FILE,
            timeout_s=args.ready_timeout,
            created=created,
        )
    except daemon.DaemonStartError as exc:
        if not exc.reason:
            raise
        said = (
            exc.reason if exc.reason.startswith("not started: ") else f"not started: {exc.reason}"
        )
        raise DaemonError(said) from None


def _check_ready_timeout(args: argparse.Namespace) -> None:
    if not args.ready_timeout > 0:
        raise SettingsError(f"--ready-timeout: bad value {args.ready_timeout!r}: expected > 0")


def _start_cluster_shard(args: argparse.Namespace) -> int:
    from paramserver.ops import serve, supervisor

    if args.cluster is None or args.shard is None:
        raise SettingsError("--cluster FILE and --shard I go together: give both")
    if args.config is not None:
        raise SettingsError(
            "--config cannot be combined with --cluster: put settings in the cluster file's "
            "[server] table"
        )
    cluster = clusterfile.load_cluster_file(args.cluster)
    count = len(cluster.shards)
    if not 0 <= args.shard < count:
        raise SettingsError(
            f"--shard: bad value {args.shard}: {args.cluster} lists {count} shard(s) (0..{count - 1})"
        )
    if "shards" in cluster.server or "shards" in vars(args):
        raise SettingsError(
            f"shards is implied by the [[shard]] tables of {args.cluster} ({count}); do not set it"
        )
    cfg = load_settings(
        ShardConfig,
        file=args.cluster,
        section="server",
        env_prefix=ENV_PREFIX,
        flags=args,
        overrides={"shards": count},
    )
    address = cluster.shards[args.shard]
    for key, bind in (("router_bind", address.router_bind), ("pub_bind", address.pub_bind)):
        refusal = cfg.plain_bind_refusal(bind)  # the host rule of ShardConfig, on the file's binds
        if refusal is not None:
            raise SettingsError(
                f"{args.cluster}:shard[{args.shard}] binds {bind} ({key}): {refusal}"
            )
    directory = serve.shard_dir(cfg, args.shard)
    created = daemon.first_missing(directory)  # what a failed start removes again
    dir_kind.check(cfg.data_dir, dir_kind.SERVER)
    supervisor.check_not_running(directory)
    supervisor.check_binds(
        [
            (f"shard {args.shard} ROUTER", address.router_bind),
            (f"shard {args.shard} PUB", address.pub_bind),
        ]
    )
    endpoints = [(s.router, s.pub) for s in cluster.shards]
    if not args.detach:
        return serve.serve_shard(
            cfg,
            args.shard,
            endpoints,
            address.router_bind,
            address.pub_bind,
            cfg.metrics_port,
            created=created,
        )
    _check_ready_timeout(args)
    pid, _ = _detach(args, directory, created)
    print(
        f"{PROG}: shard {args.shard} of {count} serving on {address.router}; pid {pid}; "
        f"log {daemon.log_path(directory)}"
    )
    if cfg.metrics_port:
        print(f"{PROG}: cluster page {supervisor.page_url(cfg)}")
    return 0


def cmd_shard(args: argparse.Namespace) -> int:
    """Internal `shard`: one shard of a local cluster, started by the supervisor.

    Args:
        args: the parsed command line.

    Returns:
        Exit code.
    """
    from paramserver.ops import serve

    try:
        cfg = ShardConfig(**json.loads(args.settings_json))
    except (ValueError, TypeError) as exc:
        raise SettingsError(f"--settings-json: {exc}") from None
    return serve.serve_shard(cfg, args.index)


def cmd_status(args: argparse.Namespace) -> int:
    """`status`: query every shard and print a table or JSON.

    Args:
        args: the parsed command line.

    Returns:
        Exit code.
    """
    from paramserver.plumbing import probe

    problem = endpoint_problem(args.connect, ("tcp://", "ipc://"))
    if problem is not None:
        raise SettingsError(
            f"--connect: bad value {args.connect!r}: {problem}; "
            "give the ROUTER of shard 0, like tcp://127.0.0.1:5555"
        )
    if not args.timeout > 0:
        raise SettingsError(f"--timeout: bad value {args.timeout!r}: expected > 0")
    try:
        result = probe.cluster_status(args.connect, args.timeout, _status_keys(args))
    except probe.ProbeError as exc:
        raise DaemonError(str(exc)) from None
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        from paramserver.plumbing.status_view import render_status

        render_status(result)
    return EXIT_FAILURE if any("error" in s for s in result["shards"]) else 0


def _status_keys(args: argparse.Namespace) -> ClientKeys | None:
    """The CURVE client keys of `status`, or None without the options."""
    from paramserver.plumbing.curve import ClientKeys, CurveError

    secret, server = args.curve_secret_key_file, args.curve_server_key_file
    if not secret and not server:
        return None
    if not secret or not server:
        raise SettingsError(
            "CURVE needs both --curve-secret-key-file and --curve-server-key-file (or neither)"
        )
    try:
        return ClientKeys.load(secret, server)
    except CurveError as exc:
        raise SettingsError(str(exc)) from None


def cmd_stop(args: argparse.Namespace) -> int:
    """`stop`: SIGTERM the server of a data dir and wait until it has drained.

    Args:
        args: the parsed command line.

    Returns:
        Exit code.
    """
    from paramserver.ops import supervisor

    data_dir = args.data_dir
    if data_dir is None:
        data_dir = load_settings(ShardConfig, file=args.config, env_prefix=ENV_PREFIX).data_dir
    if not args.timeout > 0:
        raise SettingsError(f"--timeout: bad value {args.timeout!r}: expected > 0")
    dir_kind.check(data_dir, dir_kind.SERVER)
    pids = supervisor.stop_server(data_dir, args.timeout)
    print(f"{PROG}: stopped pid {', '.join(map(str, pids))} ({data_dir}); it drained and exited")
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    """`keys`: write a new CURVE key pair, or with --islands a whole cluster's keys.

    Args:
        args: the parsed command line (`out`, `name`, `islands`).

    Returns:
        Exit code: 0, or 2 when a name is bad or a key file exists.
    """
    from paramserver.plumbing.curve import CurveError, write_keypair

    try:
        if args.islands is not None:
            return _cluster_keys(args)
        public, secret = write_keypair(args.out, args.name)
    except CurveError as exc:
        return _fail(str(exc), EXIT_USAGE)
    print(f"{PROG}: public key {public} (share it); secret key {secret} (mode 0600, keep private)")
    return 0


def _cluster_keys(args: argparse.Namespace) -> int:
    """`keys --islands`: write the key set, then print where it lies and the lines to use."""
    import socket

    from paramserver.plumbing.keyset import parse_islands, usage_lines, write_key_set

    keys = write_key_set(args.out, parse_islands(args.islands), args.name)
    connect = f"tcp://{socket.gethostname()}:{ShardConfig.port}"
    server_line, *island_lines, status_line = usage_lines(keys, connect)
    kept = "kept (it existed)" if keys.server_kept else "new"
    print(
        f"{PROG}: CURVE keys in {args.out} (secret files mode 0600, nothing overwritten)\n"
        f"  {keys.server_secret}: the shards' key pair, {kept}; keep it on the shard hosts\n"
        f"  {keys.allow_dir}/: the islands' public keys, the shards' allow dir"
    )
    for island, directory in keys.island_dirs.items():
        print(f"  {directory}/: {island}'s pair and the shards' key; copy it to {island}'s host")
    print("start the shards (on every interface; add --port, --data-dir, ... as usual):")
    print(f"  {server_line}")
    print(f"start each island ({connect}: this host, the default port; adjust if not):")
    print("\n".join(f"  {line}" for line in island_lines))
    print(f"and check the cluster:\n  {status_line}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `diloco-server`.

    Args:
        argv: arguments without the program name (default: sys.argv[1:]).

    Returns:
        Exit code.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    except SettingsError as exc:
        return _fail(str(exc), EXIT_USAGE)
    except PortInUse as exc:
        return _fail(str(exc), EXIT_PORT_IN_USE)
    except DaemonError as exc:
        return _fail(str(exc), EXIT_FAILURE)
    except OSError as exc:  # e.g. a data dir that cannot be created
        where = f": {exc.filename}" if exc.filename else ""
        return _fail(f"{exc.strerror or exc}{where}", EXIT_FAILURE)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)


def _fail(message: str, code: int) -> int:
    sys.stderr.write(f"{PROG}: {message.splitlines()[0] if message else 'failed'}\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
