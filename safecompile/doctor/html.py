"""The readiness report as one self-contained HTML page: the verdict, the checklist, then a
section (and a plot) per measure. Plots are PNGs embedded as data URIs; matplotlib (the
``html`` extra) is imported only here, when a page is rendered. Every string from the
report is escaped.
"""

from __future__ import annotations

import base64
import html
import io
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from .report import Check, Report, Timing, graphs, secs, time_unit, where
from .text import counts

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["INSTALL_HINT", "available", "render_html"]

INSTALL_HINT = "pip install 'safecompile[html]'"
"""What to run when matplotlib is missing."""

_COLORS = {"eager": "#8c8c8c", "compiled": "#1f77b4", "example": "#1f77b4", "sweep": "#ff7f0e"}
_DARKER = {"example": "#0b4f80", "sweep": "#b35600"}
_PATH_COLORS = {
    "compiled": "#2ca02c",
    "eager": "#8c8c8c",
    "failed": "#d62728",
    "skipped": "#bbbbbb",
}
_LABEL_CHARS = 48  # plot labels longer than this are cut
_MAX_GRAPHS_PLOTTED = 40


def available() -> bool:
    """Whether matplotlib can be imported (so :func:`render_html` can draw)."""
    try:
        import matplotlib.figure  # noqa: F401, PLC0415 - optional, imported on demand
    except ImportError:
        return False
    return True


def render_html(report: Report) -> str:
    """The report as one HTML page (a ``str``). Raises ``ImportError`` without matplotlib."""
    try:
        from matplotlib.figure import Figure  # noqa: PLC0415 - optional, imported on demand
    except ImportError as exc:
        raise ImportError(f"the HTML report needs matplotlib: {INSTALL_HINT}") from exc
    sections = [
        _verdict(report),
        _checklist(report.checks),
        _latency(report, Figure),
        _compile_times(report, Figure),
        _recompiles(report, Figure),
        _graph_breaks(report),
        _settings(report),
    ]
    title = f"safecompile doctor: {report.name}"
    return _PAGE.format(title=_e(title), css=_CSS, body="\n".join(sections))


def _verdict(r: Report) -> str:
    return (
        '<section id="verdict">\n'
        f'<h1 class="{"ready" if r.ready else "not-ready"}">'
        f"{'READY' if r.ready else 'NOT READY'}</h1>\n"
        f'<p class="counts">{_e(counts(r))}</p>\n'
        "<dl>"
        f"<dt>target</dt><dd><code>{_e(r.target)}</code></dd>"
        f"<dt>callable</dt><dd>{_e(r.kind)} <code>{_e(r.name)}</code></dd>"
        f"<dt>backend</dt><dd><code>{_e(r.settings.get('backend'))}</code>"
        f"{' (quick: no sweep, no timing)' if r.quick else ''}</dd>"
        f"<dt>run</dt><dd>{_e(_ran(r))}</dd>"
        "</dl>\n</section>"
    )


def _ran(r: Report) -> str:
    """When, and on what: ``2026-12-06 17:30 UTC, torch 2.13.0, safecompile 0.9.0, ...``."""
    when = r.created.replace("T", " ").replace("+00:00", " UTC") if r.created else "date unknown"
    names = {"torch": "torch", "safecompile": "safecompile", "python": "Python", "device": "on"}
    shown = [f"{label} {r.versions[k]}" for k, label in names.items() if k in r.versions]
    return ", ".join([when, *shown])


def _checklist(checks: Sequence[Check]) -> str:
    rows = []
    for c in checks:
        details = "".join(f"<li><code>{_e(line)}</code></li>" for line in c.lines)
        rows.append(
            f'<tr class="{c.status}"><td class="tag">{c.status.upper()}</td>'
            f"<th>{_e(c.title)}</th><td>{_e(c.summary)}"
            + (f"<ul>{details}</ul>" if details else "")
            + (f'<p class="advice">what to do: {_e(c.advice)}</p>' if c.status != "skip" else "")
            + "</td></tr>"
        )
    return _section("checklist", "Checklist", f'<table class="checks">{"".join(rows)}</table>')


def _latency(r: Report, figure: type[Figure]) -> str:
    intro = (
        "<p>Per-call time of each example, eager and compiled (through the guard), measured in "
        "interleaved samples; p50 is the median sample, p99 the 99th percentile (each sample "
        "averages several calls, so p99 is of those averages, not of single calls). The time "
        "axis is logarithmic, so a 1 ms shape shows beside a 100 ms one.</p>\n"
    )
    title = "Latency per example shape"
    if not r.timing:
        why = "skipped (--quick)" if r.quick else "not measured: a compile failed"
        return _section("latency", title, intro, _none(why))
    labels = [t.label for t in r.timing]
    series: dict[str, list[tuple[float | None, float | None]]] = {
        "eager": [(t.eager_s, t.eager_p99_s) for t in r.timing],
        "compiled": [(t.compiled_s, t.compiled_p99_s) for t in r.timing],
    }
    known = [x for values in series.values() for pair in values for x in pair if x is not None]
    scale, unit = time_unit(min(known, default=0.0))  # log axis: the small ones read well

    def draw(ax: Axes) -> None:
        width = 0.38
        for k, (path, values) in enumerate(series.items()):
            xs = [i + (k - 0.5) * width for i in range(len(labels))]
            p50 = [scale * v[0] if v[0] is not None else math.nan for v in values]
            p99 = [
                scale * v[1] if v[1] is not None else p for v, p in zip(values, p50, strict=True)
            ]
            ax.bar(xs, p50, width, label=f"{path} p50", color=_COLORS[path])
            ax.scatter(xs, p99, marker="_", s=300, color="black", zorder=3)
            ax.vlines(xs, p50, p99, color="black", linewidth=1)
        ax.scatter([], [], marker="_", color="black", label="p99")
        ax.set_xticks(range(len(labels)), [_cut(x) for x in labels], rotation=15, ha="right")
        ax.set_yscale("log")  # 1.5 ms and 99 ms bars both show
        lowest = min((x * scale for x in known if x > 0), default=1.0)
        ax.set_ylim(bottom=lowest / 10)  # the shortest bar spans a decade at least
        from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: PLC0415

        # plain numbers (1, 10, 100), not mathtext, which this page's plots do not parse
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel(f"{unit} per call (log scale)")
        _legend_below(ax)

    image = _plot(figure, draw, (7.0, 3.4), "Latency per example: eager and compiled, p50 and p99")
    head = ["example", "eager p50", "eager p99", "compiled p50", "compiled p99"]
    rows = (
        f"<tr><td><code>{_e(t.label)}</code></td><td>{secs(t.eager_s)}</td>"
        f"<td>{secs(t.eager_p99_s)}</td><td>{secs(t.compiled_s)}</td>"
        f"<td>{secs(t.compiled_p99_s)}</td><td>{_ratio(t)}</td>"
        f"<td>{t.samples} x {t.calls_per_sample}</td></tr>"
        for t in r.timing
    )
    table = _table([*head, "compiled / eager", "samples x calls"], rows)
    return _section("latency", title, intro, image, table)


def _ratio(t: Timing) -> str:
    return ("-" if t.ratio is None else f"{t.ratio:.2f}x") + (" (noisy)" if t.noisy else "")


def _compile_times(r: Report, figure: type[Figure]) -> str:
    intro = (
        "<p>The first call of each shape: one dark segment per graph the backend compiled for "
        "it (its compile time), then the rest of that first call in grey (dynamo tracing, the "
        "guard, one run). A replica pays this on its first requests unless it warms up.</p>\n"
    )
    calls = list(enumerate((*r.examples, *r.sweep), start=1))
    drawn = [(i, c) for i, c in calls if c.graph_s][:_MAX_GRAPHS_PLOTTED]
    if drawn:
        scale, unit = time_unit(max(c.seconds or c.backend_s for _, c in drawn))

        def draw(ax: Axes) -> None:
            for y, (_, c) in enumerate(drawn):
                left = 0.0
                for k, seconds in enumerate(c.graph_s):
                    shade = _COLORS[c.role] if k % 2 == 0 else _DARKER[c.role]
                    ax.barh(y, seconds * scale, left=left, color=shade, edgecolor="white")
                    left += seconds * scale
                rest = max(0.0, (c.seconds or 0.0) * scale - left)
                ax.barh(y, rest, left=left, color=_COLORS["eager"], alpha=0.45)
            labels = [f"#{i} {_cut(c.label)} ({graphs(c.graphs)})" for i, c in drawn]
            ax.set_yticks(range(len(drawn)), labels, fontsize="small")
            ax.invert_yaxis()
            ax.set_xlabel(f"first call ({unit}): backend compile per graph, then the rest")
            from matplotlib.patches import Patch  # noqa: PLC0415 - optional, on demand

            handles = [
                Patch(color=_COLORS[role], label=f"{role}: a graph compiling")
                for role in ("example", "sweep")
                if any(c.role == role for _, c in drawn)
            ]
            handles.append(Patch(color=_COLORS["eager"], alpha=0.45, label="the rest"))
            _legend_below(ax, handles)

        height = 1.4 + 0.32 * len(drawn)
        image = _plot(figure, draw, (7.0, height), "Compile time of each graph, per first call")
    else:
        image = _none("no graph was compiled")
    head = ["#", "role", "shape", "served", "graphs", "first call", "backend, per graph", "note"]
    rows = (
        f"<tr><td>{i}</td><td>{_e(c.role)}</td><td><code>{_e(c.label)}</code></td>"
        f"<td>{_e(c.path)}</td><td>{c.graphs}</td><td>{secs(c.seconds)}</td>"
        f"<td>{_e(', '.join(secs(s) for s in c.graph_s))}</td><td>{_e(c.note or '')}</td></tr>"
        for i, c in calls
    )
    return _section("compile-time", "Compile time per graph", intro, image, _table(head, rows))


def _recompiles(r: Report, figure: type[Figure]) -> str:
    limit = r.thresholds.max_recompiles
    intro = (
        "<p>Graphs compiled so far, shape after shape (numbered as in the table above): the "
        f"examples first, then the sweep ({_e(r.sweep_plan or 'none')}). Past the limit "
        f"({limit}) new shapes run eager.</p>\n"
    )
    title = "Recompiles over the shape sweep"
    calls = [(i, c) for i, c in enumerate((*r.examples, *r.sweep), start=1) if c.path != "skipped"]
    if not r.sweep or not calls:
        return _section("recompiles", title, intro, _none(r.sweep_plan or "no sweep"))
    totals = list(itertools.accumulate(c.graphs for _, c in calls))

    def draw(ax: Axes) -> None:
        xs = [i for i, _ in calls]
        ax.step(xs, totals, where="post", color=_COLORS["compiled"])
        ax.scatter(xs, totals, color=[_PATH_COLORS[c.path] for _, c in calls], zorder=3)
        ax.axhline(limit, color="#d62728", linestyle="--", linewidth=1, label=f"limit {limit}")
        ax.set_xticks(xs)
        ax.set_xlabel("shape #")
        ax.set_ylabel("graphs compiled")
        ax.set_ylim(0, max(limit, *totals) + 1)
        for path, color in _PATH_COLORS.items():
            if any(c.path == path for _, c in calls):
                ax.scatter([], [], color=color, label=f"served {path}")
        _legend_below(ax)

    image = _plot(figure, draw, (7.0, 3.2), "Graphs compiled over the shape sweep")
    stopped = f"<p>{_e(r.sweep_stopped)}</p>" if r.sweep_stopped else ""
    return _section("recompiles", title, intro, image, stopped)


def _graph_breaks(r: Report) -> str:
    if not r.graph_breaks:
        return _section("graph-breaks", "Graph breaks", _none(f"none in {r.graphs} graph(s)"))
    rows = []
    for b in r.graph_breaks:
        place = f"<code>{_e(where(b.get('file'), b.get('line'), b.get('function')))}</code>"
        source = b.get("source")
        if source:
            place += f"<pre>{_e(b.get('line'))} | {_e(source)}</pre>"
        rows.append(
            f"<tr><td>{place}</td><td><pre>{_e(str(b.get('reason') or '').strip())}</pre></td></tr>"
        )
    return _section(
        "graph-breaks", "Graph breaks", _table(["where", "why (dynamo's reason)"], rows)
    )


def _settings(r: Report) -> str:
    settings = "".join(
        f"<dt>{_e(k)}</dt><dd><code>{_e(v)}</code></dd>" for k, v in r.settings.items()
    )
    versions = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in r.versions.items())
    return _section(
        "versions",
        "Settings and versions",
        f"<dl>{settings}<dt>max_recompiles</dt><dd>{r.thresholds.max_recompiles}</dd></dl>\n",
        f"<dl>{versions}</dl>",
    )


# ---------------------------------------------------------------------------- helpers


def _section(ident: str, title: str, *parts: str) -> str:
    return f'<section id="{ident}">\n<h2>{title}</h2>\n' + "".join(parts) + "\n</section>"


def _table(head: Sequence[str], rows: Iterable[str]) -> str:
    """A table: ``head``'s words, then ``rows`` (HTML: what comes from the report escaped)."""
    top = "".join(f"<th>{h}</th>" for h in head)
    return f"<table><tr>{top}</tr>{''.join(rows)}</table>"


def _plot(
    figure: type[Figure], draw: Callable[[Axes], None], size: tuple[float, float], alt: str
) -> str:
    """Draw one figure (without pyplot: no global state) as an ``<img>`` with a data URI."""
    from matplotlib import rc_context  # noqa: PLC0415 - optional, imported on demand

    with rc_context({"text.parse_math": False, "font.size": 9}):  # "$" in a label is text
        fig = figure(figsize=size, dpi=100, layout="constrained")
        draw(fig.subplots())
        return _png(fig, alt)


def _png(fig: Figure, alt: str) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img alt="{_e(alt)}" src="data:image/png;base64,{data}">\n'


def _legend_below(ax: Axes, handles: Sequence[Any] | None = None) -> None:
    """The legend under the plot, outside the axes: it covers no bar, whisker or point."""
    shown = list(handles) if handles is not None else ax.get_legend_handles_labels()[0]
    ax.figure.legend(
        handles=shown,
        loc="outside lower center",
        ncols=min(len(shown), 4) or 1,
        fontsize="small",
        frameon=False,
    )


def _e(value: object) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _none(text: str) -> str:
    return f'<p class="none">{_e(text)}</p>'


def _cut(text: str, limit: int = _LABEL_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{css}</style>
</head>
<body>
<main>
{body}
</main>
</body>
</html>
"""

_CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #222;
  margin: 0; background: #fafafa; }
main { max-width: 60rem; margin: 0 auto; padding: 1.5rem; background: #fff; }
h1 { margin: 0 0 .3rem; font-size: 2rem; }
h1.ready { color: #1a7f37; } h1.not-ready { color: #c62828; }
h2 { border-bottom: 1px solid #ddd; padding-bottom: .2rem; margin-top: 2rem; }
table { border-collapse: collapse; width: 100%; margin: .6rem 0; font-size: .9rem; }
td, th { border: 1px solid #e3e3e3; padding: .3rem .5rem; text-align: left;
  vertical-align: top; }
table.checks th { white-space: nowrap; }
td.tag { font-weight: 700; font-family: ui-monospace, monospace; }
tr.pass td.tag { color: #1a7f37; } tr.warn td.tag { color: #9a6700; }
tr.fail td.tag { color: #c62828; } tr.skip td.tag { color: #777; }
ul { margin: .3rem 0; padding-left: 1.2rem; }
pre { margin: .2rem 0; white-space: pre-wrap; font-size: .85rem; }
.advice { margin: .3rem 0 0; color: #555; }
.none { color: #777; font-style: italic; }
dl { display: grid; grid-template-columns: max-content auto; gap: .1rem 1rem; }
dt { font-weight: 600; } dd { margin: 0; }
img { max-width: 100%; height: auto; display: block; margin: .5rem 0; }
"""
