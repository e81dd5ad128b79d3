"""Exceptions raised by safecompile itself."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """An option given to ``safe_compile`` or to a policy is invalid.

    Raised when the decorator or a policy is built (never on a call), with a message
    that names the option and the values it accepts.
    """

    __module__ = "safecompile"  # shown as safecompile.ConfigError, where users import it
