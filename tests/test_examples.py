"""Every example under examples/ runs, on the cheap backend, and prints what it promises.

Each runs as a user runs it (``python examples/x.py``) in a subprocess, with
``SAFECOMPILE_EXAMPLE_BACKEND=aot_eager`` (the ``example_env`` fixture); the tests read
its output, not only its exit code. The serving example has its own file.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 120  # each takes ~5-15 s here; the bound only stops a hang


def run(env: dict[str, str], *argv: str, code: int = 0) -> subprocess.CompletedProcess[str]:
    """Run ``python *argv`` from the repository root; it must exit with ``code``."""
    done = subprocess.run(
        [sys.executable, *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == code, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def line_of(example: str, text: str) -> int:
    """The 1-based number of the one line of an example that contains ``text``."""
    lines = (EXAMPLES / example).read_text().splitlines()
    found = [n for n, line in enumerate(lines, start=1) if text in line]
    assert len(found) == 1, (text, found)
    return found[0]


def test_quickstart(example_env: dict[str, str]) -> None:
    """The demo shows each promise: canary explained and finished, a compile failure
    answered by eager with the user's line, drift caught, the kill switch honoured."""
    out = run(example_env, "examples/quickstart.py").stdout

    assert "backend=aot_eager" in out  # SAFECOMPILE_EXAMPLE_BACKEND picked the backend
    # 1. why "canary": one line per graph with its checks, then the canary ends.
    assert re.search(r"== demo\.ranker: state=canary calls=7 compiled=7 eager=0", out), out
    assert re.search(r"graph 1 \(8x32:float32\): 5 call\(s\), 4 checked, canary done", out), out
    left = re.search(r"graph 2 \(.*\): 2 call\(s\), 2 checked, (\d) canary check\(s\) left", out)
    assert left is not None, out
    assert f"{left[1]} more batch(es) of 16 end the canary: state=compiled" in out
    # 2. the graph break under fullgraph=True: eager answered, rollback names the user's line.
    assert "postprocess still answered (sum of probabilities = 1.000)" in out
    assert "== demo.postprocess: state=rolled_back calls=1 compiled=0 eager=1" in out
    branch = line_of("quickstart.py", "if scores.max().item() > 0")
    assert re.search(rf"- rollback \[compile_error\].* quickstart\.py:{branch}\b", out), out
    # 3. drift: caught by the canary, eager's result returned.
    assert "the drifting path was caught: the caller got eager's exact result" in out
    head = line_of("quickstart.py", "def head(")
    assert re.search(rf"- rollback \[drift\].* quickstart\.py:{head}\b", out), out
    assert "== demo.head: state=rolled_back" in out
    # 4. the kill switch, on and off without a restart.
    assert "with SAFECOMPILE_DISABLE=demo.* the ranker is disabled" in out
    assert "and after unsetting it, compiled again" in out
    # safecompile's own log events are printed too (the demo configures logging).
    assert any(line.startswith("log: ") and "rollback" in line for line in out.splitlines())
    assert max(len(line) for line in out.splitlines()) <= 200  # a line fits a terminal


def test_metrics_prometheus(
    example_env: dict[str, str], prometheus_value: Callable[..., float]
) -> None:
    """The metrics example serves, scrapes itself over HTTP and prints the safecompile_*
    samples: calls per path, compile durations, rollbacks with their reasons, checks."""
    done = run(example_env, "examples/metrics_prometheus.py", "--port", "0", "--calls", "12")

    def value(name: str, **labels: str) -> float:
        return prometheus_value(done.stdout, name, **labels)

    assert value("safecompile_calls_total", function="example.score", path="compiled") == 12
    assert value("safecompile_calls_total", function="example.score", path="eager") == 0
    assert value("safecompile_calls_total", function="example.broken", path="eager") == 12
    assert value("safecompile_calls_total", function="example.drifting", path="eager") == 12
    assert value("safecompile_rollbacks_total", function="example.broken", reason="compile_error")
    assert value("safecompile_rollbacks_total", function="example.drifting", reason="drift") == 1
    assert value("safecompile_shadow_checks_total", function="example.score", result="pass") == 8
    assert value("safecompile_compile_duration_seconds_count", function="example.score") == 1
    assert value("safecompile_compile_duration_seconds_sum", function="example.score") > 0
    assert not any("_bucket{" in line for line in done.stdout.splitlines())  # not asked for
    assert "# serving http://127.0.0.1:" in done.stderr
    assert "example.score: state=compiled calls=12 compiled=12 eager=0" in done.stderr
    assert "example.drifting: state=rolled_back" in done.stderr


def _console_spans(stderr: str) -> list[dict[str, Any]]:
    """The spans the console exporter printed: JSON objects one after the other."""
    decoder = json.JSONDecoder()
    text = "\n".join(line for line in stderr.splitlines() if not line.startswith("#"))
    spans, at = [], 0
    while (start := text.find("{", at)) != -1:
        span, at = decoder.raw_decode(text, start)
        spans.append(span)
    return spans


def test_tracing(example_env: dict[str, str]) -> None:
    """The tracing example's spans carry the promised names, parents and source lines, and
    its JSON log lines carry the trace ids of those spans."""
    done = run(example_env, "examples/tracing.py", "--requests", "4")
    spans = _console_spans(done.stderr)
    by_name: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        by_name.setdefault(span["name"], []).append(span)

    requests = {s["context"]["span_id"] for s in by_name["example.request"]}
    assert len(requests) == 4
    compiles = by_name["safecompile.compile"]
    assert {s["parent_id"] for s in compiles} <= requests  # children of the app's spans
    # featurize: one graph_break event naming the line of torch._dynamo.graph_break().
    breaks = [e for s in compiles for e in s["events"] if e["name"] == "safecompile.graph_break"]
    assert [e["attributes"]["code.line.number"] for e in breaks] == [
        line_of("tracing.py", "torch._dynamo.graph_break()")
    ]
    assert by_name["safecompile.shadow_check"]
    assert {s["attributes"]["safecompile.result"] for s in by_name["safecompile.shadow_check"]} == {
        "pass"
    }
    # ranker: fullgraph=True refuses the data-dependent branch; the rollback names its line.
    [rollback] = by_name["safecompile.rollback"]
    attrs = rollback["attributes"]
    assert attrs["safecompile.function"] == "example.ranker"
    assert attrs["safecompile.reason"] == "compile_error"
    assert attrs["error.type"]
    assert attrs["code.file.path"].endswith("examples/tracing.py")
    assert attrs["code.line.number"] == line_of("tracing.py", "if h.mean() > 0.5")

    logs = _console_spans(done.stdout)  # the log events: JSON objects one after the other
    lines = (done.stdout + done.stderr).splitlines()
    assert max(len(line) for line in lines) <= 200, max(lines, key=len)
    traces = {s["context"]["trace_id"].removeprefix("0x") for s in spans}
    assert {"safecompile.compiled", "safecompile.rollback"} <= {log["event"] for log in logs}
    assert all(log["trace_id"] in traces for log in logs if "trace_id" in log)
    assert "example.ranker: state=rolled_back calls=4 compiled=0 eager=4" in done.stderr


def test_doctor_target(example_env: dict[str, str], tmp_path: Path) -> None:
    """The doctor's example target is READY on the example backend, and runs as a script."""
    report_path = tmp_path / "report.json"
    done = run(
        example_env,
        "-m",
        "safecompile",
        "doctor",
        "examples/doctor_target.py:doctor_target",
        "--quick",
        "--json",
        str(report_path),
    )

    assert done.stdout.splitlines()[0].startswith("safecompile doctor: READY")
    assert re.search(r"^\[PASS\] graph breaks\s+no graph breaks", done.stdout, re.MULTILINE)
    report = json.loads(report_path.read_text())
    assert report["settings"]["backend"] == "aot_eager"  # from SAFECOMPILE_EXAMPLE_BACKEND
    assert report["exit_code"] == 0

    script = run(example_env, "examples/doctor_target.py")
    assert script.stdout.strip() == "torch.Size([8, 64, 1000])"


@pytest.mark.parametrize(
    ("example", "package", "extra"),
    [
        ("serving.py", "fastapi", "examples"),
        ("metrics_prometheus.py", "prometheus_client", "prometheus"),
    ],
)
def test_missing_extra_is_one_line(
    example_env: dict[str, str], tmp_path: Path, example: str, package: str, extra: str
) -> None:
    """Without its extra, an example says in one line what to install (no traceback)."""
    (tmp_path / f"{package}.py").write_text(  # shadows the installed package
        "raise ModuleNotFoundError(f'No module named {__name__!r}', name=__name__)\n"
    )
    env = {**example_env, "PYTHONPATH": str(tmp_path)}

    done = run(env, f"examples/{example}", "--help", code=1)

    assert done.stderr == f"{package} is not installed: pip install -e '.[{extra}]'\n"
    assert done.stdout == ""


PUBLIC_MODULES = {"safecompile", "safecompile.testing", "safecompile.doctor"}


def _imports(path: Path) -> set[str]:
    """The modules a file imports (``import a.b``, ``from a.b import c``)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_examples_use_the_public_api_only(example: str) -> None:
    """An example is what a user copies: it imports safecompile's public modules only."""
    ours = {m for m in _imports(EXAMPLES / example) if m.split(".")[0] == "safecompile"}
    assert ours <= PUBLIC_MODULES, ours - PUBLIC_MODULES


def test_quickstart_is_one_file_on_aot_eager(example_env: dict[str, str]) -> None:
    """README command 1 runs the quickstart as it is: one file (none of the examples'
    shared helpers), on aot_eager by default, quick."""
    assert not {
        m for m in _imports(EXAMPLES / "quickstart.py") if m.startswith("_") and m != "__future__"
    }
    env = {k: v for k, v in example_env.items() if k != "SAFECOMPILE_EXAMPLE_BACKEND"}

    out = run(env, "examples/quickstart.py").stdout

    assert out.splitlines()[0].endswith("backend=aot_eager")
    assert "and after unsetting it, compiled again" in out


def test_zero_code(example_env: dict[str, str]) -> None:
    """The same unedited program under ``safecompile run`` is guarded (the drifting
    function answered by eager and rolled back) and, alone, is torch's."""
    env = dict(example_env, PYTHONPATH=str(ROOT))
    guarded = run(env, "-m", "safecompile", "run", "--", sys.executable, "examples/zero_code.py")
    out = guarded.stdout
    assert "state_dict keys: _orig_mod.hidden.weight, _orig_mod.hidden.bias" in out
    assert "calibrate returned eager's value: True" in out
    assert "torch.compile(model): guarded as __main__.Scorer.forward: state=canary" in out
    assert "model.compile(): guarded as __main__.Scorer.forward: state=canary compiled=3" in out
    assert "torch.compile(calibrate): guarded as __main__.calibrate: state=rolled_back" in out
    alone = run(env, "examples/zero_code.py").stdout
    assert "calibrate returned eager's value: False" in alone
    assert "torch.compile(model): torch.compile's own (not under safecompile run)" in alone
