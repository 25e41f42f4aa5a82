"""The daemon is a user of the public API: it and a library loop with the same seed, data and
settings push bit-equal frames in round 1. Real shards in threads, real sockets."""

from __future__ import annotations

import threading

import jax_cache
import pytest
from client_helpers import RecordingClient
from conftest import Cluster

import worker
from worker import data, model
from worker.config import IslandConfig
from worker.session_config import session_config
from worker.train import InnerConfig, InnerTrainer

pytestmark = pytest.mark.timeout(180)  # two clusters and two compiles of the model


def _cfg(tmp_path, connect: str, name: str) -> IslandConfig:
    return IslandConfig(
        connect=connect,
        island="same",
        data_dir=str(tmp_path / name),
        compile_cache_dir=jax_cache.DIR,
        inner_steps=4,
        batch_size=4,
        seq_len=16,
        warmup_steps=2,
        eval_every=0,
        max_rounds=1,
        codec="int8",
        heartbeat_interval_s=0.2,
        flush_timeout_s=5.0,
    )


def _round_one(pushes: list[tuple]) -> list[tuple]:
    first = min(p.round for p in pushes)
    return [
        (p.fragment, p.base_version, p.tokens, p.steps, p.frames)
        for p in pushes
        if p.round == first
    ]


def test_the_daemon_and_a_library_loop_push_bit_equal_frames_in_round_one(tmp_path):
    from worker.island import Island

    made: list[RecordingClient] = []

    def factory(client_cfg):
        made.append(RecordingClient(client_cfg))
        return made[-1]

    daemon_cluster = Cluster(tmp_path / "d", shards=2)
    try:
        cfg = _cfg(tmp_path, daemon_cluster.connect, "daemon")
        assert Island(cfg, client_factory=factory).run(threading.Event()) == 0
    finally:
        daemon_cluster.stop()
    daemon_pushes = made.pop().pushes

    library_cluster = Cluster(tmp_path / "l", shards=2)
    try:
        cfg = _cfg(tmp_path, library_cluster.connect, "library")
        model_cfg = model.model_config(cfg.model, cfg.vocab_size)
        sampler = data.island_data(cfg).sampler
        inner = InnerConfig(lr=cfg.lr, warmup_steps=cfg.warmup_steps, batch_size=4, seq_len=16)
        settings = {
            "codec": "int8",
            "heartbeat_interval_s": 0.2,
            "compile_cache_dir": jax_cache.DIR,
        }
        session_cfg = session_config(cfg.connect, "same", 4, tmp_path / "library", settings)
        params = model.init_params(model_cfg, cfg.seed)
        with worker.Session(session_cfg, params, client_factory=factory) as session:
            trainer = InnerTrainer(model_cfg, inner, session.params)
            for _ in range(4):
                trainer.step(sampler.next())
                params = session.step(trainer.params, tokens=4 * 16)
                if params is not trainer.params:
                    trainer.set_params(params)
    finally:
        library_cluster.stop()
    library_pushes = made.pop().pushes

    daemon_round, library_round = _round_one(daemon_pushes), _round_one(library_pushes)
    assert len(daemon_round) >= 2  # every fragment of the 2-shard plan
    assert [p[:4] for p in daemon_round] == [p[:4] for p in library_round]
    assert [p[4] for p in daemon_round] == [p[4] for p in library_round]  # frames, bit for bit
