"""The speed verdict: per graph, compiled against eager on live calls (docs/speed.md).

The statistics and the per-graph state run on injected latencies and a fake clock;
end to end, a backend advances the fake clock by a set latency per run (its compiled
arm) and per run of the graph's traced code (its eager arm): no timing, no flakiness.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

from safecompile import ConfigError, Reason, Rollback, Shadow, State, Warmup, safe_compile
from safecompile.base.model import EventKind
from safecompile.checks.speed import (
    Decision,
    GraphSpeed,
    SpeedPolicy,
    Step,
    decide,
    median_interval,
    ratios,
    serve,
)
from safecompile.testing import FakeClock

Latency = Callable[[int], float]  # seconds a run of call n takes


class Sim:
    """One graph's calls as the graph wrapper makes them, with injected latencies."""

    def __init__(self, policy: SpeedPolicy, compiled: Latency, eager: Latency) -> None:
        self.clock = FakeClock()
        self.speed = GraphSpeed(policy)
        self.compiled = compiled
        self.eager = eager
        self.n = 0
        self.arms: Counter[str] = Counter()
        self.verdicts: list[tuple[int, Decision]] = []
        self.log: list[str] = []  # the arm that served each call

    def call(self) -> str:
        self.n += 1
        n = self.n
        if n < self.speed.next_at:  # the wrapper's one compare
            arm = self._run_compiled(n)
        else:
            arm = serve(
                self.speed,
                n,
                False,
                self._run_compiled,
                self._run_eager,
                (n,),
                clock=self.clock,
                sync=None,
                on_eager=lambda: None,
                on_verdict=lambda d: self.verdicts.append((n, d)),
            )
        self.log.append(arm)
        return arm

    def calls(self, count: int) -> None:
        for _ in range(count):
            self.call()

    def _run_compiled(self, n: int) -> str:
        self.clock.advance(self.compiled(n))
        self.arms["compiled"] += 1
        return "compiled"

    def _run_eager(self, n: int) -> str:
        self.clock.advance(self.eager(n))
        self.arms["eager"] += 1
        return "eager"


def _policy(**kwargs: Any) -> SpeedPolicy:
    return SpeedPolicy(ratio=kwargs.pop("ratio", 1.05), **kwargs)


def _const(seconds: float) -> Latency:
    return lambda _n: seconds


# ---------------------------------------------------------------- statistics


def test_median_interval_is_the_sign_test_interval() -> None:
    """16 values: the median, and the 4th and 13th order statistics at 95% (P(Bin(16, 1/2)
    <= 3) = 0.011 <= 0.025), the 3rd and 14th at 99%."""
    values = [float(v) for v in range(16, 0, -1)]
    assert median_interval(values, 0.95) == (4.0, 8.5, 13.0)
    assert median_interval(values, 0.99) == (3.0, 8.5, 14.0)


def test_median_interval_needs_enough_values() -> None:
    """Five values cannot bound the median at 95%: the interval is unbounded."""
    low, middle, high = median_interval([1.0, 2.0, 3.0, 4.0, 5.0], 0.95)
    assert (low, middle, high) == (-math.inf, 3.0, math.inf)
    assert all(math.isnan(v) for v in median_interval([]))


def test_ratios_drop_invalid_pairs() -> None:
    """Non-finite or negative times are dropped; eager at zero reads as infinitely faster."""
    pairs = [(2.0, 1.0), (math.nan, 1.0), (1.0, -1.0), (1.0, 0.0), (0.0, 0.0)]
    assert ratios(pairs) == [2.0, math.inf, 1.0]


def test_decide_waits_for_min_pairs() -> None:
    """Below min_pairs there is no verdict, however clear the pairs."""
    policy = _policy(min_pairs=16)
    assert decide([(2.0, 1.0)] * 15, policy).eager is None
    decision = decide([(2.0, 1.0)] * 16, policy)
    assert (decision.eager, decision.ratio, decision.pairs) == (True, 2.0, 16)


def test_decide_reads_only_at_its_looks() -> None:
    """Pairs are read at min_pairs, its doublings and max_pairs, not after every pair."""
    policy = _policy(min_pairs=16, max_pairs=128)
    clear = [(2.0, 1.0)]
    looks = [n for n in range(1, 200) if decide(clear * n, policy).eager is not None]
    assert looks[:5] == [16, 32, 64, 128, 129]


def test_decide_keeps_the_serving_arm_when_inconclusive() -> None:
    """Ratios straddling the limit: undecided until max_pairs, then the serving arm stays."""
    policy = _policy(min_pairs=4, max_pairs=8)
    straddle = [(1.0, 1.0), (1.2, 1.0)]
    assert decide(straddle * 2, policy).eager is None
    assert decide(straddle * 4, policy, current_eager=False).eager is False
    assert decide(straddle * 4, policy, current_eager=True).eager is True


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ratio": 0.0},
        {"ratio": math.nan},
        {"min_pairs": 0},
        {"min_pairs": 8, "max_pairs": 4},
        {"budget": 0.0},
        {"confidence": 1.0},
        {"warm_calls": -1},
    ],
)
def test_policy_is_validated(kwargs: dict[str, Any]) -> None:
    """A policy that cannot measure is refused when built."""
    with pytest.raises(ValueError, match=r"ratio|pairs|budget|confidence|warm_calls"):
        _policy(**kwargs)


# ---------------------------------------------------------------- one graph, injected latencies


def test_compiled_three_percent_slower_stays() -> None:
    """3% slower than eager is within slower_ratio=1.05: compiled keeps serving."""
    sim = Sim(_policy(), compiled=_const(1.03), eager=_const(1.0))
    sim.calls(2000)
    (at, decision), *_ = sim.verdicts
    assert decision.eager is False
    assert decision.ratio == pytest.approx(1.03)
    assert decision.pairs == 16
    assert sim.speed.eager is False
    assert at == 128 + 15 * 8 + 1  # after the warm-up, 16 pairs one stride apart
    assert set(sim.log[at : at + 1600]) == {"compiled"}  # nothing probed until the next round


@pytest.mark.parametrize("slower", [1.10, 2.0])
def test_compiled_clearly_slower_goes_eager(slower: float) -> None:
    """10% or 2x slower than eager: the graph runs eager from the verdict on."""
    sim = Sim(_policy(), compiled=_const(slower), eager=_const(1.0))
    sim.calls(1000)
    (at, decision), *_ = sim.verdicts
    assert decision.eager is True
    assert decision.ratio == pytest.approx(slower)
    assert sim.speed.eager is True
    assert set(sim.log[at:]) == {"eager"}  # no compiled run until the next round


def test_equal_speed_stays_compiled() -> None:
    """Equal latencies: compiled stays."""
    sim = Sim(_policy(), compiled=_const(1.0), eager=_const(1.0))
    sim.calls(1000)
    assert [d.eager for _, d in sim.verdicts] == [False]
    assert sim.speed.eager is False


def test_no_timing_during_warm_up() -> None:
    """The first warm_calls calls of a graph are served compiled and never timed."""
    sim = Sim(_policy(warm_calls=128), compiled=_const(5.0), eager=_const(1.0))
    sim.calls(127)
    assert sim.arms == Counter(compiled=127)
    assert sim.speed.timed == 0


def test_due_calls_are_left_alone() -> None:
    """A call whose shadow check is due is served by the serving arm, untimed."""
    speed = GraphSpeed(_policy(warm_calls=0))
    assert speed.plan(1, due=True) is Step.COMPILED
    assert speed.timed == 0
    assert speed.plan(2) in (Step.TIME_COMPILED, Step.TIME_EAGER)


def _noisy(base: float, rng: random.Random) -> Latency:
    """Log-normal jitter, and one run in 20 ten times slower (a preemption, a GC pause)."""

    def latency(_n: int) -> float:
        value = base * rng.lognormvariate(0.0, 0.25)
        return value * 10 if rng.random() < 0.05 else value

    return latency


@pytest.mark.parametrize("seed", range(12))
def test_heavy_tailed_noise_does_not_roll_back(seed: int) -> None:
    """Equal speeds under heavy-tailed noise on both arms: never an eager verdict."""
    rng = random.Random(seed)
    sim = Sim(_policy(), compiled=_noisy(1.0, rng), eager=_noisy(1.0, rng))
    sim.calls(30_000)
    assert sim.verdicts, "no verdict reached"
    assert all(d.eager is False for _, d in sim.verdicts)


@pytest.mark.parametrize("seed", range(4))
def test_heavy_tailed_noise_still_sees_2x(seed: int) -> None:
    """The same noise does not hide a compiled path twice as slow."""
    rng = random.Random(seed)
    sim = Sim(_policy(), compiled=_noisy(2.0, rng), eager=_noisy(1.0, rng))
    sim.calls(2000)
    assert sim.verdicts[0][1].eager is True


def test_reprobe_after_backoff_flips_back() -> None:
    """Eager won; traffic changes so compiled wins: the next round, after its gap, flips
    back to compiled. Rounds that agree wait twice as long each time."""
    compiled_s = [2.0]
    sim = Sim(_policy(), compiled=lambda _n: compiled_s[0], eager=_const(1.0))
    while not sim.verdicts:
        sim.call()
    (first_at, first), *_ = sim.verdicts
    assert first.eager is True
    compiled_s[0] = 0.5  # new traffic: compiled is now twice as fast
    sim.calls(100 * 16 - 1)
    assert len(sim.verdicts) == 1  # the gap: pairs / budget calls
    assert set(sim.log[first_at:]) == {"eager"}
    sim.calls(400)
    (second_at, second) = sim.verdicts[1]
    assert second.eager is False
    assert second.ratio == pytest.approx(0.5)
    assert second_at >= first_at + 1600
    assert sim.log[-50:] == ["compiled"] * 50
    sim.calls(10_000)
    at = [a for a, _ in sim.verdicts]
    assert [d.eager for _, d in sim.verdicts] == [True, False, False, False]
    # the flip starts the backoff again; each round that agrees waits twice as long
    assert [b - a for a, b in itertools.pairwise(at[1:])] == [1600 + 121, 3200 + 121]


@pytest.mark.parametrize(("compiled", "serving"), [(0.8, "compiled"), (1.5, "eager")])
def test_steady_state_budget(compiled: float, serving: str) -> None:
    """At steady state at most 1% of calls run on the slower arm; a round's burst is
    bounded by max_pairs runs on it."""
    policy = _policy()
    sim = Sim(policy, compiled=_const(compiled), eager=_const(1.0))
    sim.calls(200_000)
    first_at = sim.verdicts[0][0]
    slower = "eager" if serving == "compiled" else "compiled"
    assert sim.log[first_at:].count(slower) <= policy.max_pairs  # the first round's tail
    settled = sim.log[first_at:]
    assert settled.count(slower) / len(settled) <= 0.01
    assert sim.log[: policy.warm_calls].count("eager") == 0
    round_one = sim.log[policy.warm_calls : first_at]
    assert round_one.count("eager") <= policy.max_pairs
    assert sim.speed.probes <= 16 * len(sim.verdicts)


def test_a_failed_timed_run_is_forgotten() -> None:
    """A timed run that raises propagates, leaves no half pair behind and no run out:
    the next call starts a new pair."""
    speed = GraphSpeed(_policy(warm_calls=0))
    clock = FakeClock()
    runs = {"compiled": 0}

    def compiled(*_args: Any) -> str:
        runs["compiled"] += 1
        clock.advance(1.0)
        return "compiled"

    def boom(*_args: Any) -> Any:
        raise RuntimeError("eager raised")

    def call(n: int) -> Any:
        return serve(
            speed,
            n,
            False,
            compiled,
            boom,
            (),
            clock=clock,
            sync=None,
            on_eager=lambda: None,
            on_verdict=lambda _d: None,
        )

    assert call(1) == "compiled"  # the first half of a pair: compiled opens the first
    with pytest.raises(RuntimeError, match="eager raised"):
        call(2)  # its partner fails
    assert speed.timed == 1
    assert speed.plan(3) is Step.TIME_EAGER  # a new pair (eager opens it), nothing stuck


# ---------------------------------------------------------------- end to end


class LatencyBackend:
    """A backend whose compiled runs take ``compiled(shape)`` fake seconds and whose
    graphs, run eagerly, take ``eager`` (it wraps the graph's own ``forward``)."""

    def __init__(self, clock: FakeClock, compiled: Callable[[int], float], eager: float) -> None:
        self.clock = clock
        self.compiled = compiled
        self.eager = eager

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        forward = gm.forward
        size = next(t.shape[0] for t in example_inputs if isinstance(t, torch.Tensor))
        clock, eager_s, compiled_s = self.clock, self.eager, self.compiled(size)

        def eager_run(*args: Any) -> Any:
            clock.advance(eager_s)
            return forward(*args)

        def compiled_run(*args: Any) -> Any:
            clock.advance(compiled_s)
            return forward(*args)

        gm.forward = eager_run  # type: ignore[method-assign]
        return compiled_run


def affine(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def test_per_graph_only_the_slow_graph_goes_eager(clock: FakeClock) -> None:
    """Two graphs (two shapes): the slow one runs eager, the fast one stays compiled, the
    callable stays up, every result equals eager's, and the verdicts say which graph."""
    backend = LatencyBackend(clock, compiled=lambda n: 2.0 if n == 4 else 0.5, eager=1.0)
    g = safe_compile(affine, backend=backend, dynamic=False, shadow=Shadow(canary=2), clock=clock)
    slow, fast = torch.randn(4), torch.randn(8)
    for _ in range(600):
        for x in (slow, fast):
            torch.testing.assert_close(g(x), affine(x), rtol=0, atol=0)
    c = g.safecompile
    assert c.state is State.COMPILED
    graphs = {r["inputs"]: r["speed"] for r in c.report()["graphs"]}
    assert graphs["4:float32"]["serving"] == "eager"
    assert graphs["4:float32"]["last"]["ratio"] == pytest.approx(2.0)
    assert graphs["8:float32"]["serving"] == "compiled"
    assert graphs["8:float32"]["last"]["ratio"] == pytest.approx(0.5)
    verdicts = [e for e in c.events() if e.kind is EventKind.SPEED_VERDICT]
    assert [(e.details["graph_inputs"], e.details["verdict"]) for e in verdicts] == [
        ("4:float32", "eager"),
        ("8:float32", "compiled"),
    ]
    assert "2.000x" in (verdicts[0].message or "")
    assert verdicts[0].details["pairs"] == 16
    assert verdicts[0].function == "affine"
    stats = c.stats()
    assert stats.calls == stats.compiled_calls + stats.eager_calls == 1200
    assert stats.extra["speed"]["graphs_eager"] == 1
    assert stats.rollbacks == 0


def test_every_graph_slower_rolls_back(clock: FakeClock) -> None:
    """One graph, compiled 2x slower: the callable rolls back (slower), and the event
    names the graph and the ratio."""
    backend = LatencyBackend(clock, compiled=lambda _n: 2.0, eager=1.0)
    g = safe_compile(affine, backend=backend, dynamic=False, shadow=Shadow(canary=2), clock=clock)
    x = torch.randn(4)
    for _ in range(400):
        torch.testing.assert_close(g(x), affine(x), rtol=0, atol=0)
    c = g.safecompile
    assert c.state is State.ROLLED_BACK
    last = c.stats().last_rollback
    assert last is not None
    assert last.reason is Reason.SLOWER
    assert "graph 1 (4:float32) 2.000x over 16 pairs" in (last.message or "")


def test_no_probes_in_the_canary_or_first_calls(clock: FakeClock) -> None:
    """The default routes nothing to eager in a graph's first calls: short tests keep
    exact counts, however slow compiled is."""
    backend = LatencyBackend(clock, compiled=lambda _n: 5.0, eager=1.0)
    g = safe_compile(affine, backend=backend, clock=clock)
    for _ in range(100):
        g(torch.randn(4))
    stats = g.safecompile.stats()
    assert (stats.compiled_calls, stats.eager_calls) == (100, 0)
    assert stats.extra["speed"]["timed"] == 0


def test_slower_ratio_none_turns_it_off(clock: FakeClock) -> None:
    """Rollback(slower_ratio=None): nothing is timed or routed, compiled always serves."""
    backend = LatencyBackend(clock, compiled=lambda _n: 5.0, eager=1.0)
    g = safe_compile(
        affine, backend=backend, rollback=Rollback(slower_ratio=None), shadow=None, clock=clock
    )
    for _ in range(1000):
        g(torch.randn(4))
    stats = g.safecompile.stats()
    assert (stats.compiled_calls, stats.eager_calls) == (1000, 0)
    assert stats.extra["speed"] == {
        "on": False,
        "graphs_eager": 0,
        "probes": 0,
        "timed": 0,
        "rounds": 0,
    }
    assert g.safecompile.report()["graphs"][0]["speed"] is None


def test_probes_keep_gradients(clock: FakeClock) -> None:
    """A call the verdict serves eagerly gives the caller eager's gradients."""
    backend = LatencyBackend(clock, compiled=lambda _n: 2.0, eager=1.0)
    g = safe_compile(affine, backend=backend, shadow=None, clock=clock)
    for _ in range(300):
        x = torch.randn(4, requires_grad=True)
        g(x).sum().backward()
        assert x.grad is not None
        torch.testing.assert_close(x.grad, torch.full((4,), 2.0))
    assert g.safecompile.stats().eager_calls > 0


# ---------------------------------------------------------------- background warmup priority


def _niceness_seen(nice: int | None) -> tuple[int, int]:
    """(the niceness of the thread that compiled, the caller's own)."""
    seen: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return gm.forward

    g = safe_compile(
        affine,
        backend=backend,
        warmup=Warmup(inputs=[(torch.randn(4),)], background=True, nice=nice),
    )
    assert g.safecompile.wait_warm(60)
    assert len(seen) == 1
    return seen[0], os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread niceness is POSIX/Linux")
def test_background_warmup_runs_at_nice_19() -> None:
    """By default the warmup worker compiles at niceness 19; the caller keeps its own."""
    worker, caller = _niceness_seen(19)
    assert worker == 19
    assert caller < 19


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread niceness is POSIX/Linux")
@pytest.mark.parametrize("nice", [None, 0])
def test_background_warmup_priority_can_be_left_alone(nice: int | None) -> None:
    """nice=None or 0: the worker keeps the caller's niceness."""
    worker, caller = _niceness_seen(nice)
    assert worker == caller


def test_warmup_default_nice_is_19() -> None:
    """Low priority is the default."""
    assert Warmup(inputs=[]).nice == 19


@pytest.mark.parametrize("nice", [20, -1, True, 1.5, "19"])
def test_warmup_nice_is_validated(nice: object) -> None:
    """nice must be an int from 0 to 19, or None."""
    with pytest.raises(ConfigError, match=r"Warmup\(nice=\.\.\.\)"):
        Warmup(inputs=[], nice=nice)  # type: ignore[arg-type]


def test_a_slower_trip_with_retry_after_recovers_and_backs_off(clock: FakeClock) -> None:
    """After a ``slower`` rollback, the trial runs the compiled path it tries (not the
    graph's eager arm): one retry, the callable recovers, its speed is measured afresh;
    still slower, it trips again soon after, with a doubled wait (calls of 1-2 ms)."""
    backend = LatencyBackend(clock, compiled=lambda _n: 0.002, eager=0.001)
    g = safe_compile(
        affine,
        backend=backend,
        dynamic=False,
        shadow=Shadow(canary=2),
        rollback=Rollback(retry_after=10),
        clock=clock,
    )
    x = torch.randn(4)
    c = g.safecompile

    def calls(count: int) -> None:
        for _ in range(count):
            torch.testing.assert_close(g(x), affine(x), rtol=0, atol=0)

    calls(400)
    first = c.stats().last_rollback
    assert c.state is State.ROLLED_BACK
    assert first is not None
    assert first.reason is Reason.SLOWER
    assert first.details["retry_in_s"] == 10
    clock.advance(10)
    compiled_before = c.stats().compiled_calls
    calls(50)
    kinds = [e.kind for e in c.events()]
    assert kinds.count(EventKind.RETRY) == 1
    assert kinds[-2:] == [EventKind.RETRY, EventKind.RECOVERED]
    assert c.state in (State.CANARY, State.COMPILED)
    assert c.stats().compiled_calls - compiled_before == 50  # the trial and every call after
    graph = c.report()["graphs"][0]["speed"]
    assert graph["serving"] == "compiled"
    assert graph["measuring"] is False  # measured afresh, after its warm-up
    calls(400)  # still 2x slower: a new verdict, and a longer wait (backoff)
    again = c.stats().last_rollback
    assert c.state is State.ROLLED_BACK
    assert again is not None
    assert again is not first
    assert again.reason is Reason.SLOWER
    assert again.details["retry_in_s"] == 20
