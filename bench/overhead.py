"""Per-call cost of the guard, side by side in one run.

For a tiny function (``x + 1`` on 4 elements) and a small MLP (3x Linear(512), batch 1),
measures the median per-call time of:

- plain eager,
- the bare ``torch.compile``'d function,
- the guarded function (``safe_compile``, shadow checks off),
- the guarded function with the kill switch on (``SAFECOMPILE_DISABLE=1``: eager path),

interleaving the variants round by round so machine noise hits them alike. Prints the
medians and the differences the issue's targets are about: guard - bare compiled
(target ≤ 1 µs) and kill-switched - eager (target ≤ 1 µs).

    python bench/overhead.py                 # inductor (cold compiles ~10 s each here)
    python bench/overhead.py --backend eager # quick
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


def tiny(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def per_call(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def measure(
    variants: dict[str, Callable[[], Any]], *, calls: int, rounds: int, disabled: set[str]
) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            if name in disabled:
                os.environ[ENV_VAR] = "1"
            try:
                samples[name].append(per_call(fn, calls))
            finally:
                os.environ.pop(ENV_VAR, None)
    return {name: statistics.median(s) for name, s in samples.items()}


def run_case(
    label: str, fn: Callable[..., Any], x: torch.Tensor, *, backend: str, calls: int, rounds: int
) -> dict[str, float]:
    def fresh() -> Callable[..., Any]:  # a module is guarded in place: one copy per variant
        return copy.deepcopy(fn) if isinstance(fn, torch.nn.Module) else fn

    bare = torch.compile(fresh(), backend=backend)
    guarded = safe_compile(fresh(), backend=backend, shadow=None, name=f"bench.{label}")
    killed = safe_compile(fresh(), backend=backend, shadow=None, name=f"bench.{label}.killed")
    with torch.no_grad():
        for _ in range(3):  # compile and warm every variant
            bare(x)
            guarded(x)
        assert guarded.safecompile.state == "compiled", guarded.safecompile.report()
        variants = {
            "eager": lambda: fn(x),
            "bare compiled": lambda: bare(x),
            "guarded": lambda: guarded(x),
            "guarded, kill switch on": lambda: killed(x),
        }
        medians = measure(
            variants, calls=calls, rounds=rounds, disabled={"guarded, kill switch on"}
        )
    assert killed.safecompile.state == "disabled"
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--calls", type=int, default=2000, help="calls per sample")
    parser.add_argument("--rounds", type=int, default=15, help="samples per variant")
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, backend={args.backend}, threads=1, "
        f"{args.rounds} rounds x {args.calls} calls, median per call"
    )
    cases = {
        "tiny (x + 1, 4 elements)": (tiny, torch.randn(4)),
        "MLP 3x512, batch 1": (MLP().eval(), torch.randn(1, 512)),
    }
    print(
        "\n| case | eager | bare compiled | guarded | kill switch on | guard - bare | "
        "kill switch - eager |\n|---|---|---|---|---|---|---|"
    )
    for label, (fn, x) in cases.items():
        calls = args.calls if "tiny" in label else max(args.calls // 10, 50)
        m = run_case(label.split()[0], fn, x, backend=args.backend, calls=calls, rounds=args.rounds)
        us = {k: v * 1e6 for k, v in m.items()}
        print(
            f"| {label} | {us['eager']:.2f} µs | {us['bare compiled']:.2f} µs | "
            f"{us['guarded']:.2f} µs | {us['guarded, kill switch on']:.2f} µs | "
            f"{us['guarded'] - us['bare compiled']:+.2f} µs | "
            f"{us['guarded, kill switch on'] - us['eager']:+.2f} µs |"
        )


if __name__ == "__main__":
    main()
