"""Bulk transfers over several connections per island-shard link, against a real shard.

The island's DEALERs reach the shard through a TCP relay written here (a
thread of the test, real sockets on 127.0.0.1): it counts the bytes each
connection carries towards the shard, and can cut one connection in the
middle of a message. The shard's welcome advertises the relay, so the
island's control and bulk DEALERs all pass through it; its PUB is direct.

The pushes' values are small multiples of powers of two, so the shard's
async SGD step (lr 1, one delta per fragment) is exact in float32 and the
expected parameters are computed by hand.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
from dataclasses import dataclass

import numpy as np
import pytest
from client_helpers import clients
from conftest import RunningShard, free_port, wait_for
from shard_helpers import delta_frames

from paramserver.server.config import ShardConfig
from paramserver.server.shard import ShardServer

pytestmark = pytest.mark.timeout(120)

FRAGMENTS = 6
ROWS, COLS = 6, 65536  # 6 fragments of 256 KiB of float32
BULK_LINKS = 3
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close sends a reset
# 3 bulk links; no re-send on a timer and no reconnect of a shard slow under load
# (10 s of silence): what goes again here goes because its connection died
_SLOW_TO_GIVE_UP = {
    "bulk_links": BULK_LINKS,
    "ack_timeout_s": 30.0,
    "heartbeat_interval_s": 0.5,
    "liveness": 20,
}


@dataclass
class Flow:
    """One relayed connection: the island's end, the shard's end, bytes towards the shard."""

    island: socket.socket
    shard: socket.socket
    up: int = 0
    down: int = 0
    cut: bool = False
    closed: bool = False


class Relay:
    """A TCP relay in a thread: each accepted connection is piped to `target`.

    `arm(after)` cuts the first connection that carries `after` more bytes
    towards the shard (counted from the arming): exactly `after` of them
    are passed on, then both ends are reset, so the shard sees part of a
    message and the island a dead connection.
    """

    def __init__(self, port: int, target: tuple[str, int]) -> None:
        self.target = target
        self.flows: list[Flow] = []
        self.lock = threading.Lock()
        self._cut_after: int | None = None
        self._armed_at: dict[int, int] = {}
        self._listener = socket.create_server(("127.0.0.1", port))
        self._listener.setblocking(False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="relay", daemon=True)
        self._thread.start()

    def arm(self, after: int) -> None:
        """Cut the first connection that passes `after` more bytes towards the shard."""
        with self.lock:
            self._armed_at = {i: f.up for i, f in enumerate(self.flows)}
            self._cut_after = after

    def carried(self) -> list[int]:
        """Bytes each connection carried towards the shard, in accept order."""
        with self.lock:
            return [f.up for f in self.flows]

    def brought(self) -> list[int]:
        """Bytes each connection brought back from the shard, in accept order."""
        with self.lock:
            return [f.down for f in self.flows]

    def cuts(self) -> int:
        with self.lock:
            return sum(f.cut for f in self.flows)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for flow in self.flows:
            flow.island.close()
            flow.shard.close()
        self._listener.close()

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, None)
        while not self._stop.is_set():
            for key, _ in sel.select(timeout=0.05):
                if key.data is None:
                    self._accept(sel)
                else:
                    self._pipe(sel, *key.data)
        sel.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        try:
            island, _ = self._listener.accept()
        except BlockingIOError:
            return
        shard = socket.create_connection(self.target)
        flow = Flow(island, shard)
        with self.lock:
            self.flows.append(flow)
            index = len(self.flows) - 1
            self._armed_at[index] = 0
        for sock, towards_shard in ((island, True), (shard, False)):
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ, (index, towards_shard))

    def _pipe(self, sel: selectors.BaseSelector, index: int, towards_shard: bool) -> None:
        flow = self.flows[index]
        if flow.closed:  # its other end's event of the same round closed it
            return
        source, sink = (flow.island, flow.shard) if towards_shard else (flow.shard, flow.island)
        try:
            data = source.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        cut = False
        if data and towards_shard:
            with self.lock:
                if self._cut_after is not None:
                    left = self._armed_at.get(index, 0) + self._cut_after - flow.up
                    if left < len(data):
                        data, cut, self._cut_after = data[: max(0, left)], True, None
                flow.up += len(data)
        elif data:
            with self.lock:
                flow.down += len(data)
        if data:
            try:
                sink.setblocking(True)
                sink.sendall(data)
                sink.setblocking(False)
            except OSError:
                cut = True
        if cut or not data:
            flow.cut, flow.closed = flow.cut or cut, True
            for sock in (flow.island, flow.shard):
                with contextlib.suppress(KeyError, ValueError):
                    sel.unregister(sock)
                with contextlib.suppress(OSError):
                    # reset, not a clean close: a connection cut in the middle of a message
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
                sock.close()


@pytest.fixture
def relayed(tmp_path):
    """Factory: relayed() -> (shard, relay, the island's endpoint, the shard's ROUTER);
    stopped at teardown."""
    made = []

    def make():
        base = free_port(3)
        router, pub, front = (f"tcp://127.0.0.1:{base + i}" for i in range(3))
        cfg = ShardConfig(
            data_dir=str(tmp_path / "server"),
            fsync=True,  # an ack says the delta is on disk
            mode="async",
            fragments=FRAGMENTS,
            outer_optimizer="sgd",
            outer_lr=1.0,
            weighting="uniform",
            downlink="float32",  # the step's increment as computed, not quantised
            heartbeat_interval_s=0.5,
            liveness=20,
        )
        shard = RunningShard(ShardServer(cfg, 0, [(front, pub)], router, pub))
        relay = Relay(base + 2, ("127.0.0.1", base))
        made.append((shard, relay))
        return shard, relay, front, router

    yield make
    for shard, relay in made:
        relay.close()
        shard.stop()


@pytest.fixture
def client():
    yield from clients()


def _init() -> dict[str, np.ndarray]:
    values = (np.arange(ROWS * COLS) % 13).astype(np.float32).reshape(ROWS, COLS)
    return {"w": values}


def _delta(fragment: int, size: int) -> np.ndarray:
    """Exact in float32, different per element and per fragment."""
    return ((np.arange(size) % 7) - 3).astype(np.float32) * np.float32(2.0 ** -(fragment + 2))


def _push_round(island, res) -> dict[int, np.ndarray]:
    deltas = {}
    for f in res.plan.fragments:
        deltas[f.index] = _delta(f.index, f.size)
        island.push(f.index, 0, res.versions[f.index], 100, 1, delta_frames(deltas[f.index]))
    return deltas


def _expected(res, deltas: dict[int, np.ndarray]) -> dict[str, np.ndarray]:
    """The parameters after one SGD step of lr 1 per fragment: init - delta."""
    flat = _init()
    out = {path: value.copy() for path, value in flat.items()}
    for f in res.plan.fragments:
        before = res.plan.gather_piece(flat, f.index, 0, f.size)
        res.plan.scatter(f.index, before - deltas[f.index], out)
    return out


def _shard_values(res, router: str, peer) -> dict[str, np.ndarray]:
    out = {leaf.path: np.zeros(leaf.shape, np.float32) for leaf in res.plan.leaves}
    reader = peer(router)
    stepped = {str(f.index): res.versions[f.index] + 1 for f in res.plan.fragments}
    # the steps run off the shard's serving loop: they may come after the acks
    wait_for(lambda: reader.status()["versions"] == stepped, "the steps", poll_s=0.25)
    for f in res.plan.fragments:
        reply, values = reader.snapshot(f.index, f.size)
        assert reply["version"] == res.versions[f.index] + 1  # one step per fragment
        res.plan.scatter(f.index, values, out)
    return out


def _run(relayed, client, cut_after: int | None):
    shard, relay, front, router = relayed()
    island = client(front, "a", **_SLOW_TO_GIVE_UP)
    res = island.join(_init())
    assert res.plan.num_fragments == FRAGMENTS
    joined = relay.carried()
    if cut_after is not None:
        relay.arm(cut_after)
    deltas = _push_round(island, res)
    wait_for(lambda: island.stats()["acked"] == FRAGMENTS, "every ack", timeout_s=60)
    return shard, router, relay, island, res, deltas, joined


@pytest.mark.parametrize("cut", [False, True], ids=["all_flows_live", "one_flow_cut_mid_push"])
def test_a_round_spreads_over_every_bulk_connection_and_is_applied_once(relayed, client, peer, cut):
    fragment_bytes = ROWS * COLS * 4 // FRAGMENTS
    cut_after = fragment_bytes // 2 if cut else None  # inside the first push of a flow
    shard, router, relay, island, res, deltas, joined = _run(relayed, client, cut_after)
    core = shard.server.core
    # the round went on several connections at once: every bulk connection (the
    # control one carries no push) passed at least one whole push to the shard
    pushed = [now - before for now, before in zip(relay.carried(), joined + [0] * 9, strict=False)]
    carriers = [n for n in pushed if n >= fragment_bytes]
    assert len(carriers) >= BULK_LINKS, pushed
    # each push acked once, applied once: one step per fragment, to the hand-computed values
    stats = island.stats()
    assert stats["acked"] == FRAGMENTS and stats["rejected"] == {}
    assert core.state.counters.accepted == FRAGMENTS
    assert stats["duplicates"] == 0
    if cut:
        assert relay.cuts() == 1
        assert stats["resent"] >= 1  # the piece cut short went again, on another connection
        assert stats["reconnects"] == 0  # the island never lost its shard
        assert len(relay.carried()) == 1 + BULK_LINKS + 1  # the dead one's replacement
    else:
        assert relay.cuts() == 0 and stats["resent"] == 0
    assert core.bindings.connections("a") >= 1 + BULK_LINKS
    got = _shard_values(res, router, peer)
    for path, want in _expected(res, deltas).items():
        np.testing.assert_array_equal(got[path], want)


def test_init_and_snapshot_pieces_spread_over_the_bulk_connections_and_survive_a_cut(
    relayed, client, peer
):
    shard, relay, front, router = relayed()
    fragment_bytes = ROWS * COLS * 4 // FRAGMENTS
    # the first island initialises the shard in pieces, one per fragment here; one of
    # its connections is cut in the middle of a piece, which goes again on another
    relay.arm(fragment_bytes // 2)
    first = client(front, "a", **_SLOW_TO_GIVE_UP)
    res = first.join(_init())
    assert relay.cuts() == 1
    uploaded = [n for n in relay.carried() if n >= fragment_bytes]
    assert len(uploaded) >= 2, relay.carried()  # the pieces went on several connections
    np.testing.assert_array_equal(res.params["w"], _init()["w"])
    got = {leaf.path: np.zeros(leaf.shape, np.float32) for leaf in res.plan.leaves}
    reader = peer(router)
    for f in res.plan.fragments:
        reply, values = reader.snapshot(f.index, f.size)
        assert reply["version"] == res.versions[f.index]
        res.plan.scatter(f.index, values, got)
    np.testing.assert_array_equal(got["w"], _init()["w"])
    # a second island reads the shard's snapshot in pieces over its bulk connections
    before = len(relay.brought())
    second = client(front, "b", **_SLOW_TO_GIVE_UP)
    joined = second.join(_init())
    np.testing.assert_array_equal(joined.params["w"], _init()["w"])
    read = [n for n in relay.brought()[before:] if n >= fragment_bytes]
    assert len(read) >= 2, relay.brought()
