"""Outer momentum kept in bfloat16 (`ShardConfig.momentum_dtype`): the step against a numpy
reference computed by hand (float32 arithmetic, round to nearest even when stored), the
compiled and jitted paths bit for bit, checkpoint / recovery / log replay giving the same
bits, a data dir of the other dtype refused, and 2 bytes per parameter less kept."""

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
from shard_helpers import delta_frames, init_payload, plan_for, push_header, small_flat

from paramserver.server.config import ConfigError, ShardConfig
from paramserver.server.fragment import MomentumDtypeError, StepEvent
from paramserver.server.state import ShardState
from paramserver.server.step.downlink import Downlink, new_residual
from paramserver.server.step.fragment_step import ChunkedStep, FusedNesterov, _kernels, host_vector
from paramserver.server.step.outer import (
    FragmentOptimizer,
    OuterError,
    outer_rule,
    round_nesterov,
    set_round_share,
)
from paramserver.server.storage.checkpoint import (
    export_state,
    read_checkpoint,
    restore_state,
    write_checkpoint,
)
from paramserver.server.storage.recovery import DurabilityError, recover
from paramserver.server.storage.wal import WriteAheadLog, event_to_record

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(_kernels() is None, reason="numba is not installed"),
]

F32 = np.float32
BF16 = np.dtype(ml_dtypes.bfloat16)
T0 = 1_000_000.0


def rand(n, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(F32)


def fma(a, b, c):
    """a * b + c rounded once to float32 (the product is exact in float64; see test_fused_step)."""
    return (a.astype(np.float64) * np.float64(b) + c.astype(np.float64)).astype(F32)


def bf16_bits(x):
    """float32 -> bfloat16 bits, round to nearest even (finite values), by hand."""
    bits = x.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def widen(bits):
    """bfloat16 bits -> the float32 they are (exact)."""
    return (bits.astype(np.uint32) << 16).view(F32)


def reference_steps(params, g_list, flags, lr, beta, block):
    """Round Nesterov with the momentum kept in bfloat16, in plain numpy: each step reads m as
    float32, computes in float32 (the fused multiply-adds where the shard's step has them), uses
    that float32 m for its update and stores bfloat16(m). block 0: p <- p - lr y; else the int8
    downlink (update plus the bfloat16 residual, the codec's int8 rule, the decoded update).
    Returns (params, momentum bits, residual bits or None, the last float32 m before rounding)."""
    neg_lr, beta = F32(-lr), F32(beta)
    p, m_bits, r_bits, m = params.copy(), np.zeros(len(params), np.uint16), None, None
    if block:
        r_bits = np.zeros(len(params), np.uint16)
    for g, (fresh, due) in zip(g_list, flags, strict=True):
        m = widen(m_bits)
        m = fma(m, beta, g) if fresh else m + g
        y = fma(m, beta, g) if due else g
        m_bits = bf16_bits(m)
        if not block:
            p = fma(y, neg_lr, p)
            continue
        v = fma(y, neg_lr, widen(r_bits))
        step = F32(1.0 / 127)
        for a in range(0, len(v), block):
            blk = v[a : a + block]
            s = F32(np.abs(blk).max())
            inv = min(F32(127) / s, F32(127) / F32(2.0**-118))
            q = np.rint(blk * inv)
            st = F32(s * step)
            p[a : a + block] += q.astype(np.int8).astype(F32) * st
            r_bits[a : a + block] = bf16_bits((blk - q * st).astype(F32))
    return p, m_bits, r_bits, m


# shares of a round per step; fresh = the round's first step, due = the round complete (by hand)
SHARES = [1.0, 0.5, 0.5, 1.0, 0.5, 0.5]
FLAGS = [(True, True), (True, False), (False, True), (True, True), (True, False), (False, True)]


def run_path(kind, n, block, lr, beta, settings=None):
    """SHARES steps of round Nesterov with a bfloat16 momentum, fused or jitted; returns bits."""
    link = Downlink("int8" if block else "float32")
    rule = outer_rule("nesterov", 1, "bfloat16")
    jitted = ChunkedStep(rule, chunk=1024, finish=link.finish)
    fused = FusedNesterov.for_config("nesterov", lr, beta, 1, chunk=2048)
    params = host_vector(rand(n, 0))
    state, residual = jitted.init(params), new_residual(n)
    assert state.momentum.dtype == BF16
    for k, share in enumerate(SHARES):
        g = rand(n, 10 + k, 0.01)
        set_round_share(state, share)

        def fill(lo, hi, out, g=g):
            np.copyto(out, g[lo:hi])

        publication = link.begin(params, residual) if link.compressed else None
        step_settings = (lr, beta) if settings is None else settings[k]
        if kind == "jit":
            sink = publication.apply if publication else None
            carry = residual if publication else None
            jitted.step(params, state, fill, sink, carry, settings=step_settings)
        else:
            assert fused.fits(state, link.block_size)
            fused.step(params, state, fill, publication, settings=step_settings)
        if publication:
            publication.frames()
    bits = residual.view(np.uint16).copy() if block else None
    return params.copy(), state.momentum.view(np.uint16).copy(), bits


@pytest.mark.parametrize("kind", ["fused", "jit"])
@pytest.mark.parametrize("block", [0, 256])
def test_bf16_momentum_steps_are_the_numpy_reference(kind, block):
    n, lr, beta = 3 * 1024 + 40, 0.7, 0.8
    params, m_bits, r_bits = run_path(kind, n, block, lr, beta)
    g_list = [rand(n, 10 + k, 0.01) for k in range(len(SHARES))]
    want = reference_steps(rand(n, 0), g_list, FLAGS, lr, beta, block)
    assert m_bits.tobytes() == want[1].tobytes()
    assert params.tobytes() == want[0].tobytes()
    if block:
        assert r_bits.tobytes() == want[2].tobytes()
    # not trivially float32: the last step's float32 m had low bits that rounding dropped
    assert (want[3].view(np.uint32) & 0xFFFF).any()
    assert not np.array_equal(widen(want[1]), want[3])


@pytest.mark.parametrize("kind", ["fused", "jit"])
def test_bf16_momentum_rounds_to_nearest_even(kind):
    # from zero momentum the round's first step keeps m = g exactly, then rounds it; by hand:
    #   0x3F808000 (a tie) -> 0x3F80 (even), 0x3F818000 (a tie) -> 0x3F82 (even),
    #   0x3F808001 (above the tie) -> 0x3F81, 0x3F807FFF (below) -> 0x3F80, sign kept
    g_bits = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0xBF808000, 0xBF818000],
                      np.uint32)  # fmt: skip
    want = np.array([0x3F80, 0x3F82, 0x3F81, 0x3F80, 0xBF80, 0xBF82], np.uint16)
    n = 1024
    g = np.zeros(n, F32)
    g[: len(g_bits)] = g_bits.view(F32)
    params = host_vector(np.zeros(n, F32))
    jitted = ChunkedStep(round_nesterov(0.7, 0.8, "bfloat16"), chunk=1024)
    state = jitted.init(params)

    def fill(lo, hi, out):
        np.copyto(out, g[lo:hi])

    if kind == "jit":
        jitted.step(params, state, fill)
    else:
        FusedNesterov.for_config("nesterov", 0.7, 0.8, 1, chunk=1024).step(params, state, fill)
    assert state.momentum.view(np.uint16)[: len(want)].tolist() == want.tolist()


@pytest.mark.parametrize("block", [0, 256])
def test_bf16_momentum_fused_equals_jitted_bit_for_bit(block):
    n = 5 * 1024 + 256 + 7
    settings = [(0.7, 0.6), (1.0, 0.3), (1.0, 0.3), (1.4, 0.0), (0.7, 0.8), (0.7, 0.8)]
    jit = run_path("jit", n, block, 0.5, 0.9, settings)
    fused = run_path("fused", n, block, 0.5, 0.9, settings)
    for a, b in zip(jit, fused, strict=True):
        assert (a is None and b is None) or a.tobytes() == b.tobytes()


def test_bf16_momentum_whole_fragment_step_and_delayed_nesterov():
    # the whole-fragment jitted step (DonatingStep) equals the chunked one; delayed Nesterov
    # keeps its momentum in bfloat16 too: from m = 0 its due step keeps bfloat16(a / delay)
    n = 2048 + 5
    g1, g2 = rand(n, 1, 0.01), rand(n, 2, 0.01)
    whole = FragmentOptimizer(round_nesterov(0.7, 0.8, "bfloat16"))
    p = rand(n, 0)
    state = whole.init(p)
    p_whole, state = whole.step(p, state, g1)
    chunked = ChunkedStep(round_nesterov(0.7, 0.8, "bfloat16"), chunk=1024)
    p_chunk = host_vector(rand(n, 0))
    c_state = chunked.init(p_chunk)
    chunked.step(p_chunk, c_state, lambda lo, hi, out: np.copyto(out, g1[lo:hi]))
    assert p_whole.tobytes() == p_chunk.tobytes()
    assert np.asarray(state.momentum).tobytes() == c_state.momentum.tobytes()
    delayed = ChunkedStep(outer_rule("delayed-nesterov", 2, "bfloat16"), chunk=1024)
    p_d = host_vector(rand(n, 0))
    d_state = delayed.init(p_d)
    assert d_state.momentum.dtype == BF16 and d_state.accumulator.dtype == F32
    for g in (g1, g2):
        delayed.step(p_d, d_state, lambda lo, hi, out, g=g: np.copyto(out, g[lo:hi]),
                     settings=(0.7, 0.8))  # fmt: skip
    mean = ((g1 + g2).astype(F32) / F32(2)).astype(F32)
    assert d_state.momentum.view(np.uint16).tobytes() == bf16_bits(mean).tobytes()


def test_a_float32_state_refuses_bfloat16_arrays_and_back():
    p = rand(1024, 0)
    f32 = FragmentOptimizer(round_nesterov(0.7, 0.8))
    b16 = FragmentOptimizer(round_nesterov(0.7, 0.8, "bfloat16"))
    with pytest.raises(OuterError, match="never converted silently"):
        f32.state_from_arrays(b16.state_to_arrays(b16.init(p)), p)
    with pytest.raises(OuterError, match="never converted silently"):
        b16.state_from_arrays(f32.state_to_arrays(f32.init(p)), p)
    with pytest.raises(OuterError, match="float16"):
        outer_rule("nesterov", 1, "float16")
    with pytest.raises(ConfigError, match="momentum_dtype"):
        ShardConfig(momentum_dtype="float16")


# -- the shard: checkpoint, recovery, replay ------------------------------------------------

BF_CFG = ShardConfig(mode="async", outer_momentum=0.8, downlink="int8", fsync=False,
                     momentum_dtype="bfloat16")  # fmt: skip


def run_steps(cfg, steps, state=None, plan=None, start=1):
    """Init a shard state (unless given) and step it `steps` times; returns (state, plan, events)."""
    events = []
    if state is None:
        flat = small_flat(0)
        plan = plan_for(flat, cfg.shards, cfg.num_fragments)
        state = ShardState(cfg, 0)
        events.append(state.initialize(plan.to_wire(), init_payload(plan, flat)).event)
    state.hello("a", T0)
    rng = np.random.default_rng(start)
    for rnd in range(start, start + steps):
        fragment = rnd % 2
        d = rng.standard_normal(plan.fragments[fragment].size).astype(F32) * 0.05
        h = push_header(plan, "a", rnd, fragment, state.versions()[fragment])
        events.append(state.submit_delta(h, delta_frames(d), T0 + rnd).event)
        events.append(state.step(fragment, T0 + rnd)[0])
    return state, plan, events


def write_log(path, events):
    """A log segment of `events`, as the shard appends them."""
    wal = WriteAheadLog(path, fsync=False)
    for event in events:
        wal.append(*event_to_record(event))
    wal.close()


def kept_bits(state):
    """Per fragment: params, momentum and residual bytes."""
    return {
        f: (frag.params.tobytes(), frag.opt_state.momentum.tobytes(), frag.residual.tobytes())
        for f, frag in sorted(state.fragments.items())
    }


def test_checkpoint_recovery_and_replay_give_the_same_bits(tmp_path):
    state, plan, first = run_steps(BF_CFG, 6)
    assert state.fragments[0].opt_state.momentum.dtype == BF16
    meta, arrays = export_state(state)
    assert meta["momentum_dtype"] == "bfloat16"
    assert arrays["opt/0/2"].dtype == np.uint16  # (share, phase, momentum): stored as its bits
    directory = tmp_path / "shard-0"
    directory.mkdir()
    write_checkpoint(directory / "checkpoint-1.ckpt", meta, arrays, fsync=False)
    state, _, after = run_steps(BF_CFG, 5, state, plan, start=7)
    live = kept_bits(state)
    step_records = [event_to_record(e)[0] for e in after if isinstance(e, StepEvent)]
    assert {r["momentum"] for r in step_records} == {"bfloat16"}
    write_log(directory / "wal-1.log", after)
    # the checkpoint plus the log after it
    found = recover(BF_CFG, 0, directory)
    assert found.checkpoint == 1 and found.replayed == len(after)
    assert kept_bits(found.state) == live
    # the whole log from the empty state, read back from its file
    whole = tmp_path / "whole" / "shard-0"
    whole.mkdir(parents=True)
    write_log(whole / "wal-0.log", first + after)
    found = recover(BF_CFG, 0, whole)
    assert found.checkpoint == 0 and found.replayed == len(first + after)
    assert kept_bits(found.state) == live
    # and the live events replayed as they are
    replica = ShardState(BF_CFG, 0)
    for event in first + after:
        replica.apply(event)
    assert kept_bits(replica) == live
    # and a state restored from the checkpoint file steps on to the same bits
    meta, arrays = read_checkpoint(directory / "checkpoint-1.ckpt")
    restored = restore_state(BF_CFG, 0, meta, arrays)
    run_steps(BF_CFG, 5, restored, plan, start=7)
    assert kept_bits(restored) == live


def test_a_shard_set_to_the_other_dtype_refuses_the_data_dir(tmp_path):
    f32_cfg = replace(BF_CFG, momentum_dtype="float32")
    state, _, events = run_steps(BF_CFG, 3)
    meta, arrays = export_state(state)
    with pytest.raises(MomentumDtypeError) as caught:
        restore_state(f32_cfg, 0, meta, arrays)
    assert (caught.value.saved, caught.value.configured) == ("bfloat16", "float32")
    assert "--momentum-dtype bfloat16" in str(caught.value)
    # a float32 checkpoint (and one written before the field: float32) is refused by bfloat16
    f32_state, _, f32_events = run_steps(f32_cfg, 3)
    meta32, arrays32 = export_state(f32_state)
    del meta32["momentum_dtype"]
    with pytest.raises(MomentumDtypeError):
        restore_state(BF_CFG, 0, meta32, arrays32)
    # a logged step is replayed only with the dtype it ran with
    replica = ShardState(f32_cfg, 0)
    with pytest.raises(MomentumDtypeError, match="logged step"):
        for event in events:
            replica.apply(event)
    assert "momentum" not in event_to_record(f32_events[2])[0]  # float32 records as before
    # recovery says so, with the named error as the cause
    directory = tmp_path / "shard-0"
    directory.mkdir()
    write_log(directory / "wal-0.log", events)
    with pytest.raises(DurabilityError, match="momentum_dtype=float32") as caught:
        recover(f32_cfg, 0, directory)
    assert isinstance(caught.value.__cause__, MomentumDtypeError)


def test_bf16_momentum_keeps_two_bytes_per_parameter_less():
    def kept_bytes(cfg):
        state, _, _ = run_steps(cfg, 4)
        total = params = 0
        for frag in state.fragments.values():
            params += frag.params.shape[0]
            total += frag.params.nbytes + frag.residual.nbytes
            total += sum(np.asarray(leaf).nbytes for leaf in frag.opt_state)
        return total, params

    f32_total, n = kept_bytes(replace(BF_CFG, momentum_dtype="float32"))
    bf_total, n_bf = kept_bytes(BF_CFG)
    assert n == n_bf
    assert f32_total - bf_total == 2 * n
    assert bf_total - 8 * n == f32_total - 10 * n  # params 4 + momentum 2 + residual 2 (+ scalars)


def test_status_reports_the_momentum_dtype():
    assert BF_CFG.outer_report()["momentum_dtype"] == "bfloat16"
    assert ShardConfig(momentum_dtype="float32").outer_report()["momentum_dtype"] == "float32"
