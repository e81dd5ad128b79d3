"""Instructions per call of the guard's paths, counted by valgrind's callgrind.

Time on a shared machine is noisy; the number of instructions a call executes is not
(to within a few). For ``x + 1`` on 4 elements it counts, per call: plain eager, the bare
``torch.compile``'d function, the guarded function (shadow checks and speed probes off,
as in ``bench/overhead.py``), the guard's compiled function without the guard's frame
(the graph wrapper alone), the guarded function with the kill switch on, and rolled back.

Each variant is counted over N calls and over 2N calls (callgrind's collection turned on
and off around the loop, ``torch._C._valgrind_toggle``); the difference over N is the
per-call count (hash seed fixed, no garbage collection while counting: the same
count to within ~1%), the loop's own ``for`` included (the "loop alone" row: a call to a
function that returns its argument). The script runs itself under valgrind:

    python bench/instructions.py                 # eager backend: ~3.5 min a run here
                                                 # (compiles are slow under valgrind)
    python bench/instructions.py --calls 500     # ~2 min, less steady (guarded - bare
                                                 # read 5,873 once, against 5,087-5,405)

``--backend`` takes another ``torch.compile`` backend; only ``eager`` has been run so far.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from overhead import bare_compile, own_code, tiny  # bench/ is on sys.path as a script

from safecompile import ENV_VAR, Rollback, safe_compile

warnings.filterwarnings("ignore")
torch.set_num_threads(1)

_CHILD = "SAFECOMPILE_BENCH_CALLGRIND_DIR"


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def variants(backend: str, x: torch.Tensor) -> dict[str, Callable[[Any], Any]]:
    bare = bare_compile(own_code(tiny, "bare"), backend)
    guarded = safe_compile(
        own_code(tiny, "guarded"),
        backend=backend,
        shadow=None,
        rollback=Rollback(slower_ratio=None),
        name="bench.guarded",
    )
    killed = safe_compile(own_code(tiny, "killed"), backend=backend, shadow=None)
    rolled = safe_compile(own_code(tiny, "rolled"), backend=backend, shadow=None)
    for _ in range(3):
        bare(x)
        guarded(x)
        rolled(x)
    assert guarded.safecompile.state == "compiled", guarded.safecompile.report()
    rolled.safecompile.rollback()  # no retry_after: eager serves it from now on
    return {
        "loop alone": identity,
        "eager": tiny,
        "bare compiled": bare,
        "guarded": guarded,
        "guard's compiled function, no guard frame": guarded.safecompile._engine.gate.compiled,
        "kill switch on": killed,
        "rolled back": rolled,
    }


def count(fn: Callable[[Any], Any], x: torch.Tensor, calls: int) -> None:
    """One collected stretch of ``calls`` calls, dumped to its own callgrind file (no
    garbage collection inside it: a collection's cost is not a call's)."""
    gc.collect()
    gc.disable()
    torch._C._valgrind_toggle()
    for _ in range(calls):
        fn(x)
    torch._C._valgrind_toggle_and_dump_stats()
    gc.enable()


def child(backend: str, calls: int) -> None:
    x = torch.randn(4)
    order = []
    with torch.no_grad():
        for name, fn in variants(backend, x).items():
            if name == "kill switch on":
                os.environ[ENV_VAR] = "1"
            for n in (calls, 2 * calls):
                count(fn, x, n)
                order.append(name)
            os.environ.pop(ENV_VAR, None)
    Path(os.environ[_CHILD], "order.json").write_text(json.dumps(order))


def totals(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise ValueError(f"no totals in {path}")


def parent(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "cg.out")
        env = dict(os.environ, **{_CHILD: tmp}, TORCHINDUCTOR_COMPILE_THREADS="1")
        env["PYTHONHASHSEED"] = "0"  # the same dict layouts, run after run
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--collect-atstart=no",
                f"--callgrind-out-file={out}",
                sys.executable,
                __file__,
                "--backend",
                args.backend,
                "--calls",
                str(args.calls),
            ],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        order = json.loads(Path(tmp, "order.json").read_text())
        counts = [totals(Path(f"{out}.{i + 1}")) for i in range(len(order))]
    print(
        f"torch {torch.__version__}, backend={args.backend}, x + 1 on 4 elements, no_grad; "
        f"instructions per call ((2N - N) / N, N = {args.calls})\n\n| path | instructions "
        "per call |\n|---|---|"
    )
    for i in range(0, len(order), 2):
        print(f"| {order[i]} | {(counts[i + 1] - counts[i]) / args.calls:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="eager")
    parser.add_argument("--calls", type=int, default=2000, help="N")
    args = parser.parse_args()
    if _CHILD in os.environ:
        child(args.backend, args.calls)
    else:
        parent(args)


if __name__ == "__main__":
    main()
