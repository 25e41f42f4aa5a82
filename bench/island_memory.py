"""Bytes of parameters + AdamW state per device of an island, replicated against fsdp.

    diloco-bench island-memory [--devices 4] [--model tiny|small|base]

Runs a child process with that many devices (on a CPU host: virtual devices
through XLA_FLAGS; on an accelerator host: its own, when it has that many),
builds the island's `InnerTrainer` once per `--param-sharding` layout and
reads, from the placed arrays themselves, how many bytes of parameters and
optimizer state live on each device. Prints one JSON object; `fsdp` should
hold about 1/devices of `replicated` per device (small vectors that no device
count divides stay replicated, so a little more).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from worker.config import MODEL_NAMES, PARAM_SHARDINGS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `diloco-bench island-memory`."""
    parser.add_argument("--devices", type=int, default=4, help="devices in the island (4)")
    parser.add_argument(
        "--model",
        choices=MODEL_NAMES,
        default="small",
        help="the model preset to measure (default small)",
    )


def measure(devices: int, model_name: str) -> dict:
    """Bytes per device of each layout (run in a process that has `devices` devices).

    Args:
        devices: how many of the default backend's devices the island uses.
        model_name: a `worker.model.MODEL_CONFIGS` name.

    Returns:
        {"devices", "platform", "model", "params", "<layout>": {"per_device_bytes": max over
        devices, "total_bytes": sum}, ..., "fsdp_over_replicated": ratio of the maxima}.
    """
    import jax

    from worker import model
    from worker.train import InnerConfig, InnerTrainer

    cfg = model.MODEL_CONFIGS[model_name]
    params = jax.tree_util.tree_map(lambda x: jax.device_get(x), model.init_params(cfg, 0))
    report: dict = {
        "devices": devices,
        "platform": jax.devices()[0].platform,
        "model": model_name,
        "params": model.count_params(params),
    }
    for layout in PARAM_SHARDINGS:
        trainer = InnerTrainer(cfg, InnerConfig(), params, devices=devices, param_sharding=layout)
        held = trainer.bytes_per_device()
        report[layout] = {"per_device_bytes": max(held.values()), "total_bytes": sum(held.values())}
        del trainer
    report["fsdp_over_replicated"] = round(
        report["fsdp"]["per_device_bytes"] / report["replicated"]["per_device_bytes"], 4
    )
    return report


def run(args: argparse.Namespace) -> int:
    """Measure in a child process with `--devices` devices; print its JSON line."""
    if args.devices < 1:
        print("diloco-bench island-memory: --devices must be >= 1", file=sys.stderr)
        return 2
    env = dict(os.environ)
    flag = f"--xla_force_host_platform_device_count={args.devices}"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
    child = [sys.executable, "-m", "bench.island_memory", str(args.devices), args.model]
    done = subprocess.run(child, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        print(f"diloco-bench island-memory: {done.stderr.strip()[-2000:]}", file=sys.stderr)
        return 1
    print(done.stdout.strip().splitlines()[-1])
    return 0


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]), sys.argv[2]), sort_keys=True))
