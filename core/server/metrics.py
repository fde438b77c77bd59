"""ServerMetrics: what /metrics exposes, in the Prometheus text format (prometheus_client).

Gauges are read from the engine at scrape time (running and waiting requests, KV slots used and
total, their ratio, the prefix cache's size and hit rate); counters and histograms are fed by the routes as each request's chunks
arrive (prompt and generated tokens, finished requests by reason, rejected requests by status,
time to first token, inter-token latency, end-to-end latency). Every metric is registered in
the app's own registry, so several apps in one process do not collide. No `_created` series are
exported (prometheus_client's `disable_created_metrics`, process-wide).
"""

from __future__ import annotations

from typing import Any

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, engine: Any):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

        disable_created_metrics()  # no `_created` series: scrapers read the process start from elsewhere
        self.registry = r = CollectorRegistry()
        gauges = {
            "num_requests_running": ("requests with a request row (prefilling or decoding)", lambda: engine.num_running),
            "num_requests_waiting": ("requests queued for a request row", lambda: engine.num_waiting),
            "kv_cache_used_tokens": ("KV slots in use", lambda: engine.kv_usage[0]),
            "kv_cache_total_tokens": ("KV slots in the pool", lambda: engine.kv_usage[1]),
            "kv_cache_usage_ratio": ("fraction of the KV pool in use", lambda: engine.kv_usage[0] / engine.kv_usage[1]),
            "prefix_cache_tokens": ("KV slots the prefix cache holds (shared or evictable)",
                                    lambda: engine.prefix_cache_stats["cached_tokens"]),
            "prefix_cache_hit_rate": ("prompt tokens found in the prefix cache / prompt tokens looked up",
                                      lambda: engine.prefix_cache_stats["hit_rate"]),
        }
        for name, (doc, read) in gauges.items():
            Gauge(f"backplane_{name}", doc, registry=r).set_function(read)
        self.prompt_tokens = Counter("backplane_prompt_tokens", "prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("backplane_generation_tokens", "tokens generated", registry=r)
        self.finished = Counter("backplane_requests_finished", "finished requests", ["finish_reason"], registry=r)
        self.rejected = Counter("backplane_requests_rejected", "refused requests", ["status"], registry=r)
        hist = {"buckets": LATENCY_BUCKETS, "registry": r}
        self.ttft = Histogram("backplane_time_to_first_token_seconds", "arrival to first token", **hist)
        self.itl = Histogram("backplane_inter_token_latency_seconds", "time between tokens", **hist)
        self.e2e = Histogram("backplane_e2e_request_latency_seconds", "arrival to last token", **hist)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def timer(self, stream: Any) -> RequestTimer:
        self.prompt_tokens.inc(stream.num_prompt_tokens)
        return RequestTimer(self, stream.created_at)


class RequestTimer:
    """Observes one request's chunks: TTFT at the first token, the gap before each later one, E2E at the end."""

    def __init__(self, metrics: ServerMetrics, created_at: float):
        self.metrics, self.created_at = metrics, created_at
        self.last: float | None = None  # when the previous token came
        self.done = False

    def on_chunk(self, chunk: Any) -> None:
        m = self.metrics
        if chunk.token_ids:
            m.generation_tokens.inc(len(chunk.token_ids))
        for t in chunk.token_times:
            if self.last is None:
                m.ttft.observe(t - self.created_at)
            else:
                m.itl.observe(t - self.last)  # 0 between the tokens of one speculative step
            self.last = t
        if chunk.finish_reason is not None and not self.done:
            self.done = True
            m.finished.labels(chunk.finish_reason).inc()
            m.e2e.observe(chunk.time - self.created_at)

    def on_abandoned(self) -> None:
        """The client left before the end: the request counts as aborted (once)."""
        if not self.done:
            self.done = True
            self.metrics.finished.labels("abort").inc()
