"""The speed verdict: the whole call, compiled against eager, on live calls (docs/speed.md).

The statistics and the callable's verdict run on injected latencies (no clock); end to
end, a fake clock moves by set latencies: the compiled path's graphs advance it (a
backend), and the user's function advances it through a helper dynamo does not trace
(so it is the eager arm's cost, and the code between graphs on the compiled path). No
timing, no flakiness.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import random
import threading
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import pytest
import torch

from safecompile import Buckets, ConfigError, Reason, Rollback, Shadow, State, Warmup, safe_compile
from safecompile.base.model import EventKind
from safecompile.checks import speed as speed_module
from safecompile.checks.speed import (
    CallSpeed,
    Decision,
    SpeedPolicy,
    Step,
    call_clock,
    decide,
    median_interval,
    ratios,
    runs,
)
from safecompile.testing import FakeClock, SlowBackend

Latency = Callable[[int], float]  # seconds call n takes


class Sim:
    """A callable's calls as the guard makes them, with injected latencies: a call goes
    to the verdict only while it wants one; an eager verdict rolls back (eager serves)."""

    def __init__(
        self,
        policy: SpeedPolicy,
        compiled: Latency,
        eager: Latency,
        key: Callable[[int], Hashable] = lambda _n: "x",
    ) -> None:
        self.speed = CallSpeed(policy)
        self.compiled = compiled
        self.eager = eager
        self.key = key
        self.n = 0
        self.rolled_back = False
        self.arms: Counter[str] = Counter()
        self.verdicts: list[tuple[int, Decision]] = []
        self.log: list[str] = []  # the arm that served each call
        self.pairs_keys: list[Hashable] = []
        self.steps: list[Step] = []  # what the verdict planned for each call

    def call(self) -> str:
        self.n += 1
        n = self.n
        step = Step.UNTIMED
        if not self.rolled_back and self.speed.wants:
            step = self.speed.plan(self.key(n))
        self.steps.append(step)
        eager = self.rolled_back or step in (Step.TIME_EAGER, Step.EAGER)
        arm = "eager" if eager else "compiled"
        seconds = self.eager(n) if eager else self.compiled(n)
        if step in (Step.TIME_EAGER, Step.TIME_COMPILED):
            decision = self.speed.record(step, seconds)
            if decision is not None:
                self.verdicts.append((n, decision))
                self.rolled_back = bool(decision.eager)
        self.speed.add(1)
        self.arms[arm] += 1
        self.log.append(arm)
        return arm

    def calls(self, count: int) -> None:
        for _ in range(count):
            self.call()


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
    """Pairs are read at min_pairs, its doublings, max_pairs and most_pairs, not after
    every pair."""
    policy = _policy(min_pairs=16, max_pairs=100, most_pairs=300)
    clear = [(2.0, 1.0)]
    looks = [n for n in range(1, 400) if decide(clear * n, policy).eager is not None]
    assert looks[:8] == [16, 32, 64, 100, 128, 256, 300, 301]


def test_decide_keeps_the_serving_arm_when_inconclusive() -> None:
    """Ratios straddling the limit: undecided until the last read, then the serving arm
    stays."""
    policy = _policy(min_pairs=4, max_pairs=8, most_pairs=8)
    straddle = [(1.0, 1.0), (1.2, 1.0)]
    assert decide(straddle * 2, policy).eager is None
    assert decide(straddle * 4, policy, current_eager=False).eager is False
    assert decide(straddle * 4, policy, current_eager=True).eager is True


def test_the_last_read_decides_on_the_median() -> None:
    """Undecided at max_pairs: a median above the limit rolls back when the interval
    says eager is faster at all (its lower end above 1); otherwise compiled stays."""
    policy = _policy(min_pairs=4, max_pairs=8, most_pairs=8)  # at 8 pairs: [min, max]

    def at_last_read(values: list[float]) -> Decision:
        decision = decide([(v, 1.0) for v in values], policy)
        assert decision.low <= policy.ratio < decision.high  # the interval straddles it
        return decision

    slower = at_last_read([1.02, 1.03, 1.08, 1.10, 1.12, 1.15, 1.20, 1.25])
    assert (slower.eager, slower.ratio) == (True, pytest.approx(1.11))
    assert at_last_read([0.98, 1.03, 1.08, 1.10, 1.12, 1.15, 1.20, 1.25]).eager is False
    assert at_last_read([1.01] * 5 + [1.2] * 3).eager is False  # the median is within the limit


def test_a_last_read_that_leans_eager_reads_on() -> None:
    """At max_pairs, a median above the limit whose interval still reaches 1 (eager not
    shown faster at all) keeps measuring, up to most_pairs, where the last read decides."""
    policy = _policy(min_pairs=4, max_pairs=8, most_pairs=16)
    leaning = [(v, 1.0) for v in (0.98, 1.03, 1.08, 1.10, 1.12, 1.15, 1.20, 1.25)]
    assert decide(leaning, policy).eager is None
    within = [(v, 1.0) for v in (0.98, 1.0, 1.02, 1.04, 1.05, 1.08, 1.10, 1.12)]
    assert decide(within, policy).eager is False  # the median within the limit: compiled
    assert decide(leaning + within, policy).eager is False  # at most_pairs: low 1.0
    assert decide(leaning * 2, policy).eager is True  # low 1.03: eager is faster


def _jittered(base: float, rng: random.Random, sigma: float) -> Latency:
    return lambda _n: base * rng.lognormvariate(0.0, sigma)


def _first_verdicts(compiled: float, seeds: int = 10) -> list[Decision]:
    """The first verdict of each seed: 20% log-normal jitter on each arm (the ratios of
    pairs spread ~28%), compiled ``compiled`` times eager's time."""
    found = []
    for seed in range(seeds):
        rng = random.Random(seed)
        sim = Sim(_policy(), compiled=_jittered(compiled, rng, 0.2), eager=_jittered(1.0, rng, 0.2))
        sim.calls(8000)
        found.append(sim.verdicts[0][1])
    return found


def test_noisy_pairs_still_roll_back_twelve_percent_slower() -> None:
    """Compiled 12% slower under that noise: the interval alone decided 1 seed in 10 (the
    rest stayed compiled); the last read rolled back 9 in 10; reading on past 128 pairs
    when the last read leans eager, 10 in 10 (2 at 256 pairs)."""
    verdicts = _first_verdicts(1.12)
    assert sum(bool(d.eager) for d in verdicts) == 10
    assert sum(bool(d.eager) and d.pairs > 128 for d in verdicts) == 2


@pytest.mark.parametrize("compiled", [0.97, 1.0])
def test_noisy_pairs_keep_a_path_as_fast_as_eager(compiled: float) -> None:
    """The same noise, compiled as fast as eager or 3% faster: at most 1 seed in 100 rolls
    back (the bound where compiled is as fast: 1% a read; 3% faster: none)."""
    assert sum(bool(d.eager) for d in _first_verdicts(compiled, seeds=100)) <= (compiled == 1.0)


def test_runs_sum_consecutive_pairs() -> None:
    """Runs of consecutive pairs, near-equal in length, each run's times summed; one pair
    a run when there are fewer pairs than runs."""
    pairs = [(float(i), 1.0) for i in range(5)]
    assert runs(pairs, 2) == [(1.0, 2.0), (9.0, 3.0)]
    assert runs(pairs, 16) == pairs
    assert runs([], 16) == []


def _two_kinds(small: float, big: float, seed: int, share: float) -> Decision:
    """The first verdict on traffic of two kinds of call in random order: ``share`` of them
    small (eager 1, compiled ``small``), the rest big (eager 10, compiled ``big``)."""
    rng = random.Random(seed)
    is_small = [rng.random() < share for _ in range(20_001)]
    sim = Sim(
        _policy(),
        compiled=lambda n: small if is_small[n] else big,
        eager=lambda n: 1.0 if is_small[n] else 10.0,
        key=lambda n: is_small[n],
    )
    sim.calls(20_000)
    return sim.verdicts[0][1]


def test_the_traffic_rolls_back_where_the_median_call_is_faster() -> None:
    """Most calls 2% faster compiled, the big ones 10% slower: the median pair favours
    compiled, but the traffic takes ~8% more time compiled, and rolls back."""
    verdicts = [_two_kinds(0.98, 11.0, seed, share=0.6) for seed in range(10)]
    assert all(d.median < 1.05 for d in verdicts)  # 0.98 in 8, 1.04 in 2
    assert all(d.eager for d in verdicts)
    assert all(d.ratio > 1.05 for d in verdicts)


def test_compiled_faster_in_total_stays_though_most_calls_are_slower() -> None:
    """Most calls 20% slower compiled, the big ones 20% faster: the traffic takes ~15% less
    time compiled, and stays compiled (the median pair alone rolled back 8 seeds in 20)."""
    verdicts = [_two_kinds(1.2, 8.0, seed, share=0.6) for seed in range(20)]
    assert not any(d.eager for d in verdicts)


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_call_clock_reads_cpu_time_on_one_thread(
    monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    """One intra-op thread, no CUDA: the verdict reads the thread's CPU time (every kernel
    runs on it); more threads: wall time (the other threads' work would be missed)."""
    monkeypatch.setattr(speed_module, "_cuda", lambda: False)
    monkeypatch.setattr(speed_module.time, "thread_time", lambda: 1.0)
    monkeypatch.setattr(speed_module.time, "perf_counter", lambda: 2.0)
    assert call_clock() == 1.0
    torch.set_num_threads(2)
    assert call_clock() == 2.0


def test_the_default_clock_leaves_out_waiting(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, one_thread: None
) -> None:
    """Without an injected clock, the verdict times with the thread's CPU time: calls whose
    CPU time says "compiled 4x slower" roll back at exactly that ratio, whatever the
    wall clock read."""
    monkeypatch.setattr(speed_module, "_cuda", lambda: False)
    monkeypatch.setattr(speed_module.time, "thread_time", clock)
    with spend_on(clock):
        g = safe_compile(two_graphs, backend=slower_backend(clock, 0.0015))
        for _ in range(400):
            g(torch.randn(4))
    last = g.safecompile.stats().last_rollback
    assert last is not None
    assert last.reason is Reason.SLOWER
    assert "the whole call 4.000x eager's time" in (last.message or "")


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


# ---------------------------------------------------------------- the verdict, injected latencies


def test_compiled_three_percent_slower_stays() -> None:
    """3% slower than eager is within slower_ratio=1.05: compiled keeps serving."""
    sim = Sim(_policy(), compiled=_const(1.03), eager=_const(1.0))
    sim.calls(2000)
    (at, decision), *_ = sim.verdicts
    assert decision.eager is False
    assert decision.ratio == pytest.approx(1.03)
    assert decision.pairs == 16
    assert not sim.rolled_back
    assert sim.log[:at].count("eager") == 16 * 2  # each probe after an eager call
    assert set(sim.log[at : at + 3190]) == {"compiled"}  # nothing probed until the next round


@pytest.mark.parametrize("slower", [1.10, 2.0])
def test_compiled_clearly_slower_rolls_back(slower: float) -> None:
    """10% or 2x slower than eager: eager wins, and serves from the verdict on."""
    sim = Sim(_policy(), compiled=_const(slower), eager=_const(1.0))
    sim.calls(1000)
    (at, decision), *_ = sim.verdicts
    assert decision.eager is True
    assert decision.ratio == pytest.approx(slower)
    assert set(sim.log[at:]) == {"eager"}


def test_equal_speed_stays_compiled() -> None:
    """Equal latencies: compiled stays."""
    sim = Sim(_policy(), compiled=_const(1.0), eager=_const(1.0))
    sim.calls(1000)
    assert [d.eager for _, d in sim.verdicts] == [False]


def test_no_timing_during_warm_up() -> None:
    """The first warm_calls calls are served compiled and never timed."""
    sim = Sim(_policy(warm_calls=128), compiled=_const(5.0), eager=_const(1.0))
    sim.calls(128)
    assert sim.arms == Counter(compiled=128)
    assert sim.speed.timed == 0
    assert sim.speed.wants  # the next call opens the first pair


def test_pairs_are_made_of_like_calls() -> None:
    """Calls of two groups, interleaved: each pair's two calls share a group (a half
    pair waits for its partner), and the verdict pools the groups' ratios."""
    speed = CallSpeed(_policy(warm_calls=0, min_pairs=4, max_pairs=4, settle=0))
    speed.add(0)
    opened = speed.plan("a")
    assert opened is Step.TIME_COMPILED
    speed.record(opened, 2.0)
    speed.add(1)
    assert speed.plan("b") is Step.UNTIMED  # another group: not its partner
    speed.add(1)
    partner = speed.plan("a")
    assert partner is Step.TIME_EAGER
    assert speed.record(partner, 1.0) is None
    assert speed.to_dict()["pairs"] == 1


def test_a_half_pair_without_partner_expires() -> None:
    """A group whose partner does not come within 4 strides is dropped: the next call,
    of any group, opens a new pair."""
    speed = CallSpeed(_policy(warm_calls=0, settle=0))
    speed.add(0)
    speed.record(speed.plan("rare"), 1.0)
    for _ in range(32):
        speed.add(1)
        assert speed.plan("common") is Step.UNTIMED
    speed.add(1)
    assert speed.plan("common") is Step.TIME_EAGER  # a new pair (eager opens it)


def test_a_timed_call_follows_calls_of_its_own_arm() -> None:
    """A call's time depends on the arm that ran just before it (docs/speed.md): a probe
    runs after an untimed eager call, a timed compiled call after a compiled call; with
    settle=2, after 2 of them."""
    for settle in (1, 2):
        policy = _policy(settle=settle)
        sim = Sim(policy, compiled=_const(1.0), eager=_const(1.0), key=lambda n: n % 3)
        sim.calls(3000)
        steps = sim.steps
        probes = [i for i, step in enumerate(steps) if step is Step.TIME_EAGER]
        timed = [i for i, step in enumerate(steps) if step is Step.TIME_COMPILED]
        assert len(probes) >= 16
        assert all(sim.log[i - settle : i] == ["eager"] * settle for i in probes)
        assert all(sim.log[i - settle : i] == ["compiled"] * settle for i in timed)


def test_pairs_do_not_lock_to_a_cycle_in_the_traffic() -> None:
    """Traffic that repeats every 100 calls: the gaps between pairs are random, so the
    pairs spread over the cycle instead of timing the same few calls round after round."""
    sim = Sim(_policy(ratio=10.0), compiled=_const(1.0), eager=_const(1.0), key=lambda n: n % 5)
    sim.calls(20_000)
    timed = {i % 100 for i, step in enumerate(sim.steps) if step is not Step.UNTIMED}
    assert len(timed) > 90


def test_variable_traffic_still_pairs() -> None:
    """Twenty groups in random order: pairs complete, and a 2x slower path is found."""
    rng = random.Random(0)
    sim = Sim(_policy(), compiled=_const(2.0), eager=_const(1.0), key=lambda _n: rng.randrange(20))
    sim.calls(3000)
    assert sim.verdicts
    assert sim.verdicts[0][1].eager is True


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


def test_rounds_back_off() -> None:
    """Compiled keeps winning: each round that agrees waits twice as long as the last."""
    sim = Sim(_policy(), compiled=_const(0.5), eager=_const(1.0))
    sim.calls(40_000)
    at = [a for a, _ in sim.verdicts]
    assert all(d.eager is False for _, d in sim.verdicts)
    gaps = [b - a for a, b in itertools.pairwise(at)]
    # the calls a round sent to eager (16 probes and the calls settling them) x 100,
    # doubling, then the next round's own span (16 pairs at most 2 strides apart)
    sent = [sim.log[a:b].count("eager") for a, b in itertools.pairwise([0, *at[:-1]])]
    assert len(gaps) == 3
    assert all(16 < n <= 16 * 2 for n in sent)
    spans = [gap - 100 * n * 2**i for i, (gap, n) in enumerate(zip(gaps, sent, strict=True))]
    assert all(0 < span <= 16 * 2 * 8 for span in spans)


def test_restart_measures_again_after_the_warm_up() -> None:
    """restart(): the round in progress and the backoff are forgotten; a new round
    starts warm_calls calls later."""
    speed = CallSpeed(_policy(warm_calls=10))
    speed.add(10)
    assert speed.wants
    speed.plan("x")
    speed.restart()
    assert not speed.wants
    assert speed.add(5) == 5
    assert speed.add(5) == 0
    assert speed.wants
    assert speed.plan("x") is not Step.UNTIMED  # nothing stuck in flight


def test_steady_state_budget() -> None:
    """Compiled wins: at steady state at most 1% of calls are probes, and a round's
    burst is bounded by max_pairs probes."""
    policy = _policy()
    sim = Sim(policy, compiled=_const(0.8), eager=_const(1.0))
    sim.calls(200_000)
    first_at = sim.verdicts[0][0]
    settled = sim.log[first_at:]
    assert settled.count("eager") / len(settled) <= 0.01
    assert sim.log[: policy.warm_calls].count("eager") == 0
    assert sim.log[policy.warm_calls : first_at].count("eager") <= 16 * (policy.settle + 1)
    assert sim.speed.probes <= 16 * (policy.settle + 1) * (len(sim.verdicts) + 1)


def test_a_failed_timed_call_is_forgotten() -> None:
    """A timed call that raised (or could not be timed) leaves no half pair and nothing
    in flight: the next call opens a new pair."""
    speed = CallSpeed(_policy(warm_calls=0, settle=0))
    speed.add(0)
    speed.record(speed.plan("x"), 1.0)  # compiled opens the first pair
    speed.add(1)
    assert speed.plan("x") is Step.TIME_EAGER
    speed.abandon()  # its partner raised
    assert speed.timed == 1
    speed.add(1)
    assert speed.plan("x") is Step.TIME_EAGER  # a new pair (eager opens it), nothing stuck


def test_one_timed_call_at_a_time() -> None:
    """While a timed call is out (another thread), other calls are not timed."""
    speed = CallSpeed(_policy(warm_calls=0, settle=0))
    speed.add(0)
    assert speed.plan("x") is Step.TIME_COMPILED
    assert speed.plan("x") is Step.UNTIMED


# ---------------------------------------------------------------- end to end

_SPEND = {"seconds": 0.0}
_CLOCK: list[FakeClock] = []


@torch._dynamo.disable  # type: ignore[untyped-decorator]
def spend() -> None:
    """The user's own work outside any graph: the eager arm's cost (and, on the compiled
    path, the code between graphs)."""
    if _CLOCK:
        _CLOCK[-1].advance(_SPEND["seconds"])


@contextlib.contextmanager
def spend_on(clock: FakeClock, seconds: float = 0.001) -> Iterator[FakeClock]:
    """While open, :func:`spend` advances ``clock`` by ``seconds``."""
    _CLOCK.append(clock)
    _SPEND["seconds"] = seconds
    try:
        yield clock
    finally:
        _CLOCK.clear()


def slower_backend(clock: FakeClock, seconds: float) -> SlowBackend:
    """Each compiled graph run advances ``clock`` by ``seconds``."""
    return SlowBackend(delay=seconds, sleep=clock.advance)


@pytest.fixture
def spending(clock: FakeClock) -> Iterator[FakeClock]:
    """The fake clock, advanced 1 ms by each call of the user's function."""
    with spend_on(clock) as spent:
        yield spent


def affine(x: torch.Tensor) -> torch.Tensor:
    spend()
    return x * 2 + 1


def two_graphs(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    spend()  # a graph break: the graphs and the code between them are one call
    return y + 1


def test_a_slower_call_rolls_back(spending: FakeClock) -> None:
    """The whole compiled call takes 3 ms more than eager's 1 ms: rolled back (slower),
    every result equals eager's, and the event gives the ratio over the pairs."""
    g = safe_compile(two_graphs, backend=slower_backend(spending, 0.0015), clock=spending)
    for _ in range(400):
        x = torch.randn(4)
        torch.testing.assert_close(g(x), two_graphs(x), rtol=0, atol=0)
    c = g.safecompile
    assert c.state is State.ROLLED_BACK
    last = c.stats().last_rollback
    assert last is not None
    assert last.reason is Reason.SLOWER
    assert "the whole call 4.000x eager's time" in (last.message or "")
    assert "over 16 pairs" in (last.message or "")
    verdict = next(e for e in c.events() if e.kind is EventKind.SPEED_VERDICT)
    assert verdict.details["verdict"] == "eager"
    assert verdict.function == "two_graphs"
    stats = c.stats()
    assert stats.calls == stats.compiled_calls + stats.eager_calls == 400
    assert stats.extra["speed"]["probes"] == 16 * 2  # each probe after an eager call


def test_a_faster_call_stays_compiled(spending: FakeClock) -> None:
    """Compiled graphs cost nothing over the user's own work: compiled stays, and the
    verdict is reported with its ratio."""
    g = safe_compile(affine, backend=slower_backend(spending, 0.0), clock=spending)
    for _ in range(400):
        g(torch.randn(4))
    c = g.safecompile
    assert c.state is State.COMPILED
    speed = c.report()["speed"]
    assert speed["rounds"] == 1
    assert speed["last"]["verdict"] == "compiled"
    assert speed["last"]["ratio"] == pytest.approx(1.0)
    assert c.stats().extra["speed"]["last_ratio"] == pytest.approx(1.0)


def test_every_call_checked_still_measures(spending: FakeClock) -> None:
    """Shadow(every=1), every compiled call shadow-checked: a compiled path 3 ms slower
    per call still rolls back (slower); the checks' own eager runs are not timed."""
    g = safe_compile(
        affine, backend=slower_backend(spending, 0.003), shadow=Shadow(every=1), clock=spending
    )
    for _ in range(600):
        x = torch.randn(4)
        torch.testing.assert_close(g(x), affine(x), rtol=0, atol=0)
    c = g.safecompile
    assert c.state is State.ROLLED_BACK
    last = c.stats().last_rollback
    assert last is not None
    assert last.reason is Reason.SLOWER
    assert "4.000x" in (last.message or "")
    assert c.stats().shadow_checks > 100  # the compiled calls were checked meanwhile


_EFFECTS = {"n": 0}


@torch._dynamo.disable  # type: ignore[untyped-decorator]
def effect_once() -> None:
    _EFFECTS["n"] += 1


def test_probes_keep_side_effects_and_gradients(spending: FakeClock) -> None:
    """A probe is the original function on the caller's own arguments: gradients reach
    the caller, a side effect happens once."""

    def effect(x: torch.Tensor) -> torch.Tensor:
        effect_once()
        spend()
        return x * 2 + 1

    _EFFECTS["n"] = 0
    g = safe_compile(effect, backend=slower_backend(spending, 0.0), shadow=None, clock=spending)
    for i in range(400):
        x = torch.randn(4, requires_grad=True)
        g(x).sum().backward()
        assert x.grad is not None
        torch.testing.assert_close(x.grad, torch.full((4,), 2.0))
        assert _EFFECTS["n"] == i + 1
    assert g.safecompile.stats().extra["speed"]["probes"] > 0
    assert g.safecompile.stats().eager_calls > 0


def viewed(x: torch.Tensor) -> torch.Tensor:
    spend()
    return x.view(2, 2)


def test_a_probe_that_raises_is_the_users_error(spending: FakeClock) -> None:
    """Eager raising on a probe is the caller's own error: raised unchanged, nothing
    tripped, nothing left in flight, and the verdict goes on measuring."""
    g = safe_compile(viewed, backend=slower_backend(spending, 0.0), shadow=None, clock=spending)
    c = g.safecompile
    for _ in range(128):
        g(torch.randn(4))
    assert c.report()["speed"]["measuring"] is True
    g(torch.randn(4))  # opens a pair, on compiled
    bad = torch.randn(3)  # the same group (sizes round up to 4): the partner, a probe
    with pytest.raises(RuntimeError, match="invalid for input of size 3"):
        g(bad)
    assert (c.report()["speed"]["probes"], c.report()["speed"]["timed"]) == (1, 1)
    assert c.state is State.COMPILED
    for _ in range(400):
        g(torch.randn(4))
    assert c.report()["speed"]["rounds"] == 1
    assert c.stats().rollbacks == 0


_WORK: list[FakeClock] = []


@torch._dynamo.disable  # type: ignore[untyped-decorator]
def eager_work(x: torch.Tensor) -> None:
    """The eager arm's cost, by size: 1 ms for 4 elements, 10 ms for 64."""
    _WORK[-1].advance(0.001 if x.numel() <= 4 else 0.010)


def sized(x: torch.Tensor) -> torch.Tensor:
    if not torch.compiler.is_compiling():  # traced away: the compiled graph's cost is its own
        eager_work(x)
    return x * 2 + 1


def test_the_traffic_rolls_back_end_to_end(clock: FakeClock) -> None:
    """Small calls 2% faster compiled, big ones 10% slower, 6 calls in 10 small: the median
    pair favours compiled, the traffic takes ~8% more time compiled: rolled back
    (``slower``), every result eager's (the median pair alone kept it compiled)."""

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        def run(*args: Any) -> Any:
            big = any(isinstance(a, torch.Tensor) and a.numel() > 4 for a in args)
            clock.advance(0.011 if big else 0.00098)
            return gm.forward(*args)

        return run

    _WORK.append(clock)
    g = safe_compile(sized, backend=backend, clock=clock)
    rng = random.Random(0)
    try:
        for _ in range(2000):
            x = torch.randn(4 if rng.random() < 0.6 else 64)
            torch.testing.assert_close(g(x), x * 2 + 1, rtol=0, atol=0)
    finally:
        _WORK.clear()
    c = g.safecompile
    assert c.state is State.ROLLED_BACK
    last = c.stats().last_rollback
    assert last is not None
    assert last.reason is Reason.SLOWER
    verdict = next(e for e in c.events() if e.kind is EventKind.SPEED_VERDICT)
    assert verdict.details["verdict"] == "eager"
    assert verdict.details["median"] == pytest.approx(0.98)
    assert verdict.details["ratio"] > 1.05


def test_buckets_time_the_padded_call(spending: FakeClock) -> None:
    """With buckets, the compiled arm is the padded call (pad, compiled, cut back), the
    eager arm the unpadded one; pairs group by bucket."""

    def rows(x: torch.Tensor) -> torch.Tensor:
        spend()
        return x * 2

    g = safe_compile(
        rows,
        backend=slower_backend(spending, 0.002),
        buckets=Buckets(dims={"x": 0}, sizes=(4, 8)),
        clock=spending,
    )
    for i in range(500):
        x = torch.randn(3 + i % 5, 2)
        torch.testing.assert_close(g(x), rows(x), rtol=0, atol=0)
    last = g.safecompile.stats().last_rollback
    assert last is not None
    assert last.reason is Reason.SLOWER


def test_recovery_measures_again(spending: FakeClock) -> None:
    """After a slower trip, retry_after=0 brings the compiled path back at once, and
    the verdict measures from scratch (the one entry point: restart_speed)."""
    backend = slower_backend(spending, 0.003)
    g = safe_compile(
        affine, backend=backend, rollback=Rollback(retry_after=0), shadow=None, clock=spending
    )
    for _ in range(300):
        g(torch.randn(4))
    c = g.safecompile
    assert c.stats().rollbacks == 1
    backend.delay = 0.0  # the traffic changed: compiled is as fast as eager now
    for _ in range(400):
        g(torch.randn(4))
    assert c.state is State.COMPILED
    assert c.report()["speed"]["last"]["verdict"] == "compiled"


def test_no_probes_in_the_first_calls(spending: FakeClock) -> None:
    """The default routes nothing to eager in the first 128 calls: short tests keep
    exact counts, however slow compiled is."""
    g = safe_compile(affine, backend=slower_backend(spending, 5.0), clock=spending)
    for _ in range(128):
        g(torch.randn(4))
    stats = g.safecompile.stats()
    assert (stats.compiled_calls, stats.eager_calls) == (128, 0)
    assert stats.extra["speed"]["timed"] == 0


def test_slower_ratio_none_turns_it_off(spending: FakeClock) -> None:
    """Rollback(slower_ratio=None): nothing is timed or routed, compiled always serves."""
    g = safe_compile(
        affine,
        backend=slower_backend(spending, 5.0),
        rollback=Rollback(slower_ratio=None),
        shadow=None,
        clock=spending,
    )
    for _ in range(1000):
        g(torch.randn(4))
    stats = g.safecompile.stats()
    assert (stats.compiled_calls, stats.eager_calls) == (1000, 0)
    assert stats.extra["speed"] == {
        "on": False,
        "probes": 0,
        "timed": 0,
        "rounds": 0,
        "last_ratio": None,
    }
    assert g.safecompile.report()["speed"] is None


def test_threads_count_every_call(spending: FakeClock) -> None:
    """Four threads: every call is counted once in stats, and the verdict counts the
    threads' calls together (each reports in batches) and times calls."""
    g = safe_compile(affine, backend=slower_backend(spending, 0.0), shadow=None, clock=spending)
    g(torch.randn(4))

    def work() -> None:
        for _ in range(500):
            g(torch.randn(4))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    c = g.safecompile
    stats = c.stats()
    assert stats.calls == 2001
    speed = c.report()["speed"]
    assert speed["calls"] <= 2001  # threads report in batches: never more than made
    assert speed["calls"] >= 128  # enough reported to start a round
    assert speed["timed"] >= 1


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


def test_a_slower_trip_with_retry_after_recovers_and_backs_off(spending: FakeClock) -> None:
    """After a ``slower`` rollback, the trial runs the compiled path it tries: one retry,
    the callable recovers, its speed is measured afresh; still slower, it trips again
    soon after, with a doubled wait (calls of 1-2 ms)."""
    clock = spending
    g = safe_compile(
        affine,
        backend=slower_backend(clock, 0.001),
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
    speed = c.report()["speed"]
    assert speed["measuring"] is False  # measured afresh, after its warm-up
    assert speed["last"] is None
    calls(400)  # still 2x slower: a new verdict, and a longer wait (backoff)
    again = c.stats().last_rollback
    assert c.state is State.ROLLED_BACK
    assert again is not None
    assert again is not first
    assert again.reason is Reason.SLOWER
    assert again.details["retry_in_s"] == 20
