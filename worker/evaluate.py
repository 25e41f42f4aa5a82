"""The final evaluation of a run: the global model read from the shards, evaluated once.

docs/design.md defines the final eval loss of any run as the global model after every
island flushed and every acked delta is merged, read from the shards (a snapshot of
each fragment from its owning shard), evaluated once on the common held-out set.
`evaluate_global` does exactly that: wait until no shard holds a pending delta, read
the parameters, build the held-out batches as every island does (`Island.__init__`:
the held-out split is the same for every data shard) and evaluate them with the
islands' own jitted eval step (`InnerTrainer.evaluate`).

Run it after the islands have stopped (`diloco-worker eval --connect ...`); while
islands still push, "merged" is only a moment and the result is one more point of
the curve, not the final one.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import jax
import numpy as np

import codec
from paramserver.plumbing import probe
from paramserver.plumbing.curve import ClientKeys, CurveError
from paramserver.plumbing.model_diff import first_difference, model_size
from worker import data as data_lib
from worker import island_files
from worker import model as model_lib
from worker.config import IslandConfig
from worker.token_files import is_token_file
from worker.train import InnerConfig, InnerTrainer

logger = logging.getLogger(__name__)


class EvalError(RuntimeError):
    """The cluster could not be read (unreachable, not initialized, not merged in time)."""


class EvalModelError(ValueError):
    """The cluster holds parameters of another model than the one asked for."""


def _check_model(cfg: IslandConfig, flat: dict[str, np.ndarray]) -> None:
    """Raise EvalModelError unless `flat` has the leaves of model `cfg.model`."""
    model_cfg = model_lib.model_config(cfg.model, cfg.vocab_size)
    shapes = jax.eval_shape(lambda: model_lib.init_params(model_cfg, 0))
    want = [_Leaf(k, tuple(v.shape), "float32") for k, v in codec.flatten(shapes).items()]
    have = [_Leaf(k, tuple(v.shape), "float32") for k, v in flat.items()]
    if sorted(want) != sorted(have):
        name = f"model {cfg.model!r} with vocab {cfg.vocab_size}"
        raise EvalModelError(
            f"the cluster's parameters ({model_size(have)}) are not those of {name} "
            f"({model_size(want)}): {first_difference(have, want, 'in the cluster', 'in ' + name)}"
            "; pass the --model and --vocab-size the islands trained"
        )


class _Leaf(NamedTuple):
    path: str
    shape: tuple[int, ...]
    dtype: str


def evaluate_global(cfg: IslandConfig, connect: str, wait_s: float) -> dict[str, Any]:
    """Wait until merged, read the global parameters from the shards, evaluate them once.

    Args:
        cfg: model and data settings (model, vocab_size, data, data_dtype, data_shards,
            heldout_fraction, batch_size, seq_len, eval_batches, devices). With curve_secret_key_file and
            curve_server_key_file set, every request speaks CURVE and the welcome's hello
            names `cfg.island` (an id the key may act as; not live elsewhere).
        connect: ROUTER endpoint of any shard (normally shard 0).
        wait_s: how long to wait for every shard's pending deltas to be merged.

    Returns:
        {"eval_loss": float (in "unit"), "unit": "nats/byte" (text) or "nats/token"
        (a token file, `loss_unit`), "eval_loss_se": its standard error over the
        batches (None for one batch), "eval_batches": int, "versions": {str(fragment):
        version}, "version_sum": int, "pending": 0}.

    Raises:
        EvalError: a shard is unreachable, the cluster is not initialized, or
            deltas are still pending after `wait_s`.
        EvalModelError: the cluster holds another model than `cfg.model`.
        ValueError: bad data settings (e.g. a held-out set too small for the batches).
    """
    if not wait_s >= 0:
        raise ValueError(f"wait_s must be >= 0, got {wait_s!r}")
    curve, island = None, None
    try:
        if cfg.curve_secret_key_file:  # a CURVE cluster: its hello speaks as this island
            curve = ClientKeys.load(cfg.curve_secret_key_file, cfg.curve_server_key_file)
            island = cfg.island
        probe.wait_merged(connect, wait_s, curve=curve)
        _plan, flat, versions = probe.global_params(connect, curve=curve, island=island)
    except (probe.ProbeError, CurveError) as exc:
        raise EvalError(str(exc)) from None
    _check_model(cfg, flat)
    batches = data_lib.heldout_set(cfg)  # exactly as every island builds them
    inner = InnerConfig(batch_size=cfg.batch_size, seq_len=cfg.seq_len)
    params = codec.unflatten(flat)
    trainer = InnerTrainer(
        model_lib.model_config(cfg.model, cfg.vocab_size),
        inner,
        params,
        devices=cfg.devices or None,
    )
    losses = np.array([trainer.evaluate([batch]) for batch in batches])  # equal batch sizes
    loss = float(losses.mean())
    result: dict[str, Any] = {
        "eval_loss": loss,
        "unit": loss_unit(cfg),
        # the figure's standard error over its batches (windows spread over the held-out set)
        "eval_loss_se": float(losses.std(ddof=1) / np.sqrt(len(losses)))
        if len(losses) > 1
        else None,
        "eval_batches": len(losses),
        "versions": {str(f): v for f, v in sorted(versions.items())},
        "version_sum": int(sum(versions.values())),
        "pending": 0,
    }
    result["data_id"] = data_lib.heldout_identity(cfg)
    warning = data_warning(cfg.data_dir, result["data_id"])
    if warning:
        result["data_warning"] = warning
    logger.info("final global eval: %.4f at version sum %d", loss, result["version_sum"])
    return result


def loss_unit(cfg: IslandConfig) -> str:
    """The unit of a loss on the island's data: per byte of text, or per id of a token file.

    Args:
        cfg: the data settings (`data`).

    Returns:
        "nats/token" for a token file (".bin", ".npy"), else "nats/byte".
    """
    return "nats/token" if cfg.data and is_token_file(cfg.data) else "nats/byte"


def data_warning(data_dir: str, data_id: str) -> str | None:
    """A warning when the island of `data_dir` trained on another held-out set than `data_id`.

    Args:
        data_dir: an island's data directory (its status.json records its `data_id`).
        data_id: the identity of the held-out set eval scored (`heldout_identity`).

    Returns:
        One line, or None when the island's data agrees or it recorded none.
    """
    try:
        status = island_files.read_status(data_dir) or {}
    except (OSError, ValueError):
        return None
    theirs = status.get("data_id")
    if not theirs or theirs == data_id:
        return None
    return (
        f"island {status.get('island', '?')} ({data_dir}) trained with held-out data {theirs}, "
        f"this eval scored {data_id}: pass the islands' --data, --data-dtype and "
        "--heldout-fraction"
    )
