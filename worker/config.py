"""`IslandConfig`: every setting of one island daemon, validated at load.

Loaded by `diloco-worker` as defaults <- TOML file (`--config`) <- environment
(`DILOCO_WORKER_<FIELD>`) <- flags, through `paramserver.plumbing.settings`.
"""

from __future__ import annotations

import dataclasses
import math

from paramserver.client import ClientConfig
from worker.exchange import MERGE_RULES

CODECS = ("int8", "int4", "float32", "bfloat16", "topk")
PARAM_SHARDINGS = ("replicated", "fsdp")  # worker.sharding (imports JAX) implements them
MODEL_NAMES = ("tiny", "small", "base")  # worker.model.MODEL_CONFIGS defines each (imports JAX)


class IslandConfigError(ValueError):
    """An island setting is invalid; the message names the field and what to do."""


@dataclasses.dataclass(frozen=True)
class IslandConfig:
    """Settings of one island (one worker process)."""

    connect: str = "tcp://127.0.0.1:5555"  # ROUTER endpoint of any shard (normally shard 0)
    island: str = "island-0"  # stable island id; a restarted island keeps it
    data_dir: str = "runs/worker"  # pid, log, status.json and metrics.jsonl go here
    # JAX persistent compilation cache: "" = <data_dir>/jax-cache, "off" = none, or a shared
    # directory (trusted: never one that others can write to)
    compile_cache_dir: str = ""
    model: str = "tiny"  # named model config: tiny | small | base
    seed: int = 0  # model init seed (used only if this island initialises the cluster)
    data: str = ""  # text file or directory of text files; "" = the embedded corpus
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
    codec: str = "int8"  # delta encoding: int8 | int4 | float32 | bfloat16 | topk
    block_size: int = 0  # quantization block (topk: chunk); 0 = the codec's default
    topk_density: float = 0.02  # codec topk: share of entries sent per chunk, in (0, 1]
    topk_bits: int = 2  # codec topk: bits per sent value, 2 or 4
    merge_rule: str = "keep-progress"  # folding a new global version: keep-progress | overwrite
    eval_every: int = 2  # rounds between evaluations of the global parameters (0 = never)
    eval_batches: int = 4  # held-out batches per evaluation
    max_rounds: int = 0  # stop after this many rounds (0 = until stopped)
    start_file: str = ""  # after joining, wait until this file exists (a start barrier); "" = none
    devices: int = 0  # local devices for data parallel inside the island (0 = all)
    # an island of several processes (jax.distributed; worker.multihost): process 0's
    # HOST:PORT, the process count and this process's index; ""/0/-1 = from JAX_COORDINATOR_
    # ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (else one process)
    coordinator: str = ""
    num_processes: int = 0
    process_id: int = -1
    param_sharding: str = "replicated"  # parameters + AdamW state on the mesh: replicated | fsdp
    cpu: int = -1  # pin the process to this CPU core (-1 = no pinning)
    flush_timeout_s: float = 10.0  # on stop, wait this long for unacked deltas
    join_timeout_s: float = ClientConfig.join_timeout_s  # give up joining after this long
    heartbeat_interval_s: float = ClientConfig.heartbeat_interval_s  # period to every shard
    curve_secret_key_file: str = ""  # CURVE: this island's NAME.key_secret; "" = no CURVE
    curve_server_key_file: str = ""  # CURVE: the shards' public key file (server.key)
    log_level: str = "INFO"  # DEBUG | INFO | WARNING | ERROR

    def __post_init__(self) -> None:
        def bad(field: str, rule: str) -> IslandConfigError:
            return IslandConfigError(f"{field} {rule}, got {getattr(self, field)!r}")

        if self.model not in MODEL_NAMES:
            raise bad("model", f"must be one of {', '.join(MODEL_NAMES)}")
        if self.codec not in CODECS:
            raise bad("codec", f"must be one of {', '.join(CODECS)}")
        if not (math.isfinite(self.topk_density) and 0 < self.topk_density <= 1):
            raise bad("topk_density", "must be a number in (0, 1]")
        if self.topk_bits not in (2, 4):
            raise bad("topk_bits", "must be 2 or 4")
        if self.merge_rule not in MERGE_RULES:
            raise bad("merge_rule", f"must be one of {', '.join(MERGE_RULES)}")
        if not self.island or len(self.island) > 128:
            raise bad("island", "must be 1-128 characters")
        if not self.connect.startswith(("tcp://", "ipc://", "inproc://")):
            raise bad("connect", "must be a ZeroMQ endpoint such as tcp://127.0.0.1:5555")
        for field in ("speed", "lr", "flush_timeout_s", "join_timeout_s", "heartbeat_interval_s"):
            value = getattr(self, field)
            if not math.isfinite(value) or value <= 0:
                raise bad(field, "must be a finite number > 0")
        if not 0 <= self.jitter < 1:
            raise bad("jitter", "must be in [0, 1)")
        if not 0 < self.heldout_fraction < 0.5:
            raise bad("heldout_fraction", "must be in (0, 0.5)")
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
        ):
            if getattr(self, field) < low:
                raise bad(field, f"must be >= {low}")
        if self.data_shard >= self.data_shards:
            raise bad("data_shard", f"must be < data_shards ({self.data_shards})")
        if bool(self.curve_secret_key_file) != bool(self.curve_server_key_file):
            raise bad(
                "curve_server_key_file" if self.curve_secret_key_file else "curve_secret_key_file",
                "must be set together with the other curve_* key file (or neither)",
            )
        if self.param_sharding not in PARAM_SHARDINGS:
            raise bad("param_sharding", f"must be one of {', '.join(PARAM_SHARDINGS)}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise bad("log_level", "must be DEBUG, INFO, WARNING or ERROR")
