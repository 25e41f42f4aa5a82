"""Error-feedback state: the per-tensor residuals carried between encodes.

Owns the optax-shaped state (`init(tree) -> state`, `encode(tree, state) ->
(frames, state)`), its validation against the tree being encoded, and the
double buffering that lets encode write new residuals without allocating:
each state owns a residual set and a spare set, and the state an encode
returns swaps them. Consequences, checked at run time: a state can be used by
one successful encode (a failed encode leaves it valid), after which only the
returned state may be used.
"""

from typing import NamedTuple

import numpy as np

from .format import CodecError
from .tree import build_tree, leaf_items


class _Ticket:
    """Shared, mutable generation counter of one chain of states."""

    def __init__(self):
        self.generation = 0


class ErrorFeedbackState(NamedTuple):
    """Residuals of error feedback, one float32 1-D array per tensor.

    Attributes:
        paths: tensor paths in tree order.
        shapes: tensor shapes.
        residuals: float32 1-D arrays (read them, do not write them).
        spare: buffers the next encode writes its residuals into.
        ticket: generation counter shared by the chain of states.
        generation: this state's generation; valid while it equals the ticket's.
    """

    paths: tuple
    shapes: tuple
    residuals: tuple
    spare: tuple
    ticket: _Ticket
    generation: int

    def residual_tree(self) -> dict:
        """The residuals as a tree shaped like the encoded one.

        Returns:
            nested dict path -> float32 array of the tensor's shape (views).
        """
        return build_tree(
            [
                (p, r.reshape(s))
                for p, s, r in zip(self.paths, self.shapes, self.residuals, strict=True)
            ]
        )


def init_state(paths: list, shapes: list) -> ErrorFeedbackState:
    """Zero residuals for the given tensors.

    Args:
        paths: tensor paths in tree order.
        shapes: tensor shapes.

    Returns:
        a fresh ErrorFeedbackState.
    """
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    return ErrorFeedbackState(
        tuple(paths),
        tuple(tuple(s) for s in shapes),
        tuple(np.zeros(n, np.float32) for n in sizes),
        tuple(np.zeros(n, np.float32) for n in sizes),
        _Ticket(),
        0,
    )


def check_state(state, paths: list, shapes: list) -> None:
    """Fail with a clear message when `state` does not fit this tree or is stale.

    Args:
        state: the state passed to encode.
        paths: tensor paths of the tree being encoded.
        shapes: their shapes.
    """
    if not isinstance(state, ErrorFeedbackState):
        raise CodecError(
            f"state must come from codec.init(tree) (or be None), got {type(state).__name__}"
        )
    if state.paths != tuple(paths) or state.shapes != tuple(tuple(s) for s in shapes):
        have = {"/".join(p): s for p, s in zip(state.paths, state.shapes, strict=True)}
        want = {"/".join(p): tuple(s) for p, s in zip(paths, shapes, strict=True)}
        diff = sorted(k for k in have.keys() | want.keys() if have.get(k) != want.get(k))
        raise CodecError(
            "error-feedback state does not match the tree (differs at "
            f"{', '.join(diff[:5])}{' ...' if len(diff) > 5 else ''}); "
            "call init(tree) first with a tree of the same names and shapes"
        )
    if state.generation != state.ticket.generation:
        raise CodecError(
            "this error-feedback state was already used by an encode; pass the state "
            "that encode returned (or call init(tree) to start over)"
        )


def advance(state: ErrorFeedbackState) -> ErrorFeedbackState:
    """The state after a successful encode wrote its residuals into `spare`.

    Args:
        state: the state that encode consumed.

    Returns:
        the next state (residual and spare buffers swapped).
    """
    state.ticket.generation += 1
    return state._replace(
        residuals=state.spare, spare=state.residuals, generation=state.ticket.generation
    )


def refund(state: ErrorFeedbackState, tree) -> ErrorFeedbackState:
    """Put values that were sent but never applied back into the error-feedback residuals.

    An island whose push was finally refused (or whose entries the receiver
    did not apply) adds the decoded values of what it sent (`codec.decode` of
    the frames) back, so the next encode sends that mass again instead of
    losing it: residual <- residual + values, tensor by tensor.

    Args:
        state: the current state (the one the last encode returned).
        tree: mapping name -> array shaped like the encoded tree (nested allowed).

    Returns:
        The next state (the old one may no longer be used, as after an encode).

    Raises:
        CodecError: a tree that does not fit the state, or a stale state.
    """
    items = [(p, np.asarray(leaf)) for p, leaf in leaf_items(tree)]
    check_state(state, [p for p, _ in items], [a.shape for _, a in items])
    for (_, values), old, new in zip(items, state.residuals, state.spare, strict=True):
        np.add(old, values.reshape(-1).astype(np.float32, copy=False), out=new)
    return advance(state)
