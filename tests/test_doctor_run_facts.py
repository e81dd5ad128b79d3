"""The doctor says "cold" only when it measured a cold compile, and its HTML page says
when and on what it ran (a CI artifact read weeks later)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import warnings
from pathlib import Path

import pytest
import torch

from safecompile.__main__ import main
from safecompile.base import torchcompat
from safecompile.doctor import Call, Report, Thresholds, judge, render_html
from safecompile.doctor._measure import _cache_state

TARGETS = Path(__file__).parent / "doctor_targets.py"
VERSIONS = {"safecompile": "9.9", "torch": "2.13.0", "python": "3.11.4", "device": "cpu (x86_64)"}


def _report(*caches: str | None) -> Report:
    calls = tuple(
        Call(
            label=f"float32[{n}]",
            role="example",
            path="compiled",
            seconds=2.0,
            graphs=1,
            backend_s=1.5,
            graph_s=(1.5,),
            cache=cache,  # type: ignore[arg-type]
        )
        for n, cache in enumerate(caches, start=1)
    )
    return Report(
        target="models.py:target",
        name="models.score",
        kind="function",
        settings={"backend": "inductor"},
        thresholds=Thresholds(),
        versions=VERSIONS,
        quick=True,
        created="2026-12-06T17:30:05+00:00",
        examples=calls,
        compiles=len(calls),
        graphs=len(calls),
    )


def _compile_summary(report: Report) -> str:
    return next(c.summary for c in judge(report) if c.name == "compile")


@pytest.mark.parametrize(
    ("caches", "says"),
    [
        (("cold", "cold"), "cold first calls took 4.00 s"),
        (("warm", "warm"), "first calls (warm: inductor's caches served every graph) took 4.00 s"),
        (("cold", "warm"), "first calls (partly cold: some graphs came from inductor's caches)"),
        ((None, None), "; first calls took 4.00 s"),
    ],
)
def test_cold_is_said_only_when_a_cold_compile_was_measured(
    caches: tuple[str | None, ...], says: str
) -> None:
    """A run whose graphs all came from inductor's caches is not called cold; neither is
    one on a backend with no cache to ask."""
    summary = _compile_summary(_report(*caches))
    assert says in summary
    if "cold" not in caches:
        assert "cold" not in summary


def test_the_cache_state_of_a_call_is_read_from_torchs_counters() -> None:
    """inductor's FX graph cache counters moved during the call tell cold from warm."""
    before = {"fx_hit": 3, "fx_miss": 1, "aot_hit": 0}
    assert _cache_state(before, {"fx_hit": 3, "fx_miss": 2, "aot_hit": 0}) == "cold"
    assert _cache_state(before, {"fx_hit": 5, "fx_miss": 1, "aot_hit": 0}) == "warm"
    assert _cache_state(before, {"fx_hit": 3, "fx_miss": 1, "aot_hit": 1}) == "warm"
    assert _cache_state(before, {"fx_hit": 4, "fx_miss": 2, "aot_hit": 0}) == "mixed"
    assert _cache_state(before, dict(before)) is None
    assert _cache_state({}, {}) is None

    counters = torch._dynamo.utils.counters
    start = torchcompat.compile_cache_counts()
    counters["inductor"]["fxgraph_cache_hit"] += 1
    counters["inductor"]["fxgraph_cache_bypass"] += 1
    try:
        now = torchcompat.compile_cache_counts()
        assert now["fx_hit"] == start["fx_hit"] + 1
        assert now["fx_miss"] == start["fx_miss"] + 1
    finally:
        counters["inductor"]["fxgraph_cache_hit"] -= 1
        counters["inductor"]["fxgraph_cache_bypass"] -= 1


def test_the_html_page_says_when_and_on_what_it_ran() -> None:
    """Date (UTC), torch, safecompile and Python versions and the target, at the top."""
    report = _report("cold")
    page = render_html(dataclasses.replace(report, checks=judge(report)))
    top = page[page.index('id="verdict"') : page.index('id="checklist"')]
    assert "models.py:target" in top
    assert (
        "2026-12-06 17:30:05 UTC, torch 2.13.0, safecompile 9.9, Python 3.11.4, on cpu (x86_64)"
        in top
    )


def test_a_doctor_run_records_its_date(tmp_path: Path) -> None:
    """The report (its JSON and its page) carries the time it was made."""
    data, page = tmp_path / "report.json", tmp_path / "report.html"
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    code = main(
        [
            "doctor",
            f"{TARGETS}:clean",
            "--backend",
            "eager",
            "--quick",
            "--json",
            str(data),
            "--html",
            str(page),
        ]
    )
    assert code == 0
    created = datetime.datetime.fromisoformat(json.loads(data.read_text())["created"])
    assert before <= created <= datetime.datetime.now(datetime.timezone.utc)
    assert created.strftime("%Y-%m-%d %H:%M:%S UTC") in page.read_text()
    # eager asks no cache: its first calls are not called cold
    assert "cold" not in json.dumps(json.loads(data.read_text())["checks"])


def test_a_target_guarded_already_is_not_warned_about_as_a_shared_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The doctor's own guard takes the target's name on purpose: no warning says that
    two guards share it."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        code = main(["doctor", f"{TARGETS}:guarded_function", "--backend", "eager", "--quick"])
    assert code == 0
    assert not [w for w in seen if "two guarded callables" in str(w.message)]
    assert "two guarded callables" not in capsys.readouterr().err
