"""What a graph's first-run protection costs: first-call latency with and without it.

A compiled graph's first run runs its compiled code on copies of the tensors it is given
and its traced graph eagerly on the caller's own (docs/design.md, "A graph's first run").
This times a guarded callable's first call (trace, compile, first run) and its second
call, with the protection on and off (``safecompile.guard._graph_backend.PROTECT_FIRST_RUNS``),
side by side: each round makes a fresh guarded copy of each case for both variants, in
alternating order, after ``torch._dynamo.reset()``. Cases:

- ``mlp``: the small MLP (3x Linear(512), batch 64), shadow checks off; its parameters
  are not copied (the graph updates nothing in place);
- ``mlp-checked``: the same with ``Shadow(every=1)`` (the first run is also compared);
- ``cache``: a decode step writing one row of a 64 MiB float32 cache in place (the cache
  is copied on the first run: the worst case, one more cache for that call).

Prints the median first-call and second-call times of each variant over the rounds, and
the median paired difference (on - off) with its interquartile range. Time is the calling
thread's CPU time (``--clock thread``, the default: a loaded machine's waits left out),
or ``--clock wall``.

    python bench/first_call.py                      # aot_eager, 9 rounds (~1 min)
    python bench/first_call.py --backend inductor   # compiles dominate (~10 s each)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from _models import MLP  # bench/ is on sys.path when a bench runs as a script

from safecompile import Shadow, safe_compile
from safecompile.guard import _graph_backend as graphs

warnings.filterwarnings("ignore")
torch.set_num_threads(1)

CACHE_ROWS, CACHE_WIDTH = 16384, 1024  # 64 MiB of float32


def decode(cache: torch.Tensor, row: torch.Tensor, at: int) -> torch.Tensor:
    cache[at] = row
    return cache[: at + 1].sum(0)


def cases() -> dict[str, tuple[Callable[[], Any], tuple[Any, ...], Shadow | None]]:
    """name -> (a factory of a fresh callable, its arguments, its shadow policy)."""
    mlp = MLP()
    x = torch.randn(64, 512)

    cache = torch.zeros(CACHE_ROWS, CACHE_WIDTH)
    row = torch.randn(CACHE_WIDTH)
    return {
        "mlp": (lambda: copy.deepcopy(mlp), (x,), None),
        "mlp-checked": (lambda: copy.deepcopy(mlp), (x,), Shadow(every=1)),
        "cache": (lambda: decode, (cache, row, 3), None),
    }


def first_calls(
    factory: Callable[[], Any],
    args: tuple[Any, ...],
    shadow: Shadow | None,
    backend: str,
    *,
    protect: bool,
    clock: Callable[[], float],
) -> tuple[float, float]:
    """Seconds of the first and the second call of a fresh guarded copy."""
    graphs.PROTECT_FIRST_RUNS = protect
    try:
        guarded = safe_compile(factory(), backend=backend, shadow=shadow)
        started = clock()
        guarded(*args)
        first = clock() - started
        started = clock()
        guarded(*args)
        second = clock() - started
    finally:
        graphs.PROTECT_FIRST_RUNS = True
    return first, second


def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--clock", choices=("thread", "wall"), default="thread")
    parser.add_argument("--case", action="append", help="only these cases (repeatable)")
    opts = parser.parse_args()
    table = cases()
    names = opts.case or list(table)
    times: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    for r in range(opts.rounds):
        for name in names:
            factory, args, shadow = table[name]
            order = (True, False) if r % 2 == 0 else (False, True)
            for protect in order:
                torch._dynamo.reset()
                clock = time.thread_time if opts.clock == "thread" else time.perf_counter
                measured = first_calls(
                    factory, args, shadow, opts.backend, protect=protect, clock=clock
                )
                times.setdefault((name, protect), []).append(measured)
    print(
        f"backend {opts.backend}, {opts.rounds} rounds, {opts.clock} clock,"
        f" torch {torch.__version__}"
    )
    print(
        f"{'case':12} {'first call off':>15} {'on':>10} {'on - off [IQR]':>24}"
        f" {'2nd off':>9} {'2nd on':>9}"
    )
    for name in names:
        on, off = times[(name, True)], times[(name, False)]
        diffs = [a[0] - b[0] for a, b in zip(on, off, strict=True)]
        lo, hi = quartiles(diffs)
        print(
            f"{name:12} {statistics.median(t[0] for t in off) * 1e3:13.1f}ms"
            f" {statistics.median(t[0] for t in on) * 1e3:8.1f}ms"
            f" {statistics.median(diffs) * 1e3:+9.1f}ms [{lo * 1e3:+.1f}, {hi * 1e3:+.1f}]"
            f" {statistics.median(t[1] for t in off) * 1e3:7.2f}ms"
            f" {statistics.median(t[1] for t in on) * 1e3:7.2f}ms"
        )


if __name__ == "__main__":
    main()
