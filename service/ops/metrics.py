"""Prometheus metrics of one app: the registry, the live-state collector and ``GET /metrics``.

``/metrics`` is the Prometheus text format, not in the OpenAPI schema, and open without an API
key (it shows counts, latencies and the model's identity, never request content — keep it on
an internal network). Request counts and latencies are recorded by
:class:`attnscope.service.ops.middlewares.RequestContextMiddleware`; the device-slot histograms
by the engine.
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _StateCollector:
    """Reads live state at scrape time: queue depth, cache, forward count, model info."""

    def __init__(self, app: FastAPI):
        self.app = app

    def describe(self):
        return []

    def collect(self):
        st = self.app.state
        slot = getattr(st, "slot", None)
        rt = getattr(st, "runtime", None)
        g = GaugeMetricFamily(
            "attnscope_queue_depth", "Requests waiting for or holding the device slot."
        )
        g.add_metric([], slot.depth if slot is not None else 0)
        yield g
        g = GaugeMetricFamily("attnscope_ready", "1 once the model is loaded and probed, else 0.")
        g.add_metric([], 1 if rt is not None else 0)
        yield g
        g = GaugeMetricFamily(
            "attnscope_abandoned_requests",
            "Requests answered 504 whose forward pass is still finishing in the background.",
        )
        g.add_metric([], len(getattr(st, "abandoned", ())))
        yield g
        if rt is None:
            return
        cache = rt.cache
        for name, doc, val in (
            ("attnscope_cache_hits", "Forward-cache lookups that found the text's forward.", cache.hits),
            ("attnscope_cache_misses", "Forward-cache lookups that needed a forward pass.", cache.misses),
            ("attnscope_forwards", "Recorded forward passes run on the device.", rt.forward_count),
        ):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], val)
            yield c
        g = GaugeMetricFamily("attnscope_cache_bytes", "Bytes of tensors held by the forward cache.")
        g.add_metric([], cache.nbytes)
        yield g
        g = GaugeMetricFamily("attnscope_cache_entries", "Forward results held by the cache.")
        g.add_metric([], len(cache))
        yield g
        info = InfoMetricFamily("attnscope_model", "The resident model (chosen at start-up).")
        keys = ("id", "revision", "architecture", "family", "n_layers", "n_heads", "d_model",
                "n_ctx", "device", "dtype", "fallback")
        info.add_metric([], {k: str(rt.info.get(k)) for k in keys})
        yield info


class Metrics:
    """The Prometheus registry of one app (a registry per app, so tests can build many)."""

    def __init__(self, app: FastAPI):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "attnscope_requests", "HTTP requests answered, by method, route template and status.",
            ["method", "route", "status"], registry=r,
        )
        self.latency = Histogram(
            "attnscope_request_duration_seconds",
            "Time from request start to the end of the response, by method and route template.",
            ["method", "route"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self.in_flight = Gauge(
            "attnscope_requests_in_flight", "HTTP requests being served.", registry=r
        )
        self.device_seconds = Histogram(
            "attnscope_forward_seconds",
            "Time one request held the device slot for its forward passes (a request whose "
            "forwards are all cached does not wait for the slot and is not counted).",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.queue_seconds = Histogram(
            "attnscope_queue_wait_seconds", "Time a request waited for the device slot before "
            "its forward passes.",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        r.register(_StateCollector(app))
        ProcessCollector(registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


metrics_router = APIRouter()


@metrics_router.get("/metrics", include_in_schema=False)
async def metrics_endpoint(request: Request) -> Response:
    """Prometheus text exposition of this replica's metrics."""
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
