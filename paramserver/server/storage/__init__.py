"""The shard's PERSISTENCE: the write-ahead log (`wal`: records and files), checkpoints
(`checkpoint`: content and files; `checkpoint_job`: one written off the serving loop),
recovery from them (`recovery`) and the running data directory (`shard_storage`:
`ShardStorage`)."""
