"""Prometheus metrics, named as vLLM names them where vLLM has the metric (dashboards carry over).

One CollectorRegistry per app (tests run several apps in one process). Engine-side counters arrive
cumulative in EngineStats; `observe_engine_stats` turns them into counter increments.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import numpy as np

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from mtpserve.ipc.frame_assembler import ReaderStats
from mtpserve.ipc.request_channel import EngineStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self._model = model_name
        self._init_requests()
        self._init_engine()
        self._init_output_path()
        self._last_stats: EngineStats | None = None
        self._last_reader = ReaderStats()

    def _labels(self) -> list[str]:
        return ["model_name"]

    def _counter(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
        return Counter(name, doc, [*self._labels(), *extra], registry=self.registry)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, self._labels(), registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, self._labels(), buckets=buckets, registry=self.registry)

    def _init_requests(self) -> None:
        m = self._model
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Prefill tokens processed.").labels(m)
        self.generation_tokens = self._counter("vllm:generation_tokens", "Generated tokens.").labels(m)
        self.request_success = self._counter("vllm:request_success", "Finished requests.", ("finished_reason",))
        self.ttft = self._histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                                    _LATENCY_BUCKETS).labels(m)
        self.itl = self._histogram("vllm:inter_token_latency_seconds",
                                   "Time between engine outputs of a request (one per step).", _ITL_BUCKETS).labels(m)
        self.tpot = self._histogram("vllm:request_time_per_output_token_seconds",
                                    "Per request: decode time / (output tokens - 1).", _ITL_BUCKETS).labels(m)
        self.e2e = self._histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.",
                                   _LATENCY_BUCKETS).labels(m)
        self.rejected = self._counter("mtpserve:http_requests_rejected", "Requests refused before the engine.",
                                      ("status",))

    def _init_engine(self) -> None:
        m = self._model
        self.running = self._gauge("vllm:num_requests_running", "Requests in the running batch.").labels(m)
        self.waiting = self._gauge("vllm:num_requests_waiting", "Requests waiting for admission.").labels(m)
        # NOTE: "in use" means held by requests; cached blocks no request holds are free (evicted on demand).
        self.kv_usage = self._gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks held by requests "
                                    "(0..1); evictable prefix-cache blocks count as free.").labels(m)
        self.kv_blocks_used = self._gauge("mtpserve:kv_blocks_used", "KV blocks held by requests.").labels(m)
        self.num_drafts = self._counter("vllm:spec_decode_num_drafts", "Draft rounds.").labels(m)
        self.num_draft_tokens = self._counter("vllm:spec_decode_num_draft_tokens", "Draft tokens.").labels(m)
        self.num_accepted = self._counter("vllm:spec_decode_num_accepted_tokens", "Accepted drafts.").labels(m)
        self.accepted_per_pos = self._counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                              "Accepted drafts by draft position.", ("position",))
        self._init_speculation()
        self.http_active = self._gauge("mtpserve:http_requests_active", "Engine requests in flight.").labels(m)
        self.engine_counters = {
            "num_preemptions": self._counter("vllm:num_preemptions", "Running requests preempted to free KV "
                                             "blocks (they recompute).").labels(m),
            "num_discarded_rows": self._counter("mtpserve:discarded_rows", "Rows computed for requests that "
                                                "finished, aborted or were preempted after launch.").labels(m),
        }
        self._init_pd()
        self._init_prefix_cache()

    def _init_speculation(self) -> None:
        """The adaptive policy (docs/speculation.md): what it chose, how drafts fare, how well it predicts."""
        m = self._model
        self.acceptance_rate = Gauge("mtpserve:spec_decode_acceptance_rate", "Accepted / drafted, by draft "
                                     "position (since start).", [*self._labels(), "position"],
                                     registry=self.registry)
        self.spec_seconds = {
            "spec_predicted_seconds": self._counter("mtpserve:spec_step_predicted_seconds", "Step time the "
                                                    "policy's cost model predicted.").labels(m),
            "spec_measured_seconds": self._counter("mtpserve:spec_step_measured_seconds", "Measured period "
                                                   "of the same steps.").labels(m),
        }
        self.registry.register(_ChosenDrafts(self))

    def _init_output_path(self) -> None:
        """The HTTP process's reader of the output path (ipc/output_reader.py): what it refused or missed."""
        m = self._model
        self.frames_rejected = self._counter("mtpserve:output_frames_rejected",
                                             "Output messages refused as malformed, by reason.", ("reason",))
        self.frames_lost = self._counter("mtpserve:output_frames_lost",
                                         "Gaps in the output channel's frame sequence.").labels(m)
        self.seq_errors = self._counter("mtpserve:output_seq_errors", "Request rows whose token sequence "
                                        "number was not the expected one (the request fails).").labels(m)

    def _init_pd(self) -> None:
        """PD (docs/pd.md): held KV on a prefill instance, KV reads on a decode instance."""
        m = self._model
        self.kv_held = self._gauge("mtpserve:pd_kv_held", "Prefilled KV entries held for a decode instance.").labels(m)
        self.pd_counters = {
            "num_kv_leases_expired": self._counter("mtpserve:pd_kv_leases_expired",
                                                   "Held KV freed because no decode instance came.").labels(m),
            "num_kv_fetches": self._counter("mtpserve:pd_kv_transfers", "KV reads from prefill instances.").labels(m),
            "kv_fetch_bytes": self._counter("mtpserve:pd_kv_transfer_bytes", "Bytes of KV read.").labels(m),
            "kv_fetch_seconds": self._counter("mtpserve:pd_kv_transfer_seconds",
                                              "Seconds spent in KV reads.").labels(m),
            "num_kv_fallbacks": self._counter("mtpserve:pd_kv_fallbacks",
                                              "Prefilled prompts recomputed here instead of read.").labels(m),
        }

    def _init_prefix_cache(self) -> None:
        """Automatic prefix caching (docs/prefix-caching.md), counted in tokens as vLLM counts it."""
        m = self._model
        self.prefix_counters = {
            "prefix_cache_queries": self._counter("vllm:prefix_cache_queries", "Prompt tokens looked up in "
                                                  "the prefix cache at admission.").labels(m),
            "prefix_cache_hits": self._counter("vllm:prefix_cache_hits", "Prompt tokens whose KV came from "
                                               "the prefix cache.").labels(m),
        }
        self.prefix_cache_blocks = self._gauge("mtpserve:prefix_cache_blocks", "KV blocks whose content the "
                                               "prefix cache can match (held by requests or evictable).").labels(m)
        self.prefix_cache_evictable = self._gauge("mtpserve:prefix_cache_evictable_blocks", "Cached KV blocks "
                                                  "no request holds: free, kept until evicted (LRU).").labels(m)

    def observe_engine_stats(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_blocks_used.set(stats.num_kv_blocks_used)
        self.kv_usage.set(stats.num_kv_blocks_used / max(stats.num_kv_blocks_total, 1))
        last = self._last_stats or EngineStats(step_id=0, num_running=0, num_waiting=0,
                                               num_kv_blocks_used=0, num_kv_blocks_total=0)
        self.num_drafts.inc(max(stats.num_drafts - last.num_drafts, 0))
        self.num_draft_tokens.inc(max(stats.num_draft_tokens - last.num_draft_tokens, 0))
        self.num_accepted.inc(max(stats.num_accepted_tokens - last.num_accepted_tokens, 0))
        for pos, total in enumerate(stats.num_accepted_per_pos):
            before = last.num_accepted_per_pos[pos] if pos < len(last.num_accepted_per_pos) else 0
            self.accepted_per_pos.labels(self._model, str(pos)).inc(max(total - before, 0))
        for pos, drafted in enumerate(stats.num_drafted_per_pos):
            accepted = stats.num_accepted_per_pos[pos] if pos < len(stats.num_accepted_per_pos) else 0
            self.acceptance_rate.labels(self._model, str(pos)).set(accepted / max(drafted, 1))
        self.kv_held.set(stats.num_kv_held)
        self.prefix_cache_blocks.set(stats.num_kv_blocks_cached)
        self.prefix_cache_evictable.set(stats.num_kv_blocks_evictable)
        counters = self.pd_counters | self.engine_counters | self.spec_seconds | self.prefix_counters
        for name, counter in counters.items():
            counter.inc(max(getattr(stats, name) - getattr(last, name), 0))
        self._last_stats = stats

    def observe_reader(self, stats: ReaderStats) -> None:
        """Turn the reader's cumulative counters into increments (called when /metrics is scraped)."""
        last = self._last_reader
        self.frames_lost.inc(max(stats.frames_lost - last.frames_lost, 0))
        self.seq_errors.inc(max(stats.seq_errors - last.seq_errors, 0))
        for reason, total in dict(stats.rejected).items():  # NOTE: a SysV reader thread may add a reason
            self.frames_rejected.labels(self._model, str(reason)).inc(max(total - last.rejected[reason], 0))
        self._last_reader = ReaderStats(frames_lost=stats.frames_lost, seq_errors=stats.seq_errors,
                                        rejected=collections.Counter(stats.rejected))

    def finished(self, reason: str) -> None:
        self.request_success.labels(self._model, reason).inc()

    def reject(self, status: int) -> None:
        self.rejected.labels(self._model, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ChosenDrafts(Collector):
    """mtpserve:spec_decode_chosen_drafts: a histogram of the drafts the policy gave each row, built from
    the engine's cumulative counts per value (observing each row here would replay thousands a second)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily("mtpserve:spec_decode_chosen_drafts", "Drafts the speculation policy "
                                       "gave each row's next window.", labels=["model_name"])
        stats = self.metrics._last_stats
        counts = stats.num_rows_by_drafts if stats is not None else []
        cumulative = np.cumsum(counts).tolist() if counts else [0]
        buckets = [(str(k), c) for k, c in enumerate(cumulative)] + [("+Inf", cumulative[-1])]
        total = float(sum(k * c for k, c in enumerate(counts)))
        family.add_metric([self.metrics._model], buckets, total)
        yield family
