"""Linear layers whose kernel is picked by measurement on this machine, per (layer shape,
row-count bucket).

Activations (``act_dtype``) are fp32, or bf16 for a bf16 model on a CPU with a native
bf16 GEMM (what vLLM and transformers run there; the loader decides). The output layer
(``lm_head``) returns fp32 logits where its path can. Candidates (:class:`LinearPath`):

* ``packed``: :func:`pagedattn.ops.packed_linear`, the weight in the model dtype widened to
  fp32 in registers, fp32 activations (bf16 ones are widened first). Any ISA; streams the
  weight at memory speed (decode rows).
* ``dpbf16``: :func:`pagedattn.ops.packed_linear_dpbf16`, bf16 activations and weights on
  ``vdpbf16ps``. bf16 weights and the ``avx512bf16`` kernels only.
* ``amx``: :func:`pagedattn.ops.packed_linear_amx`, the same operands and packed weight on
  AMX tiles (a CPU with AMX-BF16): batches of rows, where ``dpbf16``'s vector dot products
  run out of registers and oneDNN's per-call set-up is a large part of a small GEMM.
* ``torch``: ``F.linear`` in the weight dtype: bf16/fp16 activations into oneDNN's GEMM
  (AMX or ``vdpbf16ps`` where torch has a native half GEMM), or fp32 into MKL.
* ``onednn``: the same GEMM on a weight reordered once, at load, into oneDNN's blocked
  layout (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, what
  Inductor's CPU weight prepacking uses): ``F.linear`` reorders the weight on every call.

An fp32 model only gets fp32 candidates: its activations are never rounded to bf16.
oneDNN's bf16 GEMM writes bf16, so an ``lm_head`` on ``onednn``/``torch`` with bf16
activations gives bf16-rounded logits (as vLLM's bf16 models do); ``dpbf16`` writes fp32.

:func:`install_linear_paths` replaces a model's ``nn.Linear`` layers by
:class:`MeasuredLinear` modules, times every candidate per distinct (in_features,
out_features, weight dtype) at one row count per bucket (:data:`ROW_BUCKETS`), and keeps the
fastest per bucket (a near tie goes to the layer's most chosen path: :data:`NEAR_TIE`).
Choices are cached in ``$XDG_CACHE_HOME/pagedattn/linear-paths.json`` (default
``~/.cache``) under a key of CPU model, CPU flags, threads, torch version, the kernels' ISA
and the extension's build; a file with another key, or one that cannot be read, is
ignored and rewritten.
Choices measured while other processes load the cores are used but not cached.
``PAGEDATTN_LINEAR_PATH=<path>`` (or ``force=``) skips the measurement and uses one path.
"""

from __future__ import annotations

import collections
import enum
import itertools
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedattn import ops, tuning
from pagedattn.ops import onednn
from pagedattn.models.layers import fusable, replace_linear_layers

FORCE_ENV = "PAGEDATTN_LINEAR_PATH"

GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": ops.silu_and_mul, "gelu_tanh": ops.gelu_tanh_and_mul}
"""A gated MLP's activations by name (:func:`pagedattn.models.layers.gate_up_linear`), and
the native op that applies each to an unfused gate/up projection's output."""


class LinearPath(str, enum.Enum):
    PACKED = "packed"
    DPBF16 = "dpbf16"
    AMX = "amx"
    TORCH = "torch"
    ONEDNN = "onednn"

    @classmethod
    def parse(cls, name: str | LinearPath) -> LinearPath:
        try:
            return cls(name)
        except ValueError:
            valid = ", ".join(p.value for p in cls)
            raise ValueError(f"linear path must be one of {valid}, got {name!r}") from None


@dataclass(frozen=True)
class RowBucket:
    """Row counts ``lo..hi`` (``hi`` None: unbounded), timed at ``probe`` rows."""

    lo: int
    hi: int | None
    probe: int

    @property
    def label(self) -> str:
        if self.hi is None:
            return f"{self.lo}+"
        return str(self.lo) if self.lo == self.hi else f"{self.lo}-{self.hi}"


# Fixed edges; the path per bucket is measured. Probes: the geometric middle of the bucket
# (decode batches of 32 fall in 17-64); the open bucket at 512 rows, or at a full prefill
# chunk where that costs little (OPEN_BUCKET_CHUNK).
ROW_BUCKETS = (RowBucket(1, 1, 1), RowBucket(2, 4, 3), RowBucket(5, 16, 9),
               RowBucket(17, 64, 33), RowBucket(65, 256, 129), RowBucket(257, None, 512))
_DIRECT_ROWS = ROW_BUCKETS[-1].lo  # row counts below this index a list; the rest the last bucket

OPEN_BUCKET_CHUNK = 2048
"""The open bucket's rows are mostly prefill chunks of the engine's token budget (2048 by
default), and the paths' order can differ there from 512 rows (Gemma 3's qkv projection:
amx and onednn within 5% at 512 rows, onednn 15% ahead at 2048). So the open bucket is
timed at this many rows wherever the 65-256 bucket's best time, scaled up, says a call
takes under OPEN_BUCKET_CHUNK_MAX_S; else (a large output head) at its 512-row probe."""
OPEN_BUCKET_CHUNK_MAX_S = 0.03


def _bucket_index(rows: int) -> int:
    """The bucket of ``rows`` (the last one is unbounded: every count has one)."""
    return next(i for i, b in enumerate(ROW_BUCKETS) if b.hi is None or rows <= b.hi)


_BUCKET_OF_ROWS = [_bucket_index(max(m, 1)) for m in range(_DIRECT_ROWS)]


def row_bucket(rows: int) -> int:
    """The index in :data:`ROW_BUCKETS` of the bucket whose path a call of ``rows`` rows
    runs (no row counts as one)."""
    return _BUCKET_OF_ROWS[rows] if rows < _DIRECT_ROWS else len(ROW_BUCKETS) - 1


_choices_generation = 0


def choices_generation() -> int:
    """A count that changes whenever any :class:`MeasuredLinear` changes its paths or drops
    a weight form, so that what was resolved from them can tell it is stale."""
    return _choices_generation


def _choices_changed() -> None:
    global _choices_generation
    _choices_generation += 1


# ------------------------------------------------------------------ availability


torch_half_gemm = onednn.native_half_gemm


def unavailable_reasons(path: LinearPath, weight_dtype: torch.dtype) -> list[str]:
    """Why ``path`` cannot run layers with ``weight_dtype`` weights here (empty: it can)."""
    reasons = []
    if path in (LinearPath.PACKED, LinearPath.DPBF16, LinearPath.AMX) \
            and not ops.native_available():
        reasons.append("needs the native extension pagedattn._C")
    if path is LinearPath.DPBF16:
        if weight_dtype != torch.bfloat16:
            reasons.append(f"takes bfloat16 weights only, got {weight_dtype}")
        if ops.native_available() and not ops.dpbf16_linear_available():
            reasons.append(f"needs the avx512bf16 kernels, in use: {ops.get_cpu_isa().value}")
    if path is LinearPath.AMX:
        if weight_dtype != torch.bfloat16:
            reasons.append(f"takes bfloat16 weights only, got {weight_dtype}")
        if ops.native_available() and not ops.amx_linear_available():
            reasons.append("needs AMX-BF16 tiles (this CPU or kernel has none)")
    if path in (LinearPath.TORCH, LinearPath.ONEDNN) and weight_dtype != torch.float32 \
            and not torch_half_gemm(weight_dtype):
        reasons.append(f"torch has no native {weight_dtype} GEMM on this CPU (emulated, slow)")
    elif path is LinearPath.ONEDNN and weight_dtype in ops.PACKED_LINEAR_DTYPES:
        error = onednn.linear_error(weight_dtype)
        if error:
            reasons.append(error)
    if weight_dtype not in ops.PACKED_LINEAR_DTYPES:
        reasons.append(f"weights must be one of {ops.PACKED_LINEAR_DTYPES}, got {weight_dtype}")
    return reasons


def candidate_paths(weight_dtype: torch.dtype) -> list[LinearPath]:
    return [p for p in LinearPath if not unavailable_reasons(p, weight_dtype)]


def forced_path(force: str | LinearPath | None = None) -> LinearPath | None:
    """``force``, else ``$PAGEDATTN_LINEAR_PATH``, parsed; None when neither is set."""
    name = force if force is not None else os.environ.get(FORCE_ENV) or None
    return None if name is None else LinearPath.parse(name)


# ------------------------------------------------------------------ the layer


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


class MeasuredLinear(nn.Module):
    """A linear layer that runs, per row count, the path chosen for its bucket
    (:meth:`set_choices`). It takes ``act_dtype`` activations (others are cast) and returns
    ``out_dtype`` (default ``act_dtype``). It holds the weight in the form each of its
    paths needs (``packed_weight`` / ``dp_weight``, which ``dpbf16`` and ``amx`` share /
    ``weight``) and drops the unused ones
    once the choices are set. Bias: float32, added in fp32."""

    def __init__(self, linear: nn.Linear, weight_dtype: torch.dtype,
                 paths: list[LinearPath], act_dtype: torch.dtype = torch.float32,
                 out_dtype: torch.dtype | None = None,
                 gated_activation: str | None = None) -> None:
        super().__init__()
        if gated_activation is not None and gated_activation not in GATED_ACTIVATIONS:
            raise ValueError(f"gated_activation must be one of {sorted(GATED_ACTIVATIONS)} "
                             f"or None, got {gated_activation!r}")
        self.gated_activation = gated_activation
        if act_dtype not in (torch.float32, torch.bfloat16) or (
                act_dtype == torch.bfloat16 and weight_dtype != torch.bfloat16):
            raise ValueError(f"act_dtype must be float32, or bfloat16 with bfloat16 weights; "
                             f"got act_dtype={act_dtype}, weight_dtype={weight_dtype}")
        self.act_dtype = act_dtype
        self.out_dtype = out_dtype or act_dtype
        if not paths:
            raise ValueError(f"no linear path runs {weight_dtype} weights here: " + "; ".join(
                f"{p.value}: {', '.join(unavailable_reasons(p, weight_dtype))}" for p in LinearPath))
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_dtype = weight_dtype
        w = linear.weight.detach()
        self.register_buffer("packed_weight", ops.pack_linear_weight(w, weight_dtype)
                             if LinearPath.PACKED in paths else None)
        self.register_buffer("dp_weight", ops.pack_linear_weight_dpbf16(w)
                             if {LinearPath.DPBF16, LinearPath.AMX} & set(paths) else None)
        self.register_buffer("weight", w.to(weight_dtype).contiguous()
                             if LinearPath.TORCH in paths else None)
        # An opaque oneDNN tensor: a plain attribute, not a buffer (state_dict, .to() and
        # deepcopy do not take it).
        self.onednn_weight = (onednn.pack_weight(w.to(weight_dtype))
                              if LinearPath.ONEDNN in paths else None)
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.register_buffer("bias", bias)
        self.paths = list(paths)
        self.set_choices([self.paths[0]] * len(ROW_BUCKETS))

    @property
    def shape_key(self) -> str:
        key = f"{self.in_features}x{self.out_features}:{_dtype_name(self.weight_dtype)}"
        if (self.act_dtype, self.out_dtype) != (torch.float32, torch.float32):
            key += f":{_dtype_name(self.act_dtype)}->{_dtype_name(self.out_dtype)}"
        if self.gated_activation is not None:
            key += f":{self.gated_activation}-gated"
        return key

    def runner(self, path: LinearPath) -> Callable[[torch.Tensor], torch.Tensor]:
        return {LinearPath.PACKED: self._packed, LinearPath.DPBF16: self._dpbf16,
                LinearPath.AMX: self._amx, LinearPath.TORCH: self._torch,
                LinearPath.ONEDNN: self._onednn}[path]

    def set_choices(self, choices: list[LinearPath]) -> None:
        """One path per :data:`ROW_BUCKETS` entry; weights no chosen path reads are freed."""
        if len(choices) != len(ROW_BUCKETS) or not set(choices) <= set(self.paths):
            raise ValueError(f"expected one of {[p.value for p in self.paths]} for each of "
                             f"{len(ROW_BUCKETS)} row buckets, got {[c.value for c in choices]}")
        _choices_changed()
        self.choices = list(choices)
        by_bucket = [self.runner(p) for p in choices]
        # forward indexes this by row count: one list lookup per call, no search
        self._by_rows = [by_bucket[b] for b in _BUCKET_OF_ROWS]
        self._big = by_bucket[-1]

    def path_for(self, rows: int) -> LinearPath:
        """The path that :meth:`forward` runs for ``rows`` rows."""
        return self.choices[row_bucket(rows)]

    def weight_for(self, path: LinearPath) -> torch.Tensor:
        """The weight, in the form ``path`` reads (only the chosen paths' are kept)."""
        return {LinearPath.PACKED: self.packed_weight, LinearPath.DPBF16: self.dp_weight,
                LinearPath.AMX: self.dp_weight, LinearPath.TORCH: self.weight,
                LinearPath.ONEDNN: self.onednn_weight}[path]

    def release_unused(self) -> None:
        _choices_changed()
        used = set(self.choices)
        self.paths = [p for p in self.paths if p in used]
        for paths, name in (({LinearPath.PACKED}, "packed_weight"),
                            ({LinearPath.DPBF16, LinearPath.AMX}, "dp_weight"),
                            ({LinearPath.TORCH}, "weight"), ({LinearPath.ONEDNN}, "onednn_weight")):
            if not paths & used:
                setattr(self, name, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.forward(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        if x.dtype != self.act_dtype:
            x = x.to(self.act_dtype)
        return self._runner_for(x.shape[0])(x)

    def _runner_for(self, rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return self._by_rows[rows] if rows < _DIRECT_ROWS else self._big

    def gated(self, x: torch.Tensor, activation: str,
              act_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``act(gate) * up`` of this gate/up projection (see
        :func:`pagedattn.models.layers.gated_projection`): in one kernel when these rows
        run on the packed or the amx path, else the chosen path, then ``act_and_mul``."""
        return self._gated_run(self._runner_for(x.shape[0]), x, activation, act_and_mul)

    def timed_runner(self, path: LinearPath) -> Callable[[torch.Tensor], torch.Tensor]:
        """What the engine runs on ``path``: with the activation, for a gate/up projection."""
        return self.gated_runner(path) if self.gated_activation else self.runner(path)

    def gated_runner(self, path: LinearPath) -> Callable[[torch.Tensor], torch.Tensor]:
        """What :meth:`gated` runs on ``path`` for this layer's ``gated_activation`` (the
        activation by its native op where not fused): the linear paths' measurement."""
        act = self.gated_activation
        act_and_mul = GATED_ACTIVATIONS[act]
        runner = self.runner(path)
        return lambda x: self._gated_run(runner, x, act, act_and_mul)

    def _gated_run(self, runner: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                   activation: str, act_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if runner not in (self._packed, self._amx) or not fusable(x, self.out_features):
            if x.dim() != 2:
                return act_and_mul(self.forward(x))
            return act_and_mul(runner(x.to(self.act_dtype)))
        if runner == self._amx:
            return ops.packed_gated_linear_amx(x.to(self.act_dtype), self.dp_weight, self.bias,
                                               self.out_features, activation, self.out_dtype)
        out = ops.packed_gated_linear(x.float(), self.packed_weight, self.bias,
                                      self.out_features, activation)
        return out.to(self.out_dtype)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        out = ops.packed_linear(x.float(), self.packed_weight, self.bias, self.out_features)
        return out.to(self.out_dtype)  # no-ops for fp32

    def _dpbf16(self, x: torch.Tensor) -> torch.Tensor:
        return ops.packed_linear_dpbf16(x, self.dp_weight, self.bias, self.out_features,
                                        self.out_dtype)

    def _amx(self, x: torch.Tensor) -> torch.Tensor:
        return ops.packed_linear_amx(x, self.dp_weight, self.bias, self.out_features,
                                     self.out_dtype)

    def _half_gemm_out(self, out: torch.Tensor) -> torch.Tensor:
        """A half-precision GEMM's output, with the fp32 bias, in ``out_dtype``."""
        if self.bias is None:
            return out.to(self.out_dtype)
        return out.float().add_(self.bias).to(self.out_dtype)

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.float32:
            return F.linear(x, self.weight, self.bias)
        return self._half_gemm_out(F.linear(x.to(self.weight.dtype), self.weight))

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        w = self.onednn_weight
        out = onednn.linear(x.to(w.dtype), w)
        if w.dtype == torch.float32:
            return out if self.bias is None else out.add_(self.bias)
        return self._half_gemm_out(out)

    def extra_repr(self) -> str:
        chosen = ", ".join(f"{b.label}:{p.value}" for b, p in zip(ROW_BUCKETS, self.choices))
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weight_dtype={self.weight_dtype}, act_dtype={self.act_dtype}, "
                f"out_dtype={self.out_dtype}, bias={self.bias is not None}, rows=[{chosen}]")


# ------------------------------------------------------------------ the cache

CACHE_KIND = "linear-paths"
"""Their kind in the tuning home (:mod:`pagedattn.tuning`: machine key, file, busy gate)."""
machine_key = tuning.machine_key


def cache_path() -> Path:
    return tuning.cache_path(CACHE_KIND)


# ------------------------------------------------------------------ measurement


@dataclass
class BucketChoice:
    """The path of one (shape, bucket) and where it came from: ``measured`` now, ``cached``,
    ``forced``, or ``unmeasured`` (the tuning time cap ran out: a measured neighbour's)."""

    rows: str
    path: str
    source: str
    times_us: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        times = ", ".join(f"{p} {t:.0f} us" for p, t in sorted(self.times_us.items(),
                                                               key=lambda kv: kv[1]))
        return f"rows {self.rows:>7}: {self.path:<6} [{self.source}{': ' + times if times else ''}]"


@dataclass
class LinearPlan:
    """Every shape's choices, for ``--verbose`` and the benchmarks."""

    shapes: dict[str, list[BucketChoice]]
    seconds: float = 0.0
    cache_file: str | None = None
    cache_error: str | None = None

    def lines(self) -> list[str]:
        out = [f"linear paths ({self.seconds:.1f} s; cache {self.cache_file or 'unused'}"
               + (f", not written: {self.cache_error}" if self.cache_error else "") + ")"]
        for shape, buckets in self.shapes.items():
            out.append(f"  {shape}")
            out.extend(f"    {b.line()}" for b in buckets)
        return out

    def to_json(self) -> dict:
        return {"seconds": self.seconds, "cache_file": self.cache_file,
                "shapes": {s: [asdict(b) for b in bs] for s, bs in self.shapes.items()}}


def time_paths(layers: Sequence[MeasuredLinear], rows: int, deadline: float,
               min_rounds: int = 5, max_rounds: int = 50,
               budget_s: float = 0.03) -> dict[str, float]:
    """Best time (us) of each path of ``layers`` (same shape and paths) on ``rows`` random
    rows: ``min_rounds`` rounds, then more (up to ``max_rounds``) while the rounds have
    used under ``budget_s`` (:func:`tuning.best_of`: paths in turns, those over twice the
    leader's time dropped from the second round on, so that close paths get the rounds).
    Each path's calls cycle through ``layers``, so, as in a forward pass, a call seldom
    finds its weights in the core's own cache. A gated MLP's gate/up projection is timed as it runs: with its
    activation, fused where the path fuses it. Each timed call follows an untimed one of
    the same path (``warm_each``): the native kernels' pool sleeps 50 us after its last
    loop, and a step's loops follow each other closer than that."""
    # own generator: tuning must not move the global RNG that seeded sampling draws from
    x = torch.randn(rows, layers[0].in_features,
                    generator=torch.Generator().manual_seed(rows)).to(layers[0].act_dtype)

    def runs_through_layers(path: LinearPath) -> Callable[[], torch.Tensor]:
        calls = itertools.count()
        runners = [layer.timed_runner(path) for layer in layers]
        return lambda: runners[next(calls) % len(runners)](x)

    return tuning.best_of({p.value: runs_through_layers(p) for p in layers[0].paths},
                          deadline=deadline, min_rounds=min_rounds, max_rounds=max_rounds,
                          budget_s=budget_s, warm_each=True)


NEAR_TIE = 1.05
"""A bucket whose fastest path is less than this factor ahead of the layer's most chosen
path takes that path. One probe's best-of rounds differ by more than that between
processes on a large layer (Gemma 3's output head at 33 rows: either path 18 or 25 ms, by
whether its 34 MB output is page-faulted afresh), and a path fewer is a weight copy fewer."""


def _prefer_common_path(choices: list[BucketChoice]) -> None:
    counts = collections.Counter(c.path for c in choices)
    common = counts.most_common(1)[0][0]
    for c in choices:
        if c.path != common and c.times_us[common] <= NEAR_TIE * c.times_us[c.path]:
            c.path = common


def _touch_every_layer(layers: Sequence[MeasuredLinear]) -> None:
    """One call per path and layer: time_paths cycles through the layers, and a layer's
    first call on a path costs up to twice its later ones (a 640x1536 bf16 layer at one
    row, on the AMX host: 105-346 us against 54-123), which would be timed."""
    x = torch.zeros(1, layers[0].in_features, dtype=layers[0].act_dtype)
    for layer in layers:
        for path in layer.paths:
            layer.timed_runner(path)(x)


def _measure_shape(layers: list[MeasuredLinear], deadline: float) -> list[BucketChoice]:
    _touch_every_layer(layers)
    choices: list[BucketChoice | None] = []
    for bucket in ROW_BUCKETS:
        if time.perf_counter() >= deadline:
            choices.append(None)
            continue
        rows = bucket.probe
        if bucket.hi is None and choices and choices[-1] is not None:
            before = min(choices[-1].times_us.values()) * 1e-6 / ROW_BUCKETS[-2].probe
            if before * OPEN_BUCKET_CHUNK <= OPEN_BUCKET_CHUNK_MAX_S:
                rows = OPEN_BUCKET_CHUNK
        times = time_paths(layers, rows, deadline)
        choices.append(BucketChoice(bucket.label, min(times, key=times.get), "measured", times))
    measured = [c for c in choices if c is not None]
    if measured:
        _prefer_common_path(measured)
    fallback = measured[-1].path if measured else layers[0].paths[0].value
    return [c if c is not None else BucketChoice(b.label, fallback, "unmeasured")
            for b, c in zip(ROW_BUCKETS, choices)]


def _valid_cached(entry, paths: list[LinearPath]) -> list[BucketChoice] | None:
    names = {p.value for p in paths}
    try:
        got = [BucketChoice(**{**e, "source": "cached"}) for e in entry]
    except TypeError:
        return None
    # measured among exactly today's candidates: a path added since (or one gone) re-measures
    if [c.rows for c in got] != [b.label for b in ROW_BUCKETS] or any(
            c.path not in names or set(c.times_us) != names for c in got):
        return None
    return got


def plan_layers(layers: list[MeasuredLinear], force: str | LinearPath | None = None,
                budget_s: float = 10.0, cache: bool = True,
                busy: str | None | bool = True) -> LinearPlan:
    """Choose each layer's path per bucket (forced, cached, or measured within ``budget_s``
    seconds in all) and apply the choices; returns what was chosen and why. ``busy``: the
    reason fresh measurements are not cached, ``True`` to ask :func:`tuning.machine_busy`,
    ``None``/``False``: cache them."""
    start = time.perf_counter()
    busy = tuning.machine_busy() if busy is True else (busy or None)
    groups: dict[str, list[MeasuredLinear]] = {}
    for layer in layers:
        groups.setdefault(layer.shape_key, []).append(layer)
    forced = forced_path(force)
    key = machine_key()
    cached = tuning.load(CACHE_KIND, key) if cache and forced is None else {}
    plan = LinearPlan({})
    deadline = start + budget_s
    for shape, members in groups.items():
        first = members[0]
        if forced is not None:
            if forced not in first.paths:
                raise ValueError(f"linear path {forced.value!r} cannot run {shape}: "
                                 + "; ".join(unavailable_reasons(forced, first.weight_dtype)))
            choices = [BucketChoice(b.label, forced.value, "forced") for b in ROW_BUCKETS]
        else:
            choices = _valid_cached(cached.get(shape), first.paths) if shape in cached else None
            choices = choices or _measure_shape(members, deadline)
        plan.shapes[shape] = choices
        for layer in members:
            layer.set_choices([LinearPath(c.path) for c in choices])
            layer.release_unused()
    if forced is None and cache and any(c.source == "measured" for cs in plan.shapes.values() for c in cs):
        keep = {s: [asdict(c) for c in cs] for s, cs in plan.shapes.items()
                if all(c.source in ("measured", "cached") for c in cs)}
        plan.cache_error = (f"measured while busy ({busy})" if busy
                            else tuning.save(CACHE_KIND, key, {**cached, **keep}))
    plan.cache_file = str(cache_path()) if cache and forced is None else None
    plan.seconds = time.perf_counter() - start
    return plan


def describe_here() -> list[str]:
    """``pagedattn info``'s lines: each weight dtype's candidates (or why a path is out),
    and the cached choices when the cache's key is this machine's."""
    lines = []
    for dtype in ops.PACKED_LINEAR_DTYPES:
        parts = []
        for path in LinearPath:
            reasons = unavailable_reasons(path, dtype)
            parts.append(path.value if not reasons else f"({path.value}: {'; '.join(reasons)})")
        lines.append(f"  {str(dtype).split('.')[-1]:<9} {', '.join(parts)}")
    key, path = machine_key(), cache_path()
    shapes = tuning.load(CACHE_KIND, key)
    if shapes:
        lines.append(f"  cached choices ({path}):")
        for shape, entries in shapes.items():
            chosen = ", ".join(f"{e.get('rows')}:{e.get('path')}" for e in entries)
            lines.append(f"    {shape:<20} {chosen}")
    else:
        state = "none for this key" if path.exists() else "none"
        lines.append(f"  cached choices: {state} ({path}; measured when a model loads)")
    return lines


def install_linear_paths(model: nn.Module, weight_dtype: torch.dtype,
                         force: str | LinearPath | None = None, budget_s: float = 10.0,
                         cache: bool = True, busy: str | None | bool = True,
                         act_dtype: torch.dtype = torch.float32) -> LinearPlan:
    """Replace every ``nn.Linear`` of ``model`` (in place) by a :class:`MeasuredLinear` with
    ``weight_dtype`` weights and ``act_dtype`` activations (the model's ``lm_head``, if
    any, returns fp32 logits), then plan their paths (:func:`plan_layers`). Call after
    loading the weights and casting the model to fp32."""
    paths = candidate_paths(weight_dtype)
    lm_head = getattr(model, "lm_head", None)

    def make(linear: nn.Linear) -> MeasuredLinear:
        out = torch.float32 if linear is lm_head else act_dtype
        return MeasuredLinear(linear, weight_dtype, paths, act_dtype, out,
                              getattr(linear, "gated_activation", None))

    layers = replace_linear_layers(model, make)
    with torch.inference_mode():
        return plan_layers(layers, force, budget_s, cache, busy)
