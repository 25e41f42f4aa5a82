"""`./dev fast`'s kept JAX cache: entries a killed write left truncated are dropped, the rest kept."""

from __future__ import annotations

import zstandard
from kept_jax_cache import drop_broken


def test_truncated_and_empty_entries_are_dropped_and_whole_ones_and_other_files_kept(tmp_path):
    whole = zstandard.ZstdCompressor().compress(bytes(range(256)) * 64)
    (tmp_path / "jit_step-aa-cache").write_bytes(whole)
    (tmp_path / "jit_fold-bb-cache").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "jit_push-cc-cache").write_bytes(b"")
    (tmp_path / "jit_step-aa-atime").write_bytes(b"\x00" * 8)  # not an entry: never read
    assert drop_broken(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jit_step-aa-atime", "jit_step-aa-cache"]
    assert drop_broken(tmp_path) == 0
