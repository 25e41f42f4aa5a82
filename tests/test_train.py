"""worker.train: inner config checks, schedule, the jitted trainer, and 1- vs 2-device runs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from worker import data, model, train

TINY = model.MODEL_CONFIGS["tiny"]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def corpus_split():
    return data.split_corpus(data.default_corpus(), 2, 0)


@pytest.fixture(scope="module")
def trained(corpus_split):
    """A tiny trainer before and after 30 steps (one compile shared by several tests)."""
    train_text, heldout = corpus_split
    inner = train.InnerConfig(batch_size=16, seq_len=64, lr=3e-3, warmup_steps=5)
    init = model.init_params(TINY, 0)
    trainer = train.InnerTrainer(TINY, inner, init)
    evals = data.eval_batches(heldout, 16, 64, 4)
    eval_before = trainer.evaluate(evals)
    sampler = data.BatchSampler(train_text, inner.batch_size, inner.seq_len, seed=1)
    losses = [trainer.step(sampler.next()) for _ in range(30)]
    return {
        "trainer": trainer,
        "init": init,
        "losses": losses,
        "evals": evals,
        "eval_before": eval_before,
        "eval_after": trainer.evaluate(evals),
        "sampler": sampler,
    }


def test_loss_decreases_over_30_steps(trained):
    losses = trained["losses"]
    assert abs(losses[0] - np.log(256)) < 0.1
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.8
    assert trained["eval_after"] < trained["eval_before"] - 0.8
    assert trained["trainer"].steps_done == 30
    assert trained["trainer"].tokens_done == 30 * 16 * 64


def test_evaluate_is_deterministic_and_does_not_train(trained):
    trainer = trained["trainer"]
    before = trainer.numpy_params()
    assert trainer.evaluate(trained["evals"]) == trained["eval_after"]
    after = trainer.numpy_params()
    assert all(
        np.array_equal(a, b)
        for a, b in zip(
            jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after), strict=True
        )
    )


def test_evaluate_other_params_leaves_the_trainer_alone(trained):
    trainer = trained["trainer"]
    own = trainer.evaluate(trained["evals"])
    assert trainer.evaluate(trained["evals"], params=trained["init"]) == pytest.approx(
        trained["eval_before"], abs=1e-6
    )
    assert trainer.evaluate(trained["evals"]) == own


def test_numpy_params_is_a_float32_snapshot_that_survives_steps(trained):
    trainer = trained["trainer"]
    snapshot = trainer.numpy_params()
    kept = jax.tree_util.tree_map(np.copy, snapshot)
    trainer.step(trained["sampler"].next())
    for leaf, copy in zip(
        jax.tree_util.tree_leaves(snapshot), jax.tree_util.tree_leaves(kept), strict=True
    ):
        assert isinstance(leaf, np.ndarray) and leaf.dtype == np.float32
        assert np.array_equal(leaf, copy)
    assert not np.array_equal(trainer.numpy_params()["embed"], snapshot["embed"])


def test_set_params_replaces_weights_and_keeps_optimizer_state(trained):
    trainer = trained["trainer"]
    init = trained["init"]
    steps = trainer.steps_done
    count_before = int(jax.tree_util.tree_leaves(trainer._opt_state)[0])
    trainer.set_params(jax.tree_util.tree_map(np.asarray, init))
    assert np.array_equal(trainer.numpy_params()["head"], np.asarray(init["head"]))
    assert trainer.steps_done == steps
    assert int(jax.tree_util.tree_leaves(trainer._opt_state)[0]) == count_before
    trainer.set_params(init)  # a jax tree is copied, not consumed by the donated step
    trainer.step(trained["sampler"].next())
    assert np.isfinite(np.asarray(init["embed"])).all()
    # The schedule's step count was kept: a reset count would mean lr 0 (warm-up step 0)
    # and no movement from init at all.
    assert trainer.evaluate(trained["evals"]) < trained["eval_before"] - 0.05


def test_set_params_rejects_a_mismatched_tree(trained):
    trainer = trained["trainer"]
    wrong_shape = trainer.numpy_params()
    wrong_shape["head"] = wrong_shape["head"][:, :10]
    with pytest.raises(train.InnerConfigError, match="shape"):
        trainer.set_params(wrong_shape)
    missing = trainer.numpy_params()
    del missing["head"]
    with pytest.raises(train.InnerConfigError, match="structure"):
        trainer.set_params(missing)


def test_bad_batches_are_rejected(trained):
    trainer = trained["trainer"]
    with pytest.raises(train.InnerConfigError, match="shape"):
        trainer.step(np.zeros((16,), np.int32))
    with pytest.raises(train.InnerConfigError, match="at least one batch"):
        trainer.evaluate([])


def test_too_many_devices_is_rejected():
    with pytest.raises(train.InnerConfigError, match="devices=99"):
        train.InnerTrainer(TINY, train.InnerConfig(), model.init_params(TINY, 0), devices=99)


def test_schedule_warms_up_then_holds_or_decays_to_floor():
    constant = train.make_schedule(train.InnerConfig(lr=1e-3, warmup_steps=10))
    assert float(constant(0)) == 0.0
    assert float(constant(5)) == pytest.approx(5e-4)
    assert float(constant(10)) == pytest.approx(1e-3)
    assert float(constant(10**7)) == pytest.approx(1e-3)
    cosine = train.make_schedule(
        train.InnerConfig(
            lr=1e-3, warmup_steps=10, decay="cosine", decay_steps=100, final_lr_fraction=0.1
        )
    )
    assert float(cosine(10)) == pytest.approx(1e-3)
    assert float(cosine(60)) == pytest.approx(0.55e-3, rel=1e-4)
    assert float(cosine(110)) == pytest.approx(1e-4)
    assert float(cosine(10**6)) == pytest.approx(1e-4)


def test_optimizer_clips_and_skips_decay_on_layernorm():
    params = {"w": np.ones((2, 2), np.float32), "ln_scale": np.ones(2, np.float32)}
    tx = train.make_inner_optimizer(
        train.InnerConfig(lr=0.1, warmup_steps=0, weight_decay=0.5, grad_clip=1.0)
    )
    state = tx.init(params)
    zero_grads = jax.tree_util.tree_map(np.zeros_like, params)
    updates, _ = tx.update(zero_grads, state, params)
    new = optax.apply_updates(params, updates)
    assert np.allclose(new["w"], 1 - 0.1 * 0.5)  # decayed with zero gradient
    assert np.allclose(new["ln_scale"], 1.0)  # not decayed


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"lr": 0.0}, "lr"),
        ({"lr": float("nan")}, "lr"),
        ({"decay": "linear"}, "decay"),
        ({"b2": 1.0}, "b2"),
        ({"batch_size": 0}, "batch_size"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"seq_len": 1.5}, "seq_len"),
        ({"final_lr_fraction": 2.0}, "final_lr_fraction"),
        ({"grad_clip": -1.0}, "grad_clip"),
    ],
)
def test_bad_inner_config_is_rejected(kwargs, word):
    with pytest.raises(train.InnerConfigError, match=word):
        train.InnerConfig(**kwargs)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_devices_follow_the_one_device_trajectory():
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",  # the forced host device count only applies to CPU
        "PYTHONPATH": str(ROOT),
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_multidevice_probe.py"), "8"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["devices"] == 2
    one, two = np.array(result["one"]), np.array(result["two"])
    assert len(one) == len(two) == 8
    assert one[-1] < one[0] - 0.5  # it actually trained
    np.testing.assert_allclose(two, one, rtol=0, atol=1e-4)
    assert result["param_diff"] < 1e-4
