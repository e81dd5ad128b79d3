"""docs/design.md names every module of the package and what it owns."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_is_in_the_design_table() -> None:
    package = ROOT / "safecompile"
    modules = {
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if p.name != "__init__.py" or p.parent == package
    }
    text = (ROOT / "docs" / "design.md").read_text()
    table = text.split("## Who owns what", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `([\w/]+\.py)` \|", table, flags=re.MULTILINE))
    assert listed == modules
