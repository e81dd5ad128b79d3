"""The user's own error (eager raises it too) reads as eager's: raised from their line,
without safecompile's frames and without torch's log of the failed trace."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import safecompile
from safecompile import safe_compile

OURS = str(Path(safecompile.__file__).resolve().parent)
META_LOGGER = "torch._subclasses.fake_tensor"


def bad_matmul(x: torch.Tensor) -> torch.Tensor:
    return x @ torch.ones(3, 3)  # the user's shape bug: eager raises it too


class BadModule(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.ones(3, 3)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def meta_failures(self) -> list[str]:
        return [r.getMessage() for r in self.records if "failed while attempting" in r.getMessage()]


@pytest.fixture
def meta_log() -> Iterator[_Records]:
    """What torch's fake-tensor logger emits (its own handler, as torch's stderr one)."""
    handler = _Records()
    logger = logging.getLogger(META_LOGGER)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def _frames(exc: BaseException) -> list[traceback.FrameSummary]:
    return list(traceback.extract_tb(exc.__traceback__))


def _raised(call: Any, x: torch.Tensor) -> BaseException:
    with pytest.raises(RuntimeError) as caught:
        call(x)
    return caught.value


@pytest.mark.parametrize("make", [lambda: bad_matmul, BadModule], ids=["function", "module"])
def test_eagers_error_carries_at_most_one_of_our_frames(make: Any) -> None:
    """The formatted traceback runs from the caller to the user's own line, with at most
    one safecompile entry frame in between, on the first call (compile) and later ones."""
    guarded = safe_compile(make(), backend="eager", shadow=None)
    x = torch.ones(2, 2)
    expected = str(_raised(make(), x))
    for _ in range(3):
        error = _raised(guarded, x)
        assert str(error) == expected
        frames = _frames(error)
        ours = [f for f in frames if str(Path(f.filename).resolve()).startswith(OURS)]
        assert len(ours) <= 1, traceback.format_exception(error)
        assert frames[-1].name in {"bad_matmul", "forward"}
        assert "torch.ones(3, 3)" in str(frames[-1].line)
        assert error.__cause__ is None
        assert "torch._dynamo" not in "".join(traceback.format_exception(error))


def test_torchs_meta_error_log_is_silent_for_the_users_own_error(meta_log: _Records) -> None:
    """torch logs ``failed while attempting to run meta`` (with a traceback) while tracing
    the user's bug; inside a guarded call that log is held and dropped, since eager's error
    (raised to the caller) says the same."""
    guarded = safe_compile(bad_matmul, backend="eager", shadow=None)
    for _ in range(2):
        _raised(guarded, torch.ones(2, 2))
    assert meta_log.meta_failures() == []


def test_torchs_meta_error_log_is_untouched_outside_a_guard(meta_log: _Records) -> None:
    """The control: the same bug under plain torch.compile logs as torch decides."""
    torch._dynamo.reset()
    compiled = torch.compile(bad_matmul, backend="eager")
    with pytest.raises(RuntimeError):
        compiled(torch.ones(2, 2))
    assert meta_log.meta_failures()


def test_a_meta_error_log_of_the_compilers_own_failure_is_handed_on(
    meta_log: _Records,
) -> None:
    """When eager succeeds the failure was the compiler's: what torch logged about it
    inside the guarded call reaches the handlers after all."""

    def failing(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        logging.getLogger(META_LOGGER).error("failed while attempting to run meta for aten.x")
        raise RuntimeError("backend broke")

    def fine(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    guarded = safe_compile(fine, backend=failing, shadow=None)
    torch.testing.assert_close(guarded(torch.ones(2)), torch.ones(2) + 1)
    assert meta_log.meta_failures() == ["failed while attempting to run meta for aten.x"]


_RANKED = """
import sys, traceback, datetime
import torch, torch.distributed as dist
from safecompile import safe_compile
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))
def bad(x):
    return x @ torch.ones(3, 3)
guarded = safe_compile(bad, backend="eager", shadow=None, group=True)
for _ in range(2):
    try:
        guarded(torch.ones(2, 2))
    except RuntimeError as exc:
        frames = traceback.extract_tb(exc.__traceback__)
        print(sum("/safecompile/" in f.filename for f in frames), frames[-1].name)
"""


def test_with_a_process_group_eagers_error_carries_one_of_our_frames(tmp_path: Path) -> None:
    """The ranks' call counter in front of the guard adds no frame to the user's error."""
    done = subprocess.run(
        [sys.executable, "-c", _RANKED, str(tmp_path / "init")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["1 bad", "1 bad"], done.stdout
