"""A restart never serves a precompiled function built from code that has since changed.

Three processes share one ``SAFECOMPILE_CACHE_DIR`` (with the tests' key): the first saves
a precompiled function for each guarded model, the code is edited between the first and
the second, and the third starts on what the second saved. Each model reaches a helper
module of its own in one way (a module attribute, a ``from`` import, ...), so one edit
per model is checked in one pair of processes. "Without tracing" is dynamo's own count of
frames it converted around the model's guard and first calls, as in test_precompile.py.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
from children import child_env, run_json

from safecompile.base import torchcompat
from safecompile.persist.cache import code_fingerprint
from safecompile.persist.sources import code_record, stale_reasons

REPO = Path(__file__).resolve().parents[1]
needs_precompile = pytest.mark.skipif(
    not torchcompat.compiled_function_loader(),
    reason="this torch cannot precompile (torchcompat.compiled_function_loader is Missing)",
)

# Each reach form: its helper module (before, after the edit) and how the model calls it.
FORMS: dict[str, tuple[str, str, str]] = {
    "attr": ("def act(x):\n    return x * 2\n", "def act(x):\n    return x * 3\n", "h.act(x)"),
    "from": ("def act(x):\n    return x * 2\n", "def act(x):\n    return x * 3\n", "from_act(x)"),
    "method": (
        "class Other:\n    def method(self, x):\n        return x * 2\nOTHER = Other()\n",
        "class Other:\n    def method(self, x):\n        return x * 3\nOTHER = Other()\n",
        "h.OTHER.method(x)",
    ),
    "dict": (
        "def act(x):\n    return x * 2\nOPS = {'act': act}\n",
        "def act(x):\n    return x * 3\nOPS = {'act': act}\n",
        "h.OPS['act'](x)",
    ),
    "list": (
        "def act(x):\n    return x * 2\nFNS = [act]\n",
        "def act(x):\n    return x * 3\nFNS = [act]\n",
        "h.FNS[0](x)",
    ),
    "partial": (
        "import functools\ndef act(x, k):\n    return x * k\nP = functools.partial(act, k=2)\n",
        "import functools\ndef act(x, k):\n    return x * k + 1\nP = functools.partial(act, k=2)\n",
        "h.P(x)",
    ),
    "decorated": (
        "import functools\n"
        "def deco(f):\n    @functools.wraps(f)\n    def wrapper(x):\n        return f(x) + 1\n"
        "    return wrapper\n"
        "@deco\ndef act(x):\n    return x * 2\n",
        "import functools\n"
        "def deco(f):\n    @functools.wraps(f)\n    def wrapper(x):\n        return f(x) + 1\n"
        "    return wrapper\n"
        "@deco\ndef act(x):\n    return x * 3\n",
        "h.act(x)",
    ),
    "global": (
        "SCALE = 2.0\ndef act(x):\n    return x * SCALE\n",
        "SCALE = 3.0\ndef act(x):\n    return x * SCALE\n",
        "h.act(x)",
    ),
    # reached by a name the model's code does not hold: only the load-time check sees it
    "getattr": (
        "def act(x):\n    return x * 2\n",
        "def act(x):\n    return x * 3\n",
        "getattr(h, 'a' + 'ct')(x)",
    ),
    # shows only on large inputs: under the default Shadow(), small calls pass the canary
    "clamp": (
        "import torch\ndef act(x):\n    return torch.clamp(x, max=1000.0) + 1\n",
        "import torch\ndef act(x):\n    return torch.clamp(x, max=200.0) + 1\n",
        "h.act(x)",
    ),
    # a value in a closure, set where the function is made
    "closure": (
        "def make(k):\n    def f(x):\n        return x * k\n    return f\nact = make(2)\n",
        "def make(k):\n    def f(x):\n        return x * k\n    return f\nact = make(3)\n",
        "h.act(x)",
    ),
    "unchanged": ("def act(x):\n    return x * 2\n", "def act(x):\n    return x * 2\n", "h.act(x)"),
    # lines above it, its own text the same: still current
    "moved": (
        "def act(x):\n    return x * 2\n",
        "# moved\n\ndef act(x):\n    return x * 2\n",
        "h.act(x)",
    ),
}
CHANGED = {  # what the stale event names, for each form
    "attr": "act changed",
    "from": "act changed",
    "method": "Other.method changed",
    "dict": "act changed",
    "list": "act changed",
    "partial": "act changed",
    "decorated": "act changed",
    "global": "SCALE: was 2.0, now 3.0",
    "getattr": "act changed",
    "clamp": "act changed",
    "closure": "cell_contents: was 2, now 3",
}

CHILD = """
import json, sys, warnings
warnings.filterwarnings("ignore")
sys.path[:0] = [{here!r}, {repo!r}]
import torch
from structlog.testing import capture_logs
from torch._dynamo.utils import counters
from safecompile import Shadow, Warmup, safe_compile
import models

X = torch.ones(8)
BIG = torch.full((8,), 1000.0)
out = {{}}
for form in {forms!r}:
    model = getattr(models, "m_" + form)
    shadow = Shadow() if form == "clamp" else None
    before = counters["frames"]["total"]
    with capture_logs() as logs:
        g = safe_compile(model, backend="aot_eager", shadow=shadow, warmup=Warmup(inputs=[(X,)]))
        calls = [X] * (20 if form == "clamp" else 1) + ([BIG] if form == "clamp" else [])
        served = [g(x) for x in calls]
    events = [e for e in logs if e["event"] == "safecompile.precompiled"]
    out[form] = {{
        "traced": counters["frames"]["total"] > before,
        "eager": all(torch.equal(s, model(x)) for s, x in zip(served, calls)),
        "outcomes": [e["outcome"] for e in events],
        "reasons": [e.get("reason", "") for e in events],
        "state": g.safecompile.state.value,
    }}
print(json.dumps(out))
"""


def write_code(code: Path, edited: bool) -> None:
    lines = ["import torch"]
    for form, (before, after, call) in FORMS.items():
        (code / f"h_{form}.py").write_text(after if edited else before)
        lines.append(f"import h_{form}")
        if form == "from":
            lines.append("from h_from import act as from_act")
        reach = call.replace("h.", f"h_{form}.").replace("(h,", f"(h_{form},")
        lines.append(f"def m_{form}(x):\n    return {reach} + 1\n")
    (code / "models.py").write_text("\n".join(lines) + "\n")


def run(code: Path, cache: Path) -> dict[str, Any]:
    script = CHILD.format(here=str(code), repo=str(REPO), forms=list(FORMS))
    # an edit within the same second: no stale .pyc
    return run_json(script, child_env(cache, PYTHONDONTWRITEBYTECODE="1"))


@needs_precompile
def test_an_edit_in_any_reached_code_is_never_served_after_a_restart(tmp_path: Path) -> None:
    """Every reach form's edit is traced afresh and named; an unchanged model still loads
    without tracing; what the restart saved is loaded by the next one."""
    code, cache = tmp_path / "code", tmp_path / "cache"
    code.mkdir()
    write_code(code, edited=False)
    first = run(code, cache)
    assert all(first[form]["traced"] and first[form]["eager"] for form in FORMS), first

    write_code(code, edited=True)
    second = run(code, cache)
    for form, expected in CHANGED.items():
        seen = second[form]
        assert seen["eager"], (form, seen)  # the new code's results, the large input's too
        assert seen["traced"], (form, seen)
        assert seen["outcomes"][0] == "stale", (form, seen)
        assert expected in seen["reasons"][0], (form, seen)
        assert f"h_{form}.py" in seen["reasons"][0] or form in ("global", "closure"), seen
    assert second["clamp"]["state"] == "compiled"  # the fresh trace passed its checks
    for form in ("unchanged", "moved"):
        assert (second[form]["traced"], second[form]["outcomes"]) == (False, ["loaded"]), form

    third = run(code, cache)  # what the second process saved, loaded
    for form in FORMS:
        assert (third[form]["traced"], third[form]["outcomes"]) == (False, ["loaded"]), form
        assert third[form]["eager"], form


def test_a_record_without_sources_or_of_a_missing_function_is_stale(tmp_path: Path) -> None:
    """An entry saved before records were kept, or whose function is gone, is not current."""
    assert stale_reasons({"file": "x.bin"}) == ["saved without a record of the code it came from"]
    module = tmp_path / "gone_helpers.py"
    module.write_text("def act(x):\n    return x * 2\n")
    sys.path.insert(0, str(tmp_path))
    try:
        source = type("S", (), {"module": "gone_helpers", "firstlineno": 1})()
        source.content = module.read_text()
        record = code_record([source], {}, "gone_helpers")
        assert stale_reasons({"code": record}) == []
        module.write_text("def other(x):\n    return x * 2\n")
        assert any("act is gone" in r for r in stale_reasons({"code": record}))
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("gone_helpers", None)


HELPERS = """
def act(x):
    return x * 2

def other(x):
    return x

OPS = {"act": act}

class Other:
    def method(self, x):
        return x * 2

OBJ = Other()
"""


def fingerprint_with(old: str = "", new: str = "") -> str:
    """The key's code hash of a model reaching a helper module three ways, the helpers'
    source edited (``old`` replaced by ``new``)."""
    helpers = types.ModuleType("stale_helpers")
    exec(HELPERS.replace(old, new) if old else HELPERS, vars(helpers))
    scope = {"h": helpers}
    exec("def model(x):\n    return h.act(x) + h.OPS['act'](x) + h.OBJ.method(x)\n", scope)
    return code_fingerprint(scope["model"])


def test_the_key_covers_module_attributes_containers_and_objects_classes() -> None:
    """An edit the model reaches through ``h.act``, ``h.OPS[...]`` or ``h.OBJ.method``
    changes its key (and so its verdicts); one in code it does not reach does not."""
    base = fingerprint_with()
    assert fingerprint_with() == base
    assert fingerprint_with("    return x\n", "    return x + 1\n") == base  # other: unreached
    for old, new in (
        ("return x * 2\n\ndef other", "return x * 3\n\ndef other"),  # act
        ('{"act": act}', '{"act": other}'),  # the dict's function
        ("return x * 2\n\nOBJ", "return x * 3\n\nOBJ"),  # the object's class's method
    ):
        assert old in HELPERS
        assert fingerprint_with(old, new) != base, old
