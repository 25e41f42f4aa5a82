"""Optional Prometheus endpoint exposing the shards' status counters (and the cluster page).

This module owns the translation of shard status maps into Prometheus
metrics. Each scrape asks every shard for its status over the wire
(`paramserver.plumbing.probe`), so the shard loop is never touched from the HTTP
thread. Under CURVE the scrape speaks CURVE with the server's own key pair,
which every shard of the cluster admits (acting as no island), so `up` means
the shard answered, with or without CURVE. Needs the `metrics` extra
(prometheus-client). The same port serves the cluster page
(`paramserver.ops.page_server`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import zmq

from paramserver.plumbing.curve import ClientKeys, CurveError, load_keypair
from paramserver.plumbing.probe import ProbeError, shard_status

logger = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0

_COUNTERS = {
    "accepted": "deltas accepted",
    "duplicates": "duplicate deltas (acked, not applied again)",
    "hello_requests": "requests from islands not known here (answered: say hello)",
    "steps": "outer steps taken",
    "bytes_in": "bytes received on the ROUTER",
    "bytes_out": "bytes sent (replies and published updates)",
}


class MetricsError(RuntimeError):
    """The metrics endpoint cannot start (missing package, port in use)."""


class ShardCollector:
    """A prometheus collector that queries each shard's status at scrape time."""

    def __init__(
        self,
        endpoints: Sequence[str],
        timeout_s: float = SCRAPE_TIMEOUT_S,
        curve: ClientKeys | None = None,
    ) -> None:
        """Remember whom to ask.

        Args:
            endpoints: ROUTER endpoint of each shard, in shard order.
            timeout_s: per-shard reply timeout of one scrape.
            curve: client keys for CURVE shards (None: plain).
        """
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self.curve = curve
        # one context for every scrape (each probe closes its own sockets): tearing a
        # context down per scrape, right after a monitored handshake failed, could hang
        self._ctx = zmq.Context()

    def describe(self) -> list[Any]:
        """Nothing up front, so registering does not query the shards."""
        return []

    def collect(self) -> Iterator[Any]:
        """Yield the metric families of one scrape (called by prometheus_client)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        up = GaugeMetricFamily("diloco_shard_up", "1 if the shard answered", labels=["shard"])
        counters = {
            name: CounterMetricFamily(f"diloco_shard_{name}", text, labels=["shard"])
            for name, text in _COUNTERS.items()
        }
        rejected = CounterMetricFamily(
            "diloco_shard_rejected", "requests rejected", labels=["shard", "reason"]
        )
        staleness = CounterMetricFamily(
            "diloco_shard_staleness", "merged deltas by staleness", labels=["shard", "staleness"]
        )
        version = GaugeMetricFamily(
            "diloco_fragment_version", "fragment version", labels=["shard", "fragment"]
        )
        live = GaugeMetricFamily("diloco_shard_islands_live", "live islands", labels=["shard"])
        pending = GaugeMetricFamily(
            "diloco_shard_pending_bytes",
            "bytes the pending deltas keep (coded), against max_pending_bytes",
            labels=["shard"],
        )
        ctx = self._ctx
        for index, endpoint in enumerate(self.endpoints):
            label = str(index)
            try:
                status = shard_status(ctx, endpoint, self.timeout_s, self.curve)
            except ProbeError as exc:
                logger.warning("metrics: shard %d: %s", index, exc)
                up.add_metric([label], 0)
                continue
            up.add_metric([label], 1)
            for name, family in counters.items():
                family.add_metric([label], float(status.get(name, 0)))
            for reason, count in status.get("rejected", {}).items():
                rejected.add_metric([label, str(reason)], float(count))
            for stale, count in status.get("staleness_histogram", {}).items():
                staleness.add_metric([label, str(stale)], float(count))
            for fragment, v in status.get("versions", {}).items():
                version.add_metric([label, str(fragment)], float(v))
            live.add_metric([label], float(len(status.get("islands_live", []))))
            pending.add_metric([label], float(status.get("pending_bytes", 0)))
        yield up
        yield from counters.values()
        yield from (rejected, staleness, version, live, pending)


def server_keys(curve_secret_key_file: str) -> ClientKeys | None:
    """The client keys a scrape uses: the server's own pair, with itself as the server key.

    Args:
        curve_secret_key_file: the shards' NAME.key_secret ("": no CURVE).

    Returns:
        The keys, or None without CURVE.

    Raises:
        MetricsError: the key file cannot be read.
    """
    if not curve_secret_key_file:
        return None
    try:
        public, secret = load_keypair(curve_secret_key_file)
    except CurveError as exc:
        raise MetricsError(str(exc)) from None
    return ClientKeys(public, secret, public)


def serve_metrics(
    port: int,
    endpoints: Sequence[str],
    host: str = "127.0.0.1",
    curve_secret_key_file: str = "",
    token: str = "",
    data_dir: str = "",
) -> Any:
    """Start the HTTP endpoint (metrics and the cluster page) in background threads.

    Args:
        port: TCP port for /metrics, / (the cluster page) and /api/cluster
            (`paramserver.ops.page_server`).
        endpoints: ROUTER endpoint of each shard.
        host: bind address (ShardConfig.metrics_bind_host: metrics_host, else host).
        curve_secret_key_file: the shards' key pair (ShardConfig.curve_secret_key_file;
            "": the shards run without CURVE).
        token: off loopback, what every request must carry (ShardConfig.metrics_token;
            "": the data dir's, made at the first start; `page_server.page_token`).
        data_dir: where that token file is kept.

    Returns:
        The HTTP server (call ``shutdown()`` to stop it and its sampler).

    Raises:
        MetricsError: prometheus-client is missing, the key file is unusable, or
            the port cannot be bound.
    """
    try:
        from prometheus_client import CollectorRegistry
        from prometheus_client.exposition import choose_encoder
    except ImportError:
        raise MetricsError(
            "metrics_port is set but prometheus-client is not installed: "
            "pip install 'decoupled-diloco[metrics]' or set metrics_port = 0"
        ) from None
    from paramserver.ops.page_server import TOKEN_FILE, ClusterSampler, PageServer, page_token

    keys = server_keys(curve_secret_key_file)
    registry = CollectorRegistry()
    registry.register(ShardCollector(endpoints, curve=keys))

    def metrics_text(accept: str) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept)
        return encoder(registry), content_type

    try:
        secret = page_token(host, token, data_dir)
    except OSError as exc:
        raise MetricsError(f"the cluster page's token cannot be made: {exc}") from None
    sampler = ClusterSampler(endpoints, curve=keys)
    try:
        server = PageServer((host, port), sampler, metrics_text, secret)
    except OSError as exc:
        raise MetricsError(f"metrics port {port} cannot be bound: {exc.strerror}") from None
    sampler.start()
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    logger.info(
        "metrics on http://%s:%d/metrics, cluster page on http://%s:%d/", host, port, host, port
    )
    if secret is not None:  # off loopback: plain HTTP behind a token (README, Security)
        where = (
            "the metrics_token setting"
            if token
            else f"{data_dir}/{TOKEN_FILE}"
            if data_dir
            else f"this line: {secret}"
        )
        logger.warning(
            "the metrics endpoint and cluster page on %s:%d are plain HTTP off loopback: they "
            "ask for the token in %s (open http://%s:%d/?token=TOKEN; scrapers send "
            "'Authorization: Bearer TOKEN'); the token crosses the network in the clear, so "
            "reach it over a trusted network or a tunnel",
            host,
            port,
            where,
            host,
            port,
        )
    return server
