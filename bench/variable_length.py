"""Variable-length traffic: bare ``torch.compile`` against ``safe_compile`` buckets, one run.

Two models under ``torch.no_grad()``, each fed the same few hundred requests whose
sequence length follows a log-normal mix between 1 and 512 (fixed seed):

- a transformer block (``nn.TransformerEncoderLayer`` d_model=256, 8 heads, batch_first),
  called as ``block(x, mask)`` with ``x`` of ``batch x L x 256`` and a key-padding ``mask``
  of ``batch x L`` (each row of a request has its own length <= L);
- an MLP applied per token (256 -> 1024 -> GELU -> 256) on ``batch x L x 256``.

Variants, side by side in one process:

- ``eager``;
- ``compile default``: ``torch.compile(dynamic=None)`` (automatic dynamic shapes);
- ``compile dynamic=False``: one static graph per length until torch's recompile limit
  (8), then every new length runs eager *silently*;
- ``safe pad pow2`` / ``safe pad steps``: ``safe_compile`` with padded static buckets
  (``Buckets(strategy="pad")``), blocking ``Warmup`` compiling every bucket first;
- ``safe dynamic``: ``safe_compile`` with ``Buckets(strategy="dynamic")``: one bounded
  dynamic graph per range, no padded work, blocking ``Warmup``.

Shadow checks are off in the ``safe_compile`` variants (``shadow=None``; their cost is
``bench/shadow.py``'s subject); a padded bucket's padding is still verified against
unpadded eager once, during warmup. Every variant is its own copy of the model with a
``forward`` of its own code object, so dynamo's per-code caches and recompile limit are
per variant. The bare variants compile the module's bound ``forward`` (as safe_compile
does), not ``Module.__call__``.

Phases:

1. *cold pass*: each variant in turn serves every request once, from nothing compiled
   (warmup first for the safe_compile variants). Gives graphs, compile time (dynamo's
   ``_compile.compile_inner``, warmup included), first-request latency, and p50/p99 with
   compile stalls included. For the safe_compile variants, a separate copy without warmup
   serves one request, for the first-request latency without warmup.
2. *steady pass*: the same requests again with everything compiled, the variants
   interleaved request by request in a rotating order so machine noise hits them alike:
   steady p50/p99 and throughput (requests/s, tokens/s; ratio to ``compile default``).

"Silent eager": calls that ran eager without the caller being told. For
``dynamic=False`` a call is compiled only if its length got its own graph, so every call
on a length that never got one ran eager past the limit (counted per call); the
``torch._dynamo`` "hit config.recompile_limit" warnings are counted too. safe_compile's
eager calls are visible (``stats().eager_calls``, ``recompile_limit_calls``, events), so
they are reported apart.

Inductor's FX-graph and AOTAutograd caches are off and the cache dir is a fresh temporary
one, so each variant pays its own compiles (kernels with identical source may still share
a built ``.so``); inductor's one-time process start-up cost is paid on a throwaway function
first and printed apart.

    python bench/variable_length.py                          # inductor (~5-8 min here)
    python bench/variable_length.py --backend aot_eager      # no inductor (~6 min)
    python bench/variable_length.py --requests 100 --models mlp
    python bench/variable_length.py --backend aot_eager --requests 20 --models mlp --rounds 1
                                                             # smoke run (~20 s)

The ``random-mlp`` and ``random-block`` models (not in the default ``--models``) are the
shadow-check case of issue #8 instead: a small module (d=64: an MLP over the last dim, or
a ``TransformerEncoderLayer`` with 4 heads) served ``--calls`` inputs of random
``(batch, seq)`` (1..8 x 1..64), no buckets, comparing plain ``torch.compile(model)``
with ``safe_compile(copy)`` at its defaults (shadow checks on, ``Shadow()``) and with
``shadow=None``, plus eager; interleaved call by call, two passes over the same inputs
(the first compiles). Prints throughput ratios against ``torch.compile``, torch's graph
count, ``stats().graphs``, ``stats().shadow_checks`` and ``len(json.dumps(report()))``.

    python bench/variable_length.py --models random-mlp,random-block  # inductor
    python bench/variable_length.py --models random-mlp --backend aot_eager --calls 200
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import random
import statistics
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Before torch is imported: every variant pays its own compiles (see the docstring).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="vl-inductor-"))
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from _models import D_MODEL, Block  # noqa: E402  (bench/ is on sys.path as a script)
from torch import nn  # noqa: E402

from safecompile import Buckets, Warmup, pow2, safe_compile, steps  # noqa: E402

MAX_LEN = 512
DEFAULT = "compile default"
STATIC = "compile dynamic=False"
CONTROL = "eager (A/A control)"


# ---------------------------------------------------------------- models


class TokenMLP(nn.Module):
    """An MLP applied to every token."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def own_copy(model: nn.Module, tag: str) -> nn.Module:
    """A copy of ``model`` whose class's ``forward`` has a code object of its own.

    dynamo caches compiled code, and counts recompiles, per code object: variants sharing
    one ``forward`` would share a cache entry and one recompile limit.
    """
    cls = type(model)
    fwd = cls.forward
    name = f"forward_{tag}"
    code = fwd.__code__.replace(co_name=name, co_qualname=f"{cls.__qualname__}_{tag}.{name}")
    new_forward = types.FunctionType(code, fwd.__globals__, name, fwd.__defaults__)
    clone = copy.deepcopy(model)
    clone.__class__ = type(f"{cls.__name__}_{tag}", (cls,), {"forward": new_forward})
    return clone


# ---------------------------------------------------------------- traffic


@dataclass(frozen=True)
class Request:
    length: int
    args: tuple[torch.Tensor, ...]

    @property
    def tokens(self) -> int:
        return int(self.args[0].shape[0]) * self.length


def lengths(n: int, seed: int) -> list[int]:
    """Log-normal lengths (median 48, sigma 1.1) clipped to 1..512: many short requests,
    a long tail. 300 draws give ~140 distinct lengths."""
    rng = random.Random(seed)
    return [min(MAX_LEN, max(1, round(rng.lognormvariate(math.log(48), 1.1)))) for _ in range(n)]


def make_requests(kind: str, lens: Sequence[int], batch: int, seed: int) -> list[Request]:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(batch, MAX_LEN, D_MODEL, generator=gen)
    rng = random.Random(seed + 1)
    out = []
    for length in lens:
        x = base[:, :length].clone()
        if kind == "transformer":
            mask = torch.zeros(batch, length, dtype=torch.bool)
            for row in range(1, batch):  # row 0 is the longest; the others end earlier
                mask[row, rng.randint(1, length) :] = True
            out.append(Request(length, (x, mask)))
        else:
            out.append(Request(length, (x,)))
    return out


def example(kind: str, batch: int) -> tuple[torch.Tensor, ...]:
    """A warmup example (warmup resizes its bucketed dims to each bucket)."""
    x = torch.randn(batch, 64, D_MODEL)
    if kind == "transformer":
        return (x, torch.zeros(batch, 64, dtype=torch.bool))
    return (x,)


# ---------------------------------------------------------------- measurement


class LimitWarnings(logging.Handler):
    """Counts torch._dynamo's "hit config.recompile_limit" warnings per function name."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.hits: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:
            return
        if "recompile_limit" not in message:
            return
        for word in message.replace("'", " ").split():
            if word.startswith("forward_"):
                self.hits[word] = self.hits.get(word, 0) + 1


def fresh(args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """New tensor objects on the same storage: one variant's marks on its inputs
    (``Buckets(strategy="dynamic")`` calls ``mark_dynamic`` on the caller's tensors) must
    not reach the next variant's guards."""
    return tuple(a.view(a.shape) for a in args)


def unique_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def compile_seconds() -> float:
    return float(
        sum(torch._dynamo.utils.compilation_time_metrics.get("_compile.compile_inner", []))
    )


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class Variant:
    name: str
    fn: Callable[..., Any]
    guarded: Any = None  # the safe_compile'd module, for stats/report
    sizes: tuple[int, ...] | None = None
    tag: str = ""
    graphs: int = 0
    compile_s: float = 0.0
    warmup_s: float | None = None
    first_ms: float = 0.0
    first_lazy_ms: float | None = None
    lazy_graphs: int | None = None
    cold: list[float] = field(default_factory=list)
    steady: list[float] = field(default_factory=list)
    silent: int | None = 0
    limit_warnings: int = 0
    visible_eager: int | None = None
    max_diff: float = 0.0
    late_graphs: int = 0  # graphs compiled during the steady passes
    late_lengths: list[int] = field(default_factory=list)


def build(
    kind: str,
    model: nn.Module,
    backend: str,
    pad_sizes: tuple[tuple[int, ...], tuple[int, ...]],
    dyn_sizes: tuple[int, ...],
    batch: int,
) -> list[Variant]:
    dims = {"x": 1, "mask": 1} if kind == "transformer" else {"x": 1}
    pad_value: Any = {"x": 0, "mask": 1} if kind == "transformer" else 0
    variants = [Variant("eager", model), Variant(CONTROL, copy.deepcopy(model))]
    for name, dynamic in ((DEFAULT, None), (STATIC, False)):
        tag = name.split()[-1].replace("=", "_")
        tag = f"{kind}_{tag}"
        copy_ = own_copy(model, tag)
        variants.append(
            Variant(name, torch.compile(copy_.forward, backend=backend, dynamic=dynamic), tag=tag)
        )
    safe = {
        "safe pad pow2": Buckets(dims=dims, sizes=pad_sizes[0], pad_value=pad_value),
        "safe pad steps": Buckets(dims=dims, sizes=pad_sizes[1], pad_value=pad_value),
        "safe dynamic": Buckets(dims=dims, sizes=dyn_sizes, strategy="dynamic"),
    }
    for name, buckets in safe.items():
        tag = name.replace(" ", "_")
        variants.append(Variant(name, lambda *a: None, sizes=buckets.sizes, tag=f"{kind}_{tag}"))
        variants[-1].guarded = buckets  # built lazily in the cold pass (warmup timed there)
    return variants


def cold_pass(
    kind: str,
    model: nn.Module,
    variants: list[Variant],
    requests: list[Request],
    backend: str,
    batch: int,
    warnings_: LimitWarnings,
) -> None:
    for v in variants:
        graphs0, compile0 = unique_graphs(), compile_seconds()
        if isinstance(v.guarded, Buckets):
            buckets = v.guarded
            # first request without warmup: a copy that compiles lazily
            lazy = safe_compile(
                own_copy(model, v.tag + "_lazy"),
                backend=backend,
                buckets=buckets,
                shadow=None,
                name=f"bench.{v.tag}.lazy",
            )
            g = unique_graphs()
            start = time.perf_counter()
            lazy(*fresh(requests[0].args))
            v.first_lazy_ms = (time.perf_counter() - start) * 1e3
            v.lazy_graphs = unique_graphs() - g
            graphs0, compile0 = unique_graphs(), compile_seconds()
            start = time.perf_counter()
            guarded = safe_compile(
                own_copy(model, v.tag),
                backend=backend,
                buckets=buckets,
                shadow=None,
                warmup=Warmup(inputs=[example(kind, batch)]),
                name=f"bench.{v.tag}",
            )
            v.warmup_s = time.perf_counter() - start
            v.guarded = guarded
            v.fn = guarded
        compiled_lengths: set[int] = set()
        for i, req in enumerate(requests):
            before = unique_graphs()
            start = time.perf_counter()
            v.fn(*fresh(req.args))
            elapsed = time.perf_counter() - start
            v.cold.append(elapsed)
            if i == 0:
                v.first_ms = elapsed * 1e3
            if v.name == STATIC:
                if unique_graphs() > before:
                    compiled_lengths.add(req.length)
                elif req.length not in compiled_lengths:
                    v.silent = (v.silent or 0) + 1
        v.graphs = unique_graphs() - graphs0
        v.compile_s = compile_seconds() - compile0
        if v.guarded is not None and not isinstance(v.guarded, Buckets):
            stats = v.guarded.safecompile.stats()
            v.visible_eager = stats.eager_calls
            v.silent = 0
        elif v.name in ("eager", CONTROL):
            v.silent = None
        v.limit_warnings = (
            sum(n for f, n in warnings_.hits.items() if f.endswith(v.tag)) if v.tag else 0
        )
        print(
            f"  cold pass {kind} / {v.name}: {v.graphs} graphs, {v.compile_s:.1f} s compiling, "
            f"{sum(v.cold):.1f} s serving",
            flush=True,
        )


def steady_pass(variants: list[Variant], requests: list[Request], rounds: int) -> int:
    """Every request ``rounds`` times, variants interleaved in a rotating order; each
    variant's latency for a request is the median over rounds. Returns the graphs
    compiled during the pass (should be 0)."""
    ref = variants[0]
    graphs0 = unique_graphs()
    samples: dict[str, list[list[float]]] = {v.name: [[] for _ in requests] for v in variants}
    turn = 0
    for r in range(rounds):
        for i, req in enumerate(requests):
            turn += 1
            k = turn % len(variants)
            outs: dict[str, torch.Tensor] = {}
            for v in variants[k:] + variants[:k]:
                call = fresh(req.args)
                before = unique_graphs()
                start = time.perf_counter()
                out = v.fn(*call)
                samples[v.name][i].append(time.perf_counter() - start)
                if unique_graphs() != before:
                    v.late_graphs += unique_graphs() - before
                    v.late_lengths.append(req.length)
                if r == 0 and i % 10 == 0:
                    outs[v.name] = out
            for v in variants if outs else ():
                diff = (outs[v.name] - outs[ref.name]).abs().max().item()
                v.max_diff = max(v.max_diff, diff)
    for v in variants:
        v.steady = [statistics.median(s) for s in samples[v.name]]
    for v in variants:
        if v.late_graphs:
            print(
                f"  {v.name}: {v.late_graphs} graph(s) compiled in the steady passes, "
                f"lengths {v.late_lengths}"
            )
    return unique_graphs() - graphs0


# ---------------------------------------------------------------- report


def report(
    kind: str,
    variants: list[Variant],
    requests: list[Request],
    batch: int,
    rounds: int,
    late_graphs: int,
) -> None:
    n = len(requests)
    tokens = sum(r.tokens for r in requests)
    eager = variants[0]
    base = next(v for v in variants if v.name == DEFAULT)
    base_tput = n / sum(base.steady)
    eager_first_ms = eager.steady[0] * 1e3
    lens = [r.length for r in requests]
    print(
        f"\n### {kind}: batch {batch}, {n} requests, {len(set(lens))} distinct lengths "
        f"(median {statistics.median(lens):.0f}, p90 {pct(lens, 0.9)}, max {max(lens)}), "
        f"eager steady p50 {pct(eager.steady, 0.5) * 1e3:.2f} ms; first request length "
        f"{requests[0].length}, eager steady {eager_first_ms:.2f} ms; steady = median of "
        f"{rounds} interleaved passes; graphs compiled during the steady passes: {late_graphs}\n"
    )
    print(
        "| variant | graphs (buckets) | compile s | first req ms (no warmup) | "
        "cold p50 / p99 ms | steady p50 / p99 ms | req/s | tok/s | vs default | "
        "silent eager | visible eager | max abs diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for v in variants:
        tput = n / sum(v.steady)
        graphs = f"{v.graphs}" + (f" ({len(v.sizes)})" if v.sizes else "")
        first = f"{v.first_ms:.1f}"
        if v.first_lazy_ms is not None:
            first += f" ({v.first_lazy_ms:.0f})"
        compile_s = f"{v.compile_s:.1f}"
        if v.warmup_s is not None:
            compile_s += f" (warmup {v.warmup_s:.1f})"
        silent = "-" if v.silent is None else f"{v.silent}"
        if v.limit_warnings:
            silent += f" ({v.limit_warnings} limit warning)"
        visible = "-" if v.visible_eager is None else f"{v.visible_eager}"
        print(
            f"| {v.name} | {graphs} | {compile_s} | {first} | "
            f"{pct(v.cold, 0.5) * 1e3:.2f} / {pct(v.cold, 0.99) * 1e3:.0f} | "
            f"{pct(v.steady, 0.5) * 1e3:.2f} / {pct(v.steady, 0.99) * 1e3:.1f} | "
            f"{tput:.1f} | {tokens / sum(v.steady):.0f} | {tput / base_tput:.3f} | "
            f"{silent} | {visible} | {v.max_diff:.1e} |"
        )
    for v in variants:
        if v.guarded is None or isinstance(v.guarded, Buckets):
            continue
        buckets = v.guarded.safecompile.report()["buckets"]  # label: "<size> (length n) [...]"
        parts = []
        for label, s in buckets.items():
            size = label.split()[0]
            parts.append(
                f"{size}: {s['calls']} calls"
                + (f", {s['padding_waste']:.0%} pad" if s["padded_calls"] else "")
                + ("" if s["status"] == "ready" else f", {s['status']}")
            )
        stats = v.guarded.safecompile.stats()
        sizes = v.sizes or ()
        padded = sum(next(z for z in sizes if z >= r.length) for r in requests)
        waste = 1 - sum(r.length for r in requests) / padded if "pad" in v.name else 0.0
        print(
            f"\n{v.name}: sizes {list(sizes)}; padded positions wasted over the requests "
            f"{waste:.0%}; graphs the guard knows {stats.graphs} (torch compiled {v.graphs} "
            f"for it), lazy copy compiled {v.lazy_graphs} graph(s) for "
            f"its first request; per bucket (calls over all passes): " + "; ".join(parts)
        )
    print(
        f"\ntargets ({kind}); first request = request 0 (length {requests[0].length}); eager's "
        f"own first call took {eager.first_ms / eager_first_ms:.2f}x its steady latency:"
    )
    for v in variants[1:]:
        own = v.steady[0] * 1e3
        checks = [
            f"first request {v.first_ms / eager_first_ms:.2f}x eager steady (<= 2x: "
            f"{'met' if v.first_ms <= 2 * eager_first_ms else 'missed'}; "
            f"{v.first_ms / own:.2f}x its own steady {own:.1f} ms)"
        ]
        if v.sizes:
            checks.append(
                f"graphs {v.graphs} <= {len(v.sizes)} buckets: "
                f"{'met' if v.graphs <= len(v.sizes) else 'missed'}"
            )
        fallbacks = v.silent or 0
        checks.append(f"silent eager {fallbacks}: {'met' if fallbacks == 0 else 'missed'}")
        ratio = sum(base.steady) / sum(v.steady)
        checks.append(f"throughput {ratio:.3f}x default: {'met' if ratio >= 1 else 'missed'}")
        print(f"  {v.name}: " + "; ".join(checks))


# ---------------------------------------------------------------- random shapes, shadow on

RANDOM_D = 64
PLAIN = "torch.compile(model)"
SAFE_DEFAULTS = "safe_compile defaults"
SAFE_NO_SHADOW = "safe_compile shadow=None"


class SmallMLP(nn.Module):
    """The issue's MLP over the last dim: 64 -> 256 -> GELU -> 64."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(RANDOM_D, 4 * RANDOM_D), nn.GELU(), nn.Linear(4 * RANDOM_D, RANDOM_D)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


class SmallBlock(nn.Module):
    """A small transformer block: ``nn.TransformerEncoderLayer`` d_model 64, 4 heads."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            RANDOM_D, 4, dim_feedforward=4 * RANDOM_D, dropout=0.0, batch_first=True
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layer(x)
        return out


@dataclass
class Shaped:
    """One variant of the random-shapes case, and what it measured."""

    name: str
    fn: Callable[..., Any]
    guarded: Any = None
    times: dict[str, list[float]] = field(default_factory=dict)  # pass name -> seconds
    compiling: set[int] = field(default_factory=set)  # pass-1 calls during which it compiled
    graphs: int = 0  # torch's unique graphs made during this variant's calls
    max_diff: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)  # pass name -> stats() after it


def random_inputs(calls: int, max_batch: int, max_seq: int, seed: int) -> list[torch.Tensor]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(rng.randint(1, max_batch), rng.randint(1, max_seq), RANDOM_D, generator=gen)
        for _ in range(calls)
    ]


def random_variants(kind: str, backend: str) -> list[Shaped]:
    model = (SmallMLP() if kind == "random-mlp" else SmallBlock()).eval()
    safe = own_copy(model, f"{kind}_safe".replace("-", "_"))
    bare = own_copy(model, f"{kind}_safe_noshadow".replace("-", "_"))
    return [
        Shaped("eager", model),
        Shaped(PLAIN, torch.compile(own_copy(model, kind.replace("-", "_")), backend=backend)),
        Shaped(SAFE_DEFAULTS, safe_compile(safe, backend=backend), guarded=safe),
        Shaped(SAFE_NO_SHADOW, safe_compile(bare, backend=backend, shadow=None), guarded=bare),
    ]


def random_pass(label: str, variants: list[Shaped], inputs: list[torch.Tensor]) -> None:
    """Every input once, the variants interleaved call by call in a rotating order."""
    for v in variants:
        v.times[label] = []
    for i, x in enumerate(inputs):
        k = i % len(variants)
        outs: dict[str, torch.Tensor] = {}
        for v in variants[k:] + variants[:k]:
            before = unique_graphs()
            start = time.perf_counter()
            outs[v.name] = v.fn(x)
            v.times[label].append(time.perf_counter() - start)
            if unique_graphs() != before:
                v.graphs += unique_graphs() - before
                v.compiling.add(i)
        for v in variants:
            v.max_diff = max(v.max_diff, (outs[v.name] - outs["eager"]).abs().max().item())
    for v in variants:
        if v.guarded is not None:
            v.stats[label] = v.guarded.safecompile.stats()


def random_report(kind: str, variants: list[Shaped], inputs: list[torch.Tensor]) -> None:
    n = len(inputs)
    shapes = {tuple(x.shape[:2]) for x in inputs}
    plain = next(v for v in variants if v.name == PLAIN)
    print(
        f"\n### {kind}: {n} calls of random (batch, seq), {len(shapes)} distinct shapes, "
        f"d={RANDOM_D}; variants interleaved call by call; pass 1 from nothing compiled, "
        "pass 2 the same inputs again; load average "
        f"{os.getloadavg()[0]:.2f}\n"
    )
    # Pass 1 without the calls during which any variant compiled: the canary checks' cost
    # without the compile stalls (whose order between variants is luck).
    stalls = set().union(*(v.compiling for v in variants))
    print(
        f'Pass 1 "w/o compiles" leaves out the {len(stalls)} calls during which any variant '
        "compiled.\n"
    )
    print(
        "| variant | pass 1 s | pass 1 vs torch.compile | pass 1 w/o compiles vs torch.compile | "
        "pass 2 s | pass 2 vs torch.compile | pass 2 p50 / p99 µs | torch graphs | "
        "stats().graphs | shadow_checks (pass 1 / 2) | eager_calls | report() bytes | "
        "max abs diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def steady(v: Shaped) -> float:
        return sum(t for i, t in enumerate(v.times["pass 1"]) if i not in stalls)

    for v in variants:
        t1, t2 = sum(v.times["pass 1"]), sum(v.times["pass 2"])
        r1 = sum(plain.times["pass 1"]) / t1
        r1s = steady(plain) / steady(v)
        r2 = sum(plain.times["pass 2"]) / t2
        cells = ["-"] * 4
        if v.guarded is not None:
            s1, s2 = v.stats["pass 1"], v.stats["pass 2"]
            size = len(json.dumps(v.guarded.safecompile.report()))
            cells = [
                f"{s2.graphs}",
                f"{s1.shadow_checks} / {s2.shadow_checks - s1.shadow_checks}",
                f"{s2.eager_calls}",
                f"{size:,}",
            ]
        print(
            f"| {v.name} | {t1:.2f} | {r1:.2f}x | {r1s:.2f}x | {t2:.2f} | {r2:.2f}x | "
            f"{pct(v.times['pass 2'], 0.5) * 1e6:,.0f} / {pct(v.times['pass 2'], 0.99) * 1e6:,.0f}"
            f" | {v.graphs} | " + " | ".join(cells) + f" | {v.max_diff:.1e} |"
        )
    safe = next(v for v in variants if v.name == SAFE_DEFAULTS)
    s = safe.stats["pass 2"]
    print(
        f"\n{SAFE_DEFAULTS}: state {safe.guarded.safecompile.state.value}, calls {s.calls}, "
        f"compiled {s.compiled_calls}, eager {s.eager_calls}, recompile-limit calls "
        f"{s.recompile_limit_calls}, shadow checks {s.shadow_checks} (skipped "
        f"{s.shadow_skipped}, breaches {s.shadow_breaches}), rollbacks {s.rollbacks}; graphs:"
    )
    for g in safe.guarded.safecompile.report()["graphs"]:
        print(
            f"  graph {g['id']} [{g['inputs']}]: {g['calls']} calls, {g['checks']} checks, "
            f"compiled {g['compiled']}, compile {g['compile_s']:.2f} s"
        )


def random_case(kind: str, args: argparse.Namespace) -> None:
    inputs = random_inputs(args.calls, args.max_batch, args.max_seq, args.seed)
    variants = random_variants(kind, args.backend)
    for label in ("pass 1", "pass 2"):
        random_pass(label, variants, inputs)
        print(f"  {kind} {label} done", file=sys.stderr, flush=True)
    random_report(kind, variants, inputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--models", default="transformer,mlp")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3, help="steady passes (median per request)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--calls", type=int, default=1000, help="random-* models: calls a pass")
    parser.add_argument("--max-batch", type=int, default=8, help="random-* models: batch 1..N")
    parser.add_argument("--max-seq", type=int, default=64, help="random-* models: seq 1..N")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    pad_sizes = (pow2(16, MAX_LEN), steps(16, 128, 16) + steps(192, MAX_LEN, 64))
    dyn_sizes = (1, 32, 128, MAX_LEN)
    limit_warnings = LimitWarnings()
    logging.getLogger("torch._dynamo").addHandler(limit_warnings)

    started = time.perf_counter()
    # The backend's one-time start-up (inductor: 10-25 s here), on a throwaway function,
    # so that no variant pays it for the others.
    t = time.perf_counter()
    torch.compile(lambda x: x.sin() + 1, backend=args.backend)(torch.randn(8))
    startup = time.perf_counter() - t
    lens = lengths(args.requests, args.seed)
    print(
        f"torch {torch.__version__}, backend={args.backend}, threads={args.threads}, "
        f"{args.requests} requests, seed {args.seed}, no_grad; backend process start-up "
        f"(excluded) {startup:.1f} s; pad sizes {list(pad_sizes[0])} / {list(pad_sizes[1])}; "
        f"dynamic ranges {list(dyn_sizes)}; load average {os.getloadavg()[0]:.2f} at start",
        flush=True,
    )
    with torch.no_grad():
        for kind in args.models.split(","):
            if kind.startswith("random-"):
                random_case(kind, args)
                continue
            model = (Block() if kind == "transformer" else TokenMLP()).eval()
            requests = make_requests(kind, lens, args.batch, args.seed)
            variants = build(kind, model, args.backend, pad_sizes, dyn_sizes, args.batch)
            cold_pass(kind, model, variants, requests, args.backend, args.batch, limit_warnings)
            late = steady_pass(variants, requests, args.rounds)
            report(kind, variants, requests, args.batch, args.rounds, late)
    print(
        f"\ntotal wall time {time.perf_counter() - started:.0f} s; load average "
        f"{os.getloadavg()[0]:.2f} at the end"
    )


if __name__ == "__main__":
    main()
