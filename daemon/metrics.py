"""Prometheus exporter: a collector that reads the StatusBoard on each scrape (no gauges of our own to keep current).

``start_metrics_server(board, "127.0.0.1:9100")`` serves ``/metrics`` (any path) over HTTP from a daemon thread;
``stop_metrics_server(server)`` ends it. Every figure comes from one ``board.snapshot()`` per scrape. Names follow
https://prometheus.io/docs/practices/naming/ (base units: seconds, bytes; only counters end in ``_total``); the
list is ``METRICS`` below. Counters restart from 0 with the process, which ``rate()`` and ``increase()`` absorb.
"""

from __future__ import annotations

import socket
import time
from typing import Iterator

from dilocox.daemon.status import State, StatusBoard
from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.exposition import start_wsgi_server
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

# name (as exposed) -> help text; tests/test_metrics.py and the Grafana dashboard check against it
METRICS = {
    "dilocox_info": "constant 1; labels describe the node (peer_id, run_id, version, compression, overlap, admission, "
                    "stage)",
    "dilocox_state": "1 for the node's current lifecycle state, 0 for the others",
    "dilocox_uptime_seconds": "seconds since the node process created its status board",
    "dilocox_outer_step": "outer step the node's parameters hold",
    "dilocox_inner_step": "inner steps done in the current outer round",
    "dilocox_inner_steps_per_round": "H: inner steps per outer round",
    "dilocox_inner_steps_total": "inner steps this process ran (tokens_total / tokens per step)",
    "dilocox_loss": "training loss, mean of the last 10 inner steps (NaN before the first step)",
    "dilocox_validation_loss": "last validation loss measured (NaN before the first measurement)",
    "dilocox_validation_accuracy": "image models: last held-out accuracy measured, 0-1 (NaN for text)",
    "dilocox_sync_attempts": "attempts of the current sync with the swarm (0 when not syncing)",
    "dilocox_tokens_total": "tokens this process trained on",
    "dilocox_tokens_per_second": "training throughput, exponential moving average over inner steps (tokens/s)",
    "dilocox_network_sent_bytes_total": "bytes sent in outer rounds: all-reduce phases (hivemind's estimate) and "
                                        "every byte of payloads, relayed copies and uploads the contribution server "
                                        "sent, in a round or after it; updated as each round is recorded",
    "dilocox_network_received_bytes_total": "bytes received in outer rounds, counted as the sent bytes are",
    "dilocox_group_size": "replicas in the last outer round's group (us included)",
    "dilocox_round_phase_seconds": "last outer round's time per phase: compute (inner steps), communication "
                                   "(matchmaking + all-reduce), blocked (training waited on communication), "
                                   "allreduce (the all-reduce itself)",
    "dilocox_round_payload_bytes": "bytes of this node's encoded contribution in the last outer round",
    "dilocox_round_outcome": "1 for the last outer round's outcome (applied, adopted, solo, applied_alone, skipped, "
                             "resynced), 0 for the others",
    "dilocox_compression_ratio": "fp32 size of the last round's pseudo-gradient / this node's encoded contribution "
                                 "(payload bytes), whoever fetched it (0: no contribution)",
    "dilocox_compression_rank": "PowerSGD rank of the last round (adaptive compression; 0 otherwise)",
    "dilocox_compression_bits": "bits per value of the codes sent in the last round (32 = fp32 exact)",
    "dilocox_compression_error": "||M - C(M)|| / ||M|| of this node's last contribution, before error feedback",
    "dilocox_resyncs_total": "state downloads after falling out of step with the swarm (the initial sync excluded)",
    "dilocox_swarm_peers": "live swarm members seen in the membership records",
    "dilocox_contributions_dropped_total": "peers' contributions left out of the mean in sparse rounds",
    "dilocox_compute_utilization": "fraction (0-1) of wall time spent in inner steps over the last 10 rounds",
    "dilocox_memory_bytes": "memory held for this node's stage, by part",
}

OUTCOMES = ("applied", "adopted", "united", "solo", "applied_alone", "skipped", "resynced")


class StatusCollector(Collector):
    """Turns one ``board.snapshot()`` into metric families per scrape. Thread-safe: the snapshot is the only
    shared read (the board's lock is held for the copy only).

    ``tokens_per_step`` (batch_size * seq_len, tokens per inner step) lets ``dilocox_inner_steps_total`` be
    derived exactly from ``tokens_total``, which the training thread bumps by that much per inner step; without
    it the counter is not exported (a counter kept from successive scrapes would miss steps between them)."""

    def __init__(self, board: StatusBoard, tokens_per_step: int | None = None):
        self.board = board
        self.tokens_per_step = tokens_per_step

    def describe(self) -> list[Metric]:
        return []  # registering must not read the board; collect() is only called on scrapes

    def collect(self) -> Iterator[Metric]:
        s = self.board.snapshot()
        r = s.last_round

        def gauge(name: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, METRICS[name], value=value)

        def counter(name: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, METRICS[name], value=value)  # the family name drops "_total"

        yield InfoMetricFamily("dilocox", METRICS["dilocox_info"], value={
            "peer_id": s.peer_id, "run_id": s.run_id, "version": s.version, "compression": s.compression,
            "overlap": s.overlap, "admission": s.admission, "outer_algorithm": s.outer_algorithm,
            "stage": f"{s.stage_index}/{s.num_stages}"})
        state = GaugeMetricFamily("dilocox_state", METRICS["dilocox_state"], labels=["state"])
        for st in State:
            state.add_metric([st.value], 1.0 if s.state == st else 0.0)
        yield state
        yield gauge("dilocox_uptime_seconds", time.monotonic() - self.board.started)
        yield gauge("dilocox_outer_step", s.outer_step)
        yield gauge("dilocox_inner_step", s.inner_step)
        yield gauge("dilocox_inner_steps_per_round", s.inner_steps)
        if self.tokens_per_step:
            yield counter("dilocox_inner_steps_total", s.tokens_total // self.tokens_per_step)
        yield gauge("dilocox_loss", s.loss)
        yield gauge("dilocox_validation_loss", s.val_loss)
        yield gauge("dilocox_validation_accuracy", s.val_accuracy)
        yield gauge("dilocox_sync_attempts", s.sync_attempts)
        yield counter("dilocox_tokens_total", s.tokens_total)
        yield gauge("dilocox_tokens_per_second", s.tokens_per_second)
        yield counter("dilocox_network_sent_bytes_total", s.bytes_sent)
        yield counter("dilocox_network_received_bytes_total", s.bytes_received)
        yield gauge("dilocox_group_size", r.group_size)
        phases = GaugeMetricFamily("dilocox_round_phase_seconds", METRICS["dilocox_round_phase_seconds"],
                                   labels=["phase"])
        for phase, seconds in (("compute", r.compute_s), ("communication", r.duration_s), ("blocked", r.wait_s),
                               ("allreduce", r.allreduce_s)):
            phases.add_metric([phase], seconds)
        yield phases
        yield gauge("dilocox_round_payload_bytes", r.payload_bytes)
        outcome = GaugeMetricFamily("dilocox_round_outcome", METRICS["dilocox_round_outcome"], labels=["outcome"])
        # an outcome added later still shows up (as its own series) rather than vanishing
        for name in OUTCOMES + ((r.outcome,) if r.outcome and r.outcome not in OUTCOMES else ()):
            outcome.add_metric([name], 1.0 if r.outcome == name else 0.0)
        yield outcome
        yield gauge("dilocox_compression_ratio", r.compression_ratio)
        yield gauge("dilocox_compression_rank", r.rank)
        yield gauge("dilocox_compression_bits", r.bits)
        yield gauge("dilocox_compression_error", r.compression_error)
        yield counter("dilocox_resyncs_total", s.resyncs)
        yield gauge("dilocox_swarm_peers", s.swarm_size)
        yield counter("dilocox_contributions_dropped_total", s.contributions_dropped)
        yield gauge("dilocox_compute_utilization", s.compute_utilization)
        memory = GaugeMetricFamily("dilocox_memory_bytes", METRICS["dilocox_memory_bytes"], labels=["part"])
        for part, size in (("params", s.memory.params_bytes), ("inner_optimizer", s.memory.inner_optimizer_bytes),
                           ("outer_optimizer", s.memory.outer_optimizer_bytes),
                           ("error_feedback", s.memory.error_feedback_bytes), ("total", s.memory.total_bytes)):
            memory.add_metric([part], size)
        yield memory


def parse_addr(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port); ValueError naming the address otherwise."""
    host, sep, port = addr.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"metrics address {addr!r}: expected HOST:PORT with a port 0-65535")
    return host, int(port)


def check_metrics_addr(addr: str) -> None:
    """Fail fast, before the node joins the swarm, on a malformed, unresolvable or busy address (the real bind
    comes later, after hivemind has forked its processes, so that they do not inherit the listening socket).
    Raises ValueError or OSError as start_metrics_server does."""
    host, port = parse_addr(addr)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(e.errno, f"metrics address {addr}: cannot resolve {host!r} ({e.strerror})") from e
    if port == 0:
        return
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds: TIME_WAIT is no conflict
        try:
            probe.bind(sockaddr)
        except OSError as e:
            raise OSError(e.errno, f"metrics address {addr} is not available: {e.strerror or e}") from e


def start_metrics_server(board: StatusBoard, addr: str, tokens_per_step: int | None = None):
    """Serve the board's metrics at http://HOST:PORT/metrics from a daemon thread; returns (server, bound port).

    Port 0 picks a free port. Besides the dilocox_* families, the registry has the standard process_* (CPU
    seconds, resident memory bytes, open fds) and python_info ones. Raises ValueError for a malformed address
    and OSError (with the address in the message) when HOST does not resolve or HOST:PORT cannot be bound."""
    host, port = parse_addr(addr)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(board, tokens_per_step))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    try:
        server, _thread = start_wsgi_server(port, host, registry=registry)
    except socket.gaierror as e:
        raise OSError(e.errno, f"metrics address {addr}: cannot resolve {host!r} ({e.strerror})") from e
    except OSError as e:
        raise OSError(e.errno, f"metrics address {addr} is not available: {e.strerror or e}") from e
    return server, server.server_port


def stop_metrics_server(server) -> None:
    """Stop serving and close the listening socket (returns within the serve loop's 0.5 s poll interval)."""
    server.shutdown()
    server.server_close()
