"""Helper for test_train: train tiny on 1 and on 2 devices, print both loss trajectories.

Run as a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=2 (the flag must
be set before jax is imported). Prints one JSON line:
{"devices": n, "one": [loss, ...], "two": [loss, ...], "param_diff": max abs difference}.
"""

import json
import sys

import jax
import numpy as np

from worker import data, model, train


def trajectory(num_devices: int, steps: int) -> tuple[list[float], dict]:
    """Losses of `steps` steps of tiny on `num_devices` devices, same seed and global batch."""
    cfg = model.MODEL_CONFIGS["tiny"]
    inner = train.InnerConfig(batch_size=8, seq_len=32, warmup_steps=2)
    trainer = train.InnerTrainer(cfg, inner, model.init_params(cfg, 0), devices=num_devices)
    sampler = data.BatchSampler(data.default_corpus(), inner.batch_size, inner.seq_len, seed=0)
    losses = [trainer.step(sampler.next()) for _ in range(steps)]
    return losses, trainer.numpy_params()


def main() -> None:
    """Print the JSON comparison line."""
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    one, params_one = trajectory(1, steps)
    two, params_two = trajectory(2, steps)
    diffs = jax.tree_util.tree_map(lambda a, b: float(np.abs(a - b).max()), params_one, params_two)
    result = {
        "devices": len(jax.devices()),
        "one": one,
        "two": two,
        "param_diff": max(jax.tree_util.tree_leaves(diffs)),
    }
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
