"""Zero code: a program written against plain ``torch.compile``, guarded without an edit.

    python -m safecompile run -- python examples/zero_code.py   # every torch.compile guarded
    python examples/zero_code.py                                 # the same program, torch alone

Nothing below imports safecompile. Under ``safecompile run`` each ``torch.compile`` (here
a module wrapped, a module compiled in place, and a function) is answered by
``safe_compile``: shadow-checked against eager, rolled back to eager on failure or drift,
named after the compiled code for the kill switch (``SAFECOMPILE_DISABLE``) and telemetry.

``calibrate`` stands for library code that differs under tracing on purpose (it branches
on ``torch.compiler.is_compiling()``): torch alone returns the traced value; under the
runner the first shadow check sees the difference, the caller gets eager's value, and the
function rolls back (``drift``). Options: ``SAFECOMPILE_RUN_OPTIONS`` (see
``python -m safecompile run --help``).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from _common import add_backend_option


class Scorer(torch.nn.Module):
    """A toy two-layer scorer."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(16, 32)
        self.out = torch.nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


def calibrate(x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():  # differs from eager on purpose
        return x * 1.01
    return x


def describe(what: str, compiled: Any) -> None:
    guard = getattr(compiled, "safecompile", None)
    if guard is None:
        print(f"{what}: torch.compile's own (not under safecompile run)")
        return
    stats = guard.stats()
    print(
        f"{what}: guarded as {guard.name}: state={guard.state.value} "
        f"compiled={stats.compiled_calls} eager={stats.eager_calls} "
        f"shadow_checks={stats.shadow_checks} rollbacks={stats.rollbacks}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_backend_option(parser, "aot_eager")
    backend = parser.parse_args().backend
    torch.manual_seed(0)
    model = Scorer().eval()
    wrapped = torch.compile(model, backend=backend)  # torch's OptimizedModule either way
    in_place = Scorer().eval()
    in_place.compile(backend=backend)
    fixed = torch.compile(calibrate, backend=backend)
    x = torch.randn(8, 16)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(wrapped(x), model(x))
            in_place(x)
        calibrated = fixed(x)
    print(f"backend={backend}; state_dict keys: {', '.join(list(wrapped.state_dict())[:2])}")
    print(f"calibrate returned eager's value: {torch.equal(calibrated, x)}")
    describe("torch.compile(model)", wrapped)
    describe("model.compile()", in_place._compiled_call_impl)
    describe("torch.compile(calibrate)", fixed)


if __name__ == "__main__":
    main()
