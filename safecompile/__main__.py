"""The command line: ``python -m safecompile doctor MODULE:FACTORY`` (or ``safecompile doctor``).

A usage error (exit 2: bad flags, a factory that does not import, call or return a target,
inputs that fail in eager, ``--html`` without matplotlib) is one line on stderr; exit 3 is a
bug in safecompile, with its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import TypeVar

from . import deploy, doctor, runner
from .doctor import html as _html
from .doctor.report import DEFAULT_LIMIT
from .doctor.text import LINE_LIMIT

__all__ = ["main"]

_N = TypeVar("_N", int, float)

EXIT_USAGE = 2
EXIT_CRASH = 3

_DESCRIPTION = """\
Check that a callable is ready for safe_compile in production: graph breaks with their
source lines, cold compile time per example, recompiles over a shape sweep, speed against
eager, drift against eager, versions. Exit 0 ready, 1 not ready, 2 usage error.

FACTORY() returns DoctorTarget(fn=..., inputs=[...]) (from safecompile.doctor) or a pair
(fn, inputs): fn is a function or an nn.Module, inputs a list of example calls (each a
tuple of arguments, a dict of keyword arguments or a tensor) or one call's tuple of
arguments."""


def _number(
    convert: Callable[[str], _N], ok: Callable[[_N], bool], rule: str
) -> Callable[[str], _N]:
    """An argparse ``type``: the text converted, refused unless ``ok`` (``rule`` says why)."""

    def parse(text: str) -> _N:
        with contextlib.suppress(ValueError):
            value = convert(text)
            if ok(value):
                return value
        raise argparse.ArgumentTypeError(f"expected {rule}, got {text!r}")

    return parse


_DEFAULT = doctor.Settings()
_positive_int = _number(int, lambda n: n >= 1, "an integer >= 1")
_count = _number(int, lambda n: n >= 0, "an integer >= 0")
_ratio = _number(float, lambda x: x > 0, "a number > 0 (inf: never)")  # NaN > 0 is False


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="safecompile",
        description="Tools for safecompile: make torch.compile safe in production.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    doctor = commands.add_parser(
        "doctor",
        help="readiness report for one callable",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands.add_parser(
        "run", help="run a program with every torch.compile guarded", add_help=False
    )
    add = doctor.add_argument
    add(
        "target",
        metavar="MODULE:FACTORY",
        help="a module (dotted, importable from here) or a .py file, and the factory in it",
    )
    add("--backend", help="torch.compile backend (default: the target's, else inductor)")
    add("--mode", help="inductor mode (default: the target's, else none)")
    add(
        "--dynamic",
        choices=("true", "false", "auto"),
        help="torch.compile's dynamic: true, false, or auto (None; the default)",
    )
    add("--json", metavar="PATH", help="also write the report as JSON to PATH ('-': stdout)")
    add(
        "--html",
        metavar="PATH",
        help="also write the report as one self-contained HTML page with plots to PATH "
        "(needs matplotlib: pip install 'safecompile[html]')",
    )
    add(
        "--traceback",
        action="store_true",
        help="on a usage error raised by your code (an import or the factory), also print "
        "its traceback",
    )
    add(
        "--repeat",
        type=_positive_int,
        metavar="N",
        help=f"timing samples per example and path (default {_DEFAULT.repeat})",
    )
    add("--quick", action="store_true", help="skip the shape sweep and the timing")
    add(
        "--grad",
        action="store_true",
        help="run with autograd on (default: under torch.no_grad(), as for inference)",
    )
    add(
        "--max-graph-breaks",
        type=_count,
        metavar="N",
        help=f"graph breaks allowed before the check fails (default {_DEFAULT.max_graph_breaks})",
    )
    add(
        "--max-recompiles",
        type=_positive_int,
        metavar="N",
        help="compiles allowed before new shapes run eager, as Rollback(max_recompiles) "
        f"(default: the target's, else {DEFAULT_LIMIT})",
    )
    add(
        "--slower-ratio",
        type=_ratio,
        metavar="X",
        help="fail when compiled takes more than X times eager's time "
        f"(default {_DEFAULT.slower_ratio:.2f})",
    )
    deploy.add_commands(commands)  # prebuild, cache
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if list(argv[:1]) == ["run"]:  # its own flags, then the command after ``--``
        return runner.main(argv[1:])
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a bad flag (argparse printed why)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command in deploy.COMMANDS:
        return deploy.run(args)
    if args.command != "doctor":
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    return _doctor(args)


def _usage_error(message: str) -> int:
    """One line on stderr (a long one loses its middle, keeping what and where); exit 2."""
    line = f"safecompile doctor: error: {' '.join(message.split())}"
    if len(line) > LINE_LIMIT:
        tail = LINE_LIMIT * 2 // 5
        line = line[: LINE_LIMIT - tail - 1] + "\u2026" + line[-tail:]
    print(line, file=sys.stderr)
    return EXIT_USAGE


def _check_outputs(args: argparse.Namespace) -> str | None:
    """What is wrong with the output flags, checked before minutes of compiling."""
    outputs = [("--json", args.json)] if args.json not in (None, "-") else []
    if args.html is not None:
        outputs.append(("--html", args.html))
    for flag, path in outputs:
        if os.path.isdir(path):
            return f"{flag} {path}: is a directory; give a file name"
        if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            return f"{flag} {path}: no such directory"
    if args.html is not None and not _html.available():
        return f"--html needs matplotlib, which is not installed: {_html.INSTALL_HINT}"
    return None


def _doctor(args: argparse.Namespace) -> int:
    problem = _check_outputs(args)
    if problem is not None:
        return _usage_error(problem)

    flags = vars(args)  # each flag but --json, --html and --traceback is a Settings field
    given = [f.name for f in dataclasses.fields(doctor.Settings) if flags.get(f.name) is not None]
    settings = doctor.Settings(**{name: flags[name] for name in given})

    def progress(line: str) -> None:
        print(f"doctor: {line}", file=sys.stderr, flush=True)

    try:
        # stdout carries the report and only the report: what the user's code, torch or an
        # application's logging configuration prints while the doctor runs goes to stderr
        with contextlib.redirect_stdout(sys.stderr):
            target = doctor.load_target(args.target)
            report = doctor.diagnose(target, settings, spec=args.target, progress=progress)
    except doctor.UsageError as exc:
        if exc.detail and args.traceback:
            print(exc.detail.rstrip(), file=sys.stderr)
        return _usage_error(str(exc))
    except Exception:
        traceback.print_exc()
        print(
            "safecompile doctor: internal error (a bug in safecompile; please report it "
            "with the traceback above)",
            file=sys.stderr,
        )
        return EXIT_CRASH

    text = json.dumps(report.to_dict(), indent=2, allow_nan=False)
    if args.json == "-":
        print(text)
    else:
        print(doctor.render_text(report), end="")
        if args.json and not _write(args.json, text + "\n"):
            return EXIT_USAGE
    if args.html and not _write(args.html, _html.render_html(report)):
        return EXIT_USAGE
    return report.exit_code


def _write(path: str, text: str) -> bool:
    """Write ``text`` to ``path``; on failure say why in one line and return ``False``."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:
        _usage_error(f"cannot write {path}: {exc.strerror or exc}")
        return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())
