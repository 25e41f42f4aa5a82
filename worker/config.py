"""`IslandConfig`: every setting of one island daemon, validated at load.

Loaded by `diloco-worker` as defaults <- TOML file (`--config`) <- environment
(`DILOCO_WORKER_<FIELD>`) <- flags, through `paramserver.plumbing.settings`.
"""

from __future__ import annotations

import dataclasses

from paramserver.client import ClientConfig, ClientConfigError
from paramserver.plumbing.exposure import refusal
from paramserver.plumbing.validate import Checks, endpoint_problem
from worker.exchange import MERGE_RULES

CODECS = ("int8", "int4", "float32", "bfloat16", "topk")
PARAM_SHARDINGS = ("replicated", "fsdp")  # worker.device_layout (imports JAX) implements them
DATA_DTYPES = ("uint16", "uint32")  # id types of a flat .bin token file (worker.data)
MODEL_NAMES = ("tiny", "small", "base")  # worker.model.MODEL_CONFIGS defines each (imports JAX)
CONNECT_SCHEMES = ("tcp://", "ipc://")  # what a shard binds (never inproc: another process)
EXCHANGES = ("device", "host")  # where the delta, quantize and fold run (worker.session)


class IslandConfigError(ValueError):
    """An island setting is invalid; the message names the field and what to do."""


@dataclasses.dataclass(frozen=True)
class IslandConfig:
    """Settings of one island (one worker process)."""

    # ROUTER endpoint of any shard (normally shard 0); one that is not loopback needs the
    # CURVE key files or insecure
    connect: str = "tcp://127.0.0.1:5555"
    island: str = "island-0"  # stable island id; a restarted island keeps it
    # pid, log, status.json, metrics.jsonl, outbox.bin (deltas until acked: worker.outbox) and
    # session.token (worker.session_token) go here; one running island process per data dir
    data_dir: str = "runs/worker"
    # JAX persistent compilation cache: "" = <data_dir>/jax-cache, "off" = none, or a shared
    # directory (trusted: never one that others can write to); one per process: the first
    # island or session of a process sets it, later ones in that process use it
    compile_cache_dir: str = ""
    model: str = "tiny"  # named model config: tiny | small | base
    seed: int = 0  # model init seed (used only if this island initialises the cluster)
    # text file or directory of text files (bytes); a token file: FILE.bin (flat ids of
    # --data-dtype, nanoGPT layout) or FILE.npy (1-D integer array), memory-mapped; "" = the
    # embedded corpus
    data: str = ""
    data_dtype: str = "uint16"  # token ids of a .bin --data file: uint16 | uint32
    vocab_size: int = 256  # model vocabulary: 256 = bytes; a token file needs max id + 1 or more
    data_shard: int = -1  # this island's data shard; -1 = derived from the island id
    data_shards: int = 8  # number of disjoint training shards the corpus is cut into
    heldout_fraction: float = 0.05  # share of the corpus kept for evaluation (all islands)
    inner_steps: int = 50  # H: AdamW steps per round between two deltas
    batch_size: int = 16  # sequences per inner step
    seq_len: int = 128  # bytes of context per sequence
    lr: float = 3e-3  # inner AdamW peak learning rate
    warmup_steps: int = 50  # inner learning-rate warm-up steps
    speed: float = 1.0  # emulated chip speed: 0.5 pads every step to twice its time
    jitter: float = 0.0  # multiplicative step-time noise (0.1 = +-10%), emulated
    dynamic_steps: bool = False  # slow islands run speed * inner_steps per round
    codec: str = "int8"  # delta encoding: int8 (no zstd) | int4 | float32 | bfloat16 | topk
    block_size: int = 0  # quantization block (topk: chunk); 0 = the codec's default
    # codec topk: share of entries sent per chunk, in (0, 1]. Islands default to 0.05 with
    # ef_decay 0.95 (codec.topk's own defaults are 0.02 and 1.0): within 3% of int8's
    # held-out loss from 30 rounds on, 2 seeds (docs/results.md, top-k against int8)
    topk_density: float = 0.05
    topk_bits: int = 2  # codec topk: bits per sent value, 2 or 4
    # codec topk: the error-feedback residual is multiplied by this before each round's
    # selection, in (0, 1]; 1 = plain error feedback (codec.topk's ef_decay)
    topk_ef_decay: float = 0.95
    merge_rule: str = "keep-progress"  # folding a new global version: keep-progress | overwrite
    # device: delta, int8/int4 quantize and fold on the parameters' devices, only codes cross
    # to the host (other codecs use the host) | host: numpy on a host copy of the parameters
    exchange: str = "device"
    # push fragment p of P at inner step floor(p * H / P) of each round, each with its own delta
    # since its own last push, instead of all at the round's end: the peak rate at the island's
    # link falls by about P (worker.push_thread); a cluster of mode sync is refused
    streaming: bool = False
    # rounds (or streamed fragments) whose exchange, codes to the host, outbox fsync and push,
    # runs on a thread beside the next inner steps; a step past them waits (lost time);
    # 0 = inside the step that takes the delta (worker.push_thread)
    overlap_rounds: int = 1
    # quorum mode: a fragment whose last delta is not merged yet skips its push and carries the
    # work into the next one (fewer, larger deltas against newer bases when the shards lag;
    # worker.push_thread.unblocked); false = push every round as sync and async islands do
    skip_stale_pushes: bool = True
    eval_every: int = 2  # rounds between evaluations of the global parameters (0 = never)
    eval_batches: int = 4  # held-out batches per evaluation
    max_rounds: int = 0  # stop after this many rounds (0 = until stopped)
    start_file: str = ""  # after joining, wait until this file exists (a start barrier); "" = none
    devices: int = 0  # local devices for data parallel inside the island (0 = all)
    # an island of several processes (jax.distributed; worker.process_group): process 0's
    # HOST:PORT, the process count and this process's index; ""/0/-1 = from JAX_COORDINATOR_
    # ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (else one process)
    coordinator: str = ""
    num_processes: int = 0  # processes of a multi-process island; 0 = JAX_NUM_PROCESSES, else 1
    process_id: int = -1  # this process's index in the island; -1 = JAX_PROCESS_ID, else 0
    param_sharding: str = "replicated"  # parameters + AdamW state on the mesh: replicated | fsdp
    cpu: int = -1  # pin the process to this CPU core (-1 = no pinning)
    flush_timeout_s: float = 10.0  # on stop, wait this long for unacked deltas
    join_timeout_s: float = ClientConfig.join_timeout_s  # give up joining after this long
    heartbeat_interval_s: float = ClientConfig.heartbeat_interval_s  # period to every shard
    max_unacked: int = ClientConfig.max_unacked  # deltas outstanding before a push blocks
    curve_secret_key_file: str = ""  # CURVE: this island's NAME.key_secret; "" = no CURVE
    curve_server_key_file: str = ""  # CURVE: the shards' public key file (server.key)
    # send in plain TCP (no CURVE) to a shard that is not on loopback: only on a trusted,
    # firewalled network (without it such an endpoint is refused)
    insecure: bool = False
    log_level: str = "INFO"  # DEBUG | INFO | WARNING | ERROR

    def __post_init__(self) -> None:
        check = Checks("IslandConfig", IslandConfigError)
        problem = self.connect_problem()
        if problem is not None:  # said in the words of --connect and join(connect=...)
            raise IslandConfigError(f"connect={self.connect!r}: {problem}")
        try:  # the connection's other rules (island id, timeouts, CURVE pair) are the client's
            self.client_config()
        except ClientConfigError as exc:
            raise IslandConfigError(str(exc).replace("ClientConfig.", "IslandConfig.", 1)) from None
        check.choice("model", self.model, MODEL_NAMES)
        check.choice("codec", self.codec, CODECS)
        check.choice("data_dtype", self.data_dtype, DATA_DTYPES)
        check.integer("vocab_size", self.vocab_size, 2, 2**31 - 1)  # ids travel as int32
        check.number("topk_density", self.topk_density, above=0.0, high=1.0)
        check.choice("topk_bits", self.topk_bits, (2, 4))
        check.number("topk_ef_decay", self.topk_ef_decay, above=0.0, high=1.0)
        check.choice("merge_rule", self.merge_rule, MERGE_RULES)
        check.choice("exchange", self.exchange, EXCHANGES)
        check.choice("param_sharding", self.param_sharding, PARAM_SHARDINGS)
        for field in ("speed", "lr", "flush_timeout_s"):
            check.number(field, getattr(self, field), above=0.0)
        check.number("jitter", self.jitter, low=0.0, below=1.0)
        check.number("heldout_fraction", self.heldout_fraction, above=0.0, below=0.5)
        for field, low in (
            ("inner_steps", 1),
            ("batch_size", 1),
            ("seq_len", 2),
            ("data_shards", 1),
            ("warmup_steps", 0),
            ("eval_every", 0),
            ("eval_batches", 1),
            ("max_rounds", 0),
            ("devices", 0),
            ("num_processes", 0),
            ("process_id", -1),
            ("block_size", 0),
            ("cpu", -1),
            ("data_shard", -1),
            ("seed", 0),
            ("overlap_rounds", 0),
        ):
            check.integer(field, getattr(self, field), low)
        check.require(
            self.data_shard < self.data_shards,
            "data_shard",
            self.data_shard,
            f"must be < data_shards ({self.data_shards})",
        )
        check.log_level("log_level", self.log_level)

    def connect_problem(self) -> str | None:
        """What is wrong with `connect` as the address of a shard, or None.

        Only what the shards offer counts: a ROUTER endpoint over tcp (or ipc on
        one host). A plain-TCP endpoint off loopback needs the CURVE key files or
        `insecure`.

        Returns:
            One phrase saying what to give, or None.
        """
        problem = endpoint_problem(self.connect, CONNECT_SCHEMES)
        if problem is not None:
            return f"{problem}; give a shard's ROUTER endpoint, such as tcp://127.0.0.1:5555"
        return refusal(
            self.connect,
            curve=bool(self.curve_secret_key_file),
            insecure=self.insecure,
            risk="anyone on the way could read the deltas or pose as the server",
            keys="curve_secret_key_file and curve_server_key_file (--curve-...-file)",
            opt_out="insecure=True (--insecure)",
        )

    def client_config(self) -> ClientConfig:
        """This island's connection settings (the client's own defaults for the rest).

        Returns:
            The ClientConfig the island's `Client` uses.

        Raises:
            ClientConfigError: a connection setting is invalid.
        """
        return ClientConfig(
            connect=self.connect,
            island=self.island,
            heartbeat_interval_s=self.heartbeat_interval_s,
            join_timeout_s=self.join_timeout_s,
            max_unacked=self.max_unacked,
            curve_secret_key_file=self.curve_secret_key_file,
            curve_server_key_file=self.curve_server_key_file,
            insecure=self.insecure,
        )
