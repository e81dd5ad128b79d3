"""Calibrate safecompile's drift tolerances: honest compiled-vs-eager error against faults.

For fp32 and bf16 MLPs and transformer blocks, compiled (aot_eager, inductor) and run
against eager over a few seeds and batch/sequence sizes, this measures the figures that
``safecompile.checks.compare`` judges: the normalised error ‖c-e‖/‖e‖, the scale error
<c-e, e>/‖e‖² and the peak error max|c-e| / max|e| (and max abs), next to each side's
normalised error against an fp64 reference (the same rounded weights and inputs, run in
float64). It then injects the two faults the defaults must catch, a 1% multiplicative
shift (``out * 1.01``) and a single NaN, and prints Markdown tables: per configuration,
then per dtype the margins between the worst honest figure, its tolerance and the
smallest fault. The pseudo-backend ``fp64-rounded`` stands for a perfectly accurate
compiler (each output computed in fp64 and rounded once): against it, the difference
is all of eager's own rounding error, the largest honest difference there can be.

    .venv/bin/python bench/drift_calibration.py             # all: ~3 min cold on 2 cores
    .venv/bin/python bench/drift_calibration.py --backends aot_eager --seeds 2   # ~50 s
    .venv/bin/python bench/drift_calibration.py --backends aot_eager --dtypes fp32 --seeds 1
                                                              # smoke run (~20 s)

Run it alone on the machine: each inductor compile costs seconds on 2 cores.
Exit status 1 if any honest run tripped or any fault was missed.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import platform
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

if importlib.util.find_spec("safecompile") is None:  # run from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch import nn

from safecompile.checks.compare import (
    PEAK_FACTOR,
    SCALE_SHARE,
    SCALE_SIGMAS,
    TensorFigures,
    compare,
    default_tolerances,
)

warnings.filterwarnings("ignore", message=".*NumPy.*")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
EXACT = "fp64-rounded"  # not a backend: each output computed in fp64 and rounded to dtype


class PreNormBlock(nn.Module):
    """A GPT-style block written out by hand: inductor fuses its norms and pointwise ops."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def mlp(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(width, width),
        nn.GELU(),
        nn.Linear(width, width),
        nn.GELU(),
        nn.Linear(width, width),
    )


def encoder_layer(width: int) -> nn.Module:
    return nn.TransformerEncoderLayer(
        d_model=width,
        nhead=max(1, width // 32),
        dim_feedforward=4 * width,
        dropout=0.0,
        batch_first=True,
    )


@dataclass(frozen=True)
class Config:
    """One model family: how to build it, its width, its input shapes, its grad mode."""

    name: str
    build: Callable[[int], nn.Module]
    width: int
    shapes: tuple[tuple[int, ...], ...]  # leading dims of the input; the last is `width`
    grad: bool  # run with grad enabled (nn.TransformerEncoderLayer: no fused fast path)


BLOCK_SHAPES = ((1, 8), (2, 16), (8, 64), (4, 128))
CONFIGS = (
    Config("MLP 3x512, no_grad", mlp, 512, ((1,), (8,), (64,), (256,)), grad=False),
    Config("MLP 3x512, grad", mlp, 512, ((1,), (8,), (64,), (256,)), grad=True),
    Config("TransformerEncoderLayer d64, grad", encoder_layer, 64, BLOCK_SHAPES, grad=True),
    Config("TransformerEncoderLayer d256, grad", encoder_layer, 256, BLOCK_SHAPES, grad=True),
    Config("TransformerEncoderLayer d256, no_grad", encoder_layer, 256, BLOCK_SHAPES, grad=False),
    Config(
        "pre-norm block d256, no_grad",
        lambda d: PreNormBlock(d, d // 32),
        256,
        BLOCK_SHAPES,
        grad=False,
    ),
)


def figures(actual: torch.Tensor, expected: torch.Tensor) -> TensorFigures:
    """The figures compare() judges, computed independently in float64."""
    a, e = actual.detach().double(), expected.detach().double()
    d = a - e
    norm = torch.linalg.vector_norm
    return TensorFigures(
        d_norm=float(norm(d)),
        e_norm=float(norm(e)),
        a_norm=float(norm(a)),
        d_max=float(d.abs().max()),
        e_max=float(e.abs().max()),
        n=e.numel(),
    )


@dataclass
class Row:
    """Worst-case figures for one (config, dtype, backend) over seeds and shapes."""

    config: str
    dtype: str
    backend: str
    runs: int = 0
    false_trips: list[str] = field(default_factory=list)
    worst_norm: float = 0.0
    worst_scale: float = 0.0  # |scale error| / its allowance
    worst_peak: float = 0.0
    worst_abs: float = 0.0
    eager_vs_fp64: float = 0.0
    compiled_vs_fp64: float = 0.0
    shift_norm: float = math.inf  # the smallest normalised error of a 1% shift
    shift_margin: float = math.inf  # the smallest |scale error| / allowance of a 1% shift
    shift_missed: int = 0
    nan_missed: int = 0


def measure(row: Row, config: Config, seeds: int) -> None:
    dtype = DTYPES[row.dtype]
    rtol, atol = default_tolerances(dtype)
    torch._dynamo.reset()  # a fresh recompile budget for each row
    for seed in range(seeds):
        torch.manual_seed(seed)
        model = config.build(config.width).eval().to(dtype)
        reference = copy.deepcopy(model).double()  # the same rounded weights, in fp64
        if row.backend == EXACT:
            # a perfectly accurate "compiler": the same weights in fp64, rounded once
            def compiled(x: torch.Tensor, ref: nn.Module = reference) -> torch.Tensor:
                return ref(x.double()).to(x.dtype)
        else:
            compiled = torch.compile(model, backend=row.backend)
        gen = torch.Generator().manual_seed(1000 + seed)
        for shape in config.shapes:
            x = torch.randn((*shape, config.width), generator=gen).to(dtype)
            with torch.set_grad_enabled(config.grad):
                eager = model(x).detach()
                got = compiled(x).detach()
            with torch.no_grad():
                ref = reference(x.double())
            row.runs += 1
            result = compare(got, eager)
            if not result.ok:
                row.false_trips.append(f"{row.backend} {row.dtype} {config.name} {shape}: ")
                row.false_trips[-1] += str(result.reason)
            f = figures(got, eager)
            row.worst_norm = max(row.worst_norm, f.normalised)
            allowed = f.scale_allowance(rtol, atol)
            row.worst_scale = max(row.worst_scale, abs(f.scale_error) / allowed)
            row.worst_peak = max(row.worst_peak, f.d_max / f.e_max)
            row.worst_abs = max(row.worst_abs, result.max_abs)
            row.eager_vs_fp64 = max(row.eager_vs_fp64, figures(eager, ref).normalised)
            row.compiled_vs_fp64 = max(row.compiled_vs_fp64, figures(got, ref).normalised)

            shifted = got * 1.01
            s = figures(shifted, eager)
            row.shift_norm = min(row.shift_norm, s.normalised)
            row.shift_margin = min(
                row.shift_margin, abs(s.scale_error) / s.scale_allowance(rtol, atol)
            )
            row.shift_missed += compare(shifted, eager).ok

            poisoned = got.clone()
            flat = poisoned.view(-1)
            flat[int(torch.randint(flat.numel(), (1,), generator=gen))] = math.nan
            row.nan_missed += compare(poisoned, eager).ok


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--backends", default=f"aot_eager,inductor,{EXACT}")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    started = time.perf_counter()
    rows: list[Row] = []
    for backend in args.backends.split(","):
        for dtype in args.dtypes.split(","):
            for config in CONFIGS:
                t0 = time.perf_counter()
                row = Row(config.name, dtype, backend)
                measure(row, config, args.seeds)
                rows.append(row)
                print(
                    f"# {backend:9} {dtype} {config.name}: {row.runs} runs, "
                    f"{time.perf_counter() - t0:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )

    print(
        f"torch {torch.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()} CPU, {torch.get_num_threads()} threads; {args.seeds} seeds; "
        f"SCALE_SHARE={SCALE_SHARE:g}, SCALE_SIGMAS={SCALE_SIGMAS:g}, "
        f"PEAK_FACTOR={PEAK_FACTOR:g}\n"
    )
    print(
        "| model | dtype | backend | runs | false trips | norm. err | scale err / allowed "
        "| peak err | max abs | eager vs fp64 | compiled vs fp64 | 1% shift: norm. err "
        "| 1% shift: scale err / allowed | shift missed | NaN missed |"
    )
    print("|" + " --- |" * 15)
    for r in rows:
        print(
            f"| {r.config} | {r.dtype} | {r.backend} | {r.runs} | {len(r.false_trips)} "
            f"| {r.worst_norm:.2e} | {r.worst_scale:.3f} | {r.worst_peak:.2e} "
            f"| {r.worst_abs:.2e} | {r.eager_vs_fp64:.2e} | {r.compiled_vs_fp64:.2e} "
            f"| {r.shift_norm:.2e} | {r.shift_margin:.2f} | {r.shift_missed} | {r.nan_missed} |"
        )
    print(
        "\nHonest figures are the worst over runs; fault figures the weakest. Margins per dtype:\n"
    )
    print(
        "| dtype | rtol | worst honest norm. err | rtol / honest | worst honest peak "
        "| PEAK_FACTOR·rtol / peak | worst honest scale err / allowed "
        "| weakest 1% shift: norm. err / rtol | weakest 1% shift: scale err / allowed |"
    )
    print("|" + " --- |" * 9)
    for name in args.dtypes.split(","):
        mine = [r for r in rows if r.dtype == name]
        rtol, _ = default_tolerances(DTYPES[name])
        honest = max(r.worst_norm for r in mine)
        peak = max(r.worst_peak for r in mine)
        scale = max(r.worst_scale for r in mine)
        shift = min(r.shift_margin for r in mine)
        shift_norm = min(r.shift_norm for r in mine)
        print(
            f"| {name} | {rtol:g} | {honest:.2e} | {_times(rtol, honest)} | {peak:.2e} "
            f"| {_times(PEAK_FACTOR * rtol, peak)} | {scale:.3f} | {shift_norm / rtol:.2f} "
            f"| {shift:.2f} |"
        )
    trips = [reason for r in rows for reason in r.false_trips]
    missed = sum(r.shift_missed + r.nan_missed for r in rows)
    print(
        f"\n{sum(r.runs for r in rows)} runs in {time.perf_counter() - started:.0f} s: "
        f"{len(trips)} false trips, {missed} faults missed"
    )
    for reason in trips:
        print(f"false trip: {reason}")
    return 1 if trips or missed else 0


def _times(tolerance: float, honest: float) -> str:
    return f"{tolerance / honest:.0f}x" if honest > 0 else "inf (identical)"


if __name__ == "__main__":
    raise SystemExit(main())
