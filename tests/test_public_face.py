"""``wrapped.safecompile`` shows what the docs document, and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from safecompile import safe_compile

# API.md §2 and §2b, plus wait_warm (docs/reference/controller.md, the readiness probes)
DOCUMENTED = {
    "name",
    "state",
    "stats",
    "events",
    "warmup",
    "wait_warm",
    "rollback",
    "reset",
    "report",
    "sync",
}
REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "controller.md"


def _public(obj: object) -> set[str]:
    return {name for name in dir(obj) if not name.startswith("_")}


def _reference_members() -> set[str]:
    """The members the API reference page renders for the controller."""
    text = REFERENCE.read_text()
    block = text.split("::: safecompile.guard._controller.Controller", 1)[1].split(":::", 1)[0]
    listed = block.split("members:", 1)[1]
    return set(re.findall(r"^\s+- (\w+)\s*$", listed, flags=re.MULTILINE))


def test_a_guarded_function_shows_the_documented_names_only() -> None:
    fn = safe_compile(lambda x: x + 1, backend="eager", name="face.fn")
    assert _public(fn.safecompile) == DOCUMENTED


def test_a_guarded_module_shows_the_documented_names_only() -> None:
    model = safe_compile(torch.nn.Linear(2, 2), backend="eager", name="face.module")
    assert _public(model.safecompile) == DOCUMENTED


def test_the_api_reference_renders_exactly_the_public_names() -> None:
    assert _reference_members() == DOCUMENTED


# The package's names (API.md): the decorator, its policies and records, the kill switch,
# telemetry's configure, and the runner's in-code install()/uninstall().
EXPORTED = {
    "ENV_VAR",
    "Buckets",
    "ConfigError",
    "Event",
    "EventKind",
    "Guarded",
    "IgnoreWhere",
    "Reason",
    "Rollback",
    "Shadow",
    "State",
    "Stats",
    "Warmup",
    "__version__",
    "configure",
    "disable",
    "enable",
    "ignore_where",
    "install",
    "pow2",
    "safe_compile",
    "steps",
    "uninstall",
}


def test_the_package_exports_exactly_the_documented_names() -> None:
    import safecompile

    assert set(safecompile.__all__) == EXPORTED
    assert all(hasattr(safecompile, name) for name in EXPORTED)
