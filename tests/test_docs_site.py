"""The docs site builds strictly, reads offline, and its reference shows public names only.

Builds the site once (``mkdocs build --strict``, as CI does) into a temporary folder and
reads the HTML. Skipped where MkDocs is not installed (the ``docs`` extra).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs")
pytest.importorskip("material")
pytest.importorskip("mkdocstrings_handlers.python")

ROOT = Path(__file__).resolve().parents[1]
# An element that loads from another host: a script, a stylesheet or a font.
REMOTE = re.compile(r"<(?:script|link)\b[^>]*\b(?:src|href)=\"(?:https?:)?//[^\"]*\"[^>]*>")
# What the reference must not show: private defaults, modules or helpers, a missing file.
PRIVATE = ["_DEFAULT", "safecompile._", "dims_of", "pad_for", "countdown", "next_wait", "API.md"]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built site."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def text_of(page: Path) -> str:
    """A built page's article, as text (tags dropped)."""
    html = page.read_text()
    article = html[html.find("<article") : html.find("</article>")]
    return re.sub(r"<[^>]+>", "", article)


def test_nothing_loads_from_another_host(site: Path) -> None:
    """No page loads a script, stylesheet or font from a CDN: the site reads offline."""
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 20
    remote = {str(p.relative_to(site)): REMOTE.findall(p.read_text()) for p in pages}
    assert {page: found for page, found in remote.items() if found} == {}


def test_mermaid_is_bundled(site: Path) -> None:
    """The state diagram is a Mermaid block drawn by the copy of Mermaid the site ships."""
    concepts = (site / "concepts" / "index.html").read_text()
    assert '<pre class="mermaid"><code>stateDiagram-v2' in concepts
    assert re.search(r'<script src="\.\./js/mermaid\.min\.js"></script>', concepts)
    bundled = (site / "js" / "mermaid.min.js").read_text()
    assert bundled.startswith("/*! mermaid ")
    assert "The MIT License (MIT)" in bundled[:2000]


def test_reference_shows_public_names_only(site: Path) -> None:
    """The API reference names no private default, module or internal helper, and each
    option of safe_compile has a row in a parameter table."""
    pages = sorted((site / "reference").rglob("index.html"))
    assert len(pages) == 4
    for page in pages:
        text = text_of(page)
        assert [name for name in PRIVATE if name in text] == [], page
    reference = text_of(site / "reference" / "index.html")
    assert "shadow: Shadow | None = Shadow()" in reference
    assert "rollback: Rollback = Rollback()" in reference
    table = (site / "reference" / "index.html").read_text()
    for option in ("backend", "buckets", "warmup", "shadow", "rollback", "rollout", "group"):
        assert re.search(rf"<td>\s*<code>{option}</code>\s*</td>", table), option


def test_pages_in_the_nav(site: Path) -> None:
    """The FAQ, the rollout page and the versioned changelog are part of the site."""
    faq = text_of(site / "faq" / "index.html")
    assert "Why is it stuck in" in faq
    assert "Rolling out in production" in text_of(site / "rollout" / "index.html")
    changelog = text_of(site / "changelog" / "index.html")
    assert re.search(r"0\.1\.0 — \d{4}-\d{2}-\d{2}", changelog)
    assert not re.search(r"issues? \d", changelog)
