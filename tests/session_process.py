"""One process of a 2-process island built only from the public API (run by test_session_multiprocess).

    python tests/session_process.py COORDINATOR NUM_PROCESSES PROCESS_ID CONNECT OUT.json

Run with XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu. The
process initialises `jax.distributed` as a user would, places the MLP's parameters
over the mesh of every process's devices (the first layer's weights cut across the
devices, the rest replicated), joins with its own shards, trains with a jitted optax
step on global batches, and writes what it saw to OUT.json.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    coordinator, count, index, connect, out = sys.argv[1:6]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, int(count), int(index))
    import mlp_helpers as mlp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import worker

    mesh = Mesh(np.asarray(jax.devices()), ("d",))
    cut, whole = NamedSharding(mesh, PartitionSpec("d")), NamedSharding(mesh, PartitionSpec())

    def place(path, leaf):
        host = np.asarray(leaf)
        sharding = cut if jax.tree_util.keystr(path) == "['layers'][0].w" else whole
        return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])

    init = jax.tree_util.tree_map_with_path(place, mlp.init_mlp(0))
    shardings = [leaf.sharding for leaf in jax.tree_util.tree_leaves(init)]
    rng = np.random.default_rng(7)  # the same global batches on every process
    with worker.join(
        connect, island="mp", params=init, inner_steps=5, heartbeat_interval_s=0.2
    ) as session:
        params = session.params
        same_layout = [leaf.sharding for leaf in jax.tree_util.tree_leaves(params)] == shardings
        opt_state = mlp.OPTIMIZER.init(params)
        folded = 0
        for _ in range(40):
            x, y = (
                jax.make_array_from_callback(a.shape, cut, lambda i, a=a: a[i])
                for a in mlp.batch(rng)
            )
            params, opt_state, _ = mlp.train_step(params, opt_state, x, y)
            new = session.step(params, tokens=mlp.BATCH)
            folded += new is not params
            params = new
            same_layout &= [
                leaf.sharding for leaf in jax.tree_util.tree_leaves(params)
            ] == shardings
        local = [
            np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
            for leaf in jax.tree_util.tree_leaves(params)
        ]
        global_tree = session.global_params()
        digest = hashlib.sha256(b"".join(a.tobytes() for a in local)).hexdigest()
        result = {
            "process": jax.process_index(),
            "version": session.version,
            "rounds": session.round,
            "folded": folded,
            "same_layout": same_layout,
            "local_digest": digest,
            "global_loss": mlp.heldout_loss(global_tree),
            "initial_loss": mlp.heldout_loss(mlp.init_mlp(0)),
            "has_client": session.client is not None,
            "exchange": type(session.exchange).__name__,
        }
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
