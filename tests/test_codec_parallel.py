"""Threaded encode and decode: same bytes and values as one thread, errors still
name the tensor, a failed job leaves nothing running, and a forked child
encodes without the parent's threads."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import codec
from codec import parallel

ROOT = Path(__file__).resolve().parent.parent

MAKERS = {
    "int8": lambda t: codec.int8(zstd_threads=t),
    "int8-nozstd": lambda t: codec.int8(zstd_level=None, zstd_threads=t),
    "int4": lambda t: codec.int4(zstd_threads=t),
    "raw-bf16": lambda t: codec.raw("bfloat16", zstd_threads=t),
    "topk": lambda t: codec.topk(density=0.05, chunk=512, zstd_threads=t),
    "int8-stochastic": lambda t: codec.int8(stochastic=True, seed=3, zstd_threads=t),
}


@pytest.fixture
def many_jobs(monkeypatch):
    """Small frames and pieces, so that a small tree makes many parallel jobs."""
    monkeypatch.setattr(codec.format, "FRAME_BYTES", 4096)
    monkeypatch.setattr(codec.schemes, "PIECE_ELEMENTS", 2048)
    monkeypatch.setattr(codec.sparse, "ENCODE_PIECE", 2048)
    monkeypatch.setattr(codec.readers, "PIECE_ELEMENTS", 2048)


def tree(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "a": rng.standard_normal(30_001).astype(np.float32),
        "b": {"c": rng.standard_normal((70, 90)).astype(np.float16)},
        "d": np.float32(1.5).reshape(()),
        "e": np.zeros((0, 3), np.float32),
    }


@pytest.mark.parametrize("name", MAKERS)
def test_threads_give_the_same_frames_state_and_values(name, many_jobs):
    outputs = []
    for threads in (0, 3):
        c = MAKERS[name](threads)
        x = tree()
        state = c.init(x)
        frames = []
        for r in range(3):
            f, state = c.encode(tree(r), state)
            frames.append([bytes(p) for p in f])
        outputs.append((frames, codec.flatten(state.residual_tree())))
    (f0, r0), (f1, r1) = outputs
    assert len(f0[0]) >= 3 and f0 == f1
    for k in r0:
        assert np.array_equal(r0[k], r1[k]), k
    for threads in (2, 4):
        for k, v in codec.flatten(codec.decode(f0[-1], threads=threads)).items():
            assert np.array_equal(v, codec.flatten(codec.decode(f0[-1]))[k]), k


@pytest.mark.parametrize("name", ["int8", "topk", "raw-bf16"])
def test_non_finite_in_a_later_piece_names_its_tensor(name, many_jobs):
    c = MAKERS[name](2)
    x = tree()
    state = c.init(x)
    x["a"][29_999] = np.nan
    with pytest.raises(codec.CodecError, match="'a'"):
        c.encode(x, state)
    x["a"][29_999] = 0
    frames, _ = c.encode(x, state)  # the failed encode left the state usable
    assert codec.decode(frames, threads=2)["a"].shape == (30_001,)


def test_run_all_runs_every_job_and_raises_the_first_failure():
    pool = parallel.pool(3)
    done = []

    def job(i):
        done.append(i)
        if i in (5, 9):
            raise RuntimeError(f"job {i}")
        return i * i

    assert parallel.run_all(pool, lambda i: i * i, [(i,) for i in range(50)]) == [
        i * i for i in range(50)
    ]
    with pytest.raises(RuntimeError, match="job 5"):
        parallel.run_all(pool, job, [(i,) for i in range(20)])
    assert sorted(done) == list(range(20))
    with pytest.raises(codec.CodecError, match="threads.*-2"):
        codec.decode([b""], threads=-2)


FORK_SCRIPT = """
import multiprocessing, numpy as np, codec
def child(queue):
    x = {"x": np.arange(100_000, dtype=np.float32)}
    frames, _ = codec.int8(zstd_threads=2).encode(x)
    queue.put(float(codec.decode(frames, threads=2)["x"][-1]))
codec.int8(zstd_threads=2).encode({"x": np.ones(50_000, np.float32)})  # the parent's pool exists
ctx = multiprocessing.get_context("fork")
queue = ctx.Queue()
proc = ctx.Process(target=child, args=(queue,))
proc.start()
value = queue.get(timeout=30)
proc.join(30)
print(proc.exitcode, value)
"""


@pytest.mark.timeout(90)
def test_a_forked_child_gets_fresh_pools():
    # forked from a fresh interpreter: this test process may hold JAX's threads, and
    # forking a process with JAX loaded can deadlock
    proc = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT], capture_output=True, text=True, timeout=80, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    exitcode, value = proc.stdout.split()
    assert int(exitcode) == 0 and abs(float(value) - 99_999) < 99_999 / 254
