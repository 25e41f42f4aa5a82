"""Memory one peer can hold in a live shard: unread replies are bounded in bytes, silent peers cut off.

- A client that asks snapshot pieces and never reads them (its DEALER keeps
  one message and a small socket buffer) holds at most
  `max_unread_reply_bytes` (+ one piece) of the shard's memory: further
  asks are answered `throttled`, while an honest island's pushes are acked.
  The shard's RSS is sampled with psutil throughout.
- A raw ZMTP peer that sends part of a multipart message and then nothing
  is disconnected after `peer_silence_s` (ZMTP heartbeats), and what it sent
  is freed.

The shard runs as a real subprocess.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import numpy as np
import psutil
import pytest
import zmq
from conftest import Peer, wait_for
from shard_helpers import delta_frames, init_payload, plan_for, push_header
from shard_process import ShardProcess

from paramserver.wire import protocol

pytestmark = pytest.mark.timeout(180)

MIB = 1 << 20


class RssSampler:
    """Samples a process's RSS every 20 ms in a thread; `peak` is the largest seen."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return self.peak


def test_a_reader_that_never_reads_holds_a_bounded_part_of_the_shard(tmp_path, zmq_ctx):
    elements = 8 * MIB // 4 * 4  # 8M float32: two fragments of 16 MiB
    flat = {"w": np.linspace(-1, 1, elements, dtype=np.float32)}
    shard = ShardProcess(
        tmp_path / "server", "--mode", "async", "--fsync", "false",
        "--checkpoint-every-steps", "0", "--checkpoint-every-s", "0",
    )  # fmt: skip
    honest = Peer(zmq_ctx, shard.router, "honest")
    greedy = zmq_ctx.socket(zmq.DEALER)
    greedy.setsockopt(zmq.LINGER, 0)
    greedy.setsockopt(zmq.RCVHWM, 1)
    greedy.setsockopt(zmq.RCVBUF, 64 * 1024)
    sampler = None
    try:
        shard.wait_ready(zmq_ctx)
        plan = plan_for(flat, 1, 2)
        honest.hello()
        reply, _ = honest.request(
            {"kind": "init", "island": "honest", "plan": plan.to_wire()}, init_payload(plan, flat)
        )
        assert reply["kind"] == "init_ok", reply
        del flat
        piece = plan.fragments[0].size * 4
        vec = np.full(plan.fragments[1].size, 1e-4, np.float32)
        # warm: the first push and step compile the shard's kernels (norms, the step), whose
        # code and compiler memory stay; the base is taken after them
        ack, _ = honest.request(push_header(plan, "honest", 1, 1), delta_frames(vec))
        assert ack["outcome"] == "accepted", ack
        wait_for(
            lambda: honest.status()["versions"]["1"] >= 1, "the warm-up push's step", timeout_s=60
        )
        greedy.connect(shard.router)
        base = psutil.Process(shard.proc.pid).memory_info().rss
        sampler = RssSampler(shard.proc.pid)
        latencies, asked = [], 0
        # 8 honest pushes, 5 greedy asks before each: 40 pieces (640 MiB) asked, 2.7 times
        # the bound below, so a shard that queued what it was asked would fail it
        for rnd in range(2, 10):
            for _ in range(5):
                greedy.send_multipart(
                    protocol.pack({"kind": "snapshot", "island": "greedy", "fragment": 0}, [])
                )
                asked += 1
            t0 = time.monotonic()
            ack, _ = honest.request(push_header(plan, "honest", rnd, 1), delta_frames(vec))
            latencies.append(time.monotonic() - t0)
            assert ack["outcome"] == "accepted", ack
            time.sleep(0.1)
        status = honest.status()
        peak = sampler.stop()
    finally:
        if sampler is not None:
            sampler.stop()
        greedy.close(0)
        honest.close()
        assert shard.stop() == 0, shard.output
    grown = peak - base
    throttled = status["rejected"].get("throttled", 0)
    print(
        f"\nasked {asked} pieces of {piece / MIB:.0f} MiB; RSS base {base / MIB:.0f} MiB, "
        f"peak +{grown / MIB:.0f} MiB; honest acks p50 {np.median(latencies) * 1e3:.1f} ms, "
        f"p99 {np.percentile(latencies, 99) * 1e3:.1f} ms (first {latencies[0] * 1e3:.0f} ms);"
        f" throttled {throttled}"
    )
    # the bound: 2 x max_message_bytes (128 MiB) unread, plus one piece, plus slack
    assert grown < 128 * MIB + piece + 96 * MIB, grown
    assert throttled > 0, status


def _zmtp_dealer(port: int) -> socket.socket:
    """A raw TCP peer that completes the ZMTP 3.0 NULL handshake as a DEALER."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00")
    s.sendall(greeting + b"\x00" + b"\x00" * 31)
    got = b""
    while len(got) < 64:
        chunk = s.recv(64 - len(got))
        assert chunk, "the shard closed the connection during the greeting"
        got += chunk
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    s.sendall(bytes([0x04, len(body)]) + body)
    return s


def test_a_peer_that_sends_half_a_message_and_falls_silent_is_cut_off(tmp_path, zmq_ctx):
    shard = ShardProcess(
        tmp_path / "server", "--mode", "async", "--fsync", "false",
        "--heartbeat-interval-s", "0.2", "--peer-silence-s", "1",
    )  # fmt: skip
    conns: list[socket.socket] = []
    try:
        shard.wait_ready(zmq_ctx)
        proc = psutil.Process(shard.proc.pid)
        base = proc.memory_info().rss
        for _ in range(4):  # each: 3 frames of 8 MiB with MORE set, the message never ends
            s = _zmtp_dealer(shard.port)
            for _ in range(3):
                s.sendall(bytes([0x03]) + struct.pack(">Q", 8 * MIB) + b"\x01" * (8 * MIB))
            conns.append(s)
        held = proc.memory_info().rss - base

        def closed(s: socket.socket) -> bool:
            s.settimeout(0.05)
            try:
                while s.recv(65536):  # the shard's PINGs, until the end of the stream
                    pass
            except TimeoutError:
                return False
            except ConnectionError:
                return True
            return True

        wait_for(lambda: all(closed(s) for s in conns), "the silent peers cut off", timeout_s=60)
        freed = wait_for(
            lambda: (r := proc.memory_info().rss) < base + held / 2 and r, "their frames freed",
            timeout_s=30,
        )  # fmt: skip
        print(
            f"\nheld +{held / MIB:.0f} MiB by 4 half-sent messages; after the cut {(freed - base) / MIB:+.0f} MiB"
        )
        # the shard still serves
        p = Peer(zmq_ctx, shard.router, "after")
        try:
            assert p.status()["accepted"] == 0
        finally:
            p.close()
    finally:
        for s in conns:
            s.close()
        assert shard.stop() == 0, shard.output
