"""examples/ use only the public API: `worker`, `codec`, `paramserver.client` (and each other).

Every examples/*.py is parsed (not run): an import of `bench`, of a `paramserver`
module other than `paramserver.client`, or of `tests` fails, naming file and line.
"""

import ast
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PUBLIC = ("worker", "codec", "paramserver.client")
PROJECT = ("bench", "paramserver", "tests", *PUBLIC)


def _is_under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in `path` (`from X import y` also yields X.y)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def private_imports(path: Path) -> list[str]:
    """The imports of project modules outside the public API in `path`, as 'file:line module'."""
    bad = []
    for line, module in imported_modules(path):
        if not any(_is_under(module, p) for p in PROJECT):
            continue  # the standard library, jax, numpy, the examples' own local_server
        if module == "paramserver":  # `from paramserver import client` names paramserver.client
            continue
        if not any(_is_under(module, p) for p in PUBLIC):
            bad.append(f"{path.name}:{line} {module}")
    return bad


def test_every_example_imports_only_the_public_api():
    scripts = sorted(EXAMPLES.glob("*.py"))
    assert len(scripts) >= 4, scripts  # own_mlp, flax_nnx, token_file, local_server
    bad = [b for script in scripts for b in private_imports(script)]
    assert not bad, "examples/ import outside the public API: " + ", ".join(bad)


def test_the_check_catches_bench_and_paramserver_internals(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text(
        "import bench.launcher\n"
        "from paramserver.plumbing import probe\n"
        "from paramserver.client import Client\n"
        "import worker\n"
        "from codec import Codec\n"
        "import numpy\n"
    )
    assert private_imports(script) == [
        "bad.py:1 bench.launcher",
        "bad.py:2 paramserver.plumbing",
        "bad.py:2 paramserver.plumbing.probe",
    ]
