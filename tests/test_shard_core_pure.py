"""The shard's deciding modules read no clock, start no thread and touch no socket."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / "paramserver" / "server"
DECIDING = [
    "core", "state", "state_init", "fragment",
    "admission/gate", "admission/outcomes",
    "step/policy", "step/weighting", "step/merge", "step/sparse_merge",
    "step/outer", "step/fragment_step", "step/downlink",
]  # fmt: skip
FORBIDDEN = {"zmq", "threading", "time"}


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("module", DECIDING)
def test_a_deciding_module_imports_no_clock_thread_or_socket(module):
    assert not _imported(SERVER / f"{module}.py") & FORBIDDEN


def test_the_walker_sees_a_clock(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom time import monotonic\n")
    assert _imported(bad) & FORBIDDEN == {"time"}


def test_the_core_loads_without_zmq():
    code = "import sys, paramserver.server.core; print('zmq' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
