"""eager, ``torch.compile`` and ``safe_compile`` at their defaults, side by side (issue #9).

For each workload, three variants serve the same traffic in one process on one thread
(``torch.set_num_threads(1)`` unless ``--threads``), under ``torch.no_grad()`` except
the training step:

- ``eager``: the model itself;
- ``torch.compile``: ``torch.compile(model)`` with no options, as a user writes it;
- ``safe_compile``: ``safe_compile(model)`` with no options: whatever its defaults are
  (shadow canary, the speed verdict that may roll the callable back to eager, ...).

Each compiled variant is its own copy of the model with a ``forward`` of its own code
object (dynamo caches per code object). Every variant first serves ``--warmup`` rounds
(compiles, canary checks), then safe_compile alone serves rounds until its speed
verdict's first round has ended (at most ``--verdict-wait`` seconds: up to ~1,200 calls
after the 128 warm-up calls; "first verdict" says by which call, or "pending"), then
``--rounds`` measured rounds; in each round every variant serves the workload's traffic
once, the variants in a rotating order, so machine noise hits them alike. So the table
is the steady state; the verdict's first round (its probes, and compiled serving until
it rolls back) is a one-off cost before it.

Each round is timed in wall time and, on one thread on CPU (``--clock cpu``, the
default there), in the thread's CPU time: every kernel runs on the calling thread then,
and CPU time leaves out the time the shared machine made the round wait for a core.
Throughput is read against the better of eager and ``torch.compile`` (the faster by
median round time): each round's time of that variant over the variant's own time in
the same round, median over rounds (IQR in brackets), by ``--clock`` and, in the next
column, by wall time. Targets: safe_compile at
>= 0.95x of the better on every workload, and still compiled wherever ``torch.compile``
beats eager by >= 5%. The last columns say how safe_compile ended: its state and how
many compiled graphs serve (or "all eager" after a rollback), and the share of measured
calls served eager.

Workloads (``--workloads``, comma-separated; default all):

- ``mlp-1``, ``mlp-32``, ``mlp-256``: 3x Linear(512) with ReLUs (bench/_models.py) at
  batch 1, 32 and 256;
- ``tiny6``: a function of six 8-element tensors (a few elementwise ops): per-call
  overhead dominates;
- ``train``: a training step of the MLP at batch 32: the guarded forward, then
  ``.sum().backward()`` (the backward pass is the caller's, timed in the round);
- ``block``: ``nn.TransformerEncoderLayer`` d_model 256, batch 8 x seq 128, key-padding
  mask (bench/_models.py);
- ``variable``: a d_model 64, 4-head block fed random (batch, seq) in 1..8 x 1..64, the
  same fixed-seed list of shapes every round (each variant compiles what its defaults
  make of them: dynamic shapes for torch.compile);
- ``bert``, ``gpt2``: tiny ``transformers`` BERT and GPT-2 from tests/zoo.py (hidden 32,
  2 layers), batch 8 x seq 32 with an attention mask.

    python bench/compare.py                          # inductor, every workload, warm FX cache:
                                                     # 46 s at load 0.5, 150-280 s at load 8-10
    python bench/compare.py --workloads mlp-1,bert --rounds 15
    python bench/compare.py --quick                  # smoke run: inductor, 3 workloads
    python bench/compare.py --device cuda --mode reduce-overhead   # on a GPU (bench/gpu.sh)
    python bench/compare.py --quick --backend aot_eager   # smoke run without inductor: 6 s
                                                          # at load 8, warm caches
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _models import MLP, Block  # bench/ is on sys.path when a bench runs as a script
from overhead import own_code
from torch import nn
from torch.utils import _pytree as pytree

from safecompile import safe_compile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import zoo  # tests/zoo.py: tiny transformers models, no downloads

warnings.filterwarnings("ignore")

EAGER, COMPILE, SAFE = "eager", "torch.compile", "safe_compile"
Call = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class Workload:
    """A model and the traffic of one round (each call's args and kwargs)."""

    describe: str
    model: Callable[[], nn.Module | Callable[..., Any]]
    traffic: Callable[[bool], list[Call]]  # quick -> the calls of one round
    train: bool = False  # a training step: the call, then .sum().backward(), with grad


def repeat(call: Call, n: int, quick: bool) -> list[Call]:
    return [call] * (max(1, n // 5) if quick else n)


def variable_traffic(quick: bool) -> list[Call]:
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    calls = []
    for _ in range(20 if quick else 100):
        batch, seq = rng.randint(1, 8), rng.randint(1, 64)
        x = torch.randn(batch, seq, 64, generator=gen)
        calls.append(((x, torch.zeros(batch, seq, dtype=torch.bool)), {}))
    return calls


def zoo_workload(build: Callable[[], zoo.ZooModel], n: int) -> Workload:
    model = build()
    return Workload(
        f"{model.name} (tests/zoo.py), batch 8 x seq 32, attention mask",
        lambda: model.module,
        lambda quick: repeat(model.inputs(8, 32), n, quick),
    )


def mlp(batch: int, n: int) -> Workload:
    return Workload(
        f"MLP 3x Linear(512), batch {batch}",
        lambda: MLP().eval(),
        lambda quick: repeat(((torch.randn(batch, 512),), {}), n, quick),
    )


def tiny6(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    e: torch.Tensor,
    f: torch.Tensor,
) -> torch.Tensor:
    """Six small inputs, a few elementwise ops: dynamo's per-call work dominates."""
    return torch.relu(a * b + c * d - e / (f.abs() + 1))


def tiny6_traffic(quick: bool) -> list[Call]:
    gen = torch.Generator().manual_seed(0)
    return repeat((tuple(torch.randn(8, generator=gen) for _ in range(6)), {}), 200, quick)


def block_call() -> Call:
    mask = torch.zeros(8, 128, dtype=torch.bool)
    mask[1:, 100:] = True
    return (torch.randn(8, 128, 256), mask), {}


WORKLOADS: dict[str, Callable[[], Workload]] = {
    "mlp-1": lambda: mlp(1, 200),
    "mlp-32": lambda: mlp(32, 50),
    "mlp-256": lambda: mlp(256, 10),
    "tiny6": lambda: Workload("tiny function, six 8-element tensors", lambda: tiny6, tiny6_traffic),
    "train": lambda: Workload(
        "MLP 3x Linear(512) training step, batch 32: forward + backward",
        lambda: MLP().train(),
        lambda quick: repeat(((torch.randn(32, 512),), {}), 20, quick),
        train=True,
    ),
    "block": lambda: Workload(
        "transformer block d256, batch 8 x seq 128, key-padding mask",
        lambda: Block().eval(),
        lambda quick: repeat(block_call(), 5, quick),
    ),
    "variable": lambda: Workload(
        "transformer block d64, random (batch, seq) in 1..8 x 1..64",
        lambda: Block(64, 4).eval(),
        variable_traffic,
    ),
    "bert": lambda: zoo_workload(zoo.bert, 20),
    "gpt2": lambda: zoo_workload(zoo.gpt2, 20),
}
QUICK = "mlp-1,tiny6,train"


@dataclass
class Variant:
    name: str
    fn: Callable[..., Any]
    times: list[float] = field(default_factory=list)  # per round, the clock read (--clock)
    walls: list[float] = field(default_factory=list)  # per round, wall time


def serve(v: Variant, traffic: list[Call], cpu: bool, cuda: bool = False) -> None:
    """One round: every call of the traffic, timed as a whole, in wall time and (``cpu``)
    the thread's CPU time (on CUDA, until the GPU has done the work, not its launch)."""
    if cuda:
        torch.cuda.synchronize()
    start, start_cpu = time.perf_counter(), time.thread_time()
    for args, kwargs in traffic:
        v.fn(*args, **kwargs)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    v.walls.append(wall)
    v.times.append(time.thread_time() - start_cpu if cpu else wall)


def interleaved(
    variants: list[Variant], traffic: list[Call], rounds: int, cpu: bool, cuda: bool = False
) -> None:
    """``rounds`` rounds, the variants in a rotating order; each round's time kept."""
    for r in range(rounds):
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            serve(v, traffic, cpu, cuda)


def verdict_pending(guarded: Any) -> bool:
    """Whether safe_compile's speed verdict is still in its first round."""
    report = guarded.safecompile.report()
    return (
        report["speed"] is not None
        and report["speed"]["rounds"] == 0
        and (report["state"] not in ("rolled_back", "disabled"))
    )


def on_device(traffic: list[Call], device: str) -> list[Call]:
    """The traffic's tensors moved to ``device`` (once, before any timing)."""
    if device == "cpu":
        return traffic
    return [pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), call) for call in traffic]


def paired_ratio(best: Variant, v: Variant, wall: bool = False) -> tuple[float, float, float]:
    """Median (and quartiles) over rounds of best's time / v's time: v's throughput as a
    ratio to the best's, paired within each round."""
    pairs = zip(best.walls, v.walls, strict=True) if wall else zip(best.times, v.times, strict=True)
    ratios = [b / t for b, t in pairs]
    if len(ratios) < 2:
        return ratios[0], ratios[0], ratios[0]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return statistics.median(ratios), q1, q3


def graphs_served(guarded: Any) -> str:
    """How many graphs serve compiled now (past the recompile limit: eager), or
    ``all eager`` after a rollback (the speed verdict's, or another)."""
    report = guarded.safecompile.report()
    if report["state"] in ("rolled_back", "disabled"):
        return f"all eager ({report['state']})"
    served = ["compiled" if g["compiled"] else "eager" for g in report["graphs"]]
    counts = {arm: served.count(arm) for arm in dict.fromkeys(served)}
    return ", ".join(f"{n} {arm}" for arm, n in counts.items()) or "no graph"


def training_step(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The caller's training step around a model: forward, then the backward pass."""

    def step(*args: Any, **kwargs: Any) -> None:
        fn(*args, **kwargs).sum().backward()

    return step


def run(name: str, args: argparse.Namespace) -> dict[str, Any]:
    workload = WORKLOADS[name]()
    traffic = on_device(workload.traffic(args.quick), args.device)
    model = workload.model()
    if isinstance(model, nn.Module):
        model = model.to(args.device)
    tag = name.replace("-", "_")
    mode = {"mode": args.mode} if args.mode else {}
    compiled = torch.compile(own_code(model, f"{tag}_compile"), backend=args.backend, **mode)
    guarded = safe_compile(own_code(model, f"{tag}_safe"), backend=args.backend, name=name, **mode)
    variants = [Variant(EAGER, model), Variant(COMPILE, compiled), Variant(SAFE, guarded)]
    if workload.train:
        for v in variants:
            v.fn = training_step(v.fn)
    started = time.perf_counter()
    cuda = args.device.startswith("cuda")
    cpu = args.clock == "cpu"
    safe = variants[2]
    with torch.set_grad_enabled(workload.train):
        interleaved(variants, traffic, args.warmup, cpu, cuda)
        waited = time.perf_counter()
        while verdict_pending(guarded) and time.perf_counter() - waited < args.verdict_wait:
            serve(safe, traffic, cpu, cuda)  # safe_compile alone, until its first verdict
        pending = verdict_pending(guarded)
        verdict_calls = guarded.safecompile.report()["speed"]["calls"]
        before = guarded.safecompile.stats()
        for v in variants:
            v.times.clear()
            v.walls.clear()
        interleaved(variants, traffic, args.rounds, cpu, cuda)
    after = guarded.safecompile.stats()
    eager_v, compile_v, _ = variants
    best = min((eager_v, compile_v), key=lambda v: statistics.median(v.times))
    calls = after.calls - before.calls
    return {
        "name": name,
        "describe": workload.describe,
        "calls": len(traffic),
        "median_s": {v.name: statistics.median(v.times) for v in variants},
        "best": best.name,
        "ratio": {v.name: paired_ratio(best, v) for v in variants},
        "wall_ratio": paired_ratio(best, variants[2], wall=True),
        "first_verdict": "pending" if pending else f"by call {verdict_calls}",
        "compile_gain": paired_ratio(eager_v, compile_v)[0],
        "state": guarded.safecompile.state.value,
        "graphs": graphs_served(guarded),
        "eager_share": (after.eager_calls - before.eager_calls) / max(1, calls),
        "wall_s": time.perf_counter() - started,
    }


def verdict(r: dict[str, Any]) -> str:
    """Whether this workload meets the issue's targets."""
    ok = r["ratio"][SAFE][0] >= 0.95
    wins = r["compile_gain"] >= 1.05
    stayed = "compiled" in r["graphs"] and r["state"] not in ("rolled_back", "disabled")
    notes = [">= 0.95x" if ok else "MISSED 0.95x"]
    if wins:
        notes.append("compiled wins, stayed compiled" if stayed else "compiled wins, LEFT IT")
    return "; ".join(notes)


def cell(ratio: tuple[float, float, float]) -> str:
    return f"{ratio[0]:.3f}x ({ratio[1]:.2f}-{ratio[2]:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--workloads", default=None, help=f"default all: {','.join(WORKLOADS)}")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds (default 31)")
    parser.add_argument("--warmup", type=int, default=None, help="rounds first (default 10)")
    parser.add_argument(
        "--verdict-wait",
        type=float,
        default=None,
        help="then at most this many seconds of safe_compile alone until its speed verdict's "
        "first round ends (default 20; 0 with --quick)",
    )
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default=None,
        help="what ranks and compares the variants: the thread's CPU time (default on one "
        "thread on CPU) or wall time (the default otherwise); the other table column is "
        "always wall time",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--mode", default=None, help="torch.compile's mode, for both")
    parser.add_argument(
        "--quick", action="store_true", help=f"smoke run: {QUICK}, 3 rounds, small traffic"
    )
    args = parser.parse_args()
    args.rounds = args.rounds or (3 if args.quick else 31)
    args.warmup = args.warmup or (2 if args.quick else 10)
    if args.verdict_wait is None:
        args.verdict_wait = 0.0 if args.quick else 20.0
    if args.clock is None:
        args.clock = "cpu" if args.threads == 1 and args.device == "cpu" else "wall"
    names = [
        w.strip()
        for w in (args.workloads or (QUICK if args.quick else ",".join(WORKLOADS))).split(",")
        if w.strip()
    ]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    print(
        f"torch {torch.__version__}, backend={args.backend}, mode={args.mode}, "
        f"device={args.device}, threads={torch.get_num_threads()}, "
        f"{args.warmup} warmup rounds, safe_compile alone up to {args.verdict_wait:.0f} s "
        f"until its first speed verdict, {args.rounds} measured rounds, variants interleaved, "
        f"clock={args.clock}; "
        f"load average {os.getloadavg()[0]:.2f} at start",
        flush=True,
    )
    print(
        "\n| workload | calls/round | eager ms/round | torch.compile ms/round | safe_compile "
        "ms/round | better of the two | torch.compile vs eager | safe_compile vs better "
        "(IQR) | same, wall time (IQR) | first verdict | safe_compile state | graphs serving "
        "| eager share | targets |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    for name in names:
        r = run(name, args)
        ms = {k: v * 1e3 for k, v in r["median_s"].items()}
        print(
            f"| {r['describe']} | {r['calls']} | {ms[EAGER]:.2f} | {ms[COMPILE]:.2f} | "
            f"{ms[SAFE]:.2f} | {r['best']} | {r['compile_gain']:.2f}x | {cell(r['ratio'][SAFE])} "
            f"| {cell(r['wall_ratio'])} | {r['first_verdict']} | {r['state']} | {r['graphs']} "
            f"| {r['eager_share']:.1%} | {verdict(r)} |",
            flush=True,
        )
    print(
        f"\nload average {os.getloadavg()[0]:.2f} at the end; total wall time "
        f"{time.perf_counter() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
