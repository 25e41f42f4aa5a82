"""Start a cluster from an Orbax checkpoint and save its final global model as one.

A pretrained model, as JAX users keep it: an Orbax checkpoint of a params
pytree (--init-checkpoint; without it this script first pretrains own_mlp.py's
MLP briefly on one machine and saves it, so that it runs on a fresh clone).
The script restores it with plain Orbax, starts a local 2-shard parameter
server (or uses --connect), joins it as an island with the restored params (the
first island of a fresh cluster initialises the global model with them), trains
a few rounds, then reads the final global model with `worker.global_model` and
saves it with plain Orbax (--save), where any JAX program restores it:

    orbax.checkpoint.StandardCheckpointer().restore(PATH)

    python examples/from_checkpoint.py [--init-checkpoint DIR] [--save DIR] [--steps 60]

Needs the orbax extra: pip install 'decoupled-diloco[orbax]'.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

try:
    import orbax.checkpoint as ocp
except ImportError:
    print("skipped: orbax-checkpoint is not installed: pip install 'decoupled-diloco[orbax]'")
    sys.exit(0)

import jax
import numpy as np
from local_server import cluster, example_parser, print_summary
from own_mlp import BATCH, OPTIMIZER, batch, heldout_loss, init_mlp, train_step

import worker

PRETRAIN_STEPS = 40


def save(params: Any, path: Path) -> Path:
    """Save a params pytree with plain Orbax at `path` (a new directory)."""
    path = path.absolute()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, params)
        checkpointer.wait_until_finished()
    return path


def restore(path: Path, like: Any) -> Any:
    """Restore a params pytree with plain Orbax, as `like`'s structure, dtypes and shardings."""
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like
    )
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(path.absolute(), target)


def pretrain(path: Path) -> Path:
    """A stand-in for a pretrained model: the MLP after a few local Adam steps, saved."""
    params, opt_state = init_mlp(0), OPTIMIZER.init(init_mlp(0))
    rng = np.random.default_rng(99)
    for _ in range(PRETRAIN_STEPS):
        params, opt_state, _loss = train_step(params, opt_state, *batch(rng))
    return save(params, path)


def main() -> None:
    parser = example_parser(__doc__, steps=60)
    parser.add_argument("--init-checkpoint", default="", help="an Orbax checkpoint of the MLP")
    parser.add_argument(
        "--save", default="", help="where to save the final model (default: OUT/global-checkpoint)"
    )
    args = parser.parse_args()
    like = init_mlp(0)  # the model's structure, dtypes and placement (values unused)
    with cluster(args) as (connect, out):
        init_path = Path(args.init_checkpoint) if args.init_checkpoint else None
        if init_path is None:
            init_path = pretrain(out / "init-checkpoint")
            print(f"pretrained {PRETRAIN_STEPS} steps, saved to {init_path}", flush=True)
        params = restore(init_path, like)
        restored_loss = heldout_loss(params)
        rng = np.random.default_rng(1)
        with worker.join(connect, island="a", params=params, inner_steps=args.inner_steps,
                         data_dir=out / "a") as session:  # fmt: skip
            params = session.params  # the restored model, now the cluster's global model
            opt_state = OPTIMIZER.init(params)
            for _ in range(args.steps):
                if session.stopping:
                    break
                params, opt_state, _loss = train_step(params, opt_state, *batch(rng))
                params = session.step(params, tokens=BATCH)
        final, version = worker.global_model(connect, like=like)
        final_loss = heldout_loss(final)
        saved = save(final, Path(args.save) if args.save else out / "global-checkpoint")
        kept = "" if args.save or args.out else " (in the temporary --out: give --save to keep it)"
        print(f"saved the global model (version {version}) to {saved}{kept}", flush=True)
    print_summary(
        {
            "restored_loss": restored_loss,
            "global_loss": final_loss,
            "global_version": version,
            "checkpoint": str(saved),
        },
        args.json,
        f"global model: held-out loss {restored_loss:.4f} restored -> {final_loss:.4f} "
        f"(version {version}), saved to {saved}",
    )


if __name__ == "__main__":
    main()
