"""`diloco-worker export`: the cluster's global model written as an Orbax checkpoint.

    diloco-worker export --connect tcp://HOST:PORT --out DIR [--no-wait-merged] [--wait-s 60]

It reads the global model from the running shards (`worker.global_read.global_flat`:
by default after every acked delta is merged) and saves it with Orbax's
`StandardCheckpointer` at DIR (a new directory; an existing one is refused, never
overwritten). The checkpoint is a nested dict of float32 numpy arrays, nested by
the plan's "/"-joined leaf names: "layers/0/w" is ``tree["layers"]["0"]["w"]``
(sequence indexes become string keys). Plain Orbax restores it:

    orbax.checkpoint.StandardCheckpointer().restore(DIR)

The shards must be running: export reads their snapshots over the wire. For a
stopped cluster, start its server on its data dir first (`diloco-server start
--data-dir D`; the shards recover from their checkpoint and log), export, stop it.
Orbax (`pip install 'decoupled-diloco[orbax]'`) is imported only when a
checkpoint is read or written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

import codec

ORBAX_HINT = "pip install 'decoupled-diloco[orbax]'"


class ExportError(RuntimeError):
    """The checkpoint cannot be written (no Orbax, an existing --out, names that do not nest)."""


def _orbax() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        raise ExportError(f"orbax-checkpoint is not installed: {ORBAX_HINT}") from None
    return ocp


def nested(flat: dict[str, np.ndarray]) -> dict[str, Any]:
    """The flat {"a/b": array} mapping as nested dicts ({"a": {"b": array}}).

    Args:
        flat: plan names -> arrays.

    Returns:
        Nested dicts of the same arrays (no copy).

    Raises:
        ExportError: a name nests under another leaf or has an empty part.
    """
    try:
        return codec.unflatten(flat)
    except codec.CodecError as exc:
        raise ExportError(f"the model's leaf names do not nest into dicts: {exc}") from None


def save_orbax(tree: Any, out: str | Path) -> Path:
    """Save a pytree of arrays as an Orbax checkpoint (`StandardCheckpointer`) at `out`.

    Args:
        tree: the pytree (e.g. `nested(flat)`, or a user's params).
        out: a directory that must not exist yet (its parent is created).

    Returns:
        The checkpoint's absolute path.

    Raises:
        ExportError: Orbax is missing, or `out` exists.
    """
    path = Path(out).absolute()
    if path.exists():
        raise ExportError(f"{path} exists: give a new directory for the checkpoint")
    ocp = _orbax()
    path.parent.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, tree)
        checkpointer.wait_until_finished()
    return path


def add_parser(sub: Any) -> None:
    """Add the `export` subcommand to `diloco-worker`'s subparsers."""
    export = sub.add_parser(
        "export",
        help="write the cluster's global model as an Orbax checkpoint",
        description="Read the global model from the running shards (after every acked "
        "delta is merged) and save it as an Orbax checkpoint: a nested dict of float32 "
        "arrays by the '/'-joined leaf names. The shards must be running; for a stopped "
        "cluster start its server on its data dir first.",
    )
    export.add_argument(
        "--connect", required=True, help="ROUTER endpoint of any shard, e.g. tcp://HOST:5555"
    )
    export.add_argument("--out", required=True, help="a new directory for the checkpoint")
    export.add_argument(
        "--wait-s", type=float, default=60.0, help="seconds to wait for the merge (default 60)"
    )
    export.add_argument(
        "--no-wait-merged",
        action="store_true",
        help="read the shards' values now, without waiting for pending deltas",
    )
    export.add_argument("--curve-secret-key-file", default="", help="an island's CURVE secret key")
    export.add_argument("--curve-server-key-file", default="", help="the server's public key")
    export.add_argument("--island", default=None, help="the island id a CURVE key may act as")
    export.add_argument(
        "--insecure", action="store_true", help="allow plain TCP to a host that is not loopback"
    )
    export.add_argument("--json", action="store_true", help="print one JSON line")


def run(args: argparse.Namespace) -> int:
    """`diloco-worker export`: read, save, print one line; 1 with a one-line error."""
    from worker.global_read import GlobalModelError, global_flat

    try:
        model = global_flat(
            args.connect,
            wait_merged=not args.no_wait_merged,
            wait_s=args.wait_s,
            curve_secret_key_file=args.curve_secret_key_file,
            curve_server_key_file=args.curve_server_key_file,
            island=args.island,
            insecure=args.insecure,
        )
        path = save_orbax(nested(model.params), args.out)
    except (GlobalModelError, ExportError) as exc:
        print(f"diloco-worker export: {exc}", file=sys.stderr)
        return 1
    count = sum(int(v.size) for v in model.params.values())
    summary = {
        "out": str(path),
        "leaves": len(model.params),
        "parameters": count,
        "versions": {str(f): v for f, v in sorted(model.versions.items())},
        "version_sum": model.version,
    }
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        print(
            f"wrote {count:,} parameters in {len(model.params)} leaves at version sum "
            f"{model.version} over {len(model.versions)} fragments to {path} (Orbax)"
        )
    return 0
