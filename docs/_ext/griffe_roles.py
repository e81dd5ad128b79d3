"""A griffe extension for the docs site: Sphinx roles in docstrings become code spans.

safecompile's docstrings use reStructuredText roles (``:class:`Report```,
``:func:`~safecompile.doctor.judge```) and double backticks. Markdown renders double
backticks as code already; this turns each role into a plain code span holding the name
(``~`` keeps the last dotted part, as Sphinx does), so the generated reference reads
``Report`` instead of ``:class:`Report```. Cross-links are left to the hand-written pages.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|data|mod|exc|obj|const):`(~?)([^`]+)`")


def _plain(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    name = target.rsplit(".", 1)[-1] if tilde else target
    return f"`{name}`"


class SphinxRoles(griffe.Extension):
    """Rewrite ``:role:`target``` to ``target`` in code, in every docstring loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Called for each object griffe loads (module, class, function, attribute)."""
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_plain, obj.docstring.value)
