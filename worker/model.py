"""The island's language model: a decoder-only transformer over bytes or tokens, in pure JAX.

This module owns the model configuration, the parameter tree (its names, shapes and
initialisation) and the forward pass / loss. Nothing here knows about optimizers,
devices or the network.

Why pure JAX rather than Flax NNX: it needs no extra dependency, and the parameters are
a plain nested dict of arrays, which is exactly the tree the codec flattens to "a/b"
names and the parameter server's sharding plan splits. Keys never contain "/".

Architecture: vocab 256 (raw bytes) unless token data sets another (`model_config`),
pre-LayerNorm blocks with causal multi-head attention and a GELU MLP, rotary position
embeddings (no learned positions, so any sequence length works), a final LayerNorm and
an untied output head; no biases in the linear layers. The per-layer weights are stacked along a leading layer axis and the
blocks run under `jax.lax.scan`, so compile time does not grow with depth.

Parameter tree (L layers, D model width, F MLP width, V vocab):

    embed          [V, D]
    layers/ln1_scale, ln1_bias, ln2_scale, ln2_bias   [L, D]
    layers/qkv     [L, D, 3D]
    layers/attn_out [L, D, D]
    layers/mlp_in  [L, D, F]
    layers/mlp_out [L, F, D]
    final_ln/scale, final_ln/bias   [D]
    head           [D, V]
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

VOCAB_SIZE = 256
_INIT_STD = 0.02
_LN_EPS = 1e-5
_ROPE_BASE = 10_000.0


class ModelConfigError(ValueError):
    """A model configuration or model input is invalid."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of the transformer. Frozen and hashable, so it can be a static jit argument."""

    d_model: int = 64  # residual stream width D
    n_layers: int = 2  # number of transformer blocks L
    n_heads: int = 4  # attention heads; d_model / n_heads must be an even integer (rotary)
    d_ff: int = 256  # MLP hidden width F
    vocab_size: int = VOCAB_SIZE  # vocabulary V: 256 bytes, or a token file's

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "d_ff", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelConfigError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads:
            raise ModelConfigError(
                f"ModelConfig.d_model={self.d_model} is not divisible by n_heads={self.n_heads}"
            )
        if (self.d_model // self.n_heads) % 2:
            raise ModelConfigError(
                f"head width d_model/n_heads={self.d_model // self.n_heads} must be even "
                "for rotary embeddings"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads


# Parameter counts: tiny 0.13M, small 0.85M, base 6.4M.
MODEL_CONFIGS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(d_model=64, n_layers=2, n_heads=4, d_ff=256),
    "small": ModelConfig(d_model=128, n_layers=4, n_heads=4, d_ff=512),
    "base": ModelConfig(d_model=256, n_layers=8, n_heads=8, d_ff=1024),
}


def model_config(name: str, vocab_size: int = VOCAB_SIZE) -> ModelConfig:
    """A named shape with the vocabulary of the island's data (`IslandConfig.vocab_size`).

    Args:
        name: a key of MODEL_CONFIGS.
        vocab_size: V; the default (bytes) gives MODEL_CONFIGS[name] itself.

    Returns:
        The ModelConfig (equal to MODEL_CONFIGS[name] at V = 256, so text runs are unchanged).

    Raises:
        ModelConfigError: an unknown name or a bad vocab_size.
    """
    if name not in MODEL_CONFIGS:
        raise ModelConfigError(f"model {name!r} must be one of {', '.join(MODEL_CONFIGS)}")
    return dataclasses.replace(MODEL_CONFIGS[name], vocab_size=vocab_size)


def init_params(cfg: ModelConfig, seed: int) -> dict:
    """Initialise the parameter tree, deterministically from `seed`.

    Args:
        cfg: model shape.
        seed: integer seed; the same seed gives bit-identical parameters.

    Returns:
        Nested dict of float32 jax arrays (layout in the module docstring).
    """
    if not isinstance(seed, int | np.integer) or isinstance(seed, bool):
        raise ModelConfigError(f"seed must be an int, got {seed!r}")
    # One compiled program instead of dozens of eagerly dispatched ops (seconds on CPU).
    return _init_params_jit(cfg, jnp.uint32(int(seed) % 2**32))


@functools.partial(jax.jit, static_argnums=0)
def _init_params_jit(cfg: ModelConfig, seed: jax.Array) -> dict:
    L, D, F, V = cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.vocab_size
    keys = jax.random.split(jax.random.key(seed), 6)
    # Residual-branch outputs are scaled down so the stream's variance stays O(1) with depth.
    out_std = _INIT_STD / math.sqrt(2 * L)

    def normal(key: jax.Array, shape: tuple[int, ...], std: float) -> jax.Array:
        return std * jax.random.normal(key, shape, dtype=jnp.float32)

    ones_LxD = jnp.ones((L, D), jnp.float32)
    zeros_LxD = jnp.zeros((L, D), jnp.float32)
    return {
        "embed": normal(keys[0], (V, D), _INIT_STD),
        "layers": {
            "ln1_scale": ones_LxD,
            "ln1_bias": zeros_LxD,
            "qkv": normal(keys[1], (L, D, 3 * D), _INIT_STD),
            "attn_out": normal(keys[2], (L, D, D), out_std),
            "ln2_scale": ones_LxD,
            "ln2_bias": zeros_LxD,
            "mlp_in": normal(keys[3], (L, D, F), _INIT_STD),
            "mlp_out": normal(keys[4], (L, F, D), out_std),
        },
        "final_ln": {"scale": jnp.ones((D,), jnp.float32), "bias": jnp.zeros((D,), jnp.float32)},
        "head": normal(keys[5], (D, V), _INIT_STD),
    }


def count_params(params: dict) -> int:
    """Total number of scalar parameters.

    Args:
        params: a parameter tree (jax or numpy leaves).

    Returns:
        The sum of the leaves' sizes.
    """
    return int(sum(np.size(leaf) for leaf in jax.tree_util.tree_leaves(params)))


def weight_decay_mask(params: dict) -> dict:
    """Which leaves take weight decay: matrices yes, LayerNorm scales and biases no.

    Args:
        params: a parameter tree of this model.

    Returns:
        A tree of bools with the same structure.
    """

    def decays(path: tuple, _leaf: object) -> bool:
        name = str(getattr(path[-1], "key", path[-1]))
        return not (name.endswith("scale") or name.endswith("bias"))

    return jax.tree_util.tree_map_with_path(decays, params)


def _layer_norm(x_BxTxD: jax.Array, scale_D: jax.Array, bias_D: jax.Array) -> jax.Array:
    mean_BxTx1 = x_BxTxD.mean(axis=-1, keepdims=True)
    var_BxTx1 = jnp.square(x_BxTxD - mean_BxTx1).mean(axis=-1, keepdims=True)
    return (x_BxTxD - mean_BxTx1) * jax.lax.rsqrt(var_BxTx1 + _LN_EPS) * scale_D + bias_D


def _rotary_tables(seq_len: int, head_dim: int) -> tuple[jax.Array, jax.Array]:
    inv_freq_K = 1.0 / (_ROPE_BASE ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angle_TxK = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq_K[None, :]
    return jnp.cos(angle_TxK), jnp.sin(angle_TxK)


def _rotate(x_BxTxHxE: jax.Array, cos_TxK: jax.Array, sin_TxK: jax.Array) -> jax.Array:
    # Rotate pairs (first half, second half) of each head's features by a position angle.
    half = x_BxTxHxE.shape[-1] // 2
    x1, x2 = x_BxTxHxE[..., :half], x_BxTxHxE[..., half:]
    cos, sin = cos_TxK[None, :, None, :], sin_TxK[None, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _block(
    cfg: ModelConfig, rope: tuple[jax.Array, jax.Array], x_BxTxD: jax.Array, layer: dict
) -> jax.Array:
    B, T, D = x_BxTxD.shape
    H, E = cfg.n_heads, cfg.head_dim
    h_BxTxD = _layer_norm(x_BxTxD, layer["ln1_scale"], layer["ln1_bias"])
    qkv_BxTx3D = h_BxTxD @ layer["qkv"]
    q, k, v = (a.reshape(B, T, H, E) for a in jnp.split(qkv_BxTx3D, 3, axis=-1))
    q, k = _rotate(q, *rope), _rotate(k, *rope)
    scores_BxHxTxT = jnp.einsum("bqhe,bkhe->bhqk", q, k) / math.sqrt(E)
    causal_TxT = jnp.tril(jnp.ones((T, T), dtype=bool))
    scores_BxHxTxT = jnp.where(causal_TxT, scores_BxHxTxT, jnp.finfo(jnp.float32).min)
    probs_BxHxTxT = jax.nn.softmax(scores_BxHxTxT, axis=-1)
    attn_BxTxD = jnp.einsum("bhqk,bkhe->bqhe", probs_BxHxTxT, v).reshape(B, T, D)
    x_BxTxD = x_BxTxD + attn_BxTxD @ layer["attn_out"]
    h_BxTxD = _layer_norm(x_BxTxD, layer["ln2_scale"], layer["ln2_bias"])
    return x_BxTxD + jax.nn.gelu(h_BxTxD @ layer["mlp_in"]) @ layer["mlp_out"]


def apply(params: dict, tokens_BxT: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Next-byte logits for every position (position t sees tokens 0..t only).

    Args:
        params: parameter tree from `init_params`.
        tokens_BxT: integer byte ids, shape [B, T].
        cfg: the model shape the parameters were made for.

    Returns:
        float32 logits of shape [B, T, V].
    """
    if tokens_BxT.ndim != 2:
        raise ModelConfigError(f"tokens must have shape [B, T], got shape {tokens_BxT.shape}")
    T = tokens_BxT.shape[1]
    rope = _rotary_tables(T, cfg.head_dim)
    x_BxTxD = jnp.take(params["embed"], tokens_BxT, axis=0)

    def scan_step(x: jax.Array, layer: dict) -> tuple[jax.Array, None]:
        return _block(cfg, rope, x, layer), None

    x_BxTxD, _ = jax.lax.scan(scan_step, x_BxTxD, params["layers"])
    x_BxTxD = _layer_norm(x_BxTxD, params["final_ln"]["scale"], params["final_ln"]["bias"])
    return x_BxTxD @ params["head"]


def token_losses(params: dict, tokens_BxT1: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Per-position cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1].

    Args:
        params: parameter tree from `init_params`.
        tokens_BxT1: integer byte ids, shape [B, T+1] with T >= 1.
        cfg: the model shape.

    Returns:
        float32 losses in nats, shape [B, T].
    """
    if tokens_BxT1.ndim != 2 or tokens_BxT1.shape[1] < 2:
        raise ModelConfigError(
            f"tokens must have shape [B, T+1] with T >= 1, got shape {tokens_BxT1.shape}"
        )
    if not jnp.issubdtype(tokens_BxT1.dtype, jnp.integer):
        raise ModelConfigError(f"tokens must be integers, got dtype {tokens_BxT1.dtype}")
    inputs_BxT, targets_BxT = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
    logits_BxTxV = apply(params, inputs_BxT, cfg)
    logprobs_BxTxV = jax.nn.log_softmax(logits_BxTxV, axis=-1)
    return -jnp.take_along_axis(logprobs_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]


def loss_fn(params: dict, tokens_BxT1: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Mean next-byte cross-entropy, in nats per byte.

    Args:
        params: parameter tree from `init_params`.
        tokens_BxT1: integer byte ids, shape [B, T+1]; predicts tokens[:, 1:] from
            tokens[:, :-1].
        cfg: the model shape.

    Returns:
        A float32 scalar.
    """
    return token_losses(params, tokens_BxT1, cfg).mean()
