"""Regressions found by bench/variable_length.py and bench/cold_start.py."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import torch

from safecompile import Buckets, Warmup, pow2, safe_compile
from safecompile.testing import RecordingBackend


class GatedRecording(RecordingBackend):
    """Records graphs and the threads that compiled them; every compile waits for ``go``."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []
        self.entered = threading.Event()
        self.go = threading.Event()

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list[object]):  # type: ignore[no-untyped-def]
        self.threads.append(threading.get_ident())
        self.entered.set()
        if not self.go.wait(20):
            raise TimeoutError("the test never let the compile finish")
        return gm.forward


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_background_warmup_under_traffic_compiles_every_bucket_off_the_request_path() -> None:
    """Live calls during a background warmup run eager and never start a compile; the
    warmup compiles every bucket even while traffic arrives, so wait_warm() means warm.

    The warmup's first compile is held until the traffic has been served, so the traffic
    really arrives while the warmup is in flight.
    """
    backend = GatedRecording()
    sizes = pow2(16, 128)
    g = safe_compile(
        double,
        backend=backend,
        shadow=None,
        buckets=Buckets(dims={"x": 1}, sizes=sizes, strategy="pad"),  # a graph per size
        warmup=Warmup(inputs=[(torch.randn(2, 20),)], background=True),
    )
    assert backend.entered.wait(60)  # the warmup is compiling its first bucket, held there
    x = torch.randn(2, 100)
    for _ in range(5):
        torch.testing.assert_close(g(x), x * 2)
    assert not g.safecompile.wait_warm(0)  # the traffic arrived during the warmup
    assert backend.compiles == 1  # the held compile only: live calls started none
    assert g.safecompile.stats().eager_calls == 5
    backend.go.set()
    assert g.safecompile.wait_warm(60)
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


EXIT_AFTER_WARMUP = """
import torch
from safecompile import Buckets, Warmup, pow2, safe_compile

def score(x):
    return x.tanh().sum(-1)

guarded = safe_compile(
    score,
    backend="aot_eager",
    buckets=Buckets(dims={"x": 1}, sizes=pow2(16, 64)),
    warmup=Warmup(inputs=[(torch.randn(2, 16),)], background=True),
)
assert guarded.safecompile.wait_warm(timeout=60)
"""


def test_the_process_exits_cleanly_right_after_a_background_warmup(tmp_path: Path) -> None:
    """A script that ends as soon as its background warmup is done exits with 0: the
    warmup thread is joined at exit instead of being torn down inside torch, which
    aborted the process ("terminate called without an active exception")."""
    (tmp_path / "script.py").write_text(EXIT_AFTER_WARMUP)
    for _ in range(2):  # the abort depended on timing: it came most of the time
        done = subprocess.run(
            [sys.executable, "script.py"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert (done.returncode, done.stderr) == (0, "")
