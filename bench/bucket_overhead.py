"""Hot-path cost of ``Bucketer.plan()`` (the per-call bucketing decision).

Run: ``.venv/bin/python bench/bucket_overhead.py``. Prints the median of repeated
``timeit`` runs, in microseconds per call, for one and two bucketed arguments; the
memo is warm (the shapes were seen before), as on steady traffic. Also prints the
cold (first time a shape signature is seen) cost and ``pad``/``unpad`` costs, and the
bucketed call's own cost on the serving example's request (``pad`` of its two inputs and
``unpad`` of its output, around a stand-in for the model; the row below it is the
stand-in alone).

``--instructions`` counts the serving rows in instructions per call under valgrind's
callgrind instead (time on a shared machine is noisy; instruction counts are not): about
a minute.
"""

from __future__ import annotations

import gc
import os
import statistics
import subprocess
import sys
import tempfile
import timeit
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from safecompile.base.policies import Buckets, pow2  # noqa: E402
from safecompile.shapes.buckets import Bucketer  # noqa: E402

NUMBER = 20_000
REPEAT = 15
_CHILD = "SAFECOMPILE_BENCH_CALLGRIND_CALLS"


def median_us(fn: Any, number: int = NUMBER) -> tuple[float, float]:
    """(median, min) microseconds per call over REPEAT timeit runs."""
    runs = [t / number * 1e6 for t in timeit.repeat(fn, number=number, repeat=REPEAT)]
    return statistics.median(runs), min(runs)


def serving_calls() -> tuple[Any, Any]:
    """The serving example's request (examples/serving.py), tokens and mask 12 -> 16: the
    bucketed call's own work around a stand-in for the model (``pad`` of both inputs, a
    cast of the padded tokens, ``unpad``), and the stand-in alone."""

    def tagger(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return tokens

    kwargs: dict[str, Any] = {}
    bs = Bucketer(Buckets(dims={"tokens": 1, "mask": 1}, sizes=pow2(8, 128)), tagger)
    request: tuple[Any, ...] = (
        torch.randint(0, 1000, (1, 12)),
        torch.ones(1, 12, dtype=torch.bool),
    )
    plan = bs.plan(request, kwargs)
    assert plan is not None
    (padded_tokens, _), _ = bs.pad(plan, request, kwargs)
    scores = padded_tokens.float()
    spec = bs.learn_cuts(plan, scores, request[0].float())

    def round_trip() -> Any:
        return bs.unpad(plan, bs.pad(plan, request, kwargs)[0][0].float(), spec)

    return round_trip, padded_tokens.float


def serving_rows() -> list[tuple[str, tuple[float, float]]]:
    round_trip, alone = serving_calls()
    return [
        ("serving request: pad 2 args 1x12 -> 1x16, cast, unpad", median_us(round_trip, 5000)),
        ("  the cast alone (of the padded 1x16 tokens)", median_us(alone, 5000)),
    ]


def count_child(calls: int) -> None:
    """Under callgrind: each stretch of calls dumped to its own file (N, then 2N)."""
    round_trip, alone = serving_calls()
    for fn in (round_trip, alone):
        for _ in range(100):
            fn()
        for n in (calls, 2 * calls):
            gc.collect()
            gc.disable()
            torch._C._valgrind_toggle()
            for _ in range(n):
                fn()
            torch._C._valgrind_toggle_and_dump_stats()
            gc.enable()


def count_instructions(calls: int) -> None:
    """Instructions per call of the serving rows, by valgrind's callgrind (load-proof)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "cg.out")
        env = dict(os.environ, **{_CHILD: str(calls)}, PYTHONHASHSEED="0")
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--collect-atstart=no",
                f"--callgrind-out-file={out}",
                sys.executable,
                __file__,
            ],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        counts = []
        for i in range(4):
            text = Path(f"{out}.{i + 1}").read_text()
            line = next(x for x in text.splitlines() if x.startswith(("summary:", "totals:")))
            counts.append(int(line.split()[1]))
    print(f"torch {torch.__version__}; instructions per call ((2N - N) / N, N = {calls})")
    names = ("serving request: pad, cast, unpad", "  the cast alone")
    for i, name in enumerate(names):
        print(f"{name:<36} {(counts[2 * i + 1] - counts[2 * i]) / calls:10.0f}")


def main() -> None:
    x = torch.randn(4, 100, 64)
    mask = torch.ones(4, 100, dtype=torch.bool)

    def one(x: torch.Tensor) -> torch.Tensor:
        return x

    def two(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return x

    def three(x: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return x

    b1 = Bucketer(Buckets(dims={"x": 1}, sizes=pow2(16, 2048)), one)
    b2 = Bucketer(Buckets(dims={"x": 1, "mask": 1}, sizes=pow2(16, 2048)), two)
    b3 = Bucketer(Buckets(dims={"x": 1, "mask": 1, "pos": 1}, sizes=pow2(16, 2048)), three)
    pos = torch.arange(100).expand(4, 100)
    args3: tuple[Any, ...] = (x, mask, pos)
    b3.plan(args3, {})
    args1: tuple[Any, ...] = (x,)
    args2: tuple[Any, ...] = (x, mask)
    kwargs: dict[str, Any] = {}
    kw2 = {"mask": mask}
    b1.plan(args1, kwargs)
    b2.plan(args2, kwargs)
    b2.plan((x,), kw2)

    def nothing() -> None:
        return None

    rows = [
        ("baseline: empty Python call", median_us(nothing)),
        ("plan(), 1 bucketed arg", median_us(lambda: b1.plan(args1, kwargs))),
        ("plan(), 2 bucketed args", median_us(lambda: b2.plan(args2, kwargs))),
        ("plan(), 2 bucketed args, one by keyword", median_us(lambda: b2.plan((x,), kw2))),
        ("plan(), 3 bucketed args (generic path)", median_us(lambda: b3.plan(args3, kwargs))),
    ]

    lengths = iter(range(1, 10**9))

    def cold() -> None:
        n = next(lengths) % 2000 + 1
        b2._memo.clear()
        b2.plan((x[:, :1].expand(4, n, 64), mask[:, :1].expand(4, n)), kwargs)

    rows.append(("plan(), 2 args, memo miss (first sight of a shape)", median_us(cold, 2000)))

    plan = b1.plan(args1, kwargs)
    assert plan is not None
    ((padded,), _) = b1.pad(plan, args1, kwargs)
    out = padded * 2
    spec = b1.learn_cuts(plan, out, x * 2)
    x1 = x[:1]
    plan1 = b1.plan((x1,), kwargs)
    assert plan1 is not None
    ((padded1,), _) = b1.pad(plan1, (x1,), kwargs)
    out1 = padded1 * 2
    spec1 = b1.learn_cuts(plan1, out1, x1 * 2)
    rows += [
        ("pad(), x 4x100x64 -> 4x128x64", median_us(lambda: b1.pad(plan, args1, kwargs), 2000)),
        (
            "unpad(), 4x128x64 -> 4x100x64 (view + copy)",
            median_us(lambda: b1.unpad(plan, out, spec)),
        ),
        (
            "unpad(), 1x128x64 -> 1x100x64 (view only)",
            median_us(lambda: b1.unpad(plan1, out1, spec1)),
        ),
    ]

    rows += serving_rows()

    width = max(len(name) for name, _ in rows)
    print(f"torch {torch.__version__}; {REPEAT} timeit runs; microseconds per call")
    print(f"{'':<{width}}  {'median':>8}  {'min':>8}")
    for name, (median, best) in rows:
        print(f"{name:<{width}}  {median:8.3f}  {best:8.3f}")


if __name__ == "__main__":
    if _CHILD in os.environ:
        count_child(int(os.environ[_CHILD]))
    elif "--instructions" in sys.argv[1:]:
        count_instructions(2000)
    else:
        main()
