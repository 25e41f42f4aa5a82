"""The final global evaluation: probe.global_params / wait_merged and `diloco-worker eval`.

Real shards serve in threads on random 127.0.0.1 ports; islands are real `Client`s;
the CLI runs as a subprocess. No mocks.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np
import pytest
from client_helpers import clients
from conftest import WAIT_S, free_port, wait_for
from shard_helpers import delta_frames, small_flat

import codec
from paramserver.plumbing import probe
from worker import model as model_lib
from worker.config import IslandConfig

ROOT = Path(__file__).resolve().parent.parent
EVAL_FLAGS = ("--model", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "2")


@pytest.fixture
def client():
    yield from clients()


def tiny_flat() -> dict[str, np.ndarray]:
    params = model_lib.init_params(model_lib.MODEL_CONFIGS["tiny"], 0)
    return codec.flatten(jax.tree_util.tree_map(np.asarray, params))


def run_eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", "eval", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
    )


# -- probe.global_params / wait_merged ---------------------------------------------


@pytest.mark.timeout(60)
def test_global_params_equal_the_joined_params_bit_for_bit(cluster, client):
    c = cluster(2)
    joined = client(c.connect, "a").join(small_flat(0))
    plan, flat, versions = probe.global_params(c.connect)
    assert plan.hash == joined.plan.hash and plan.num_shards == 2
    assert versions == joined.versions
    assert set(flat) == set(joined.params)
    for name, value in joined.params.items():
        assert flat[name].dtype == np.float32
        np.testing.assert_array_equal(flat[name], value)


@pytest.mark.timeout(60)
def test_after_a_push_wait_merged_returns_and_global_params_read_the_new_version(cluster, client):
    c = cluster(2)
    a = client(c.connect, "a")
    joined = a.join(small_flat(0))
    frag = joined.plan.fragments_of(1)[0]  # a fragment on the second shard
    delta = np.full(frag.size, 0.01, np.float32)
    a.push(frag.index, 1, joined.versions[frag.index], 1000, 10, delta_frames(delta))
    wait_for(lambda: a.stats()["acked"] == 1, "the ack")

    status = probe.wait_merged(c.connect, timeout_s=WAIT_S)
    assert len(status["shards"]) == 2
    for shard in status["shards"]:
        assert "error" not in shard and not any(shard["pending"].values())
    _plan, flat, versions = probe.global_params(c.connect)
    assert versions[frag.index] == joined.versions[frag.index] + 1
    assert sum(versions.values()) == sum(sum(s["versions"].values()) for s in status["shards"])
    moved = joined.plan.gather(flat, frag.index)
    assert not np.array_equal(moved, joined.plan.gather(joined.params, frag.index))
    updates: list = []
    wait_for(lambda: updates.extend(a.poll_updates()) or updates, "the update")
    (update,) = updates
    np.testing.assert_array_equal(moved, update.values)  # what the islands see, bit for bit
    for other in joined.plan.fragments:
        if other.index != frag.index:
            np.testing.assert_array_equal(
                joined.plan.gather(flat, other.index),
                joined.plan.gather(joined.params, other.index),
            )


@pytest.mark.timeout(60)
def test_wait_merged_names_what_is_pending_then_returns_once_merged(cluster, client):
    c = cluster(1, mode="sync")  # sync: a step waits for every live island
    a, b = client(c.connect, "a"), client(c.connect, "b")
    joined = a.join(small_flat(0))
    b.join(small_flat(0))
    size = joined.plan.fragments[0].size
    a.push(0, 1, joined.versions[0], 100, 5, delta_frames(np.full(size, 0.1, np.float32)))
    wait_for(lambda: a.stats()["acked"] == 1, "a's ack")
    with pytest.raises(probe.ProbeError, match=r"not merged within 0.3s: shard 0 .*fragment 0: 1"):
        probe.wait_merged(c.connect, timeout_s=0.3, poll_s=0.05)
    stop = threading.Event()
    stop.set()
    with pytest.raises(probe.ProbeError, match="stopped while waiting"):
        probe.wait_merged(c.connect, timeout_s=WAIT_S, stop=stop)

    b.push(0, 1, joined.versions[0], 100, 5, delta_frames(np.full(size, 0.2, np.float32)))
    status = probe.wait_merged(c.connect, timeout_s=WAIT_S, poll_s=0.05)
    assert status["shards"][0]["pending"] == {"0": 0, "1": 0}
    assert status["shards"][0]["versions"]["0"] == joined.versions[0] + 1


@pytest.mark.timeout(60)
def test_an_uninitialized_cluster_is_named_as_such(cluster):
    c = cluster(2)
    with pytest.raises(probe.ProbeError, match="not initialized: no island has joined"):
        probe.global_params(c.connect)
    with pytest.raises(probe.ProbeError, match="not initialized"):
        probe.wait_merged(c.connect, timeout_s=1.0)


@pytest.mark.timeout(30)
def test_an_unreachable_shard_is_a_probe_error():
    dead = f"tcp://127.0.0.1:{free_port()}"
    with pytest.raises(probe.ProbeError, match=f"no reply from {dead}"):
        probe.global_params(dead, timeout_s=0.3)
    with pytest.raises(probe.ProbeError, match="no reply"):
        probe.wait_merged(dead, timeout_s=0.3)


# -- worker.evaluate / diloco-worker eval --------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cli_eval_json_against_a_live_cluster_equals_the_in_process_evaluation(cluster, client):
    from worker.evaluate import evaluate_global

    c = cluster(2)
    joined = client(c.connect, "a").join(tiny_flat())
    proc = run_eval("--connect", c.connect, "--json", "--wait-s", "10", *EVAL_FLAGS)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert math.isfinite(result["eval_loss"]) and 4.0 < result["eval_loss"] < 7.0  # ~ln 256
    assert result["versions"] == {str(f): v for f, v in joined.versions.items()}
    assert result["version_sum"] == sum(joined.versions.values())
    assert result["pending"] == 0

    cfg = IslandConfig(model="tiny", batch_size=4, seq_len=32, eval_batches=2)
    here = evaluate_global(cfg, c.connect, wait_s=10.0)
    assert here == result  # same definition, same numbers (1 CPU device each)

    batch_means = [evaluate_global(replace(cfg, eval_batches=1), c.connect, 10.0)]
    assert result["eval_batches"] == 2 and result["eval_loss_se"] > 0  # over the 2 batches
    assert batch_means[0]["eval_loss_se"] is None  # one batch: no spread to measure

    flags = [f for f in EVAL_FLAGS if f not in ("--eval-batches", "2")]  # eval's own default
    text = run_eval("--connect", c.connect, "--wait-s", "10", *flags)
    assert text.returncode == 0, text.stderr[-2000:]
    assert text.stdout.startswith("eval_loss ") and "version sum" in text.stdout
    assert "standard error" in text.stdout and "32 x 4 x 32 held-out tokens" in text.stdout


@pytest.mark.timeout(120)
def test_cli_eval_errors_are_one_line_and_non_zero(cluster, client):
    dead = f"tcp://127.0.0.1:{free_port()}"
    for args, code in (
        (("--connect", dead, "--wait-s", "0.5"), 1),  # nobody there
        (("--connect", "nonsense"), 2),  # not an endpoint
        (("--connect", dead, "--wait-s", "-1"), 2),
    ):
        proc = run_eval(*args, *EVAL_FLAGS)
        assert proc.returncode == code, (args, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert lines[0].startswith("diloco-worker"), lines

    c = cluster(1)  # initialized with another model than --model tiny
    client(c.connect, "a").join(small_flat(0))
    proc = run_eval("--connect", c.connect, "--wait-s", "5", *EVAL_FLAGS)
    assert proc.returncode == 2, proc.stderr
    assert "not those of model 'tiny'" in proc.stderr and "Traceback" not in proc.stderr
    assert "cluster's parameters (168 parameters in 2 leaves)" in proc.stderr  # both labelled
    assert "(131,712 parameters in 12 leaves)" in proc.stderr
    assert "leaf 'a/w' is in the cluster only" in proc.stderr


@pytest.mark.timeout(180)
def test_cli_eval_reads_a_token_file_with_the_vocabulary_the_islands_trained(
    cluster, client, tmp_path
):
    vocab = 512
    path = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, vocab, 20_000).astype(np.uint16).tofile(path)
    params = model_lib.init_params(model_lib.model_config("tiny", vocab), 0)
    c = cluster(1)
    client(c.connect, "a").join(codec.flatten(jax.tree_util.tree_map(np.asarray, params)))
    flags = ("--connect", c.connect, "--wait-s", "10", *EVAL_FLAGS, "--data", str(path))
    proc = run_eval(*flags, "--json", "--vocab-size", str(vocab))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert abs(result["eval_loss"] - math.log(vocab)) < 0.2  # a fresh model: ~uniform over 512
    wrong = run_eval(*flags)  # the default vocabulary, 256: another model than the cluster's
    assert wrong.returncode == 2 and "Traceback" not in wrong.stderr
    assert "with vocab 256" in wrong.stderr and "--vocab-size" in wrong.stderr


def test_heldout_identity_names_the_data_and_the_heldout_rule(tmp_path):
    from worker.data import heldout_identity

    text = tmp_path / "other.txt"
    text.write_bytes(bytes(range(256)) * 400)
    base = IslandConfig()
    same = heldout_identity(base)
    assert same == heldout_identity(IslandConfig(island="b", eval_batches=32))  # not eval's size
    others = {
        heldout_identity(replace(base, data=str(text))),
        heldout_identity(replace(base, heldout_fraction=0.1)),
    }
    assert same not in others and len(others) == 2
    assert heldout_identity(replace(base, data_shards=4)) == same  # the held-out part is common


@pytest.mark.timeout(180)
def test_cli_eval_warns_when_the_islands_trained_on_another_heldout_set(cluster, client, tmp_path):
    from worker.data import heldout_identity

    c = cluster(1)
    client(c.connect, "a").join(tiny_flat())
    island = tmp_path / "island-a"  # the status an island on the built-in corpus records
    island.mkdir()
    (island / "status.json").write_text(
        json.dumps({"island": "a", "data_id": heldout_identity(IslandConfig())})
    )
    text = tmp_path / "other.txt"
    text.write_bytes(bytes(range(256)) * 400)
    proc = run_eval("--connect", c.connect, "--wait-s", "5", "--json", "--data-dir", str(island),
                    "--data", str(text), *EVAL_FLAGS)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["data_id"] == heldout_identity(IslandConfig(data=str(text)))
    warning = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert len(warning) == 1 and "island a" in warning[0], proc.stderr
    assert heldout_identity(IslandConfig()) in warning[0] and result["data_id"] in warning[0]
    assert "--data" in warning[0] and "Traceback" not in proc.stderr
