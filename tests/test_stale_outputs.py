"""Never a crash where torch raises: a CUDA-graph output overwritten by a later replay.

torch frees such an output and marks its storage so that reading its address raises
(``RuntimeError: accessing tensor output of CUDAGraphs that has been overwritten``).
Triton's kernel launcher reads each argument's address with ``data_ptr()`` without
checking for that error, and the process dies in the launch (docs/design.md, "Known
limits"). Under cudagraph options the graph wrapper reads the addresses first, so torch's
error is raised on the guard's path, before any launch. On CPU, :class:`StaleLauncher`
imitates both sides: each run's outputs are new tensors and the previous run's are marked
(their ``data_ptr()`` raises), and its "launch" reads every argument's address, counting
the reads that raised (where Triton's launcher would have crashed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from safecompile import Shadow, State, safe_compile
from safecompile.testing import RecordingBackend
from tests.test_pool_outputs import under_cudagraphs


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class StaleLauncher(RecordingBackend):
    """Outputs of a run go stale at the next run (their ``data_ptr()`` raises, as after a
    CUDA-graph replay); a run first reads its arguments' addresses, like a kernel launch."""

    def __init__(self) -> None:
        super().__init__()
        self.crashes = 0  # launches on a stale argument (a segfault on a GPU)
        self._last: list[torch.Tensor] = []

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        def launch(*args: Any) -> Any:
            for a in args:
                if isinstance(a, torch.Tensor):
                    try:
                        a.data_ptr()
                    except RuntimeError:
                        self.crashes += 1  # Triton's launcher reads NULL here and dies
            out = gm.forward(*args)
            for old in self._last:
                torch._C._set_throw_on_mutable_data_ptr(old)
            self._last = [t for t in out if isinstance(t, torch.Tensor)]
            return out

        return launch


def step(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    return (x + state) * 0.5


def stale_state(call: Callable[..., torch.Tensor]) -> torch.Tensor:
    """Calls that leave the caller holding an output a later run made stale."""
    x, s = torch.ones(4), torch.zeros(4)
    call(x, s)  # a graph's first run (its compiled outputs go unused)
    held = call(x, s)
    call(x, s)  # overwrites what ``held`` points to
    return held


def test_the_imitation_launches_on_a_stale_output_under_plain_torch_compile() -> None:
    backend = StaleLauncher()
    compiled = torch.compile(step, backend=backend)
    held = stale_state(compiled)
    compiled(torch.ones(4), held)
    assert backend.crashes == 1


def test_under_cudagraphs_a_stale_output_is_never_launched_on() -> None:
    """The guard reads the addresses first: torch's error, on the guard's path; eager
    answers (on a GPU, eager's read raises that error too: the caller gets it, as under
    plain torch.compile)."""
    backend = StaleLauncher()
    guarded = safe_compile(
        step, **under_cudagraphs(True, backend), shadow=Shadow(canary=0, every=0)
    )
    held = stale_state(guarded)
    out = guarded(torch.ones(4), held)
    assert backend.crashes == 0
    torch.testing.assert_close(out, (torch.ones(4) + held) * 0.5)
    assert guarded.safecompile.state is State.ROLLED_BACK  # a runtime error: eager from now
    assert guarded.safecompile.stats().last_rollback is not None


def test_without_cudagraph_options_the_graph_runs_unchecked() -> None:
    """Without CUDA graphs no output goes stale: the hot path reads no addresses."""
    backend = StaleLauncher()
    guarded = safe_compile(step, **under_cudagraphs(False, backend), shadow=None)
    held = stale_state(guarded)
    guarded(torch.ones(4), held)
    assert backend.crashes == 1  # the imitation's stale output reached its launch
