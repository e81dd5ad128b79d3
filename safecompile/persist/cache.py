"""Cold start across restarts, under ``SAFECOMPILE_CACHE_DIR`` (read when asked): torch's
own caches in ``torch/`` (``TORCHINDUCTOR_CACHE_DIR``) and one signed JSON verdict per
(artifact key, scope) in ``verdicts/``. An artifact key hashes everything that makes an
artifact or a verdict stale (versions, device, the code, torch.compile's options), so new
code or a torch upgrade retries a known failure. A corrupt or foreign file is ignored with
one ``safecompile.cache_file_ignored`` warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import getpass
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import stat
import sys
import tempfile
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from safecompile._version import __version__
from safecompile.base import torchcompat

from ._state import STATE
from .bounded import bounded, read_file
from .remote import RemoteVerdicts, activate
from .signing import owner_problem, signer, warn_ignored, warn_once

__all__ = [
    "CACHE_ENV_VAR",
    "CallKey",
    "Verdict",
    "VerdictStore",
    "artifact_key",
    "cache_root",
    "code_fingerprint",
    "environment",
    "keys_made",
    "provenance",
    "signed_store",
    "usable_root",
    "use_torch_caches",
]

CACHE_ENV_VAR = "SAFECOMPILE_CACHE_DIR"
SCHEMA = "safecompile.verdict"
SCHEMA_VERSION = 1

_KEY_CHARS = 32  # hex digits of an artifact key (128 bits)
MAX_JSON_DEPTH = 32  # a verdict nests 4 deep; anything far deeper is not ours
MAX_VERDICT_BYTES = 1 << 20  # a verdict is a few hundred bytes
DIR_CHECK_TIMEOUT_S = 2.0  # checking and probing the cache directory: a local disk takes ms
_MAX_CODE_OBJECTS = 2000  # bound on the code walked for one fingerprint
_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_COMPILE_", "TORCH_DYNAMO_")
# Settings that only say where things go (or which job this is), not what is compiled:
# directories, remote caches (on or off, and where: TORCHINDUCTOR_REDIS_URL), job ids.
_PLACE_ONLY = re.compile(r"(_DIR|_PATH|_FILE|JOB_ID|_URL|_HOST|_PORT|REMOTE_CACHE)$")
# Library code is covered by its package version; only user code is walked.
_LIBRARY_ROOTS = frozenset(
    {"torch", "torchvision", "torchaudio", "triton", "functorch", "safecompile", "builtins"}
)

# Values fed as text alone: no class of the user's to walk.
_PLAIN = (
    type(None),
    bool,
    int,
    float,
    str,
    bytes,
    complex,
    enum.Enum,
    set,
    frozenset,
    torch.Tensor,
)


def cache_root() -> Path | None:
    """``$SAFECOMPILE_CACHE_DIR`` expanded and absolute, ``None`` if unset; creates nothing."""
    value = os.environ.get(CACHE_ENV_VAR, "").strip()
    if not value:
        return None
    return Path(os.path.expandvars(os.path.expanduser(value))).absolute()


_SUBDIRS = ("torch", "verdicts", "artifacts", "precompiled")


def usable_root() -> Path | None:
    """:func:`cache_root` once it is a directory this user owns, no other user can write
    (torch unpickles what it holds) and that takes a file; else ``None``, one warning."""
    root = cache_root()
    if root is None:
        return None
    try:  # bounded: a directory on a hung mount must not hang safe_compile()
        problem = bounded(lambda: _root_problem(root), str(root), DIR_CHECK_TIMEOUT_S)
    except OSError as exc:
        problem = f"it does not answer: {exc}"
    if problem is None:
        return root
    warn_once(f"root:{root}", f"{CACHE_ENV_VAR}={root} is not used: {problem}")
    return None


def _root_problem(root: Path) -> str | None:
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        for path in (root, *(root / name for name in _SUBDIRS)):
            try:
                info = os.stat(path)
            except FileNotFoundError:
                continue
            if not stat.S_ISDIR(info.st_mode):
                return f"{path} is not a directory"
            problem = owner_problem(path, info)
            if problem is not None:
                return problem
        fd, probe = tempfile.mkstemp(prefix=".probe.", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"cannot write there: {type(exc).__name__}: {exc}"
    return None


def environment(device: str | torch.device = "cpu") -> dict[str, str]:
    """The versions and hardware an artifact depends on, as text (also for reports)."""
    env: dict[str, str] = {
        "safecompile": __version__,
        "torch": torch.__version__,
        "torch.git": str(getattr(torch.version, "git_version", None)),
        "torch.cuda": str(torch.version.cuda),
        "torch.hip": str(getattr(torch.version, "hip", None)),
        "triton": _triton_version(),
        "python": sys.version,
        "python.implementation": sys.implementation.name,
        "python.cache_tag": str(sys.implementation.cache_tag),
        "platform": f"{platform.system()}-{platform.machine()}",
    }
    env.update(_device_info(device))
    for name in sorted(os.environ):
        if name.startswith(_ENV_PREFIXES) and not _PLACE_ONLY.search(name):
            env[f"env.{name}"] = os.environ[name]
    return env


@functools.cache
def _triton_version() -> str:
    for dist in ("triton", "pytorch-triton", "pytorch-triton-rocm", "pytorch-triton-xpu"):
        try:
            return f"{dist}=={importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "none"


def _device_info(device: str | torch.device) -> dict[str, str]:
    dev = torch.device(device)
    info = {"device": dev.type}
    try:
        if dev.type == "cuda" and torch.cuda.is_available():
            index = dev.index if dev.index is not None else torch.cuda.current_device()
            props = torch.cuda.get_device_properties(index)
            info["device.capability"] = f"{props.major}.{props.minor}"
            info["device.name"] = str(props.name)
            arch = getattr(props, "gcnArchName", None)
            if torch.version.hip is not None and arch:
                info["device.arch"] = str(arch)
        elif dev.type == "cpu":
            info["device.isa"] = str(torch.backends.cpu.get_cpu_capability())
    except Exception as exc:  # a key must never fail on an odd device
        info["device.error"] = type(exc).__name__
    return info


def artifact_key(
    fn: Callable[..., Any], *, device: str | torch.device = "cpu", code: bool = True, **compile: Any
) -> str:
    """A hex hash of what makes ``fn``'s artifacts stale: environment, code, and the compile
    options given (``backend=``, ``mode=``, ...; one set to ``None`` counts as not given).
    ``code=False``: ``fn``'s name instead of its code, a key that outlives an edit (it
    points to the last key saved, so a restart can say what changed)."""
    parts = {
        "environment": environment(device),
        "code": code_fingerprint(fn) if code else _identity(fn),
        "compile": {name: _stable(value) for name, value in compile.items() if value is not None},
    }
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:_KEY_CHARS]


class CallKey:
    """One callable's :func:`artifact_key`, made at its first call (its first tensor's device)."""

    def __init__(
        self, target: Callable[..., Any], options: Mapping[str, Any], *, code: bool = True
    ) -> None:
        self._target = target
        self._options = dict(options)
        self._code = code
        self.value: str | None = None  # None until a call made it

    def get(self, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None = None) -> str | None:
        """The key, made now if no call made it yet; ``None`` (warned once) if it cannot be."""
        if self.value is None:
            values = (*args, *(kwargs or {}).values())
            device = next(
                (t.device for t in values if isinstance(t, torch.Tensor)), torch.device("cpu")
            )
            try:
                self.value = artifact_key(
                    self._target, device=device, code=self._code, **self._options
                )
                STATE.origins.setdefault(self.value, _origin(self._target))
            except Exception as exc:  # never fail a call over a key
                warn_ignored("key", exc)
        return self.value


def _identity(fn: object) -> str:
    """``fn``'s module and qualified name (a module instance's: its class's)."""
    module = getattr(fn, "__module__", None) or type(fn).__module__
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{name}"


def keys_made() -> dict[str, dict[str, str]]:
    """The artifact keys this process made, each with its code's origin (may be ``{}``)."""
    return dict(STATE.origins)


def provenance(key: str) -> dict[str, str]:
    """What an entry stored under ``key`` records of where it was made, signed with it (for
    ``safecompile cache``): the torch and Python versions, and when this process made the
    key, the function's module, qualname and :func:`code_fingerprint`."""
    made = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "safecompile": __version__,
        "platform": f"{platform.system()}-{platform.machine()}",
    }
    return made | STATE.origins.get(key, {})


def _origin(target: Callable[..., Any]) -> dict[str, str]:
    """An importable module-level function's module, qualname and code fingerprint; ``{}``
    for anything that cannot be found again by name (a method, a module, a closure)."""
    if not isinstance(target, types.FunctionType) or "<locals>" in target.__qualname__:
        return {}
    module, qualname = target.__module__, target.__qualname__
    if not module or module == "__main__":
        return {}
    return {"module": module, "qualname": qualname, "code": code_fingerprint(target)}


def code_fingerprint(fn: Callable[..., Any]) -> str:
    """A hash of the user code ``fn`` runs (not line numbers; libraries are keyed by version)
    and, for a module, its submodules' classes, settings and parameter shapes. Never raises."""
    walker = _CodeWalker()
    try:
        walker.value(fn)
    except Exception as exc:  # partial is still deterministic; never fail a decoration
        walker.feed("error", type(exc).__name__)
    return walker.digest()


class _CodeWalker:
    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self._seen: set[int] = set()
        self._attrs: set[tuple[int, str]] = set()  # (module id, attribute) walked
        self._budget = _MAX_CODE_OBJECTS

    def digest(self) -> str:
        return self._hash.hexdigest()

    def feed(self, tag: str, *parts: object) -> None:
        for part in (tag, *parts):
            data = part if isinstance(part, bytes) else str(part).encode("utf-8", "replace")
            self._hash.update(len(data).to_bytes(8, "little"))
            self._hash.update(data)

    def _once(self, obj: object) -> bool:
        if id(obj) in self._seen or self._budget <= 0:
            return False
        self._seen.add(id(obj))
        self._budget -= 1
        return True

    def value(self, obj: object) -> None:
        if isinstance(obj, torch.nn.Module):
            self.module(obj)
        elif isinstance(obj, types.MethodType):
            self.feed("method")
            self.value(obj.__self__)
            self.value(obj.__func__)
        elif isinstance(obj, functools.partial):
            self.feed("partial", _stable(obj.args), _stable(obj.keywords))
            self.value(obj.func)
        elif isinstance(obj, types.FunctionType):
            self.function(obj)
        elif isinstance(obj, type):
            self.klass(obj)
        elif callable(obj):
            self.feed("callable")
            self.klass(type(obj))
        else:
            self.feed("value", _stable(obj))

    def function(self, fn: types.FunctionType) -> None:
        if _is_library(fn) or not self._once(fn):
            self.feed("ref", getattr(fn, "__module__", ""), getattr(fn, "__qualname__", ""))
            return
        self.feed("function", fn.__module__, fn.__qualname__)
        self.code(fn.__code__, fn.__globals__)
        self.feed("defaults", _stable(fn.__defaults__), _stable(fn.__kwdefaults__))
        for cell in fn.__closure__ or ():
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell
                self.feed("cell", "empty")
                continue
            self._reached(content)
        wrapped = getattr(fn, "__wrapped__", None)
        if wrapped is not None:
            self.value(wrapped)

    def _reached(self, obj: object, attrs: tuple[str, ...] = (), depth: int = 0) -> None:
        """Something fn's code reaches: walk user code, name the rest. A user module's
        attributes the code names (``attrs``: ``m.f`` names ``f``) are walked too, and so
        are a container's items and a user object's class."""
        if isinstance(obj, types.FunctionType | type | torch.nn.Module | functools.partial):
            self.value(obj)
        elif isinstance(obj, types.ModuleType):
            self.feed("module", obj.__name__)
            if obj.__name__.partition(".")[0] in _LIBRARY_ROOTS or depth > 3:
                return
            for name in attrs:
                if name in vars(obj) and (id(obj), name) not in self._attrs:
                    self._attrs.add((id(obj), name))
                    self.feed("attr", name)
                    self._reached(vars(obj)[name], attrs, depth + 1)
        else:
            self.feed("value", _stable(obj))
            if depth > 3:
                return
            if isinstance(obj, dict):
                for item in obj.values():
                    self._reached(item, attrs, depth + 1)
            elif isinstance(obj, list | tuple):
                for item in obj:
                    self._reached(item, attrs, depth + 1)
            elif not isinstance(obj, _PLAIN) and not _is_library(type(obj)):
                self.klass(type(obj))

    def code(self, code: types.CodeType, names: Mapping[str, Any]) -> None:
        """``code``, its nested code and the globals (``names``) they read."""
        if not self._once(code):
            self.feed("ref", code.co_qualname)
            return
        self.feed(
            "code",
            code.co_qualname,
            code.co_filename,
            code.co_code,
            ",".join(code.co_names),
            code.co_argcount,
            code.co_posonlyargcount,
            code.co_kwonlyargcount,
            code.co_flags,
        )
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                self.code(const, names)
            else:
                self.feed("const", _stable(const))
        for name in code.co_names:
            if name in names:
                self._reached(names[name], code.co_names)

    def klass(self, cls: type) -> None:
        for k in cls.__mro__:
            if _is_library(k) or not self._once(k):
                self.feed("class-ref", k.__module__, k.__qualname__)
                continue
            self.feed("class", k.__module__, k.__qualname__)
            for name, attr in sorted(vars(k).items()):
                func = attr.__func__ if isinstance(attr, staticmethod | classmethod) else attr
                if isinstance(func, property):
                    for accessor in (func.fget, func.fset):
                        if isinstance(accessor, types.FunctionType):
                            self.function(accessor)
                elif isinstance(func, types.FunctionType):
                    self.feed("attr", name)
                    self.function(func)

    def module(self, root: torch.nn.Module) -> None:
        self.feed("nn.Module")
        for name, sub in root.named_modules():
            self.feed("submodule", name, type(sub).__module__, type(sub).__qualname__)
            self.klass(type(sub))
            settings = {
                k: v
                for k, v in vars(sub).items()
                if k != "training" and isinstance(v, bool | int | float | str | type(None))
            }
            self.feed("settings", _stable(settings))
            for pname, tensor in (
                *sub.named_parameters(recurse=False),
                *sub.named_buffers(recurse=False),
            ):
                self.feed("tensor", pname, _stable(tensor))


def _is_library(obj: object) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return module.partition(".")[0] in _LIBRARY_ROOTS


def _stable(value: object, depth: int = 0) -> str:
    """Text equal for equal values in every process (no ids, no hash order, no tensor
    values). ``torch.Size`` is a tuple, ``bool`` and int enums are ints: order matters."""
    inner = functools.partial(_stable, depth=depth + 1)
    if depth > 6:
        text = "..."
    elif isinstance(value, type(None) | bool | int | float | str | bytes | complex):
        text = repr(value)  # a float's repr is its shortest exact text, nan and inf included
    elif isinstance(value, enum.Enum):
        text = f"{type(value).__qualname__}.{value.name}"
    elif isinstance(value, torch.Tensor):
        text = f"tensor({value.dtype}, {tuple(value.shape)})"
    elif isinstance(value, torch.dtype | torch.device | torch.Size):
        text = str(value)
    elif isinstance(value, tuple | list):
        text = f"{type(value).__name__}({', '.join(map(inner, value))})"
    elif isinstance(value, set | frozenset):
        text = f"set({', '.join(sorted(map(inner, value)))})"
    elif isinstance(value, Mapping):
        text = "{" + ", ".join(sorted(f"{inner(k)}: {inner(v)}" for k, v in value.items())) + "}"
    else:  # a function or class by name, anything else by its type's
        named = value if isinstance(value, types.FunctionType | type) else type(value)
        text = f"<{named.__module__}.{named.__qualname__}>"
    return text


@dataclasses.dataclass(frozen=True, kw_only=True)
class Verdict:
    """What was learnt about a function under one artifact key (``kind="compile_failed"``)."""

    kind: str
    time: float  # wall-clock seconds since the epoch
    name: str | None = None  # the guarded callable's name, for humans
    reason: str | None = None
    error_type: str | None = None
    message: str | None = None
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable form."""
        return dataclasses.asdict(self) | {"details": dict(self.details)}


_FROM_ENV: Any = object()  # VerdictStore's remote tier: the environment's
_PURPOSE = "verdict"


def signed_store() -> tuple[Path | None, VerdictStore | None]:
    """The usable ``SAFECOMPILE_CACHE_DIR`` and a signing verdict store under it;
    ``(None, None)`` without a directory, ``(root, None)`` without a key."""
    root = usable_root()
    store = VerdictStore(root) if root is not None else None
    return root, store if store is not None and store.signer is not None else None


class VerdictStore:
    """Signed verdicts under ``root/verdicts``, one JSON file per (key, scope; ``""``: the
    whole function); without the operator's key it reads and writes nothing. ``remote``
    (default: ``SAFECOMPILE_REMOTE_CACHE``'s tier) is read when the file is missing and
    written alongside. The last writer wins; what cannot be trusted is ignored, warned once.
    """

    def __init__(self, root: Path | str, *, remote: RemoteVerdicts | None = _FROM_ENV) -> None:
        self.directory = Path(root) / "verdicts"
        self.signer = signer()
        if self.signer is None:
            warn_once(
                "no-key",
                f"{CACHE_ENV_VAR} without a key (SAFECOMPILE_CACHE_KEY or "
                "SAFECOMPILE_CACHE_KEY_FILE): verdicts and torch's portable artifacts are "
                "neither written nor read; torch's own on-disk caches still are",
            )
        self.remote = activate() if remote is _FROM_ENV else remote

    def path(self, key: str, scope: str = "") -> Path:
        """The file holding ``(key, scope)``."""
        digest = hashlib.sha256(scope.encode()).hexdigest()[:24]
        return self.directory / _key_dir(key) / f"{digest}.json"

    def get(
        self, key: str, scope: str = "", *, max_age: float | None = None, now: float | None = None
    ) -> Verdict | None:
        """The verdict for ``(key, scope)``, or ``None`` (none, unreadable, foreign, or
        older than ``max_age`` seconds before ``now``)."""
        if self.signer is None:
            return None  # nothing unauthenticated is trusted
        where: Path | str = self.path(key, scope)
        doc = _read_json(self.path(key, scope))
        if doc is None and self.remote is not None:
            where = self.remote.where(key, scope)
            doc = _decode_json(where, self.remote.get(key, scope))
        if doc is None:
            return None
        try:
            if doc.get("schema") != SCHEMA or doc.get("version") != SCHEMA_VERSION:
                raise ValueError(
                    f"schema {doc.get('schema')!r} version {doc.get('version')!r}, expected "
                    f"{SCHEMA!r} version {SCHEMA_VERSION}"
                )
            # the MAC covers the key and scope (another key's file fails it), so only what
            # this store's put() wrote is parsed: a Verdict's own fields
            self.signer.verify_doc(_PURPOSE, _doc_name(key, scope), doc)
            verdict = Verdict(**doc["verdict"])
        except (ValueError, TypeError, KeyError) as exc:
            warn_ignored(where, f"foreign or invalid: {exc}")
            return None
        if max_age is not None and now is not None and now - verdict.time > max_age:
            return None
        return verdict

    def put(self, key: str, verdict: Verdict, scope: str = "") -> bool:
        """Write ``verdict`` for ``(key, scope)``, signed; ``False`` if it was not written."""
        if self.signer is None:
            return False
        head = {"schema": SCHEMA, "version": SCHEMA_VERSION, "key": key, "scope": scope}
        made = {"made": provenance(key)}  # for `safecompile cache`; get() reads "verdict"
        # a JSON round trip first, so the MAC covers exactly what a reader will parse
        doc = json.loads(json.dumps({**head, **made, "verdict": verdict.to_dict()}, default=str))
        doc = self.signer.sign_doc(_PURPOSE, _doc_name(key, scope), doc)
        data = json.dumps(doc, sort_keys=True, indent=1).encode()
        written = _write_atomic(self.path(key, scope), data)
        shared = self.remote is not None and self.remote.put(key, scope, data)
        return written or shared

    def all(self, key: str) -> dict[str, Verdict]:
        """Every readable verdict under ``key``, by scope."""
        try:
            files = sorted((self.directory / _key_dir(key)).glob("*.json"))
        except OSError:
            files = []
        local = (doc.get("scope") for doc in map(_read_json, files) if doc is not None)
        scopes = [scope for scope in local if isinstance(scope, str)]
        scopes += self.remote.scopes(key) if self.remote is not None else []
        found = {scope: self.get(key, scope) for scope in dict.fromkeys(scopes)}  # each once
        return {scope: verdict for scope, verdict in found.items() if verdict is not None}

    def clear(self, key: str | None = None, scope: str | None = None) -> int:
        """Delete one verdict, every verdict of ``key``, or all; the number of files."""
        if key is not None and scope is not None:
            targets = [self.path(key, scope)]
        else:
            folder = self.directory / _key_dir(key) if key is not None else self.directory
            try:
                targets = sorted(folder.rglob("*.json"))
            except OSError:
                return 0
        removed = self.remote.delete(key, scope) if self.remote is not None else 0
        for path in targets:
            try:
                path.unlink()
                removed += 1
            except FileNotFoundError:
                continue
            except OSError as exc:
                warn_ignored(path, f"cannot delete: {type(exc).__name__}: {exc}")
        return removed


def _doc_name(key: str, scope: str) -> str:
    return f"{key}\0{scope}"


def _key_dir(key: str) -> str:
    """A safe directory name for a key: itself when it is hex, else its hash."""
    if re.fullmatch(r"[0-9a-f]{8,128}", key):
        return key
    return hashlib.sha256(key.encode()).hexdigest()[:_KEY_CHARS]


def _read_json(path: Path) -> dict[str, Any] | None:
    try:  # bounded: a verdict file on a hung mount must not hang the call reading it
        raw = read_file(path, limit=MAX_VERDICT_BYTES)
    except OSError as exc:
        warn_ignored(path, f"unreadable: {type(exc).__name__}: {exc}")
        return None
    if raw is not None and len(raw) > MAX_VERDICT_BYTES:
        warn_ignored(path, f"foreign: larger than {MAX_VERDICT_BYTES} bytes")
        return None
    return _decode_json(path, raw)


def _decode_json(where: Path | str, raw: bytes | None) -> dict[str, Any] | None:
    """A verdict document (from a file or the remote tier), or ``None`` (warned once if
    bad). Nesting deeper than ``MAX_JSON_DEPTH`` is foreign, never a ``RecursionError``."""
    if raw is None:
        return None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except RecursionError:
        warn_ignored(where, f"foreign: nested deeper than {MAX_JSON_DEPTH} levels")
        return None
    except (UnicodeDecodeError, ValueError) as exc:
        warn_ignored(where, f"corrupt: {type(exc).__name__}: {exc}")
        return None
    if not isinstance(doc, dict):
        warn_ignored(where, f"foreign: a JSON {type(doc).__name__}, not an object")
        return None
    if _too_deep(doc, MAX_JSON_DEPTH):
        warn_ignored(where, f"foreign: nested deeper than {MAX_JSON_DEPTH} levels")
        return None
    return doc


def _too_deep(doc: object, limit: int) -> bool:
    """Whether ``doc`` nests lists and objects more than ``limit`` deep (no recursion)."""
    stack: list[tuple[object, int]] = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    return False


def _write_atomic(path: Path, data: bytes) -> bool:
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        return True
    except OSError as exc:
        warn_ignored(path, f"cannot write: {type(exc).__name__}: {exc}")
        return False
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def use_torch_caches(root: Path | str) -> Path:
    """Point torch's on-disk caches at ``root/torch`` unless the user chose a directory; the
    one in use. An environment variable, as every thread sees it (a config assignment is
    thread-local); before the first compile, as dynamo's derived dir does not follow."""
    target = (Path(root) / "torch").absolute()
    with STATE.torch_dirs_lock:
        env_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        current = Path(env_dir).absolute() if env_dir else None
        if current is not None and current != target and not _is_torch_default(str(current)):
            return current
        target.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(target)
        triton = os.environ.get("TRITON_CACHE_DIR")
        if current is not None and triton and Path(triton).absolute().is_relative_to(current):
            # derived from the old dir by a compile that already ran: follow the move
            moved = target / Path(triton).absolute().relative_to(current)
            os.environ["TRITON_CACHE_DIR"] = str(moved)
        if current != target:
            torchcompat.drop_local_cache_path()
    return target


def _is_torch_default(directory: str) -> bool:
    """Whether ``directory`` is torch's default (torch sets the variable to it itself)."""
    default = torchcompat.default_cache_dir()
    if default is None:  # the same rule, without importing torch._inductor (~1.5 s)
        try:
            user = getpass.getuser()
        except (KeyError, ModuleNotFoundError, OSError):
            getuid = getattr(os, "getuid", None)
            user = f"uid_{getuid()}" if callable(getuid) else "unknown_user"
        user = re.sub(r'[\\/:*?"<>|]', "_", user)
        default = os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")
    return Path(directory).absolute() == Path(default).absolute()
