"""The doctor's HTML report (``--html PATH``) and its one-line usage errors.

Reports are made with the cheap ``eager`` backend on ``tests/doctor_targets.py``. The
command-line cases that must hold for a real process (one line on stderr, no traceback,
matplotlib missing) run ``python -m safecompile`` in a subprocess; the others in-process.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from safecompile.__main__ import main
from safecompile.doctor import (
    Call,
    Failure,
    Report,
    Thresholds,
    Timing,
    judge,
    render_html,
    render_text,
)

HERE = Path(__file__).parent
ROOT = HERE.parent
TARGETS = HERE / "doctor_targets.py"
SECTIONS = [
    "verdict",
    "checklist",
    "latency",
    "compile-time",
    "recompiles",
    "graph-breaks",
    "versions",
]
PNG = b"\x89PNG\r\n\x1a\n"
VOID = {"meta", "img", "br", "hr", "link", "input"}
HINT = "pip install 'safecompile[html]'"


def spec(factory: str) -> str:
    return f"{TARGETS}:{factory}"


def marked_line(marker: str) -> int:
    lines = TARGETS.read_text().splitlines()
    found = [i + 1 for i, text in enumerate(lines) if text.endswith(f"# doctor-test: {marker}")]
    assert len(found) == 1, found
    return found[0]


class Page(HTMLParser):
    """What a browser would see: sections in order, images, tags opened and closed."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.sections: list[str] = []
        self.images: list[str] = []
        self.tags: set[str] = set()
        self.links: list[str] = []
        self.open: list[str] = []
        self.mismatched: list[str] = []
        self.text: list[str] = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        self.tags.add(tag)
        if tag == "section":
            self.sections.append(found.get("id") or "")
        if tag == "img":
            self.images.append(found.get("src") or "")
        self.links += [v for k, v in attrs if k in ("href", "src") and v is not None]
        if tag not in VOID:
            self.open.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if not self.open or self.open[-1] != tag:
            self.mismatched.append(tag)
        else:
            self.open.pop()

    def handle_data(self, data: str) -> None:
        self.text.append(data)

    def section_text(self) -> str:
        return "".join(self.text)


def html_report(tmp_path: Path, *argv: str) -> tuple[int, str, Page]:
    """Run the doctor in-process with ``--html``; the exit code, the page and its parse."""
    out = tmp_path / "report.html"
    code = main(["doctor", *argv, "--html", str(out)])
    text = out.read_text(encoding="utf-8")
    return code, text, Page(text)


def decoded_png(src: str) -> bytes:
    prefix = "data:image/png;base64,"
    assert src.startswith(prefix), src[:40]
    return base64.b64decode(src[len(prefix) :], validate=True)


# ---------------------------------------------------------------------------- the page


def test_full_report_has_sections_in_order_and_a_plot_each(tmp_path: Path) -> None:
    """Verdict first, then the checklist, latency, compile time, recompiles, graph breaks;
    three plots (latency, compile time, recompiles), each an embedded PNG; the JSON written
    next to it carries what the plots draw."""
    data = tmp_path / "report.json"
    code, text, page = html_report(
        tmp_path, spec("clean"), "--backend", "eager", "--repeat", "3", "--json", str(data)
    )
    report = json.loads(data.read_text())

    assert code == 0
    assert page.sections == SECTIONS
    assert len(page.images) == 3
    for src in page.images:
        assert decoded_png(src).startswith(PNG)
    assert text.index(">READY</h1>") < text.index('id="checklist"')
    assert page.open == [], "every element is closed"
    assert page.mismatched == []
    assert all(link.startswith("data:") for link in page.links), "no external asset"
    for t in report["timing"]:
        assert t["eager_p99_s"] >= t["eager_s"] > 0
        assert t["compiled_p99_s"] >= t["compiled_s"] > 0
        assert f"<code>{t['label']}</code>" in text[text.index('id="latency"') :]
    for call in report["examples"]:
        assert len(call["graph_s"]) == call["graphs"]
        assert sum(call["graph_s"]) == pytest.approx(call["backend_s"])


def test_quick_report_says_what_was_skipped(tmp_path: Path) -> None:
    """--quick: no timing and no sweep, so one plot (compile time) and two 'skipped' notes."""
    code, _, page = html_report(tmp_path, spec("one_call"), "--backend", "eager", "--quick")
    words = page.section_text()

    assert code == 0
    assert page.sections == SECTIONS
    assert len(page.images) == 1
    assert "skipped (--quick)" in words


def test_graph_breaks_name_the_line(tmp_path: Path) -> None:
    """A graph break is listed with file:line and its source line; the verdict reads first."""
    code, text, page = html_report(tmp_path, spec("breaking"), "--backend", "eager", "--quick")
    line = marked_line("graph-break")
    breaks = text[text.index('id="graph-breaks"') : text.index('id="versions"')]

    assert code == 1
    assert f"doctor_targets.py:{line} in breaking_fn" in breaks
    assert "torch._dynamo.graph_break()" in breaks
    assert text.index(">NOT READY</h1>") < text.index('id="checklist"')
    assert page.sections == SECTIONS


def _hostile_report() -> Report:
    """A report whose every user-controlled string carries markup."""
    evil = "<script>alert('x')</script>"
    report = Report(
        target=f"models.py:{evil}",
        name="m.<b>f</b>&co",
        kind="function",
        settings={"backend": f"be{evil}", "dynamic": "auto"},
        thresholds=Thresholds(),
        versions={"torch": "2.13", "python": "3.11", "safecompile": "0", "device": evil},
        quick=False,
        examples=(
            Call(
                label=f"float32[4] {evil}",
                role="example",
                path="compiled",
                seconds=1.0,
                graphs=1,
                backend_s=0.5,
                graph_s=(0.5,),
                note=evil,
            ),
        ),
        sweep=(
            Call(
                label=f"float32[5]{evil}", role="sweep", path="compiled", graphs=1, graph_s=(0.2,)
            ),
        ),
        sweep_plan=f"leading dim {evil}",
        compiles=2,
        graphs=2,
        graph_breaks=(
            {
                "file": f"/src/{evil}.py",
                "line": 3,
                "function": evil,
                "reason": f"Unsupported: {evil}",
                "source": "if x < y and y > 0: print(x)",
            },
        ),
        timing=(
            Timing(
                label=evil,
                eager_s=1e-3,
                compiled_s=2e-3,
                ratio=2.0,
                samples=5,
                calls_per_sample=1,
                eager_p99_s=2e-3,
                compiled_p99_s=3e-3,
            ),
        ),
        failure=Failure(
            reason="compile_error",
            label=evil,
            error_type=evil,
            message=evil,
            file=evil,
            line=1,
            function=evil,
            source=evil,
            at_definition=False,
        ),
    )
    return dataclasses.replace(report, checks=judge(report))


def test_verdict_counts_read_as_the_text_report_does() -> None:
    """The page's counts are the text report's words: failed and warned checks by name."""
    report = _hostile_report()
    counts = render_text(report).splitlines()[0].split(" - ", 1)[1]

    assert counts.startswith("2 failed (compile, graph breaks)")
    assert counts in Page(render_html(report)).section_text()


def test_user_strings_are_escaped() -> None:
    """Labels, names, messages, paths and source lines cannot inject markup."""
    text = render_html(_hostile_report())
    page = Page(text)

    assert "<script>" not in text
    assert "<b>f</b>" not in text
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in text
    assert "if x &lt; y and y &gt; 0: print(x)" in text
    assert "script" not in page.tags
    assert "b" not in page.tags
    assert page.mismatched == []
    assert page.open == []
    assert page.sections == SECTIONS
    assert "<script>alert('x')</script>" in page.section_text(), "shown to the reader as text"


# ---------------------------------------------------------------------------- usage errors


def _run(*argv: str, cwd: Path = ROOT, code: str | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m safecompile ARGV`` (or ``python -c CODE ARGV``) in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SAFECOMPILE_DISABLE", None)
    command = [sys.executable, "-c", code, *argv] if code else [sys.executable, "-m", *argv]
    return subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )


def _one_line(code: int, out: str, err: str) -> str:
    """The only line on stderr (asserted so), with exit code 2 and nothing on stdout."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert out == ""
    assert len(lines) == 1, err
    assert lines[0].startswith("safecompile doctor: error: ")
    assert "Traceback" not in err
    return lines[0]


def _bad_modules(folder: Path) -> None:
    (folder / "needs_dep.py").write_text(
        "import os\n\nimport no_such_dependency_xyz  # line 3\n\ndef target():\n    pass\n"
    )
    (folder / "broken_syntax.py").write_text("def target(:\n    pass\n")
    (folder / "raises_at_import.py").write_text(
        "def helper():\n    raise RuntimeError('model registry\\nunreachable')\n\nhelper()\n"
    )
    (folder / "exits_at_import.py").write_text("import sys\n\nsys.exit(3)\n")


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("nosuch:thing", "cannot import 'nosuch': no module named 'nosuch' here"),
        ("needs_dep:target", "No module named 'no_such_dependency_xyz' (at needs_dep.py:3 in"),
    ],
)
def test_bad_target_in_a_process_is_one_line(tmp_path: Path, target: str, expected: str) -> None:
    """``python -m safecompile doctor BAD``: exit 2, one line naming the problem, no traceback."""
    _bad_modules(tmp_path)

    done = _run("safecompile", "doctor", target, "--backend", "eager", cwd=tmp_path)

    assert expected in _one_line(done.returncode, done.stdout, done.stderr)


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("broken_syntax.py:target", "SyntaxError: "),
        ("broken_syntax.py:target", "(at broken_syntax.py:1)"),
        ("raises_at_import.py:target", "RuntimeError: model registry unreachable"),
        ("raises_at_import.py:target", "(at raises_at_import.py:2 in helper)"),
        ("exits_at_import.py:target", "SystemExit(3)"),
        ("tests.doctor_targets:NOT_CALLABLE", "is an int, not a callable factory"),
        ("tests.doctor_targets:nope", "has no attribute 'nope'"),
        ("tests.doctor_targets:raises", "raises() raised ValueError: no model here (at "),
        ("model_without_colon", "expected MODULE:FACTORY"),
        ("/no/such/dir/model.py:target", "no such file: /no/such/dir/model.py"),
    ],
)
def test_bad_target_is_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    target: str,
    expected: str,
) -> None:
    """Every way a target fails to load is one line on stderr, naming the user's line."""
    _bad_modules(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))

    code = main(["doctor", target, "--backend", "eager"])
    captured = capsys.readouterr()

    assert expected in _one_line(code, captured.out, captured.err)


def test_traceback_flag_shows_the_users_frames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--traceback adds the user's own traceback, without safecompile's frames."""
    _bad_modules(tmp_path)
    monkeypatch.chdir(tmp_path)

    code = main(["doctor", "raises_at_import.py:target", "--traceback"])
    err = capsys.readouterr().err

    assert code == 2
    assert 'raises_at_import.py", line 2, in helper' in err
    assert "safecompile" + os.sep + "doctor.py" not in err
    assert err.rstrip().splitlines()[-1].startswith("safecompile doctor: error: ")


def test_html_output_paths_are_checked_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory or a missing folder for --html fails before the target is loaded."""
    missing = tmp_path / "nowhere" / "r.html"

    for path, expected in ((tmp_path, "is a directory"), (missing, "no such directory")):
        code = main(["doctor", "nosuch:thing", "--html", str(path)])
        captured = capsys.readouterr()
        assert expected in _one_line(code, captured.out, captured.err)


# ---------------------------------------------------------------------------- no matplotlib

_WITHOUT_MATPLOTLIB = """\
import sys

sys.modules["matplotlib"] = None  # as if not installed: importing it raises ImportError
from safecompile.__main__ import main

target, html = sys.argv[1:]
with_html = main(["doctor", target, "--html", html])
print(f"--html: exit {with_html}", file=sys.stderr)
text = main(["doctor", target, "--backend", "eager", "--quick"])
print(f"text: exit {text}", file=sys.stderr)
print(f"matplotlib imported: {sys.modules.get('matplotlib') is not None}", file=sys.stderr)
"""


def test_without_matplotlib(tmp_path: Path) -> None:
    """--html without matplotlib fails at once (before loading the target) in one line
    naming the extra; the terminal report needs no plotting library."""
    out = tmp_path / "r.html"

    done = _run(spec("one_call"), str(out), code=_WITHOUT_MATPLOTLIB)
    err = done.stderr.splitlines()

    assert done.returncode == 0, done.stderr
    assert err[0] == (
        "safecompile doctor: error: --html needs matplotlib, which is not installed: " + HINT
    )
    assert err[1] == "--html: exit 2"
    assert not out.exists()
    assert "text: exit 0" in err
    assert "matplotlib imported: False" in err
    assert done.stdout.startswith("safecompile doctor: READY")


# ---------------------------------------------------------------------------- the plots


def _mixed_latency_report() -> Report:
    """Two shapes whose latencies differ by ~65x, plus compiles and a sweep."""
    calls = tuple(
        Call(
            label=f"float32[{n}, 64]",
            role="example" if n < 64 else "sweep",
            path="compiled",
            seconds=1.0 + n / 100,
            graphs=1,
            backend_s=0.8,
            graph_s=(0.8,),
        )
        for n in (1, 8, 64, 512)
    )
    timing = tuple(
        Timing(
            label=label,
            eager_s=eager,
            compiled_s=eager * 0.9,
            ratio=0.9,
            samples=20,
            calls_per_sample=5,
            spread=0.05,
            eager_p99_s=eager * 1.2,
            compiled_p99_s=eager * 1.1,
        )
        for label, eager in (("float32[1, 64]", 1.5e-3), ("float32[512, 64]", 99e-3))
    )
    report = Report(
        target="t:f",
        name="m.f",
        kind="function",
        settings={"backend": "inductor", "dynamic": "auto"},
        thresholds=Thresholds(),
        versions={"torch": "2.13", "python": "3.11", "safecompile": "0", "device": "cpu"},
        quick=False,
        examples=calls[:2],
        sweep=calls[2:],
        sweep_plan="leading (batch) dim 8 -> 64, 512",
        compiles=4,
        graphs=4,
        timing=timing,
    )
    return dataclasses.replace(report, checks=judge(report))


def test_plots_show_small_and_large_latencies_and_legends_cover_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The latency axis is logarithmic (a 1.5 ms bar stands tall beside a 99 ms one), and
    no plot's legend overlaps its axes (so it covers no bar, whisker or point)."""
    from safecompile.doctor import html as page

    figures: list[Any] = []
    real_png = page._png

    def keep(fig: Any, alt: str) -> str:
        figures.append(fig)
        return real_png(fig, alt)

    monkeypatch.setattr(page, "_png", keep)
    render_html(_mixed_latency_report())
    assert len(figures) == 3  # latency, compile time, recompiles
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    for fig in figures:
        FigureCanvasAgg(fig).draw()
        renderer = fig.canvas.get_renderer()
        (ax,) = fig.axes
        legends = fig.legends + ([ax.get_legend()] if ax.get_legend() else [])
        assert legends, "every plot has a legend"
        for legend in legends:
            assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))
    latency = figures[0].axes[0]
    assert latency.get_yscale() == "log"
    ticks = [t.get_text() for t in latency.get_yticklabels() + latency.get_yticklabels(minor=True)]
    assert any(t for t in ticks), "the time axis is labelled"
    assert not any("$" in t or "mathdefault" in t for t in ticks), ticks
    heights = sorted(
        p.get_window_extent(renderer=figures[0].canvas.get_renderer()).height
        for p in latency.patches
    )
    assert heights[0] >= 0.3 * heights[-1], heights  # linear: 1.5/99 of it, invisible
    assert latency.get_ylim()[0] <= 1.35 / 10  # ms: the shortest bar spans a decade
