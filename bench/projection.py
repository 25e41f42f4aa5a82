"""What a large model would need per island: the report's bandwidth projection, as arithmetic.

From a run's measured bytes per parameter per round (what one island sent plus
received per round, over the model's parameter count), the bandwidth one island
needs to keep a model of `PROJECTED_PARAMS` parameters fed, when an inner step
takes `STEP_S` seconds and a round is H steps:

    bits/s = bytes_per_param_per_round * PROJECTED_PARAMS * 8 / (H * STEP_S)

DDP exchanges every step: its bytes per parameter per step (from its measured
bytes per token) give bits/s = bytes_per_param_per_step * PROJECTED_PARAMS * 8 /
STEP_S. The seed's own figure for DiLoCo across four regions is 2-5 Gbit/s.
Every input is printed next to the result, so the arithmetic can be checked.
Pure functions; `bench.report` feeds them the records.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bench import analysis

PROJECTED_PARAMS = 12e9  # a 12B-parameter model
STEP_S = 1.0  # one inner step per second
HORIZONS = (30, 100)  # H of the projection
SEED_FIGURE = "2-5 Gbit/s per island across four regions (the seed's figure)"


def bits_per_s(bytes_per_param: float, every_steps: int, params: float = PROJECTED_PARAMS) -> float:
    """Bandwidth to move `bytes_per_param` for `params` parameters once every `every_steps` steps.

    Args:
        bytes_per_param: bytes per parameter per exchange.
        every_steps: inner steps between two exchanges (H; 1 for DDP).
        params: model size.

    Returns:
        Bits per second at one inner step per STEP_S seconds.
    """
    return bytes_per_param * params * 8 / (every_steps * STEP_S)


def run_bytes_per_param_round(record: Mapping[str, Any], params: int) -> float | None:
    """Mean bytes per parameter per round of a DiLoCo run's islands (up + down, join excluded).

    Args:
        record: a run record (`bench.run_record.summarize`).
        params: the model's parameter count.

    Returns:
        Bytes per parameter per round, or None without a finished round.
    """
    per_round = [
        i["up_per_round"] + i["down_per_round"]
        for i in record["islands"].values()
        if i.get("rounds") and i["up_per_round"] + i["down_per_round"] > 0
    ]
    mean = analysis.mean(per_round)
    return None if mean is None or params <= 0 else mean / params


def project(
    records: Mapping[str, Mapping[str, Any]],
    params: int | None,
    ddp_per_token: float | None,
    tokens_per_step: int,
    horizons: Sequence[int] = HORIZONS,
) -> dict[str, Any]:
    """The projection table: every DiLoCo run at each H, and DDP, for a 12B model.

    Args:
        records: run records by name (DiLoCo runs have `rounds` per island).
        params: the measured model's parameter count (None: nothing to project).
        ddp_per_token: DDP's bytes per token and island (None: no DDP row).
        tokens_per_step: tokens one island (or DDP rank) trains per inner step.
        horizons: H values to project at.

    Returns:
        {"inputs": {...}, "rows": [{"run", "codec", "H", "bytes_per_param_round",
        "gbit_per_s"}], "ddp": {"bytes_per_param_step", "gbit_per_s"} or None}.
    """
    inputs = {
        "projected_params": PROJECTED_PARAMS,
        "step_s": STEP_S,
        "measured_params": params,
        "tokens_per_step": tokens_per_step,
        "formula": "bytes/param/round * params * 8 / (H * step_s)",
        "seed_figure": SEED_FIGURE,
    }
    rows: list[dict[str, Any]] = []
    ddp = None
    if not params:
        return {"inputs": inputs, "rows": rows, "ddp": ddp}
    for name, rec in records.items():
        if rec.get("method") == "ddp":
            continue
        per_param = run_bytes_per_param_round(rec, params)
        if per_param is None:
            continue
        for h in horizons:
            rows.append(
                {
                    "run": name,
                    "codec": rec.get("codec"),
                    "H": h,
                    "bytes_per_param_round": per_param,
                    "gbit_per_s": bits_per_s(per_param, h) / 1e9,
                }
            )
    if ddp_per_token:
        per_step = ddp_per_token * tokens_per_step / params
        ddp = {"bytes_per_param_step": per_step, "gbit_per_s": bits_per_s(per_step, 1) / 1e9}
    return {"inputs": inputs, "rows": rows, "ddp": ddp}
