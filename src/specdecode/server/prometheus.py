"""Prometheus metrics of one server, in a registry of its own (two apps never share counters).

Names follow vLLM's (without its "vllm:" prefix), so one scraper or report reads both:

- spec_decode_num_drafts_total: verification steps that had at least one draft token;
- spec_decode_num_draft_tokens_total, spec_decode_num_accepted_tokens_total;
- spec_decode_num_accepted_tokens_per_pos_total{position}: accepted draft tokens at each draft
  position (0 = the first draft token). accepted / draft tokens is NOT alpha when k > 1;
  mean acceptance length = 1 + accepted / drafts over steps that drafted;
- time_to_first_token_seconds, inter_token_latency_seconds (the gap between two successive
  token-carrying outputs of a request: one engine step, which may emit several tokens),
  e2e_request_latency_seconds: histograms, measured where the server hands text to the client;
- num_requests_running (decoding or prefilling), num_requests_waiting (queued): gauges;
- kv_cache_usage_perc (tokens held / token capacity of the shared cache, 0..1),
  kv_cache_used_rows, kv_cache_rows: gauges;
- memory_bytes{component}: target_weights, draft_weights (only what the drafter does not
  share with the target), target_kv (the shared batch cache, allocated at start), draft_store
  (--drafter suffix: its store of earlier requests, read at each scrape), and peak_rss (this
  process, read at each scrape): gauges;
- with --drafter suffix (read from the store at each scrape): suffix_store_bytes and
  suffix_store_requests (what it holds), suffix_store_max_bytes and suffix_store_max_requests
  (its caps, --suffix-mib and --suffix-requests), suffix_store_evicted_requests_total (requests
  evicted to stay under the caps), and suffix_store_info{isolation} (value 1: user or shared);
- spec_decode_guard_holds (under --k auto): times the controller's guard held speculation off
  because its speculative steps realized fewer tokens/s than plain steps (control.PayGuard);
- engine_steps_total{batch_size}: engine steps by the number of requests they decoded (the
  batch-size distribution the traffic produced; `bench --endpoint` replays read it);
- live speculation per drafter and request label (server.speculation, read at each scrape):
  spec_decode_label_row_steps_total (a request in a step), spec_decode_label_no_draft_steps_total
  (of those, drafting nothing), spec_decode_label_draft_tokens_total,
  spec_decode_label_accepted_tokens_total, spec_decode_label_emitted_tokens_total,
  spec_decode_label_step_seconds_total (each step's time, once per request in it) and
  spec_decode_label_plain_equivalent_tokens_total (tokens plain decoding would have emitted in
  that time, by the calibration): counters; spec_decode_realized_speedup (emitted over plain
  equivalent, over the last judged window) and spec_decode_not_paying (1 while that is below
  1.0): gauges; spec_decode_calibration_stale{reason} (target, precision, drafter, step_cost:
  1 while the calibration does not describe what is served) and
  spec_decode_plain_step_seconds{batch_size} (the calibrated plain step): gauges;
- record_lines_total{outcome} (--record: lines written, dropped, failed);
- prompt_tokens_total, generation_tokens_total, request_success_total{finished_reason}
  (stop, length, abort) counters;
- requests_refused_total{reason}: requests answered with an error instead of a generation, by
  error code (server_busy: the 429 of a full queue; shutting_down; invalid_value,
  context_length_exceeded, ...: 4xx; request_too_large; request_timeout; invalid_api_key;
  not_found; internal_error: a 500), and header_timeout for requests whose first bytes arrived
  but not their complete headers within --header-timeout (a connection closed idle at that
  deadline, having sent nothing since it opened or since its last response, is not counted);
  `REFUSED_REASONS` is the closed set (docs/serving.md lists it).

Every series carries the label model_name. Counters and histograms are thread-safe: the engine
thread updates the speculation counters and gauges, the event loop the per-request ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from specdecode.memory import peak_rss_bytes
from specdecode.server.connections import HEADER_TIMEOUT
from specdecode.server.openai_errors import ERROR_CODES
from specdecode.server.speculation import STALE_REASONS, SpeculationMonitor
from specdecode.suffix import SuffixStore

CONTENT_TYPE = CONTENT_TYPE_LATEST
# every reason requests_refused_total counts (docs/serving.md lists the same)
REFUSED_REASONS = ERROR_CODES | {HEADER_TIMEOUT}


def _peak_rss_bytes() -> float:
    return float(peak_rss_bytes())

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort"}


class ServerMetrics:
    """The server's counters, histograms and gauges, and their text exposition."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r, m = self.registry, ["model_name"]
        self._drafts = Counter("spec_decode_num_drafts", "Steps that verified a draft.", m,
                               registry=r).labels(model_name)
        self._draft_tokens = Counter("spec_decode_num_draft_tokens", "Draft tokens proposed.",
                                     m, registry=r).labels(model_name)
        self._accepted = Counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                 m, registry=r).labels(model_name)
        self._per_pos = Counter("spec_decode_num_accepted_tokens_per_pos",
                                "Draft tokens accepted, by draft position.",
                                [*m, "position"], registry=r)
        self._ttft = Histogram("time_to_first_token_seconds", "Time to first token.", m,
                               buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self._itl = Histogram("inter_token_latency_seconds", "Gap between token outputs.", m,
                              buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self._e2e = Histogram("e2e_request_latency_seconds", "Request latency.", m,
                              buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self._running = Gauge("num_requests_running", "Requests decoding or prefilling.", m,
                              registry=r).labels(model_name)
        self._waiting = Gauge("num_requests_waiting", "Requests queued.", m,
                              registry=r).labels(model_name)
        self._kv_usage = Gauge("kv_cache_usage_perc", "KV cache tokens held / capacity (0-1).",
                               m, registry=r).labels(model_name)
        self._kv_rows_used = Gauge("kv_cache_used_rows", "KV cache rows in use.", m,
                                   registry=r).labels(model_name)
        self._kv_rows = Gauge("kv_cache_rows", "KV cache rows (max batch).", m,
                              registry=r).labels(model_name)
        self._prompt_tokens = Counter("prompt_tokens", "Prompt tokens of finished requests.",
                                      m, registry=r).labels(model_name)
        self._generation_tokens = Counter("generation_tokens", "Tokens generated.", m,
                                          registry=r).labels(model_name)
        self._success = Counter("request_success", "Finished requests, by finish reason.",
                                [*m, "finished_reason"], registry=r)
        self._refused = Counter("requests_refused", "Requests answered with an error, by reason.",
                                [*m, "reason"], registry=r)
        self._memory = Gauge("memory_bytes", "Memory by component (bytes).",
                             [*m, "component"], registry=r)
        self._memory.labels(model_name, "peak_rss").set_function(_peak_rss_bytes)
        self._steps = Counter("engine_steps", "Engine steps, by the requests they decoded.",
                              [*m, "batch_size"], registry=r)
        self._recorded = Counter("record_lines", "--record lines, by outcome.",
                                 [*m, "outcome"], registry=r)

    def watch_guard(self, holds: Callable[[], float]) -> None:
        """Expose the controller's guard: `holds()` is read at each scrape."""
        Gauge("spec_decode_guard_holds", "Times speculation was held off because it did not "
              "pay (control.PayGuard).", ["model_name"], registry=self.registry
              ).labels(self.model_name).set_function(holds)

    def watch_speculation(self, monitor: SpeculationMonitor) -> None:
        """Expose the live speculation monitor (read at each scrape)."""
        self.registry.register(_SpeculationCollector(monitor, self.model_name))

    def observe_batch(self, batch: int) -> None:
        """One engine step that decoded `batch` requests."""
        self._steps.labels(self.model_name, str(batch)).inc()

    def observe_recorded(self, outcome: str) -> None:
        """One --record line: written, dropped or failed."""
        self._recorded.labels(self.model_name, outcome).inc()

    def watch_suffix_store(self, store: SuffixStore, isolation: str) -> None:
        """Expose the `suffix` drafter's store of earlier requests (read at each scrape): its
        size and caps, its evictions, and its bytes as memory_bytes{component="draft_store"}.
        No series names a scope: nothing here tells users apart."""
        self.registry.register(_SuffixStoreCollector(store, self.model_name, isolation))
        self._memory.labels(self.model_name, "draft_store").set_function(
            lambda: float(store.nbytes()))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return bytes(generate_latest(self.registry))

    def observe_step(self, drafted: int, accepted: int, accepted_per_pos: list[int]) -> None:
        """One verification step of one request: `accepted_per_pos[i]` is 0 or 1 per position."""
        if drafted <= 0:
            return
        self._drafts.inc()
        self._draft_tokens.inc(drafted)
        self._accepted.inc(accepted)
        for pos, count in enumerate(accepted_per_pos):
            if count:
                self._per_pos.labels(self.model_name, str(pos)).inc(count)

    def set_backend(self, backend: str, version: str, exactness: str | None) -> None:
        """An info gauge (value 1) naming the runtime behind the target and its measured
        exactness ("unknown" where none was measured: the transformers adapter)."""
        Gauge("backend_info", "The target's runtime, its version and measured exactness.",
              ["model_name", "backend", "version", "exactness"], registry=self.registry).labels(
            self.model_name, backend, version, exactness or "unknown").set(1)

    def set_memory(self, target_weights: int, draft_weights: int, target_kv: int) -> None:
        """The static part of the memory accounting, set once when the server is built."""
        for component, value in (("target_weights", target_weights),
                                 ("draft_weights", draft_weights), ("target_kv", target_kv)):
            self._memory.labels(self.model_name, component).set(value)

    def set_engine_state(self, running: int, waiting: int, used_rows: int, rows: int,
                         used_tokens: int, capacity_tokens: int) -> None:
        """Gauges describing the engine after a loop iteration."""
        self._running.set(running)
        self._waiting.set(waiting)
        self._kv_rows_used.set(used_rows)
        self._kv_rows.set(rows)
        self._kv_usage.set(used_tokens / capacity_tokens if capacity_tokens else 0.0)

    def observe_refused(self, reason: str) -> None:
        """One request refused (or failed before generating) for `reason`."""
        self._refused.labels(self.model_name, reason).inc()

    def observe_first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def observe_finished(self, reason: str, prompt_tokens: int, generation_tokens: int,
                         seconds: float) -> None:
        """A request left the engine: finished (stop, length) or cancelled (abort)."""
        self._success.labels(self.model_name, FINISH_REASONS.get(reason, reason)).inc()
        self._prompt_tokens.inc(prompt_tokens)
        self._generation_tokens.inc(generation_tokens)
        self._e2e.observe(seconds)


class _SuffixStoreCollector(Collector):
    """The suffix store's series, read from the store when scraped (its counters live in the
    store: the engine thread adds and evicts, the scrape only reads)."""

    def __init__(self, store: SuffixStore, model_name: str, isolation: str) -> None:
        self.store, self.model_name, self.isolation = store, model_name, isolation

    def collect(self) -> Iterable[Metric]:
        store, labels = self.store, ["model_name"]
        for name, doc, value in (
                ("suffix_store_bytes", "Bytes the suffix store of earlier requests holds.",
                 store.nbytes()),
                ("suffix_store_requests", "Requests the suffix store holds.", len(store)),
                ("suffix_store_max_bytes", "The suffix store's cap in bytes (--suffix-mib).",
                 store.max_bytes),
                ("suffix_store_max_requests", "The suffix store's cap in requests "
                 "(--suffix-requests).", store.max_requests)):
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric([self.model_name], float(value))
            yield gauge
        evicted = CounterMetricFamily("suffix_store_evicted_requests", "Requests evicted from "
                                      "the suffix store to stay under its caps.", labels=labels)
        evicted.add_metric([self.model_name], float(store.evicted))
        yield evicted
        info = GaugeMetricFamily("suffix_store_info", "Whose earlier text a request drafts "
                                 "from: isolation user (its own scope) or shared.",
                                 labels=[*labels, "isolation"])
        info.add_metric([self.model_name, self.isolation], 1.0)
        yield info


class _SpeculationCollector(Collector):
    """The live speculation series (server.speculation), read from the monitor when scraped."""

    COUNTERS = (("row_steps", "spec_decode_label_row_steps", "Requests in engine steps."),
                ("no_draft", "spec_decode_label_no_draft_steps",
                 "Requests in engine steps that drafted nothing (k = 0)."),
                ("drafted", "spec_decode_label_draft_tokens", "Draft tokens proposed."),
                ("accepted", "spec_decode_label_accepted_tokens", "Draft tokens accepted."),
                ("emitted", "spec_decode_label_emitted_tokens", "Tokens emitted by steps."),
                ("step_s", "spec_decode_label_step_seconds",
                 "Seconds of the steps, once per request in each."),
                ("plain_equivalent", "spec_decode_label_plain_equivalent_tokens",
                 "Tokens plain decoding would have emitted in that time (calibrated)."))

    def __init__(self, monitor: SpeculationMonitor, model_name: str) -> None:
        self.monitor, self.model_name = monitor, model_name

    def collect(self) -> Iterable[Metric]:
        labels = ["model_name", "drafter", "label"]
        per_label = self.monitor.labels()
        for attr, name, doc in self.COUNTERS:
            family = CounterMetricFamily(name, doc, labels=labels)
            for label, (total, _, _) in per_label.items():
                family.add_metric([self.model_name, self.monitor.drafter, label],
                                  float(getattr(total, attr)))
            yield family
        speedup = GaugeMetricFamily("spec_decode_realized_speedup", "Realised speedup "
                                    "estimate over the last judged window.", labels=labels)
        losing = GaugeMetricFamily("spec_decode_not_paying", "1 while the realised speedup "
                                   "estimate of the last window is below 1.0.", labels=labels)
        for label, (_, window, not_paying) in per_label.items():
            key = [self.model_name, self.monitor.drafter, label]
            speedup.add_metric(key, window.speedup if window else math.nan)
            losing.add_metric(key, float(not_paying))
        yield speedup
        yield losing
        stale = GaugeMetricFamily("spec_decode_calibration_stale", "1 while the calibration "
                                  "does not describe what is served, by reason.",
                                  labels=["model_name", "reason"])
        reasons = self.monitor.stale_reasons()
        for reason in STALE_REASONS:
            stale.add_metric([self.model_name, reason], float(reason in reasons))
        yield stale
        plain = GaugeMetricFamily("spec_decode_plain_step_seconds", "The calibrated plain "
                                  "decoding step, by batch size.",
                                  labels=["model_name", "batch_size"])
        for batch, seconds in sorted(self.monitor.plain.seconds.items()):
            plain.add_metric([self.model_name, str(batch)], seconds)
        yield plain
