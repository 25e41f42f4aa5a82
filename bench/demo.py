"""The main job: a local cluster (2 shards, 3 islands, one at half speed) training on the embedded corpus.

    diloco-bench demo [--duration 150] [--model tiny] [--out runs/demo]

Starts real daemons (`diloco-server start --detach`, `diloco-worker start
--detach`), prints the address of the live cluster page (the server's
`--metrics-port`: a free port unless `--metrics-port` says, 0 for none),
shows a live table of every island (loss, global eval loss, version lag,
bytes), then stops the islands, evaluates the global model once every acked
delta is merged (`diloco-worker eval`), prints a summary (eval loss before/after,
bytes on the wire against synchronous data parallel for the same tokens, goodput
per island), writes `summary.json` and `loss.png` to the output directory and
stops the server. Every island trains at least `--duration` seconds: the clock
the progress lines show counts them, from the moment every island trains (the
first ones start earlier, while the others compile: the plot shows that head
start); the plot ends with the final eval. Progress goes to stdout, errors to
stderr; `--json` prints the summary as the last line of stdout and the progress
on stderr instead, so that stdout holds the JSON alone.

The live table needs a terminal: when the progress stream is not one (a pipe,
a log file, CI) or with `--no-live`, the demo prints one plain progress line
every few seconds instead. Ctrl-C prints one line, stops every daemon the demo
started and exits with status 130; a Ctrl-C while daemons are being started
takes effect once they are up (their launchers are shielded from it), so none
is left behind.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import analysis, cli, outdir, plots
from bench.common import human_bytes
from bench.launcher import IslandSpec, LaunchError, LocalCluster, free_base_port
from worker.data import default_corpus, unigram_entropy

UNIGRAM_NATS = round(unigram_entropy(default_corpus()), 3)  # best context-free loss
PROGRESS_S = 5.0  # seconds between two plain progress lines (no terminal)
INTERRUPTED_EXIT = 130  # 128 + SIGINT, as a shell reports it
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}  # both stop every daemon the demo started
GOODPUT_LINE = (  # printed under the summary table
    "goodput: share of an island's wall time spent on inner steps whose work entered the "
    "model (waits, back-pressure, rejected work are lost; staleness is not: it shows in the loss)"
)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM ended the demo; the message is already printed."""


class _Interrupt:
    """SIGINT and SIGTERM handler: one line, then raise `Interrupted`, or later while daemons start.

    While `deferred` is set (a start of daemons is under way) the signal is only
    recorded; `check` raises once the start returned. A second signal is ignored,
    so that stopping the cluster is never cut short.
    """

    def __init__(self) -> None:
        self.hit = False
        self.deferred = False

    def handler(self, _signum: int, _frame: Any) -> None:
        if self.hit:
            return
        self.hit = True
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the stop commands inherit it too
        print("diloco-bench demo: interrupted; stopping the daemons it started",
              file=sys.stderr, flush=True)  # fmt: skip
        if not self.deferred:
            raise Interrupted

    def check(self) -> None:
        """Raise `Interrupted` if a SIGINT or SIGTERM arrived while deferred."""
        if self.hit:
            raise Interrupted

    def shielded(self, start: Callable[[], None]) -> None:
        """Run a daemon start where Ctrl-C cannot cut it short.

        The start runs in a thread that blocks SIGINT and SIGTERM, so the launcher processes
        it runs (and the daemons they spawn) inherit the blocked signal and finish
        starting; this thread keeps receiving them and defers them until then.

        Args:
            start: starts daemons (e.g. `LocalCluster.start_islands` with its specs).
        """
        errors: list[BaseException] = []

        def target() -> None:
            signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
            try:
                start()
            except BaseException as exc:  # re-raised below, in the main thread
                errors.append(exc)

        self.deferred = True
        try:
            thread = threading.Thread(target=target, name="demo-start", daemon=True)
            thread.start()
            while thread.is_alive():
                thread.join(0.2)
        finally:
            self.deferred = False
        self.check()
        if errors:
            raise errors[0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `diloco-bench demo`."""
    parser.add_argument(
        "--duration", type=float, default=150.0, help="seconds of training (default 150)"
    )
    parser.add_argument("--model", default="tiny", help="tiny | small | base (default tiny)")
    parser.add_argument("--islands", type=int, default=3, help="number of islands (default 3)")
    parser.add_argument("--shards", type=int, default=2, help="number of shards (default 2)")
    parser.add_argument(
        "--slow-speed", type=float, default=0.5, help="speed of the last island (default 0.5)"
    )
    parser.add_argument(
        "--inner-steps", type=int, default=30, help="inner steps per round (default 30)"
    )
    parser.add_argument(
        "--out",
        default="runs/demo",
        help="output directory (default runs/demo); must be new, empty or an earlier demo's",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="port of the cluster page and Prometheus metrics (default: a free port; 0: off)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the summary (summary.json without the server status) on stdout as JSON, "
        "and the progress on stderr",
    )
    parser.add_argument(
        "--no-live",
        action="store_true",
        help="plain progress lines instead of the live table (automatic without a terminal)",
    )


def ddp_bytes(params: int, steps: int, islands: int) -> int:
    """Bytes one island moves for `steps` steps of synchronous data parallel.

    A ring all-reduce of fp32 gradients sends and receives 2 (n-1)/n of the
    gradient per step and island.

    Args:
        params: parameter count.
        steps: inner steps the island ran.
        islands: number of data-parallel replicas.

    Returns:
        Bytes sent plus received by one island.
    """
    if islands < 2:
        return 0
    return int(2 * 2 * (islands - 1) / islands * 4 * params * steps)


def _compact_table(title: str, columns: tuple[str, ...], caption: str | None = None):
    """A rich table that fits 80 columns: no vertical rules, one space of padding.

    Args:
        title: shown above.
        columns: headers; the first is left-aligned, the rest right-aligned.
        caption: shown below (e.g. what a short header means).

    Returns:
        The empty `rich.table.Table`.
    """
    from rich import box
    from rich.table import Table

    table = Table(title=title, caption=caption, box=box.SIMPLE_HEAD, show_edge=False,
                  pad_edge=False, collapse_padding=True)  # fmt: skip
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right", no_wrap=True)
    return table


def _table(cluster: LocalCluster, names: list[str], elapsed: float, duration: float):
    table = _compact_table(
        f"decoupled-diloco demo: {elapsed:.0f}s / {duration:.0f}s",
        ("island", "speed", "state", "round", "loss", "eval", "lag", "sent", "recv", "good"),
        caption="eval: global model on held-out data; good: goodput",
    )
    for name in names:
        s = cluster.island_status(name)
        table.add_row(
            name,
            f"{s.get('speed', '')}",
            s.get("state", "starting"),
            str(s.get("round", 0)),
            f"{s['loss']:.3f}" if "loss" in s else "-",
            f"{s['eval_global']:.3f}" if "eval_global" in s else "-",
            str(s.get("version_lag", "-")),
            human_bytes(s.get("bytes_sent", 0)),
            human_bytes(s.get("bytes_received", 0)),
            f"{100 * s['goodput']:.0f}%" if "goodput" in s else "-",
        )
    return table


def summarize(
    cluster: LocalCluster,
    names: list[str],
    speeds: dict[str, float],
    final: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Summary of a finished run from the islands' metrics files and the final eval.

    Args:
        cluster: the (stopped) cluster.
        names: island names.
        speeds: island -> emulated speed.
        final: `LocalCluster.final_eval` (the global model after the last merge,
            with the shards' status); without it the newest island eval counts.

    Returns:
        JSON-ready summary.
    """
    final = final or {}
    credited = analysis.credited_tokens(final.get("server") or {})
    rows = {name: cluster.island_metrics(name) for name in names}
    evals = sorted(
        (r["wall"], r["eval_global"]) for rs in rows.values() for r in rs if "eval_global" in r
    )
    islands = {}
    total_wire = total_ddp = 0
    params = max((r.get("params", 0) for rs in rows.values() for r in rs), default=0)
    for name, rs in rows.items():
        last = rs[-1] if rs else {}
        wire = last.get("bytes_sent", 0) + last.get("bytes_received", 0)
        ddp = ddp_bytes(params, last.get("steps", 0), len(names))
        total_wire += wire
        total_ddp += ddp
        islands[name] = {
            "speed": speeds[name],
            "rounds": last.get("round", 0),
            "steps": last.get("steps", 0),
            "tokens": last.get("tokens", 0),
            "final_train_loss": next((r["loss"] for r in reversed(rs) if "loss" in r), None),
            "bytes_sent": last.get("bytes_sent", 0),
            "bytes_received": last.get("bytes_received", 0),
            "ddp_bytes_same_tokens": ddp,
            "goodput": (
                analysis.final_goodput(rs, credited[name])
                if name in credited
                else last.get("goodput")
            ),
        }
    after = final.get("eval_loss", evals[-1][1] if evals else None)
    return {
        "params": params,
        "eval_loss_before": evals[0][1] if evals else None,
        "eval_loss_after": after,
        "eval_after_versions": final.get("version_sum"),
        "unigram_entropy": UNIGRAM_NATS,
        "bytes_on_wire": total_wire,
        "ddp_bytes_same_tokens": total_ddp,
        "ddp_over_wire": (total_ddp / total_wire) if total_wire else None,
        "islands": islands,
    }


def plot(
    cluster: LocalCluster,
    names: list[str],
    path: Path,
    final: tuple[float, float] | None = None,
) -> None:
    """Write a PNG: train loss per island and global eval loss against wall-clock time.

    Args:
        cluster: the (stopped) cluster.
        names: island names.
        path: the PNG.
        final: (wall-clock time, loss) of the final eval of the merged model, or None.
    """
    rows = {n: cluster.island_metrics(n) for n in names}
    plots.write_demo_plot(rows, UNIGRAM_NATS, path, final=final)


def run(args: argparse.Namespace) -> int:
    """Run the demo.

    Args:
        args: the parsed flags.

    Returns:
        0; 1 with a one-line message if a daemon fails; 130 after Ctrl-C (one
        line, every daemon it started stopped).
    """
    interrupt = _Interrupt()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, interrupt.handler) for s in STOP_SIGNALS} if main_thread else {}
    try:
        return _run(args, interrupt)
    except Interrupted:
        return INTERRUPTED_EXIT
    except LaunchError as exc:
        if interrupt.hit:  # a terminal's Ctrl-C also reached a launcher: already said
            return INTERRUPTED_EXIT
        print(f"diloco-bench demo: {exc}", file=sys.stderr)
        return 1
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _run(args: argparse.Namespace, interrupt: _Interrupt) -> int:
    out = outdir.claim(Path(args.out), "demo")
    names = [f"island-{i}" for i in range(args.islands)]
    speeds = {n: 1.0 for n in names}
    if args.islands > 1:
        speeds[names[-1]] = args.slow_speed
    common = ("--model", args.model, "--inner-steps", str(args.inner_steps))
    specs = [IslandSpec(n, speeds[n], common) for n in names]
    quorum = max(1, args.islands - 1)
    log = sys.stderr if args.json else sys.stdout  # progress; stdout holds the JSON alone
    live = not args.no_live and log.isatty()
    metrics_port = free_base_port(1) if args.metrics_port is None else args.metrics_port
    server_args = ("--quorum", str(quorum), "--metrics-port", str(metrics_port))
    server_args += ("--inner-steps", str(args.inner_steps))  # H: the default outer lr
    with LocalCluster(out, shards=args.shards, server_args=server_args) as cluster:
        print(f"starting {args.shards} shards on {cluster.connect} ...", file=log, flush=True)
        interrupt.shielded(cluster.start_server)
        if metrics_port:
            print(
                f"cluster page: http://{cluster.host}:{metrics_port}/ (live)", file=log, flush=True
            )
        print(
            f"starting {args.islands} islands (JAX import + compile takes a while) ...",
            file=log,
            flush=True,
        )
        interrupt.shielded(lambda: cluster.start_islands(specs))
        _watch(cluster, names, args.duration, live, log)
        print("stopping islands ...", file=log, flush=True)
        for name in names:
            cluster.stop_island(name)
        print("final eval of the merged global model ...", file=log, flush=True)
        final = cluster.final_eval(("--model", args.model))
        final_wall = time.time()
        if "error" in final:
            print(f"diloco-bench demo: final eval failed: {final['error']}", file=sys.stderr)
    summary = summarize(cluster, names, speeds, final)
    summary["server"] = final.get("server") or {}
    summary["duration_s"] = args.duration
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    scored = final.get("eval_loss")
    plot(cluster, names, out / "loss.png", (final_wall, scored) if scored is not None else None)
    _print_summary(summary, out, log)
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if k != "server"}))
    return 0


def progress_line(statuses: dict[str, dict[str, Any]], elapsed: float, duration: float) -> str:
    """One plain progress line: tokens of all islands, each island's train loss, the newest eval.

    Args:
        statuses: island -> its status.json (in the order of the islands).
        elapsed: seconds of training so far.
        duration: seconds of training planned.

    Returns:
        E.g. ``[  15s/150s] tokens 1.23M  loss 2.412 2.455 starting  eval 2.500``;
        an island without a loss yet shows its state.
    """
    tokens = sum(s.get("tokens", 0) for s in statuses.values())
    count = f"{tokens / 1e6:.2f}M" if tokens >= 1e6 else f"{tokens / 1e3:.0f}k"
    losses = " ".join(
        f"{s['loss']:.3f}" if "loss" in s else s.get("state", "starting") for s in statuses.values()
    )
    evals = [
        (s.get("wall", 0.0), s["eval_global"]) for s in statuses.values() if "eval_global" in s
    ]
    newest = f"  eval {max(evals)[1]:.3f}" if evals else ""
    return f"[{elapsed:4.0f}s/{duration:.0f}s] tokens {count}  loss {losses}{newest}"


def _watch(
    cluster: LocalCluster, names: list[str], duration: float, live: bool, stream: Any
) -> None:
    """Show progress on `stream` for `duration` seconds once every island is up.

    The clock counts those seconds, from 0 to `duration` (the islands that
    started first have trained a little longer). Ctrl-C raises `Interrupted`
    in the sleeps.
    """
    began = time.monotonic()

    def left() -> tuple[float, float, dict[str, dict[str, Any]]]:
        statuses = {n: cluster.island_status(n) for n in names}
        elapsed = time.monotonic() - began
        return duration - elapsed, elapsed, statuses

    if not live:
        print(f"every {PROGRESS_S:g}s: tokens, train loss of {' '.join(names)}, global eval",
              file=stream, flush=True)  # fmt: skip
        while (now := left())[0] > 0:
            print(progress_line(now[2], now[1], duration), file=stream, flush=True)
            time.sleep(max(0.0, min(PROGRESS_S, now[0])))
        return
    from rich.console import Console
    from rich.live import Live

    with Live(console=Console(file=stream), refresh_per_second=2) as display:
        while (now := left())[0] > 0:
            display.update(_table(cluster, names, now[1], duration))
            time.sleep(0.5)


def _print_summary(summary: dict[str, Any], out: Path, stream: Any) -> None:
    from rich.console import Console

    console = Console(file=stream)
    before, after = summary["eval_loss_before"], summary["eval_loss_after"]
    console.print(
        f"\nglobal eval loss: {before if before is None else f'{before:.3f}'} -> "
        f"{after if after is None else f'{after:.3f}'} nats/byte "
        f"(unigram entropy {UNIGRAM_NATS})"
    )
    ratio = summary["ddp_over_wire"]
    console.print(
        f"bytes on the wire: {human_bytes(summary['bytes_on_wire'])}; data parallel for the "
        f"same tokens: {human_bytes(summary['ddp_bytes_same_tokens'])}"
        + (f" ({ratio:.0f}x)" if ratio else "")
    )
    table = _compact_table(
        "islands", ("island", "speed", "rounds", "tokens", "sent", "received", "goodput")
    )
    for name, s in summary["islands"].items():
        table.add_row(
            name, f"{s['speed']}", str(s["rounds"]), str(s["tokens"]), human_bytes(s["bytes_sent"]),
            human_bytes(s["bytes_received"]),
            f"{100 * s['goodput']:.0f}%" if s["goodput"] is not None else "-",
        )  # fmt: skip
    console.print(table)
    console.print(GOODPUT_LINE)
    console.print(f"wrote {out / 'summary.json'} and {out / 'loss.png'}")


if __name__ == "__main__":
    sys.exit(cli.main(["demo", *sys.argv[1:]]))
