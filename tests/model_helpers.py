"""Sizes of the named models, for bounds that tests compute from their inputs."""

from __future__ import annotations

import functools


@functools.cache
def tiny_params() -> int:
    """Parameters of the tiny model: an int8 delta of it is at least this many bytes.

    Returns:
        The count, from the model's shapes (nothing is materialised).
    """
    import jax

    from worker import model

    shapes = jax.eval_shape(lambda: model.init_params(model.model_config("tiny"), 0))
    return model.count_params(shapes)
