"""What the guard reads from a graph dynamo hands over: pure readers of a GraphModule.

Its inputs as text, the function it belongs to, whether it updates tensors in place or
draws random numbers, and the Python objects its frame updates (:mod:`._effects`).
Nothing here keeps state; :mod:`.graphs` records what these return.
"""

from __future__ import annotations

import functools
import inspect
import re
import types
from dataclasses import dataclass
from typing import Any

import torch

from safecompile.base import torchcompat

from ._effects import Effect, frame_key, outside_effects

__all__ = [
    "DIM_LETTERS",
    "GraphFacts",
    "Reading",
    "code_name",
    "describe_inputs",
    "mutates_in_place",
    "random_op",
    "read_facts",
    "read_graph",
    "twin_key",
    "written_inputs",
]


@dataclass(frozen=True, slots=True)
class GraphFacts:
    """What the guard reads from a graph dynamo hands over (saved with a precompiled one)."""

    label: str  # its inputs as text
    code: str  # the function (or resume function) it belongs to
    unchecked: str | None  # why it can never be checked
    mutates: bool  # it may update a tensor in place
    effects: tuple[Effect, ...]  # Python objects its frame updates


@dataclass(frozen=True, slots=True)
class Reading:
    """All the backend reads of a graph dynamo hands over, before it is compiled."""

    facts: GraphFacts
    frame: types.CodeType | None  # the function (or resume function) being compiled
    frame_key: tuple[str, str, int] | None  # its :func:`frame_key`
    twin: tuple[Any, ...]  # what makes two graphs the same compile (:func:`twin_key`)
    random: bool  # it draws random numbers
    written: frozenset[int] | None  # the inputs its code may update (:func:`written_inputs`)


def read_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Reading:
    """Read everything of a graph at once, as dynamo hands it over (its side-effect
    record is live then, and no compiler has rewritten it yet)."""
    frame = torchcompat.frame_code()
    random = random_op(gm)
    facts = _facts(gm, frame, random)
    twin = twin_key(facts.code, gm, example_inputs)
    key = frame_key(frame) if frame is not None else None
    return Reading(facts, frame, key, twin, random is not None, written_inputs(gm))


def read_facts(gm: torch.fx.GraphModule) -> GraphFacts:
    """A graph's facts as dynamo hands it over (its side-effect record is live then);
    ``unchecked`` says why a shadow check must skip it (``None``: it need not)."""
    return _facts(gm, torchcompat.frame_code(), random_op(gm))


def _facts(
    gm: torch.fx.GraphModule, frame: types.CodeType | None, random: str | None
) -> GraphFacts:
    """:func:`read_facts`, with the frame and the random op read already."""
    effects, lost = outside_effects()
    unchecked: str | None = None
    if random is not None:
        unchecked = f"the graph draws random numbers ({random}): compiled and eager streams differ"
    elif lost is not None:
        unchecked = (
            f"the call updates a Python object that cannot be found again to copy "
            f"({lost}): eager cannot rerun it without applying the update twice"
        )
    code = code_name(frame)
    return GraphFacts(describe_inputs(gm), code, unchecked, mutates_in_place(gm), effects)


def code_name(code: types.CodeType | None) -> str:
    if code is None:
        return "?"
    return f"{code.co_name}@{code.co_filename}:{code.co_firstlineno}"


def twin_key(code: str, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> tuple[Any, ...]:
    """What makes two graphs the same compile: code, graph, inputs' metadata, grad mode."""
    inputs = tuple(
        (
            str(tuple(t.shape)),
            str(t.stride()) if t.layout == torch.strided else "",
            t.dtype,
            t.device,
            t.requires_grad,
        )
        if isinstance(t, torch.Tensor)
        else str(t)
        for t in example_inputs
    )
    return (code, gm.code, inputs, torch.is_grad_enabled())


_IN_PLACE_FUNCTIONS = frozenset({"setitem", "iadd", "isub", "imul", "itruediv", "ifloordiv"})


def mutates_in_place(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph may update a tensor in place (an input, a buffer, a parameter).

    Conservative: any in-place op counts (``add_``, ``x[i] = v``, ``+=``, ``inplace=True``,
    batch norm while training); a check of such a graph copies that state first.
    """
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        name = _target_name(node.target)
        if name in _IN_PLACE_FUNCTIONS or node.kwargs.get("inplace") is True:
            return True
        if name.endswith("_") and not name.endswith("__"):
            return True
        if name == "batch_norm" and (
            node.kwargs.get("training") is True or (len(node.args) > 5 and node.args[5] is True)
        ):
            return True
    return False


# Ops whose result may be a view of their first argument (a write into it writes there).
_VIEWS = frozenset(
    {
        "getitem", "getattr", "view", "view_as", "reshape", "reshape_as", "transpose",
        "permute", "t", "T", "mT", "H", "mH", "expand", "expand_as", "narrow", "select",
        "squeeze", "unsqueeze", "flatten", "unflatten", "as_strided", "split", "chunk",
        "unbind", "split_with_sizes", "tensor_split", "diagonal", "detach", "contiguous",
        "movedim", "moveaxis", "swapaxes", "swapdims", "unfold", "real", "imag",
        "view_as_real", "view_as_complex", "alias", "to", "type_as", "float", "half",
    }
)  # fmt: skip


def written_inputs(gm: torch.fx.GraphModule) -> frozenset[int] | None:
    """The positions of the graph's inputs its code may update in place (an in-place op on
    an input or a view of one); ``None`` when one cannot be traced back to its tensor."""
    inputs = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    written: set[int] = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        name = _target_name(node.target)
        targets: list[Any] = []
        if name == "batch_norm":
            targets = [
                *node.args[1:3],
                node.kwargs.get("running_mean"),
                node.kwargs.get("running_var"),
            ]
        elif (
            name in _IN_PLACE_FUNCTIONS
            or node.kwargs.get("inplace") is True
            or (name.endswith("_") and not name.endswith("__"))
        ):
            targets = list(node.args[:1])
        if "out" in node.kwargs:
            targets.append(node.kwargs["out"])
        for target in _leaves(targets):
            base = _input_of(target, inputs)
            if base is _UNKNOWN:
                return None
            if isinstance(base, int):
                written.add(base)
    return frozenset(written)


_UNKNOWN = object()


def _input_of(value: Any, inputs: dict[Any, int]) -> int | object | None:
    """The input ``value`` is, or is a view of (its position); ``None`` for a tensor the
    graph made; ``_UNKNOWN`` when it cannot tell (a module's attribute...)."""
    for _ in range(64):
        if not isinstance(value, torch.fx.Node):
            return None  # a constant
        if value.op == "placeholder":
            return inputs[value]
        if value.op not in ("call_function", "call_method"):
            return _UNKNOWN
        if _target_name(value.target) not in _VIEWS or not value.args:
            return None  # a new tensor
        value = value.args[0]
    return _UNKNOWN


def _leaves(value: Any) -> list[Any]:
    """The leaves of nested lists and tuples (an op's list argument: ``_foreach_add_``)."""
    if isinstance(value, list | tuple):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]


_SYMBOL = re.compile(r"\b[su]\d+\b")


#: What a dim that varies is called in a graph's description, in order of appearance.
DIM_LETTERS = "NMKLPQRT"


def describe_inputs(gm: torch.fx.GraphModule) -> str:
    """The graph's user inputs as text (parameters, buffers and the sizes dynamo lifts
    out of tensors left out): ``Nx32:float32, int``, a dim that varies as a letter."""
    parts = []
    letters: dict[str, str] = {}  # torch's symbol (``s77``) -> its letter: equal dims read equal

    def letter(match: re.Match[str]) -> str:
        n = len(letters)
        return letters.setdefault(match[0], DIM_LETTERS[n] if n < len(DIM_LETTERS) else f"N{n}")

    def dims(dim: object) -> str:
        return _SYMBOL.sub(letter, str(dim)).replace(" ", "")

    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        name = str(node.target)
        if "_parameters_" in name or "_buffers_" in name:
            continue
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.Tensor):
            shape = "x".join(dims(d) for d in value.shape) or "scalar"
            parts.append(f"{shape}:{str(value.dtype).removeprefix('torch.')}")
        elif torchcompat.is_tensor_property(getattr(node.meta.get("grapharg"), "source", None)):
            continue  # a size dynamo lifted out of a tensor: not an argument of the user's
        elif isinstance(value, torch.SymInt | int | float | bool):
            parts.append("int" if isinstance(value, torch.SymInt) else type(value).__name__)
    text = ", ".join(parts) or "no tensor inputs"
    return text if len(text) <= 160 else text[:157] + "..."


_DROPOUTS = frozenset(
    {
        "dropout",
        "dropout1d",
        "dropout2d",
        "dropout3d",
        "alpha_dropout",
        "feature_dropout",
        "feature_alpha_dropout",
        "native_dropout",
        "rrelu",
        "scaled_dot_product_attention",
    }
)


# Positional names where a builtin's signature cannot be read.
_POSITIONAL = {
    "scaled_dot_product_attention": ("query", "key", "value", "attn_mask", "dropout_p"),
    "rrelu": ("input", "lower", "upper", "training"),
}


@functools.cache
def _seeded(name: str) -> bool:
    """Whether ATen's op of this name draws random numbers (its own tag says so)."""
    packet = getattr(torch.ops.aten, name, None)
    try:
        return packet is not None and any(
            torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in packet.overloads()
        )
    except Exception:
        return False


def _target_name(target: object) -> str:
    if isinstance(target, str):
        return target
    if torchcompat.is_op_overload(target):
        return str(getattr(target, "_opname", ""))
    return str(getattr(target, "__name__", "")).removeprefix("_")


def _dropout_draws(
    name: str, target: object, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    """Whether a dropout-like call draws: ``p > 0`` and training; ``rrelu``: training."""
    try:
        bound = inspect.signature(target).bind(*args, **kwargs)  # type: ignore[arg-type]
        bound.apply_defaults()
        values = dict(bound.arguments)
    except (TypeError, ValueError):
        names = _POSITIONAL.get(name, ("input", "p", "training"))  # torch.dropout(x, p, train)
        values = dict(zip(names, args, strict=False)) | kwargs
    if name == "rrelu":
        return values.get("training", False) is not False
    training = values.get("training", values.get("train", True))
    if training is False:
        return False
    p = values.get("p", values.get("dropout_p", 0.0 if name.startswith("scaled") else None))
    return not (isinstance(p, int | float) and p == 0)


def random_op(gm: torch.fx.GraphModule) -> str | None:
    """The first op of the graph that draws random numbers, or ``None``: ATen tags every
    op that draws ``nondeterministic_seeded``; the dropout family draws only with ``p > 0``
    while training."""
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        name = _target_name(node.target)
        if name.rstrip("_") in _DROPOUTS:
            if node.op == "call_function" and _dropout_draws(
                name.rstrip("_"), node.target, node.args, node.kwargs
            ):
                return name
            continue
        if name and _seeded(name):
            return name
    return None
