"""Put first on ``PYTHONPATH`` by ``safecompile run``: every Python process of the
command answers ``torch.compile`` with ``safe_compile`` once it imports ``torch``.

It imports neither torch nor safecompile itself (a child that never imports torch pays
nothing): a finder on ``sys.meta_path`` waits for ``import torch`` and, once torch is
loaded, calls :func:`safecompile.runner.install_from_environment`. Then it runs the
``sitecustomize`` it hides (the next one on ``sys.path``), as ``site`` would have.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))


def _package() -> None:
    """The safecompile this file ships with (not another one the path may hold first)."""
    if "safecompile" in sys.modules:
        return
    package = os.path.dirname(_HERE)
    spec = importlib.util.spec_from_file_location(
        "safecompile", os.path.join(package, "__init__.py"), submodule_search_locations=[package]
    )
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["safecompile"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["safecompile"]
        raise


def _install() -> None:
    importing = sys.modules.get("safecompile")
    if getattr(getattr(importing, "__spec__", None), "_initializing", False):
        # torch loaded while safecompile itself imports it: safecompile installs once whole
        importing._run_pending = True  # type: ignore[union-attr]
        return
    try:
        _package()
        from safecompile import runner  # noqa: PLC0415 - only once torch is imported

        runner.install_from_environment()
    except Exception as exc:  # the program runs on, with torch's own torch.compile
        sys.stderr.write(
            f"safecompile run: not installed ({type(exc).__name__}: {exc}); "
            "torch.compile is torch's own in this process\n"
        )


class _Loader(importlib.abc.Loader):
    """torch's own loader, then :func:`_install`."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        made: ModuleType | None = self._inner.create_module(spec)
        return made

    def exec_module(self, module: ModuleType) -> None:
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        module.__loader__ = self._inner
        with contextlib.suppress(ValueError):  # torch is being loaded: no more waiting
            sys.meta_path.remove(_FINDER)
        self._inner.exec_module(module)
        _install()


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds ``torch`` with the other finders and installs once it is loaded (a
    ``find_spec("torch")`` that loads nothing, as libraries probe, leaves it waiting)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch":
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader)
                return spec  # type: ignore[no-any-return]
        return None


def _chain() -> None:
    """Run the ``sitecustomize`` this one hides, if there is one."""
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_FINDER = _AfterTorch()
if "torch" in sys.modules:
    _install()
else:
    sys.meta_path.insert(0, _FINDER)
_chain()
