"""Operations around the shard: the command line, the serve loop of a host's shards, the supervisor, metrics, the cluster page.

Operations import the shard's logic (`paramserver.server`), never the reverse.
"""
