"""Regressions found by bench/variable_length.py and bench/cold_start.py."""

from __future__ import annotations

import threading
import time

import torch

from safecompile import Buckets, Warmup, pow2, safe_compile
from safecompile.testing import RecordingBackend


class SlowRecording(RecordingBackend):
    """Records graphs, taking a while per compile, and the threads that compiled them."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.threads: list[int] = []

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list[object]):  # type: ignore[no-untyped-def]
        self.threads.append(threading.get_ident())
        time.sleep(self.seconds)
        return gm.forward


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_background_warmup_under_traffic_compiles_every_bucket_off_the_request_path() -> None:
    """Live calls during a background warmup run eager and never start a compile; the
    warmup compiles every bucket even while traffic arrives, so wait_warm() means warm."""
    backend = SlowRecording(0.05)
    sizes = pow2(16, 128)
    g = safe_compile(
        double,
        backend=backend,
        shadow=None,
        buckets=Buckets(dims={"x": 1}, sizes=sizes),
        warmup=Warmup(inputs=[(torch.randn(2, 20),)], background=True),
    )
    x = torch.randn(2, 100)
    while not g.safecompile.wait_warm(0):
        torch.testing.assert_close(g(x), x * 2)
        time.sleep(0.001)
    assert backend.compiles == len(sizes)
    assert threading.get_ident() not in backend.threads
    g(x)
    assert backend.compiles == len(sizes)
    assert g.safecompile.stats().compiled_calls == 1


def test_dynamic_ranges_leave_the_callers_tensors_unmarked() -> None:
    """mark_dynamic goes on an alias: the caller's tensor reaching another compiled
    function must not make it recompile."""
    g = safe_compile(
        double,
        backend=RecordingBackend(),
        shadow=None,
        buckets=Buckets(dims={"x": 0}, sizes=(1, 32, 128), strategy="dynamic"),
    )
    x = torch.randn(39)
    torch.testing.assert_close(g(x), x * 2)
    assert not hasattr(x, "_dynamo_dynamic_indices")


def test_dynamic_range_first_call_at_the_bucket_size_compiles_the_range() -> None:
    """A range's first call whose length is the bucket size still compiles the bounded
    dynamic graph: later lengths of the range recompile nothing, hidden or not."""
    backend = RecordingBackend()
    g = safe_compile(
        double,
        backend=backend,
        shadow=None,
        buckets=Buckets(dims={"x": 0}, sizes=(1, 32, 128), strategy="dynamic"),
    )
    for n in (32, 20, 7, 31, 128, 100, 64):
        x = torch.randn(n)
        torch.testing.assert_close(g(x), x * 2)
    stats = g.safecompile.stats()
    assert backend.compiles == stats.graphs == 2
