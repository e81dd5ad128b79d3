"""Does compiling pay for the serving example's model? eager, ``torch.compile`` and the
example's guarded call, side by side.

Run: ``.venv/bin/python bench/serving_model.py`` (needs the ``examples`` extra; inductor
needs a C++ compiler; the compiles take a few minutes on 2 CPU cores).

The model is ``examples/serving.py``'s ``Tagger``, under ``torch.no_grad()`` on one thread
(``torch.set_num_threads(1)``). Requests cycle through ``--lengths`` tokens (batch 1):

- ``eager``: the model itself;
- ``torch.compile``: ``torch.compile(model, dynamic=False)``, one graph per length;
- ``guarded``: the example's own ``guard()`` (buckets padded to powers of two, shadow
  checks, the speed verdict), warmed up first, then served alone until its speed
  verdict's first round has ended (``--settle``), as the service runs it after start-up.

Each round serves every length ``--calls`` times per variant, the variants in a rotating
order; the figure is the median over ``--rounds`` rounds of the thread's CPU time per
call (``time.thread_time``: on a shared machine it leaves out the time spent waiting for
a core), with the min beside it. The guarded call's state at the end says whether its
speed verdict kept the compiled path (``compiled``) or rolled it back (``rolled_back``).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import serving  # noqa: E402
import torch  # noqa: E402


def per_call_us(fn: Any, requests: list[tuple[torch.Tensor, torch.Tensor]], calls: int) -> float:
    started = time.thread_time()
    for _ in range(calls):
        for tokens, mask in requests:
            fn(tokens, mask)
    return (time.thread_time() - started) / (calls * len(requests)) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--lengths", default="5,12,30,100", help="request lengths, cycled")
    parser.add_argument("--calls", type=int, default=50, help="calls per length per round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--settle", type=int, default=200, help="passes at most until the first verdict"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    model = serving.build_model()
    lengths = [int(n) for n in args.lengths.split(",")]
    requests = [serving.encode([(7 * i + n) % serving.VOCAB for i in range(n)]) for n in lengths]
    compiled = torch.compile(copy.deepcopy(model), backend=args.backend, dynamic=False)
    guarded = serving.guard(copy.deepcopy(model), args.backend, label=args.backend)
    variants = {"eager": model, "torch.compile": compiled, "guarded": guarded}

    started = time.monotonic()
    with torch.no_grad():
        # The background warmup runs at nice 19, which a loaded machine starves: warm up
        # here too, at the caller's priority (compiles already made are not made again).
        guarded.safecompile.warmup(*requests[0])
        guarded.safecompile.wait_warm()
        for fn in variants.values():  # compiles (torch.compile), canaries (guarded)
            per_call_us(fn, requests, 3)
        print(f"# compiled and warm in {time.monotonic() - started:.0f} s", file=sys.stderr)
        # The guarded call alone until its speed verdict's first round has ended (its
        # probes run eager: a one-off cost), so the rounds below are the steady state.
        c = guarded.safecompile
        for _ in range(args.settle):
            if c.stats().extra["speed"]["rounds"] >= 1:
                break
            per_call_us(guarded, requests, 1)
        before = c.stats()
        times: dict[str, list[float]] = {name: [] for name in variants}
        by_length: dict[tuple[str, int], list[float]] = {}
        names = list(variants)
        for r in range(args.rounds):
            for name in names[r % 3 :] + names[: r % 3]:
                spent = 0.0
                for n, request in zip(lengths, requests, strict=True):
                    us = per_call_us(variants[name], [request], args.calls)
                    by_length.setdefault((name, n), []).append(us)
                    spent += us
                times[name].append(spent / len(lengths))

    print(
        f"torch {torch.__version__}, backend {args.backend}, lengths {lengths}, "
        f"{args.rounds} rounds x {args.calls} calls a length; CPU us per call (1 thread)"
    )
    eager_median = statistics.median(times["eager"])
    print(f"{'variant':<14} {'median':>8} {'min':>8} {'vs eager':>9}  median by length")
    for name, got in times.items():
        median = statistics.median(got)
        each = "  ".join(f"{n}: {statistics.median(by_length[name, n]):.0f}" for n in lengths)
        print(f"{name:<14} {median:8.1f} {min(got):8.1f} {median / eager_median:8.2f}x  {each}")
    stats = c.stats()
    compiled = stats.compiled_calls - before.compiled_calls
    eager = stats.eager_calls - before.eager_calls
    print(
        f"guarded: state {c.state.value}; measured calls {compiled} compiled, {eager} eager "
        f"(shadow checks run eager too: {stats.shadow_checks - before.shadow_checks}); "
        f"speed verdict: {stats.extra['speed']['rounds']} rounds, last ratio "
        f"{stats.extra['speed']['last_ratio']}, rollbacks {stats.rollbacks}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
