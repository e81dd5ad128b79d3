"""Zero code: ``safecompile.install()`` in this process, and ``safecompile run`` over real
programs (a spawn child, a subprocess Python, torchrun workers, transformers' generate)."""

from __future__ import annotations

import copy
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

import safecompile
from safecompile import ConfigError, Shadow, runner
from safecompile.base import torchcompat

ROOT = Path(__file__).resolve().parents[1]
TORCH_COMPILE = torch.compile


@pytest.fixture
def installed() -> Iterator[None]:
    safecompile.install(shadow=Shadow(canary=2, every=0))
    try:
        yield
    finally:
        safecompile.uninstall()
    assert torch.compile is TORCH_COMPILE


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


# ------------------------------------------------------------------ options


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "SAFECOMPILE_RUN_OPTIONS is not JSON"),
        ("[1]", "must be a JSON object"),
        ('{"shadwo": null}', "unknown option 'shadwo' (did you mean shadow?)"),
        ('{"shadow": {"canry": 2}}', "Shadow has no field 'canry' (did you mean canary?)"),
        ('{"shadow": 3}', "'shadow' must be an object of Shadow's fields or null"),
        ('{"rollback": null}', "'rollback' cannot be null"),
        ('{"rollout": 2}', "safe_compile(rollout=...) must be a fraction"),
        ('{"shadow": {"canary": -1}}', "SAFECOMPILE_RUN_OPTIONS: "),
    ],
)
def test_bad_options_are_refused_with_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        runner.settings_from(text)
    assert message in str(info.value)


def test_options_from_json() -> None:
    settings = runner.settings_from(
        '{"shadow": {"canary": 3, "every": 0}, "rollback": {"slower_ratio": null}, "rollout": 0.5}'
    )
    assert settings.shadow == Shadow(canary=3, every=0)
    assert settings.rollback.slower_ratio is None
    assert settings.rollout == 0.5
    assert runner.settings_from('{"shadow": null}').shadow is None
    assert runner.settings_from(None) == runner.settings_from("  ") == runner.Settings()


def test_print_config_and_bad_options_on_the_command_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SAFECOMPILE_RUN_OPTIONS", '{"shadow": {"canary": 5}}')
    assert runner.main(["--print-config"]) == 0
    out = capsys.readouterr().out
    assert "shadow: Shadow(canary=5," in out
    assert f"PYTHONPATH: {runner.SITE_DIR}" in out
    assert runner.main(["--options", '{"rolout": 1}', "--", "true"]) == 2
    assert "unknown option 'rolout' (did you mean rollout?)" in capsys.readouterr().err
    assert runner.main([]) == 2
    assert "no command to run" in capsys.readouterr().err
    assert runner.main(["--", "no-such-command-safecompile"]) == 127


def test_python_m_safecompile_run_print_config() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), SAFECOMPILE_RUN_OPTIONS='{"shadow": {"canary": 0')
    done = subprocess.run(
        [sys.executable, "-m", "safecompile", "run", "--print-config"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("safecompile run: error: SAFECOMPILE_RUN_OPTIONS is not JSON")


# ------------------------------------------------------------------ install()


def test_install_and_uninstall_are_idempotent_and_thread_safe() -> None:
    threads = [threading.Thread(target=safecompile.install) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        replacement = torch.compile
        assert replacement is not TORCH_COMPILE
        assert runner.installed()
        safecompile.install(rollout=0.5)  # again: the same replacement, new options
        assert torch.compile is replacement
        assert torchcompat.torch_compile() is TORCH_COMPILE
    finally:
        threads = [threading.Thread(target=safecompile.uninstall) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert torch.compile is TORCH_COMPILE
    assert not runner.installed()
    safecompile.uninstall()
    assert torch.compile is TORCH_COMPILE


def test_install_refuses_bad_options() -> None:
    with pytest.raises(ConfigError, match="rollout"):
        safecompile.install(rollout=3.0)
    assert torch.compile is TORCH_COMPILE


@pytest.mark.usefixtures("installed")
def test_torch_compile_keeps_its_signature_and_the_guard_reaches_torchs() -> None:
    assert inspect.signature(torch.compile) == inspect.signature(TORCH_COMPILE)
    assert torch.compile.__doc__ == TORCH_COMPILE.__doc__
    # the guard's per-function recompile limit reads torch.compile's signature
    assert not isinstance(torchcompat.per_function_limit(8), torchcompat.Missing)


@pytest.mark.usefixtures("installed")
def test_every_calling_form_is_guarded() -> None:
    x = torch.randn(4)
    call = torch.compile(double, backend="eager")

    @torch.compile
    def bare(x: torch.Tensor) -> torch.Tensor:
        return x.sin()

    @torch.compile(backend="aot_eager", dynamic=False)
    def with_arguments(x: torch.Tensor) -> torch.Tensor:
        return x.cos()

    for fn, eager in ((call, double(x)), (with_arguments, x.cos())):
        torch.testing.assert_close(fn(x), eager)
        assert fn.safecompile.stats().compiled_calls == 1
    assert call.safecompile.name == f"{__name__}.double"
    assert bare.safecompile.name.endswith("test_every_calling_form_is_guarded.<locals>.bare")
    assert with_arguments.safecompile.report()["backend"] == "aot_eager"
    assert with_arguments.safecompile.report()["dynamic"] is False
    assert bare.safecompile.report()["backend"] == "inductor"  # torch's default


@pytest.mark.usefixtures("installed")
def test_a_method_in_a_class_body_and_torch_compiler_compile_are_guarded() -> None:
    class Scale(torch.nn.Module):
        @torch.compile(backend="eager")
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 3

    x = torch.randn(3)
    module = Scale()
    torch.testing.assert_close(module(x), x * 3)
    guarded = Scale.forward
    assert guarded.safecompile.name.endswith("<locals>.Scale.forward")
    assert guarded.safecompile.stats().compiled_calls == 1
    through = torch.compiler.compile(double, backend="eager")
    assert through.safecompile.name == f"{__name__}.double"


@pytest.mark.usefixtures("installed")
def test_disable_true_and_torchs_own_options_are_torchs() -> None:
    off = torch.compile(double, disable=True)
    assert not hasattr(off, "safecompile")
    torch.testing.assert_close(off(torch.ones(2)), double(torch.ones(2)))
    # safe_compile refuses both; torch raises its own error, as without the runner
    with (
        structlog.testing.capture_logs() as logs,
        pytest.raises(RuntimeError, match="Either mode or options"),
    ):
        torch.compile(double, mode="default", options={"trace.enabled": False})
    [event] = [e for e in logs if e["event"] == "safecompile.run.unguarded"]
    assert "give one of them, not both" in event["reason"]
    assert event["function"] == f"{__name__}.double"


@pytest.mark.usefixtures("installed")
def test_torchs_own_compiles_are_torchs() -> None:
    """torch runs some operators eagerly through torch.compile (torch.cond, map, flex
    attention): those calls are torch's machinery, not the user's, and stay torch's."""
    x = torch.randn(4)
    with structlog.testing.capture_logs():
        out = torch.cond(x.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (x,))
    torch.testing.assert_close(out, x.sin() if x.sum() > 0 else x.cos())
    assert not any("_cond_op_wrapper" in name for name in runner._PROCESS.names._seen)
    inside: dict[str, Any] = {"__name__": "torch._higher_order_ops.example", "torch": torch}
    exec("compiled = torch.compile(lambda t: t + 1, backend='eager')", inside)
    assert not hasattr(inside["compiled"], "safecompile")


@pytest.mark.usefixtures("installed")
def test_names_are_readable_and_distinct() -> None:
    first = torch.compile(lambda x: x + 1, backend="eager")
    second = torch.compile(lambda x: x + 2, backend="eager")
    assert first.safecompile.name != second.safecompile.name
    assert first.safecompile.name.startswith(f"{__name__}.test_names_are_readable_and_distinct.")
    assert ".<locals>.<lambda>:" in first.safecompile.name

    def make(k: int) -> object:
        def inner(x: torch.Tensor) -> torch.Tensor:
            return x + k

        return inner

    again = [torch.compile(make(k), backend="eager") for k in range(2)]
    names = [g.safecompile.name for g in again]  # type: ignore[attr-defined]
    assert names[0].endswith("make.<locals>.inner")  # one code object: one name
    assert names[1] == names[0]
    named = torch.compile(double, backend="eager", name="my.region")
    assert named.safecompile.name == "my.region"


@pytest.mark.usefixtures("installed")
def test_a_compiled_module_is_torchs_optimized_module_with_a_guarded_forward() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    compiled = torch.compile(model, backend="eager")
    optimized = torch._dynamo.eval_frame.OptimizedModule
    assert isinstance(compiled, optimized)
    assert compiled._orig_mod is model
    assert list(compiled.state_dict()) == [f"_orig_mod.{k}" for k in model.state_dict()]
    assert compiled.safecompile.name == "torch.nn.modules.container.Sequential.forward"
    x = torch.randn(2, 4)
    torch.testing.assert_close(compiled(x), model(x))
    assert compiled.safecompile.stats().compiled_calls == 1
    assert not hasattr(model, "safecompile")  # the module itself stays as it was
    compiled.eval()
    assert not model.training
    twin = copy.deepcopy(compiled)  # compiled again, guarded again
    assert isinstance(twin, optimized)
    assert twin._orig_mod is not model
    torch.testing.assert_close(twin(x), model(x))


@pytest.mark.usefixtures("installed")
def test_module_compile_in_place_is_guarded(monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Linear(4, 2)
    model.compile(backend="eager")
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), torch.nn.functional.linear(x, model.weight, model.bias))
    guarded = model._compiled_call_impl
    assert guarded.safecompile.name == "torch.nn.modules.linear.Linear.forward"
    assert guarded.safecompile.stats().compiled_calls == 1
    assert list(model.state_dict()) == ["weight", "bias"]
    # the kill switch reaches it by that name
    monkeypatch.setenv("SAFECOMPILE_DISABLE", "torch.nn.modules.linear.*")
    model(x)
    assert guarded.safecompile.stats().compiled_calls == 1
    assert guarded.safecompile.stats().eager_calls == 1


# ------------------------------------------------------------------ safecompile run


def _run(
    tmp_path: Path, command: list[str], *, env: dict[str, str] | None = None, timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, PYTHONPATH=str(ROOT))
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "safecompile", "run", "--", *command],
        capture_output=True,
        text=True,
        env=full,
        cwd=tmp_path,
        timeout=timeout,
        check=False,
    )


PROGRAM = """
import importlib.util, json, multiprocessing, subprocess, sys
importlib.util.find_spec("torch")  # a probe first, as libraries do: no import yet
import torch

def child(_):
    import torch
    f = torch.compile(lambda t: t * 3, backend="eager")
    return [f(torch.ones(2)).tolist(), f.safecompile.name, f.safecompile.stats().compiled_calls]

if __name__ == "__main__":
    import sitecustomize
    f = torch.compile(lambda t: t + 1, backend="eager")
    out = {"chained": getattr(sitecustomize, "MARK", None), "main": f(torch.ones(2)).tolist(),
           "main_calls": f.safecompile.stats().compiled_calls}
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        out["spawn"] = pool.apply(child, (0,))
    # safecompile imported first: it imports torch, and installs once it is whole
    code = "import safecompile, torch; print(hasattr(torch.compile, '__safecompile_original__'))"
    out["subprocess"] = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                       text=True).stdout.strip()
    print("RESULT", json.dumps(out))
"""


def test_the_program_and_its_python_children_are_guarded(tmp_path: Path) -> None:
    """The main process, a multiprocessing spawn child and a subprocess Python all answer
    torch.compile with safe_compile; a sitecustomize already on the path still runs; the
    exporters come from OTEL_* (a span per compile on the console)."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("MARK = 'theirs'\n")
    (tmp_path / "app.py").write_text(textwrap.dedent(PROGRAM))
    env = {
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(theirs)]),
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_SERVICE_NAME": "zero-code-test",
    }
    done = _run(tmp_path, [sys.executable, "app.py"], env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    out = json.loads(line.removeprefix("RESULT "))
    assert out["chained"] == "theirs"
    assert out["main"] == [2.0, 2.0]
    assert out["main_calls"] == 1
    values, name, calls = out["spawn"]
    assert values == [3.0, 3.0]
    assert name.startswith("__mp_main__.child.<locals>.<lambda>:")
    assert calls == 1
    assert out["subprocess"] == "True"
    assert '"name": "safecompile.compile"' in done.stdout
    assert "zero-code-test" in done.stdout


TORCHRUN = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
f = torch.compile(lambda x: x * 2, backend="eager")
y = f(torch.full((2,), float(rank + 1)))
dist.all_reduce(y)
print(f"RANK {rank} {f.safecompile.name} {f.safecompile.stats().compiled_calls} {y.tolist()}")
dist.destroy_process_group()
"""


def test_both_torchrun_workers_are_guarded(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(textwrap.dedent(TORCHRUN))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", "train.py"]
    done = _run(tmp_path, command, env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    # the two workers share one stdout: a line of one may land inside the other's
    lines = sorted(re.findall(r"RANK \d [^\]]*\]", done.stdout))
    assert lines == [f"RANK {r} __main__.<lambda>:5 1 [6.0, 6.0]" for r in (0, 1)]


GENERATE = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.generation.configuration_utils import CompileConfig

torch.manual_seed(0)
config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = GPT2LMHeadModel(config).eval()
ids = torch.randint(0, 63, (2, 5), generator=torch.Generator().manual_seed(1))

def generate(**options):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                              do_sample=False, pad_token_id=63, cache_implementation="static",
                              **options)

compile_config = CompileConfig(backend="aot_eager", mode=None)
compile_config._compile_all_devices = True  # compile on CPU too (transformers' test flag)
compiled = generate(compile_config=compile_config)
eager = generate(disable_compile=True)
guard = model._compiled_call.safecompile
stats = guard.stats()
print("SAME", torch.equal(compiled, eager))
print("NAME", guard.name)
print("STATS", stats.compiled_calls, stats.shadow_checks, stats.shadow_breaches, stats.rollbacks)
"""


def test_transformers_generate_with_a_static_cache_is_guarded_and_eagers(tmp_path: Path) -> None:
    """transformers compiles the forward itself (get_compiled_call) for a static cache:
    under the runner that compile is guarded, shadow-checked, and the tokens are eager's."""
    (tmp_path / "gen.py").write_text(textwrap.dedent(GENERATE))
    options = '{"shadow": {"canary": 8, "every": 1}}'
    done = _run(tmp_path, [sys.executable, "gen.py"], env={"SAFECOMPILE_RUN_OPTIONS": options})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert lines["SAME"] == "True"
    assert lines["NAME"] == "transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel.forward"
    compiled_calls, checks, breaches, rollbacks = map(int, lines["STATS"].split())
    assert compiled_calls >= 5
    assert checks >= 5
    assert breaches == rollbacks == 0
