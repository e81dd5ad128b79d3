"""The latency of a live call no graph covers, against eager's, with and without the
deferred compile (``Warmup(background=True)``), side by side in one run.

A small MLP (3x Linear(512)) is warmed up on batch 4; the live call then comes with batch
``--batch`` (8), which needs a new graph (``dynamic=False``: a static one per batch size,
so no variant's graph serves another's; inductor's caches are off, so each compiles from
nothing). Variants, each on a fresh copy of the model:

- ``eager``: the plain module on the new shape (median of ``--calls`` calls);
- ``blocking warmup``: ``Warmup(inputs=[(x4,)])``, then the live call: it compiles the new
  graph on the request path (what every live miss did before the deferred compile);
- ``background warmup``: ``Warmup(inputs=[(x4,)], background=True)``: the live call is
  served eager and its graph compiles on a worker (one live shape after another, each
  compared with eager's call of that shape timed the same way just before: after the
  same 5 calls on batch 4 and a ``gc.collect()``); then ``--calls`` calls more while that
  compile runs (against eager's median), and the time until the new graph serves;
- ``lazy``: no warmup: the very first call compiles on the request path;
- ``lazy, background``: ``Warmup(inputs=[], background=True)``: the very first call is
  served eager, its graph compiles on a worker.

Times are wall-clock (``time.perf_counter``: what the caller waits) and, for the live misses
and the calls served while their graphs compile, the calling thread's CPU time too
(``time.thread_time``: the work the call did, without waiting for a core or the
interpreter lock, which on a loaded machine is most of the noise). One intra-op thread.

    python bench/first_request.py                     # inductor (~1-2 minutes)
    python bench/first_request.py --backend aot_eager # quick smoke run
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from _models import MLP  # bench/ is on sys.path when a bench runs as a script

from safecompile import Warmup, safe_compile

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
# every variant compiles from nothing: no graph reused from an earlier variant's compile
torch._inductor.config.force_disable_caches = True


def timed(fn: Callable[[], Any]) -> float:
    """Wall time of one call (what the caller waits)."""
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def both(fn: Callable[[], Any]) -> tuple[float, float]:
    """Wall and thread CPU time of one call."""
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - wall, time.thread_time() - cpu


def eager_median(model: torch.nn.Module, x: torch.Tensor, calls: int) -> tuple[float, float]:
    for _ in range(3):
        model(x)
    times = [both(lambda: model(x)) for _ in range(calls)]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def main() -> None:  # noqa: PLR0915 - one run, top to bottom
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument(
        "--batches", default="8,12,16,24,32", help="the live calls' batch sizes, one miss each"
    )
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument(
        "--nice", type=int, default=19, help="Warmup(nice=...) of the background variants"
    )
    opts = parser.parse_args()
    torch.manual_seed(0)
    base = MLP().eval()
    x4 = torch.randn(4, 512)
    live = [torch.randn(int(b), 512) for b in opts.batches.split(",")]
    rows: list[tuple[str, str, str]] = []

    def guarded(warmup: Warmup | None) -> Any:
        return safe_compile(
            copy.deepcopy(base), backend=opts.backend, dynamic=False, shadow=None, warmup=warmup
        )

    def steady(g: Any) -> None:
        """A few covered calls first, and no garbage left to collect: a serving process
        (the same for eager before each call it is compared with)."""
        for _ in range(5):
            g(x4)
        gc.collect()

    def eager_after_steady(x: torch.Tensor) -> tuple[float, float]:
        """Eager's call on a shape, in the state a guarded miss is timed in (right after
        the same steady calls): the reference for that miss."""
        steady(plain)
        return both(lambda: plain(x))

    with torch.no_grad():
        plain = copy.deepcopy(base)
        eager = [eager_median(plain, x, opts.calls) for x in live]
        walls = [wall for wall, _ in eager]
        rows.append(("eager, median over the live shapes", ms(statistics.median(walls)), "1.00x"))

        def row(name: str, seconds: float, reference: float) -> None:
            rows.append((name, ms(seconds), f"{seconds / reference:.2f}x"))

        blocking = guarded(Warmup(inputs=[(x4,)]))
        steady(blocking)
        row("blocking warmup: the live miss (compiles)", timed(lambda: blocking(live[0])), walls[0])

        background = guarded(Warmup(inputs=[(x4,)], background=True, nice=opts.nice))
        assert background.safecompile.wait_warm(600)
        deferred = background.safecompile._engine.deferred
        misses: list[tuple[float, float]] = []
        during: list[tuple[float, float]] = []
        serves: list[float] = []
        for x, (wall, cpu) in zip(live, eager, strict=True):
            reference = eager_after_steady(x)
            steady(background)
            started = time.perf_counter()
            missed = both(lambda x=x: background(x))
            misses.append((missed[0] / reference[0], missed[1] / reference[1]))
            while len(during) < opts.calls * len(live) and deferred.pending():
                served = both(lambda x=x: background(x))
                during.append((served[0] / wall, served[1] / cpu))
            assert deferred.wait_idle(600)
            serves.append(time.perf_counter() - started)
        rows.append(
            (
                f"background warmup: the live miss, median of {len(misses)} shapes",
                "",
                ratios(misses),
            )
        )
        if during:
            rows.append(
                (f"  {len(during)} calls served while its graph compiled", "", ratios(during))
            )
        compiled = background.safecompile.stats().compiled_calls
        steady(background)
        after = background.safecompile.stats().compiled_calls
        rows.append(
            (
                "  until its graph serves, median (s)",
                f"{statistics.median(serves):.2f}",
                f"{after - compiled} of 5 covered calls compiled after",
            )
        )

        lazy = guarded(None)
        row("lazy: the first call (compiles)", timed(lambda: lazy(live[0])), walls[0])

        lazy_bg = guarded(Warmup(inputs=[], background=True, nice=opts.nice))
        assert lazy_bg.safecompile.wait_warm(600)
        gc.collect()
        reference = timed(lambda: plain(live[1]))  # eager after a gc.collect(), as here
        gc.collect()
        row("lazy, background: the first call", timed(lambda: lazy_bg(live[1])), reference)
        assert lazy_bg.safecompile._engine.deferred.wait_idle(600)

    print(
        f"torch {torch.__version__}, backend={opts.backend}, MLP 3x Linear(512), warmed on "
        f"batch 4, live batches {opts.batches}, threads=1, no_grad, nice={opts.nice}"
    )
    print("| variant | ms | vs eager |\n| --- | ---: | ---: |")
    for name, value, ratio in rows:
        print(f"| {name} | {value} | {ratio} |")


def ratios(pairs: list[tuple[float, float]]) -> str:
    """Medians (and maxima) of (wall, CPU) ratios to eager's."""
    wall = [w for w, _ in pairs]
    cpu = [c for _, c in pairs]
    return (
        f"wall {statistics.median(wall):.2f}x (max {max(wall):.2f}x), "
        f"CPU {statistics.median(cpu):.2f}x (max {max(cpu):.2f}x)"
    )


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


if __name__ == "__main__":
    main()
