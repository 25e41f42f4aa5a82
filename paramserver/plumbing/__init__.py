"""Daemon plumbing shared by the server and the worker: pid files and signals
(`daemon`), layered settings (`settings`), CURVE keys and the key-to-island
binding (`curve`, `identity`), cluster files, read-only probes and the status
view, the C heap's trim (`heap`) and a worker thread beside an I/O loop
(`loop_thread`: the shard's step, push-check and log writer threads). Imports
the wire only."""
