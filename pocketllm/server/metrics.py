"""Prometheus metrics (``pocketllm:`` prefix): engine load read at scrape time, request histograms."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pocketllm.outputs import RequestOutput

ABORT_REASONS = ("client_disconnect", "cancel", "deadline", "shutdown")
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0, 640.0)


class _EngineCollector:
    """Reads the engine's gauges and cumulative counters when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], dict | None]) -> None:
        self.stats = stats

    def collect(self):
        stats = self.stats()
        if stats is None:
            return
        gauges = {
            "num_requests_running": "Requests in the running batch.",
            "num_requests_waiting": "Requests queued for admission.",
            "kv_cache_usage_perc": "Fraction of KV-cache blocks in use (0..1).",
            "kv_cache_free_blocks": "KV-cache blocks free for allocation.",
        }
        values = {**stats, "kv_cache_usage_perc": stats["kv_cache_usage"]}
        for name, doc in gauges.items():
            family = GaugeMetricFamily(f"pocketllm:{name}", doc)
            family.add_metric([], float(values[name]))
            yield family
        counters = {
            "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
            "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
            "num_preemptions": "Requests preempted (recomputed) for lack of KV blocks.",
        }
        for name, doc in counters.items():
            family = CounterMetricFamily(f"pocketllm:{name}", doc)
            family.add_metric([], float(stats[name]))
            yield family


class ServerMetrics:
    """One registry per server; ``observe`` records a finished engine request."""

    def __init__(self, stats: Callable[[], dict | None]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats))
        r = self.registry
        self.prompt_tokens = Counter("pocketllm:prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("pocketllm:generation_tokens", "Tokens generated.", registry=r)
        self.finished = Counter("pocketllm:request_success", "Finished requests by finish reason.",
                                ["finished_reason"], registry=r)
        self.aborted = Counter("pocketllm:request_aborted", "Requests ended early, by reason: the client went "
                               "away, a DELETE, the request deadline, the shutdown timeout.", ["reason"],
                               registry=r)
        for reason in ABORT_REASONS:
            self.aborted.labels(reason=reason)
        self.ttft = Histogram("pocketllm:time_to_first_token_seconds", "Arrival to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pocketllm:inter_token_latency_seconds", "Time between consecutive tokens.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pocketllm:e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("pocketllm:request_queue_time_seconds", "Arrival to first scheduling.",
                               buckets=LATENCY_BUCKETS, registry=r)

    def observe(self, output: RequestOutput, e2e_seconds: float) -> None:
        usage = output.usage
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generation_tokens.inc(usage.completion_tokens)
        self.finished.labels(finished_reason=output.finish_reason).inc()
        self.queue.observe(usage.queue_time_s)
        if usage.completion_tokens:
            self.ttft.observe(usage.queue_time_s + usage.prefill_time_s)
        for gap in output.metadata.get("inter_token_latencies", ()):
            self.itl.observe(gap)
        self.e2e.observe(e2e_seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
