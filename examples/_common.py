"""What the examples share (quickstart.py excepted, which is one file): the backend they
compile with, and one line per guarded callable.

Every example takes ``--backend``; its default is ``$SAFECOMPILE_EXAMPLE_BACKEND`` when set
(CI sets ``aot_eager``: quick, no C++ compiler), else the example's own default. The
examples run as scripts (``python examples/x.py``), so this module is imported as
``_common`` from the folder they live in.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any, TextIO

BACKEND_ENV_VAR = "SAFECOMPILE_EXAMPLE_BACKEND"


@contextlib.contextmanager
def needs_extra(extra: str) -> Iterator[None]:
    """Around an example's optional imports: a missing package ends the example with one
    line naming the extra that installs it, not an import traceback."""
    try:
        yield
    except ModuleNotFoundError as exc:
        raise SystemExit(f"{exc.name} is not installed: pip install -e '.[{extra}]'") from None


def example_backend(default: str) -> str:
    """``$SAFECOMPILE_EXAMPLE_BACKEND`` when set, else ``default``."""
    return os.environ.get(BACKEND_ENV_VAR) or default


def add_backend_option(parser: argparse.ArgumentParser, default: str) -> None:
    """``--backend NAME``, defaulting to :func:`example_backend`."""
    parser.add_argument(
        "--backend",
        default=example_backend(default),
        help=f"torch.compile backend (default: ${BACKEND_ENV_VAR}, else {default})",
    )


def log_events(stream: TextIO, prefix: str = "") -> None:
    """Print safecompile's log events (one per state change), one readable line each.

    safecompile is silent unless the application configures logging; this is the
    application's choice: the standard library at INFO, whose message is safecompile's
    one-line summary (the structured fields ride along as the record's attributes).
    """
    logging.basicConfig(level=logging.INFO, stream=stream, format=f"{prefix}%(message)s")


def summary(guarded: Any) -> str:
    """One line on a guarded callable: its name, state and call counts."""
    controller = guarded.safecompile if hasattr(guarded, "safecompile") else guarded
    stats = controller.stats()
    return (
        f"{controller.name}: state={controller.state.value} calls={stats.calls} "
        f"compiled={stats.compiled_calls} eager={stats.eager_calls} "
        f"graph_breaks={stats.graph_breaks} shadow_checks={stats.shadow_checks} "
        f"rollbacks={stats.rollbacks}"
    )
