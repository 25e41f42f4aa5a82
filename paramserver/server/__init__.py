"""The shard: one process's logic, in rooms by concept.

- `shard`: the I/O loop (ROUTER and PUB sockets, one fsync per batch, then send);
- `core`: the sans-I/O protocol core (requests and ticks in, effects out);
- `admission/`: who may send and how fast (`gate`), what came of a request (`outcomes`);
- `state`, `state_init`, `events`, `fragment`: the event-sourced state and its init;
- `step/`: when to step (`policy`), the weights, the merge, the outer optimizer, the
  chunked step and the quantized downlink;
- `storage/`: the write-ahead log, checkpoints, recovery, the data directory;
- `config`: the shard's settings.

Operations (cli, serve, supervisor, metrics, cluster page) are `paramserver.ops`, which
imports this package, never the reverse. Imports the wire and the plumbing; never the
client."""
