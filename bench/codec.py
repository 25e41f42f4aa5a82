"""Codec benchmark: ratio, error, error feedback and throughput of every scheme.

    diloco-bench codec [--quick] [--no-real] [--elements N] [--threads T]
    python -m bench.codec --quick

Data sets: (a) real deltas, the parameter change of a small JAX transformer
over consecutive rounds of AdamW steps on the embedded corpus (after a
warm-up), and (b) synthetic heavy-tailed deltas (Student-t, 3 degrees of
freedom). For each scheme it reports the compression ratio against fp32
bytes, the relative L2 error of one round, the relative error of the sum
over all rounds with and without error feedback, and encode/decode GB/s of
fp32 input next to numpy memcpy measured in the same run at the same size
(real deltas: timed on the parameter tree with each tensor's deltas of all
rounds stacked along a new leading axis, so that the data outgrows the caches
as a larger model's would; synthetic: on the large tensor, while the
accumulated error uses 1M-element synthetic rounds). Encode and decode run on
`--threads` threads (default: the machine's cores, at most 4); memcpy is one
thread, as numpy does it.

`topk` (density 0.02, 2 bits) is the sparse scheme: its ratio is against fp32
bytes of one round, its per-round error is that of one round without error
feedback, and its accumulated errors compare the sum of what was decoded over
all rounds with the true sum, with and without error feedback.

`single_core` is the target check of the host codec's speed: int8 as
`codec.int8()` builds it (block 256, zstd level 1, error feedback on) on one
thread, on the synthetic `--elements` tensor, each encode and each decode timed
right after a memcpy (np.copyto into an existing array) of the same fp32 bytes,
so a ratio is taken pair by pair while the machine's speed drifts; the median
ratio is compared with the targets (encode >= 0.15x, decode >= 0.25x memcpy).
Like the memcpy, decode writes into existing arrays there (`decode(frames,
out=tree)`), and encode carries its error-feedback state from round to round.
`stages` repeats it with `zstd_level=None` (quantize with error feedback and
a crc32 per frame; crc32 checks and dequantize).

`zstd_break_even` (per data set) says when `zstd_level=None` pays: the link
speed above which sending uncompressed frames is faster than compressing them,
``bytes saved / extra seconds``, once counting the encoder's compression alone
and once with the receiver's decompression too (end to end), from the
encode/decode timings of the scheme with and without zstd in the same run.
JSON on stdout, progress on stderr.
"""

import argparse
import os
import platform
import sys

import numpy as np

import codec
from bench import cli
from bench.common import emit_json, gbps, memcpy_gbps, progress, timed

SCHEMES = {
    "raw-fp32": lambda t: codec.raw("float32", zstd_threads=t),
    "raw-bf16": lambda t: codec.raw("bfloat16", zstd_threads=t),
    "int8": lambda t: codec.int8(zstd_threads=t),
    "int8+stochastic": lambda t: codec.int8(stochastic=True, seed=0, zstd_threads=t),
    "int8-block1024": lambda t: codec.int8(block_size=1024, zstd_threads=t),
    "int8-nozstd": lambda t: codec.int8(zstd_level=None, zstd_threads=t),
    "int4": lambda t: codec.int4(zstd_threads=t),
    "topk": lambda t: codec.topk(zstd_threads=t),
    "topk-nozstd": lambda t: codec.topk(zstd_level=None, zstd_threads=t),
    "topk-4bit": lambda t: codec.topk(bits=4, zstd_threads=t),
}
# scheme with zstd -> the same scheme without, for the break-even link speed
ZSTD_PAIRS = {"int8": "int8-nozstd", "topk": "topk-nozstd"}
# Targets on real deltas (scheme -> metric -> (comparison, bound)).
TARGETS = {
    "int8": {
        "ratio": (">=", 4.4),
        "rel_l2_per_round": ("<=", 0.015),
        "accumulated_rel_error_ef": ("<=", 0.002),
        "encode_over_memcpy": (">=", 0.15),
        "decode_over_memcpy": (">=", 0.25),
    },
    "int4": {"ratio": (">=", 7.5), "accumulated_rel_error_ef": ("<=", 0.02)},
}
# single_core targets: int8 encode/decode over memcpy of the same fp32 bytes, one thread
SINGLE_CORE_TARGETS = {"encode_over_memcpy": 0.15, "decode_over_memcpy": 0.25}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `diloco-bench codec`.

    Args:
        parser: the subcommand's parser.
    """
    parser.add_argument("--quick", action="store_true", help="small, fast run")
    parser.add_argument("--elements", type=int, default=None, help="synthetic tensor size")
    parser.add_argument("--rounds", type=int, default=None, help="rounds for accumulated error")
    parser.add_argument("--no-real", action="store_true", help="skip the real-delta part")
    parser.add_argument("--model", default="tiny", help="worker.model config for real deltas")
    parser.add_argument("--steps", type=int, default=None, help="AdamW steps per real round")
    parser.add_argument(
        "--threads",
        type=int,
        default=min(os.cpu_count() or 1, 4),
        help="encode/decode threads (0 or 1: one thread; default: cores, at most 4)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed repeats of each measurement (default 7, 3 with --quick)",
    )


def synthetic_rounds(elements: int, rounds: int, seed: int = 0) -> list[dict]:
    """Heavy-tailed synthetic deltas.

    Args:
        elements: elements per round.
        rounds: number of rounds.
        seed: generator seed.

    Returns:
        list of trees {"delta": float32 array}.
    """
    rng = np.random.default_rng(seed)
    return [
        {"delta": (rng.standard_t(3, elements) * 1e-3).astype(np.float32)} for _ in range(rounds)
    ]


def real_rounds(model_name: str, rounds: int, steps: int, warmup: int, tick) -> list[dict]:
    """Parameter deltas of a small transformer trained with AdamW on the corpus.

    Args:
        model_name: key of worker.model.MODEL_CONFIGS.
        rounds: consecutive rounds to record.
        steps: AdamW steps per round.
        warmup: steps before the first round.
        tick: callable advanced once per step (progress).

    Returns:
        list of trees shaped like the parameters: float32 delta (start - end of the round).
    """
    from worker import data, model, train

    cfg = model.MODEL_CONFIGS[model_name]
    inner = train.InnerConfig()
    train_bytes, _ = data.split_corpus(data.default_corpus(), 1, 0, 0.05)
    sampler = data.BatchSampler(train_bytes, inner.batch_size, inner.seq_len, seed=0)
    trainer = train.InnerTrainer(cfg, inner, model.init_params(cfg, seed=0), devices=1)
    for _ in range(warmup):
        trainer.step(sampler.next())
        tick()
    out = []
    for _ in range(rounds):
        start = codec.flatten(trainer.numpy_params())
        for _ in range(steps):
            trainer.step(sampler.next())
            tick()
        end = codec.flatten(trainer.numpy_params())
        out.append(codec.unflatten({k: (start[k] - end[k]).astype(np.float32) for k in start}))
    return out


def _elements(tree: dict) -> int:
    return sum(np.size(v) for v in codec.flatten(tree).values())


def _vector(tree: dict) -> np.ndarray:
    return np.concatenate([np.ravel(v).astype(np.float64) for v in codec.flatten(tree).values()])


def _accumulated(c, rounds: list[dict], feedback: bool) -> float:
    state = c.init(rounds[0]) if feedback else None
    total = np.zeros(sum(np.size(v) for v in codec.flatten(rounds[0]).values()))
    truth = np.zeros_like(total)
    for tree in rounds:
        frames, state = c.encode(tree, state)
        total += _vector(codec.decode(frames))
        truth += _vector(tree)
    return float(np.linalg.norm(total - truth) / np.linalg.norm(truth))


def measure_scheme(
    make,
    rounds: list[dict],
    acc_rounds: list[dict],
    speed_tree: dict,
    repeats: int,
    memcpy: dict,
    threads: int = 0,
) -> dict:
    """All figures of one scheme on one data set.

    Args:
        make: () -> Codec.
        rounds: trees for ratio and per-round error (first 5).
        acc_rounds: same-shaped trees, one per round, for the accumulated error.
        speed_tree: tree timed for encode/decode throughput.
        repeats: timed repeats for throughput.
        memcpy: memcpy gbps() at the size of speed_tree.
        threads: decode threads (the codec from `make` has its own).

    Returns:
        dict of figures.
    """
    c = make()
    fp32_bytes = 4 * _elements(rounds[0])
    ratios, errors = [], []
    for tree in rounds[: min(len(rounds), 5)]:
        frames, _ = c.encode(tree)
        ratios.append(fp32_bytes / sum(len(f) for f in frames))
        x = _vector(tree)
        errors.append(float(np.linalg.norm(_vector(codec.decode(frames)) - x) / np.linalg.norm(x)))
    box = {"state": c.init(speed_tree)}

    def encode():
        box["frames"], box["state"] = c.encode(speed_tree, box["state"])

    speed_bytes = 4 * _elements(speed_tree)
    enc = gbps(speed_bytes, timed(encode, repeats))
    dec = gbps(speed_bytes, timed(lambda: codec.decode(box["frames"], threads=threads), repeats))
    return {
        "speed_wire_bytes": sum(len(f) for f in box["frames"]),
        "ratio": float(np.mean(ratios)),
        "rel_l2_per_round": float(np.mean(errors)),
        "rel_l2_per_round_max": float(np.max(errors)),
        "accumulated_rel_error_ef": _accumulated(make(), acc_rounds, feedback=True),
        "accumulated_rel_error_no_ef": _accumulated(make(), acc_rounds, feedback=False),
        "encode_gbps": enc,
        "decode_gbps": dec,
        "encode_over_memcpy": enc["median"] / memcpy["median"],
        "decode_over_memcpy": dec["median"] / memcpy["median"],
    }


def measure_dataset(
    label: str, rounds: list[dict], acc_rounds: list[dict], speed_tree: dict, args, p
) -> dict:
    """Every scheme on one data set.

    Args:
        label: data set name (progress only).
        rounds: trees for ratio and per-round error.
        acc_rounds: same-shaped trees for the accumulated error.
        speed_tree: tree timed for throughput.
        args: parsed flags.
        p: rich Progress.

    Returns:
        {"elements", "rounds", "memcpy_gbps", "schemes": {name: figures}}.
    """
    memcpy = memcpy_gbps(4 * _elements(speed_tree))
    task = p.add_task(f"{label}: schemes", total=len(SCHEMES))
    schemes = {}
    for name, make in SCHEMES.items():
        p.update(task, description=f"{label}: {name}")
        schemes[name] = measure_scheme(
            lambda m=make: m(args.threads),
            rounds,
            acc_rounds,
            speed_tree,
            args.repeats,
            memcpy,
            args.threads,
        )
        p.advance(task)
    speed_bytes = 4 * _elements(speed_tree)
    return {
        "elements": _elements(rounds[0]),
        "accumulation_rounds": len(acc_rounds),
        "accumulation_elements": _elements(acc_rounds[0]),
        "speed_elements": _elements(speed_tree),
        "speed_tensors": len(codec.flatten(speed_tree)),
        "memcpy_gbps": memcpy,
        "schemes": schemes,
        "zstd_break_even": {
            name: break_even(schemes[name], schemes[plain], speed_bytes)
            for name, plain in ZSTD_PAIRS.items()
            if name in schemes and plain in schemes
        },
    }


def break_even(zstd: dict, plain: dict, speed_bytes: int) -> dict:
    """Link speed above which skipping zstd is faster, from one run's figures.

    Args:
        zstd: measure_scheme() figures of the scheme with zstd.
        plain: the same scheme with zstd_level=None.
        speed_bytes: fp32 bytes of the timed tree.

    Returns:
        bytes saved, extra seconds, and the break-even in Gbit/s (encode
        only, and end to end with decompression); None where zstd took no
        extra time (it then pays at any link speed).
    """

    def seconds(figures, key):
        return speed_bytes / (figures[key]["median"] * 1e9)

    saved = plain["speed_wire_bytes"] - zstd["speed_wire_bytes"]
    extra_enc = seconds(zstd, "encode_gbps") - seconds(plain, "encode_gbps")
    extra_dec = seconds(zstd, "decode_gbps") - seconds(plain, "decode_gbps")

    def gbit(extra):
        return 8 * saved / extra / 1e9 if extra > 0 else None

    return {
        "bytes_saved": saved,
        "bytes_saved_fraction": saved / plain["speed_wire_bytes"],
        "extra_encode_s": extra_enc,
        "extra_decode_s": extra_dec,
        "break_even_gbit_s_encode_only": gbit(extra_enc),
        "break_even_gbit_s_end_to_end": gbit(extra_enc + extra_dec),
    }


def single_core(tree: dict, repeats: int) -> dict:
    """int8 encode and decode on one thread, each against a memcpy timed just before it.

    Args:
        tree: the tree to encode (float32).
        repeats: timed (memcpy, encode, memcpy, decode) rounds.

    Returns:
        elements, the codec, medians of the per-pair ratios and GB/s, the same
        without zstd (`stages`), and the targets met or missed.
    """
    nbytes = 4 * _elements(tree)
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)

    def memcpy():
        np.copyto(dst, src)

    def paired(c) -> dict:
        box = {"state": c.init(tree)}
        out = codec.unflatten({k: np.empty_like(v) for k, v in codec.flatten(tree).items()})

        def encode():
            box["frames"], box["state"] = c.encode(tree, box["state"])

        def decode():
            codec.decode(box["frames"], threads=0, out=out)

        times: dict = {"memcpy": [], "encode": [], "decode": []}
        order = (("memcpy", memcpy), ("encode", encode), ("memcpy", memcpy), ("decode", decode))
        for _ in range(repeats + 1):  # the first round warms up (compiles, touches pages)
            for name, fn in order:
                times[name].append(timed(fn, 1, warmup=0)[0])
        copy, enc, dec = times["memcpy"][2:], times["encode"][1:], times["decode"][1:]
        return {
            "encode_over_memcpy": float(
                np.median([m / e for m, e in zip(copy[0::2], enc, strict=True)])
            ),
            "decode_over_memcpy": float(
                np.median([m / d for m, d in zip(copy[1::2], dec, strict=True)])
            ),
            "encode_gbps": gbps(nbytes, enc),
            "decode_gbps": gbps(nbytes, dec),
            "memcpy_gbps": gbps(nbytes, copy),
            "wire_bytes": sum(len(f) for f in box["frames"]),
        }

    c = codec.int8()
    out = {"elements": _elements(tree), "codec": repr(c), "threads": 0, **paired(c)}
    plain = paired(codec.int8(zstd_level=None))
    out["stages"] = {
        "encode_without_zstd_over_memcpy": plain["encode_over_memcpy"],
        "decode_without_zstd_over_memcpy": plain["decode_over_memcpy"],
    }
    out["targets"] = {
        key: {"value": out[key], "target": f">= {bound}", "met": out[key] >= bound}
        for key, bound in SINGLE_CORE_TARGETS.items()
    }
    return out


def check_targets(result: dict) -> dict:
    """Compare real-delta figures with the targets.

    Args:
        result: a measure_dataset() result.

    Returns:
        scheme -> metric -> {"value", "target", "met"}.
    """
    out = {}
    for scheme, metrics in TARGETS.items():
        figures = result["schemes"][scheme]
        out[scheme] = {}
        for metric, (op, bound) in metrics.items():
            value = figures[metric]
            met = value >= bound if op == ">=" else value <= bound
            out[scheme][metric] = {"value": value, "target": f"{op} {bound}", "met": met}
    return out


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print JSON.

    Args:
        args: parsed flags.

    Returns:
        exit status 0.
    """
    quick = args.quick
    args.elements = args.elements or (1 << 20 if quick else 1 << 24)
    args.rounds = args.rounds or (10 if quick else 50)
    args.repeats = args.repeats or (3 if quick else 7)
    args.steps = args.steps or (4 if quick else 8)
    warmup = 10 if quick else 100
    result = {
        "command": " ".join(sys.argv),
        "machine": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "cpus": os.cpu_count(),
            # other work on the machine slows every figure here, memcpy included
            "loadavg_1m_start": os.getloadavg()[0],
        },
        "threads": args.threads,
        "datasets": {},
    }
    with progress() as p:
        if not args.no_real:
            total = warmup + args.rounds * args.steps
            task = p.add_task(f"training {args.model} for real deltas", total=total)
            rounds = real_rounds(
                args.model, args.rounds, args.steps, warmup, lambda: p.advance(task)
            )
            flats = [codec.flatten(tree) for tree in rounds]
            stacked = codec.unflatten({k: np.stack([f[k] for f in flats]) for k in flats[0]})
            real = measure_dataset("real", rounds, rounds, stacked, args, p)
            real.update(model=args.model, steps_per_round=args.steps, warmup_steps=warmup)
            result["datasets"]["real"] = real
            result["targets_real"] = check_targets(real)
        task = p.add_task("synthetic data", total=1)
        big = synthetic_rounds(args.elements, 1, seed=1)
        small = synthetic_rounds(min(args.elements, 1 << 20), args.rounds, seed=2)
        p.advance(task)
        result["datasets"]["synthetic"] = measure_dataset("synthetic", big, small, big[0], args, p)
        task = p.add_task("int8 on one core", total=1)
        result["single_core"] = single_core(big[0], args.repeats)
        p.advance(task)
    result["machine"]["loadavg_1m_end"] = os.getloadavg()[0]
    emit_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(cli.main(["codec", *sys.argv[1:]]))
