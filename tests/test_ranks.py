"""Ranks that agree: real processes on 127.0.0.1, gloo, a fault injected on rank 1 only.

Each scenario starts its ranks once (this file run as a script, one process per rank),
every rank writes what it saw to a JSON file, and the tests read those files. Every
process is bounded by a timeout and killed past it: a hang fails the test, never the
suite.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from safecompile import ConfigError, Reason, Rollback, Shadow, compose, safe_compile
from safecompile.fleet.ranks import Agreement, Local
from safecompile.testing import (
    DriftingBackend,
    FailingBackend,
    FakeClock,
    RuntimeFailingBackend,
)
from tests.test_speed_verdict import affine, slower_backend, spend_on

_LIMIT_S = 150  # per scenario: process start, import torch, the calls (under load)
_SYNC_TIMEOUT_S = 3.0  # the short safe-point timeout of the timeout scenarios

Results = dict[int, dict[str, Any]]


def _run_scenario(scenario: str, world: int, where: Path) -> Results:
    """Start ``world`` ranks of ``scenario`` and collect what each reported."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, scenario, str(rank), str(world), str(where)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=(where / f"stderr{rank}.txt").open("w"),
        )
        for rank in range(world)
    ]
    deadline = time.monotonic() + _LIMIT_S
    try:
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
    except subprocess.TimeoutExpired:
        pytest.fail(f"scenario {scenario!r} hung past {_LIMIT_S}s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = {}
    for rank in range(world):
        path = where / f"rank{rank}.json"
        if path.exists():
            results[rank] = json.loads(path.read_text())
    return results


@pytest.fixture(scope="module")
def agree(tmp_path_factory: pytest.TempPathFactory) -> Results:
    """Three ranks, rank 1's backend faulty; several guarded functions, one start."""
    results = _run_scenario("agree", 3, tmp_path_factory.mktemp("agree"))
    assert sorted(results) == [0, 1, 2]
    return results


def _first_rolled_back(states: list[str]) -> int | None:
    return next((i for i, s in enumerate(states) if s == "rolled_back"), None)


def test_a_drifting_rank_serves_eager_at_once_and_its_peers_follow_at_the_safe_point(
    agree: Results,
) -> None:
    """Rank 1 drifts at call 3 and serves eager from that call on; ranks 0 and 2 leave
    compiled at the next safe point (call 8)."""
    assert _first_rolled_back(agree[1]["counted"]["states"]) == 3
    for rank, seen in agree.items():
        counted = seen["counted"]
        if rank != 1:
            assert _first_rolled_back(counted["states"]) == 8, rank
        assert all(counted["equal"]), rank  # every answer is eager's, on every rank
    assert agree[0]["counted"]["compiled_calls"] == 8
    assert agree[2]["counted"]["compiled_calls"] == 8
    assert agree[1]["counted"]["compiled_calls"] == 3  # its breaches answered eagerly


def test_the_origin_keeps_its_reason_and_peers_record_peer(agree: Results) -> None:
    """Rank 1's rollback says drift; the others say peer, with rank 1 and its reason."""
    own = agree[1]["counted"]["rollbacks"]
    assert [e["reason"] for e in own] == ["drift"]
    for rank in (0, 2):
        (event,) = agree[rank]["counted"]["rollbacks"]
        assert event["reason"] == "peer"
        assert event["details"]["peer_rank"] == 1
        assert event["details"]["peer_reason"] == "drift"
        assert event["details"]["call"] == 8
        assert event["details"]["rank"] == rank


def test_the_peer_rollback_span_names_the_peer(agree: Results) -> None:
    """Rank 0's ``safecompile.rollback`` span carries the reason and the origin rank."""
    (span,) = agree[0]["counted"]["spans"]
    assert span["safecompile.reason"] == "peer"
    assert span["safecompile.peer.rank"] == 1
    assert span["safecompile.peer.reason"] == "drift"


def test_sync_at_a_step_boundary_switches_every_rank(agree: Results) -> None:
    """A runtime failure on rank 1 is held until ``sync()``; there, every rank switches."""
    for rank, seen in agree.items():
        step = seen["step"]
        assert step["before_sync"] != "rolled_back", rank  # held: still compiled
        assert step["after_sync"] == "rolled_back", rank
        assert step["compiled_after_sync"] == 0, rank
        assert all(step["equal"]), rank
    assert agree[1]["step"]["rollbacks"] == ["runtime_error"]
    assert agree[0]["step"]["rollbacks"] == agree[2]["step"]["rollbacks"] == ["peer"]


def test_recovery_is_agreed_too(agree: Results) -> None:
    """``retry_after``: no rank tries compiled again until every rank's wait is over."""
    for rank, seen in agree.items():
        retry = seen["retry"]
        assert retry["tripped"] == "rolled_back", rank
        assert retry["one_rank_waiting"] == "rolled_back", rank
        assert retry["all_ready"] in ("canary", "compiled"), rank
        assert retry["compiled_after"] == 1, rank
        assert retry["kinds"][-2:] == ["retry", "recovered"], rank


def test_a_compile_error_trips_its_rank_at_once_and_the_others_at_the_safe_point(
    agree: Results,
) -> None:
    """Rank 1 cannot compile: it serves eager from call 0 (compiling once, not on every
    call); ranks 0 and 2 follow at the safe point (call 4), with reason peer."""
    faulty = agree[1]["compile_error"]
    assert _first_rolled_back(faulty["states"]) == 0
    assert faulty["compiles"] == 1
    assert [e["reason"] for e in faulty["rollbacks"]] == ["compile_error"]
    for rank in (0, 2):
        seen = agree[rank]["compile_error"]
        assert _first_rolled_back(seen["states"]) == 4, rank
        (event,) = seen["rollbacks"]
        assert (event["reason"], event["details"]["peer_reason"]) == ("peer", "compile_error")
    assert all(all(seen["compile_error"]["equal"]) for seen in agree.values())


def test_a_slower_verdict_on_one_rank_is_agreed(agree: Results) -> None:
    """Rank 1's speed verdict finds compiled slower: held, and every rank rolls back at
    the same safe point (rank 1 with reason slower, the others peer)."""
    first = {rank: _first_rolled_back(seen["slower"]["states"]) for rank, seen in agree.items()}
    assert first[1] is not None
    assert first[1] > 0
    assert first[1] % 64 == 0  # at a safe point, not at the verdict's call
    assert set(first.values()) == {first[1]}
    assert [e["reason"] for e in agree[1]["slower"]["rollbacks"]] == ["slower"]
    for rank in (0, 2):
        (event,) = agree[rank]["slower"]["rollbacks"]
        assert (event["reason"], event["details"]["peer_reason"]) == ("peer", "slower")


def test_without_a_group_a_rank_trips_alone(agree: Results) -> None:
    """``group=None``: behaviour unchanged — rank 1 trips at once, the others stay."""
    assert agree[1]["alone"]["state"] == "rolled_back"
    assert agree[0]["alone"]["state"] == agree[2]["alone"]["state"] == "canary"
    assert all(seen["alone"]["ranks"] is None for seen in agree.values())


@pytest.fixture(scope="module")
def timeouts(tmp_path_factory: pytest.TempPathFactory) -> Results:
    """Two ranks: rank 1 first arrives late at a safe point, then dies before another."""
    results = _run_scenario("timeouts", 2, tmp_path_factory.mktemp("timeouts"))
    assert sorted(results) == [0, 1]
    return results


def test_a_late_peer_learns_that_the_others_gave_up(timeouts: Results) -> None:
    """Rank 0 times out waiting for rank 1 and trips; rank 1, arriving later, is told by
    the entry times and trips too: both end eager from the same call."""
    for rank, seen in timeouts.items():
        late = seen["late"]
        assert _first_rolled_back(late["states"]) == 2, rank
        (event,) = late["rollbacks"]
        assert event["reason"] == "peer"
        assert all(late["equal"]), rank
    assert "sync_timeout" in timeouts[0]["late"]["rollbacks"][0]["details"]["sync_error"]
    assert "after another" in timeouts[1]["late"]["rollbacks"][0]["details"]["sync_error"]
    assert _SYNC_TIMEOUT_S - 0.1 <= timeouts[0]["late"]["safe_point_s"] < _SYNC_TIMEOUT_S + 5


def test_a_peer_that_dies_trips_the_others_instead_of_hanging(timeouts: Results) -> None:
    """Rank 1 exits before a safe point: rank 0 trips (``peer``) within the timeout."""
    assert "dead" not in timeouts[1]
    dead = timeouts[0]["dead"]
    assert _first_rolled_back(dead["states"]) == 4
    assert all(dead["equal"])
    (event,) = dead["rollbacks"]
    assert event["reason"] == "peer"
    assert "sync_error" in event["details"]
    assert dead["safe_point_s"] < _SYNC_TIMEOUT_S + 5
    assert dead["after_s"] < 1.0  # no collective once the agreement has ended
    assert dead["ranks"]["ended"]


@pytest.fixture(scope="module")
def channel(tmp_path_factory: pytest.TempPathFactory) -> Results:
    """Two ranks that make different calls, and a module with a collective in forward."""
    results = _run_scenario("channel", 2, tmp_path_factory.mktemp("channel"))
    assert sorted(results) == [0, 1]
    return results


def test_an_extra_call_on_one_rank_never_pairs_with_the_users_collective(
    channel: Results,
) -> None:
    """Rank 0 makes one more guarded call (a safe point) before both ranks all_reduce 8
    floats: the user's collective gets its right values on both ranks; rank 0 gives up
    waiting and serves eager, rank 1 learns it at its own safe point."""
    for rank, seen in channel.items():
        extra = seen["extra"]
        assert extra["reduced"] == [3.0] * 8, rank
        assert all(extra["equal"]), rank
        assert extra["states"][-1] == "rolled_back", rank
        (event,) = extra["rollbacks"]
        assert event["reason"] == "peer", rank
    assert "sync_timeout" in channel[0]["extra"]["rollbacks"][0]["details"]["sync_error"]
    assert "after another" in channel[1]["extra"]["rollbacks"][0]["details"]["sync_error"]


def test_sync_on_one_rank_only_is_caught_not_paired(channel: Results) -> None:
    """``sync()`` on rank 0 alone: its safe point and rank 1's next periodic one carry the
    same index at different calls; both ranks see it, leave the agreement and serve eager."""
    for rank, seen in channel.items():
        lone = seen["lone"]
        (event,) = lone["rollbacks"]
        assert event["reason"] == "peer", rank
        assert "different calls" in event["details"]["sync_error"], rank
        assert "rank 0 at call 2, rank 1 at call 4" in event["details"]["sync_error"], rank
        assert lone["ended"], rank
        assert all(lone["equal"]), rank


def test_a_collective_inside_forward_with_drift_on_one_rank(channel: Results) -> None:
    """A module that all_reduces inside forward; rank 1's compiled graph drifts from its
    first run. Every call on both ranks returns eager's value (the sum over ranks): rank
    1 serves eager from the call that caught the drift, rank 0 follows by the safe point."""
    for rank, seen in channel.items():
        collective = seen["collective"]
        assert all(collective["equal"]), (rank, collective["equal"])
        assert collective["states"][-1] == "rolled_back", rank
    assert channel[1]["collective"]["states"][0] == "rolled_back"  # at once, not at call 4
    assert [e["reason"] for e in channel[1]["collective"]["rollbacks"]] == ["drift"]


# ---------------------------------------------------------------------- in this process


class _Group:
    """A stand-in process group: this rank's number and the group's size."""

    def __init__(self, rank: int, world: int) -> None:
        self._rank, self._world = rank, world

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._world


class _Peers(Agreement):
    """An agreement whose exchange is simulated: the peers' verdicts are given."""

    def __init__(
        self, rank: int, peers: dict[int, Local], *, late_ms: int = 0, every: int = 4
    ) -> None:
        super().__init__(_Group(rank, len(peers) + 1), every=every, timeout=2.0)
        self._peers = peers
        self._late_ms = late_ms  # how much later than this rank the peers enter

    def _exchange(self, group: Any, index: int, row: list[int]) -> list[list[int]]:
        call, entered = row[1], row[5] + self._late_ms
        rows = {group.rank(): row}
        for rank, local in self._peers.items():
            rows[rank] = _encode(local, rank, group.size(), index, call, entered)
        return [rows[rank] for rank in range(group.size())]


def _encode(
    local: Local, rank: int, world: int, index: int, call: int, entered_ms: float
) -> list[int]:
    """What a peer writes at safe point ``index`` (its own agreement encodes it)."""
    captured: list[list[int]] = []
    probe = Agreement(_Group(rank, world), every=4, timeout=2.0, wall=lambda: entered_ms / 1000)
    probe.safe_points = index - 1

    def capture(_group: Any, _index: int, row: list[int]) -> list[list[int]]:
        captured.append(row)
        return [row] * world

    probe._exchange = capture  # type: ignore[method-assign]
    probe.agree(local, call)
    return captured[0]


_OK = Local(tripped=False, reason=None, ready=False)


def test_the_lowest_tripped_rank_and_its_reason_win() -> None:
    """Ranks 2 (slower) and 3 (drift) tripped: every rank hears rank 2, slower."""
    peers = {
        1: _OK,
        2: Local(tripped=True, reason=Reason.SLOWER, ready=False),
        3: Local(tripped=True, reason=Reason.DRIFT, ready=False),
    }
    outcome = _Peers(0, peers).agree(_OK, 8)
    assert outcome is not None
    assert (outcome.trip, outcome.origin, outcome.origin_reason) == (True, 2, Reason.SLOWER)
    assert (outcome.call, outcome.rank, outcome.world, outcome.recover) == (8, 0, 4, False)


def test_nothing_tripped_changes_nothing() -> None:
    """No verdict anywhere: no trip, no failure."""
    outcome = _Peers(1, {0: _OK, 2: _OK}).agree(_OK, 4)
    assert outcome is not None
    assert (outcome.trip, outcome.failure) == (False, None)


def test_recovery_needs_every_rank_ready() -> None:
    """Every rank tripped: they retry only when every one is ready."""
    ready = Local(tripped=True, reason=Reason.DRIFT, ready=True)
    waiting = Local(tripped=True, reason=Reason.PEER, ready=False)
    assert _Peers(0, {1: ready}).agree(ready, 4).recover  # type: ignore[union-attr]
    assert not _Peers(0, {1: waiting}).agree(ready, 4).recover  # type: ignore[union-attr]


def test_a_spread_past_the_timeout_ends_the_agreement() -> None:
    """A peer that entered more than sync_timeout later means the first one gave up."""
    agreement = _Peers(0, {1: _OK}, late_ms=2500)
    outcome = agreement.agree(_OK, 4)
    assert outcome is not None
    assert outcome.failure is not None
    assert "after another" in outcome.failure
    assert agreement.broken == outcome.failure
    assert agreement.agree(_OK, 8) is None  # no collective once it has ended
    assert not agreement.holds()


def test_different_calls_at_one_safe_point_end_the_agreement() -> None:
    """A peer's row of the same safe point names another call: the call counts differ,
    nothing is paired, and every rank leaves the agreement (the same verdict on each)."""

    class _Behind(_Peers):
        def _exchange(self, group: Any, index: int, row: list[int]) -> list[list[int]]:
            rows = super()._exchange(group, index, row)
            rows[1] = [rows[1][0], rows[1][1] + 1, *rows[1][2:]]  # rank 1: one call later
            return rows

    agreement = _Behind(0, {1: _OK})
    outcome = agreement.agree(_OK, 64)
    assert outcome is not None
    assert outcome.failure is not None
    assert "rank 0 at call 64, rank 1 at call 65" in outcome.failure
    assert not outcome.trip
    assert agreement.agree(_OK, 128) is None  # nothing more once it has ended
    assert agreement.report()["ended"] == outcome.failure


def test_group_none_adds_nothing() -> None:
    """No group: no agreement object, trips apply at once, ``sync()`` is a no-op."""
    guarded = safe_compile(lambda x: x + 1, backend=RuntimeFailingBackend())
    assert guarded.safecompile.report()["ranks"] is None
    assert torch.equal(guarded(torch.ones(2)), torch.full((2,), 2.0))
    assert guarded.safecompile.sync() == "rolled_back"
    assert guarded.safecompile.report()["ranks"] is None


def test_group_true_before_init_trips_locally() -> None:
    """``group=True`` with torch.distributed not initialized: no peers, the trip is local."""
    assert not dist.is_initialized()
    guarded = safe_compile(
        lambda x: x + 1, backend=RuntimeFailingBackend(), group=True, name="ranks.local"
    )
    assert torch.equal(guarded(torch.ones(2)), torch.full((2,), 2.0))
    assert guarded.safecompile.state == "rolled_back"
    assert guarded.safecompile.sync() == "rolled_back"  # nothing to agree with


def test_an_agreed_recovery_restarts_the_speed_verdict_and_the_canary(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank tripped and ready: the agreed recovery brings back the compiled path
    whole: the speed verdict that had found eager faster measures afresh, and the canary
    starts again (one recovery routine, the same as a half-open trial's)."""
    peers = {1: _OK}

    def simulated(group: object, *, every: int, timeout: float, name: str) -> _Peers:
        return _Peers(0, peers, every=every)

    # the fleet plugged into safe_compile: a simulated peer, agreed with at each sync()
    fleet = dataclasses.replace(compose._FLEET, check_group=lambda group: None, peers=simulated)
    monkeypatch.setattr(compose, "_FLEET", fleet)
    with spend_on(clock):
        guarded = safe_compile(
            affine,
            backend=slower_backend(clock, 0.001),  # the whole call 2 ms against eager's 1
            dynamic=False,
            shadow=Shadow(canary=2),
            rollback=Rollback(retry_after=10, sync_every=1000),  # safe points: sync() only
            clock=clock,
            group=object(),
        )
        c = guarded.safecompile
        assert c.report()["ranks"] is not None
        x = torch.randn(4)
        for _ in range(400):  # 2x slower: eager wins, the slower trip is held
            torch.testing.assert_close(guarded(x), affine(x), rtol=0, atol=0)
        assert c.report()["speed"]["last"]["verdict"] == "eager"
        assert c.sync() == "rolled_back"
        clock.advance(10)
        peers[1] = Local(tripped=True, reason=Reason.PEER, ready=True)
        assert c.sync() == "canary"
        report = c.report()
        assert report["speed"]["last"] is None  # measured afresh
        assert report["graphs"][0]["canary_left"] == 2
        assert [e.kind.value for e in c.events()][-2:] == ["retry", "recovered"]
        compiled = c.stats().compiled_calls
        torch.testing.assert_close(guarded(x), affine(x), rtol=0, atol=0)
        assert c.stats().compiled_calls == compiled + 1


@pytest.mark.parametrize("group", [1, "world", False, object()])
def test_group_is_validated(group: object) -> None:
    """Anything but a ProcessGroup, True or None is refused at decoration."""
    with pytest.raises(ConfigError, match="group"):
        safe_compile(lambda x: x, group=group)


# ---------------------------------------------------------------------- the ranks


def _f(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2 + 1


def _g(x: torch.Tensor) -> torch.Tensor:
    return torch.cos(x) - x


def _h(x: torch.Tensor) -> torch.Tensor:
    return x * 3 - 1


def _k(x: torch.Tensor) -> torch.Tensor:
    return x.exp() / 2


def _m(x: torch.Tensor) -> torch.Tensor:
    return x.abs() + 2


def _inputs(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(4, 8, generator=gen) for _ in range(n)]


def _rollbacks(guarded: Any) -> list[dict[str, Any]]:
    return [
        {"reason": e.reason.value, "details": e.details, "message": e.message}
        for e in guarded.safecompile.events()
        if e.kind.value == "rollback"
    ]


def _calls(guarded: Any, fn: Any, inputs: list[torch.Tensor]) -> tuple[list[str], list[bool]]:
    states, equal = [], []
    for x in inputs:
        equal.append(torch.equal(guarded(x), fn(x)))
        states.append(guarded.safecompile.state.value)
    return states, equal


def _agree_rank(rank: int) -> dict[str, Any]:
    faulty = rank == 1
    out: dict[str, Any] = {}

    # Safe points every 8 calls; rank 1 drifts from its 4th compiled run (call 3).
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    counted = safe_compile(
        _f,
        backend=DriftingBackend(scale=1.5, from_run=4) if faulty else "eager",
        group=True,
        rollback=Rollback(sync_every=8),
        shadow=Shadow(canary=2, every=1),
        tracer_provider=provider,
    )
    states, equal = _calls(counted, _f, _inputs(20))
    spans = [
        dict(s.attributes or {})
        for s in exporter.get_finished_spans()
        if s.name.endswith("rollback")
    ]
    out["counted"] = {
        "states": states,
        "equal": equal,
        "compiled_calls": counted.safecompile.stats().compiled_calls,
        "rollbacks": _rollbacks(counted),
        "spans": spans,
    }

    # A training step's boundary: sync() only; rank 1's compiled code fails on run 2.
    step = safe_compile(
        _g,
        backend=RuntimeFailingBackend(on_run=2) if faulty else "eager",
        group=True,
        rollback=Rollback(sync_every=1000),
    )
    _, equal = _calls(step, _g, _inputs(5))
    before = step.safecompile.state.value
    after = step.safecompile.sync().value
    compiled = step.safecompile.stats().compiled_calls
    _, more = _calls(step, _g, _inputs(3))
    out["step"] = {
        "before_sync": before,
        "after_sync": after,
        "compiled_after_sync": step.safecompile.stats().compiled_calls - compiled,
        "equal": equal + more,
        "rollbacks": [e["reason"] for e in _rollbacks(step)],
    }

    # Recovery agreed: retry_after=10 on a fake clock; rank 1 is the last to be ready.
    clock = FakeClock()
    retry = safe_compile(
        _h,
        backend=RuntimeFailingBackend(on_run=2, once=True) if faulty else "eager",
        group=True,
        rollback=Rollback(sync_every=1000, retry_after=10),
        clock=clock,
    )
    _calls(retry, _h, _inputs(2))
    tripped = retry.safecompile.sync().value
    if not faulty:
        clock.advance(10)
    one_waiting = retry.safecompile.sync().value
    if faulty:
        clock.advance(10)
    all_ready = retry.safecompile.sync().value
    compiled = retry.safecompile.stats().compiled_calls
    _calls(retry, _h, _inputs(1))
    out["retry"] = {
        "tripped": tripped,
        "one_rank_waiting": one_waiting,
        "all_ready": all_ready,
        "compiled_after": retry.safecompile.stats().compiled_calls - compiled,
        "kinds": [e.kind.value for e in retry.safecompile.events()],
    }

    # A compile error on rank 1: it trips at once (nothing to run), the others at call 4.
    failing = FailingBackend()
    compiling = safe_compile(
        _k,
        backend=failing if faulty else "eager",
        group=True,
        rollback=Rollback(sync_every=4),
    )
    states, equal = _calls(compiling, _k, _inputs(6))
    out["compile_error"] = {
        "states": states,
        "equal": equal,
        "compiles": failing.compiles,
        "rollbacks": _rollbacks(compiling),
    }

    # The speed verdict on rank 1 only: its compiled calls take 2 ms against eager's 1.
    clock = FakeClock()
    with spend_on(clock):
        slow = safe_compile(
            affine,
            backend=slower_backend(clock, 0.001) if faulty else "eager",
            group=True,
            rollback=Rollback(sync_every=64),
            clock=clock,
            name="agree.slower",
        )
        states = []
        for x in _inputs(512):
            slow(x)
            states.append(slow.safecompile.state.value)
    out["slower"] = {"states": states, "rollbacks": _rollbacks(slow)}

    # No group: unchanged, a rank trips alone.
    alone = safe_compile(_m, backend=RuntimeFailingBackend() if faulty else "eager")
    _calls(alone, _m, _inputs(1))
    out["alone"] = {
        "state": alone.safecompile.state.value,
        "ranks": alone.safecompile.report()["ranks"],
    }
    return out


def _late(rank: int, where: Path) -> dict[str, Any]:
    guarded = safe_compile(
        _f,
        backend="eager",
        group=True,
        rollback=Rollback(sync_every=2, sync_timeout=_SYNC_TIMEOUT_S),
    )
    inputs = _inputs(4)
    states, equal = _calls(guarded, _f, inputs[:2])
    gave_up, done = where / "rank0-gave-up", where / "rank1-done"
    if rank == 1:  # reach the safe point only once rank 0 has stopped waiting
        _wait_for(gave_up)
    started = time.perf_counter()
    more_states, more_equal = _calls(guarded, _f, inputs[2:])
    safe_point_s = time.perf_counter() - started
    if rank == 0:  # and stay up until rank 1 has met the abandoned collective
        gave_up.touch()
        _wait_for(done)
    else:
        done.touch()
    return {
        "states": states + more_states,
        "equal": equal + more_equal,
        "rollbacks": _rollbacks(guarded),
        "safe_point_s": safe_point_s,
    }


def _dead(rank: int, result: dict[str, Any], where: Path) -> dict[str, Any]:
    group = dist.new_group([0, 1])
    guarded = safe_compile(
        _g,
        backend="eager",
        group=group,
        rollback=Rollback(sync_every=4, sync_timeout=_SYNC_TIMEOUT_S),
    )
    inputs = _inputs(8)
    states, equal = _calls(guarded, _g, inputs[:4])
    if rank == 1:  # die before the safe point at call 4
        (where / "rank1.json").write_text(json.dumps(result, default=str))
        os._exit(0)
    started = time.perf_counter()
    more_states, more_equal = _calls(guarded, _g, inputs[4:5])
    safe_point_s = time.perf_counter() - started
    started = time.perf_counter()
    rest_states, rest_equal = _calls(guarded, _g, inputs[5:])
    guarded.safecompile.sync()
    return {
        "states": states + more_states + rest_states,
        "equal": equal + more_equal + rest_equal,
        "rollbacks": _rollbacks(guarded),
        "safe_point_s": safe_point_s,
        "after_s": time.perf_counter() - started,
        "ranks": guarded.safecompile.report()["ranks"],
    }


def _channel_rank(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    timeout = Rollback(sync_every=4, sync_timeout=_SYNC_TIMEOUT_S)

    # Rank 0 makes one extra guarded call (index 4: a safe point), then both all_reduce.
    extra = safe_compile(_f, backend="eager", group=True, rollback=timeout, name="ch.extra")
    inputs = _inputs(5)
    states, equal = _calls(extra, _f, inputs[:4])
    if rank == 0:
        more_states, more_equal = _calls(extra, _f, inputs[4:])
    values = torch.full((8,), 1.5)
    dist.all_reduce(values)  # the user's own collective
    if rank == 1:  # its fifth call comes after
        more_states, more_equal = _calls(extra, _f, inputs[4:])
    out["extra"] = {
        "reduced": values.tolist(),
        "states": states + more_states,
        "equal": equal + more_equal,
        "rollbacks": _rollbacks(extra),
    }

    # sync() on rank 0 only, after 2 calls; rank 1 meets its periodic safe point at 4.
    lone = safe_compile(
        _g,
        backend="eager",
        group=True,
        rollback=Rollback(sync_every=4, sync_timeout=60.0),
        name="ch.lone",
    )
    inputs = _inputs(6)
    _, equal = _calls(lone, _g, inputs[:2])
    if rank == 0:
        lone.safecompile.sync()
    _, more = _calls(lone, _g, inputs[2:])
    out["lone"] = {
        "equal": equal + more,
        "rollbacks": _rollbacks(lone),
        "ended": lone.safecompile.report()["ranks"]["ended"],
    }

    # A collective inside forward; rank 1's compiled graph drifts from its first run.
    torch.manual_seed(0)
    module = _Reducing()
    layer = module.lin  # not guarded: the reference
    guarded = safe_compile(
        module,
        backend=DriftingBackend(scale=1.5) if rank == 1 else "eager",
        group=True,
        rollback=Rollback(sync_every=4),
        shadow=Shadow(canary=1, every=0),
        name="ch.collective",
    )
    states, equal = [], []
    for step in range(8):
        with torch.no_grad():
            got = guarded(_rank_input(rank, step))
            want = 2 * sum(layer(_rank_input(peer, step)) for peer in range(2))
        equal.append(bool(torch.allclose(got, want)))
        states.append(guarded.safecompile.state.value)
    out["collective"] = {
        "states": states,
        "equal": equal,
        "rollbacks": _rollbacks(guarded),
    }
    return out


class _Reducing(torch.nn.Module):
    """A layer whose output is summed over the ranks inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        dist.all_reduce(y)
        return y * 2


def _rank_input(rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 8, generator=gen)


def _wait_for(path: Path) -> None:
    """Another process's signal (bounded: the scenario's own limit ends a hang)."""
    deadline = time.monotonic() + 60
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def _main(scenario: str, rank: int, world: int, where: Path) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{where / 'init'}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    if scenario == "agree":
        result = _agree_rank(rank)
    elif scenario == "channel":
        result = _channel_rank(rank)
    else:
        result = {"late": _late(rank, where)}
        result["dead"] = _dead(rank, result, where)
    (where / f"rank{rank}.json").write_text(json.dumps(result, default=str))
    sys.stdout.flush()
    os._exit(0)  # no teardown: a dead or abandoned peer must not hang the exit


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
