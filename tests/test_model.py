"""worker.model: parameter tree, initialisation, loss at init and causal masking."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from worker import model

TINY = model.MODEL_CONFIGS["tiny"]
# compiled once each: run eagerly, every op of the transformer compiles on its own (~2x slower)
_apply = jax.jit(model.apply, static_argnums=2)
_token_losses = jax.jit(model.token_losses, static_argnums=2)
_loss_fn = jax.jit(model.loss_fn, static_argnums=2)


def _random_tokens(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 256, shape), dtype=jnp.int32)


def test_init_is_deterministic_from_seed_and_differs_across_seeds():
    a, b, c = (model.init_params(TINY, s) for s in (7, 7, 8))
    leaves_a, leaves_b, leaves_c = (jax.tree_util.tree_leaves(t) for t in (a, b, c))
    assert all(np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b, strict=True))
    assert not np.array_equal(a["embed"], c["embed"])
    assert not np.array_equal(a["layers"]["qkv"], c["layers"]["qkv"])


def test_tree_is_nested_float32_with_slash_free_keys():
    params = model.init_params(TINY, 0)
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, leaf in paths:
        assert leaf.dtype == jnp.float32
        assert all("/" not in str(entry.key) for entry in path)
    assert params["layers"]["qkv"].shape == (TINY.n_layers, TINY.d_model, 3 * TINY.d_model)


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [("tiny", 0.1e6, 0.2e6), ("small", 0.5e6, 2e6), ("base", 5e6, 20e6)],
)
def test_param_counts_in_advertised_ranges(name, low, high):
    cfg = model.MODEL_CONFIGS[name]
    # Shapes only: no need to materialise the base model's arrays.
    shapes = jax.eval_shape(lambda: model.init_params(cfg, 0))
    assert low <= model.count_params(shapes) <= high


def test_count_params_matches_manual_sum():
    params = model.init_params(TINY, 0)
    assert model.count_params(params) == sum(x.size for x in jax.tree_util.tree_leaves(params))


def test_loss_at_init_is_close_to_uniform():
    params = model.init_params(TINY, 0)
    loss = float(_loss_fn(params, _random_tokens((4, 65)), TINY))
    assert abs(loss - math.log(256)) < 0.05


def test_changing_a_future_token_leaves_earlier_positions_unchanged():
    params = model.init_params(TINY, 1)
    tokens = _random_tokens((2, 33), seed=3)
    k = 20
    changed = tokens.at[:, k].set((tokens[:, k] + 1) % 256)
    logits, logits_changed = (_apply(params, t[:, :-1], TINY) for t in (tokens, changed))
    np.testing.assert_allclose(logits[:, :k], logits_changed[:, :k], rtol=0, atol=1e-6)
    assert np.abs(np.asarray(logits[:, k:] - logits_changed[:, k:])).max() > 1e-4
    losses, losses_changed = (_token_losses(params, t, TINY) for t in (tokens, changed))
    # Position k-1 predicts token k, so losses before k-1 are untouched.
    np.testing.assert_allclose(losses[:, : k - 1], losses_changed[:, : k - 1], rtol=0, atol=1e-6)


def test_weight_decay_mask_skips_layernorm():
    mask = model.weight_decay_mask(model.init_params(TINY, 0))
    assert mask["embed"] and mask["head"] and mask["layers"]["mlp_in"]
    assert not mask["layers"]["ln1_scale"] and not mask["final_ln"]["bias"]


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"d_model": 60, "n_heads": 8}, "d_model=60"),
        ({"d_model": 12, "n_heads": 4}, "even"),
        ({"n_layers": 0}, "n_layers"),
        ({"d_ff": 2.5}, "d_ff"),
    ],
)
def test_bad_config_is_rejected_with_the_value(kwargs, word):
    with pytest.raises(model.ModelConfigError, match=word):
        model.ModelConfig(**kwargs)


def test_bad_token_shapes_are_rejected():
    params = model.init_params(TINY, 0)
    with pytest.raises(model.ModelConfigError, match="shape"):
        model.loss_fn(params, _random_tokens((8,)), TINY)
    with pytest.raises(model.ModelConfigError, match="T >= 1"):
        model.loss_fn(params, _random_tokens((2, 1)), TINY)
    with pytest.raises(model.ModelConfigError, match="integers"):
        model.loss_fn(params, jnp.zeros((2, 5), jnp.float32), TINY)
    with pytest.raises(model.ModelConfigError, match="seed"):
        model.init_params(TINY, "0")


def test_every_configurable_model_name_has_a_config():
    from worker.config import MODEL_NAMES
    from worker.model import MODEL_CONFIGS

    assert tuple(MODEL_CONFIGS) == MODEL_NAMES
