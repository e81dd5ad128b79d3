"""The Python snippets of the README and of the docs' first pages run as written.

A page's ```` ```python ```` blocks are run in order as one script, as a reader pasting
them one after the other into a session would, in a subprocess from a temporary folder.
Only the backend changes: ``backend="inductor"`` reads ``backend="aot_eager"``, and
``safe_compile``'s default backend is ``aot_eager`` (quick, no C++ compiler); every
other word of the snippets runs as printed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    "README.md",
    "docs/index.md",
    "docs/quickstart.md",
    "docs/faq.md",
    "docs/rollout.md",
    "docs/testing.md",
    "docs/troubleshooting.md",
    "docs/declared-comparisons.md",
]
TIMEOUT_S = 180  # each page takes seconds; the bound only stops a hang

# Run before the snippets: safe_compile as imported from safecompile defaults to aot_eager.
PRELUDE = """\
import functools
import safecompile
safecompile.safe_compile = functools.partial(safecompile.safe_compile, backend="aot_eager")
"""


def python_blocks(markdown: str) -> list[str]:
    """The bodies of the ```` ```python ```` fenced blocks, in order."""
    return re.findall(r"^```python\n(.*?)^```$", markdown, re.DOTALL | re.MULTILINE)


def test_python_blocks_are_found() -> None:
    """The extraction finds fenced python blocks and nothing else."""
    page = "text\n```python\na = 1\n```\n```bash\nls\n```\n```python\nb = a\n```\n"
    assert python_blocks(page) == ["a = 1\n", "b = a\n"]


@pytest.mark.parametrize("page", PAGES)
def test_snippets_run_as_written(page: str, tmp_path: Path) -> None:
    """Every python block of the page runs, in order, without an error."""
    blocks = python_blocks((ROOT / page).read_text())
    assert blocks, f"{page} has no python block"
    script = PRELUDE + "\n".join(blocks).replace('backend="inductor"', 'backend="aot_eager"')
    (tmp_path / "snippets.py").write_text(script)

    done = subprocess.run(
        [sys.executable, "snippets.py"],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )

    assert done.returncode == 0, f"{page}:\n{done.stderr[-3000:]}"
