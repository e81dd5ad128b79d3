"""``safecompile prebuild`` and ``safecompile cache``: build a store ahead of a deploy, and
look inside one (docs/deploying.md).

``prebuild MODULE:FACTORY`` imports the module and calls the factory (the doctor's
convention); the guarded callables it returns warm up as they would in the service (every
``Warmup`` example, every bucket), which seals their precompiled functions into
``SAFECOMPILE_CACHE_DIR`` (and ``SAFECOMPILE_REMOTE_CACHE``). ``cache list|verify|prune``
reads a cache directory or a Redis through :mod:`safecompile.persist.inventory`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fnmatch
import json
import logging
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from safecompile import doctor
from safecompile.base.killswitch import ENV_VAR
from safecompile.base.model import EventKind, State
from safecompile.doctor.text import LINE_LIMIT
from safecompile.guard.decorator import Guarded
from safecompile.observe.log import LOGGER_NAME
from safecompile.persist import inventory
from safecompile.persist.cache import CACHE_ENV_VAR, cache_root, keys_made, usable_root
from safecompile.persist.remote import (
    BLOB_PREFIX,
    REMOTE_ENV_VAR,
    RedisLink,
    RemoteUnavailableError,
    RemoteVerdicts,
    activate,
    parse_url,
    redacted,
)
from safecompile.persist.signing import KEY_ENV_VAR, KEY_FILE_ENV_VAR, Signer, signer

__all__ = ["COMMANDS", "add_commands", "run"]

COMMANDS = ("prebuild", "cache")
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
SCHEMA = "safecompile.cache"
SCHEMA_VERSION = 1
_KEY_NEEDED = f"{KEY_ENV_VAR} (or {KEY_FILE_ENV_VAR})"

_PREBUILD = f"""\
Compile the guarded callables FACTORY() returns for every warmup example and bucket, and
seal what a restart loads without tracing into ${CACHE_ENV_VAR} (a directory to ship
with the image) or ${REMOTE_ENV_VAR} (a Redis the replicas share), signed with
${KEY_ENV_VAR}. Prints what it built. Exit 0 all built, 1 something did not build,
2 usage error.

FACTORY() returns guarded callables (safe_compile(..., warmup=Warmup(inputs=[...]))),
as one, a list or a dict; a pair (guarded, inputs) adds example calls of its own. Give
them the options the service uses: entries are keyed by them, and by the code, torch,
Python and device."""

_CACHE = f"""\
Look inside ${CACHE_ENV_VAR} (--dir DIR: another directory; --remote [URL]: the
Redis of ${REMOTE_ENV_VAR}, or URL's). Each entry (one artifact key) with its
function, precompiled graphs, bucket verdicts, torch version, size, age, whether its
signature verifies under ${KEY_ENV_VAR}, and whether it was built from the code
importable here (its module is imported with the kill switch on: nothing compiles).
Nothing stored is unpickled."""

_ACTIONS = {
    "list": (
        "list every entry",
        "List every entry; --json for machines. Exit 0, 2 usage error.",
    ),
    "verify": (
        "exit 1 on an invalid, foreign or stale entry",
        "Check every entry: exit 1, naming each entry, file and reason, if a signature does "
        "not verify (tampered, or another key), an entry was made by another torch or Python "
        "(foreign) or from other code than the code importable here (stale); 0 when all are "
        "good; 2 usage error (verify needs the key).",
    ),
    "prune": (
        "delete stale, foreign, old or invalid entries",
        "Delete every entry that matches any of the criteria given (--dry-run first to see "
        "which). Exit 0 done, 2 usage error.",
    ),
}


def add_commands(commands: Any) -> None:
    """Add ``prebuild`` and ``cache`` to the command line's subparsers."""
    raw = argparse.RawDescriptionHelpFormatter
    prebuild = commands.add_parser(
        "prebuild",
        help="build the artifacts a deploy loads",
        description=_PREBUILD,
        formatter_class=raw,
    )
    add = prebuild.add_argument
    add("target", metavar="MODULE:FACTORY", help="a module (dotted) or a .py file, and the factory")
    add("--json", metavar="PATH", help="also write what was built as JSON to PATH ('-': stdout)")
    add("--traceback", action="store_true", help="on an error in your code, print its traceback")

    cache = commands.add_parser(
        "cache",
        help="list, verify and prune stored artifacts",
        description=_CACHE,
        formatter_class=raw,
    )
    actions = cache.add_subparsers(dest="action", metavar="ACTION")
    for name, (summary, text) in _ACTIONS.items():
        sub = actions.add_parser(name, help=summary, description=text)
        sub.add_argument(
            "--dir", metavar="DIR", help=f"the cache directory (default ${CACHE_ENV_VAR})"
        )
        sub.add_argument(
            "--remote",
            metavar="URL",
            nargs="?",
            const="",
            help=f"the Redis instead (default URL: ${REMOTE_ENV_VAR})",
        )
        sub.add_argument("--json", action="store_true", help="print JSON instead of text")
        sub.add_argument(
            "--no-import",
            action="store_true",
            help="do not import the functions' modules (whether an entry is current is not told)",
        )
        if name != "prune":
            continue
        add = sub.add_argument
        add("--stale", action="store_true", help="entries built from other code than here")
        add("--foreign", action="store_true", help="entries made by another torch or Python")
        add("--invalid", action="store_true", help="entries with a file whose HMAC fails")
        add("--older-than", metavar="AGE", type=_age, help="entries older than AGE (30m, 12h, 7d)")
        add("--function", metavar="NAME", help="entries of these functions (a glob: 'ranker.*')")
        add("--key", metavar="KEY", help="the entry of this key (a prefix of 6+ hex digits)")
        add("--dry-run", action="store_true", help="say what would be deleted, delete nothing")


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def _age(text: str) -> float:
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if found is None:
        raise argparse.ArgumentTypeError(
            f"expected a number and a unit (s, m, h, d, w), e.g. 7d or 12h, got {text!r}"
        )
    return float(found[1]) * _UNITS[found[2]]


def run(args: argparse.Namespace) -> int:
    """Run ``prebuild`` or ``cache`` for parsed ``args``; the exit code."""
    try:
        if args.command == "prebuild":
            return _prebuild(args)
        if args.action is None:
            raise _Usage("say which: safecompile cache list, verify or prune")
        return _cache(args)
    except _Usage as exc:
        return _usage(_command(args), str(exc))
    except doctor.UsageError as exc:
        if exc.detail and getattr(args, "traceback", False):
            print(exc.detail.rstrip(), file=sys.stderr)
        return _usage(_command(args), str(exc))


def _command(args: argparse.Namespace) -> str:
    action = getattr(args, "action", None)
    return f"{args.command} {action}" if action else str(args.command)


class _Usage(Exception):
    """A usage error: one line on stderr, exit 2."""


def _usage(command: str, message: str) -> int:
    line = f"safecompile {command}: error: {' '.join(message.split())}"
    if len(line) > LINE_LIMIT * 2:
        line = line[: LINE_LIMIT * 2 - 1] + "\u2026"
    print(line, file=sys.stderr)
    return EXIT_USAGE


# ---------------------------------------------------------------- prebuild


@dataclasses.dataclass(frozen=True)
class Built:
    """What prebuild made for one guarded callable."""

    function: str
    ok: bool
    why: str | None  # why it did not build
    graphs: tuple[str, ...] = ()  # the precompiled graphs' labels (shapes, dtypes)
    buckets: int = 0  # bucket verdicts stored
    bytes: int = 0
    keys: tuple[str, ...] = ()


def _prebuild(args: argparse.Namespace) -> int:
    remote = os.environ.get(REMOTE_ENV_VAR, "").strip()
    if remote:
        try:
            parse_url(remote)
        except ValueError as exc:
            raise _Usage(f"{REMOTE_ENV_VAR}: {exc}") from None
    if cache_root() is None and not remote:
        raise _Usage(
            f"nowhere to build: set {CACHE_ENV_VAR} (a directory to ship) or "
            f"{REMOTE_ENV_VAR} (a Redis the replicas share)"
        )
    if signer() is None:
        raise _Usage(f"entries are signed: set {_KEY_NEEDED}, the key the replicas verify with")
    problem = _check_output(args.json)
    if problem is not None:
        raise _Usage(problem)
    temporary = cache_root() is None
    with _store_dir() as root, _logs() as notes:
        started = time.time()
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the report only
            value, factory = doctor.call_factory(args.target)
            targets = _targets(value, factory)
            built = [_build(fn, inputs, root, notes) for fn, inputs in targets]
        where = str(root) if not remote else f"{root} and {redacted(remote)}"
        if temporary:
            where = redacted(remote)
        report = {
            "schema": "safecompile.prebuild",
            "version": 1,
            "target": args.target,
            "where": where,
            "seconds": round(time.time() - started, 3),
            "built": [dataclasses.asdict(b) for b in built],
        }
    text = json.dumps(report, indent=2)
    if args.json == "-":
        print(text)
    else:
        for b in built:
            print(_built_line(b, where))
        done = sum(b.ok for b in built)
        print(f"prebuild: {done} of {len(built)} built into {where}")
        if args.json:
            try:
                Path(args.json).write_text(text + "\n", encoding="utf-8")
            except OSError as exc:
                return _usage("prebuild", f"cannot write {args.json}: {exc.strerror or exc}")
    return EXIT_OK if built and all(b.ok for b in built) else EXIT_FAILED


def _check_output(path: str | None) -> str | None:
    if path is None or path == "-":
        return None
    if os.path.isdir(path):
        return f"--json {path}: is a directory; give a file name"
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        return f"--json {path}: no such directory"
    return None


@contextlib.contextmanager
def _store_dir() -> Iterator[Path]:
    """The cache directory to build into: ``SAFECOMPILE_CACHE_DIR``, or with only a Redis a
    temporary one (what is built reaches Redis through it)."""
    if cache_root() is not None:
        root = usable_root()
        if root is None:
            raise _Usage(f"{CACHE_ENV_VAR}={cache_root()} cannot be used (see the warning above)")
        yield root
        return
    with tempfile.TemporaryDirectory(prefix="safecompile-prebuild-") as folder:
        os.environ[CACHE_ENV_VAR] = folder
        try:
            yield Path(folder)
        finally:
            os.environ.pop(CACHE_ENV_VAR, None)


class _Notes(logging.Handler):
    """safecompile's log events while prebuild runs: warnings to stderr, and why a
    precompiled function was not saved."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.not_saved: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        fields = record.__dict__
        if fields.get("safecompile_event") == "safecompile.precompiled":
            if fields.get("outcome") == "not_saved":
                self.not_saved.append(str(fields.get("safecompile_reason", fields.get("reason"))))
        elif record.levelno >= logging.WARNING:
            print(f"safecompile: {record.getMessage()}", file=sys.stderr)


@contextlib.contextmanager
def _logs() -> Iterator[_Notes]:
    logger = logging.getLogger(LOGGER_NAME)
    notes, level = _Notes(), logger.level
    logger.addHandler(notes)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield notes
    finally:
        logger.removeHandler(notes)
        logger.setLevel(level)


_RETURNS = (
    "guarded callables (safe_compile(..., warmup=Warmup(inputs=[...]))), as one, a list or "
    "a dict, or pairs (guarded, inputs)"
)


def _targets(value: object, factory: str) -> list[tuple[Guarded, tuple[doctor.Example, ...]]]:
    """The guarded callables ``FACTORY()`` returned, each with its extra example calls."""
    items: list[object]
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, list) or (isinstance(value, tuple) and not _pair(value)):
        items = list(value)
    else:
        items = [value]
    if not items:
        raise doctor.UsageError(f"{factory}() returned nothing to build; expected {_RETURNS}")
    found: list[tuple[Guarded, tuple[doctor.Example, ...]]] = []
    for i, item in enumerate(items):
        fn, inputs = item if _pair(item) else (item, None)  # type: ignore[misc]
        if isinstance(item, doctor.DoctorTarget):
            fn, inputs = item.fn, item.inputs
        if not callable(fn):
            raise doctor.UsageError(
                f"{factory}() returned {type(fn).__name__} (item {i}); expected {_RETURNS}"
            )
        if not hasattr(fn, "safecompile"):
            raise doctor.UsageError(
                f"{factory}(): {getattr(fn, '__qualname__', fn)!r} is not guarded by "
                "safe_compile: entries are keyed by the guard's options, so return the guarded "
                "callable the service uses"
            )
        calls = doctor.parse_inputs(inputs, f"{factory}(): inputs") if inputs is not None else ()
        found.append((fn, calls))
    return found


def _pair(value: object) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and hasattr(value[0], "safecompile")


def _build(fn: Guarded, calls: tuple[doctor.Example, ...], root: Path, notes: _Notes) -> Built:
    """Warm ``fn`` (its own warmup, then ``calls``) and read what reached the store."""
    name = fn.safecompile.name
    saw = len(notes.not_saved)
    why = _warm(fn, calls)
    if why is not None:
        return Built(name, ok=False, why=why)
    made = keys_made()
    entries = [e for e in inventory.scan(root, signer()) if e.key in made and e.function == name]
    graphs = tuple(label for e in entries for label in e.labels)
    size = sum(e.bytes for e in entries)
    buckets = sum(e.buckets for e in entries)
    keys = tuple(e.key for e in entries if e.graphs)
    if not graphs:
        reasons = notes.not_saved[saw:]
        why = "no graph was precompiled" + (f": {reasons[-1]}" if reasons else "")
    else:
        why = _not_shared([e for e in entries if e.graphs])
    return Built(
        name, ok=why is None, why=why, graphs=graphs, buckets=buckets, bytes=size, keys=keys
    )


def _warm(fn: Guarded, calls: tuple[doctor.Example, ...]) -> str | None:
    """Why ``fn`` did not warm up (``None``: it did)."""
    control = fn.safecompile
    control.wait_warm()  # a background warmup started at decoration
    for call in calls:
        control.warmup(*call.args, **call.kwargs)
    state = control.state
    if state is State.DISABLED:
        return "disabled by the kill switch (SAFECOMPILE_DISABLE)"
    if state is State.ROLLED_BACK:
        last = control.stats().last_rollback
        why = f"{last.reason.value}: {last.message}" if last and last.reason else "rolled back"
        return f"rolled back at warmup ({why})"
    failed = [e for e in control.events() if e.kind is EventKind.WARMUP_FAILED]
    if failed:
        return f"warmup failed: {failed[-1].message}"
    if state is State.PENDING:
        return "nothing compiled: give it Warmup(inputs=[...]) or return (guarded, inputs)"
    return None


def _not_shared(entries: list[inventory.Entry]) -> str | None:
    """With ``SAFECOMPILE_REMOTE_CACHE``, what of ``entries`` did not reach Redis."""
    url = os.environ.get(REMOTE_ENV_VAR, "").strip()
    if not url:
        return None
    tier = activate()
    if tier is None:
        return f"not written to {redacted(url)}: the remote cache is off (see the warning)"
    for entry in entries:
        blobs = [
            f"{BLOB_PREFIX}{entry.key}:{Path(f.path).name}"
            for f in entry.files
            if f.path.startswith("precompiled")
        ]

        def stored(client: Any, blobs: list[str] = blobs) -> bool:
            return all(client.exists(blob) for blob in blobs)

        index = tier.get(entry.key, inventory.PRECOMPILED_SCOPE)
        if index is None or not tier.link.run_or(stored, False):
            return f"not written to {redacted(url)} (it did not answer, or lost the entry)"
    return None


def _built_line(b: Built, where: str) -> str:
    if not b.ok:
        return f"FAILED {b.function}: {b.why}"
    shown = ", ".join(b.graphs[:4]) + (", ..." if len(b.graphs) > 4 else "")
    buckets = f", {b.buckets} bucket verdict(s)" if b.buckets else ""
    keys = ", ".join(k[:12] for k in b.keys)
    return (
        f"built {b.function}: {len(b.graphs)} graph(s) [{shown}]{buckets}, {_size(b.bytes)} "
        f"in {where} (key {keys})"
    )


# ---------------------------------------------------------------- cache


def _cache(args: argparse.Namespace) -> int:
    store = _Store.chosen(args)
    signing = signer()
    needs_key = args.action == "verify" or (args.action == "prune" and args.invalid)
    if signing is None and needs_key:
        raise _Usage(f"checking signatures needs the operator's key: set {_KEY_NEEDED}")
    if args.action == "prune":
        _check_prune(args)
    now = time.time()
    entries = store.scan(signing)
    # prune asks whether an entry is current only for --stale
    checked = not args.no_import and (args.action != "prune" or args.stale)
    with _importing():
        rows = [_row(e, now, checked=checked) for e in entries]
    if args.action == "prune":
        return _prune(args, store, entries, rows)
    doc = {
        "schema": SCHEMA,
        "version": SCHEMA_VERSION,
        "root": store.where,
        "time": now,
        "signatures_checked": signing is not None,
        "torch_cache_bytes": store.torch_cache_bytes(),
        "entries": rows,
    }
    bad = [r for r in rows if r["problems"]]
    if args.json:
        print(json.dumps(doc | {"ok": not bad} if args.action == "verify" else doc, indent=2))
    elif args.action == "list":
        _print_list(doc)
    else:
        for r in bad:
            for problem in r["problems"]:
                print(f"{r['key'][:12]} {r['function'] or '-'}: {problem}")
        print(f"verify: {len(rows) - len(bad)} of {_entries(len(rows))} good in {store.where}")
    return EXIT_FAILED if args.action == "verify" and bad else EXIT_OK


@contextlib.contextmanager
def _importing() -> Iterator[None]:
    """While the modules entries name are imported to see if their code changed: the kill
    switch on (a warmup at import compiles nothing), the current directory importable (as
    with ``python -m``), and what they print on stderr."""
    before = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = "1"
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if before is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = before


@dataclasses.dataclass(frozen=True)
class _Store:
    """What ``cache`` looks inside: a directory, or a Redis (``remote``)."""

    where: str
    root: Path | None = None
    remote: RemoteVerdicts | None = None

    @classmethod
    def chosen(cls, args: argparse.Namespace) -> _Store:
        if args.remote is not None:
            if args.dir:
                raise _Usage("give --dir or --remote, not both")
            url = args.remote or os.environ.get(REMOTE_ENV_VAR, "").strip()
            if not url:
                raise _Usage(f"which Redis? set {REMOTE_ENV_VAR} or give --remote URL")
            try:
                link = RedisLink(url, purpose="safecompile cache", quiet=True)
            except ValueError as exc:
                raise _Usage(f"--remote: {exc}") from None
            return cls(where=redacted(url), remote=RemoteVerdicts(link))
        root = Path(args.dir).absolute() if args.dir else cache_root()
        if root is None:
            raise _Usage(f"which cache? set {CACHE_ENV_VAR} or give --dir DIR (or --remote)")
        if not root.is_dir():
            raise _Usage(f"no cache directory at {root}")
        return cls(where=str(root), root=root)

    def scan(self, signing: Signer | None) -> list[inventory.Entry]:
        if self.root is not None:
            return inventory.scan(self.root, signing)
        assert self.remote is not None
        try:
            return inventory.scan_remote(self.remote, signing)
        except RemoteUnavailableError as exc:
            raise _Usage(f"cannot read {self.where}: {exc}") from None

    def torch_cache_bytes(self) -> int | None:
        return inventory.torch_cache_bytes(self.root) if self.root is not None else None

    def remove(self, entry: inventory.Entry) -> int:
        if self.root is not None:
            return inventory.remove(self.root, entry)
        assert self.remote is not None
        return inventory.remove_remote(self.remote, entry)


def _row(entry: inventory.Entry, now: float, *, checked: bool) -> dict[str, Any]:
    """An entry as the JSON and the table show it, with its problems."""
    current, why = inventory.is_current(entry) if checked else (None, "not checked (--no-import)")
    problems = [f"invalid signature: {f.path}: {f.problem}" for f in entry.invalid]
    foreign = inventory.foreign(entry)
    if foreign is not None:
        problems.append(f"foreign: {foreign}")
    if current is False:
        problems.append(f"stale: {why}")
    age = entry.age(now)
    return entry.to_dict() | {
        "age_s": None if age is None else round(age, 1),
        "current": current,
        "current_why": why,
        "problems": problems,
    }


def _print_list(doc: dict[str, Any]) -> None:
    rows = doc["entries"]
    head = ("KEY", "FUNCTION", "GRAPHS", "BUCKETS", "TORCH", "SIZE", "AGE", "SIGNATURE", "CURRENT")
    table = [head]
    for r in rows:
        signature = {None: "unchecked", True: "ok", False: "INVALID"}[r["signature"]]
        current = {None: "?", True: "yes", False: "STALE"}[r["current"]]
        function = r["function"] or ("(cpu ISA checks)" if "vec_isa_checks" in r["kinds"] else "-")
        table.append(
            (
                r["key"][:12],
                function,
                str(r["graphs"]),
                str(r["buckets"]),
                (r["torch"] or "?") + (" (foreign)" if r["foreign"] else ""),
                _size(r["bytes"]),
                _duration(r["age_s"]),
                signature,
                current,
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    torch_bytes = doc["torch_cache_bytes"]
    torch_caches = "" if torch_bytes is None else f" (and torch's own caches: {_size(torch_bytes)})"
    total = _size(sum(r["bytes"] for r in rows))
    print(f"{_entries(len(rows))}, {total} in {doc['root']}{torch_caches}")


def _check_prune(args: argparse.Namespace) -> None:
    chosen = (args.stale, args.foreign, args.invalid, args.older_than, args.function, args.key)
    if not any(v not in (None, False) for v in chosen):
        raise _Usage(
            "say what to prune: --stale, --foreign, --invalid, --older-than AGE, "
            "--function NAME or --key KEY (any of them; --dry-run to see first)"
        )
    if args.stale and args.no_import:
        raise _Usage("--stale needs the modules imported: drop --no-import")
    if args.key is not None and not re.fullmatch(r"[0-9a-f]{6,128}", args.key):
        raise _Usage(f"--key: expected 6 or more hex digits, got {args.key!r}")


def _prune(
    args: argparse.Namespace,
    store: _Store,
    entries: list[inventory.Entry],
    rows: list[dict[str, Any]],
) -> int:
    removed: list[dict[str, Any]] = []
    for entry, r in zip(entries, rows, strict=True):
        why = _prune_reason(args, r)
        if why is None:
            continue
        files = len(entry.files) if args.dry_run else store.remove(entry)
        removed.append(
            {"key": entry.key, "function": entry.function, "why": why, "files": files}
            | {"bytes": entry.bytes}
        )
    if args.json:
        doc = {
            "schema": SCHEMA,
            "version": SCHEMA_VERSION,
            "root": store.where,
            "dry_run": args.dry_run,
            "removed": removed,
            "kept": len(rows) - len(removed),
        }
        print(json.dumps(doc, indent=2))
        return EXIT_OK
    verb = "would remove" if args.dry_run else "removed"
    for item in removed:
        print(
            f"{verb} {item['key'][:12]} {item['function'] or '-'} ({item['why']}): "
            f"{item['files']} file(s), {_size(item['bytes'])}"
        )
    total = _size(sum(i["bytes"] for i in removed))
    print(f"prune: {verb} {len(removed)} of {_entries(len(rows))} ({total}) in {store.where}")
    return EXIT_OK


def _prune_reason(args: argparse.Namespace, r: dict[str, Any]) -> str | None:
    """Why prune removes the entry ``r`` (the first criterion it matches), or ``None``."""
    function, age = r["function"], r["age_s"]
    criteria = (
        (args.invalid and r["signature"] is False, "invalid signature"),
        (args.foreign and r["foreign"], f"foreign: {r['foreign']}"),
        (args.stale and r["current"] is False, "stale"),
        (
            args.older_than is not None and age is not None and age > args.older_than,
            f"older than {_duration(args.older_than)}",
        ),
        (
            args.function is not None and function and fnmatch.fnmatchcase(function, args.function),
            f"function {args.function}",
        ),
        (args.key is not None and r["key"].startswith(args.key or ""), f"key {args.key}"),
    )
    return next((why for matched, why in criteria if matched), None)


def _entries(n: int) -> str:
    return f"{n} {'entry' if n == 1 else 'entries'}"


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _duration(seconds: float | None) -> str:
    if seconds is None or math.isnan(seconds):
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"
