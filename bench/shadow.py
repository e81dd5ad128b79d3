"""Cost of shadow checks, side by side in one run.

On a small MLP (3x Linear(512), batch 32) and a transformer block
(``nn.TransformerEncoderLayer`` d_model=256, batch 8 x seq 128), under ``torch.no_grad()``,
measures throughput and per-call latency (p50, p99) of the guarded module with:

- shadow checks off (``shadow=None``), twice: the second copy is an A/A control whose
  difference from the first is the noise floor of this run,
- ``Shadow()`` defaults and ``Shadow(every=1)``, each in ``mode="sync"`` and ``"async"``.

Every variant is its own compiled copy of the model. All of them are warmed up past the
canary first, so the main table is steady state; the canary phase (the first ``canary``
calls of a new graph, each one checked) is reported in a table of its own. Variants are
interleaved round by round, in a rotating order, so machine noise hits them alike; the
"vs shadow off" figures are per-round paired ratios (throughput: median over rounds) and
ratios of pooled percentiles (p99). Async checks still queued at the end of a variant's
turn are drained outside the timed window (so they cannot slow the next variant down);
that drain time is printed. "slow calls" is the share of calls that took more than twice
shadow off's median: the population p99 looks at (a check every 256 calls slows about 1
to 2 calls in 256, just under p99's 1%).

``torch.set_num_threads(1)``: one intra-op thread for the caller and for the async worker,
so the two compete for the machine's 2 cores like two request threads would.

Issue #3 targets: ``Shadow()`` defaults cost <= 3% throughput; async <= 5% on p99.

    python bench/shadow.py                      # inductor (cold compiles ~10 s here)
    python bench/shadow.py --backend aot_eager  # no inductor, full size (~4 min)
    python bench/shadow.py --backend aot_eager --rounds 2 --scale 0.1  # smoke run (~20 s)
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from _models import MLP  # noqa: E402  (bench/ is on sys.path when run as a script)

from safecompile import Shadow, Stats, safe_compile  # noqa: E402
from safecompile.guard._controller import Controller  # noqa: E402
from safecompile.guard.shadow import drain  # noqa: E402

torch.set_num_threads(1)

OFF = "shadow off"
CONTROL = "shadow off (A/A control)"
VARIANTS: dict[str, Shadow | None] = {
    OFF: None,
    CONTROL: None,
    "sync, defaults": Shadow(),
    "sync, every=1": Shadow(every=1),
    "async, defaults": Shadow(mode="async"),
    "async, every=1": Shadow(mode="async", every=1),
}


def transformer_block() -> torch.nn.Module:
    block: torch.nn.Module = torch.nn.TransformerEncoderLayer(
        d_model=256, nhead=8, dim_feedforward=1024, dropout=0.0, batch_first=True
    )
    return block


@dataclass
class Case:
    label: str
    build: Callable[[], torch.nn.Module]
    shape: tuple[int, ...]
    calls: int  # per variant per round
    rounds: int


@dataclass
class Samples:
    latencies: list[float] = field(default_factory=list)  # seconds, every timed call
    round_s: list[float] = field(default_factory=list)  # wall time of each round's calls
    drain_s: float = 0.0
    compile_s: float = 0.0
    canary: list[float] = field(default_factory=list)  # the calls after the compiling one


def timed_calls(fn: Callable[[], Any], calls: int, into: list[float]) -> float:
    clock = time.perf_counter
    start = clock()
    for _ in range(calls):
        t0 = clock()
        fn()
        into.append(clock() - t0)
    return clock() - start


def pct(ordered: list[float], q: float) -> float:
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def run_case(case: Case, *, backend: str) -> None:
    base = case.build().eval()
    x = torch.randn(*case.shape)
    models: dict[str, torch.nn.Module] = {
        name: safe_compile(
            copy.deepcopy(base), backend=backend, shadow=shadow, name=f"bench.shadow.{name}"
        )
        for name, shadow in VARIANTS.items()
    }
    ctl: dict[str, Controller] = {
        name: m.safecompile  # type: ignore[misc]
        for name, m in models.items()
    }
    call = {name: functools.partial(m, x) for name, m in models.items()}
    samples = {name: Samples() for name in models}
    canary = Shadow().canary
    with torch.no_grad():
        # 1. compile each variant, then time its canary phase: calls 2..canary, each one
        #    checked where shadow is on (the compiling call is checked too, not timed here).
        for name in models:
            t0 = time.perf_counter()
            call[name]()
            samples[name].compile_s = time.perf_counter() - t0
            timed_calls(call[name], canary - 1, samples[name].canary)
            drain()
        # 2. warm up past the canary into steady state.
        for name in models:
            for _ in range(max(case.calls, 2 * canary)):
                call[name]()
            drain()
            assert ctl[name].state == "compiled", (name, ctl[name].report())
        before = {name: c.stats() for name, c in ctl.items()}
        # 3. measure, interleaved, in a rotating order.
        names = list(models)
        for r in range(case.rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                s = samples[name]
                s.round_s.append(timed_calls(call[name], case.calls, s.latencies))
                t0 = time.perf_counter()
                drain()
                s.drain_s += time.perf_counter() - t0
    after = {name: c.stats() for name, c in ctl.items()}
    states = {name: c.state.value for name, c in ctl.items()}
    report(case, samples, before, after, states, canary=canary)


def report(
    case: Case,
    samples: dict[str, Samples],
    before: dict[str, Stats],
    after: dict[str, Stats],
    states: dict[str, str],
    *,
    canary: int,
) -> None:
    off = samples[OFF]
    off_sorted = sorted(off.latencies)
    off_p99 = pct(off_sorted, 0.99)
    slow_at = 2 * pct(off_sorted, 0.50)
    measured = case.calls * case.rounds
    print(f"\n### {case.label}: {case.rounds} rounds x {case.calls} calls per variant\n")
    print(
        "| variant | calls/s | p50 | p99 | throughput vs shadow off | p99 vs shadow off | "
        "slow calls (> 2x off p50) | checks done / skipped | async drain |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, s in samples.items():
        ordered = sorted(s.latencies)
        p50, p99 = pct(ordered, 0.50), pct(ordered, 0.99)
        per_round = [case.calls / t for t in s.round_s]
        paired = [(t_off / t) - 1.0 for t, t_off in zip(s.round_s, off.round_s, strict=True)]
        tput = statistics.median(per_round)
        checks = after[name].shadow_checks - before[name].shadow_checks
        skipped = after[name].shadow_skipped - before[name].shadow_skipped
        flag = "" if states[name] == "compiled" else f" **state={states[name]}**"
        vs = "—" if name == OFF else f"{100 * statistics.median(paired):+.1f}%"
        vs99 = "—" if name == OFF else f"{100 * (p99 / off_p99 - 1):+.1f}%"
        drain_cell = f"{s.drain_s * 1e3:.0f} ms" if name.startswith("async") else "—"
        slow = 100 * sum(t > slow_at for t in ordered) / len(ordered)
        print(
            f"| {name}{flag} | {tput:,.0f} | {p50 * 1e6:,.0f} µs | {p99 * 1e6:,.0f} µs | "
            f"{vs} | {vs99} | {slow:.2f}% | {checks} / {skipped} of {measured} calls | "
            f"{drain_cell} |"
        )
    print(
        f"\nCanary phase: the compiling call, then calls 2..{canary}, each checked (shadow "
        f"off: the same calls, unchecked). Extra = their time minus shadow off's.\n"
    )
    print(
        f"| variant | compile (1st call) | calls 2..{canary}, mean | "
        f"extra over {canary - 1} calls |"
    )
    print("|---|---|---|---|")
    off_mean = statistics.fmean(off.canary)
    for name, s in samples.items():
        mean = statistics.fmean(s.canary)
        extra = "—" if name == OFF else f"{(mean - off_mean) * len(s.canary) * 1e3:+.2f} ms"
        print(f"| {name} | {s.compile_s:.1f} s | {mean * 1e6:,.0f} µs | {extra} |")
    sync1 = samples["sync, every=1"]
    per_check = statistics.median(sync1.latencies) - statistics.median(off.latencies)
    ab = after["sync, every=1"].extra.get("latency", {})
    ab_c, ab_e = ab.get("compiled", {}).get("p50"), ab.get("eager", {}).get("p50")
    print(
        f"\nSteady-state cost of one sync check (p50 of every=1 minus shadow off): "
        f"{per_check * 1e6:,.0f} µs, so the {canary}-call canary costs about "
        f"{canary * per_check * 1e3:.2f} ms per new graph."
    )
    every = Shadow().every
    off_call = statistics.median(off.latencies)
    print(
        f"At the default every={every}, that per-check cost predicts a sync throughput cost of "
        f"{100 * per_check / (every * off_call + per_check):.2f}% (one check per {every} calls)."
    )
    if ab_c and ab_e:
        print(
            f"The shadow's own A/B figures (sync, every=1): compiled p50 {ab_c * 1e6:,.0f} µs, "
            f"eager p50 {ab_e * 1e6:,.0f} µs ({ab_c / ab_e:.2f}x)."
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per case")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply calls per round")
    args = parser.parse_args()
    cases = [
        Case("MLP 3x Linear(512), batch 32", MLP, (32, 512), calls=256, rounds=30),
        Case(
            "TransformerEncoderLayer d256, batch 8 x seq 128",
            transformer_block,
            (8, 128, 256),
            calls=32,
            rounds=20,
        ),
    ]
    load = os.getloadavg()
    print(
        f"torch {torch.__version__}, backend={args.backend}, torch threads="
        f"{torch.get_num_threads()}, {os.cpu_count()} CPUs, load average {load[0]:.2f} "
        f"at start; no_grad; variants interleaved round by round"
    )
    start = time.perf_counter()
    for case in cases:
        if args.rounds is not None:
            case.rounds = args.rounds
        case.calls = max(1, round(case.calls * args.scale))
        run_case(case, backend=args.backend)
    load = os.getloadavg()
    print(f"\nTotal {time.perf_counter() - start:.0f} s; load average {load[0]:.2f} at the end.")


if __name__ == "__main__":
    main()
