"""The packages import in one direction only: codec <- paramserver <- worker <- bench.

Walks every module's source with `ast` (no import side effects) and fails on an
import of a package that sits later in the chain, and on codec importing
anything but numpy, zstandard, msgpack (ml_dtypes for bf16, numba for the
compiled block kernels) and the stdlib; JAX only in `codec/quant_jax.py`, inside the
function that builds its JAX formulation (`codec.quant.jax_rule`), so importing
any codec module loads no JAX.
"""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ORDER = ["codec", "paramserver", "worker", "bench"]
CODEC_THIRD_PARTY = {"numpy", "zstandard", "msgpack", "ml_dtypes", "numba"}
CODEC_JAX_MODULE = "quant_jax.py"  # the one codec module that imports JAX (in a function, on use)


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
        for name in imported_top_levels(path) - allowed - _jax_if_allowed(path)
    ]
    assert not offenders, "; ".join(offenders)


def _jax_if_allowed(path: Path) -> set[str]:
    return {"jax"} if path == ROOT / "codec" / CODEC_JAX_MODULE else set()


def test_importing_codec_and_its_modules_loads_neither_jax_nor_numba():
    # JAX (and numba) are optional for codec: only a caller that asks for codec.quant.jax_rule
    # (or compiled_loops) loads it
    modules = [p.stem for p in package_files("codec") if p.name != "__init__.py"]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module('codec.' + m)\n"
        "assert 'jax' not in sys.modules, 'jax was imported'\n"
        "assert 'numba' not in sys.modules, 'numba was imported'\n"
        "from codec.quant import jax_rule\n"
        "assert 'jax' in sys.modules and callable(jax_rule.encode)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


# the codec's floors: the block rule (`quant_rule`) builds on nothing of the codec; its numba
# loops and JAX formulation on the rule; its entry points (`quant`) on those; the sparse scheme
# on the rule; the frame format (`format`: spec, layout, header) on nothing; the tree paths and
# thread pools on it; the payload frames (`payload`: the writer) on those; the readers
# (`readers`, `coded`) on all of them; the schemes and the error feedback above them
CODEC_FLOORS = {
    "codec.quant_rule": set(),
    "codec.quant_numba": {"codec.quant_rule"},
    "codec.quant_jax": {"codec.quant_rule"},
    "codec.quant": {"codec.quant_rule", "codec.quant_numba", "codec.quant_jax"},
    "codec.sparse": {"codec.quant", "codec.quant_rule"},
    "codec.format": set(),
    "codec.tree": {"codec.format"},
    "codec.parallel": {"codec.format"},
    "codec.payload": {"codec.format", "codec.parallel"},
    "codec.readers": {
        "codec.format",
        "codec.tree",
        "codec.parallel",
        "codec.payload",
        "codec.quant",
        "codec.sparse",
    },
    "codec.coded": {
        "codec.format",
        "codec.payload",
        "codec.readers",
        "codec.quant",
        "codec.quant_rule",
        "codec.sparse",
    },
}


@pytest.mark.parametrize("module", sorted(CODEC_FLOORS))
def test_the_codecs_rule_and_frame_format_import_only_below_them(module):
    graph = import_graph(package_files("codec"))
    assert graph[module] <= CODEC_FLOORS[module], f"{module} imports {sorted(graph[module])}"


def test_only_the_clients_threaded_shell_touches_sockets():
    # `paramserver.client.links` (the I/O thread's sockets) is the one client module with zmq
    files = sorted((ROOT / "paramserver" / "client").glob("*.py"))
    with_zmq = sorted(p.name for p in files if "zmq" in imported_top_levels(p))
    assert with_zmq == ["links.py"], with_zmq


def imported_modules(path: Path) -> set[str]:
    """Full dotted names of the absolute imports in a source file (`from a import b`: `a.b`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    mods: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods.add(node.module)
            mods.update(f"{node.module}.{alias.name}" for alias in node.names)
    return mods


# paramserver's wings and the wings each may import (besides itself)
WINGS_ALLOWED = {
    "wire": set(),
    "plumbing": {"wire"},
    "client": {"wire", "plumbing"},
    "server": {"wire", "plumbing"},
    "ops": {"wire", "plumbing", "server"},  # operations import the shard's logic, never the reverse
}


# launcher aliases exempt from the wing rule: the shard's old command-line path, kept so that
# installed `diloco-server` scripts and `python -m paramserver.server.cli` still work
ALIASES = {ROOT / "paramserver" / "server" / "cli.py"}


def wing_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "paramserver" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in WINGS_ALLOWED else None


def wing_offenders(files: list[Path], allowed_for) -> list[str]:
    offenders = []
    for path in files:
        for mod in imported_modules(path):
            wing = wing_of(mod)
            if wing is not None and wing not in allowed_for(path):
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
                offenders.append(f"{where} imports {mod}")
    return sorted(offenders)


@pytest.mark.parametrize("wing", sorted(WINGS_ALLOWED))
def test_paramserver_wings_import_only_below_them(wing):
    # islands' client never reaches the shard side; the wire and plumbing stay at the bottom
    files = sorted(set((ROOT / "paramserver" / wing).rglob("*.py")) - ALIASES)
    assert files, f"paramserver/{wing}/ is empty"
    offenders = wing_offenders(files, lambda _path: WINGS_ALLOWED[wing] | {wing})
    assert not offenders, f"paramserver.{wing} may import only {WINGS_ALLOWED[wing]}: " + "; ".join(
        offenders
    )


# the shard's rooms (paramserver/server/...) and the server modules each may import besides
# its own room: admission and step are rules over the state's data; persistence stores the
# state; the core runs a request through them; only the loop (`shard`) holds sockets and files
SERVER_ROOMS_ALLOWED = {
    "admission": {"fragment"},
    "step": {"config", "fragment"},
    "storage": {"config", "fragment", "state", "admission", "step"},
    "state": {"config", "fragment", "state_init", "admission", "step"},
    "effects": {"fragment", "state", "admission"},
    "checkpoint_schedule": set(),
    "core": {"config", "effects", "fragment", "state", "admission", "checkpoint_schedule", "step"},
}


def room_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["paramserver", "server"] or len(parts) < 3:
        return None
    return parts[2]


@pytest.mark.parametrize("room", sorted(SERVER_ROOMS_ALLOWED))
def test_the_shards_rooms_import_only_what_they_build_on(room):
    path = ROOT / "paramserver" / "server" / room
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
    allowed = SERVER_ROOMS_ALLOWED[room] | {room}
    offenders = [
        f"{file.relative_to(ROOT)} imports {mod}"
        for file in files
        for mod in imported_modules(file)
        if room_of(mod) is not None and room_of(mod) not in allowed
    ]
    assert not offenders, f"paramserver.server.{room} may import {sorted(allowed)}: " + "; ".join(
        offenders
    )


def test_paramserver_has_no_flat_modules_outside_the_wings():
    flat = sorted(p.name for p in (ROOT / "paramserver").glob("*.py"))
    assert flat == ["__init__.py", "__main__.py"], flat


def test_worker_uses_only_the_client_and_the_plumbing():
    # an island never imports the shard side (nor the wire's internals directly)
    offenders = [
        f"{path.relative_to(ROOT)} imports {mod}"
        for path in package_files("worker")
        for mod in imported_modules(path)
        if mod.startswith("paramserver")
        and mod not in {"paramserver", "paramserver.client", "paramserver.plumbing"}
        and not mod.startswith(("paramserver.client.", "paramserver.plumbing."))
    ]
    assert not offenders, "worker may use paramserver's client and plumbing only: " + "; ".join(
        offenders
    )


def test_the_wing_check_sees_a_client_reaching_the_shard_side(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from paramserver.server.state import ShardState\nimport numpy\n")
    offenders = wing_offenders([bad], lambda _path: {"client", "wire", "plumbing"})
    assert offenders and all("bad.py imports paramserver.server.state" in o for o in offenders)
    # `from paramserver.client import core` names the client wing, which the client may use
    ok = tmp_path / "ok.py"
    ok.write_text("from paramserver.client import core\n")
    assert wing_offenders([ok], lambda _path: {"client"}) == []


def test_the_walker_sees_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import worker.model\nfrom bench import demo\nfrom . import sibling\n")
    assert imported_top_levels(bad) == {"worker", "bench"}


CONTROL_SCRIPT = """
import contextlib, io, sys
from paramserver.ops import cli as server_cli
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


# ---- no import cycle inside a package: a walk of the module graph ----


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported: any depth except functions, TYPE_CHECKING."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for orelse in child.orelse:
                    visit(ast.Module(body=[orelse], type_ignores=[]))
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                found.append(child)
            visit(child)

    visit(tree)
    return found


def import_graph(files: list[Path], root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules among `files` it imports when it is imported (relative ones resolved).

    `from a import b` is an edge to `a.b` when that is a module here, else to `a`.
    """
    names = {module_name_under(path, root): path for path in files}
    graph: dict[str, set[str]] = {name: set() for name in names}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _module_level_imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                named = [f"{base}.{alias.name}" for alias in node.names]
                targets = [t for t in named if t in names]  # submodules named in the import
                if len(targets) < len(named):  # and names defined in `base` itself
                    targets.append(base)
            for target in targets:
                while target and target not in names:  # import a.b.c of an unknown leaf: a.b
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def module_name_under(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` as [a, b, ..., a], or [] when there is none (a depth-first walk)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := walk(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (cycle := walk(start)):
            return cycle
    return []


@pytest.mark.parametrize("package", ORDER)
def test_no_import_cycle_inside_the_package(package):
    graph = import_graph(package_files(package))
    cycle = find_cycle(graph)
    assert not cycle, f"import cycle in {package}: " + " -> ".join(cycle)


def test_the_cycle_walk_sees_a_cycle_through_a_package_init(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import A\n")
    (pkg / "a.py").write_text("from .sub import b\nA = 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import C\n"
        "def later():\n    from pkg import a\nfrom pkg import A\n"
    )
    (pkg / "c.py").write_text("import pkg.a\n")
    graph = import_graph(sorted(pkg.rglob("*.py")), tmp_path)
    assert graph["pkg.sub.b"] == {"pkg"}  # not pkg.c (TYPE_CHECKING), not pkg.a (in a function)
    assert find_cycle(graph) == ["pkg", "pkg.a", "pkg.sub.b", "pkg"]
    (pkg / "__init__.py").write_text("")
    assert find_cycle(import_graph(sorted(pkg.rglob("*.py")), tmp_path)) == []
