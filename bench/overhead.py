"""Per-call cost of the guard, side by side in one run.

For a tiny function (``x + 1`` on 4 elements), the same as a module (what a guarded
module adds: ``Module.__call__``) and a small MLP (3x Linear(512), batch 1), measures the
median per-call time of:

- plain eager,
- the bare ``torch.compile``'d function (for the MLP: a copy whose ``forward`` is replaced
  by ``torch.compile(module.forward)``, called through ``Module.__call__``, which is
  exactly how the guard installs itself on a module),
- the guarded function (``safe_compile``, shadow checks off),
- the guarded function with the kill switch on (``SAFECOMPILE_DISABLE=1``: eager path),
- the guarded function rolled back (``rollback()``, no trial due: eager path),

interleaving the variants round by round, in a rotating order, so machine noise hits
them alike. Time is the calling thread's CPU time (``time.thread_time``, ``--clock
thread``, the default): the work a call does, without the time the thread waited for a
core while other processes ran (on a shared, loaded machine that wait is most of the
noise). ``--clock wall`` times with ``time.perf_counter`` instead. Every compiled
variant is a copy with a code object of its own (dynamo keeps its cache entries per code
object). Prints the medians and the differences the issue's
targets are about: guard - bare compiled (target ≤ 1 µs) and kill-switched - eager
(target ≤ 1 µs), and rolled back - eager. The differences are paired per round (both
variants timed in the same round); the table gives their median over rounds and, in
brackets, their interquartile range.

    python bench/overhead.py                              # inductor (cold compiles ~10 s each)
    python bench/overhead.py --backend eager --rounds 3   # quick smoke run (~10 s)
    python bench/overhead.py --split                      # also: where the guard's time goes
    python bench/overhead.py --clock wall                 # wall time (an idle machine)
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from _models import MLP  # bench/ is on sys.path when a bench runs as a script

from safecompile import ENV_VAR, Rollback, safe_compile

warnings.filterwarnings("ignore")
torch.set_num_threads(1)

EAGER = "eager"
BARE = "bare compiled"
GUARDED = "guarded"
KILLED = "guarded, kill switch on"
ROLLED = "guarded, rolled back"
ISOLATED = "bare, with the guard's compile options"
WRAPPED = "the guard's compiled function, no guard frame"


def tiny(x: torch.Tensor) -> torch.Tensor:
    return x + 1


class Tiny(torch.nn.Module):
    """``x + 1`` as a module: what a guarded module adds over a guarded function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


CLOCKS: dict[str, Callable[[], float]] = {"thread": time.thread_time, "wall": time.perf_counter}
clock = CLOCKS["thread"]


def per_call(fn: Callable[[], Any], calls: int) -> float:
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls


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


def own_code(fn: Any, tag: str) -> Any:
    """A copy of ``fn`` (a function, or a module: its ``forward``) with a code object of its
    own: dynamo keeps its cache entries on the code object, so variants that compile the
    same code would share one entry list (and one recompile limit)."""
    if isinstance(fn, torch.nn.Module):
        cls = type(fn)
        forward = own_code(cls.forward, tag)
        clone = copy.deepcopy(fn)
        clone.__class__ = type(f"{cls.__name__}_{tag}", (cls,), {"forward": forward})
        return clone
    name = f"{fn.__name__}_{tag}"
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def bare_compile(fn: Callable[..., Any], backend: str, **options: Any) -> Callable[..., Any]:
    """``torch.compile`` as the guard uses it: a module keeps ``Module.__call__`` and gets
    a compiled bound ``forward`` as an instance attribute; a function is compiled as is."""
    if isinstance(fn, torch.nn.Module):
        fn.forward = torch.compile(fn.forward, backend=backend, **options)  # type: ignore[method-assign]
        return fn
    return torch.compile(fn, backend=backend, **options)


def split_variants(
    fn: Callable[..., Any], guarded: Any, x: torch.Tensor, backend: str
) -> dict[str, Callable[[], Any]]:
    """``--split``: the guard's layers one at a time (a plain function only).

    - torch.compile with the options the guard passes (``isolate_recompiles``, its own
      recompile limit) and no backend wrapper;
    - the guard's compiled function called directly: torch's call plus the guard's
      per-graph wrapper (``GuardBackend._instrument``), without the guard's own frame.
    """
    iso = bare_compile(
        own_code(fn, "isolated"), backend, isolate_recompiles=True, recompile_limit=18
    )
    # internal: the compiled function the guard calls
    inner = guarded.safecompile._engine.gate.compiled
    for _ in range(3):
        iso(x)
    return {ISOLATED: lambda: iso(x), WRAPPED: lambda: inner(x)}


def run_case(
    label: str,
    fn: Callable[..., Any],
    x: torch.Tensor,
    *,
    backend: str,
    calls: int,
    rounds: int,
    split: bool = False,
) -> dict[str, list[float]]:
    # one copy per variant (a module is guarded in place), each with its own code object
    bare = bare_compile(own_code(fn, "bare"), backend)
    guarded = safe_compile(
        own_code(fn, "guarded"),
        backend=backend,
        shadow=None,
        rollback=Rollback(slower_ratio=None),  # overhead of the guard, not of speed probes
        name=f"bench.{label}",
    )
    killed = safe_compile(
        own_code(fn, "killed"), backend=backend, shadow=None, name=f"bench.{label}.killed"
    )
    rolled = safe_compile(
        own_code(fn, "rolled"), backend=backend, shadow=None, name=f"bench.{label}.rolled"
    )
    with torch.no_grad():
        for _ in range(3):  # compile and warm every variant
            bare(x)
            guarded(x)
            rolled(x)
        assert guarded.safecompile.state == "compiled", guarded.safecompile.report()
        rolled.safecompile.rollback()  # no retry_after: eager serves it from now on
        variants = {
            EAGER: lambda: fn(x),
            BARE: lambda: bare(x),
            GUARDED: lambda: guarded(x),
            KILLED: lambda: killed(x),
            ROLLED: lambda: rolled(x),
        }
        if split:
            variants.update(split_variants(fn, guarded, x, backend))
        samples = measure(variants, calls=calls, rounds=rounds, disabled={KILLED})
    killed_stats = killed.safecompile.stats()  # the switch is off again: state says so
    assert killed_stats.compiled_calls == 0 < killed_stats.eager_calls, killed_stats
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
    parser.add_argument(
        "--split", action="store_true", help="also time the guard's layers (tiny case)"
    )
    parser.add_argument(
        "--clock", choices=sorted(CLOCKS), default="thread", help="thread CPU time or wall time"
    )
    args = parser.parse_args()
    global clock  # one clock for the whole run, chosen here
    clock = CLOCKS[args.clock]
    print(
        f"torch {torch.__version__}, backend={args.backend}, threads=1, {args.rounds} rounds x "
        f"{args.calls} calls (MLP: a tenth), median per call, {args.clock} clock; load average "
        f"{os.getloadavg()[0]:.2f} at start"
    )
    cases = {
        "tiny (x + 1, 4 elements)": ("tiny", tiny, torch.randn(4)),
        "tiny module (x + 1, 4 elements)": ("tiny_module", Tiny(), torch.randn(4)),
        "MLP 3x512, batch 1": ("MLP", MLP().eval(), torch.randn(1, 512)),
    }
    print(
        "\n| case | eager | bare compiled | guarded | kill switch on | guard - bare "
        "(IQR) | kill switch - eager (IQR) | rolled back - eager (IQR) |"
        "\n|---|---|---|---|---|---|---|---|"
    )
    splits: dict[str, list[float]] = {}
    for label, (key, fn, x) in cases.items():
        tiny_case = key == "tiny"  # the --split case
        calls = args.calls if key.startswith("tiny") else max(args.calls // 10, 50)
        s = run_case(
            key,
            fn,
            x,
            backend=args.backend,
            calls=calls,
            rounds=args.rounds,
            split=args.split and tiny_case,
        )
        if args.split and tiny_case:
            splits = s
        us = {k: statistics.median(v) * 1e6 for k, v in s.items()}
        guard = paired(s[GUARDED], s[BARE])
        kill = paired(s[KILLED], s[EAGER])
        rolled = paired(s[ROLLED], s[EAGER])
        print(
            f"| {label} | {us[EAGER]:.2f} µs | {us[BARE]:.2f} µs | {us[GUARDED]:.2f} µs | "
            f"{us[KILLED]:.2f} µs | {guard[0]:+.2f} µs ({guard[1]:+.2f} … {guard[2]:+.2f}) | "
            f"{kill[0]:+.2f} µs ({kill[1]:+.2f} … {kill[2]:+.2f}) | "
            f"{rolled[0]:+.2f} µs ({rolled[1]:+.2f} … {rolled[2]:+.2f}) |",
            flush=True,
        )
    if splits:
        print_split(splits)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


def print_split(s: dict[str, list[float]]) -> None:
    """Each layer of the guard over the previous one, paired per round (tiny case)."""
    print(
        "\nThe guard's layers, tiny case (each over the previous, per-round paired median "
        "and IQR):\n\n| layer | median per call | over the previous |\n|---|---|---|"
    )
    previous = None
    for name in (BARE, ISOLATED, WRAPPED, GUARDED):
        over = "—"
        if previous is not None:
            d = paired(s[name], s[previous])
            over = f"{d[0]:+.2f} µs ({d[1]:+.2f} … {d[2]:+.2f})"
        print(f"| {name} | {statistics.median(s[name]) * 1e6:.2f} µs | {over} |")
        previous = name


if __name__ == "__main__":
    main()
