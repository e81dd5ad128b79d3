"""Doctor factories for tests/test_doctor.py: each returns what a user's FACTORY would.

Lines that tests look up carry a ``# doctor-test: <what>`` marker; tests find their number
by reading this file, so editing it never breaks them.
"""

from __future__ import annotations

import torch
from torch import nn

from safecompile import safe_compile
from safecompile.doctor import DoctorTarget
from safecompile.testing import (
    DriftingBackend,
    FailingBackend,
    RuntimeFailingBackend,
    SlowBackend,
)


def clean_fn(x: torch.Tensor) -> torch.Tensor:
    """No graph break, nothing odd."""
    return torch.tanh(x @ x.T) * 2 + 1


def breaking_fn(x: torch.Tensor) -> torch.Tensor:
    """One graph break, in the middle."""
    y = torch.sin(x) * 2
    torch._dynamo.graph_break()  # doctor-test: graph-break
    return y + 1


def scaled_fn(x: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Keyword arguments."""
    return torch.relu(x) * scale


def mismatched_fn(x: torch.Tensor) -> torch.Tensor:
    """Fails in eager on the example inputs: the user's own bug."""
    return x @ torch.ones(3, 3)


class Tagger(nn.Module):
    """A sequence model: (batch, seq, dim) features and a (batch, seq) padding mask."""

    def __init__(self, dim: int = 8, dropout: float = 0.0) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.drop(torch.relu(self.proj(x)))
        return h * mask[..., None]


def _seq_inputs(batch: int = 4, seq: int = 16, dim: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, seq, dim), torch.ones(batch, seq, dtype=torch.bool)


def clean() -> object:
    """A pair: the function and a list of two example calls."""
    return clean_fn, [(torch.randn(4, 8),), (torch.randn(6, 8),)]


def one_call() -> object:
    """A pair: the function and one call's tuple of arguments."""
    return clean_fn, (torch.randn(4, 8),)


def breaking() -> object:
    return breaking_fn, (torch.randn(4, 8),)


def fullgraph_break() -> DoctorTarget:
    """fullgraph=True turns the graph break into a compile failure at the break's line."""
    return DoctorTarget(fn=breaking_fn, inputs=[torch.randn(4, 8)], fullgraph=True)


def failing() -> DoctorTarget:
    """The backend raises while compiling."""
    return DoctorTarget(fn=clean_fn, inputs=[torch.randn(4, 8)], backend=FailingBackend())


def runtime_failing() -> DoctorTarget:
    """Compiles, then the compiled code raises where eager does not."""
    return DoctorTarget(fn=clean_fn, inputs=[torch.randn(4, 8)], backend=RuntimeFailingBackend())


def drifting() -> DoctorTarget:
    """Compiled outputs are 1% off."""
    return DoctorTarget(
        fn=clean_fn, inputs=[torch.randn(4, 8)], backend=DriftingBackend(scale=1.01)
    )


def slow() -> DoctorTarget:
    """Compiled calls take 2 ms longer than eager's."""
    return DoctorTarget(fn=clean_fn, inputs=[torch.randn(4, 8)], backend=SlowBackend(delay=0.002))


def keywords() -> DoctorTarget:
    return DoctorTarget(fn=scaled_fn, inputs=[{"x": torch.randn(4, 8), "scale": 2.0}])


def module() -> DoctorTarget:
    """An nn.Module with a batch and a sequence dim."""
    torch.manual_seed(0)
    return DoctorTarget(fn=Tagger().eval(), inputs=[_seq_inputs()])


def training_dropout() -> DoctorTarget:
    """Dropout in training mode: compiled and eager draw different random numbers."""
    return DoctorTarget(fn=Tagger(dropout=0.5).train(), inputs=[_seq_inputs()], sweep=())


def eager_error() -> object:
    return mismatched_fn, (torch.randn(4, 8),)


def not_a_target() -> object:
    return 42


def raises() -> object:
    raise ValueError("no model here")  # doctor-test: factory-raises


NOT_CALLABLE = 3


def guarded_function() -> object:
    """A function the user has guarded already: its name and backend carry over."""
    guarded = safe_compile(clean_fn, backend="eager", name="ranker.score")
    return guarded, (torch.randn(4, 8),)


def guarded_module() -> DoctorTarget:
    """A module guarded in place."""
    model = safe_compile(Tagger().eval(), backend="aot_eager")
    return DoctorTarget(fn=model, inputs=[_seq_inputs()])


def noisy() -> object:
    """A factory that prints, as model loaders do."""
    print("loading the model...")
    return clean_fn, (torch.randn(4, 8),)
