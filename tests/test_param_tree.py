"""worker.param_tree: leaf names for the plan and the round trip back to the user's pytree type."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import numpy as np
import pytest

from worker.param_tree import TreeError, TreeLayout

pytestmark = pytest.mark.timeout(30)


class Pair(NamedTuple):
    w: np.ndarray
    b: np.ndarray


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Block:
    scale: np.ndarray
    pairs: tuple


def _tree():
    return Block(
        scale=np.full(2, 3.0, np.float32),
        pairs=(Pair(np.ones((2, 3), np.float32), np.zeros(3, np.float32)), {"g": np.ones(1)}),
    )


def test_leaves_are_named_by_their_path_and_the_tree_comes_back_as_its_own_type():
    layout = TreeLayout.of(_tree())
    assert layout.names == ("scale", "pairs/0/w", "pairs/0/b", "pairs/1/g")
    flat = {name: np.full(shape, i, np.float32) for i, (name, shape) in
            enumerate(zip(layout.names, layout.shapes, strict=True))}  # fmt: skip
    back = layout.build(flat)
    assert isinstance(back, Block) and isinstance(back.pairs[0], Pair)
    assert back.pairs[1]["g"].dtype == np.float64  # the leaf's own dtype is kept
    assert back.pairs[0].b.tolist() == [2.0, 2.0, 2.0] and back.scale.tolist() == [0.0, 0.0]
    nested = TreeLayout.of({"a": {"b": np.ones(1, np.float32)}, "c": np.ones(1, np.float32)})
    assert nested.names == ("a/b", "c")  # what codec.flatten calls a nested dict's leaves


def test_a_tree_of_other_structure_shape_or_dtype_is_refused_naming_the_leaf():
    layout = TreeLayout.of(_tree())
    other = _tree()
    other.pairs = (other.pairs[0],)
    with pytest.raises(TreeError, match="at 'pairs/1/g'"):
        layout.leaves(other)
    other = _tree()
    other.scale = np.ones(3, np.float32)
    with pytest.raises(TreeError, match=r"'scale' is float32\[3\], the session's is float32\[2\]"):
        layout.leaves(other)
    other = _tree()
    other.scale = other.scale.astype(np.float16)
    with pytest.raises(TreeError, match="'scale' is float16"):
        layout.leaves(other)


def test_two_leaves_with_one_name_are_refused():
    with pytest.raises(TreeError, match="both named 'a/b'"):
        TreeLayout.of({"a/b": np.ones(1), "a": {"b": np.ones(1)}})
