"""Per-call cost of the guard, side by side in one run.

For a tiny function (``x + 1`` on 4 elements) and a small MLP (3x Linear(512), batch 1),
measures the median per-call time of:

- plain eager,
- the bare ``torch.compile``'d function (for the MLP: a copy whose ``forward`` is replaced
  by ``torch.compile(module.forward)``, called through ``Module.__call__``, which is
  exactly how the guard installs itself on a module),
- the guarded function (``safe_compile``, shadow checks off),
- the guarded function with the kill switch on (``SAFECOMPILE_DISABLE=1``: eager path),

interleaving the variants round by round, in a rotating order, so machine noise hits
them alike. Prints the medians and the differences the issue's targets are about:
guard - bare compiled (target ≤ 1 µs) and kill-switched - eager (target ≤ 1 µs). The
differences are paired per round (both variants timed in the same round); the table gives
their median over rounds and, in brackets, their interquartile range.

    python bench/overhead.py                              # inductor (cold compiles ~10 s each)
    python bench/overhead.py --backend eager --rounds 3   # quick smoke run (~10 s)
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from _models import MLP  # bench/ is on sys.path when a bench runs as a script

from safecompile import ENV_VAR, safe_compile

warnings.filterwarnings("ignore")
torch.set_num_threads(1)

EAGER = "eager"
BARE = "bare compiled"
GUARDED = "guarded"
KILLED = "guarded, kill switch on"


def tiny(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def per_call(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def measure(
    variants: dict[str, Callable[[], Any]], *, calls: int, rounds: int, disabled: set[str]
) -> dict[str, list[float]]:
    """Per-call seconds of every variant, one sample per round, in a rotating order."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            if name in disabled:
                os.environ[ENV_VAR] = "1"
            try:
                samples[name].append(per_call(variants[name], calls))
            finally:
                os.environ.pop(ENV_VAR, None)
    return samples


def bare_compile(fn: Callable[..., Any], backend: str) -> Callable[..., Any]:
    """``torch.compile`` as the guard uses it: a module keeps ``Module.__call__`` and gets
    a compiled bound ``forward`` as an instance attribute; a function is compiled as is."""
    if isinstance(fn, torch.nn.Module):
        module = copy.deepcopy(fn)
        module.forward = torch.compile(module.forward, backend=backend)  # type: ignore[method-assign]
        return module
    return torch.compile(fn, backend=backend)


def run_case(
    label: str, fn: Callable[..., Any], x: torch.Tensor, *, backend: str, calls: int, rounds: int
) -> dict[str, list[float]]:
    def fresh() -> Callable[..., Any]:  # a module is guarded in place: one copy per variant
        return copy.deepcopy(fn) if isinstance(fn, torch.nn.Module) else fn

    bare = bare_compile(fn, backend)
    guarded = safe_compile(fresh(), backend=backend, shadow=None, name=f"bench.{label}")
    killed = safe_compile(fresh(), backend=backend, shadow=None, name=f"bench.{label}.killed")
    with torch.no_grad():
        for _ in range(3):  # compile and warm every variant
            bare(x)
            guarded(x)
        assert guarded.safecompile.state == "compiled", guarded.safecompile.report()
        variants = {
            EAGER: lambda: fn(x),
            BARE: lambda: bare(x),
            GUARDED: lambda: guarded(x),
            KILLED: lambda: killed(x),
        }
        samples = measure(variants, calls=calls, rounds=rounds, disabled={KILLED})
    assert killed.safecompile.state == "disabled"
    stats = guarded.safecompile.stats()
    assert stats.eager_calls == 0, stats  # every guarded call took the compiled path
    return samples


def paired(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Median and interquartile range of the per-round differences a - b, in µs."""
    diffs = [(x - y) * 1e6 for x, y in zip(a, b, strict=True)]
    if len(diffs) < 2:
        return diffs[0], diffs[0], diffs[0]
    q1, _, q3 = statistics.quantiles(diffs, n=4)
    return statistics.median(diffs), q1, q3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--calls", type=int, default=2000, help="calls per sample (tiny case)")
    parser.add_argument("--rounds", type=int, default=31, help="samples per variant")
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, backend={args.backend}, threads=1, {args.rounds} rounds x "
        f"{args.calls} calls (MLP: a tenth), median per call; load average "
        f"{os.getloadavg()[0]:.2f} at start"
    )
    cases = {
        "tiny (x + 1, 4 elements)": (tiny, torch.randn(4)),
        "MLP 3x512, batch 1": (MLP().eval(), torch.randn(1, 512)),
    }
    print(
        "\n| case | eager | bare compiled | guarded | kill switch on | guard - bare "
        "(IQR) | kill switch - eager (IQR) |\n|---|---|---|---|---|---|---|"
    )
    for label, (fn, x) in cases.items():
        calls = args.calls if "tiny" in label else max(args.calls // 10, 50)
        s = run_case(label.split()[0], fn, x, backend=args.backend, calls=calls, rounds=args.rounds)
        us = {k: statistics.median(v) * 1e6 for k, v in s.items()}
        guard = paired(s[GUARDED], s[BARE])
        kill = paired(s[KILLED], s[EAGER])
        print(
            f"| {label} | {us[EAGER]:.2f} µs | {us[BARE]:.2f} µs | {us[GUARDED]:.2f} µs | "
            f"{us[KILLED]:.2f} µs | {guard[0]:+.2f} µs ({guard[1]:+.2f} … {guard[2]:+.2f}) | "
            f"{kill[0]:+.2f} µs ({kill[1]:+.2f} … {kill[2]:+.2f}) |",
            flush=True,
        )
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
