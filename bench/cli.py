"""`diloco-bench`: one command, one subcommand per bench module.

`COMMANDS` lists the subcommands: name -> (module, one-line help). Each module
defines ``add_arguments(parser)`` and ``run(args) -> int``; only the chosen one
is imported, so a heavy subcommand never slows the others down. A name with an
underscore is also accepted with a hyphen (`island_memory`, `island-memory`).
Adding a subcommand is one entry here. An output directory a subcommand
refuses (`bench.outdir.OutDirError`) ends it here with one line on stderr and
exit status 2. SIGTERM unwinds a subcommand as Ctrl-C does (`child.sigterm_unwinds`:
SystemExit(143) in the main thread), so the daemons, helpers and network
namespaces it started are stopped and removed when `timeout` or a scheduler ends it.
"""

import argparse
import importlib
import sys

from bench import child
from bench.outdir import OutDirError

# one line per subcommand: name -> (module, help)
# fmt: off
COMMANDS: dict[str, tuple[str, str]] = {
    "async_outer": ("bench.async_outer", "Outer lr / momentum sweep for fully asynchronous merging (picks the mode=async defaults)."),
    "topk_outer": ("bench.topk_outer", "Top-k against int8 at equal tokens: outer lr, density, EF decay and round count."),
    "outer_sweep": ("bench.outer_sweep", "Outer lr x momentum by mode, H and island count, with the daemon's fold rule (picks `outer_defaults`)."),
    "step_rule": ("bench.step_rule", "The step rule as islands multiply: round movement for K = 1..16, async vs sync loss (push-only folds), the harsh mix."),
    "chaos": ("bench.chaos", "Chaos run: training under a seeded fault schedule next to a fault-free run with the same seed."),
    "control_plane": ("bench.control_plane", "The control plane under a bulk push on a thin, long link: one shared connection against two."),
    "flows": ("bench.flows", "Several bulk flows against one on window-limited connections: a join and a round of pushes."),
    "codec": ("bench.codec", "Codec benchmark: ratio, error, error feedback and throughput of every scheme."),
    "device": ("bench.device_check", "The accelerator check: installs CUDA JAX where a GPU lacks it; island, quantize and join figures against baselines, one JSON."),
    "demo": ("bench.demo", "The main job: a local cluster (2 shards, 3 islands, one at half speed) training on the embedded corpus."),
    "fidelity": ("bench.fidelity", "Reproduce Decoupled DiLoCo's quorum table and DiLoCo's parity with DDP, with real daemons."),
    "island_exchange": ("bench.island_exchange", "The island exchange per round, on the device against on the host, vs a device memcpy."),
    "island_memory": ("bench.island_memory", "Bytes of parameters + AdamW state per device of an island, replicated against fsdp."),
    "load": ("bench.load", "Load test: many lightweight simulated islands (client only, random int8 deltas) against N shards."),
    "regions": ("bench.regions", "Emulated multi-region deployment: regions in network namespaces over shaped, delayed WAN links, probed first."),
    "report": ("bench.report", "Benchmarks that reproduce the seed's claims: DDP vs synchronous DiLoCo vs this system on WAN links."),
    "outbox_cost": ("bench.outbox_cost", "What persisting before sending costs an island: outbox writes per round against its exchange."),
    "outer_h": ("bench.outer_h", "Outer lr / momentum per H: synchronous DiLoCo against DDP at equal tokens (picks the sync defaults)."),
    "restart": ("bench.restart", "Restart-to-first-step of an island, cold and warm JAX compilation cache."),
    "session_overhead": ("bench.session_overhead", "What the public island API costs: `Session.step` per call between pushes and per round."),
    "scale": ("bench.scale", "Shard memory, step, checkpoint stalls and the island exchange at scale, against issue 21's targets."),
    "server": ("bench.server", "Shard throughput: merge + outer step vs decode, push->ack round trips, checkpoint and restart."),
    "streaming": ("bench.streaming", "Streaming fragments against round-end pushes: peak/average bytes per second at the island's socket, and loss."),
}
# fmt: on


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
    for name, (module_name, summary) in COMMANDS.items():
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
    child.sigterm_unwinds()
    try:
        return int(args._module.run(args) or 0)
    except OutDirError as exc:
        print(f"diloco-bench {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
