"""Daemon plumbing shared by the server and the worker: pid files and signals
(`daemon`), layered settings (`settings`), CURVE keys and the key-to-island
binding (`curve`, `identity`), cluster files, read-only probes and the status
view. Imports the wire only."""
