"""The declared comparison: how a check compares a compiled result with eager's.

:class:`Comparer` is built once per guarded callable from its ``Shadow`` policy, and
checked then: an ``ignore_where(arg)`` must name a parameter of the function. It compares
outputs as the policy declares (``Shadow(compare=...)``: whole, a user's function, or with
the positions ``ignore_where`` marks set to 0), with the policy's tolerances; a breach
says which of the call's mask inputs it lines up with. It compares a state update too
(buffers, inputs, Python objects). It only answers comparisons
(:class:`~safecompile.checks.compare.Comparison`); the shadow runner counts and says them.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from safecompile.base.errors import ConfigError
from safecompile.base.policies import IgnoreWhere, Shadow, compare_label
from safecompile.base.torchcompat import pytree
from safecompile.checks.compare import Comparison, compare, expand_mask

if TYPE_CHECKING:
    from safecompile.checks.snapshot import After

__all__ = ["Comparer"]


class Comparer:
    """The declared comparison of one guarded callable (``policy``: its shadow policy)."""

    def __init__(self, policy: Shadow | None, fn: Callable[..., Any]) -> None:
        self.policy = policy
        self._signature = _signature(fn)
        _check_declared(policy, fn, self._signature)

    def tolerances(self) -> tuple[float | None, float | None]:
        policy = self.policy
        return (policy.rtol, policy.atol) if policy is not None else (None, None)

    def outputs(
        self, out: Any, eager_out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Comparison:
        """Compare a compiled output with eager's for the call ``(args, kwargs)``, as the
        policy declares (``Shadow(compare=...)``); a breach says where they differ."""
        masks = functools.partial(self._mask_inputs, args, kwargs)
        declared = self.policy.compare if self.policy is not None else None
        if isinstance(declared, IgnoreWhere):
            return self._compare_ignoring(declared, out, eager_out, args, kwargs, masks)
        result = self._compare(out, eager_out, masks=masks)
        if declared is None:
            return result
        label = compare_label(declared)
        if bool(declared(eager_out, out, args, kwargs)):
            return dataclasses.replace(result, ok=True, reason=None, where=None)
        why = f"Shadow(compare={label}) returned False"
        if result.reason is not None:
            why += f"; compared whole: {result.reason}"
        return dataclasses.replace(result, ok=False, reason=why)

    def state(self, after: After) -> Comparison:
        """Compare the state the compiled run updated with eager's update."""
        tensors = self._compare(*after.tensor_states())
        if not tensors.ok:
            reason = f"the state update differs (buffers or inputs): {tensors.reason}"
            return dataclasses.replace(tensors, reason=reason)
        objects = self._compare(*after.object_states())
        why = None if objects.ok else f"the Python objects it updates differ: {objects.reason}"
        return Comparison(
            objects.ok,
            max(tensors.max_abs, objects.max_abs),
            max(tensors.max_rel, objects.max_rel),
            why,
            tensors.leaves + objects.leaves,
        )

    def _compare_ignoring(
        self,
        declared: IgnoreWhere,
        out: Any,
        eager_out: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        masks: Callable[[], dict[str, torch.Tensor]],
    ) -> Comparison:
        """Compare with the positions ``declared`` ignores set to 0 on both sides."""
        mask = self._argument(declared.arg, args, kwargs)
        if not isinstance(mask, torch.Tensor):  # not passed (None): nothing is ignored
            return self._compare(out, eager_out, masks=masks)
        with torch.no_grad():
            ignored = mask == declared.equals
            fits = [0]
            out = _ignore(out, ignored, declared.dims, fits)
            eager_out = _ignore(eager_out, ignored, declared.dims, [0])
        result = self._compare(out, eager_out, masks=masks)
        if not fits[0] and result.reason is not None:
            shape = tuple(mask.shape)
            why = f"{result.reason} ({declared.label}: its mask {shape} lines up with no output)"
            result = dataclasses.replace(result, reason=why)
        return result

    def _argument(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The value of parameter ``name`` in this call (``None`` if not passed)."""
        if name in kwargs:
            return kwargs[name]
        if self._signature is None:
            return None
        try:
            bound = self._signature.bind_partial(*args, **kwargs)
        except TypeError:
            return None
        return bound.arguments.get(name)

    def _mask_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> dict[str, torch.Tensor]:
        """The call's bool and 0/1 tensors by parameter name (to say whether a breach lines
        up with one); read only when a check breaches."""
        named: dict[str, Any] = {}
        if self._signature is not None:
            try:
                named = dict(self._signature.bind_partial(*args, **kwargs).arguments)
            except TypeError:
                named = {}
        if not named:
            named = {f"args[{i}]": a for i, a in enumerate(args)} | dict(kwargs)
        found = {}
        for name, value in named.items():
            if isinstance(value, torch.Tensor) and _is_mask(value):
                found[name] = value
        return found

    def _compare(
        self,
        out: Any,
        eager_out: Any,
        masks: Callable[[], dict[str, torch.Tensor]] | None = None,
    ) -> Comparison:
        rtol, atol = self.tolerances()
        return compare(out, eager_out, rtol=rtol, atol=atol, masks=masks)


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):
        return None


def _check_declared(
    policy: Shadow | None, fn: Callable[..., Any], signature: inspect.Signature | None
) -> None:
    """At decoration: ``ignore_where(arg)`` names a parameter of the function."""
    declared = policy.compare if policy is not None else None
    if not isinstance(declared, IgnoreWhere) or signature is None:
        return
    params = signature.parameters
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    param = params.get(declared.arg)
    if param is not None and param.kind not in variadic:
        return
    if param is None and any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return  # it may come as a keyword
    close = difflib.get_close_matches(declared.arg, list(params), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    name = getattr(fn, "__qualname__", type(fn).__qualname__)
    raise ConfigError(
        f"Shadow(compare={declared.label}) names {declared.arg!r}, which is not a parameter "
        f"of {name}{signature}{hint}"
    )


def _is_mask(t: torch.Tensor) -> bool:
    """A bool tensor, or an integer or float one holding only 0s and 1s."""
    if t.dtype == torch.bool:
        return t.numel() > 1
    if t.is_complex() or t.numel() <= 1 or t.layout != torch.strided:
        return False
    with torch.no_grad():
        return bool(((t == 0) | (t == 1)).all())


def _ignore(out: Any, ignored: torch.Tensor, dims: tuple[int, ...] | None, fits: list[int]) -> Any:
    """``out`` with the positions ``ignored`` marks set to 0 in each tensor it lines up
    with (``fits[0]`` counts them); others unchanged."""
    k = ignored.ndim

    def one(t: torch.Tensor) -> torch.Tensor:
        shape = tuple(t.shape)
        lined = dims if dims is not None else tuple(range(k))
        if (
            k == 0
            or len(lined) != k
            or max(lined) >= len(shape)
            or any(shape[d] != n for d, n in zip(lined, ignored.shape, strict=True))
        ):
            return t
        fits[0] += 1
        where = expand_mask(ignored.to(t.device), lined, shape)
        return t.masked_fill(where, 0)

    return pytree.tree_map_only(torch.Tensor, one, out)
