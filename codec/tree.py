"""Tree paths: the codec names a tensor by the keys from the tree root to its leaf.

`leaf_items` walks a tree in sorted key order (the order of a message's
tensors, codec/format.py's docstring), `build_tree` nests leaves back under
their paths, `flatten` / `unflatten` convert to and from "/"-joined names.
"""

from collections.abc import Mapping

from .format import CodecError

Path = tuple[str, ...]


def leaf_items(tree: Mapping) -> list[tuple[Path, object]]:
    """Walk a tree in sorted key order.

    Args:
        tree: mapping name -> leaf, nested mappings allowed.

    Returns:
        list of (path, leaf), path being the tuple of keys down to the leaf.
        Empty sub-mappings contribute nothing.
    """
    if not isinstance(tree, Mapping):
        raise CodecError(f"a tree must be a mapping of name -> array, got {type(tree).__name__}")
    out: list[tuple[Path, object]] = []
    _walk(tree, (), out)
    return out


def _walk(node: Mapping, prefix: Path, out: list) -> None:
    for key in node:
        if not isinstance(key, str):
            raise CodecError(f"tree keys must be str, got {key!r} under {'/'.join(prefix)!r}")
    for key in sorted(node):
        value = node[key]
        if isinstance(value, Mapping):
            _walk(value, (*prefix, key), out)
        else:
            out.append(((*prefix, key), value))


def build_tree(items: list[tuple[Path, object]]) -> dict:
    """Inverse of `leaf_items`: nest leaves under their paths.

    Args:
        items: (path, leaf) pairs; paths must be distinct and no path may be a
            prefix of another.

    Returns:
        nested dict.
    """
    root: dict = {}
    for path, leaf in items:
        node = root
        for key in path[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise CodecError(f"name {'/'.join(path)!r} nests under a leaf")
            node = child
        if path[-1] in node:
            raise CodecError(f"name {'/'.join(path)!r} appears twice or is also a subtree")
        node[path[-1]] = leaf
    return root


def flatten(tree: Mapping) -> dict:
    """Flatten nested mappings to one level with "/"-joined names.

    Args:
        tree: mapping name -> array, nested mappings allowed; keys may not
            contain "/".

    Returns:
        dict "a/b" -> array in sorted name order.
    """
    flat = {}
    for path, leaf in leaf_items(tree):
        for key in path:
            if "/" in key or not key:
                raise CodecError(f"key {key!r} in {'/'.join(path)!r} is empty or contains '/'")
        flat["/".join(path)] = leaf
    return flat


def unflatten(flat: Mapping) -> dict:
    """Invert `flatten`: split "/"-joined names into nested dicts.

    Args:
        flat: mapping "a/b" -> array.

    Returns:
        nested dict.
    """
    items = []
    for name, leaf in flat.items():
        if not isinstance(name, str) or not name or "" in name.split("/"):
            raise CodecError(f"flat name {name!r} must be a non-empty str without empty parts")
        items.append((tuple(name.split("/")), leaf))
    return build_tree(items)
