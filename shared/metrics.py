"""Prometheus metrics of every learnmesh process, defined in one module so names stay
consistent. Each component adds its metrics in its own block below."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class _HotChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount


_C = TypeVar("_C")


class _HotHistogramChild:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # bucket "le": value <= bound
        self.sum += value


class _HotFamily(Collector, Generic[_C]):
    """Labelled children kept in a dict, registered with a registry, read at scrape time."""

    family: type[CounterMetricFamily] | type[HistogramMetricFamily]

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = list(labelnames)
        self._children: dict[tuple[str, ...], _C] = {}
        registry.register(self)

    def _new_child(self) -> _C:
        raise NotImplementedError

    def _add(self, family: Any, key: tuple[str, ...], child: _C) -> None:
        raise NotImplementedError

    def labels(self, *values: str) -> _C:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {self.labelnames}")
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            child = self._children.setdefault(key, self._new_child())
        return child

    def describe(self) -> Iterator[Any]:
        yield self.family(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Any]:
        family = self.family(self.name, self.documentation, labels=self.labelnames)
        for key, child in list(self._children.items()):
            self._add(family, key, child)
        yield family


class HotHistogram(_HotFamily[_HotHistogramChild]):
    """A labelled histogram for hot paths, like HotCounter: ``labels(...).observe(v)`` is a
    bisect and two adds, where prometheus_client's Histogram takes a lock and walks its
    buckets (5% of a cached context read's client time, profiled). Same exposition
    (``_bucket{le=...}``, ``_sum``, ``_count``); one event loop per child, as HotCounter."""

    family = HistogramMetricFamily

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], *, buckets: Sequence[float],
                 registry: CollectorRegistry = REGISTRY) -> None:
        self.bounds = tuple(sorted(float(b) for b in buckets if b != float("inf")))
        if not self.bounds:
            raise ValueError(f"{name}: at least one finite bucket")
        super().__init__(name, documentation, labelnames, registry)

    def _new_child(self) -> _HotHistogramChild:
        return _HotHistogramChild(self.bounds)

    def _add(self, family: Any, key: tuple[str, ...], child: _HotHistogramChild) -> None:
        counts, total = list(child.counts), child.sum
        cumulative, buckets = 0, []
        for bound, n in zip((*self.bounds, float("inf")), counts, strict=True):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))
        family.add_metric(list(key), buckets, total)


class HotCounter(_HotFamily[_HotChild]):
    """A labelled counter for hot paths: ``labels(...).inc(n)`` is one attribute add, where
    prometheus_client's Counter takes a lock per increment (~0.4 µs: a tenth of a cached
    context read's client time, for the three counters it bumps). The registry reads the
    totals at scrape time. A child is meant to be bumped from one thread (the event loop
    that owns it), as the context store does; reads from the scrape thread are safe."""

    family = CounterMetricFamily

    def __init__(self, name: str, documentation: str, labelnames: list[str],
                 registry: CollectorRegistry = REGISTRY) -> None:
        super().__init__(name.removesuffix("_total"), documentation, labelnames, registry)

    def _new_child(self) -> _HotChild:
        return _HotChild()

    def _add(self, family: Any, key: tuple[str, ...], child: _HotChild) -> None:
        family.add_metric(list(key), child.value)


class Without(Collector):
    """``registry``'s families except those whose name starts with one of ``prefixes``: what a
    process exposes of the metrics of every process defined here (a gateway's trainer counters
    would read 0 beside the trainer's own exporter, as if nothing had been trained)."""

    def __init__(self, registry: CollectorRegistry, prefixes: tuple[str, ...]) -> None:
        self.registry = registry
        self.prefixes = prefixes

    def collect(self) -> Iterator[Any]:
        return (mf for mf in self.registry.collect() if not mf.name.startswith(self.prefixes))


# ---------------------------------------------------------------- gateway / MCP
MCP_REQUESTS = Counter("learnmesh_mcp_requests_total", "MCP requests", ["method", "revision", "transport"])
MCP_LATENCY = Histogram("learnmesh_mcp_request_seconds", "MCP request latency", ["method", "revision"],
                        buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10))
MCP_ERRORS = Counter("learnmesh_mcp_errors_total", "MCP error responses", ["code"])
MCP_SESSIONS_OPEN = Gauge("learnmesh_mcp_sessions_open", "Legacy MCP sessions cached on this replica")
LIMIT_EXCEEDED = Counter("learnmesh_limit_exceeded_total", "Requests refused because a principal reached a limit",
                         ["limit"])  # requests | learn_samples | learn_bytes | sample_backlog | subscriptions | ...
LIMITS_LOCAL_FALLBACK = Gauge("learnmesh_limits_local_fallback",
                              "1 while Redis does not answer and this replica enforces request rates by itself")
LEARN_FORBIDDEN = Counter("learnmesh_learn_forbidden_total",
                          "learn calls and sample imports refused: the principal may not teach")

# ---------------------------------------------------------------- MCP-Proxy (gateway/proxy/)
PROXY_CALLS = Counter("learnmesh_proxy_calls_total", "Calls forwarded to upstream MCP servers",
                      ["upstream", "method", "outcome"])
PROXY_LATENCY = Histogram("learnmesh_proxy_call_seconds", "Latency of calls forwarded to an upstream",
                          ["upstream"], buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                                                 10, 30))
PROXY_BREAKER = Gauge("learnmesh_proxy_breaker_state", "An upstream's circuit breaker: 0 closed, 1 half-open, 2 open",
                      ["upstream"])

# ---------------------------------------------------------------- samples / trainer
SAMPLES_ACCEPTED = Counter("learnmesh_samples_accepted_total", "Samples written to the durable log")
SAMPLES_REJECTED = Counter("learnmesh_samples_rejected_total", "Samples refused at the gateway once the call "
                           "passed the tool's input schema (a call the schema refuses: learnmesh_mcp_errors_total)",
                           ["reason"])
SAMPLES_BACKPRESSURE = Counter("learnmesh_samples_backpressure_total",
                               "Logged samples not pushed to the trainer because its queue was full "
                               "(they are replayed from the log)")
TRAINER_STEP = Gauge("learnmesh_trainer_step", "Optimizer steps of the current model lineage")
TRAINER_LOSS = Gauge("learnmesh_trainer_loss", "Training loss of the last optimizer step")
TRAINER_SAMPLES_PER_S = Gauge("learnmesh_trainer_samples_per_second", "Samples trained per second (EMA)")
TRAINER_SAMPLES = Counter("learnmesh_trainer_samples_total", "Samples trained (committed with a gradient)")
SAMPLES_CONTEXT_NOT_COPIED = Counter("learnmesh_samples_context_not_copied_total",
                                     "learn calls whose context windows exceeded trainer.max_context_copy_bytes "
                                     "(their samples read the context at its version when trained)")
TRAINER_SAMPLES_SKIPPED = Counter("learnmesh_trainer_samples_skipped_total",
                                  "Samples consumed without a gradient, by reason", ["reason"])
TRAINER_REPLAYED = Counter("learnmesh_trainer_replayed_samples_total",
                           "Extra passes over recent samples (trainer.replay_passes)")
TRAINER_ANSWER_PASSES = Counter("learnmesh_trainer_answer_passes_total",
                                "Passes given to samples whose short target the model did not answer yet "
                                "(trainer.answer_passes)")
TRAINER_LOG_RESETS = Counter("learnmesh_trainer_log_resets_total",
                             "Times the trainer found a sample log other than the one its offsets came from")
TRAINER_IDLE_SYNCS = Counter("learnmesh_trainer_idle_syncs_total",
                             "Bit-exact residual publishes while training paused (consistency.idle_sync_ms)")
TRAINER_COMMITTED_SEQ = Gauge("learnmesh_trainer_committed_seq", "Last sample sequence number committed")
TRAINER_STEP_SECONDS = Histogram("learnmesh_trainer_step_seconds", "Wall time of one optimizer step",
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
TRAINER_RESTARTS = Counter("learnmesh_trainer_restarts_total", "Rank group restarts after a failure")
TRAINER_VERSION = Gauge("learnmesh_trainer_published_version", "Last model version published to workers")

# ---------------------------------------------------------------- context store
CONTEXT_OPS = HotCounter("learnmesh_context_ops_total", "Context store operations", ["op", "outcome"])
CONTEXT_OP_SECONDS = HotHistogram("learnmesh_context_op_seconds", "Context store operation latency (one round trip)",
                                  ["op"], buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1, 1))
CONTEXT_EVICTIONS = Counter("learnmesh_context_evictions_total", "Contexts evicted by learnmesh",
                            ["reason"])  # idle | principal_budget | global_budget | admin
CONTEXT_APPENDED_BYTES = HotCounter("learnmesh_context_appended_bytes_total", "Bytes appended to contexts",
                                    ["modality"])
CONTEXT_READ_ENTRIES = HotCounter("learnmesh_context_read_entries_total",
                               "Entries get_window returned, by where they came from (redis or the read cache)",
                               ["source"])

# ---------------------------------------------------------------- weight-delta sync (codec, envelope, publisher, subscriber)
DELTA_PUBLISHED = Counter("learnmesh_delta_published_total", "Deltas/anchors published by the trainer", ["kind"])
DELTA_BYTES = Counter("learnmesh_delta_bytes_total", "Delta bytes on the wire", ["direction"])
DELTA_ENCODE_SECONDS = Histogram("learnmesh_delta_encode_seconds", "Time to encode one delta",
                                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
DELTA_DENSITY = Gauge("learnmesh_delta_density", "Fraction of elements sent in the last delta")
DELTA_RESIDUAL = Gauge("learnmesh_delta_residual_rel", "Relative residual (not yet sent) of the last delta")
DELTA_LATEST_VERSION = Gauge("learnmesh_delta_latest_version", "Latest model version published")
DELTA_APPLIED = Counter("learnmesh_delta_applied_total", "Deltas applied by workers", ["kind"])
DELTA_REJECTED = Counter("learnmesh_delta_rejected_total", "Delta packets rejected and not applied", ["reason"])
DELTA_RESYNCS = Counter("learnmesh_delta_resyncs_total", "Snapshot resyncs by workers", ["cause"])
DELTA_SNAPSHOT_REQUESTS = Counter("learnmesh_delta_snapshot_requests_total",
                                  "Snapshot requests the trainer received, by what became of them (served, "
                                  "deferred to the end of the peer's interval, coalesced into a later one, "
                                  "refused: too many peers waiting)", ["outcome"])
DELTA_APPLY_SECONDS = Histogram("learnmesh_delta_apply_seconds", "Time to decode and apply one delta",
                                buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1))

# ---------------------------------------------------------------- operations (issue list not covered above)
# Processes without an HTTP server expose these with shared.control.start_metrics_server
# (workers: metrics.worker_port + index; trainer ranks: metrics.trainer_port + rank).
TRAINER_ALLREDUCE_BYTES = Counter("learnmesh_trainer_allreduce_bytes_total",
                                  "Gradient bytes all-reduced by this rank (after the DDP comm hook)", ["hook"])
DELTA_COMPRESSION_RATIO = Gauge("learnmesh_delta_compression_ratio",
                                "Dense fp32 bytes / wire bytes of the last published delta")
DELTA_STEP_TO_SERVING = Histogram("learnmesh_delta_step_to_serving_seconds",
                                  "Optimizer step to a worker serving that version",
                                  buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
CODEC_CPU_SECONDS = Counter("learnmesh_codec_cpu_seconds_total", "CPU seconds spent in the delta codec",
                            ["op"])  # encode | decode
WORKER_VERSION_LAG = Gauge("learnmesh_worker_version_lag", "Model versions a worker is behind the trainer",
                           ["worker"])
WORKER_VERSION = Gauge("learnmesh_worker_model_version", "Model version a worker serves", ["worker"])
CONTEXT_STORED_BYTES = Gauge("learnmesh_context_stored_bytes", "Bytes held by the context store (all principals)")
ADMIN_ACTIONS = Counter("learnmesh_admin_actions_total", "Audited admin actions", ["action"])
ADMIN_DENIED = Counter("learnmesh_admin_denied_total", "Admin requests refused", ["status"])  # 401 | 403

# ---------------------------------------------------------------- inference (workers and the gateway's pool)
WORKER_BATCH_SIZE = Histogram("learnmesh_worker_batch_size", "Requests per batch run by a worker", ["op"],
                              buckets=(1, 2, 4, 8, 16, 32, 64, 128))
WORKER_REQUESTS = Counter("learnmesh_worker_requests_total", "Requests handled by a worker", ["op", "outcome"])
WORKER_TOKENS = Counter("learnmesh_worker_generated_tokens_total", "Tokens generated by a worker")
INFER_REQUESTS = Counter("learnmesh_inference_requests_total", "Inference requests sent by the gateway",
                         ["op", "outcome"])  # ok | bad_input | error | no_worker | timeout
INFER_SECONDS = Histogram("learnmesh_inference_request_seconds", "Gateway-side inference latency", ["op"],
                          buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
INFER_RETRIES = Counter("learnmesh_inference_retries_total", "Requests retried on another worker (worker died)")
WORKERS_LIVE = Gauge("learnmesh_workers_live", "Inference workers answering heartbeats")
WORKERS_BENCHED = Gauge("learnmesh_workers_benched",
                        "Inference workers benched for letting requests time out (worker.max_consecutive_timeouts)")
WORKER_BAD_MESSAGES = Counter("learnmesh_worker_bad_messages_total",
                              "Messages from workers the gateway could not read and dropped")

# ---------------------------------------------------------------- ZeroMQ links (CurveZMQ)
ZMQ_AUTH_REFUSED = Counter("learnmesh_zmq_auth_refused_total",
                           "CURVE clients refused by this process's ZAP allow-list", ["domain"])
ZMQ_DROPPED = Counter("learnmesh_zmq_dropped_messages_total",
                      "Messages a bound ZeroMQ socket could not read and dropped (link: infer, samples, "
                      "snapshots, acks)", ["link"])
ZMQ_CONNECTIONS_BROKEN = Counter("learnmesh_zmq_connections_broken_total",
                                 "Connections to a server this process closed because the server sent a frame "
                                 "over the socket's limit or broke the protocol; each is connected again",
                                 ["peer"])
ZMQ_HANDSHAKE_FAILED = Counter("learnmesh_zmq_handshake_failed_total",
                               "CURVE handshakes this process failed as a client (peer: the server's role)",
                               ["peer", "reason"])
