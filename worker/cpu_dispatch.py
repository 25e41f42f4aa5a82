"""How an island daemon's JAX runs computations on a CPU device: inline, on the calling thread.

By default JAX hands each CPU computation to one of XLA's worker threads and
returns at once. XLA allocates the computation's scratch (about 16.8 MB per
step for the `tiny` model) with malloc on whichever thread runs it. glibc's
malloc gives each thread its own arena, so over a run several arenas each
keep a copy of that scratch, and each one at times hands its free top back to
the system and takes it again. The island's RSS then moves among levels about
16 MB apart (docs/results.md, "What moves an island's RSS"), which reads as
growth in an hour's soak.

Run inline, a computation's scratch is taken and freed on the thread that
called it, in that thread's arena, and reused there step after step. Measured
on this project's VM (the `tiny` step, 3,000 steps, a fresh process each):
RSS held one level from step 250 on inline, against levels 16 MB apart
spanning 78-95 MiB by default, and the step took as long (the means of three
alternating pairs within 2.4%; docs/results.md, "The island's CPU computations
run inline"). The setting touches only the CPU backend (GPU and TPU dispatch
as they do) and only computations on one device.

`configure` must run before the process's first JAX computation: JAX reads the
setting when it creates its CPU client. The island daemon calls it first
thing. A `worker.join` session leaves the user's process as it is (JAX's
client may already exist); docs/operations.md says how to set it there. This
module imports JAX only inside `configure`, so control commands stay free of it.
"""

from __future__ import annotations


def configure() -> str:
    """Make this process's CPU computations run inline, on the thread that calls them.

    Call before the process's first JAX computation; later, JAX's CPU client
    exists and keeps the mode it was created with.

    Returns:
        The mode JAX's setting now holds, read back: "inline" or "asynchronous".
    """
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", False)
    return "asynchronous" if jax.config.values["jax_cpu_enable_async_dispatch"] else "inline"
