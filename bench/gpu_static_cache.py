"""On a CUDA GPU: a transformers StaticCache ``generate()`` under CUDA graphs, case by case.

The table under "On a GPU" in docs/benchmarks.md: tiny GPT-2 (tests/zoo.py, random
weights) generating 8 tokens with ``cache_implementation="static"``, compiled six ways.
Each case runs in a process of its own (one that crashes the interpreter is reported as
such) and its tokens are compared with eager's:

    python bench/gpu_static_cache.py            # every case, ~1 min each on one H200
    python bench/gpu_static_cache.py safe-nested  # one case, in this process

Cases: ``hf-auto`` (transformers compiles ``forward`` itself), ``plain-ro`` and
``plain-ro-nested`` (``torch.compile(forward, mode="reduce-overhead")``, transformers'
compile off / on), ``safe-nocompile`` and ``safe-nested`` (``safe_compile`` with
``mode="reduce-overhead"``, transformers' compile off / on), ``safe-noshadow`` (the same
as ``safe-nocompile`` with shadow checks off: whether the checks' eager runs and state
copies matter), ``safe-default-nested`` (``safe_compile`` in inductor's default mode,
transformers' compile on). A case that crashes prints the innermost Python frames
``faulthandler`` saw (where the launch was made from).
"""

from __future__ import annotations

import copy
import faulthandler
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CASES = (
    "hf-auto",
    "plain-ro",
    "safe-nocompile",
    "safe-noshadow",
    "plain-ro-nested",
    "safe-default-nested",
    "safe-nested",
)
TIMEOUT_S = 120


def run_case(case: str) -> None:
    faulthandler.enable()
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    import torch
    import zoo

    from safecompile import Shadow, safe_compile

    model = zoo.gpt2(dropout=0.0).module.to("cuda")
    reference = copy.deepcopy(model)
    _, kwargs = zoo.text_inputs(2, 6, mask=False)
    ids = kwargs["input_ids"].to("cuda")

    def generate(module: Any, **options: Any) -> torch.Tensor:
        with torch.no_grad():
            out: torch.Tensor = module.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=8,
                do_sample=False,
                pad_token_id=zoo.VOCAB - 1,
                cache_implementation="static",
                **options,
            )
        return out

    hf_off = {"disable_compile": True}
    shadow = Shadow(canary=8, every=64)
    if case == "hf-auto":
        out = generate(model)
    elif case in ("plain-ro", "plain-ro-nested"):
        model.forward = torch.compile(model.forward, mode="reduce-overhead")
        out = generate(model, **(hf_off if case == "plain-ro" else {}))
    elif case in ("safe-nocompile", "safe-nested", "safe-noshadow"):
        checks = None if case == "safe-noshadow" else shadow
        guarded = safe_compile(model, backend="inductor", mode="reduce-overhead", shadow=checks)
        out = generate(guarded, **(hf_off if case != "safe-nested" else {}))
    elif case == "safe-default-nested":
        out = generate(safe_compile(model, backend="inductor", shadow=shadow))
    else:
        raise SystemExit(f"unknown case {case!r}: one of {', '.join(CASES)}")
    torch.testing.assert_close(out, generate(reference, **hf_off))
    print(f"{case}: tokens equal eager's")


def main() -> None:
    if len(sys.argv) > 1:
        run_case(sys.argv[1])
        return
    for case in CASES:
        try:
            done = subprocess.run(
                [sys.executable, __file__, case],
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            print(f"{case:22} TIMED OUT after {TIMEOUT_S} s")
            continue
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        if done.returncode == 0:
            verdict = "ok"
        elif done.returncode < 0:
            verdict = f"CRASHED (signal {-done.returncode})"
        else:
            verdict = f"FAILED (exit {done.returncode})"
        errors = [line for line in lines if "Error" in line and not line.startswith(" ")]
        print(f"{case:22} {verdict}: {(errors or lines or [''])[-1][:200]}")
        if done.returncode < 0:  # faulthandler's stack, innermost frame first
            frames = [line.strip() for line in lines if line.strip().startswith("File ")]
            for frame in frames[:6]:
                print(f"{'':24}{frame[:160]}")


if __name__ == "__main__":
    main()
