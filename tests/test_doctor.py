"""The doctor: ``python -m safecompile doctor MODULE:FACTORY`` and ``safecompile.doctor``.

The CLI runs in-process through ``main([...])`` (one test runs it as a subprocess). Targets
live in ``tests/doctor_targets.py``; they compile with ``backend="eager"`` or a
fault-injecting backend, except the one ``inductor`` test.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from safecompile.__main__ import main
from safecompile.base import torchcompat
from safecompile.doctor import (
    Call,
    DoctorTarget,
    Example,
    Failure,
    Report,
    Thresholds,
    Timing,
    UsageError,
    is_debug_backend,
    judge,
    parse_inputs,
    render_text,
    to_target,
)

HERE = Path(__file__).parent
TARGETS = HERE / "doctor_targets.py"
ROOT = HERE.parent
EXAMPLE = ROOT / "examples" / "doctor_target.py"


def spec(factory: str) -> str:
    """``tests/doctor_targets.py:FACTORY``, by path (independent of the current directory)."""
    return f"{TARGETS}:{factory}"


def marked_line(marker: str, path: Path = TARGETS) -> int:
    """The number of the line carrying ``# doctor-test: <marker>``."""
    lines = path.read_text().splitlines()
    found = [i + 1 for i, text in enumerate(lines) if text.endswith(f"# doctor-test: {marker}")]
    assert len(found) == 1, found
    return found[0]


def run(tmp_path: Path, *argv: str) -> tuple[int, dict[str, Any]]:
    """Run the CLI in-process with ``--json``; return the exit code and the parsed report."""
    out = tmp_path / "report.json"
    code = main(["doctor", *argv, "--json", str(out)])
    return code, json.loads(out.read_text())


def checks(report: dict[str, Any]) -> dict[str, str]:
    return {c["name"]: c["status"] for c in report["checks"]}


# ---------------------------------------------------------------------------- verdicts


def test_clean_function_is_ready(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A function without breaks, failures or drift: exit 0, every check run, verdict first."""
    code, report = run(tmp_path, spec("clean"), "--backend", "eager", "--repeat", "5")
    text = capsys.readouterr().out

    assert code == 0
    assert text.startswith("safecompile doctor: READY")
    assert report["verdict"] == "ready"
    assert report["exit_code"] == 0
    status = checks(report)
    assert status["compile"] == "pass"
    assert status["graph_breaks"] == "pass"
    assert status["drift"] == "pass"
    assert status["recompiles"] in ("pass", "warn")
    # eager is a debug backend: its speed is overhead only, never a failure
    assert status["speed"] in ("pass", "warn")
    assert [c["path"] for c in report["examples"]] == ["compiled", "compiled"]
    assert report["sweep"], "the leading dim was swept"
    assert len(report["timing"]) == 2


def test_json_has_every_section(tmp_path: Path) -> None:
    """``--json`` writes a report with the schema, the verdict, the checks and each section."""
    _, report = run(tmp_path, spec("one_call"), "--backend", "eager", "--quick")

    assert report["schema"] == "safecompile.doctor/1"
    for key in (
        "verdict",
        "exit_code",
        "target",
        "name",
        "settings",
        "thresholds",
        "versions",
        "checks",
        "examples",
        "sweep",
        "graph_breaks",
        "timing",
        "failure",
        "compiles",
        "graphs",
    ):
        assert key in report, key
    assert [c["name"] for c in report["checks"]] == [
        "compile",
        "graph_breaks",
        "recompiles",
        "speed",
        "drift",
    ]
    assert set(report["versions"]) >= {"torch", "python", "safecompile", "device"}
    assert report["versions"]["torch"] == torch.__version__
    assert report["settings"]["backend"] == "eager"
    assert report["name"] == "doctor_targets.clean_fn"


def test_json_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    """``--json -`` prints the JSON report instead of the text one."""
    code = main(["doctor", spec("one_call"), "--backend", "eager", "--quick", "--json", "-"])

    assert code == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "ready"


def test_stdout_is_the_report_only(capsys: pytest.CaptureFixture[str]) -> None:
    """What the user's code prints while the doctor runs goes to stderr, not into the report."""
    code = main(["doctor", spec("noisy"), "--backend", "eager", "--quick", "--json", "-"])
    captured = capsys.readouterr()

    assert code == 0
    assert json.loads(captured.out)["verdict"] == "ready"
    assert "loading the model..." in captured.err


def test_graph_break_is_reported_at_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A graph break fails the report (0 allowed) and names its file, line and function."""
    line = marked_line("graph-break")

    code, report = run(tmp_path, spec("breaking"), "--backend", "eager", "--quick")
    text = capsys.readouterr().out

    assert code == 1
    assert checks(report)["graph_breaks"] == "fail"
    [brk] = report["graph_breaks"]
    assert (brk["file"], brk["line"], brk["function"]) == (str(TARGETS), line, "breaking_fn")
    assert brk["source"] == "torch._dynamo.graph_break()  # doctor-test: graph-break"
    assert "graph_break()" in brk["reason"]
    assert text.startswith("safecompile doctor: NOT READY")
    assert f"doctor_targets.py:{line} in breaking_fn" in text
    assert "[FAIL] graph breaks" in text


def test_graph_breaks_within_the_allowance_warn(tmp_path: Path) -> None:
    """``--max-graph-breaks 1`` accepts the break: a warning, exit 0."""
    code, report = run(
        tmp_path, spec("breaking"), "--backend", "eager", "--quick", "--max-graph-breaks", "1"
    )

    assert code == 0
    assert checks(report)["graph_breaks"] == "warn"


def test_compile_failure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The target's own backend fails: exit 1 with the error type; later checks are skipped."""
    code, report = run(tmp_path, spec("failing"))
    text = capsys.readouterr().out

    assert code == 1
    status = checks(report)
    assert status["compile"] == "fail"
    assert status["recompiles"] == status["speed"] == status["drift"] == "skip"
    failure = report["failure"]
    assert failure["reason"] == "compile_error"
    assert failure["error_type"] == "torch._dynamo.exc.BackendCompilerFailed"
    assert "InjectedCompileError" in failure["message"]
    assert failure["function"] == "clean_fn"  # torch names no line: the function's own
    assert failure["at_definition"] is True
    assert report["examples"][0]["path"] == "failed"
    assert "[FAIL] compile" in text
    assert "BackendCompilerFailed" in text


def test_runtime_failure(tmp_path: Path) -> None:
    """Compiled code that raises where eager does not: a compile-check failure, exit 1."""
    code, report = run(tmp_path, spec("runtime_failing"))

    assert code == 1
    assert checks(report)["compile"] == "fail"
    assert report["failure"]["reason"] == "runtime_error"
    assert report["failure"]["error_type"].endswith("InjectedRuntimeError")


def test_compile_failure_points_at_the_user_line(tmp_path: Path) -> None:
    """fullgraph=True makes the graph break a compile failure, located at the break's line."""
    code, report = run(tmp_path, spec("fullgraph_break"), "--backend", "eager")

    assert code == 1
    failure = report["failure"]
    assert failure["error_type"].startswith("torch._dynamo.exc.")
    assert (failure["file"], failure["line"]) == (str(TARGETS), marked_line("graph-break"))
    assert failure["at_definition"] is False
    assert checks(report)["graph_breaks"] == "skip"


def test_drift_fails(tmp_path: Path) -> None:
    """Compiled outputs 1% off eager's fail the drift check with the figures."""
    code, report = run(tmp_path, spec("drifting"), "--quick")

    assert code == 1
    assert checks(report)["drift"] == "fail"
    [call] = report["examples"]
    assert call["drift"] is not None
    assert call["max_abs"] > 0


def test_slower_than_eager_fails(tmp_path: Path) -> None:
    """A compiled path slower than eager beyond --slower-ratio fails the speed check."""
    code, report = run(tmp_path, spec("slow"), "--repeat", "3")

    assert code == 1
    assert checks(report)["speed"] == "fail"
    [timing] = report["timing"]
    assert timing["ratio"] > 1.1
    assert timing["compiled_s"] > 0.002


def test_module_sweeps_batch_and_sequence(tmp_path: Path) -> None:
    """An nn.Module with (batch, seq, dim) inputs: both dims are swept; dynamic=auto passes."""
    code, report = run(tmp_path, spec("module"), "--backend", "eager", "--repeat", "3")

    assert code == 0, checks(report)
    assert report["kind"] == "module"
    assert report["name"] == "doctor_targets.Tagger.forward"
    assert "leading (batch) dim 4" in report["sweep_plan"]
    assert "dim 1 (sequence) 16" in report["sweep_plan"]
    assert checks(report)["recompiles"] in ("pass", "warn")
    assert report["compiles"] < report["thresholds"]["max_recompiles"]


def test_recompile_limit_fails_with_dynamic_false(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With dynamic=False every swept shape compiles: the sweep reaches the limit and stops."""
    code, report = run(
        tmp_path,
        spec("module"),
        "--backend",
        "eager",
        "--dynamic",
        "false",
        "--max-recompiles",
        "4",
        "--repeat",
        "3",
    )
    text = capsys.readouterr().out

    assert code == 1
    assert checks(report)["recompiles"] == "fail"
    assert report["compiles"] == 4
    assert report["sweep"][-1]["path"] == "eager"
    assert "stopped at the recompile limit" in report["sweep_stopped"]
    assert "Buckets" in text


def test_keyword_inputs(tmp_path: Path) -> None:
    """An example call given as a dict of keyword arguments."""
    code, report = run(tmp_path, spec("keywords"), "--backend", "eager", "--quick")

    assert code == 0
    assert report["examples"][0]["label"] == "x=float32[4, 8], scale=float"


def test_random_ops_make_drift_a_warning(tmp_path: Path) -> None:
    """Dropout in training mode: drift cannot be judged; a warning, not a failure."""
    code, report = run(tmp_path, spec("training_dropout"), "--backend", "eager", "--quick")

    assert checks(report)["drift"] == "warn"
    assert "dropout" in report["random_op"].lower()
    assert code == 0


def test_a_graph_no_check_can_copy_for_is_a_drift_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A graph updating an object that a shadow check cannot find to copy: the drift
    check warns that safe_compile's state will read ``unchecked``, and names it."""

    def unreadable() -> Any:  # torch's record of side effects, in a shape it cannot read
        raise RuntimeError("an entry of the record torch changed")

    monkeypatch.setattr(torchcompat, "side_effects", unreadable)
    code, report = run(tmp_path, spec("clean"), "--backend", "eager", "--quick")

    assert code == 0
    assert checks(report)["drift"] == "warn"
    assert report["unchecked"]  # every graph (the sweep adds one), each naming it
    assert all("record of side effects" in line for line in report["unchecked"])
    assert "WARN" in capsys.readouterr().out


def test_guarded_function_keeps_its_name_and_backend(tmp_path: Path) -> None:
    """A target already guarded by safe_compile: its name and backend are the defaults."""
    code, report = run(tmp_path, spec("guarded_function"), "--quick")

    assert code == 0
    assert report["name"] == "ranker.score"
    assert report["settings"]["backend"] == "eager"


def test_guarded_module(tmp_path: Path) -> None:
    """A module guarded in place: the doctor checks its own forward, not the guard."""
    code, report = run(tmp_path, spec("guarded_module"), "--quick")

    assert code == 0
    assert report["name"] == "doctor_targets.Tagger.forward"
    assert report["settings"]["backend"] == "aot_eager"
    assert report["examples"][0]["path"] == "compiled"


def test_grad_flag(tmp_path: Path) -> None:
    """``--grad`` runs with autograd on (the default is torch.no_grad())."""
    code, report = run(tmp_path, spec("module"), "--backend", "eager", "--quick", "--grad")

    assert code == 0
    assert report["settings"]["grad"] is True


def test_example_target(tmp_path: Path) -> None:
    """examples/doctor_target.py works with the doctor."""
    code, report = run(tmp_path, f"{EXAMPLE}:doctor_target", "--backend", "aot_eager", "--quick")

    assert code == 0, checks(report)
    assert report["kind"] == "module"
    assert len(report["examples"]) == 2


# ---------------------------------------------------------------------------- usage errors


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["no_colon_here"], "expected MODULE:FACTORY"),
        (["no_such_module_xyz:factory"], "cannot import 'no_such_module_xyz'"),
        ([f"{ROOT / 'missing.py'}:factory"], "no such file"),
        ([spec("no_such_factory")], "has no attribute 'no_such_factory'"),
        ([spec("NOT_CALLABLE")], "not a callable factory"),
        ([spec("raises")], "raises() raised ValueError: no model here"),
        ([spec("not_a_target")], "not_a_target() returned an int"),
        ([spec("eager_error"), "--backend", "eager"], "raises in eager too"),
        ([spec("clean"), "--backend", "no_such_backend"], "is not a known backend"),
        ([spec("clean"), "--backend", "eager", "--mode", "max-autotune"], "only applies to"),
        ([spec("clean"), "--json", "/no/such/dir/report.json"], "no such directory"),
    ],
)
def test_usage_errors_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """What cannot be run is a usage error: exit 2 and a message on stderr, no report."""
    code = main(["doctor", *argv])
    captured = capsys.readouterr()

    assert code == 2
    assert message in captured.err
    assert "safecompile doctor: error:" in captured.err
    assert captured.out == ""


def test_factory_error_names_the_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A factory that raises: one line naming the user's line; --traceback adds the
    traceback, down to that line."""
    line = marked_line("factory-raises")

    main(["doctor", spec("raises")])
    brief = capsys.readouterr().err
    main(["doctor", spec("raises"), "--traceback"])
    full = capsys.readouterr().err

    assert brief.count("\n") == 1
    assert f"doctor_targets.py:{line} in raises)" in brief
    assert f'doctor_targets.py", line {line}, in raises' in full
    assert full.endswith(brief)


def test_a_factory_that_raises_inside_torch_names_its_own_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The error is located at the factory's call (``factory.py:3``), not in torch's
    ``serialization.py`` where it was raised; --traceback starts at the user's frame."""
    factory = tmp_path / "factory.py"
    factory.write_text(
        "import torch\ndef factory():\n    return torch.load('/no/such/model.pt')\n",
        encoding="utf-8",
    )

    code = main(["doctor", f"{factory}:factory"])
    brief = capsys.readouterr().err
    main(["doctor", f"{factory}:factory", "--traceback"])
    full = capsys.readouterr().err

    assert code == 2
    assert "factory() raised FileNotFoundError" in brief
    assert "factory.py:3 in factory)" in brief
    assert "serialization.py" not in brief
    assert 'factory.py", line 3, in factory' in full
    assert "safecompile" + os.sep + "doctor" not in full


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["doctor"],
        ["doctor", "x:y", "--dynamic", "maybe"],
        ["doctor", "x:y", "--repeat", "0"],
        ["doctor", "x:y", "--slower-ratio", "-1"],
        ["frobnicate"],
    ],
)
def test_bad_flags_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """argparse's refusals come back as exit code 2 from main()."""
    assert main(argv) == 2
    assert capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--repeat", "0", "expected an integer >= 1, got '0'"),
        ("--repeat", "x", "expected an integer >= 1, got 'x'"),
        ("--max-graph-breaks", "-1", "expected an integer >= 0, got '-1'"),
        ("--slower-ratio", "nan", "expected a number > 0 (inf: never), got 'nan'"),
    ],
)
def test_a_bad_number_flag_says_what_it_expects(
    flag: str, value: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A number flag out of range or not a number names the flag and what it takes."""
    assert main(["doctor", "x:y", flag, value]) == 2
    assert f"argument {flag}: {expected}" in capsys.readouterr().err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    """``doctor --help`` documents FACTORY's contract."""
    assert main(["doctor", "--help"]) == 0
    assert "DoctorTarget" in capsys.readouterr().out


def test_kill_switch_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With SAFECOMPILE_DISABLE covering the target, the doctor refuses to pretend."""
    monkeypatch.setenv("SAFECOMPILE_DISABLE", "doctor_targets.*")

    assert main(["doctor", spec("one_call"), "--backend", "eager", "--quick"]) == 2
    assert "SAFECOMPILE_DISABLE" in capsys.readouterr().err


# ---------------------------------------------------------------------------- the entry point


def test_python_dash_m_entry_point() -> None:
    """``python -m safecompile doctor tests.doctor_targets:clean`` from the project root."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SAFECOMPILE_DISABLE", None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "safecompile",
            "doctor",
            "tests.doctor_targets:one_call",
            "--backend",
            "eager",
            "--quick",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )

    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("safecompile doctor: READY")
    assert "doctor: compiling example 1/1" in done.stderr


@pytest.mark.inductor
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit, inside inductor
def test_default_backend_is_inductor(tmp_path: Path) -> None:
    """Without --backend, the doctor compiles with inductor."""
    code, report = run(tmp_path, spec("one_call"), "--quick")

    assert code == 0, checks(report)
    assert report["settings"]["backend"] == "inductor"
    assert report["examples"][0]["graphs"] == 1


# ---------------------------------------------------------------------------- the contract


def test_inputs_forms() -> None:
    """A list holds several calls; a tuple, a dict or a tensor is one call."""
    x, y = torch.randn(2), torch.randn(3)

    assert parse_inputs([(x,), (x, y)]) == (Example((x,)), Example((x, y)))
    assert parse_inputs((x, y)) == (Example((x, y)),)
    assert parse_inputs(x) == (Example((x,)),)
    assert parse_inputs([x, y]) == (Example((x,)), Example((y,)))
    assert parse_inputs({"x": x}) == (Example((), {"x": x}),)
    assert parse_inputs([{"x": x}, (y,)]) == (Example((), {"x": x}), Example((y,)))


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ([], "empty"),
        (None, "got None"),
        ("x", "must be a list of calls"),
        ([3], r"inputs\[0\] must be a tuple"),
        ({1: torch.randn(2)}, "names must be identifiers"),
    ],
)
def test_bad_inputs_are_refused(inputs: object, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parse_inputs(inputs)


def test_factory_return_forms() -> None:
    """A DoctorTarget or a pair (fn, inputs); anything else is refused."""
    x = torch.randn(2)
    target = DoctorTarget(fn=torch.sin, inputs=[(x,)])

    assert to_target(target) is target
    assert to_target((torch.sin, (x,))) == DoctorTarget(fn=torch.sin, inputs=(x,))
    with pytest.raises(UsageError, match="a callable without inputs"):
        to_target(torch.sin)
    with pytest.raises(UsageError, match="expected DoctorTarget"):
        to_target((torch.sin, (x,), {}))
    with pytest.raises(UsageError, match="fn must be a function"):
        to_target(DoctorTarget(fn=3, inputs=[(x,)]))  # type: ignore[arg-type]


def _report(**changes: Any) -> Report:
    """A measured report, to judge and render without running anything."""
    base = Report(
        target="t:f",
        name="m.f",
        kind="function",
        settings={"backend": "inductor", "dynamic": "auto"},
        thresholds=Thresholds(),
        versions={"torch": "2.13", "python": "3.11", "safecompile": "0", "device": "cpu"},
        quick=False,
        examples=(
            Call(label="float32[4]", role="example", path="compiled", seconds=1.0, graphs=1),
        ),
        sweep=(Call(label="float32[5]", role="sweep", path="compiled", graphs=0),),
        sweep_plan="leading (batch) dim 4 -> 5",
        compiles=1,
        graphs=1,
    )
    return dataclasses.replace(base, **changes)


def _timing(ratio: float, spread: float = 0.05) -> Timing:
    return Timing(
        label="float32[4]",
        eager_s=1e-3,
        compiled_s=ratio * 1e-3,
        ratio=ratio,
        samples=20,
        calls_per_sample=1,
        spread=spread,
    )


@pytest.mark.parametrize(
    ("ratio", "backend", "status"),
    [
        (0.8, "inductor", "pass"),
        (1.05, "inductor", "warn"),
        (1.5, "inductor", "fail"),
        (1.5, "aot_eager", "warn"),
    ],
)
def test_speed_thresholds(ratio: float, backend: str, status: str) -> None:
    """Faster passes, up to --slower-ratio warns, beyond fails; debug backends only warn."""
    report = _report(timing=(_timing(ratio),), settings={"backend": backend})

    speed = {c.name: c for c in judge(report)}["speed"]
    assert speed.status == status


def test_noisy_timings_do_not_fail() -> None:
    """A slowdown measured on a busy machine (pairs' ratios spread wide) only warns."""
    report = _report(timing=(_timing(1.5, spread=0.6),))

    speed = {c.name: c for c in judge(report)}["speed"]
    assert speed.status == "warn"
    assert "noisy" in speed.summary


def test_recompile_thresholds() -> None:
    """Over half the limit warns; hitting it fails."""
    limit = Thresholds().max_recompiles
    eager = Call(label="float32[9]", role="sweep", path="eager", note="past the recompile limit")

    assert {c.name: c.status for c in judge(_report(compiles=2))}["recompiles"] == "pass"
    assert {c.name: c.status for c in judge(_report(compiles=limit))}["recompiles"] == "warn"
    hit = _report(compiles=limit, sweep=(eager,))
    assert {c.name: c.status for c in judge(hit)}["recompiles"] == "fail"


def test_render_text_reads_verdict_first() -> None:
    """The text report: the verdict line, then each check with its tag and what to do."""
    report = _report(timing=(_timing(0.5),))
    text = render_text(dataclasses.replace(report, checks=judge(report)))
    lines = text.splitlines()

    assert lines[0] == "safecompile doctor: READY - 5 passed"
    assert any(line.startswith("[PASS] speed") and "0.50x eager's time" in line for line in lines)
    assert text.count("what to do:") == 5
    assert lines[-1].startswith("versions: safecompile 0, torch 2.13, python 3.11; device cpu")


def test_debug_backends() -> None:
    assert is_debug_backend("eager")
    assert is_debug_backend("aot_eager_decomp_partition")
    assert not is_debug_backend("inductor")


@pytest.mark.parametrize(
    ("ratio", "spread"),
    [(0.83, 2.12), (0.89, 18.15), (1.05, 0.6), (1.5, 0.6)],
)
def test_speed_is_inconclusive_when_the_spread_is_too_wide(ratio: float, spread: float) -> None:
    """Timings whose middle half reaches both sides of 1.0 (or of the limit) neither pass
    nor fail: WARN "inconclusive", with the spread and the remedy (the 0.83x and 0.89x
    passes seen on a busy machine)."""
    speed = {c.name: c for c in judge(_report(timing=(_timing(ratio, spread=spread),)))}["speed"]
    assert speed.status == "warn"
    assert speed.summary.startswith("inconclusive: ")
    assert f"spread {spread:.0%}" in speed.summary
    assert "--repeat" in speed.advice
    assert "idle machine" in speed.advice


@pytest.mark.parametrize(
    ("ratio", "spread", "status"),
    [(0.5, 0.3, "pass"), (3.0, 0.3, "fail"), (0.83, 0.2, "pass")],
)
def test_a_noisy_timing_that_still_decides_is_judged(
    ratio: float, spread: float, status: str
) -> None:
    """Noise that cannot change the answer (0.5x with its middle half all below 1.0, 3x
    all above the limit) does not make the check inconclusive."""
    speed = {c.name: c for c in judge(_report(timing=(_timing(ratio, spread=spread),)))}["speed"]
    assert speed.status == status
    assert not speed.summary.startswith("inconclusive")


def test_measured_timings_record_the_middle_half() -> None:
    """The doctor keeps the pairs' first and third quartiles, and the judge reads them."""
    timing = dataclasses.replace(_timing(0.9, spread=0.5), ratio_low=0.7, ratio_high=1.2)
    assert timing.middle_half() == (0.7, 1.2)
    speed = {c.name: c for c in judge(_report(timing=(timing,)))}["speed"]
    assert "spans 0.70x to 1.20x" in speed.summary
    assert "(noisy: spread 50%, pairs 0.70x to 1.20x)" in speed.lines[0]


def test_timing_says_how_far_it_got_every_few_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Timing a slow call is not silent: a progress line at least every PROGRESS_EVERY_S
    seconds (made 0 here, so every sample after the first says so)."""
    from safecompile.doctor import _measure as measure
    from safecompile.doctor import diagnose
    from safecompile.doctor.report import Settings

    assert measure.PROGRESS_EVERY_S <= 5.0
    monkeypatch.setattr(measure, "PROGRESS_EVERY_S", 0.0)
    said: list[str] = []
    target = to_target((lambda x: x * 2 + 1, (torch.randn(4, 8),)))
    diagnose(target, Settings(backend="eager", repeat=4), progress=said.append)
    timing = [line for line in said if line.startswith("timing float32[4, 8]: ")]
    assert timing == [f"timing float32[4, 8]: {i} of 4 samples" for i in range(4)]


def test_text_report_lines_are_at_most_200_characters() -> None:
    """Long labels, summaries and messages wrap under their line instead of running on;
    nothing is lost."""
    label = "float32[" + ", ".join(["1024"] * 24) + "]"
    failure = Failure(
        reason="compile_error",
        label=label,
        error_type="torch._dynamo.exc.Unsupported",
        message="word " * 120 + "\nsecond line " + "x" * 260,
        file="/srv/app/model.py",
        line=42,
        function="forward",
        source="y = " + "x + " * 80 + "1",
        at_definition=False,
    )
    report = _report(failure=failure, timing=(dataclasses.replace(_timing(1.5), label=label),))
    text = render_text(dataclasses.replace(report, checks=judge(report)))
    assert all(len(line) <= 200 for line in text.splitlines()), max(text.splitlines(), key=len)
    flat = " ".join(text.split())
    assert "x" * 200 in text.replace("\n", "").replace(" ", "")
    assert "model.py:42 in forward" in flat


def test_a_long_usage_error_is_one_line_of_at_most_200_characters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A factory raising with a 2,000-character message: still one line, at most 200
    characters, naming the error type and the user's line."""
    factory = tmp_path / "long_factory.py"
    factory.write_text(
        "def factory():\n    raise ValueError('the registry said: ' + 'no ' * 700)\n",
        encoding="utf-8",
    )
    code = main(["doctor", f"{factory}:factory"])
    err = capsys.readouterr().err
    lines = err.splitlines()

    assert code == 2
    assert len(lines) == 1
    assert len(lines[0]) <= 200, len(lines[0])
    assert "factory() raised ValueError: the registry said: no no" in lines[0]
    assert "long_factory.py:2 in factory)" in lines[0]
