"""torch's compile failures in plain words that name the user's line.

torch words its failures for its own developers ("Could not guard on data-dependent
expression zuf0 > 0.0"); a person wants to know which line of theirs did what, and what
to do. :func:`explain` recognises, from the exception's type, ``gb_type`` and message
(torch 2.13), a branch on a tensor's value, a custom op without a fake implementation, a
graph break under ``fullgraph=True``, an op the backend cannot compile and the recompile
limit; anything else keeps its own first line. The raw text stays beside it
(``Event.details["error_message"]``).
"""

from __future__ import annotations

import linecache
import os
import re
from dataclasses import dataclass

from .source import SourceLocation, exception_chain, safe_message, truncate

__all__ = ["Explanation", "explain", "source_line"]

#: Longest plain-words sentence; the raw text is kept elsewhere.
TEXT_LIMIT = 200
_SUMMARY_LIMIT = 100
_CODE_LIMIT = 40

_DATA_DEPENDENT = re.compile(
    r"Data-dependent branching|Could not guard on data-dependent expression"
    r"|data-dependent expression .* could not be evaluated"
)
_NO_FAKE = re.compile(
    r"no fake impl registered for <CustomOpDef\((?P<op>[^)]+)\)>"
    r"|(?P<op2>[\w.:]+) has no (?:fake|meta) (?:impl|kernel)",
    re.IGNORECASE,
)
_BUILTIN = re.compile(r"builtin operator `(?P<name>[^`]+)`")


@dataclass(frozen=True, slots=True)
class Explanation:
    """A failure in plain words.

    ``kind`` names the failure kind (``data_dependent_branch``, ``custom_op``,
    ``graph_break``, ``backend_error``, ``recompile_limit``, ``error``); ``summary`` is a
    few words for a back-reference ("a branch on a tensor's value"); ``text`` is the
    sentence a person reads, naming the user's line where one is known.
    """

    kind: str
    summary: str
    text: str


def source_line(location: SourceLocation | None) -> str | None:
    """The stripped text of the user's line (bounded, without an inline comment), or
    ``None`` when unknown."""
    if location is None or location.line is None:
        return None
    text = linecache.getline(location.file, location.line).strip()
    text = text.split("  #", 1)[0].rstrip()  # an inline comment is not the code
    return truncate(text, _CODE_LIMIT) if text else None


def _where(location: SourceLocation | None) -> str:
    """``at model.py:42 (`if x.sum() > 0:`)``, or ``""`` when nothing is known."""
    if location is None:
        return ""
    place = os.path.basename(location.file)
    if location.line is not None:
        place = f"{place}:{location.line}"
    code = source_line(location)
    return f" at {place} (`{code}`)" if code else f" at {place}"


def _headline(error: BaseException) -> str:
    """The error's own first line: the inner error of a backend failure, ``gb_type`` of a
    graph break, else the first non-empty line of its message."""
    inner = getattr(error, "inner_exception", None)
    if isinstance(inner, BaseException):
        error = inner
    gb_type = getattr(error, "gb_type", None)
    if isinstance(gb_type, str) and gb_type:
        return gb_type
    first = next((line.strip() for line in safe_message(error).splitlines() if line.strip()), "")
    name = type(error).__name__
    return truncate(f"{name}: {first}" if first else name, _SUMMARY_LIMIT)


def _make(kind: str, summary: str, text: str) -> Explanation:
    return Explanation(kind, truncate(summary, _SUMMARY_LIMIT), truncate(text, TEXT_LIMIT))


def explain(error: BaseException, location: SourceLocation | None = None) -> Explanation:
    """``error`` in plain words, naming ``location`` (the user's line) where given."""
    where = _where(location)
    chain = list(exception_chain(error, inner=True, limit=8))
    names = {type(e).__name__ for e in chain}
    texts = " ".join(str(e) for e in chain)

    if _DATA_DEPENDENT.search(texts):
        return _make(
            "data_dependent_branch",
            "a branch on a tensor's value",
            f"a branch on a tensor's value{where}: compile cannot see which way it goes; "
            "use torch.cond or move it out",
        )
    found = _NO_FAKE.search(texts)
    if found is not None:
        op = found.group("op") or found.group("op2")
        return _make(
            "custom_op",
            f"custom op {op} cannot be traced",
            f"custom op {op}{where} has no fake (meta) implementation, needed to trace it: "
            "add one with register_fake",
        )
    if "FailOnRecompileLimitHit" in names or "fail_on_recompile_limit_hit" in texts:
        return _make(
            "recompile_limit",
            "too many recompiles",
            f"too many recompiles{where}: each new shape or Python value compiles a graph; "
            "use Buckets or dynamic=True",
        )
    gb_type = next(
        (g for e in chain if isinstance(g := getattr(e, "gb_type", None), str) and g), None
    )
    if gb_type is not None:
        builtin = _BUILTIN.search(texts)
        what = f"`{builtin.group('name')}`" if builtin else gb_type
        return _make(
            "graph_break",
            f"a graph break ({what})",
            f"a graph break{where}: {what}; fullgraph=True allows none: move it out or use "
            "fullgraph=False",
        )
    headline = _headline(error)
    if "BackendCompilerFailed" in names:
        backend = getattr(error, "backend_name", None)
        by = f"backend {backend!r}" if isinstance(backend, str) else "the backend"
        return _make("backend_error", headline, f"{by} failed to compile{where}: {headline}")
    return _make("error", headline, headline + where)
