"""The shard daemon's configuration: one frozen dataclass, validated on construction.

Fields are checked with the shared validators (`paramserver.plumbing.validate`);
the merge-policy fields take their defaults and rules from `PolicyConfig`.

This module owns `ShardConfig` (every setting of a shard process, with its
default and meaning) and the port layout of a local cluster. Loading from
TOML / environment / flags is `paramserver.plumbing.settings`' job.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from paramserver.plumbing.exposure import refusal
from paramserver.plumbing.validate import LOG_LEVELS, Checks
from paramserver.server.step.merge import MERGES
from paramserver.server.step.policy import PolicyConfig, PolicyError
from paramserver.server.step.weighting import STEP_RULES, WEIGHTINGS

MIB = 1024 * 1024

# Outer lr / momentum used when outer_lr / outer_momentum are left at None: a function of
# the mode, the islands' H and the number of islands that push (`outer_defaults`), each
# mode's row chosen for it by the same sweep, none inherited from another mode. A quorum
# step that merges n of N islands is n/N of a round and the momentum moves once per round
# (`step.outer.round_nesterov`); async mode steps once per delta (no momentum: Nesterov on
# every single delta diverged in `diloco-bench async_outer`, 2026-11-30).
OUTER_OPTIMIZERS = ("nesterov", "sgd", "delayed-nesterov")  # paramserver.server.step.outer
DOWNLINKS = ("float32", "int8")  # paramserver.server.step.downlink
# The dtype a fragment keeps its outer momentum in (paramserver.server.step.outer): float32, or
# bfloat16 (2 B/param instead of 4: each step computes in float32 and rounds the new momentum
# to nearest even when it stores it)
MOMENTUM_DTYPES = ("float32", "bfloat16")
# Per mode: rows (largest H, ((fewest pushing islands, lr, momentum), ...)). A row serves
# every H up to its largest (the boundaries 17 and 55 are geometric means of the measured
# H = 10, 30, 100); in it the last column whose island count is <= the islands that push
# (3 and 6: geometric means of the measured 2, 4, 8). The shard looks the cell up at every
# step with that step's N and passes lr and momentum to the outer step as arguments
# (`step.outer.outer_rule`), so both follow the island count during a run.
# Chosen by `python -m bench.outer_sweep --budget 800` (2026-12-03; docs/results.md "Outer
# settings by mode, H and island count"): a real ShardState, islands folding every
# published version at their next inner step, a micro model (d 32, 1 layer), 800 inner
# steps of 8 x 32 bytes summed over the islands per cell, one seed; held-out nats/byte,
# lr x momentum {0.4, 0.7, 1.0} x 0.8 and 0.7 / 0.9, widened where the best sat on an edge
# (lr 0.25, 1.4, 2.0; momentum 0.6).
# Best per cell, lr/momentum and nats/byte (sync | quorum 1 + grace | async):
#   H=10:  K=2 0.7/0.6 2.269 | 0.7/0.6 2.291 | 1.0/0 2.291
#          K=4 0.7/0.6 2.355 | 0.7/0.6 2.402 | 1.4/0 2.384
#          K=8 0.7/0.6 2.565 | 0.7/0.6 2.707 | 1.4/0 2.558
#   H=30:  K=2 0.7/0.8 2.271 | 0.7/0.8 2.315 (1.0/0.8 2.316) | 1.4/0 2.316 (1.0/0 2.318)
#          K=4 0.7/0.6 2.407 (0.7/0.8 2.412) | 1.0/0.6 2.419 | 1.4/0 2.393
#          K=8 0.7/0.8 2.671 (0.7/0.6 2.672) | 1.0/0.6 2.720 | 1.4/0 2.618
#   H=100: K=2 0.7/0.8 2.314 | 1.0/0.8 2.318 | 1.0/0 2.302 (4 and 8 islands: under 3
#          rounds in the budget, not measured; the row has one column)
# Momentum 0.9 lost to 0.8 in every cell; 0.6 beat 0.8 at H=10 and in quorum at H=30.
# Quorum (1 + grace) columns re-chosen over 3 seeds (2026-12-04, docs/results.md "K = 1 +
# grace and async against sync over 3 seeds"): its best momentum falls as a step merges a
# smaller share of the islands; best rows per cell, vs sync (seeds 0-2):
#   H=10:  K=2 0.7/0.6 +0.9% | K=4 1.0/0.3 +0.9% (1.4/0 +1.0%) | K=8 1.4/0 +0.4%
#   H=30:  K=2 1.0/0.6 +1.2% (1.0/0.3, 1.4/0 +1.4%) | K=4 1.4/0 -0.7% | K=8 1.4/0 -1.7%
#   H=100: K=2 1.0/0.8 +0.4% (4 and 8 islands not measured: the row has one column);
#          over seeds 0-5 1.0/0.6 -0.4% against 1.0/0.8 +0.8% (better on all 6 paired
#          seeds; 1.4/0.6 +0.4%, 1.4/0.8 +1.6%), so the row takes 1.0/0.6
# Sync keeps one momentum per row (0.4 beat 0.6 only at 2 islands, by 0.4%: "Outer
# momentum below 0.6 at H = 10 over 3 seeds"). Async: no momentum, lr by island count.
OUTER_DEFAULTS_TABLE: dict[str, tuple[tuple[float, tuple[tuple[int, float, float], ...]], ...]] = {
    "sync": (
        (17, ((1, 0.7, 0.6),)),
        (55, ((1, 0.7, 0.8),)),
        (math.inf, ((1, 0.7, 0.8),)),
    ),
    "quorum": (
        (17, ((1, 0.7, 0.6), (3, 1.0, 0.3), (6, 1.4, 0.0))),
        (55, ((1, 1.0, 0.6), (3, 1.4, 0.0))),
        (math.inf, ((1, 1.0, 0.6),)),
    ),
    "async": ((math.inf, ((1, 1.0, 0.0), (3, 1.4, 0.0))),),
}
# Steps of sparse (topk) deltas: plain SGD, the islands' error feedback is the momentum.
# 1.0: the issue-22 sync simulation (3 islands, 300 steps: outer SGD lr 1 with the
# per-entry merge 2.378 / 2.226 at H=30 / 10 against 2.716 / 2.547 as shipped);
# `diloco-bench topk_outer` sweeps it.
SPARSE_OUTER_LR = 1.0
DEFAULT_INNER_STEPS = 50  # the islands' default H (worker.config.IslandConfig.inner_steps)
DEFAULT_ISLANDS = 2  # the island count the table assumes before any island pushed


def _outer_cell(mode: str, inner_steps: int, islands: int) -> tuple[float, float, float, int]:
    """The table's (lr, momentum, largest H of the row, fewest islands of the column)."""
    rows = OUTER_DEFAULTS_TABLE[mode]
    largest, columns = next((r for r in rows if inner_steps <= r[0]), rows[-1])
    fewest, lr, momentum = columns[0]
    for count, lr_of, momentum_of in columns:
        if islands >= count:
            fewest, lr, momentum = count, lr_of, momentum_of
    return lr, momentum, largest, fewest


def outer_defaults(mode: str, inner_steps: int, islands: int) -> tuple[float, float, str]:
    """The default outer (lr, momentum) of a mode, and why (what `status.outer` shows).

    Args:
        mode: "sync", "quorum" or "async" (a key of OUTER_DEFAULTS_TABLE).
        inner_steps: H, the islands' inner steps per round (>= 1).
        islands: the islands that push (a round's N, >= 1).

    Returns:
        (lr, momentum, the reason in one line): the table row of the first
        largest H >= inner_steps, in it the last column whose island count is
        <= islands.
    """
    lr, momentum, largest, fewest = _outer_cell(mode, inner_steps, islands)
    rows = OUTER_DEFAULTS_TABLE[mode]
    index = [r[0] for r in rows].index(largest)
    low = int(rows[index - 1][0]) + 1 if index else 1
    if math.isinf(largest):
        row = "any H" if low == 1 else f"H >= {low}"
    else:
        row = f"H {low}-{int(largest)}"
    return (
        lr,
        momentum,
        f"{mode}: the default of H={inner_steps} at {islands} pushing islands (row {row}, "
        f"column {fewest}+ islands of OUTER_DEFAULTS_TABLE; bench.outer_sweep 2026-12-04)",
    )


def sync_outer_defaults(inner_steps: int, islands: int = DEFAULT_ISLANDS) -> tuple[float, float]:
    """The default outer (lr, momentum) of sync steps (`outer_defaults` of mode sync).

    Args:
        inner_steps: H, the islands' inner steps per round (>= 1).
        islands: the islands that push (a round's N), >= 1.

    Returns:
        (lr, momentum).
    """
    return outer_defaults("sync", inner_steps, islands)[:2]


PENDING_MEMORY_SHARE = 4  # default max_pending_bytes: 1/4 of the machine's physical memory
FALLBACK_MEMORY_BYTES = 16 * 1024 * MIB  # assumed when the physical memory cannot be read


def physical_memory_bytes() -> int:
    """The machine's physical memory: os.sysconf, else /proc/meminfo, else FALLBACK_MEMORY_BYTES.

    Returns:
        Bytes.
    """
    try:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        if pages > 0 and page > 0:
            return int(pages) * int(page)
    except (ValueError, OSError, AttributeError):
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return FALLBACK_MEMORY_BYTES


def default_max_pending_bytes() -> int:
    """The default pending-delta budget of a shard: 1/PENDING_MEMORY_SHARE of physical memory.

    Returns:
        Bytes (each shard process of a machine gets this much: lower it when
        several shards share one machine).
    """
    return physical_memory_bytes() // PENDING_MEMORY_SHARE


class ConfigError(ValueError):
    """A setting is invalid; the message names the field, the value and what to do."""


@dataclass(frozen=True)
class ShardConfig:
    """Settings of one shard process (every shard of a cluster gets the same config)."""

    # bind address of the ROUTER and PUB sockets; one that is not loopback (0.0.0.0, a LAN
    # address) needs CURVE keys (curve_secret_key_file, curve_allow_dir) or insecure
    host: str = "127.0.0.1"
    port: int = 5555  # base port: shard i binds ROUTER port+2i and PUB port+2i+1
    shards: int = 1  # number of shard processes in the cluster
    fragments: int = 0  # fragments in the plan; 0 = 2 per shard
    data_dir: str = "runs/server"  # write-ahead logs and checkpoints (shard-<i>/ below it)
    # merge policy: sync, quorum or async (paramserver.server.step.policy, which owns these defaults)
    mode: Literal["sync", "quorum", "async"] = PolicyConfig.mode
    quorum: int = PolicyConfig.quorum  # quorum mode: distinct live islands before the grace window
    grace_rule: str = PolicyConfig.grace_rule  # quorum grace window: eq3 (adaptive) or fraction
    grace_fraction: float = PolicyConfig.grace_fraction  # fraction rule: share of the EMA gap
    grace_gamma: float = PolicyConfig.grace_gamma  # eq3 rule: share of the slack spent, in (0, 1)
    # eq3 rule: tau, the inner steps an island trains while its delta is merged (the overlap)
    grace_overlap_steps: int = PolicyConfig.grace_overlap_steps
    grace_min_s: float = PolicyConfig.grace_min_s  # lower clamp of the grace window, seconds
    grace_max_s: float = PolicyConfig.grace_max_s  # upper clamp of the grace window, seconds
    weighting: str = "default"  # merge weights: default, uniform, tokens, no-staleness
    # combining the islands' deltas: mean, rda, or median (coordinate-wise over the islands of a
    # step: robust to a minority of untrusted islands) (paramserver.server.step.merge)
    merge: str = "mean"
    staleness_exponent: float = 0.5  # a in (1 + staleness)^-a of the default weighting
    # how a step's share n/N of a round (n islands merged, N that push) scales it and its
    # staleness: round (default), version, share or round-staleness (weighting.py)
    step_rule: str = "round"
    outer_optimizer: str = "nesterov"  # nesterov, sgd or delayed-nesterov
    # H, the inner steps per round the islands run (set it to their --inner-steps): it picks
    # the default outer lr and momentum of sync and quorum steps; an island that says it runs
    # another H (its pushes' inner_steps) that would take other defaults gets one warning
    inner_steps: int = DEFAULT_INNER_STEPS
    # outer learning rate; unset, each step takes the default of the mode, --inner-steps and
    # the islands that push (OUTER_DEFAULTS_TABLE: sync 0.7; quorum 0.7-1.4, larger with more
    # islands; async 1.0, 1.4 from 3 islands); status `outer` shows it and why
    outer_lr: float | None = None
    # outer (Nesterov) momentum in [0, 1); unset, each step takes the default of the mode, H
    # and the islands that push (sync 0.6 for H <= 17, else 0.8; quorum 0.6 at 2 islands,
    # 0.3 at 3-5 and 0 from 6 for H <= 17, 0 from 3 for H 18-55, 0.6 above 55; async 0)
    outer_momentum: float | None = None
    nesterov_delay: int = 1  # contributions between momentum updates (delayed Nesterov)
    # the dtype each fragment keeps its outer momentum in: float32, or bfloat16 (half the
    # bytes: 2 B/param less; the step computes in float32 and rounds the new momentum to
    # nearest even when it stores it). A data dir written with the other dtype is refused
    # at start (MomentumDtypeError): restart with the dtype it was written with
    momentum_dtype: Literal["float32", "bfloat16"] = "float32"
    # outer lr of steps whose deltas are all topk-coded: SGD without momentum, each entry
    # merged over the islands that sent it (paramserver.server.step.sparse_merge)
    sparse_outer_lr: float = SPARSE_OUTER_LR
    heartbeat_interval_s: float = 1.0  # PUB heartbeat period when idle; liveness unit
    liveness: int = 5  # an island silent this many heartbeat intervals is dead
    max_message_bytes: int = 64 * MIB  # larger requests are rejected "oversize"
    # frames one request may have (header + codec header + payload frames); more are refused
    # "oversize" before anything is stored. Our writer cuts payloads at 1 MiB, so a message
    # of max_message_bytes has max_message_bytes / 1 MiB + 2 frames; keep at least that
    max_frames_per_message: int = 4096
    # bytes of snapshot replies one connection may leave unread in the shard before its next
    # snapshot request is refused `throttled` (one reply is always served); 0 = twice
    # max_message_bytes (two pieces in flight, as our client asks them)
    max_unread_reply_bytes: int = 0
    # a connection that sends no bytes for this long (ZMTP heartbeats: the shard pings every
    # heartbeat_interval_s, and a pong counts) is closed, and what it half-sent is freed; a
    # handshake must finish within it too; 0 = never (ZeroMQ's defaults)
    peer_silence_s: float = 30.0
    max_islands: int = 256  # distinct islands a shard tracks at once
    max_pending_per_island: int = 8  # unmerged deltas one island may have per fragment
    # bytes all pending deltas of the shard may keep (counted coded: ~1.02 B/param for int8,
    # 4 for raw float32); beyond it a push is refused too_many_pending (the island re-sends
    # it later). Default: a quarter of this machine's physical memory, per shard process
    max_pending_bytes: int = field(default_factory=default_max_pending_bytes)
    # bytes one island's pending deltas may keep on this shard (counted like max_pending_bytes);
    # beyond it its push is refused too_many_pending, so one island cannot fill the shard's
    # budget; 0 = a quarter of max_pending_bytes, but at least two whole-model deltas of the
    # island on this shard (at its delta's bytes per parameter)
    max_pending_bytes_per_island: int = 0
    # requests per second one island (or one connection that has not said hello) may send
    # while another island or connection was heard within the last second; beyond it a request
    # is refused `throttled` with retry_after_s, before anything of it is decoded; 0 = no limit.
    # An island sends (its fragments on this shard) / (its round) pushes a second plus a
    # heartbeat: ~9 at the chaos bench's 0.3-s rounds; `diloco-bench load --flood` measured
    # honest ack p99 1.3-1.4x under a flood at 20/16 against 2.7-3.7x at 100/50. Pushes of an
    # island whose last push was acked are not charged (any number of fragments at once)
    max_requests_per_s: float = 20.0
    request_burst: int = 16  # requests one island may send at once above max_requests_per_s
    # answers per second to one island's (or connection's) throttled requests and headers that
    # do not decode; the rest are dropped unanswered (counted: status `dropped`); 0 = answer all
    max_refusals_per_s: float = 20.0
    dedup_window: int = 64  # rounds below an island's newest that are still deduplicated
    # clip a delta's L2 norm to this x the median of its fragment's last accepted norms (once
    # 4 are known); 0 = off. Honest deltas of one run stay within a few x of each other
    clip_norm_multiple: float = 10.0
    # refuse (delta_too_large) a delta whose L2 norm is over this x max(the fragment's
    # parameter norm, sqrt(its size)): the bound from the very first push; 0 = off
    max_delta_norm_ratio: float = 10.0
    # refuse (bad_tokens) a push whose tokens / steps is over this (tokens per inner step)
    max_tokens_per_step: int = 2**26
    max_inner_steps: int = 2**20  # refuse (bad_tokens) a push of more inner steps than this
    # cap one island's work weight f in a step at this x the largest of the other islands'
    # of the step (tokens^2/steps: 16 = an island with 4x the batch); 0 = no cap
    max_weight_ratio: float = 16.0
    # refuse (bad_round) a round more than this above the island's newest round on the
    # fragment (round ids are microseconds since the epoch: 2**40 us is ~12.7 days)
    max_round_gap: int = 2**40
    # forget an island with no session (no hello heard: bye, or silent past liveness) and
    # nothing pending after this many seconds: its registry, report and dedup entries
    island_ttl_s: float = 3600.0
    checkpoint_every_steps: int = 50  # checkpoint after this many outer steps (0 = never)
    checkpoint_every_s: float = 60.0  # ... or this many seconds since the last (0 = never)
    fsync: bool = True  # fsync the log before acking; False only for throwaway runs
    # published updates: int8 deltas (with the shard's error feedback) or full fp32 values
    downlink: Literal["float32", "int8"] = "int8"
    log_level: str = "INFO"  # DEBUG, INFO, WARNING or ERROR
    metrics_port: int = 0  # Prometheus metrics port; 0 = off
    metrics_host: str = ""  # bind address of the metrics endpoint; "" = the same as host
    # off loopback (needs CURVE keys or insecure), the metrics endpoint and cluster page ask for
    # this token; "" = one made at the first start in <data_dir>/metrics.token (mode 0600)
    metrics_token: str = ""
    curve_secret_key_file: str = ""  # shard key pair (NAME.key_secret); "" = no CURVE (trusted net)
    curve_allow_dir: str = ""  # with CURVE: directory of the allowed islands' NAME.key files
    # with CURVE: TOML file granting a key more island ids than its file's stem (NAME.key acts
    # as island NAME), one line per key: NAME = ["id-b", "id-c"]; "" = only the stems
    curve_allow_map: str = ""
    # serve plain TCP (no CURVE) on a host that is not loopback: anyone who reaches the
    # ports may join, init and push; only on a trusted, firewalled network
    insecure: bool = False

    def __post_init__(self) -> None:
        check = Checks("ShardConfig", ConfigError)
        check.text("host", self.host, "give a bind address such as 127.0.0.1 or 0.0.0.0", False)
        check.require(self.host.strip() != "", "host", self.host, "give a bind address")
        check.integer("shards", self.shards, 1)
        check.integer("port", self.port, 1)
        check.require(
            self.port + 2 * self.shards - 1 <= 65535,
            "port",
            self.port,
            f"{self.shards} shards need ports port..port+{2 * self.shards - 1} <= 65535; "
            "lower port",
        )
        check.integer("fragments", self.fragments, 0)
        check.require(
            self.fragments == 0 or self.fragments >= self.shards,
            "fragments",
            self.fragments,
            f"need at least one per shard (shards={self.shards}), or 0 for 2 per shard",
        )
        check.text("data_dir", self.data_dir, "give a directory path", empty=False)
        try:
            self.policy()  # the merge-policy rules live with PolicyConfig, written once
        except PolicyError as exc:
            raise ConfigError(str(exc).replace("PolicyConfig.", "ShardConfig.", 1)) from None
        check.choice("weighting", self.weighting, WEIGHTINGS)
        check.choice("merge", self.merge, MERGES)
        check.number("staleness_exponent", self.staleness_exponent, low=0.0)
        check.choice("step_rule", self.step_rule, STEP_RULES)
        check.choice("outer_optimizer", self.outer_optimizer, OUTER_OPTIMIZERS)
        check.integer("inner_steps", self.inner_steps, 1)
        if self.outer_lr is not None:
            check.number("outer_lr", self.outer_lr, above=0.0)
        if self.outer_momentum is not None:
            check.number("outer_momentum", self.outer_momentum, low=0.0, below=1.0)
        check.integer("nesterov_delay", self.nesterov_delay, 1)
        check.choice("momentum_dtype", self.momentum_dtype, MOMENTUM_DTYPES)
        check.number("sparse_outer_lr", self.sparse_outer_lr, above=0.0)
        check.require(
            not (self.outer_optimizer == "sgd" and self.nesterov_delay != 1),
            "nesterov_delay",
            self.nesterov_delay,
            "sgd has no momentum to delay: set 1 or use outer_optimizer=delayed-nesterov",
        )
        check.number("heartbeat_interval_s", self.heartbeat_interval_s, above=0.0)
        check.integer("liveness", self.liveness, 1)
        check.integer("max_message_bytes", self.max_message_bytes, 4096)
        check.require(
            self.max_message_bytes <= 1024 * MIB,
            "max_message_bytes",
            self.max_message_bytes,
            "keep it <= 1 GiB; split the model into more fragments instead",
        )
        honest_frames = -(-self.max_message_bytes // MIB) + 2
        check.integer("max_frames_per_message", self.max_frames_per_message, 3)
        check.require(
            self.max_frames_per_message >= honest_frames,
            "max_frames_per_message",
            self.max_frames_per_message,
            f"keep it >= {honest_frames}: a push of max_message_bytes cut at 1 MiB has that many",
        )
        check.integer("max_unread_reply_bytes", self.max_unread_reply_bytes, 0)
        check.number("peer_silence_s", self.peer_silence_s, low=0.0)
        check.integer("max_islands", self.max_islands, 1)
        check.integer("max_pending_per_island", self.max_pending_per_island, 1)
        check.require(
            isinstance(self.max_pending_bytes, int)
            and not isinstance(self.max_pending_bytes, bool)
            and self.max_pending_bytes >= 1,
            "max_pending_bytes",
            self.max_pending_bytes,
            "give the byte budget of all pending deltas as an int >= 1, e.g. 4294967296 "
            f"(4 GiB); the default is 1/{PENDING_MEMORY_SHARE} of physical memory",
        )
        check.integer("max_pending_bytes_per_island", self.max_pending_bytes_per_island, 0)
        check.number("max_requests_per_s", self.max_requests_per_s, low=0.0)
        check.integer("request_burst", self.request_burst, 1)
        check.number("max_refusals_per_s", self.max_refusals_per_s, low=0.0)
        check.integer("dedup_window", self.dedup_window, 1)
        check.number("max_delta_norm_ratio", self.max_delta_norm_ratio, low=0.0)
        check.integer("max_tokens_per_step", self.max_tokens_per_step, 1)
        check.integer("max_inner_steps", self.max_inner_steps, 1)
        check.number("max_weight_ratio", self.max_weight_ratio, low=0.0)
        check.require(
            self.max_weight_ratio == 0 or self.max_weight_ratio >= 1,
            "max_weight_ratio",
            self.max_weight_ratio,
            "use 0 (no cap) or a ratio >= 1 of the other islands' largest weight (e.g. 16)",
        )
        check.integer("max_round_gap", self.max_round_gap, 1)
        check.number("island_ttl_s", self.island_ttl_s, above=0.0)
        check.number("clip_norm_multiple", self.clip_norm_multiple, low=0.0)
        check.require(
            self.clip_norm_multiple == 0 or self.clip_norm_multiple >= 1,
            "clip_norm_multiple",
            self.clip_norm_multiple,
            "use 0 (off) or a multiple >= 1 of the median recent norm (e.g. 3)",
        )
        check.integer("checkpoint_every_steps", self.checkpoint_every_steps, 0)
        check.number("checkpoint_every_s", self.checkpoint_every_s, low=0.0)
        check.boolean("fsync", self.fsync)
        check.choice("downlink", self.downlink, DOWNLINKS)
        check.choice("log_level", self.log_level, LOG_LEVELS)
        check.integer("metrics_port", self.metrics_port, 0, 65535)
        check.text(
            "metrics_host",
            self.metrics_host,
            "give a bind address such as 127.0.0.1, or leave it empty to use host",
        )
        check.text("metrics_token", self.metrics_token)
        check.together(
            "curve_secret_key_file",
            self.curve_secret_key_file,
            "curve_allow_dir",
            self.curve_allow_dir,
        )
        check.text("curve_allow_map", self.curve_allow_map)
        check.require(
            not self.curve_allow_map or bool(self.curve_allow_dir),
            "curve_allow_map",
            self.curve_allow_map,
            "an allow map needs CURVE: set curve_secret_key_file and curve_allow_dir too",
        )
        check.boolean("insecure", self.insecure)
        refused = self.plain_bind_refusal(self.host)
        check.require(refused is None, "host", self.host, str(refused))
        refused = self.metrics_bind_refusal()
        check.require(refused is None, "metrics_host", self.metrics_bind_host, str(refused))

    def metrics_bind_refusal(self) -> str | None:
        """Why the metrics endpoint and cluster page may not bind off loopback, or None.

        Returns:
            One line naming the address, the risk and the ways out, when
            metrics_port is set on a host that is not loopback without CURVE
            keys or `insecure` (the shards' rule, `paramserver.plumbing.exposure`;
            bound there, the page asks for a token); None otherwise.
        """
        if not self.metrics_port:
            return None
        return refusal(
            self.metrics_bind_host,
            curve=bool(self.curve_secret_key_file),
            insecure=self.insecure,
            risk="anyone who reaches the port reads the island ids, losses and counters",
            keys="--curve-secret-key-file and --curve-allow-dir (the page then asks for a token)",
            opt_out="--metrics-host 127.0.0.1, or --insecure",
        )

    def plain_bind_refusal(self, address: str) -> str | None:
        """Why this shard may not bind `address` (a host or endpoint) without CURVE, or None.

        Args:
            address: a bind host such as "0.0.0.0", or a bind endpoint tcp://HOST:PORT.

        Returns:
            One line naming the address, the risk and both ways out (CURVE keys
            or --insecure); None with CURVE, with `insecure`, or on loopback
            (`paramserver.plumbing.exposure`).
        """
        return refusal(
            address,
            curve=bool(self.curve_secret_key_file),
            insecure=self.insecure,
            risk="anyone who reaches the port may join, init and push",
            keys="--curve-secret-key-file and --curve-allow-dir",
            opt_out="--insecure",
        )

    @property
    def metrics_bind_host(self) -> str:
        """Where the metrics endpoint binds: `metrics_host`, or `host` when it is empty ("*": all)."""
        host = self.metrics_host.strip() or self.host
        return "0.0.0.0" if host == "*" else host

    @property
    def num_fragments(self) -> int:
        """Fragments in the plan (2 per shard when `fragments` is 0)."""
        return self.fragments or 2 * self.shards

    @property
    def steps_on_single_deltas(self) -> bool:
        """Whether every outer step merges one delta: async mode.

        Async mode takes its own outer defaults (`outer_defaults`); a quorum of
        1 takes those of its mode, quorum, like any quorum.
        """
        return self.mode == "async"

    def outer_settings(self, islands: int | None = None) -> tuple[float, float, str]:
        """The outer (lr, momentum) in effect with `islands` pushing islands, and why.

        Args:
            islands: the islands that push (None or 0: `DEFAULT_ISLANDS`).

        Returns:
            (lr, momentum, reason): given values win over the defaults of
            `outer_defaults(mode, inner_steps, islands)`.
        """
        count = islands or DEFAULT_ISLANDS
        lr, momentum, why = outer_defaults(self.mode, self.inner_steps, count)
        given = [name for name in ("outer_lr", "outer_momentum") if getattr(self, name) is not None]
        if given:
            why = f"{' and '.join(given)} given; otherwise {why}"
        lr = float(self.outer_lr) if self.outer_lr is not None else lr
        momentum = float(self.outer_momentum) if self.outer_momentum is not None else momentum
        return lr, momentum, why

    @property
    def effective_outer_lr(self) -> float:
        """The outer learning rate the shard starts with (DEFAULT_ISLANDS pushing islands)."""
        return self.outer_settings()[0]

    @property
    def effective_outer_momentum(self) -> float:
        """The outer momentum the shard starts with (DEFAULT_ISLANDS pushing islands)."""
        return self.outer_settings()[1]

    @property
    def outer_from_inner_steps(self) -> bool:
        """Whether the outer lr or momentum is the default of `inner_steps` (not given, sync/quorum)."""
        defaulted = self.outer_lr is None or self.outer_momentum is None
        return defaulted and not self.steps_on_single_deltas

    def outer_report(self, islands: int | None = None) -> dict[str, Any]:
        """The outer optimizer in effect, JSON-ready (for status).

        Args:
            islands: the islands that push, as the shard's last step counted
                them (None: none stepped yet).

        Returns:
            optimizer, lr (in effect with `islands`), momentum, the dtype the
            momentum is kept in, inner_steps, islands (None before a step),
            whether lr/momentum were defaulted from inner_steps, and why (one line).
        """
        lr, momentum, why = self.outer_settings(islands)
        return {
            "optimizer": self.outer_optimizer,
            "lr": lr,
            "momentum": momentum,
            "momentum_dtype": self.momentum_dtype,
            "inner_steps": self.inner_steps,
            "islands": islands,
            "from_inner_steps": self.outer_from_inner_steps,
            "why": why,
        }

    def inner_steps_mismatch(self, island: str, steps: int | None) -> str | None:
        """What to tell the operator when an island's configured H would take other defaults.

        Args:
            island: the pushing island.
            steps: the island's own configured H (`inner_steps` in its push
                header), None when it does not say: the inner steps of a push
                are not its H (pushes merged after a skipped push, streaming
                fragments, a last partial round), so nothing is inferred.

        Returns:
            A one-line warning, or None when the island's H takes the same
            defaults as `inner_steps` (or the outer settings are not defaulted,
            or the island did not say its H).
        """
        if steps is None or not self.outer_from_inner_steps:
            return None
        ours = outer_defaults(self.mode, self.inner_steps, DEFAULT_ISLANDS)[:2]
        theirs = outer_defaults(self.mode, steps, DEFAULT_ISLANDS)[:2]
        if ours == theirs:
            return None
        return (
            f"island {island} runs {steps} inner steps per round, but the default outer "
            f"lr/momentum {ours[0]}/{ours[1]} were chosen for inner_steps={self.inner_steps} "
            f"(H={steps} takes {theirs[0]}/{theirs[1]}): start the shards with "
            f"--inner-steps {steps}, or give --outer-lr and --outer-momentum"
        )

    @property
    def pending_bytes_per_island(self) -> int:
        """One island's pending byte budget: max_pending_bytes_per_island, or 1/4 of the shard's."""
        return self.max_pending_bytes_per_island or max(1, self.max_pending_bytes // 4)

    @property
    def unread_reply_bytes(self) -> int:
        """Bytes of replies one connection may leave unread: the setting, or 2 x max_message_bytes."""
        return self.max_unread_reply_bytes or 2 * self.max_message_bytes

    @property
    def max_frame_bytes(self) -> int:
        """Hard cap given to ZMQ_MAXMSGSIZE: twice max_message_bytes (see protocol)."""
        return 2 * self.max_message_bytes

    def policy(self) -> PolicyConfig:
        """The merge-policy settings.

        Returns:
            A PolicyConfig with this config's mode, quorum and grace window.
        """
        return PolicyConfig(
            mode=self.mode,
            quorum=self.quorum,
            grace_rule=self.grace_rule,
            grace_fraction=self.grace_fraction,
            grace_gamma=self.grace_gamma,
            grace_overlap_steps=self.grace_overlap_steps,
            grace_min_s=self.grace_min_s,
            grace_max_s=self.grace_max_s,
        )


def local_endpoints(cfg: ShardConfig) -> list[tuple[str, str]]:
    """Connect addresses of every shard of a cluster on one host.

    Args:
        cfg: the cluster's config; a wildcard host (0.0.0.0, *, ::) maps to 127.0.0.1.

    Returns:
        [(router, pub), ...] per shard: tcp://host:port+2i and tcp://host:port+2i+1.
    """
    host = "127.0.0.1" if cfg.host in ("0.0.0.0", "*", "::") else cfg.host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return [
        (f"tcp://{host}:{cfg.port + 2 * i}", f"tcp://{host}:{cfg.port + 2 * i + 1}")
        for i in range(cfg.shards)
    ]


def bind_endpoints(cfg: ShardConfig, index: int) -> tuple[str, str]:
    """Bind addresses of shard `index`.

    Args:
        cfg: the cluster's config.
        index: shard index in [0, cfg.shards).

    Returns:
        (router, pub) as tcp://host:port+2i and tcp://host:port+2i+1.
    """
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < cfg.shards:
        raise ConfigError(f"shard index {index!r} out of range: the config has {cfg.shards} shards")
    host = cfg.host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{cfg.port + 2 * index}", f"tcp://{host}:{cfg.port + 2 * index + 1}"
