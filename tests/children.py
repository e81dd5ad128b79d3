"""Running a guarded script in a fresh process, as a restart or a replica would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def child_env(
    cache: Path, *, drop: str = "TORCHINDUCTOR_CACHE_DIR", **extra: str
) -> dict[str, str]:
    """This process's environment for a child with its own ``SAFECOMPILE_CACHE_DIR``;
    variables starting with ``drop`` left out (torch's own cache: the child uses ours)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["SAFECOMPILE_CACHE_DIR"] = str(cache)
    env.update(extra)
    return env


def run_json(script: str, env: dict[str, str], *, timeout: float | None = 600) -> dict[str, Any]:
    """Run ``python -c script``; it must succeed, and its last stdout line is JSON."""
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
