"""The docs site stays readable in one sitting: word limits per page and for the whole site.

Counts the words of every Markdown page under ``docs/`` (the changelog, which includes
``CHANGELOG.md``, and the API reference, which mkdocstrings builds from docstrings, aside).
``design.md`` is the maintainers' map of the code and may run longer than a user's page.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
SITE_LIMIT = 25_000
PAGE_LIMIT = 3_000
LONGER = {"design.md": 5_000}
BENCHMARKS_LIMIT = 1_500
LEFT_OUT = {"changelog.md"}


def words(page: Path) -> int:
    """Words as a reader meets them: prose, tables and code blocks alike."""
    return len(re.findall(r"\S+", page.read_text()))


def pages() -> list[Path]:
    """The pages the limits apply to."""
    found = sorted(DOCS.glob("*.md"))
    assert len(found) > 10, DOCS
    return [p for p in found if p.name not in LEFT_OUT]


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_no_page_over_its_limit(page: Path) -> None:
    """No user page over 3,000 words; benchmarks.md under 1,500."""
    limit = BENCHMARKS_LIMIT if page.name == "benchmarks.md" else LONGER.get(page.name, PAGE_LIMIT)
    assert words(page) <= limit, f"{page.name}: {words(page)} words, limit {limit}"


def test_the_whole_site_under_its_limit() -> None:
    """The site, every page together, under 25,000 words."""
    counts = {p.name: words(p) for p in pages()}
    assert sum(counts.values()) <= SITE_LIMIT, sorted(counts.items(), key=lambda kv: -kv[1])


def test_user_pages_carry_no_lab_notes() -> None:
    """No commit hashes or issue numbers in a user page: they belong in the changelog."""
    lab = re.compile(r"\bissue #?\d+\b|(?<![\w/.-])[0-9a-f]{7}(?![\w-])", re.IGNORECASE)
    found = {p.name: lab.findall(p.read_text()) for p in pages()}
    assert {name: hits for name, hits in found.items() if hits} == {}
