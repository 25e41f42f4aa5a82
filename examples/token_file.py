"""Our transformer on a token file: a nanoGPT-style flat .bin of uint16 ids, as an island.

The script writes its own token file (a synthetic language of VOCAB ids where each
token has four likely successors, so a model can learn it), then trains this
project's transformer (`worker.model`, `worker.train.InnerTrainer`) on it through
the public API (`worker.join`, `Session.step`) against a local 2-shard server that
it starts and stops (or the server of --connect), and prints the global model's
held-out loss. The data is what `diloco-worker start --data FILE.bin --data-dtype
uint16 --vocab-size VOCAB` reads: memory-mapped, one held-out split for all islands.

    python examples/token_file.py [--steps 60] [--inner-steps 10] [--json]
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from local_server import cluster, example_parser, global_model, print_summary

import worker
from worker import data, model
from worker.config import IslandConfig
from worker.train import InnerConfig, InnerTrainer

VOCAB = 512
BATCH, SEQ_LEN = 8, 32


def write_token_file(path: Path, tokens: int, seed: int = 0) -> Path:
    """A flat uint16 file of `tokens` ids (the nanoGPT train.bin layout: no header)."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, VOCAB, size=(VOCAB, 4))  # each id's four likely next ids
    ids = np.empty(tokens, dtype=np.uint16)
    ids[0] = 0
    choices = rng.integers(0, 4, size=tokens)
    for i in range(1, tokens):
        ids[i] = successors[ids[i - 1], choices[i]]
    ids.tofile(path)
    return path


def main() -> None:
    parser = example_parser(__doc__, steps=60)
    parser.add_argument("--tokens", type=int, default=100_000, help="tokens in the file")
    args = parser.parse_args()
    with cluster(args) as (connect, out):
        path = write_token_file(out / "tokens.bin", args.tokens)
        cfg = IslandConfig(island="tokens", data=str(path), data_dtype="uint16",
                           vocab_size=VOCAB, data_shards=1, batch_size=BATCH, seq_len=SEQ_LEN,
                           data_dir=str(out / "tokens"))  # fmt: skip
        own = data.island_data(cfg)  # memory-mapped; its shard and the common held-out set
        model_cfg = model.model_config("tiny", cfg.vocab_size)
        init = model.init_params(model_cfg, seed=0)
        inner = InnerConfig(batch_size=BATCH, seq_len=SEQ_LEN, lr=1e-2, warmup_steps=10)
        with worker.join(connect, island=cfg.island, params=init, inner_steps=args.inner_steps,
                         data_dir=cfg.data_dir) as session:  # fmt: skip
            trainer = InnerTrainer(model_cfg, inner, session.params)
            with session.caller_time():  # evaluation, not training: out of goodput
                initial = trainer.evaluate(own.eval_set)
            for _ in range(args.steps):
                loss = trainer.step(own.sampler.next())
                new = session.step(trainer.params, tokens=BATCH * SEQ_LEN)
                if new is not trainer.params:  # a global version was folded in
                    trainer.set_params(new)
            pushes = session.stats.get("pushes")
        print(f"island tokens: {args.steps} steps on {path.name} ({args.tokens} uint16 ids, "
              f"vocab {VOCAB}), last train loss {loss:.3f}, {pushes} pushes", flush=True)  # fmt: skip
        params, version = global_model(connect, like=init)
        final = trainer.evaluate(own.eval_set, params=params)
    print_summary(
        {"initial_loss": initial, "global_loss": final, "global_version": version,
         "uniform_loss": float(np.log(VOCAB))},
        args.json,
        f"global model: held-out loss {initial:.3f} at start -> {final:.3f} nats/token "
        f"(version {version}; uniform = {np.log(VOCAB):.3f})",
    )  # fmt: skip


if __name__ == "__main__":
    main()
