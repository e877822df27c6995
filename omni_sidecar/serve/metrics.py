"""Prometheus metrics of the sidecar, including what the shim reports on each StepEnd."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (
    10e-6, 25e-6, 50e-6, 75e-6, 100e-6, 150e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 50e-3, 0.25, 1.0,
)


class SidecarMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.step_hook_seconds = Histogram(
            "omni_sidecar_step_hook_seconds", "Sidecar time spent on one step's hooks",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.shim_exchange_seconds = Histogram(
            "omni_sidecar_shim_exchange_seconds",
            "Blocking StepBegin->StepPlan round trip as the shim measured it",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.shim_post_seconds = Histogram(
            "omni_sidecar_shim_post_seconds", "Shim-side cost of sending a StepEnd (copy + send)",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.steps = Counter("omni_sidecar_steps", "Steps with a forward", registry=r)
        self.tokens = Counter("omni_sidecar_scheduled_tokens", "Tokens scheduled in those steps", registry=r)
        self.requests = Counter("omni_sidecar_requests", "Request events", ["event"], registry=r)
        self.request_errors = Counter("omni_sidecar_request_errors", "Requests failed by hooks", registry=r)
        self.rejected_frames = Counter("omni_sidecar_rejected_frames", "Frames rejected", ["code"], registry=r)
        self.sessions = Gauge("omni_sidecar_sessions", "Connected shim sessions", registry=r)
        self.arena_bytes = Gauge("omni_sidecar_arena_bytes", "Size of mapped arenas", ["direction"], registry=r)
        self.arena_used_bytes = Gauge(
            "omni_sidecar_arena_used_bytes", "Bytes used in the last step", ["direction"], registry=r)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
