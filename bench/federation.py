"""One in-process DiLoCo federation for the benchmarks: R replicas, the product's codes, aggregation and outer step.

Round t (1-based) of ``Federation.round``, for the round's members (all replicas unless the caller excludes some):

  1. each member runs H inner steps (``Replica.inner_steps``: how a benchmark trains) from its schedule's
     reference (``ExperimentalSchedule``, dilocox/experimental/overlap.py, a subclass of dilocox/overlap.py's
     ``OuterSchedule``); overlapped rounds run tau of them, then the previous round's mean lands (the outer step)
     and is merged, then the rest;
  2. its pseudo-gradient delta = reference - x (``OuterSchedule.pseudo_gradient``, CPU fp32);
  3. ``Contributions.send`` may replace what a member sends (an attack); ``Method``'s code encodes it: the sparse
     codec (dilocox/sparse/ ``SparseCodec.prepare`` / ``commit``; ``Contributions.encoded`` sees each payload
     before its commit), one index set per round (dilocox/shared_index.py, with dilocox/experimental/selections.py),
     the dense ``Compressor`` round protocol (dilocox/compression.py ``DenseCompressor``) with the weighted mean
     of the codes that hivemind's all-reduce returns, or none (``plain``: flat float64 vectors);
  4. the aggregate, weight H per member: dilocox/sparse/aggregate.py with a dilocox/robust.py rule (sparse), the
     shared reduce, the codes' mean (dense), or dilocox/robust.py's ``aggregate`` (plain; the caller may replace
     it: ``aggregator``); re-sparsified by dilocox/experimental/resparsify.py on request;
  5. the outer step (``OuterOptimizer``, dilocox/diloco.py, through the schedule): at the round's end
     (synchronous; every member re-bases on theta) or tau inner steps into the next round (overlapped: the
     members start from their proxies; ``finish`` lands the last round's mean).

Synchronous rounds start every member from theta (a replica that sat some rounds out catches up). What is measured
per round stays with the caller (``round`` returns the ``Exchange``). bench/quality.py, bench/audit.py and
bench/attacks/badsfl/sim.py (SCAFFOLD's control variates in its hooks) run their rounds here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Optional, Protocol, Sequence

import torch

from dilocox import exact_mean, robust
from dilocox.compression import CompressionConfig, DenseCompressor
from dilocox.data import ReplicaShard
from dilocox.diloco import InnerConfig, InnerLoop, OuterOptimizer
from dilocox.experimental.overlap import ExperimentalSchedule
from dilocox.experimental.resparsify import reencode, residual
from dilocox.experimental.selections import (
    index_bytes,
    leader_rank,
    random_positions,
    reduce_by_range,
    union_positions,
)
from dilocox.shared_index import (
    ReducerFeedback,
    Selection,
    SharedIndexConfig,
    SharedIndexMember,
    leader_positions,
    reduce,
    value_range,
    values_bytes,
)
from dilocox.sparse import SparseCodec, SparseConfig, aggregate, decode

Tensors = list[torch.Tensor]


@dataclass(frozen=True)
class Method:
    """One row: how pseudo-gradients are coded and how the outer step applies their mean."""

    name: str
    codec: str = "none"             # Compressor mode (none, fp16, int8, adaptive), "sparse" or "plain" (uncoded)
    outer_lr: float = 0.7
    outer_lr_final: Optional[float] = None  # outer lr ramped linearly to this over the outer steps (lr_at)
    outer_momentum: float = 0.9
    nesterov: bool = True
    overlap: str = "none"           # "none" or "delayed" (overlapped rounds, dilocox/overlap.py)
    tau: Optional[int] = None       # overlapped: inner steps of round t+1 before round t's update lands (None: H)
    proxy: str = "none"             # overlapped: the next round's local start (dilocox/overlap.py)
    proxy_source: str = "code"      # what stands in for our share: the decoded contribution, raw delta, or EF
    merge: str = "rebase"           # overlapped: how the landed update joins the local trajectory
    mix: float = 0.5                # merge "mix": x <- mix x + (1 - mix) theta (Streaming DiLoCo)
    rank_max: int = 8
    rank_energy: float = 0.5
    error_feedback: bool = True
    dense_embeddings: bool = False  # embeddings and LM head sent whole (8-bit), not in low rank
    warmup_rounds: int = 0          # the first rounds sent uncompressed (fp32)
    power_iterations: int = 1       # PowerSGD iterations per round (each extra one: two more phases)
    refresh_every: int = 0          # every k-th round sent whole at 8 bits, flushing the error feedback
    sparse: SparseConfig = field(default_factory=SparseConfig)
    aggregation: str = "mean"       # sparse and plain rounds: dilocox/robust.py rule
    norm_bound: float = 0.0         # sparse and plain rounds: clip to this multiple of the median norm (0: off)
    resparsify: int = 0             # sparse rounds: the aggregate cut to this many x topk per chunk (0: off)
    resparsify_bits: int = 0        # bits per value of the cut aggregate (0: the contributions')
    restore_whole: bool = False     # the cut's residual returned undecayed (SparseCodec.restore's whole)
    shared: Optional[SharedIndexConfig] = None  # sparse rounds on one index set (dilocox/shared_index.py)
    reducer_feedback: bool = False  # shared: the result's quantization error kept by its range's reducer
    reducer_proposes: bool = False  # ... and added to the reducer's own proposal on its range (it may pick them)


class Replica(Protocol):
    """What the federation needs of a replica: its local parameters and a way to train them."""

    params: Tensors  # the model's parameters, in place; the schedule reads and re-bases them

    def inner_steps(self, t: int, first: int, end: int) -> None:
        """Inner steps ``first`` .. ``end`` - 1 (0-based in the round) of round ``t`` (1-based)."""


class ShardReplica:
    """An ``InnerLoop`` that draws its batches in order from a ``ReplicaShard`` (what a node with
    --data-seed r draws); global step (t - 1) H + i."""

    def __init__(self, inner: InnerLoop, shard: ReplicaShard, inner_steps: int):
        self.inner, self.shard, self.h = inner, shard, inner_steps

    @property
    def params(self) -> Tensors:
        return self.inner.params

    def inner_steps(self, t: int, first: int, end: int) -> None:
        for i in range(first, end):
            self.inner.inner_step(*self.shard.next_batch(), global_step=(t - 1) * self.h + i)


class Contributions:
    """Per-contribution hooks (attacks, audits); the defaults send the honest pseudo-gradient."""

    def send(self, t: int, member: int, delta: Tensors, deltas: Mapping[int, Tensors]) -> Tensors:
        """What ``member`` sends in round ``t`` instead of its pseudo-gradient ``delta`` (``deltas``: every
        member's honest one, by replica index). Default: ``delta``."""
        return delta

    def encoded(self, t: int, member: int, payload: bytes, sent: Tensors) -> None:
        """Sparse rounds: ``member``'s payload of ``sent``, before its codec commits the new error feedback."""


@dataclass
class Exchange:
    """One round's result: ``mean`` the aggregate (the parameters' shapes, fp32), ``own`` each member's
    contribution as the proxy's stand-in (``Method.proxy_source``), ``payload`` one member's bytes, ``upload``
    the bytes a member uploads (mean over members), ``dropped`` contributions the sparse aggregate rejected;
    plain rounds: ``vectors`` the contributions (peer id -> flat float64), ``flat`` the aggregate (float64) and
    ``report`` the aggregator's (dilocox/robust.py: {"clipped": {peer: scale}, ...})."""

    mean: Tensors
    own: list[Tensors]
    payload: float
    upload: float
    dropped: dict = field(default_factory=dict)
    vectors: dict = field(default_factory=dict)
    flat: Optional[torch.Tensor] = None
    report: dict = field(default_factory=dict)


def flatten(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors into one float64 vector (parameter order)."""
    return torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])


def unflatten(vector: torch.Tensor, like: list[torch.Tensor]) -> Tensors:
    """Split a flat vector back into CPU fp32 tensors shaped like ``like``; ValueError if the sizes differ."""
    out, at = [], 0
    for t in like:
        n = math.prod(t.shape)
        out.append(vector[at:at + n].reshape(t.shape).to(torch.float32).clone())
        at += n
    if at != vector.numel():
        raise ValueError(f"vector of {vector.numel()} values does not fit {at} parameters")
    return out


def _codes_mean(codes: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """The weighted mean hivemind's all-reduce returns for fp32 code buffers (integers: exact)."""
    total = sum(weights)
    return sum(w / total * c for w, c in zip(weights, codes))


def _compressor(method: Method, mode: str, shapes, dense: tuple, seed: int) -> DenseCompressor:
    return DenseCompressor(shapes, CompressionConfig(mode=mode, rank_max=method.rank_max, energy=method.rank_energy,
                                                seed=seed, error_feedback=method.error_feedback, dense=dense))


class Federation:
    """R replicas, one theta (``outer.global_params``) and one schedule per replica (module docstring).

    theta starts as ``replicas[0]``'s parameters (a caller may ``outer.load_state`` another before round 1: the
    synchronous rounds start every member from theta); ``inner_cfg`` is the replicas' (the dense codes' bounds read
    its learning rates and betas); ``inner_steps`` H; ``rounds`` the outer lr ramp's length; ``seed`` the dense codes';
    ``param_names`` the parameters' names (``Method.dense_embeddings``); ``peer_id`` a replica's id (sparse and
    plain rounds; the aggregates sort by it); ``aggregator`` (plain rounds): (vectors, weights) -> (flat aggregate,
    report), default dilocox/robust.py's ``aggregate`` with ``Method``'s rule and norm bound. Raises ValueError for
    an unknown overlap, proxy or merge (the schedule's)."""

    def __init__(self, method: Method, replicas: Sequence[Replica], inner_cfg: InnerConfig, inner_steps: int,
                 rounds: int, seed: int, param_names: Sequence[str] = (),
                 contributions: Optional[Contributions] = None, peer_id: Callable[[int], str] = "r{}".format,
                 aggregator: Optional[Callable[[dict, dict], tuple[torch.Tensor, dict]]] = None):
        self.method, self.replicas, self.inner_cfg, self.h = method, list(replicas), inner_cfg, inner_steps
        self.hooks, self.peer_id = contributions or Contributions(), peer_id
        self.aggregator = aggregator or (lambda vectors, weights: robust.aggregate(
            vectors, weights, method.aggregation, norm_bound=method.norm_bound))
        self.outer = OuterOptimizer(self.replicas[0].params, method.outer_lr, method.outer_momentum, method.nesterov,
                                    method.outer_lr_final, ramp_steps=rounds)
        self.schedules = [ExperimentalSchedule(self.outer, method.overlap, method.proxy, method.merge, method.mix)
                          for _ in self.replicas]
        self.shapes = [tuple(p.shape) for p in self.outer.global_params]
        self.numel = sum(math.prod(s) for s in self.shapes)
        self.step_bound = exact_mean.adam_step_bound(*inner_cfg.betas)
        self.tau = inner_steps if method.tau is None else min(method.tau, inner_steps)
        self.pending: Optional[Tensors] = None  # overlapped: the last round's mean, not applied yet
        self.group = 0
        dense = tuple(i for i, n in enumerate(param_names) if "embed" in n or "lm_head" in n) \
            if method.dense_embeddings else ()
        n = len(self.replicas)
        self.codecs = dict(main=[SharedIndexMember(self.numel, method.shared) if method.shared
                                 else SparseCodec(self.shapes, method.sparse) if method.codec == "sparse"
                                 else None if method.codec == "plain"
                                 else _compressor(method, method.codec, self.shapes, dense, seed) for _ in range(n)])
        if method.reducer_feedback:  # fixed chunk ranges: one buffer stands for every reducer's (shared_index.py)
            self.codecs["reducer"] = [ReducerFeedback(self.numel)]
        if method.warmup_rounds:
            self.codecs["warmup"] = [_compressor(method, "none", self.shapes, dense, seed) for _ in range(n)]
        if method.refresh_every:
            self.codecs["refresh"] = [_compressor(method, "int8", self.shapes, dense, seed) for _ in range(n)]
        for s in self.schedules:
            s.begin_round(self.replicas[0].params)

    def round(self, t: int, members: Optional[Sequence[int]] = None) -> Exchange:
        """Round ``t`` (1-based) of ``members`` (replica indices, ascending; default all): inner steps,
        pseudo-gradients, the exchange and the outer step (or, overlapped, the previous round's)."""
        members = list(range(len(self.replicas)) if members is None else members)
        m, h = self.method, self.h
        if m.overlap == "none":
            for i in members:  # from theta (a no-op for a member of the last round)
                self.schedules[i].rebase(self.replicas[i].params)
                self.schedules[i].begin_round(self.replicas[i].params)
            self._steps(members, t, 0, h)
        else:  # round t-1's mean lands tau inner steps into round t (tau = H: at its end, DiLoCoX)
            self._steps(members, t, 0, self.tau)
            if self.pending is not None:
                self.schedules[0].update_theta(self.pending, self.group, outer_step=t - 1)  # theta is shared
                for i in members:
                    self.schedules[i].merge(self.replicas[i].params)
                self.pending = None
            self._steps(members, t, self.tau, h)
        deltas = {i: self.schedules[i].pseudo_gradient(self.replicas[i].params) for i in members}
        out = self.exchange(t, deltas)
        if m.overlap == "none":
            self.schedules[0].update_theta(out.mean, len(members), outer_step=t)
            for i in members:
                s, p = self.schedules[i], self.replicas[i].params
                s.rebase(p)
                s.begin_round(p)
        else:
            self.pending, self.group = out.mean, len(members)
            for k, i in enumerate(members):
                s, p = self.schedules[i], self.replicas[i].params
                if m.proxy == "eager":  # each replica's schedule keeps its own eager state
                    s.last_mean, s.group_size = self.schedules[0].last_mean, len(members)
                s.start_from_proxy(p, out.own[k])
                s.begin_round(p)
        return out

    def finish(self, rounds: int) -> bool:
        """Overlapped: land the last round's mean (``rounds``: its outer step), as a node does before it leaves;
        False if nothing was pending."""
        if self.pending is None:
            return False
        self.schedules[0].update_theta(self.pending, self.group, outer_step=rounds)
        self.pending = None
        return True

    def _steps(self, members: list[int], t: int, first: int, end: int) -> None:
        for i in members:
            self.replicas[i].inner_steps(t, first, end)

    def exchange(self, t: int, deltas: Mapping[int, Tensors]) -> Exchange:
        """The group's aggregate of round ``t``'s contributions as every member computes it (steps 3-4 of the
        module docstring); ``deltas``: pseudo-gradients by replica index, ascending. Upload per member: (k - 1)
        x payload in an all-gather; (payload + result) x (k - 1) / k when the aggregate is re-sparsified (a
        reduce-scatter over chunk ranges); 2 x payload x (k - 1) / k per phase in hivemind's butterfly."""
        m, members, honest = self.method, list(deltas), list(deltas.values())
        weights = [float(self.h)] * len(members)
        main = [self.codecs["main"][i] for i in members]
        sent = [self.hooks.send(t, i, d, deltas) for i, d in deltas.items()]
        if m.shared:
            return self._shared_round(main, sent, weights, t)
        if m.codec == "sparse":
            return self._sparse_round(main, members, honest, sent, weights, t)
        if m.codec == "plain":
            vectors = {self.peer_id(i): flatten(d) for i, d in zip(members, sent)}
            flat, report = self.aggregator(vectors, {key: float(self.h) for key in vectors})
            k = len(members)
            return Exchange(unflatten(flat, self.outer.global_params), [list(d) for d in sent], 4 * self.numel,
                            4 * self.numel * (k - 1), vectors=vectors, flat=flat, report=report)
        lr_sum = sum(self.inner_cfg.lr_at((t - 1) * self.h + i) for i in range(self.h))
        bounds = [exact_mean.pseudo_gradient_bound(lr_sum, self.inner_cfg.weight_decay, float(p.abs().max()),
                                                   self.step_bound) for p in self.outer.global_params]
        if t <= m.warmup_rounds:
            return _compressed_round([self.codecs["warmup"][i] for i in members], sent, bounds, t, weights, 1)
        if m.refresh_every and t % m.refresh_every == 0:
            refresh = [self.codecs["refresh"][i] for i in members]
            flushed = [[d + e for d, e in zip(delta, c.error)] for delta, c in zip(sent, main)]
            for c in refresh:
                c.error = [torch.zeros_like(e) for e in c.error]
            out = _compressed_round(refresh, flushed, bounds, t, weights, 1)
            for c, r in zip(main, refresh):
                c.error = [e.clone() for e in r.error]
            return out
        return _compressed_round(main, sent, bounds, t, weights, m.power_iterations)

    def _sparse_round(self, codecs, members, honest, sent, weights, t) -> Exchange:
        m, shapes = self.method, self.shapes
        if m.proxy_source == "ef":  # the error-feedback-corrected pseudo-gradient: beta e + delta
            own = [[m.sparse.beta * e + d for e, d in zip(c.error, delta)] for c, delta in zip(codecs, honest)]
        payloads = {}
        for i, c, send in zip(members, codecs, sent):
            payload, new_error = c.prepare(send)
            self.hooks.encoded(t, i, payload, send)
            c.commit(new_error)
            payloads[self.peer_id(i)] = payload
        mean, dropped = aggregate(payloads, {p: w for p, w in zip(payloads, weights)}, shapes, m.sparse,
                                  rule=m.aggregation, norm_bound=m.norm_bound)
        k, size = len(payloads), len(next(iter(payloads.values())))
        upload = (k - 1) * size
        if m.resparsify:  # every member applies the cut aggregate; what it dropped goes back to its owners
            result = reencode(mean, m.sparse, m.resparsify, m.resparsify_bits)
            for p, c in zip(payloads, codecs):
                c.restore(residual(decode(payloads[p], shapes, m.sparse), mean, result), m.restore_whole)
            mean = result.applied
            upload = (size + len(result.payload)) * (k - 1) / k
        if m.proxy_source == "code":  # our contribution as the group decodes it
            own = [decode(payloads[p], shapes, m.sparse) for p in payloads]
        elif m.proxy_source == "raw":
            own = [list(d) for d in honest]
        return Exchange(mean, own, size, upload, dropped)

    def _shared_round(self, members, deltas, weights, t) -> Exchange:
        """One index set per round (dilocox/shared_index.py). One member's payload: its values plus the index
        set (what a receiver needs to place them). Upload per member (mean): (values + result range + index set)
        x (k - 1) / k, a reduce-scatter of the values over chunk ranges, an all-gather of the ranges' results,
        and the index set: the leader's relayed so that each member forwards it about once, or each member's
        proposal to the others (union)."""
        method, shapes = self.method, self.shapes
        feedback = self.codecs.get("reducer", [None])[0]
        cfg, k = method.shared, len(members)
        ms = [mem.accumulate(d) for mem, d in zip(members, deltas)]
        n = ms[0].numel()
        if cfg.selection == Selection.UNION and method.reducer_proposes:  # member r reduces range r (chunk_ranges)
            views = [m.clone() for m in ms]
            for r, v in enumerate(views):
                a, b = value_range(n, cfg.chunk, k, r)
                v[a:b] += torch.from_numpy(feedback.error[a:b])
            positions, index = union_positions(views, cfg)
        elif cfg.selection == Selection.UNION:
            positions, index = union_positions(ms, cfg)
        else:
            positions = (leader_positions(ms[leader_rank(t, k)], cfg) if cfg.selection == Selection.LEADER
                         else random_positions(n, cfg, 0, t))
            index = index_bytes(positions, n, cfg)
        sent = [mem.contribute(m, positions) for mem, m in zip(members, ms)]
        if feedback is None:
            red = reduce(sent, weights, positions, n, cfg, method.aggregation, method.norm_bound)
            for mem in members:
                mem.restore(positions, red.residual)
        else:  # as the transport would: each range by its reducer, who keeps what its result dropped
            red = reduce_by_range(sent, weights, positions, n, cfg, method.aggregation, method.norm_bound, feedback)

        def dense(values) -> Tensors:
            flat = torch.zeros(n)
            flat[torch.from_numpy(positions)] = torch.from_numpy(values)
            return [t_.view(s) for t_, s in zip(torch.split(flat, [math.prod(s) for s in shapes]), shapes)]

        own = [dense(v) if method.proxy_source == "code" else list(d) for v, d in zip(sent, deltas)]
        values = values_bytes(positions, n, cfg)
        return Exchange(dense(red.applied), own, values + index, (values + red.result_bytes + index) * (k - 1) / k)


def _compressed_round(codecs, deltas, bounds, t, weights, power_iterations) -> Exchange:
    """The Compressor round protocol, with the mean of the codes hivemind's all-reduce would return; own
    contributions for the delayed start proxy are the raw pseudo-gradients, as in the daemon."""
    for it in range(power_iterations):
        rounds = [c.begin(d, bounds, t) for c, d in zip(codecs, deltas)]
        for _ in range(rounds[0].num_phases):
            out = [r.phase_payload() for r in rounds]
            mean = _codes_mean([codes for codes, _ in out], weights)
            for r in rounds:
                r.phase_done(mean, [stats for _, stats in out], weights)
        if it < power_iterations - 1:
            for r, c in zip(rounds, codecs):
                c.refine(r)
    # the daemon's proxy stand-in for a Compressor round (daemon/rounds.py): the raw pseudo-gradient
    averaged, own = rounds[0].result(), [list(d) for d in deltas]
    for r, c in zip(rounds, codecs):
        r.decide_rank(0.0, 0.0, len(rounds))
        c.commit(r)
    payload = rounds[0].stats.payload_bytes * power_iterations
    return Exchange(averaged, own, payload, 2 * payload * (len(rounds) - 1) / len(rounds))
