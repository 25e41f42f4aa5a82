"""The shard side: the shard daemon (`shard`, `serve`, `supervisor`, `cli`), its
state and rules (`state`, `admission`, `binding`), the merge and outer step
(`policy`, `weighting`, `merge`, `robust`, `outer`), durability (`durable`,
`wal`, `log_records`, `records`, `checkpoint`), the downlink and metrics.
Imports the wire and the plumbing; never the client."""
