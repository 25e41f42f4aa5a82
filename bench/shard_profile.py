"""Profile one shard of a local cluster with cProfile, without touching the shard's code.

`profile_env(directory, index)` returns the environment that makes the shard
process of `index` (``python -m paramserver.server.cli shard --index I``) run under
cProfile from its start to its clean exit (SIGTERM: drain, checkpoint, exit
0), writing ``shard-I.pstats`` into `directory`: a ``sitecustomize.py`` put on
PYTHONPATH there starts the profiler in that process only (its main thread,
the shard's loop). `sections(path)` reads such a file back as the seconds
spent in each part of the shard's loop (cumulative, so nested parts are also
inside their parents: see `SECTIONS`).
"""

from __future__ import annotations

import os
import pstats
from pathlib import Path
from typing import Any

ENV = "DILOCO_BENCH_PROFILE_SHARD"  # "<index>:<pstats path>"

_SITECUSTOMIZE = '''"""Written by bench.shard_profile: cProfile the shard named in $%(env)s, if this is it."""
import os
import sys

_spec = os.environ.get("%(env)s", "")
_index, _, _path = _spec.partition(":")
_argv = list(sys.argv)
if _path and "shard" in _argv and _argv[_argv.index("shard") + 1 :][:2] == ["--index", _index]:
    import atexit
    import cProfile

    _profile = cProfile.Profile()

    def _dump():
        _profile.disable()
        _profile.dump_stats(_path)

    atexit.register(_dump)
    _profile.enable()
'''

# section -> (file suffix, function): cumulative seconds of that function. Nested:
# serve > turn > {poll, handle > {unpack, submit_delta > {decode, wal_append}}, step >
# {wal_append, merge_and_optimizer}, fsync, flush}, checkpoint.
SECTIONS: dict[str, tuple[str, str]] = {
    "serve": ("paramserver/server/shard.py", "serve"),
    "turn": ("paramserver/server/shard.py", "_turn"),
    "poll_wait": ("zmq/sugar/socket.py", "poll"),
    "recv": ("zmq/sugar/socket.py", "recv_multipart"),
    "handle": ("paramserver/server/core.py", "handle"),
    "unpack_header": ("paramserver/wire/protocol.py", "unpack"),
    "push_submit": ("paramserver/server/state.py", "submit_delta"),
    "push_decode": ("codec/readers.py", "decode"),
    "wal_append": ("paramserver/server/storage/shard_storage.py", "append"),
    "due_fragments": ("paramserver/server/state.py", "due_fragments"),
    "step": ("paramserver/server/state.py", "step"),
    "step_apply": ("paramserver/server/state.py", "_apply_step"),
    "fsync": ("paramserver/server/storage/shard_storage.py", "sync"),
    "flush_replies_publish": ("paramserver/server/core.py", "settle"),
    "checkpoint": ("paramserver/server/shard.py", "maybe_checkpoint"),
    "snapshot": ("paramserver/server/core.py", "_on_snapshot"),
    "heartbeat": ("paramserver/server/core.py", "_on_heartbeat"),
}


def profile_env(directory: Path, index: int) -> dict[str, str]:
    """Environment additions that profile shard `index`; writes the sitecustomize.py.

    Args:
        directory: where sitecustomize.py and shard-<index>.pstats go (created).
        index: the shard to profile.

    Returns:
        PYTHONPATH (this directory first) and the profile variable.
    """
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(_SITECUSTOMIZE % {"env": ENV})
    path = os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, ENV: f"{index}:{directory / f'shard-{index}.pstats'}"}


def sections(path: Path, top: int = 12) -> dict[str, Any]:
    """Seconds per section of the shard loop, and the functions with the most own time.

    Args:
        path: a pstats file written by the profiled shard.
        top: how many functions to list by own time.

    Returns:
        {"cumulative_s": {section: seconds}, "top_own_s": [[function, seconds], ...]}, the
        latter among the functions the shard's loop calls (a function's own time counts
        all its calls, also those from outside the loop).
    """
    stats = pstats.Stats(str(path)).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    cumulative: dict[str, float] = {}
    for section, (suffix, name) in SECTIONS.items():
        cumulative[section] = round(
            sum(
                row[3]
                for (file, _, func), row in stats.items()
                if func == name and file.replace(os.sep, "/").endswith(suffix)
            ),
            3,
        )
    inside = _called_from(stats, SECTIONS["serve"])  # leave out imports and start-up
    by_own = sorted(inside, key=lambda key: stats[key][2], reverse=True)[:top]
    own = [[f"{_short(key[0])}:{key[2]}", round(stats[key][2], 3)] for key in by_own]
    return {"cumulative_s": cumulative, "top_own_s": own}


def _called_from(stats: dict, root: tuple[str, str]) -> set:
    """The functions called, directly or not, from `root` (file suffix, name), and it."""
    callees: dict[Any, set] = {}
    for key, row in stats.items():
        for caller in row[4]:
            callees.setdefault(caller, set()).add(key)
    todo = [k for k in stats if k[2] == root[1] and k[0].replace(os.sep, "/").endswith(root[0])]
    seen = set(todo)
    while todo:
        for callee in callees.get(todo.pop(), ()):
            if callee not in seen:
                seen.add(callee)
                todo.append(callee)
    return seen


def _short(file: str) -> str:
    parts = file.replace(os.sep, "/").split("/")
    return "/".join(parts[-2:])
