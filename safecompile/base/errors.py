"""Exceptions raised by safecompile itself."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

__all__ = ["ConfigError", "unknown_options"]


class ConfigError(ValueError):
    """An option given to ``safe_compile`` or to a policy is invalid.

    Raised when the decorator or a policy is built (never on a call), with a message
    that names the option and the values it accepts.
    """

    __module__ = "safecompile"  # shown as safecompile.ConfigError, where users import it


def unknown_options(owner: str, given: Iterable[str], known: Sequence[str]) -> ConfigError:
    """The error for options ``owner`` (``"safe_compile()"``, ``"Shadow()"``) does not
    take: each one named, with a did-you-mean for a misspelled one, and the allowed ones."""
    named = []
    for option in sorted(given):
        close = difflib.get_close_matches(option, known, n=1)
        named.append(f"{option} (did you mean {close[0]}?)" if close else option)
    return ConfigError(
        f"{owner} got unknown option(s) {', '.join(named)}; allowed: {', '.join(sorted(known))}"
    )
