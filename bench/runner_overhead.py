"""Per-call cost of a call guarded by the runner against the same call guarded by the
decorator, side by side in one run.

``safecompile.install()`` (what ``safecompile run`` does in each process) answers
``torch.compile`` with ``safe_compile``; this measures whether that path costs anything
per call over ``@safe_compile`` on the same code. Variants, interleaved round by round in
a rotating order (``overhead.py``'s method: thread CPU time by default, per-round paired
differences, median and interquartile range), each with a code object of its own:

- tiny function (``x + 1``, 4 elements): ``safe_compile(fn)`` against the runner's
  ``torch.compile(fn)``;
- tiny module, in place: ``safe_compile(module)`` against the runner's
  ``module.compile()``;
- tiny module, wrapped: the runner's ``torch.compile(module)`` (an ``OptimizedModule``)
  against ``safe_compile(module)``, next to torch's own ``torch.compile(module)`` against
  its compiled ``forward``: the layer ``OptimizedModule`` adds in both.

Shadow checks and speed probes are off in every guarded variant.

    python bench/runner_overhead.py                  # eager backend (~1 min)
    python bench/runner_overhead.py --rounds 5       # quick smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import overhead  # bench/ is on sys.path when a bench runs as a script
import torch
from overhead import Tiny, measure, own_code, paired, tiny

import safecompile
from safecompile import Rollback, safe_compile

TORCH_COMPILE = torch.compile  # torch's own, kept before install()
QUIET: dict[str, Any] = {"shadow": None, "rollback": Rollback(slower_ratio=None)}

ROWS = [
    # (case, variant, baseline)
    ("function: runner - decorator", "runner fn", "decorator fn"),
    ("module in place: runner's module.compile() - decorator", "runner compile()", "decorator"),
    ("module wrapped: runner's torch.compile(module) - decorator", "runner wrapped", "decorator"),
    ("module wrapped: torch's own torch.compile(module) - its forward", "torch wrapped", "torch"),
]


def variants(backend: str, x: torch.Tensor) -> dict[str, Callable[[], Any]]:
    made: dict[str, Callable[..., Any]] = {}
    made["decorator fn"] = safe_compile(own_code(tiny, "dec"), backend=backend, **QUIET)
    made["decorator"] = safe_compile(own_code(Tiny(), "dec"), backend=backend, **QUIET)
    torch_forward = own_code(Tiny(), "torch")
    torch_forward.forward = TORCH_COMPILE(torch_forward.forward, backend=backend)  # type: ignore[method-assign]
    made["torch"] = torch_forward
    made["torch wrapped"] = TORCH_COMPILE(own_code(Tiny(), "torchwrapped"), backend=backend)
    safecompile.install(**QUIET)
    try:
        made["runner fn"] = torch.compile(own_code(tiny, "run"), backend=backend)
        in_place = own_code(Tiny(), "run")
        in_place.compile(backend=backend)
        made["runner compile()"] = in_place
        made["runner wrapped"] = torch.compile(own_code(Tiny(), "runwrapped"), backend=backend)
    finally:
        safecompile.uninstall()
    for name, fn in made.items():
        for _ in range(3):  # compile and warm
            fn(x)
        guard = getattr(fn, "safecompile", None) or getattr(
            getattr(fn, "_compiled_call_impl", None), "safecompile", None
        )
        if name.startswith(("runner", "decorator")):
            assert guard is not None, name
            assert guard.state == "compiled", name
    return {name: (lambda fn=fn: fn(x)) for name, fn in made.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="eager")
    parser.add_argument("--calls", type=int, default=2000, help="calls per sample")
    parser.add_argument("--rounds", type=int, default=31, help="samples per variant")
    args = parser.parse_args()
    overhead.clock = time.thread_time
    print(
        f"torch {torch.__version__}, backend={args.backend}, threads=1, {args.rounds} rounds x "
        f"{args.calls} calls, median per call, thread clock; load average "
        f"{os.getloadavg()[0]:.2f} at start"
    )
    x = torch.randn(4)
    with torch.no_grad():
        samples = measure(
            variants(args.backend, x), calls=args.calls, rounds=args.rounds, disabled=set()
        )
    us = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
    print("\n| case | variant | baseline | difference (IQR) |\n|---|---|---|---|")
    for case, variant, baseline in ROWS:
        d = paired(samples[variant], samples[baseline])
        print(
            f"| {case} | {us[variant]:.2f} µs | {us[baseline]:.2f} µs | "
            f"{d[0]:+.2f} µs ({d[1]:+.2f} … {d[2]:+.2f}) |"
        )
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
