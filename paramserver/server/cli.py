"""`python -m paramserver.server.cli` still runs the shard's command line, now `paramserver.ops.cli`.

A launcher alias only: it imports nothing of `paramserver.ops` (the shard's
logic never imports its operations), it runs that module as __main__.
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("paramserver.ops.cli", run_name="__main__", alter_sys=True)
