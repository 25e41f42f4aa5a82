"""Ctrl-C at random moments of the flagship example ends it, its server and all, and keeps the work.

`examples/own_mlp.py` starts a 2-shard server and two islands (threads) that
train against it. A seeded RNG picks `PER_KIND` moments of each kind:

- joining: once the server is up (the islands compile and join);
- training: while the islands train against live shards;
- backpressure: the shards are SIGSTOPped until an island's round row leaves
  less than a round's deltas of room under `max_unacked`: its push waits for a slot;
- flush: a run of 4 rounds whose shards are SIGSTOPped once both islands logged a
  round, until an island logged its last round after the stop: it waits at close
  for acks that do not come (4 rounds of 4 fragments fit in `max_unacked`: no
  back-pressure);
- stopped: the shards are SIGSTOPped a round before the SIGINT (pushes in flight).

Each case is its own example process, in its own session. The fixture records
every pid the case starts (the example, the server's supervisor, its shards,
found by their pid files) and, whatever happens, resumes and kills each one
still alive at teardown. The test asserts that the example exits within
`EXIT_S` of the SIGINT, that none of those pids is alive then, that each
island's outbox file holds exactly the unacked deltas the island said it kept,
and that when acks were held some island kept deltas.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from paramserver.client import ClientConfig
from paramserver.plumbing import daemon
from worker import outbox

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "own_mlp.py"
SEED = 34
EXIT_S = 10.0  # the bound: the example ends within this of the SIGINT
START_TIMEOUT_S = 240.0  # a server and JAX start in seconds; far longer on a loaded box
LANES = 2  # cases run side by side (each has its own server, ports and files)
KINDS = ("joining", "training", "backpressure", "flush", "stopped")
HELD = {"backpressure", "flush", "stopped"}  # the shards hold acks when the SIGINT comes
ISLANDS = ("a", "b")
_POLL_S = 0.02
_KEPT = r"island (\w+) stopped with (\d+) unacked deltas: kept in"
FLUSH_ROUNDS = 4  # rounds of the flush case's run
# its inner steps a round: ~0.25 s of the example's MLP, so that the stop comes before an
# island's last round (at 20, ~10 ms a round, one island had ended and the other's pushes
# were all acked before the stop in 1 of several full runs)
FLUSH_INNER_STEPS = 500
PER_KIND = 1  # moments of each kind (each case is a whole run of the example)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@dataclass
class Moment:
    """One case: what runs, and when the SIGINT comes."""

    kind: str
    delay_s: float  # after the case's trigger (server up, training, back-pressure, ...)

    @property
    def flags(self) -> list[str]:
        """The example's size: a short run of 4 rounds for `flush`, else one that trains on."""
        if self.kind == "flush":  # 4 rounds x 4 fragments: at most max_unacked deltas held
            steps = FLUSH_INNER_STEPS * FLUSH_ROUNDS
            return ["--steps", str(steps), "--inner-steps", str(FLUSH_INNER_STEPS)]
        return ["--steps", "100000", "--inner-steps", "5"]


def moments(seed: int) -> list[Moment]:
    """`PER_KIND` moments of each kind, with delays drawn from `seed`, in a shuffled order."""
    rng = random.Random(seed)
    delays = {
        "joining": (0.0, 1.5),
        "training": (0.0, 2.0),
        "backpressure": (0.0, 1.0),
        "flush": (0.0, 1.0),
        "stopped": (0.0, 0.3),
    }
    cases = [Moment(kind, rng.uniform(*delays[kind])) for kind in KINDS for _ in range(PER_KIND)]
    rng.shuffle(cases)
    return cases


@dataclass
class Case:
    """A running example and every pid it was seen to start."""

    proc: subprocess.Popen
    out: Path
    pids: set[int] = field(default_factory=set)
    lines: list[str] = field(default_factory=list)

    def daemon_pids(self) -> list[int]:
        """The server's supervisor and shards, by their pid files (recorded as seen)."""
        found = [daemon.running_pid(p) for p in self.out.rglob(daemon.PID_FILE)]
        live = [pid for pid in found if pid is not None]
        self.pids.update(live)
        return live

    def shard_pids(self) -> list[int]:
        """The live shards' pids (an empty list until both are up)."""
        files = sorted((self.out / "server").glob("shard-*/" + daemon.PID_FILE))
        pids = [daemon.running_pid(p) for p in files]
        if len(pids) < 2 or None in pids:
            return []
        self.pids.update(pids)
        return pids

    def output(self) -> str:
        return "".join(self.lines)


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


@pytest.fixture
def examples(tmp_path) -> Iterator[Callable[[str, list[str]], Case]]:
    """Start own_mlp.py cases; at teardown resume and kill every process any case started."""
    cases: list[Case] = []
    lock = threading.Lock()

    def start(name: str, flags: list[str]) -> Case:
        out = tmp_path / name
        argv = [sys.executable, "-u", str(EXAMPLE), "--out", str(out), "--json", *flags]
        proc = subprocess.Popen(
            argv, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"},
        )  # fmt: skip
        case = Case(proc, out, pids={proc.pid})
        with lock:
            cases.append(case)
        reader = threading.Thread(target=lambda: case.lines.extend(proc.stdout), daemon=True)
        reader.start()
        return case

    try:
        yield start
    finally:
        for case in cases:
            with contextlib.suppress(OSError):
                case.daemon_pids()  # the latest pid files too
            if case.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(case.proc.pid, signal.SIGKILL)
            live = [pid for pid in case.pids if daemon.pid_alive(pid)]
            _signal(live, signal.SIGKILL)
            _signal(live, signal.SIGCONT)  # a SIGSTOPped process dies of SIGKILL too; be sure
            with contextlib.suppress(subprocess.TimeoutExpired):
                case.proc.wait(timeout=30)


def _wait(case: Case, done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not done():
        case.daemon_pids()
        if case.proc.poll() is not None:
            pytest.fail(f"the example exited before {what}:\n{case.output()}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {START_TIMEOUT_S:g}s:\n{case.output()}")
        time.sleep(_POLL_S)


def _rows(case: Case, island: str) -> list[dict]:
    path = case.out / island / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            rows.append(json.loads(line))
    return rows


def _outbox_deltas(case: Case, island: str) -> int:
    try:
        saved = outbox.load(case.out / island / "outbox.bin")
    except outbox.fmt.OutboxFileError:  # mid-write: read again at the next poll
        return 0
    return 0 if saved is None else len(saved.deltas)


def _training(case: Case) -> bool:
    return all(_rows(case, i) for i in ISLANDS) and bool(case.shard_pids())


def _blocked(case: Case, island: str) -> bool:
    """Whether the island's push waits for a slot: its last round row shows fewer than a
    round's deltas of room under `max_unacked`.

    A row is written once its round is handed to the push thread (the pushes it counts
    are the earlier rounds'), so pending 14 of 16 with 4 deltas a round means that round
    waits after 2; the next round's end then waits for the push thread and writes no row.
    (Pending reaches exactly 16 in a row only when the acks stopped on a round's edge.)
    """
    rows = _rows(case, island)
    if not rows:
        return False
    per_round = rows[-1].get("pushes", 0) - rows[-2].get("pushes", 0) if len(rows) > 1 else 0
    return rows[-1].get("pending", 0) + max(per_round, 0) > ClientConfig.max_unacked


def _closing(case: Case, island: str) -> bool:
    """Whether the island logged its last round (`FLUSH_ROUNDS`) but not its final row."""
    rows = _rows(case, island)
    return bool(rows) and rows[-1].get("round") == FLUSH_ROUNDS and not rows[-1].get("final")


def _drive(case: Case, moment: Moment) -> float:
    """Bring the case to its moment and send the SIGINT; return when it was sent."""
    if moment.kind == "joining":  # the server is up; the islands import, compile, join
        _wait(case, lambda: "server:" in case.output(), "server")
    else:
        _wait(case, lambda: _training(case), "training")
    if moment.kind in HELD:  # acks are held from now on
        rounds = {i: len(_rows(case, i)) for i in ISLANDS}
        silent = case.output().count("silent for")  # the islands' "shard N silent" lines so far
        _signal(case.shard_pids(), signal.SIGSTOP)
    if moment.kind == "backpressure":  # an island's pushes wait for a slot
        _wait(case, lambda: any(_blocked(case, i) for i in ISLANDS), "back-pressure")
    elif moment.kind == "flush":  # an island logged its last round after the stop (that
        # round's pushes cannot be acked) and flushes at close

        def flushing() -> bool:
            return any(_closing(case, i) and len(_rows(case, i)) > rounds[i] for i in ISLANDS)

        _wait(case, flushing, "an island's flush of pushes made after the stop")
    elif moment.kind == "stopped":  # an island pushed a round after the stop (rows: one each),
        # or judged the shards silent (an island near its unacked cap blocks instead of pushing)

        def stopped_seen() -> bool:
            pushed = any(len(_rows(case, i)) >= rounds[i] + 2 for i in ISLANDS)
            return pushed or case.output().count("silent for") > silent

        _wait(case, stopped_seen, "a push or the shards judged silent")
    time.sleep(moment.delay_s)
    case.daemon_pids()
    sent = time.monotonic()
    case.proc.send_signal(signal.SIGINT)
    return sent


def _run_case(start: Callable[[str, list[str]], Case], index: int, moment: Moment) -> str | None:
    """Run one case; return what went wrong, or None."""
    case = start(f"{index}-{moment.kind}", moment.flags)
    try:
        sent = _drive(case, moment)
    except pytest.fail.Exception as exc:  # reported with the other cases' outcomes
        return f"case {index} ({moment.kind}): {exc}"
    deadline = sent + EXIT_S
    while case.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    took = time.monotonic() - sent
    label = f"case {index} ({moment.kind}, +{moment.delay_s:.2f}s)"
    if case.proc.poll() is None:  # where its threads are: faulthandler dumps them on SIGABRT
        case.proc.send_signal(signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            case.proc.wait(timeout=10)
        dumped = time.monotonic() + 5.0  # the reader thread takes the dump's lines
        while "most recent call first" not in case.output() and time.monotonic() < dumped:
            time.sleep(_POLL_S)
        return f"{label}: still running {took:.1f}s after the SIGINT:\n{case.output()[-12000:]}"
    left = sorted(pid for pid in case.pids if daemon.pid_alive(pid))
    if left:
        return f"{label}: pids {left} left running:\n{case.output()[-3000:]}"
    said = {m[1]: int(m[2]) for m in re.finditer(_KEPT, case.output())}
    kept = {i: _outbox_deltas(case, i) for i in ISLANDS}
    # an island that said what it kept must have kept exactly that; one whose close the
    # example's exit cut short said nothing, and its outbox holds what it persisted before
    # each push (the file loads: `_outbox_deltas`)
    if any(i in said and kept[i] != said[i] for i in ISLANDS):
        return f"{label}: outboxes hold {kept}, the islands said {said}:\n{case.output()[-3000:]}"
    if moment.kind in HELD and not any(kept.values()):
        return f"{label}: acks were held, yet no outbox holds a delta:\n{case.output()[-3000:]}"
    return None


def test_sigint_at_random_moments_ends_the_example_and_keeps_the_unacked_deltas(examples):
    plan = moments(SEED)
    assert sorted(m.kind for m in plan) == sorted(KINDS * PER_KIND)
    with ThreadPoolExecutor(LANES) as pool:
        failures = list(pool.map(lambda im: _run_case(examples, *im), enumerate(plan)))
    problems = [f for f in failures if f is not None]
    assert not problems, "\n\n".join(problems)
