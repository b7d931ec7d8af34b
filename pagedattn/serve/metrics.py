"""Prometheus metrics of the server (``GET /metrics``), in a registry of its own so two
servers in one process (tests) do not collide."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets from 1 ms to ~1 min: TTFT spans a decode step to a long queued prefill.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
            0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class ServeMetrics:
    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        r, label = self.registry, {"model_name": model}

        def hist(name, doc):
            return Histogram(name, doc, ["model_name"], registry=r, buckets=_BUCKETS).labels(**label)

        def gauge(name, doc):
            return Gauge(name, doc, ["model_name"], registry=r).labels(**label)

        self.ttft = hist("pagedattn_time_to_first_token_seconds", "Arrival to first token")
        self.itl = hist("pagedattn_inter_token_latency_seconds", "Time between two tokens of a request")
        self.e2e = hist("pagedattn_e2e_request_latency_seconds", "Arrival to the end of a request")
        self.running = gauge("pagedattn_num_requests_running", "Requests in the running batch")
        self.waiting = gauge("pagedattn_num_requests_waiting", "Requests queued in the engine")
        self.kv_used = gauge("pagedattn_kv_cache_blocks_used", "KV blocks held by requests")
        self.kv_total = gauge("pagedattn_kv_cache_blocks_total", "KV blocks in the pool")
        self.hit_rate = gauge("pagedattn_prefix_cache_hit_rate",
                              "Prefix-cache block hits / block queries since start")
        self.preemptions = Counter("pagedattn_num_preemptions", "Requests preempted",
                                   ["model_name"], registry=r).labels(**label)
        self.step_threads = gauge("pagedattn_step_threads",
                                  "Threads of the latest engine step (fewer than torch's "
                                  "while other processes keep the cores busy)")
        self.steps_on_fewer_threads = Counter(
            "pagedattn_steps_on_fewer_threads", "Engine steps run on fewer threads than "
            "torch's count because other processes kept cores busy", ["model_name"],
            registry=r).labels(**label)
        self._requests = Counter("pagedattn_request", "Finished requests by finish reason",
                                 ["model_name", "finish_reason"], registry=r)
        self._model = model
        self._seen_preemptions = 0
        self._seen_fewer = 0

    def finished(self, reason: str, e2e: float) -> None:
        self._requests.labels(model_name=self._model, finish_reason=reason).inc()
        self.e2e.observe(e2e)

    def refresh(self, load) -> None:
        """Set the gauges from ``load`` (``LLMEngine.load()``, taken by the engine thread
        after a step or after it added or aborted requests)."""
        self.running.set(load.num_running)
        self.waiting.set(load.num_waiting)
        self.kv_used.set(load.kv_blocks_used)
        self.kv_total.set(load.kv_blocks_total)
        queries = load.prefix_cache_queries
        self.hit_rate.set(load.prefix_cache_hits / queries if queries else 0.0)
        if load.num_preemptions > self._seen_preemptions:
            self.preemptions.inc(load.num_preemptions - self._seen_preemptions)
            self._seen_preemptions = load.num_preemptions
        self.step_threads.set(load.step_threads)
        if load.steps_on_fewer_threads > self._seen_fewer:
            self.steps_on_fewer_threads.inc(load.steps_on_fewer_threads - self._seen_fewer)
            self._seen_fewer = load.steps_on_fewer_threads

    def render(self) -> bytes:
        return generate_latest(self.registry)
