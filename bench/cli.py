"""`diloco-bench`: one command, one subcommand per bench module.

Owns the dispatcher. A module of the `bench` package becomes a subcommand
(named after the module) by defining two top-level functions::

    def add_arguments(parser: argparse.ArgumentParser) -> None: ...
    def run(args: argparse.Namespace) -> int: ...

The first line of its module docstring is the subcommand's help. Modules are
found by reading their source (no import), and only the chosen one is
imported, so a heavy subcommand never slows the others down. An output
directory a subcommand refuses (`bench.outdir.OutDirError`) ends it here with
one line on stderr and exit status 2.
"""

import argparse
import ast
import importlib
import sys
from pathlib import Path

from bench.outdir import OutDirError

PACKAGE_DIR = Path(__file__).resolve().parent
REQUIRED = {"add_arguments", "run"}


def discover() -> dict[str, tuple[str, str]]:
    """Find the subcommands.

    Returns:
        name -> (module path, one-line help), sorted by name.
    """
    found = {}
    for path in sorted(PACKAGE_DIR.glob("*.py")):
        if path.stem.startswith("_") or path.stem == "cli":
            continue
        try:
            tree = ast.parse(path.read_text(), filename=str(path))
        except (OSError, SyntaxError):
            continue
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        if names >= REQUIRED:
            doc = (ast.get_docstring(tree) or "").strip().splitlines()
            found[path.stem] = (f"bench.{path.stem}", doc[0] if doc else "")
    return found


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser, with the arguments of the chosen subcommand only.

    Args:
        argv: the command line without the program name.

    Returns:
        argparse parser whose parsed namespace carries `_module`.
    """
    parser = argparse.ArgumentParser(
        prog="diloco-bench", description="Measurements and the local-cluster launcher."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, summary) in discover().items():
        # island_memory is also island-memory: a module name cannot hold a hyphen
        aliases = [name.replace("_", "-")] if "_" in name else []
        sp = sub.add_parser(name, aliases=aliases, help=summary, description=summary)
        if chosen in (name, *aliases):
            module = importlib.import_module(module_name)
            module.add_arguments(sp)
            sp.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a bench subcommand.

    Args:
        argv: arguments (default: sys.argv[1:]).

    Returns:
        the subcommand's exit status (2 when its output directory is refused).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args._module.run(args) or 0)
    except OutDirError as exc:
        print(f"diloco-bench {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
