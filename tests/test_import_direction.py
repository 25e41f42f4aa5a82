"""The packages import in one direction only: codec <- paramserver <- worker <- bench.

Walks every module's source with `ast` (no import side effects) and fails on an
import of a package that sits later in the chain, and on codec importing
anything but numpy, zstandard, msgpack (ml_dtypes for bf16) and the stdlib.
"""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ORDER = ["codec", "paramserver", "worker", "bench"]
CODEC_THIRD_PARTY = {"numpy", "zstandard", "msgpack", "ml_dtypes"}


def imported_top_levels(path: Path) -> set[str]:
    """Top-level module names a source file imports (relative imports excluded)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def package_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", ORDER)
def test_no_import_against_the_direction(package):
    later = set(ORDER[ORDER.index(package) + 1 :])
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in package_files(package)
        for name in imported_top_levels(path) & later
    ]
    assert not offenders, "imports against codec <- paramserver <- worker <- bench: " + "; ".join(
        offenders
    )


def test_codec_imports_only_its_allowed_dependencies():
    allowed = CODEC_THIRD_PARTY | set(sys.stdlib_module_names) | {"codec"}
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in package_files("codec")
        for name in imported_top_levels(path) - allowed
    ]
    assert not offenders, "; ".join(offenders)


def test_worker_uses_only_the_public_paramserver_modules():
    public = {
        "paramserver",
        "paramserver.client",
        "paramserver.daemon",
        "paramserver.settings",
        "paramserver.probe",  # read-only operator queries (worker.evaluate's final eval)
    }
    offenders = []
    for path in package_files("worker"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            for mod in mods:
                if mod.startswith("paramserver") and mod not in public:
                    offenders.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not offenders, "worker may use paramserver's client only: " + "; ".join(offenders)


def test_the_walker_sees_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import worker.model\nfrom bench import demo\nfrom . import sibling\n")
    assert imported_top_levels(bad) == {"worker", "bench"}


CONTROL_SCRIPT = """
import contextlib, io, sys
from paramserver import cli as server_cli
from worker import cli as worker_cli
data, keys, port = sys.argv[1], sys.argv[2], sys.argv[3]
runs = [
    (server_cli.main, ["stop", "--data-dir", data, "--timeout", "1"]),
    (server_cli.main, ["status", "--connect", "tcp://127.0.0.1:" + port, "--timeout", "0.2"]),
    (server_cli.main, ["keys", "--out", keys, "--name", "isl"]),
    (worker_cli.main, ["stop", "--data-dir", data, "--timeout", "1"]),
    (worker_cli.main, ["status", "--data-dir", data]),
]
for main, argv in runs:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        with contextlib.suppress(SystemExit):
            main(argv)
print(sorted(m for m in ("jax", "optax", "flax") if m in sys.modules))
"""


@pytest.mark.timeout(120)
def test_control_commands_import_no_jax(tmp_path):
    # stop, status and keys of both daemons run without importing JAX (a fresh interpreter)
    import subprocess

    from conftest import free_port

    proc = subprocess.run(
        [sys.executable, "-c", CONTROL_SCRIPT, str(tmp_path / "none"), str(tmp_path / "keys"),
         str(free_port())],
        capture_output=True, text=True, timeout=100, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout
    assert (tmp_path / "keys" / "isl.key").exists()  # the keys command really ran
