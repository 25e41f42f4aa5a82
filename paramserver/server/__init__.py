"""The shard side: the pure shard core (`core`: requests -> `effects`) over its state and
rules (`state`, `outcomes`, `binding`, `events`, `fragment`, `counters`), the merge
and outer step (`policy`, `weighting`, `fragment_step`, `merge`, `robust`, `outer`,
`chunked_step`, `downlink`), persistence (`storage/`), and the daemon around them (`shard`: the I/O
loop, `serve`, `supervisor`, `cli`) and metrics. Imports the wire and the plumbing;
never the client."""
