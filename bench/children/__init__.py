"""Child processes the bench harness starts, each run as ``python -m bench.children.<name>``.

- `relay`: TCP relay with per-connection latency and an optional token bucket (`bench.wan`).
- `chaos_relay`: a relay that cuts, slows, drops, duplicates, delays and corrupts
  messages on a seeded schedule (`bench.chaos`).
- `ddp_reducer`: the all-reduce of the data-parallel baseline (`bench.runs`).
- `ddp_rank`: one rank of the data-parallel baseline (`bench.runs`).

- `meter`: a relay that counts the bytes of each link per time bucket (`bench.streaming`).
- `flood_peer`: a flat-out pusher or a hostile sender against one shard (`bench.load_flood`).

Each stops on SIGTERM / SIGINT and the servers among them print ``ready`` once
they listen; both through `bench.child`, which also starts and stops them.
None of them is a `diloco-bench` subcommand.
"""
