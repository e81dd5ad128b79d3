"""Map compiler failures and graph breaks back to the user's own source line.

torch says where a failure happened differently for each kind (torch 2.13): dynamo errors
carry ``real_stack`` / ``innermost_user_frame_summary``; ``BackendCompilerFailed`` carries
neither, but the failing FX node shows up as a local in the backend's frames or as its
``stack_trace`` in the inner message; an error from compiled code at run time arrives
unwrapped, its traceback running into generated code (an FX ``<eval_with_key>.N`` forward,
whose line maps to a node, or inductor's output file); a graph break is told by
``gm.compile_subgraph_reason`` or, with nothing compiled before it, by a resume function's
name (``torch_dynamo_resume_in_<fn>_at_<line>``). Frames in torch, safecompile and
generated code are never reported as the user's.
"""

from __future__ import annotations

import functools
import importlib.util
import linecache
import os
import re
import sysconfig
import traceback
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from safecompile.base import torchcompat

__all__ = [
    "SourceLocation",
    "dedupe_graph_breaks",
    "error_type_name",
    "exception_chain",
    "graph_breaks_of",
    "innermost_user_frame",
    "is_generated_file",
    "is_user_file",
    "location_fields",
    "location_of_error",
    "location_of_function",
    "redact_tensors",
    "safe_message",
    "truncate",
    "without_our_frames",
]

#: Default bound on any message that leaves the process.
MESSAGE_LIMIT = 512

_MAX_CHAIN = 16  # exceptions followed through __cause__ / __context__
_MAX_DEF_SCAN = 64  # source lines scanned from a code object's first line to its ``def``

_FRAME_RE = re.compile(r'File "(?P<file>[^"\n]+)", line (?P<line>\d+), in (?P<func>[^\n]+)')
_RESUME_RE = re.compile(r"^torch_dynamo_resume_in_(?P<func>.+)_at_(?P<line>\d+)$")
_TENSOR_RE = re.compile(r"\b(?:tensor|Parameter containing:\s*tensor)\(")
_BOILERPLATE_RE = re.compile(r"^Set TORCHDYNAMO_VERBOSE=1 [^\n]*\n?", re.MULTILINE)
_IMPLIED_BREAK_REASON = "graph break (reason not reported: nothing was compiled before it)"


@dataclass(frozen=True, slots=True)
class SourceLocation:
    """A place in the user's source: the file, the line (where known), the function."""

    file: str
    line: int | None
    function: str | None


# ---------------------------------------------------------------------------- files


def _package_dir(name: str) -> str | None:
    """The directory of an installed top-level package, without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return _norm(next(iter(spec.submodule_search_locations)))


def _norm(path: str) -> str:
    return os.path.normcase(os.path.abspath(path))


@functools.cache
def _internal_dirs() -> tuple[str, ...]:
    found = (_package_dir(name) for name in ("functorch", "torchgen", "triton"))
    dirs = {_norm(os.path.dirname(torch.__file__)), _our_dir(), *(d for d in found if d)}
    return tuple(sorted(dirs))


@functools.cache
def _stdlib_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple(sorted({_norm(paths[key]) for key in ("stdlib", "platstdlib") if key in paths}))


def _under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def is_generated_file(filename: str) -> bool:
    """Whether ``filename`` names code that torch generated (FX, inductor, ``exec``)."""
    if not filename:
        return True
    if filename.startswith("<"):
        return not (filename == "<stdin>" or filename.startswith("<ipython-input-"))
    path = _norm(filename)
    parts = path.split(os.sep)
    if any(part.startswith("torchinductor_") or part == "torch_compile_debug" for part in parts):
        return True
    caches = (os.environ.get(name) for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"))
    return any(_under(path, _norm(directory)) for directory in caches if directory)


def is_user_file(filename: str) -> bool:
    """Whether ``filename`` is the user's own code: not torch (functorch, torchgen, triton),
    safecompile, the standard library or generated code; ``site-packages`` counts (model
    code, say)."""
    if is_generated_file(filename):
        return False
    path = _norm(filename)
    if any(_under(path, d) for d in _internal_dirs()):
        return False
    for directory in _stdlib_dirs():
        if _under(path, directory):
            rest = path[len(directory) :].split(os.sep)
            if "site-packages" not in rest and "dist-packages" not in rest:
                return False
    return True


@functools.cache
def _our_dir() -> str:
    return _norm(os.path.dirname(os.path.dirname(__file__)))


def without_our_frames(exc: BaseException) -> BaseException:
    """``exc`` (the same object) without its leading safecompile frames, so the traceback
    a user reads starts in their code; kept whole when every frame is ours."""
    tb = exc.__traceback__
    while tb is not None and _under(_norm(tb.tb_frame.f_code.co_filename), _our_dir()):
        tb = tb.tb_next
    return exc if tb is None else exc.with_traceback(tb)


# ---------------------------------------------------------------------------- functions


def _plain_function_name(name: str) -> str:
    """``torch_dynamo_resume_in_f_at_7`` -> ``f`` (dynamo's resume functions)."""
    while (match := _RESUME_RE.match(name)) is not None:  # each match is shorter
        name = match.group("func")
    return name


def _def_line(code: types.CodeType) -> int:
    """The line of the ``def`` statement (``co_firstlineno`` is the first decorator's)."""
    first = code.co_firstlineno
    name = code.co_name
    if not name.isidentifier():  # <lambda>, <module>, <genexpr>
        return first
    pattern = re.compile(rf"^\s*(?:async\s+)?def\s+{re.escape(name)}\b")
    lines = linecache.getlines(code.co_filename)
    for index in range(first - 1, min(len(lines), first - 1 + _MAX_DEF_SCAN)):
        if pattern.match(lines[index]):
            return index + 1
    return first


def _unwrap(fn: object) -> object:
    """Peel wrappers off ``fn`` until a plain function (or something opaque) is left."""
    for _ in range(_MAX_CHAIN):
        inner: object = None
        if getattr(fn, "__wrapped__", None) is not None:  # functools.wraps
            inner = fn.__wrapped__  # type: ignore[attr-defined]
        elif isinstance(fn, types.FunctionType):
            return fn
        elif (compiled := torchcompat.compiled_original(fn)) is not None:
            inner = compiled
        elif isinstance(fn, torch.nn.Module):
            inner = getattr(fn, "forward", None)
        elif isinstance(fn, functools.partial):
            inner = fn.func
        elif isinstance(fn, types.MethodType | staticmethod | classmethod):
            inner = fn.__func__
        elif callable(fn) and not isinstance(fn, type | types.BuiltinFunctionType):
            inner = type(fn).__call__
        if inner is None or inner is fn:
            return fn
        fn = inner
    return fn


def location_of_function(fn: object) -> SourceLocation | None:
    """Where ``fn`` is defined (its ``def`` line), seen through wrappers, partials,
    methods, ``nn.Module`` and callable objects; ``None`` outside the user's files."""
    target = _unwrap(fn)
    code = getattr(target, "__code__", None)
    if not isinstance(code, types.CodeType) or not is_user_file(code.co_filename):
        return None
    name = getattr(target, "__qualname__", None) or code.co_qualname
    return SourceLocation(code.co_filename, _def_line(code), str(name))


# ---------------------------------------------------------------------------- errors


def error_type_name(exc: BaseException) -> str:
    """The exception's qualified type name: ``torch._dynamo.exc.Unsupported``, ``ValueError``."""
    cls = type(exc)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def truncate(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """``text`` cut to at most ``limit`` characters (an ellipsis marks the cut)."""
    limit = max(limit, 1)
    if len(text) <= limit:
        return text
    return text[: limit - 1] + "\u2026"


def redact_tensors(text: str) -> str:
    """``text`` with every tensor repr (``tensor([...])``) replaced by ``tensor(...)``."""
    out: list[str] = []
    pos = 0
    for match in _TENSOR_RE.finditer(text):
        if match.start() < pos:
            continue
        depth = 1
        index = match.end()
        while index < len(text) and depth:
            if text[index] == "(":
                depth += 1
            elif text[index] == ")":
                depth -= 1
            index += 1
        out.append(text[pos : match.start()])
        out.append("tensor(...)")
        pos = index
    out.append(text[pos:])
    return "".join(out)


def safe_message(exc_or_text: BaseException | str, limit: int = MESSAGE_LIMIT) -> str:
    """A message fit to leave the process: tensor reprs redacted, torch's advice about
    ``TORCHDYNAMO_VERBOSE`` / ``TORCH_LOGS`` dropped, bounded in length."""
    text = exc_or_text if isinstance(exc_or_text, str) else str(exc_or_text)
    text = _BOILERPLATE_RE.sub("", text).strip()
    return truncate(redact_tensors(text), limit)


def exception_chain(
    exc: BaseException, *, inner: bool = False, limit: int = _MAX_CHAIN
) -> Iterator[BaseException]:
    """``exc``, then what it came from (with ``inner``, torch's ``inner_exception`` first;
    then ``__cause__``, else ``__context__``), each once, at most ``limit``."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < limit:
        seen.add(id(current))
        yield current
        wrapped = getattr(current, "inner_exception", None) if inner else None
        if isinstance(wrapped, BaseException):
            current = wrapped
        else:
            current = current.__cause__ or current.__context__


def _from_summary(frame: traceback.FrameSummary) -> SourceLocation:
    return SourceLocation(frame.filename, frame.lineno, _plain_function_name(frame.name))


def innermost_user_frame(stack: Iterable[Any]) -> SourceLocation | None:
    """The last of ``stack``'s frames (``traceback.FrameSummary``) in the user's files."""
    found: SourceLocation | None = None
    for frame in stack:
        if isinstance(frame, traceback.FrameSummary) and is_user_file(frame.filename):
            found = _from_summary(frame)
    return found


def _from_stack_text(text: str) -> SourceLocation | None:
    """The innermost user frame in formatted traceback text (an FX node's ``stack_trace``)."""
    return innermost_user_frame(
        traceback.FrameSummary(m["file"], int(m["line"]), m["func"].strip(), lookup_line=False)
        for m in _FRAME_RE.finditer(text)
    )


def _node_location(node: object) -> SourceLocation | None:
    stack_trace = node.meta.get("stack_trace") if isinstance(node, torch.fx.Node) else None
    return _from_stack_text(stack_trace) if isinstance(stack_trace, str) else None


def _graph_module_node(frame: types.FrameType, lineno: int) -> SourceLocation | None:
    """The user location of the FX node a ``GraphModule.forward`` frame was running."""
    module = frame.f_locals.get("self")
    if not isinstance(module, torch.fx.GraphModule):
        return None
    codes = [
        getattr(getattr(owner, "forward", None), "__code__", None)
        for owner in (type(module), module)
    ]
    lineno_map = torchcompat.graph_line_map(module)
    if frame.f_code not in codes or lineno_map is None:
        return None
    index = lineno_map.get(lineno - frame.f_code.co_firstlineno)
    nodes = list(module.graph.nodes)
    return _node_location(nodes[index]) if isinstance(index, int) and index < len(nodes) else None


def _frame_location(frame: types.FrameType, lineno: int) -> SourceLocation:
    code = frame.f_code
    line = _def_line(code) if lineno == code.co_firstlineno else lineno
    return SourceLocation(code.co_filename, line, _plain_function_name(code.co_qualname))


def _backend_location(inner: BaseException) -> SourceLocation | None:
    """Where the FX node a backend failed on came from, when torch lets us know; else
    the user frame of a dynamo error inside the backend's."""
    for exc in exception_chain(inner):
        # fx.Interpreter ("Original traceback:") and inductor lowering ("Found from :")
        # put the failing node's stack_trace in the message.
        found = _from_stack_text(str(exc))
        if found is not None:
            return found
        # Otherwise: the innermost frame of the backend's own that holds the node it was
        # working on (dynamo's frames hold the output node and placeholders: skipped).
        for frame, _ in reversed(list(traceback.walk_tb(exc.__traceback__))):
            if frame.f_code.co_filename.startswith(torchcompat.dynamo_dir()):
                continue
            for name in ("n", "node"):
                found = _node_location(frame.f_locals.get(name))
                if found is not None:
                    return found
    for nested in exception_chain(inner):
        found = innermost_user_frame(getattr(nested, "real_stack", None) or ())
        if found is not None:
            return found
    return None


def _runtime_order(exc: BaseException) -> list[BaseException]:
    """Explicit causes first, the root one first (where the failure began), then ``exc``;
    then what ``exc`` was raised while handling (``__context__``), which is incidental."""
    causes: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and len(causes) < _MAX_CHAIN and current not in causes:
        causes.append(current)
        current = current.__cause__
    ordered = causes[::-1]
    ordered.extend(link for link in exception_chain(exc) if link not in ordered)
    return ordered


def _runtime_location(exc: BaseException) -> tuple[SourceLocation | None, str | None]:
    """The innermost user frame (or generated FX frame mapped to its node) of a traceback."""
    generated: str | None = None
    for link in _runtime_order(exc):
        entries = list(traceback.walk_tb(link.__traceback__))
        # The first entry is the frame that caught the exception (the caller): it is where
        # the call was made, not where the failure happened, unless it is the only one.
        candidates = entries[1:] if len(entries) > 1 else entries
        for frame, lineno in reversed(candidates):
            filename = frame.f_code.co_filename
            if is_generated_file(filename):
                generated = generated or filename  # the innermost generated file
                node = _graph_module_node(frame, lineno)
                if node is not None:
                    return node, generated
            elif is_user_file(filename):
                if generated is None:  # user code called from generated code: keep both
                    files = (outer.f_code.co_filename for outer, _ in candidates)
                    generated = next((f for f in files if is_generated_file(f)), None)
                return _frame_location(frame, lineno), generated
    return None, generated


def location_of_error(exc: BaseException, fn: object) -> tuple[SourceLocation | None, str | None]:
    """Where in the user's source ``exc`` happened (else where ``fn`` is defined), and
    the generated file on the failing stack, if any."""
    for link in exception_chain(exc):
        # A dynamo error: the innermost user frame of its real stack, else its summary's.
        summary = getattr(link, "innermost_user_frame_summary", None)
        found = innermost_user_frame([summary, *(getattr(link, "real_stack", None) or ())])
        if found is not None:
            return found, None
        inner = getattr(link, "inner_exception", None)
        if isinstance(inner, BaseException):  # BackendCompilerFailed / InductorError
            return _backend_location(inner) or location_of_function(fn), None
    found, generated = _runtime_location(exc)
    return found or location_of_function(fn), generated


# ---------------------------------------------------------------------------- graph breaks


def location_fields(where: SourceLocation | None) -> dict[str, Any]:
    """An event's ``file`` / ``line`` / ``function`` for ``where`` (``{}`` when unknown)."""
    if where is None:
        return {}
    return {"file": where.file, "line": where.line, "function": where.function}


def _break(reason: str, location: SourceLocation | None) -> dict[str, object]:
    unknown = {"file": None, "line": None, "function": None}
    return {"reason": safe_message(reason), **unknown, **location_fields(location)}


def graph_breaks_of(
    gm: torch.fx.GraphModule, *, include_resumed: bool = False
) -> list[dict[str, object]]:
    """The graph breaks ``gm`` tells of, each ``{"reason", "file", "line", "function"}``:
    the one that ended it (so summing over graphs counts each once) and, with
    ``include_resumed``, the one it resumes after, the only trace of a break with nothing
    compiled before it (merge a compile's lists with :func:`dedupe_graph_breaks`)."""
    out: list[dict[str, object]] = []
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is not None and getattr(reason, "graph_break", False):
        stack = list(getattr(reason, "user_stack", None) or ())
        location = innermost_user_frame(stack)
        if location is None and stack and isinstance(stack[-1], traceback.FrameSummary):
            location = _from_summary(stack[-1])
        out.append(_break(str(getattr(reason, "reason", "")), location))
    if not include_resumed:
        return out
    resumed: dict[tuple[str, int], str] = {}  # (file, line) -> function, first seen
    for node in gm.graph.nodes:
        stack_trace = node.meta.get("stack_trace")
        if not isinstance(stack_trace, str) or "torch_dynamo_resume_in_" not in stack_trace:
            continue
        for match in _FRAME_RE.finditer(stack_trace):
            resume = _RESUME_RE.match(match["func"].strip())
            if resume is not None and is_user_file(match["file"]):
                resumed.setdefault((match["file"], int(resume["line"])), resume["func"])
    for (file, line), function in resumed.items():
        location = SourceLocation(file, line, _plain_function_name(function))
        out.append(_break(_IMPLIED_BREAK_REASON, location))
    return out


def dedupe_graph_breaks(breaks: Iterable[dict[str, object]]) -> list[dict[str, object]]:
    """One entry per break location, keeping a known reason over an unknown one."""
    merged: dict[tuple[object, object], dict[str, object]] = {}
    for entry in breaks:
        key = (entry.get("file"), entry.get("line"))
        if key == (None, None):
            merged[(id(entry), None)] = entry
            continue
        previous = merged.get(key)
        if previous is None or previous.get("reason") == _IMPLIED_BREAK_REASON:
            merged[key] = entry
    return list(merged.values())
