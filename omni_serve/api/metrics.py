"""`/metrics`: Prometheus text, in a registry of the server's own (vLLM's engines keep theirs)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "omni_serve"


class SpeechMetrics:
    def __init__(self, stages: list[str]) -> None:
        self.registry = CollectorRegistry()
        self.ttfa = Histogram(f"{PREFIX}_time_to_first_audio_seconds", "From the request's arrival to its first audio",
                              registry=self.registry,
                              buckets=(0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.rtf = Histogram(f"{PREFIX}_real_time_factor", "Seconds to make a request's audio per second of audio",
                             registry=self.registry, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 50))
        self.first_audio_share = Histogram(
            f"{PREFIX}_stage_first_audio_seconds",
            "A stage's share of a request's first audio: the thinker's whole request, the talker's start to "
            "its first chunk of frames, code2wav's first chunk to its waveform", ["stage"],
            registry=self.registry, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.audio_seconds = Counter(f"{PREFIX}_audio_seconds", "Seconds of audio served", registry=self.registry)
        self.requests = Counter(f"{PREFIX}_requests", "Speech requests by outcome", ["outcome"],
                                registry=self.registry)
        self.queue = Gauge(f"{PREFIX}_stage_requests", "Requests in a stage's engine now (code2wav: one per chunk)", ["stage"],
                           registry=self.registry)
        self.sidecar_restarts = Gauge(f"{PREFIX}_sidecar_restarts", "Times a stage's sidecar was started again",
                                      ["stage"], registry=self.registry)
        self.engine_restarts = Gauge(f"{PREFIX}_engine_restarts", "Times a stage's engine was started again after it died",
                                     ["stage"], registry=self.registry)
        for stage in stages:
            self.queue.labels(stage).set(0)
            self.sidecar_restarts.labels(stage).set(0)
            self.engine_restarts.labels(stage).set(0)

    def text(self) -> bytes:
        return generate_latest(self.registry)
