"""The shard daemon's I/O loop: sockets, polling, replies and publishing (skeleton).

This module owns the ZeroMQ side of one shard: a ROUTER for requests and a PUB
for sequenced updates and heartbeats. Decisions and state live in
`paramserver.state`; the wire format in `paramserver.protocol`.
"""

from __future__ import annotations

import logging
import threading

import zmq

from paramserver import protocol
from paramserver.config import ShardConfig, bind_endpoints, local_endpoints

logger = logging.getLogger(__name__)


class ShardServer:
    """One shard: bind, serve until a stop event, drain, close."""

    def __init__(
        self,
        cfg: ShardConfig,
        index: int,
        endpoints: list[tuple[str, str]] | None = None,
        router_bind: str | None = None,
        pub_bind: str | None = None,
    ) -> None:
        """Create the shard (binds nothing yet).

        Args:
            cfg: cluster settings.
            index: this shard's index in [0, cfg.shards).
            endpoints: connect addresses [(router, pub), ...] of every shard,
                sent to islands in `welcome`; default local_endpoints(cfg).
            router_bind: ROUTER bind address; default from cfg (port + 2 * index).
            pub_bind: PUB bind address; default from cfg (port + 2 * index + 1).
        """
        default_router, default_pub = bind_endpoints(cfg, index)
        self.cfg = cfg
        self.index = index
        self.endpoints = endpoints if endpoints is not None else local_endpoints(cfg)
        self.router_bind = router_bind or default_router
        self.pub_bind = pub_bind or default_pub
        self.ready = threading.Event()
        self.bound_endpoints: tuple[str, str] | None = None

    def serve(self, stop: threading.Event) -> None:
        """Run the loop until `stop` is set, then drain and close.

        Args:
            stop: set it (from any thread or a signal handler) to stop.
        """
        ctx = zmq.Context.instance()
        router = ctx.socket(zmq.ROUTER)
        pub = ctx.socket(zmq.PUB)
        try:
            for sock in (router, pub):
                sock.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_frame_bytes)
            router.bind(self.router_bind)
            pub.bind(self.pub_bind)
            self.bound_endpoints = (
                router.getsockopt_string(zmq.LAST_ENDPOINT),
                pub.getsockopt_string(zmq.LAST_ENDPOINT),
            )
            self.ready.set()
            while not stop.is_set():
                if router.poll(100):
                    frames = router.recv_multipart(copy=False)
                    ident, body = frames[0], frames[1:]
                    try:
                        header, _ = protocol.unpack(body)
                        reply = protocol.reply_header(
                            header, "rejected", reason="not_initialized", detail="skeleton"
                        )
                    except protocol.ProtocolError as exc:
                        reply = protocol.reply_header(
                            exc.header, "rejected", reason=exc.reason, detail=exc.detail
                        )
                    router.send_multipart([ident, *protocol.pack(reply)])
        finally:
            router.close(0)
            pub.close(0)


def run_shard(
    cfg: ShardConfig,
    index: int,
    endpoints: list[tuple[str, str]] | None,
    stop_event: threading.Event,
) -> int:
    """Daemon entry: serve one shard until `stop_event`, drain, checkpoint.

    Args:
        cfg: cluster settings.
        index: shard index.
        endpoints: connect addresses of every shard (None: local_endpoints(cfg)).
        stop_event: set by the caller's signal handler.

    Returns:
        Process exit code: 0 after a clean drain.
    """
    server = ShardServer(cfg, index, endpoints)
    server.serve(stop_event)
    return 0
