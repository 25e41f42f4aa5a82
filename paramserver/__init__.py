"""The outer parameter server and its client, in five wings: `wire` (shared by
both sides), `server` (the shard's logic), `ops` (the shard as a daemon: cli,
serve, supervisor, metrics, the cluster page), `client` (what islands use) and
`plumbing` (daemon helpers shared with `worker`)."""
