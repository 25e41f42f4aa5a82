"""Alias of the shard's command line, now `paramserver.ops.cli`: kept for installed scripts.

`diloco-server` scripts installed before the move call `paramserver.server.cli:main`, and
`python -m paramserver.server.cli` is how tests and launchers start shards. This module is
the one exception to "the shard's logic never imports its operations"
(tests/test_import_direction.py names it): it imports `paramserver.ops.cli` only when run.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Run `paramserver.ops.cli.main`.

    Args:
        argv: the arguments (default sys.argv[1:]).

    Returns:
        Its exit status.
    """
    from paramserver.ops.cli import main as ops_main

    return ops_main(argv)


if __name__ == "__main__":
    sys.exit(main())
