"""safecompile: make ``torch.compile`` safe to switch on in production.

One line, ``@safe_compile``, on a function, a method or an ``nn.Module``: compile with
warmup, bound recompiles with shape buckets, shadow-check compiled outputs against eager,
and roll back to eager automatically when anything goes wrong.
"""

from __future__ import annotations

from ._version import __version__
from .base.errors import ConfigError
from .base.killswitch import ENV_VAR, disable, enable
from .base.model import Event, EventKind, Reason, State, Stats
from .base.policies import Buckets, IgnoreWhere, Rollback, Shadow, Warmup, ignore_where, pow2, steps
from .compose import safe_compile
from .guard.decorator import Guarded
from .observe.telemetry import configure
from .runner import install, uninstall

if globals().pop("_run_pending", False):  # safecompile run: torch loaded while we imported it
    from .runner import install_from_environment

    install_from_environment()

__all__ = [
    "ENV_VAR",
    "Buckets",
    "ConfigError",
    "Event",
    "EventKind",
    "Guarded",
    "IgnoreWhere",
    "Reason",
    "Rollback",
    "Shadow",
    "State",
    "Stats",
    "Warmup",
    "__version__",
    "configure",
    "disable",
    "enable",
    "ignore_where",
    "install",
    "pow2",
    "safe_compile",
    "steps",
    "uninstall",
]
