"""Warm-up: compiling the train/eval steps before timing changes nothing a run computes."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest

from bench.children import ddp_rank as ddp
from worker import data, model, train

TINY = model.MODEL_CONFIGS["tiny"]
INNER = train.InnerConfig(batch_size=8, seq_len=32, warmup_steps=2)


def host(tree):
    return [np.array(x, copy=True) for x in jax.tree_util.tree_leaves(tree)]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def batches():
    sampler = data.BatchSampler(data.default_corpus(), INNER.batch_size, INNER.seq_len, seed=3)
    return [sampler.next() for _ in range(3)]


@pytest.mark.timeout(120)
def test_trainer_warmup_changes_no_state_and_the_next_steps_are_identical(batches):
    init = model.init_params(TINY, 0)
    warm = train.InnerTrainer(TINY, INNER, init)
    cold = train.InnerTrainer(TINY, INNER, init)
    warm.step(batches[0])  # state that is not the initial one: moments and count non-zero
    cold.step(batches[0])
    params0, opt0 = host(warm.params), host(warm._opt_state)

    t0 = time.monotonic()
    seconds = warm.warmup()
    assert 0 < seconds <= time.monotonic() - t0  # its own duration, in seconds
    assert_same(host(warm.params), params0)
    assert_same(host(warm._opt_state), opt0)
    assert (warm.steps_done, warm.tokens_done) == (1, INNER.batch_size * INNER.seq_len)

    for batch in batches[1:]:
        assert warm.step(batch) == cold.step(batch)
    assert_same(host(warm.params), host(cold.params))
    assert_same(host(warm._opt_state), host(cold._opt_state))
    assert warm.evaluate(batches) == cold.evaluate(batches)


@pytest.mark.timeout(120)
def test_trainer_warmup_compiles_everything_a_run_uses(batches):
    trainer = train.InnerTrainer(TINY, INNER, model.init_params(TINY, 0))
    trainer.warmup()
    compiled = trainer._train_step._cache_size(), trainer._eval_step._cache_size()
    assert compiled[0] >= 1 and compiled[1] >= 1
    for batch in batches:
        trainer.step(batch)
    trainer.evaluate(batches)
    trainer.set_params(trainer.numpy_params())  # as an island folding in a new version
    trainer.step(batches[0])
    trainer.evaluate(batches, params=trainer.numpy_params())
    assert (trainer._train_step._cache_size(), trainer._eval_step._cache_size()) == compiled


@pytest.mark.timeout(120)
def test_ddp_warmup_changes_nothing_and_compiles_every_step(batches):
    tx = train.make_inner_optimizer(INNER)
    params = model.init_params(TINY, 0)
    opt_state = tx.init(params)
    grad_step = ddp.make_grad_step(TINY)
    apply_step = ddp.make_apply_step(tx, params)
    params0, opt0 = host(params), host(opt_state)

    t0 = time.monotonic()
    seconds = ddp.warmup(grad_step, apply_step, params, opt_state, INNER.batch_size, INNER.seq_len)
    assert 0 < seconds <= time.monotonic() - t0  # its own duration, in seconds
    assert_same(host(params), params0)  # not donated, not changed
    assert_same(host(opt_state), opt0)
    compiled = [f._cache_size() for f in (grad_step, apply_step)]
    assert min(compiled) >= 1
    for batch in batches:
        _loss, grad_P = grad_step(params, batch)
        params, opt_state = apply_step(params, opt_state, np.asarray(grad_P))
    assert [f._cache_size() for f in (grad_step, apply_step)] == compiled
