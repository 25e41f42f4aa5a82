"""The shard's ADMISSION: who may send and how fast (`gate`: ids bound to connections,
request-rate buckets), and what came of each request (`outcomes`: named outcomes and
refusals, their counts, what status shows of each island). The sans-I/O core
(`paramserver.server.core.ShardCore.handle`) runs a request through them."""
