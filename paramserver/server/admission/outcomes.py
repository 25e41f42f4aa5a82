"""What came of each request: the refusal rules, the outcome's reply, its counts, the islands' view.

This module owns every refusal from its rule to its reply: the header-only
checks of a push (`check_push`: plan, fragment, island, claimed work
`work_refusal`, round ceiling `round_refusal`, dedup window, base version,
per-island pending bound), the delta's norm bound (`norm_refusal`), the pending byte budget
(`budget_refusal`), the size limit of any request
(`oversize`), the refusals of a snapshot request (`snapshot_refusal`), the
answer to an island the shard does not know on that connection
(`unknown_island`), the payload checks of `init` and `push` (`read_init`,
`read_delta`, and `check_payload`: a push's whole payload check with its
delta's norm, the work the shard's loop may run off its thread), how an outcome is counted (`count`) and the reply header
it becomes (`render`: an `ack` for a push, else `rejected`). The rules take
plain values, so they import nothing of the shard's state.

`ShardCounters` is what a shard counts for `status` (accepted, duplicates,
rejections, drops, bytes, steps, credit): plain data; `count` here decides how
a refusal is counted, `paramserver.server.state` counts steps and accepts.

Why past 700 lines: the refusal rules, their counters and their replies are
read together whenever a reason is added (issue 33 added three); splitting
the counters or the island view off would scatter one concept.

`IslandReports` is the per-island view behind the `islands` field of a shard's
`status` (what the cluster page shows): when the island's last delta arrived
here, how many rounds it pushed here, the staleness of its deltas in its last
merged step, and what the island last reported of its training (the optional
`inner_loss`, `steps_per_s` and `goodput` fields of its pushes and heartbeats,
`paramserver.wire.protocol.TRAINING_FIELDS`). Plain bookkeeping, not events: a
restart starts it empty. Pure: the caller passes `now` (wall-clock seconds).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import codec
from codec.coded import CodedTensor, read_coded
from paramserver.server.fragment import DedupEntry, Event, FragmentState
from paramserver.wire import protocol
from paramserver.wire.plan import Plan, PlanError
from paramserver.wire.protocol import DUPLICATE, REJECTED, TRAINING_FIELDS


@dataclass(frozen=True)
class Outcome:
    """The answer to a request: status accepted / duplicate / rejected, reason and detail.

    `event` is the applied event when the request changed durable state.
    `version` is the fragment's version after the request (pushes), else 0.
    `merged_version` (pushes accepted or duplicate) is the first version of the
    fragment that includes the delta: a step merges every pending delta, so a
    delta still pending is in the next version. `retry_after_s` (a `throttled`
    refusal) is when the request may be sent again.
    """

    status: str
    reason: str | None = None
    detail: str = ""
    event: Event | None = None
    version: int = 0
    merged_version: int | None = None
    retry_after_s: float | None = None


def refused(reason: str, detail: str) -> Outcome:
    """A rejected outcome (not yet counted: see `count`).

    Args:
        reason: one of paramserver.wire.protocol.REASONS.
        detail: human-readable explanation.

    Returns:
        Outcome(rejected, reason, detail).
    """
    return Outcome(REJECTED, reason, detail)


def count(counters: ShardCounters, outcome: Outcome) -> Outcome:
    """Count a refusal: a duplicate, `unknown_island` as a hello request, the rest by reason.

    Args:
        counters: the shard's counters (changed in place).
        outcome: any outcome; accepted ones pass uncounted.

    Returns:
        The outcome.
    """
    if outcome.status == DUPLICATE:
        counters.duplicates += 1
    elif outcome.status == REJECTED and outcome.reason == "unknown_island":
        counters.hello_requests += 1
    elif outcome.status == REJECTED:
        counters.rejected[outcome.reason] = counters.rejected.get(outcome.reason, 0) + 1
    return outcome


def render(request: Mapping[str, Any] | None, outcome: Outcome, version: int) -> dict[str, Any]:
    """The reply header of an outcome: `ack` for a push, else `rejected`.

    Args:
        request: the request header (None when it could not be parsed).
        outcome: the request's outcome.
        version: the fragment's current version (a push's ack when the outcome has none).

    Returns:
        The reply header (echoing the request's `id`).
    """
    if request is not None and request.get("kind") == "push":
        detail = {"detail": outcome.detail} if outcome.status == REJECTED else {}
        if outcome.retry_after_s is not None:
            detail["retry_after_s"] = outcome.retry_after_s
        return protocol.reply_header(
            request,
            "ack",
            round=request["round"],
            fragment=request["fragment"],
            outcome=outcome.status,
            reason=outcome.reason,
            version=outcome.version or version,
            merged_version=outcome.merged_version,
            **detail,
        )
    return render_rejected(request, outcome)


def render_rejected(request: Mapping[str, Any] | None, outcome: Outcome) -> dict[str, Any]:
    """The `rejected` reply header of a refusal (of any request, a push that did not parse too).

    Args:
        request: the request header, or what could be read of it (None: nothing).
        outcome: the refusal.

    Returns:
        The reply header (echoing the request's `id`).
    """
    extra = {} if outcome.retry_after_s is None else {"retry_after_s": outcome.retry_after_s}
    return protocol.reply_header(
        request, "rejected", reason=outcome.reason, detail=outcome.detail, **extra
    )


def throttled(retry_after_s: float, rate: float, burst: int) -> Outcome:
    """The refusal of a request over its island's (or connection's) request rate.

    Args:
        retry_after_s: seconds until the island's bucket holds a token (> 0).
        rate: the shard's max_requests_per_s.
        burst: the shard's request_burst.

    Returns:
        A rejected `throttled` outcome carrying retry_after_s (rounded up to the
        millisecond), not yet counted.
    """
    wait = max(0.001, math.ceil(retry_after_s * 1000) / 1000)
    return Outcome(
        REJECTED,
        "throttled",
        f"over max_requests_per_s={rate:g} (request_burst={burst}) while requests wait: "
        f"send it again after {wait:g} s",
        retry_after_s=wait,
    )


def read_plan(plan_wire: Any, cfg: Any) -> Plan | Outcome:
    """The plan of an `init` or `init_begin`, or why it is refused.

    Args:
        plan_wire: the wire plan (Plan.to_wire()).
        cfg: the shard's config (shards, num_fragments).

    Returns:
        The plan, or a rejected outcome (malformed "bad wire plan", plan_mismatch),
        not yet counted.
    """
    try:
        plan = Plan.from_wire(plan_wire)
    except PlanError as exc:
        return refused("malformed", f"bad wire plan: {exc}")
    if plan.num_shards != cfg.shards or plan.num_fragments != cfg.num_fragments:
        return refused(
            "plan_mismatch",
            f"plan has {plan.num_shards} shards / {plan.num_fragments} fragments; "
            f"the cluster runs {cfg.shards} / {cfg.num_fragments}",
        )
    return plan


def read_init(
    plan_wire: Any, payload: Sequence[Any], cfg: Any, shard: int
) -> tuple[Plan, dict[int, np.ndarray]] | Outcome:
    """The plan and this shard's initial values of an `init`, or why they are refused.

    Args:
        plan_wire: the wire plan (Plan.to_wire()).
        payload: codec frames of the tree {"<fragment>": 1-D float32 vector}
            with exactly this shard's fragments.
        cfg: the shard's config (shards, num_fragments).
        shard: the shard's index.

    Returns:
        (plan, fragment -> values), or a rejected outcome (malformed,
        plan_mismatch, codec_error, unknown_fragment, bad_shape, bad_dtype,
        non_finite), not yet counted.
    """
    plan = read_plan(plan_wire, cfg)
    if isinstance(plan, Outcome):
        return plan
    owned = {f.index: f.size for f in plan.fragments_of(shard)}
    try:
        tree = codec.decode(payload, max_elements=sum(owned.values()))
    except codec.CodecError as exc:
        return refused("codec_error", str(exc))
    keys = sorted(str(k) for k in tree)
    if keys != sorted(str(i) for i in owned):
        return refused(
            "unknown_fragment",
            f"init payload has fragments {keys}; shard {shard} owns {sorted(owned)}",
        )
    values: dict[int, np.ndarray] = {}
    for index, size in owned.items():
        problem = protocol.vector_problem(tree[str(index)], size)
        if problem:
            return refused(problem[0], f"fragment {index}: {problem[1]}")
        values[index] = tree[str(index)]
    return plan, values


def read_delta(payload: Sequence[Any], size: int) -> CodedTensor | Outcome:
    """The delta of a push's payload, kept coded, or why it is refused.

    Checks what decoding it would (frames, checksums, header sizes, finite
    non-negative scales, topk offsets: `codec.coded.read_coded`), the tree, dtype
    and shape, and that every decoded value is finite, without decoding it.

    Args:
        payload: codec frames of the tree {"delta": 1-D vector}.
        size: the fragment's size.

    Returns:
        The delta as a CodedTensor, or a rejected outcome (codec_error,
        bad_shape, bad_dtype, non_finite), not yet counted.
    """
    try:
        tensors = read_coded(payload, max_elements=size)
    except codec.CodecError as exc:
        return refused("codec_error", str(exc))
    paths = sorted("/".join(t.path) for t in tensors)
    if len(tensors) != 1 or tensors[0].path != ("delta",):
        return refused("bad_shape", f"payload must be the tree {{'delta': vec}}, got {paths}")
    delta = tensors[0]
    if delta.dtype != "float32":
        return refused("bad_dtype", f"dtype {delta.dtype}; fragment vectors are float32")
    if delta.shape != (size,):
        return refused("bad_shape", f"shape {delta.shape}; the fragment needs ({size},)")
    if not delta.all_finite():
        return refused("non_finite", "values contain NaN or Inf")
    return delta


@dataclass(frozen=True)
class CheckedPayload:
    """A push's payload, checked: its delta (kept coded) and norm, or why it is refused.

    Attributes:
        delta: the delta, or None when refused.
        norm: its L2 norm (float64; 0 when refused).
        refusal: the rejected outcome (codec_error, bad_shape, bad_dtype,
            non_finite; not yet counted), or None.
    """

    delta: CodedTensor | None
    norm: float = 0.0
    refusal: Outcome | None = None


def check_payload(payload: Sequence[Any], size: int) -> CheckedPayload:
    """Check a push's payload and take its delta's norm (reads every byte once; no state).

    Args:
        payload: codec frames of the tree {"delta": 1-D vector}.
        size: the fragment's size.

    Returns:
        The checked payload.
    """
    delta = read_delta(payload, size)
    if isinstance(delta, Outcome):
        return CheckedPayload(None, refusal=delta)
    # the norm `step.weighting.l2_norm` takes of a coded delta, bit for bit
    return CheckedPayload(delta, float(np.sqrt(delta.sum_squares())))


def norm_refusal(norm: float, param_norm: float, size: int, ratio: float) -> Outcome | None:
    """The refusal of a delta far larger than the fragment it would move, or None.

    The bound holds from the very first push (before any recent norms exist):
    a delta may not be more than `ratio` times the larger of the fragment's
    parameter norm and sqrt(size) (an RMS of 1 per element, for fragments
    that start at zero).

    Args:
        norm: the delta's L2 norm (float64; may be inf for a huge finite delta).
        param_norm: the fragment's parameter L2 norm now.
        size: the fragment's element count.
        ratio: the shard's max_delta_norm_ratio (0: no bound).

    Returns:
        A rejected `delta_too_large` outcome (not yet counted), or None.
    """
    if ratio <= 0 and math.isfinite(norm):
        return None
    bound = ratio * max(param_norm, math.sqrt(size)) if ratio > 0 else math.inf
    if math.isfinite(norm) and norm <= bound:
        return None
    return refused(
        "delta_too_large",
        f"delta norm {norm:.4g} is over max_delta_norm_ratio={ratio:g} x max(parameter "
        f"norm {param_norm:.4g}, sqrt(size {size})) = {bound:.4g}",
    )


def budget_refusal(pending_bytes: int, incoming: int, budget: int) -> Outcome | None:
    """The refusal of a delta that would take a shard's pending deltas over its byte budget.

    Args:
        pending_bytes: bytes the shard's pending deltas keep now.
        incoming: bytes the new delta would keep (its coded size).
        budget: the shard's max_pending_bytes.

    Returns:
        A rejected `too_many_pending` outcome (not yet counted), or None when
        it fits or nothing is pending (a lone delta is always admitted, so a
        budget below one delta still makes progress).
    """
    if pending_bytes == 0 or pending_bytes + incoming <= budget:
        return None
    return refused(
        "too_many_pending",
        f"pending deltas keep {pending_bytes} bytes and this one {incoming}: over "
        f"max_pending_bytes={budget}; re-send after a step",
    )


def island_budget_refusal(
    island: str, mine: int, incoming: int | None, limit: int
) -> Outcome | None:
    """The refusal of a delta that would take one island's pending deltas over its byte budget.

    Args:
        island: the pushing island.
        mine: bytes the island's pending deltas on this shard keep now.
        incoming: bytes the new delta would keep (its coded size); None before
            the payload is read (then only an island already at its limit is refused).
        limit: the shard's max_pending_bytes_per_island (resolved).

    Returns:
        A rejected `too_many_pending` outcome (not yet counted), or None when it
        fits or the island has nothing pending (its lone delta is always admitted).
    """
    fits = mine < limit if incoming is None else mine + incoming <= limit
    if mine == 0 or fits:
        return None
    return refused(
        "too_many_pending",
        f"deltas of {island!r} pending here keep {mine} bytes"
        + ("" if incoming is None else f" and this one {incoming}")
        + f": over max_pending_bytes_per_island={limit}; re-send after a step",
    )


def oversize(size: int, limit: int) -> Outcome | None:
    """The refusal of a request larger than the shard accepts.

    Args:
        size: the request's size in bytes, all frames.
        limit: the shard's max_message_bytes.

    Returns:
        A rejected `oversize` outcome, or None when the request fits.
    """
    if size <= limit:
        return None
    return refused("oversize", f"{size} bytes; max_message_bytes={limit}")


def too_many_frames(frames: int, limit: int) -> Outcome | None:
    """The refusal of a request cut into more frames than the shard accepts.

    Args:
        frames: the request's frame count (header and payload frames).
        limit: the shard's max_frames_per_message.

    Returns:
        A rejected `oversize` outcome, or None when the request's frames are within it.
    """
    if frames <= limit:
        return None
    return refused(
        "oversize",
        f"{frames} frames; max_frames_per_message={limit} (cut the payload into larger pieces)",
    )


def snapshot_refusal(initialized: bool, owned: bool, fragment: int, shard: int) -> Outcome | None:
    """Why a snapshot of `fragment` cannot be served, if it cannot.

    Args:
        initialized: whether the shard has its parameters.
        owned: whether the shard owns `fragment`.
        fragment: the requested fragment.
        shard: the shard's index.

    Returns:
        `not_initialized` or `unknown_fragment` (rejected), or None to serve it.
    """
    if not initialized:
        return refused("not_initialized", "no parameters yet: init first")
    if not owned:
        return refused("unknown_fragment", f"fragment {fragment} is not on shard {shard}")
    return None


def snapshot_piece_refusal(offset: int, end: int, size: int, most: int) -> Outcome | None:
    """The refusal of a snapshot of elements [offset, end) of a fragment of `size`, or None.

    Args:
        offset: the first element asked (the request's `offset`, default 0).
        end: one past the last (offset + the request's `count`, clipped at `size`).
        size: the fragment's element count.
        most: the most elements a reply may hold (protocol.piece_elements).

    Returns:
        `bad_shape` (offset past the end) or `oversize` (more than `most`), or None.
    """
    if offset >= size:
        return refused("bad_shape", f"offset {offset} is past the end of the fragment ({size})")
    if end - offset > most:
        return refused(
            "oversize",
            f"{end - offset} elements do not fit one reply under max_message_bytes; ask "
            f"pieces of at most {most} elements with offset and count",
        )
    return None


def unknown_island(island: str) -> Outcome:
    """The answer to a push or heartbeat of an island not known on its connection.

    Args:
        island: the island id the request names.

    Returns:
        A rejected `unknown_island` outcome asking it to say hello again.
    """
    detail = f"island {island!r} is not known here (or its connection changed): say hello again"
    return refused("unknown_island", detail)


def check_push(
    header: Mapping[str, Any],
    plan: Plan | None,
    frag: FragmentState | None,
    known: bool,
    entry: DedupEntry | None,
    limits: Any,
    now: float,
) -> Outcome | None:
    """Header-only checks of a push, in order; counts nothing.

    Args:
        header: a push header that passed protocol.unpack.
        plan: the shard's plan (None before init).
        frag: the pushed fragment's state, None when the shard does not own it.
        known: whether the island said hello.
        entry: the dedup entry of (island, fragment), if any.
        limits: the shard's config (dedup_window, max_pending_per_island,
            max_round_gap, max_inner_steps, max_tokens_per_step).
        now: wall-clock seconds (the round bound: `round_refusal`).

    Returns:
        None when the push may proceed to payload checks; else the duplicate
        or rejected outcome (not yet counted).
    """
    if plan is None:
        return refused("not_initialized", "no parameters yet: init first")
    fragment, island, rnd = header["fragment"], header["island"], header["round"]
    if header["plan_hash"] != plan.hash:
        return refused("plan_mismatch", f"plan hash {header['plan_hash']!r} != {plan.hash!r}")
    if frag is None:
        return refused("unknown_fragment", f"fragment {fragment} is not owned by this shard")
    if not known:
        return unknown_island(island)
    bad = work_refusal(header["tokens"], header["steps"], limits) or round_refusal(
        rnd, entry, now, limits.max_round_gap
    )
    if bad is not None:
        return bad
    if entry is not None:
        if rnd in entry.rounds:
            merged = frag.version  # merged already: a version that includes it
            if any(c.island == island and c.round == rnd for c in frag.pending):
                # pending: the next step's, or the one after a step under way without it
                in_step = frag.in_step
                merged += 1 if in_step is None or (island, rnd) in in_step else 2
            return Outcome(
                DUPLICATE, None, "already accepted", version=frag.version, merged_version=merged
            )
        if rnd < entry.low(limits.dedup_window):
            return refused(
                "replayed_round",
                f"round {rnd} is older than the dedup window (newest {entry.newest}, "
                f"window {limits.dedup_window}, floor {entry.floor})",
            )
    if header["base_version"] > frag.version:
        return refused(
            "future_base_version",
            f"base_version {header['base_version']} > current version {frag.version}",
        )
    mine = sum(1 for c in frag.pending if c.island == island)
    if mine >= limits.max_pending_per_island:
        return refused(
            "too_many_pending",
            f"{mine} deltas of {island!r} already pending on fragment {fragment}",
        )
    return None


def work_refusal(tokens: int, steps: int, limits: Any) -> Outcome | None:
    """The refusal of a push claiming more work than any island does, or None.

    Args:
        tokens: the push's tokens (>= 1).
        steps: its inner steps (>= 1).
        limits: the shard's config (max_inner_steps, max_tokens_per_step).

    Returns:
        A rejected `bad_tokens` outcome when steps > max_inner_steps or
        tokens > max_tokens_per_step * steps (not yet counted), else None.
    """
    if steps > limits.max_inner_steps:
        return refused("bad_tokens", f"steps={steps} > max_inner_steps={limits.max_inner_steps}")
    if tokens > limits.max_tokens_per_step * steps:
        return refused(
            "bad_tokens",
            f"tokens={tokens} over {steps} inner steps is more than "
            f"max_tokens_per_step={limits.max_tokens_per_step} per step",
        )
    return None


def round_refusal(rnd: int, entry: DedupEntry | None, now: float, gap: int) -> Outcome | None:
    """The refusal of a round id too far in the future, or None.

    Round ids are the island's to choose (ours: its session's start in
    microseconds plus a counter), so the bound is loose: a round more than
    `gap` above both the shard's clock in microseconds and the island's newest
    accepted round on the fragment is refused, so that no single push (2**64 - 1)
    can put an island's newest round out of reach of its later ones.

    Args:
        rnd: the push's round.
        entry: the dedup entry of (island, fragment), if any.
        now: wall-clock seconds.
        gap: the shard's max_round_gap.

    Returns:
        A rejected `bad_round` outcome (not yet counted), or None.
    """
    ceiling = max(int(now * 1_000_000), entry.newest if entry is not None else 0) + gap
    if rnd <= ceiling:
        return None
    return refused(
        "bad_round",
        f"round {rnd} is more than max_round_gap={gap} above the shard's clock in "
        "microseconds and this island's newest round: number rounds from the time "
        "(microseconds) or from 0",
    )


@dataclass
class ShardCounters:
    """What `status` reports; `accepted`, `staleness` and `steps` are rebuilt by replay."""

    accepted: int = 0
    duplicates: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    bytes_in: int = 0
    bytes_out: int = 0
    staleness: dict[int, int] = field(default_factory=dict)
    steps: int = 0
    clipped: int = 0  # deltas scaled down by robust aggregation (clip_norm_multiple)
    guarded_steps: int = 0  # steps whose deltas were scaled to MAX_MERGED_NORM (state._guard)
    non_finite_steps: int = 0  # steps that left non-finite parameters (a bug; logged)
    forgotten_islands: int = 0  # islands forgotten after island_ttl_s (state.forget_idle)
    credited_forgotten: float = 0.0  # their credited tokens, summed
    # requests from islands the shard does not know (answered unknown_island: "say
    # hello"); expected after a restart or before an island's first hello here, so
    # they are not rejections
    hello_requests: int = 0
    # requests dropped unanswered, by reason (throttled, or a header that did not decode:
    # malformed, bad_version, unknown_kind): over max_refusals_per_s (paramserver.server.admission.gate)
    dropped: dict[str, int] = field(default_factory=dict)
    # island -> tokens that entered the model: merged tokens * fragment share (no g(s))
    credited: dict[str, float] = field(default_factory=dict)

    def add_step(self, staleness: list[int], credits: dict[str, float]) -> None:
        """Count one outer step.

        Args:
            staleness: the staleness of each delta it merged.
            credits: island -> tokens that entered the model in this step.
        """
        self.steps += 1
        for s in staleness:
            self.staleness[s] = self.staleness.get(s, 0) + 1
        for island, credit in credits.items():
            self.credited[island] = self.credited.get(island, 0.0) + credit

    def report(self) -> dict[str, Any]:
        """The counters as status fields (JSON-ready, str keys).

        Returns:
            accepted, duplicates, rejected (reason -> count), hello_requests,
            dropped (reason -> requests left unanswered), bytes_in, bytes_out, staleness_histogram, steps, clipped and credited_tokens (island ->
            merged tokens * fragment share, staleness not counted, rounded to 3 decimals).
        """
        return {
            "accepted": self.accepted,
            "duplicates": self.duplicates,
            "rejected": dict(sorted(self.rejected.items())),
            "hello_requests": self.hello_requests,
            "dropped": dict(sorted(self.dropped.items())),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "staleness_histogram": {str(k): v for k, v in sorted(self.staleness.items())},
            "steps": self.steps,
            "clipped": self.clipped,
            "guarded_steps": self.guarded_steps,
            "non_finite_steps": self.non_finite_steps,
            "forgotten_islands": self.forgotten_islands,
            "credited_forgotten": round(self.credited_forgotten, 3),
            "credited_tokens": {k: round(v, 3) for k, v in sorted(self.credited.items())},
        }

    def drop(self, reason: str) -> None:
        """Count a request dropped unanswered.

        Args:
            reason: why it was refused (throttled, malformed, bad_version, unknown_kind).
        """
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


# The most islands remembered; beyond it the one heard from longest ago is forgotten.
MAX_REPORTED_ISLANDS = 4096


@dataclass
class IslandReport:
    """One island as this shard saw it (wall-clock seconds)."""

    heard: float
    last_push: float | None = None
    last_round: int | None = None
    rounds: int = 0  # distinct rounds with an accepted delta here
    accepted: int = 0
    staleness: int | None = None  # the most stale of its deltas in its last merged step
    training: dict[str, float] = field(default_factory=dict)
    reported: float | None = None  # when `training` last changed hands

    def as_status(self) -> dict[str, Any]:
        """JSON-ready: the fields above, `training` flattened into the map."""
        return {
            "heard": self.heard,
            "last_push": self.last_push,
            "last_round": self.last_round,
            "rounds": self.rounds,
            "accepted": self.accepted,
            "staleness": self.staleness,
            "reported": self.reported,
            **self.training,
        }


class IslandReports:
    """Every island's `IslandReport` on one shard, bounded by MAX_REPORTED_ISLANDS."""

    def __init__(self, limit: int = MAX_REPORTED_ISLANDS) -> None:
        """Start empty.

        Args:
            limit: the most islands kept.
        """
        self.limit = limit
        self.islands: dict[str, IslandReport] = {}

    def _of(self, island: str, now: float) -> IslandReport:
        report = self.islands.get(island)
        if report is None:
            if len(self.islands) >= self.limit:
                oldest = min(self.islands, key=lambda i: self.islands[i].heard)
                del self.islands[oldest]
            report = self.islands[island] = IslandReport(heard=now)
        report.heard = max(report.heard, now)
        return report

    def heard(self, island: str, header: Mapping[str, Any], now: float) -> None:
        """A push or heartbeat of a known island arrived (its header passed the protocol check).

        Args:
            island: the island id.
            header: the message header; its training fields, when present, replace
                the island's last report.
            now: wall-clock seconds.
        """
        report = self._of(island, now)
        training = {k: float(header[k]) for k in TRAINING_FIELDS if k in header}
        if training:
            report.training, report.reported = training, now

    def accepted(self, island: str, round_id: int, now: float) -> None:
        """One delta of the island was accepted here.

        Args:
            island: the island id.
            round_id: the push's round.
            now: wall-clock seconds.
        """
        report = self._of(island, now)
        report.last_push, report.accepted = now, report.accepted + 1
        if report.last_round != round_id:
            report.last_round, report.rounds = round_id, report.rounds + 1

    def merged(self, staleness: Iterable[tuple[str, int]]) -> None:
        """An outer step merged deltas: note each island's most stale one in it.

        Args:
            staleness: (island, staleness) of each merged delta.
        """
        worst: dict[str, int] = {}
        for island, stale in staleness:
            worst[island] = max(stale, worst.get(island, stale))
        for island, stale in worst.items():
            if island in self.islands:
                self.islands[island].staleness = stale

    def forget(self, island: str) -> None:
        """Drop an island's report (the shard forgot the island).

        Args:
            island: the island id.
        """
        self.islands.pop(island, None)

    def status(self) -> dict[str, dict[str, Any]]:
        """JSON-ready: island -> `IslandReport.as_status()`, sorted by id."""
        return {i: r.as_status() for i, r in sorted(self.islands.items())}
