"""The Python snippets of the README and of the docs' first pages run as written.

A page's ```` ```python ```` blocks are run in order as one script, as a reader pasting
them one after the other into a session would, in a subprocess from a temporary folder.
Only the backend changes: ``backend="inductor"`` reads ``backend="aot_eager"``, and
``safe_compile``'s default backend is ``aot_eager`` (quick, no C++ compiler); every
other word of the snippets runs as printed.
"""

from __future__ import annotations

import json
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


def run_python(args: list[str], folder: Path) -> subprocess.CompletedProcess[str]:
    """Python run with ``args`` in ``folder`` (its home too), importing this checkout."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=folder,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(folder)},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


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

    done = run_python(["snippets.py"], tmp_path)

    assert done.returncode == 0, f"{page}:\n{done.stderr[-3000:]}"


# ---------------------------------------------------------------- docs/quickstart.md

QUICKSTART = "docs/quickstart.md"
LOOK = "c = score.safecompile\n"  # the first line of the block whose comments show a run
# Appended to the blocks before it: what that block's statements return, as printed.
SHOW = """
import json
import safecompile
c = score.safecompile
print(json.dumps({"state": repr(c.state), "stats": repr(c.stats()), "event": repr(c.events()[0]),
                  "states": [state.value for state in safecompile.State]}))
"""


def comments_under(block: str) -> dict[str, str]:
    """Each statement of a block with the comment lines under it, joined into one line."""
    said: dict[str, str] = {}
    statement = ""
    for line in block.splitlines():
        if line.startswith("#"):
            said[statement] = f"{said.get(statement, '')} {line.lstrip('# ')}".strip()
        else:
            statement = line.split("  #")[0]
    return said


def test_quickstart_comments_show_a_run(tmp_path: Path) -> None:
    """The quickstart's "Look at it" comments show what the page's code returns when run
    as ``app.py``: the state (and every ``State`` listed, in order), and the fields shown
    of ``Stats`` and of the first event, as printed."""
    blocks = python_blocks((ROOT / QUICKSTART).read_text())
    look = next(i for i, block in enumerate(blocks) if block.startswith(LOOK))
    code = "\n".join(blocks[:look]).replace('backend="inductor"', 'backend="aot_eager"')
    (tmp_path / "app.py").write_text(code + SHOW)

    done = run_python(["-c", PRELUDE + "import runpy\nrunpy.run_path('app.py')"], tmp_path)

    assert done.returncode == 0, done.stderr[-3000:]
    ran = json.loads(done.stdout.splitlines()[-1])
    said = comments_under(blocks[look])
    state, _, every = said["c.state"].partition("Every state:")
    assert ran["state"] in state
    assert re.findall(r'"(\w+)"', every) == ran["states"]
    for statement, printed in (("c.stats()", ran["stats"]), ("c.events()", ran["event"])):
        shown = re.findall(r"\w+=[^,)]+", said[statement])
        assert shown, statement
        assert [field for field in shown if field not in printed] == [], printed


# ---------------------------------------------------------------- docs/deploying.md

DEPLOYING = "docs/deploying.md"


def deploying_steps(markdown: str) -> tuple[dict[str, str], list[tuple[str, str | None]]]:
    """The page's files (```` ```python ```` blocks whose first line is ``# NAME.py``) and
    its ```` ```bash ```` blocks, each with the output block printed right after it."""
    files: dict[str, str] = {}
    for body in python_blocks(markdown):
        first, _, rest = body.partition("\n")
        name = re.fullmatch(r"# (\w+\.py)", first)
        if name is not None:
            files[name[1]] = rest
    steps = [
        (found[1], found[2])
        for found in re.finditer(
            r"^```bash\n(.*?)^```\n(?:\s*^```\n(.*?)^```$)?", markdown, re.DOTALL | re.MULTILINE
        )
    ]
    return files, steps


def normalised(line: str, cwd: Path) -> str:
    """A line of output without what differs between runs: keys, sizes, ages, versions,
    the folder it ran in; runs of spaces as one."""
    line = line.replace(str(cwd), "/src")
    for pattern, text in (
        (r"\b[0-9a-f]{12}\b", "KEY"),
        (r"\b\d+(\.\d+)? (B|KB|MB|GB)\b", "SIZE"),
        (r"\b\d+[smhd]\b", "AGE"),
        (r"\b\d+\.\d+\.\d+\S*", "VERSION"),
    ):
        line = re.sub(pattern, text, line)
    return " ".join(line.split())


def test_deploying_commands_run_as_written(tmp_path: Path) -> None:
    """The Deploying page's shell commands run in order as one shell session, in a folder
    holding its ``models.py``, each exits 0, and prints the lines shown after it (keys,
    sizes, ages and versions aside). Only the backend changes, as above."""
    files, steps = deploying_steps((ROOT / DEPLOYING).read_text())
    assert set(files) == {"models.py"}
    assert len(steps) >= 4, "the page's bash blocks were not found"
    for name, text in files.items():
        (tmp_path / name).write_text(text.replace('backend="inductor"', 'backend="aot_eager"'))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for command, argv in (("safecompile", "-m safecompile"), ("python", "")):
        shim = bin_dir / command
        shim.write_text(f'#!/bin/sh\nexec {sys.executable} {argv} "$@"\n')
        shim.chmod(0o755)
    script = ["set -e"]
    for i, (commands, _) in enumerate(steps):
        script += [f"echo '@@step {i}'", commands]
    (tmp_path / "page.sh").write_text("\n".join(script) + "\n")

    done = subprocess.run(
        ["/bin/bash", "page.sh"],
        cwd=tmp_path,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT_S * 2,
        check=False,
    )

    assert done.returncode == 0, f"{DEPLOYING}:\n{done.stdout[-3000:]}"
    printed = re.split(r"^@@step \d+\n", done.stdout, flags=re.MULTILINE)[1:]
    assert len(printed) == len(steps)
    for (commands, shown), out in zip(steps, printed, strict=True):
        lines = {normalised(line, tmp_path) for line in out.splitlines()}
        for line in (shown or "").splitlines():
            assert normalised(line, Path("/src")) in lines, f"{commands}\nprinted:\n{out}"
