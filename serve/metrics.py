"""`moepack serve`'s /metrics: Prometheus' text format (prometheus-client), one registry per app.

    moepack_requests_total{endpoint, status}       requests answered, by route and HTTP status
    moepack_errors_total{endpoint, status}         of them, the 4xx and 5xx
    moepack_prompt_tokens_total                     prompt tokens of the generations run
    moepack_generated_tokens_total                  tokens generated
    moepack_expert_cache_hits_total / _misses_total the decoder's expert cache, since the server started
    moepack_requests_in_flight                      admitted (reading, being prepared, waiting or running), and
                                                    runs still stopping after their client left
    moepack_time_to_first_token_seconds             histogram: from a request's arrival to its first token
    moepack_time_per_output_token_seconds           histogram: between consecutive tokens of a generation
    moepack_decode_batch_size                       histogram: sequences per decode step (serve --max-batch > 1)
    moepack_sequences_decoding                      sequences decoding now (serve --max-batch > 1)
    moepack_prompt_cache_hits_total                 prompts that continued a prompt cache entry (--prompt-cache-gib)
    moepack_prompt_cache_tokens_total               prompt tokens those hits did not prefill
    moepack_prompt_cache_bytes                      what the prompt cache holds now
    moepack_shared_prefill_tokens_total             prompt tokens a sequence took from another's prefill of the same
                                                    prompt (n choices, identical requests at once; --max-batch > 1)
"""

from __future__ import annotations

from collections.abc import Callable

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    def __init__(self, cache_counts: Callable[[], tuple[int, int] | None], in_flight: Callable[[], int],
                 decoding: Callable[[], int | None] = lambda: None, prompt_cache: Callable[[], object] = lambda: None,
                 shared_tokens: Callable[[], int | None] = lambda: None):
        """`decoding()`: the sequences decoding now, None where nothing batches them (no gauge then); so too
        `shared_tokens()`, the prompt tokens taken from another sequence's prefill.
        `prompt_cache()`: the batch scheduler's PromptCache, None where there is none (no prompt cache metrics)."""
        from prometheus_client import CollectorRegistry, Counter, Histogram
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self.registry = registry = CollectorRegistry()
        self.requests = Counter("moepack_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=registry)
        self.errors = Counter("moepack_errors", "Requests answered with a 4xx or 5xx", ["endpoint", "status"],
                              registry=registry)
        self.prompt_tokens = Counter("moepack_prompt_tokens", "Prompt tokens of the generations run",
                                     registry=registry)
        self.generated_tokens = Counter("moepack_generated_tokens", "Tokens generated", registry=registry)
        self.ttft = Histogram("moepack_time_to_first_token_seconds", "From a request's arrival to its first token",
                              buckets=TTFT_BUCKETS, registry=registry)
        self.tpot = Histogram("moepack_time_per_output_token_seconds", "Between consecutive generated tokens",
                              buckets=TPOT_BUCKETS, registry=registry)
        self.batch_size = Histogram("moepack_decode_batch_size", "Sequences per decode step",
                                    buckets=BATCH_BUCKETS, registry=registry)

        class Live:  # read at each scrape: the cache's own counters and the admission count
            def collect(self):
                counts = cache_counts()
                if counts is not None:
                    yield CounterMetricFamily("moepack_expert_cache_hits", "Expert cache hits", value=counts[0])
                    yield CounterMetricFamily("moepack_expert_cache_misses", "Expert cache misses",
                                              value=counts[1])
                yield GaugeMetricFamily("moepack_requests_in_flight", "Requests admitted (reading, being prepared, "
                                        "waiting or running), and runs still stopping after their client left",
                                        value=in_flight())
                now = decoding()
                if now is not None:
                    yield GaugeMetricFamily("moepack_sequences_decoding", "Sequences decoding together now",
                                            value=now)
                shared = shared_tokens()
                if shared is not None:
                    yield CounterMetricFamily("moepack_shared_prefill_tokens", "Prompt tokens taken from another "
                                              "sequence's prefill of the same prompt", value=shared)
                cache = prompt_cache()
                if cache is not None:
                    yield CounterMetricFamily("moepack_prompt_cache_hits", "Prompts that continued a prompt cache "
                                              "entry", value=cache.hits)
                    yield CounterMetricFamily("moepack_prompt_cache_tokens", "Prompt tokens taken from the prompt "
                                              "cache (not prefilled)", value=cache.tokens_reused)
                    yield GaugeMetricFamily("moepack_prompt_cache_bytes", "Bytes the prompt cache holds",
                                            value=cache.nbytes)

        registry.register(Live())

    def answered(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        if status >= 400:
            self.errors.labels(endpoint, str(status)).inc()

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def cache_counts_of(generator) -> Callable[[], tuple[int, int] | None]:
    """The generator's expert-cache (hits, misses), None where it has no such cache (a stand-in generator)."""
    def counts():
        cache = getattr(getattr(generator, "decoder", None), "cache", None)
        hits, misses = getattr(cache, "hits", None), getattr(cache, "misses", None)
        return (hits, misses) if isinstance(hits, int) and isinstance(misses, int) else None
    return counts
