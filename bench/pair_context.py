"""Why the speed verdict's live pairs read ``bench/compare.py``'s variable workload faster
than whole rounds do (issue 18): each live pair's shapes and times, against the same shapes'
per-call times in rounds of one arm at a time, and a call's time by the arm that ran before it.

safe_compile serves the ``variable`` traffic (a d64 block, random (batch, seq)) with the
verdict kept measuring (every round read as "compiled" and the next started at once: a
slower_ratio of 100 and a patched backoff), interleaved round by round with eager itself.
Each timed call is logged with its (batch, seq); each pair's compiled and eager time is set
against the median of the same shape's untimed calls in the rounds (thread CPU time, one
thread); calls the verdict took (timed, or sent to eager to settle a probe) are left out
of the rounds' times. ``--settle K`` sets how many calls of its arm a timed call follows
(the policy's own default otherwise); ``--shuffle`` runs each round in a new order.

    python bench/pair_context.py                   # inductor: ~1 min at load 2
    python bench/pair_context.py --settle 0 --no-context
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import torch
from _models import Block  # bench/ is on sys.path when a bench runs as a script
from compare import variable_traffic
from overhead import own_code

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import safecompile.checks.speed as speed_mod
import safecompile.guard._paths as paths_mod
import safecompile.guard._speed as arm_mod
from safecompile import Rollback, safe_compile

Shape = tuple[int, int]
Pair = tuple[Shape, float, Shape, float]  # compiled's shape and seconds, eager's


def instrument(
    pairs: list[Pair], timed: list[tuple[speed_mod.Step, Shape, float]], sent: list[int]
) -> Callable[[], None]:
    """Log every timed call's shape and time, and every completed pair; count the calls the
    verdict took (timed or sent to eager, ``sent[0]``); keep measuring. Returns the undo."""
    shape: list[Shape] = [(0, 0)]
    planned: list[tuple[speed_mod.Step, Shape]] = []
    call_key, plan, record = (
        paths_mod.call_key,
        speed_mod.CallSpeed.plan,
        speed_mod.CallSpeed.record,
    )
    conclude = speed_mod.CallSpeed._conclude

    def keyed(args: tuple[Any, ...], kwargs: dict[str, Any], *rest: Any) -> Hashable:
        shape[0] = (args[0].shape[0], args[0].shape[1])
        return call_key(args, kwargs, *rest)

    def planned_step(self: speed_mod.CallSpeed, key: Hashable) -> speed_mod.Step:
        step = plan(self, key)
        if step is not speed_mod.Step.UNTIMED:
            sent[0] += 1
        if step in (speed_mod.Step.TIME_EAGER, speed_mod.Step.TIME_COMPILED):
            planned.append((step, shape[0]))
        return step

    def recorded(self: speed_mod.CallSpeed, step: speed_mod.Step, seconds: float) -> Any:
        before = len(self._pairs)
        timed.append((*planned[-1], seconds))
        decision = record(self, step, seconds)
        if len(self._pairs) > before or decision is not None:
            (arm, shape_a, a), (_, shape_b, b) = timed[-2], timed[-1]
            compiled_first = arm is speed_mod.Step.TIME_COMPILED
            pairs.append((shape_a, a, shape_b, b) if compiled_first else (shape_b, b, shape_a, a))
        return decision

    def keep_measuring(self: speed_mod.CallSpeed, decision: speed_mod.Decision) -> None:
        conclude(self, decision)
        self._round_at = self.calls

    paths_mod.call_key = keyed
    speed_mod.CallSpeed.plan = planned_step  # type: ignore[method-assign]
    speed_mod.CallSpeed.record = recorded  # type: ignore[method-assign]
    speed_mod.CallSpeed._conclude = keep_measuring  # type: ignore[method-assign]

    def undo() -> None:
        paths_mod.call_key = call_key
        speed_mod.CallSpeed.plan = plan  # type: ignore[method-assign]
        speed_mod.CallSpeed.record = record  # type: ignore[method-assign]
        speed_mod.CallSpeed._conclude = conclude  # type: ignore[method-assign]

    return undo


def read(pairs: list[Pair], medians: dict[str, dict[Shape, float]], label: str) -> None:
    pairs = [p for p in pairs if p[0] in medians["compiled"] and p[2] in medians["eager"]]
    if not pairs:
        print(f"{label}: no pairs")
        return
    c, e = sum(p[1] for p in pairs), sum(p[3] for p in pairs)
    round_c = sum(medians["compiled"][p[0]] for p in pairs)
    round_e = sum(medians["eager"][p[2]] for p in pairs)
    print(
        f"{label}: {len(pairs)} pairs; summed compiled / eager {c / e:.3f} live, "
        f"{round_c / round_e:.3f} from the same shapes' times in rounds; live / rounds: "
        f"compiled {c / round_c:.3f}, eager {e / round_e:.3f}; "
        f"median pair {statistics.median(p[1] / p[3] for p in pairs):.3f}"
    )


def context(model: Callable[..., Any], guarded: Callable[..., Any], traffic: list[Any]) -> None:
    """A call's time after k calls of an arm (random shapes), over the same call repeated."""
    rng = random.Random(1)
    found: dict[tuple[str, str, int], list[float]] = {}
    arms = {"eager": model, "compiled": guarded}
    for _ in range(2000):
        args, kwargs = rng.choice(traffic)
        before, arm, k = rng.choice(list(arms)), rng.choice(list(arms)), rng.choice([1, 8])
        for _ in range(k):
            other_args, other_kwargs = rng.choice(traffic)
            arms[before](*other_args, **other_kwargs)
        cost = []
        for _ in range(2):
            start = time.thread_time()
            arms[arm](*args, **kwargs)
            cost.append(time.thread_time() - start)
        found.setdefault((arm, before, k), []).append(cost[0] / cost[1])
    for (arm, before, k), values in sorted(found.items()):
        print(f"{arm} after {k} {before}: {statistics.median(values):.3f} (n={len(values)})")


def replay(
    traffic: list[Any], times: dict[str, dict[Shape, list[float]]], seeds: int, **policy: Any
) -> None:
    """The verdict's first round on the traffic's own per-call times (each shape's untimed
    calls in the rounds, drawn at random), compiled scaled to a given summed-time ratio: in
    how many seeds it rolls back (the traffic in its order from a random call, as
    ``bench/compare.py`` sends it; what a call costs does not depend on the one before)."""
    calls = [
        (shape, paths_mod.call_key(a, k, None, None))
        for a, k in traffic
        if (shape := (a[0].shape[0], a[0].shape[1])) in times["compiled"]
    ]
    total = {arm: sum(statistics.mean(times[arm][s]) for s, _ in calls) for arm in times}
    rule = speed_mod.SpeedPolicy(ratio=1.05, **policy)
    print(f"replay, {seeds} seeds, {len(calls)} shapes, {rule}")
    for ratio in (1.0, 1.03, 1.05, 1.08, 1.11):
        scale = ratio * total["eager"] / total["compiled"]
        found = []
        for seed in range(seeds):
            rng, speed = random.Random(seed), speed_mod.CallSpeed(rule)
            start, decision = rng.randrange(len(calls)), None
            while decision is None and speed.calls < 100_000:
                shape, key = calls[(start + speed.calls) % len(calls)]
                step = speed.plan(key) if speed.wants else speed_mod.Step.UNTIMED
                if step is speed_mod.Step.TIME_EAGER:
                    decision = speed.record(step, rng.choice(times["eager"][shape]))
                elif step is speed_mod.Step.TIME_COMPILED:
                    decision = speed.record(step, scale * rng.choice(times["compiled"][shape]))
                speed.add(1)
            found.append((decision, speed.probes))
        rolled = sum(bool(d and d.eager) for d, _ in found)
        pairs = statistics.mean(d.pairs for d, _ in found if d)
        sent = statistics.mean(p for _, p in found)
        print(
            f"| {ratio:.2f} | {rolled} / {seeds} | {pairs:.0f} pairs | {sent:.0f} sent to eager |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--settle", type=int, help="the policy's settle (default: its own)")
    parser.add_argument("--shuffle", action="store_true", help="each round in a new order")
    parser.add_argument("--no-context", action="store_true", help="skip the context table")
    parser.add_argument("--replay", type=int, default=0, help="seeds of the replay (0: none)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    traffic = variable_traffic(False)
    if args.settle is not None:
        settle = functools.partial(speed_mod.SpeedPolicy, settle=args.settle)
        arm_mod.SpeedPolicy = settle  # type: ignore[attr-defined,assignment]
    model = Block(64, 4).eval()
    guarded = safe_compile(
        own_code(model, "pairs"), backend=args.backend, rollback=Rollback(slower_ratio=100.0)
    )
    pairs: list[Pair] = []
    timed: list[tuple[speed_mod.Step, Shape, float]] = []
    sent = [0]
    undo = instrument(pairs, timed, sent)
    times: dict[str, dict[Shape, list[float]]] = {"eager": {}, "compiled": {}}
    totals: dict[str, float] = {"eager": 0.0, "compiled": 0.0}
    with torch.no_grad():
        for _ in range(10):  # compiles, the canary
            for call_args, kwargs in traffic:
                model(*call_args, **kwargs)
                guarded(*call_args, **kwargs)
        pairs.clear()
        for r in range(args.rounds):
            order = [("eager", model), ("compiled", guarded)]
            shuffled = random.Random(r).sample(traffic, len(traffic)) if args.shuffle else traffic
            for arm, fn in order if r % 2 else order[::-1]:
                for call_args, kwargs in shuffled:
                    seen, start = sent[0], time.thread_time()
                    fn(*call_args, **kwargs)
                    spent = time.thread_time() - start
                    totals[arm] += spent
                    if sent[0] == seen:  # neither timed nor sent to eager
                        shape = (call_args[0].shape[0], call_args[0].shape[1])
                        times[arm].setdefault(shape, []).append(spent)
        medians = {arm: {s: statistics.median(v) for s, v in d.items()} for arm, d in times.items()}
        print(f"rounds: compiled / eager summed {totals['compiled'] / totals['eager']:.3f}")
        shapes = [(a[0].shape[0], a[0].shape[1]) for a, _ in traffic]
        shapes = [s for s in shapes if s in medians["compiled"]]  # some: every call timed
        by_shape = sum(medians["compiled"][s] for s in shapes) / sum(
            medians["eager"][s] for s in shapes
        )
        print(f"the traffic from its shapes' untimed medians: compiled / eager {by_shape:.3f}")
        read(pairs, medians, "all pairs")
        read([p for p in pairs if p[0] == p[2]], medians, "same-shape pairs")
        if not args.no_context:
            context(model, guarded, traffic)
    undo()
    if args.replay:
        replay(
            traffic, times, args.replay, **({} if args.settle is None else {"settle": args.settle})
        )


if __name__ == "__main__":
    main()
