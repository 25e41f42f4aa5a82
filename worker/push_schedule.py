"""Streaming fragments: when each fragment of an island's delta is pushed within a round.

Without streaming an island pushes every fragment at the end of its round, so
its link carries the whole delta in one burst every H steps. With streaming
(`--streaming true`, Streaming DiLoCo, arXiv 2501.18512) fragment p of P is
pushed at inner step ``floor(p * H / P)`` of each round, each with its own
delta since its own last push, so the bytes of a round are spread over it and
the peak rate falls by about P.

Steps are counted within a round as ``k = 1 .. H`` (k inner steps done); step
0 of a round is the end of the previous one, so a fragment whose offset is 0
(always fragment 0) is pushed at ``k = H``, where a non-streaming island
pushes everything. In the first round fragment p > 0 thus sends the work of
its first ``floor(p * H / P)`` steps, and from then on every push carries H
steps of work. When the island stops (its last round, or SIGTERM), every
fragment with unsent steps is pushed once more ("the flush"), so a streaming
run puts exactly the tokens of a non-streaming one into the model.

Adopting published versions stays per fragment (`worker.exchange.FragmentSync`
keeps a base version and an anchor per fragment), so nothing else changes.

Sync mode: a cluster of mode "sync" makes every island wait after its round
for the merge of all its fragments; there is nothing left to overlap, and
waiting per fragment would stall training P times per round. An island with
`--streaming true` therefore refuses a sync cluster at join
(`check_streaming_mode`).
"""

from __future__ import annotations

from collections.abc import Mapping


class StreamingError(ValueError):
    """Streaming cannot run against this cluster; the message says what to change."""


def fragment_offsets(inner_steps: int, num_fragments: int) -> list[int]:
    """Inner step of the round at which each fragment is pushed.

    Args:
        inner_steps: H, inner steps per round (>= 1).
        num_fragments: P, fragments in the plan (>= 1).

    Returns:
        ``[floor(p * H / P) for p in range(P)]`` (0 = the round's end).
    """
    if inner_steps < 1 or num_fragments < 1:
        raise ValueError(
            f"inner_steps and num_fragments must be >= 1, got {inner_steps} and {num_fragments}"
        )
    return [p * inner_steps // num_fragments for p in range(num_fragments)]


def due_fragments(step: int, inner_steps: int, num_fragments: int) -> list[int]:
    """The fragments to push once `step` inner steps of the round are done.

    Args:
        step: inner steps done in this round, 1 .. H.
        inner_steps: H.
        num_fragments: P.

    Returns:
        Fragment indexes p whose offset ``floor(p * H / P)`` equals ``step mod H``,
        ascending (several share a step when H < P).
    """
    if not 1 <= step <= inner_steps:
        raise ValueError(f"step must be in 1..{inner_steps}, got {step}")
    at = step % inner_steps
    return [
        p for p, offset in enumerate(fragment_offsets(inner_steps, num_fragments)) if offset == at
    ]


def flush_fragments(unsent_steps: Mapping[int, int]) -> list[int]:
    """The fragments to push when the island stops: those with unsent work.

    Args:
        unsent_steps: fragment -> inner steps since its last push.

    Returns:
        Fragment indexes with at least one unsent step, ascending.
    """
    return sorted(p for p, steps in unsent_steps.items() if steps > 0)


def check_streaming_mode(streaming: bool, mode: str) -> None:
    """Refuse streaming against a cluster of mode "sync" (see the module docstring).

    Args:
        streaming: the island's `streaming` setting.
        mode: the cluster's merge mode, from the join.

    Raises:
        StreamingError: streaming against a sync cluster (one line: what to change).
    """
    if streaming and mode == "sync":
        raise StreamingError(
            "streaming true needs a cluster of mode quorum or async, and this one runs "
            "mode sync (islands wait for the merge after each round: nothing to overlap); "
            "start the island with --streaming false or the shards with --mode quorum"
        )


def unblocked(
    due: list[int], last_push: Mapping[int, int], outcomes: Mapping[tuple[int, int], str]
) -> list[int]:
    """The due fragments of a quorum-mode island whose previous delta is settled.

    An island keeps at most one unmerged delta per fragment in quorum mode
    while its shards are up: a fragment whose last push is still pending,
    deferred (`too_many_pending`) or acked but not merged skips this push, and
    its next push carries the work of both rounds against a newer base. (With
    a shard down the session does not ask: the client queues pushes as before
    and re-sends them when the shard is back.) A shard slower than the islands thus gets
    fewer, larger deltas instead of a queue of stale ones that it refuses, has
    re-sent and merges late under the outer momentum. (Sync mode waits for
    each round's merge; async mode steps on every delta as it comes, so its
    islands push every round: examples/own_mlp.py, async, ended at 0.028
    without the skip and 0.049 with it. A multi-process island pushes on
    schedule: its processes must agree on what each step pushes. An island
    with `skip_stale_pushes` false never asks.)

    Args:
        due: fragments due to push now.
        last_push: fragment -> round id of its last push.
        outcomes: (round, fragment) -> `Client.delta_outcomes` of those pushes.

    Returns:
        The due fragments never pushed, or whose last push was merged or rejected.
    """
    settled = {f for (_, f), outcome in outcomes.items() if outcome in ("merged", "rejected")}
    return [f for f in due if f not in last_push or f in settled]
