"""The outer parameter server and its client, in four wings: `wire` (shared by
both sides), `server` (the shard daemon), `client` (what islands use) and
`plumbing` (daemon helpers shared with `worker`)."""
