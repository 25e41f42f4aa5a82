"""The shard: one process's logic, in rooms by concept.

- `shard`: the I/O loop (ROUTER and PUB sockets; its step, push-check and log writer threads);
- `group_commit`: the log writer thread (one append and fsync per group of records) and the
  replies that wait for their record (the rest is sent at once);
- `core`: the sans-I/O protocol core (requests and ticks in, effects out, their types);
- `admission/`: who may send, how fast, how much unread (`gate`), what came of a request
  (`outcomes`);
- `state`, `state_init`, `fragment`: the event-sourced state (a fragment's state and the
  events of its log: `fragment`) and its init;
- `step/`: when to step (`policy`), the weights and the round clock (`weighting`), the
  merge, the outer optimizer, the chunked step and the quantized downlink;
- `storage/`: the write-ahead log, checkpoints, recovery, the data directory;
- `config`: the shard's settings.

Operations (cli, serve, supervisor, metrics, cluster page) are `paramserver.ops`, which
imports this package, never the reverse. Imports the wire and the plumbing; never the
client."""
