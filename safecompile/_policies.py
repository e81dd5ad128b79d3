"""Policies: small frozen, keyword-only dataclasses, validated when built."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ._errors import ConfigError

__all__ = ["FOREVER", "Buckets", "Rollback", "Shadow", "Warmup", "pow2", "steps"]

FOREVER = 1 << 62  # a countdown that never runs out


def _check_int(owner: str, name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{owner}({name}=...) must be an int >= {minimum}, got {value!r}")


def _check_number(
    owner: str, name: str, value: object, *, minimum: float, strict: bool = False
) -> None:
    ok = (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and (value > minimum if strict else value >= minimum)
    )
    if not ok:
        bound = f"> {minimum}" if strict else f">= {minimum}"
        raise ConfigError(f"{owner}({name}=...) must be a finite number {bound}, got {value!r}")


def _check_choice(owner: str, name: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{owner}({name}=...) must be one of {allowed}, got {value!r}")


def pow2(lo: int, hi: int) -> tuple[int, ...]:
    """The powers of two from ``lo`` to ``hi`` (both rounded outward to a power of two).

    ``pow2(16, 2048) == (16, 32, 64, 128, 256, 512, 1024, 2048)``.
    """
    _check_int("pow2", "lo", lo, minimum=1)
    _check_int("pow2", "hi", hi, minimum=lo)
    first = 1 << (lo - 1).bit_length()
    last = 1 << (hi - 1).bit_length()
    out = []
    size = first
    while size <= last:
        out.append(size)
        size <<= 1
    return tuple(out)


def steps(lo: int, hi: int, step: int) -> tuple[int, ...]:
    """Every ``step`` from ``lo`` up to the first value that holds ``hi``.

    ``steps(8, 32, 8) == (8, 16, 24, 32)``. Finer than :func:`pow2`, so less padded
    work for more graphs; concatenate ranges for vLLM-like lists:
    ``pow2(1, 4) + steps(8, 256, 8) + steps(272, 512, 16)``.
    """
    _check_int("steps", "lo", lo, minimum=1)
    _check_int("steps", "hi", hi, minimum=lo)
    _check_int("steps", "step", step, minimum=1)
    count = -(-(hi - lo) // step)  # ceil: the last value holds hi
    return tuple(lo + i * step for i in range(count + 1))


OutputDims = int | tuple[int, ...]


def _normal_dims(value: object) -> tuple[int, ...] | None:
    """``value`` as a tuple of distinct int dims, or ``None`` if it is not one."""
    dims = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    if (
        not isinstance(dims, tuple)
        or any(isinstance(d, bool) or not isinstance(d, int) for d in dims)
        or len(set(dims)) != len(dims)
    ):
        return None
    return dims


def _normal_outputs(
    outputs: object,
) -> tuple[int, ...] | dict[str, tuple[int, ...]] | None:
    if outputs is None:
        return None
    if isinstance(outputs, Mapping):
        normal: dict[str, tuple[int, ...]] = {}
        for path, dims in outputs.items():
            if not isinstance(path, str):
                raise ConfigError(
                    "Buckets(outputs=...) keys must be output paths as text ('' for the "
                    f"output itself, '0', 'logits', '1.attn'), got {path!r}"
                )
            found = _normal_dims(dims)
            if found is None:
                raise ConfigError(
                    "Buckets(outputs=...) values must be a dim (int) or a tuple of distinct "
                    f"dims (() for none), got {path!r}: {dims!r}"
                )
            normal[path] = found
        return normal
    found = _normal_dims(outputs)
    if not found:
        raise ConfigError(
            "Buckets(outputs=...) must be None (learn the cut per bucket), a dim or tuple of "
            "dims to cut in every output tensor, or a mapping of output path to dims, "
            f"got {outputs!r}"
        )
    return found


@dataclass(frozen=True, kw_only=True)
class Buckets:
    """Pad variable dims up to a bounded set of sizes, so recompiles stay bounded.

    ``dims`` maps an argument name to the dim (or dims) to pad; every bucketed dim of
    one call must have the same length (``x`` and ``mask``). ``sizes`` is an
    increasing sequence of lengths; ``pad_value`` is one number or a mapping per
    argument; an input longer than the largest size runs eager (``oversize="eager"``)
    or compiles its own shape (``"compile"``).

    ``strategy="pad"`` (default) pads to static shapes, one graph per size (what CUDA
    graphs and ``mode="reduce-overhead"`` need). ``strategy="dynamic"`` pads nothing:
    each range between two sizes gets one dynamic graph bounded by
    ``torch._dynamo.mark_dynamic(min=..., max=...)``, so no padded work is done.

    ``outputs`` says which output dims are cut back to the original length. ``None``
    (default) learns it per bucket by comparing the padded output with unpadded eager's:
    a dim is cut where padding changed it from the length to the bucket size. An int
    or tuple cuts those dims of every tensor in the output; a mapping names output
    paths (``""`` the output itself, ``"0"``, ``"logits"``, ``"1.attn"``) and their
    dims (``()``: never cut), the others are not cut. A declaration is checked against
    what padding actually changed, and un-padding checks every cut dim, so a hidden
    size that equals the bucket, or a square attention map, is never cut silently.
    """

    dims: Mapping[str, int | tuple[int, ...]]
    sizes: tuple[int, ...]
    pad_value: float | Mapping[str, float] = 0
    oversize: Literal["eager", "compile"] = "eager"
    outputs: OutputDims | Mapping[str, OutputDims] | None = None
    strategy: Literal["pad", "dynamic"] = "pad"

    def __post_init__(self) -> None:
        owner = "Buckets"
        if not isinstance(self.dims, Mapping) or not self.dims:
            raise ConfigError(
                f"{owner}(dims=...) must be a non-empty mapping of argument name to dim, "
                f"got {self.dims!r}"
            )
        normal: dict[str, tuple[int, ...]] = {}
        for arg, dim in self.dims.items():
            if not isinstance(arg, str) or not arg.isidentifier():
                raise ConfigError(f"{owner}(dims=...) keys must be argument names, got {arg!r}")
            dims = (dim,) if isinstance(dim, int) and not isinstance(dim, bool) else dim
            if (
                not isinstance(dims, tuple)
                or not dims
                or any(isinstance(d, bool) or not isinstance(d, int) for d in dims)
                or len(set(dims)) != len(dims)
            ):
                raise ConfigError(
                    f"{owner}(dims=...) values must be a dim (int) or a tuple of distinct "
                    f"dims, got {arg!r}: {dim!r}"
                )
            normal[arg] = dims
        object.__setattr__(self, "dims", normal)

        sizes = tuple(self.sizes) if isinstance(self.sizes, Sequence) else self.sizes
        if (
            not isinstance(sizes, tuple)
            or not sizes
            or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes)
            or any(sizes[i] >= sizes[i + 1] for i in range(len(sizes) - 1))
        ):
            raise ConfigError(
                f"{owner}(sizes=...) must be a non-empty, strictly increasing sequence of "
                f"positive ints (pow2(lo, hi) makes one), got {self.sizes!r}"
            )
        object.__setattr__(self, "sizes", sizes)

        pads = self.pad_value if isinstance(self.pad_value, Mapping) else {"*": self.pad_value}
        for arg, value in pads.items():
            if arg != "*" and arg not in normal:
                raise ConfigError(
                    f"{owner}(pad_value=...) names {arg!r}, which is not in dims "
                    f"({', '.join(sorted(normal))})"
                )
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(
                    f"{owner}(pad_value=...) must be a number or a mapping of argument name "
                    f"to number, got {value!r}"
                )
        if isinstance(self.pad_value, Mapping):
            object.__setattr__(self, "pad_value", dict(self.pad_value))
        _check_choice(owner, "strategy", self.strategy, ("pad", "dynamic"))
        _check_choice(owner, "oversize", self.oversize, ("eager", "compile"))
        object.__setattr__(self, "outputs", _normal_outputs(self.outputs))

    def pad_for(self, arg: str) -> float:
        """The pad value for one argument."""
        if isinstance(self.pad_value, Mapping):
            return self.pad_value.get(arg, 0)
        return self.pad_value

    def bucket_for(self, length: int) -> int | None:
        """The smallest size that holds ``length``, or ``None`` when it is too long."""
        for size in self.sizes:
            if size >= length:
                return size
        return None


WarmupInputs = Sequence[tuple[Any, ...]] | Callable[[], Sequence[tuple[Any, ...]]]


@dataclass(frozen=True, kw_only=True)
class Warmup:
    """Compile ahead of traffic on example inputs.

    ``inputs`` is a sequence of argument tuples, or a callable returning one (called
    when warmup runs, so large tensors need not live for the process's lifetime).
    ``background=True`` compiles on a worker thread while eager serves.
    """

    inputs: WarmupInputs
    background: bool = False

    def __post_init__(self) -> None:
        inputs: object = self.inputs  # checked at run time: callers may pass anything
        if not callable(inputs):
            if isinstance(inputs, str | bytes) or not isinstance(inputs, Sequence):
                raise ConfigError(
                    "Warmup(inputs=...) must be a sequence of argument tuples or a callable "
                    f"returning one, got {type(inputs).__name__}"
                )
            for item in inputs:
                if not isinstance(item, tuple):
                    raise ConfigError(
                        "Warmup(inputs=...) items must be tuples of positional arguments, "
                        f"e.g. [(torch.randn(8, 16),)], got {type(item).__name__}"
                    )
            object.__setattr__(self, "inputs", tuple(inputs))
        if not isinstance(self.background, bool):
            raise ConfigError(f"Warmup(background=...) must be a bool, got {self.background!r}")

    def resolve(self) -> tuple[tuple[Any, ...], ...]:
        """The example argument tuples (calling ``inputs`` if it is a callable)."""
        items = self.inputs() if callable(self.inputs) else self.inputs
        out = tuple(items)
        for item in out:
            if not isinstance(item, tuple):
                raise ConfigError(
                    "Warmup(inputs=...) returned an item that is not a tuple of arguments: "
                    f"{type(item).__name__}"
                )
        return out


@dataclass(frozen=True, kw_only=True)
class Shadow:
    """Compare compiled outputs with eager's on live traffic.

    The first ``canary`` compiled calls of each graph are compared, then one call in
    ``every`` (0: none after the canary). ``mode="sync"`` compares before returning and
    returns eager's result on a breach; ``"async"`` compares on a worker fed by a queue
    of ``queue_size`` and never blocks the caller. ``rtol``/``atol`` of ``None`` mean
    per-dtype defaults.
    """

    canary: int = 8
    every: int = 256
    mode: Literal["sync", "async"] = "sync"
    rtol: float | None = None
    atol: float | None = None
    queue_size: int = 16

    def __post_init__(self) -> None:
        _check_int("Shadow", "canary", self.canary, minimum=0)
        _check_int("Shadow", "every", self.every, minimum=0)
        _check_choice("Shadow", "mode", self.mode, ("sync", "async"))
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if value is not None:
                _check_number("Shadow", name, value, minimum=0.0)
        _check_int("Shadow", "queue_size", self.queue_size, minimum=1)

    def countdown(self, canary_left: int) -> int:
        """Calls of a graph to serve unchecked before its next check is due."""
        if canary_left > 0:
            return 0
        return FOREVER if self.every == 0 else self.every - 1


@dataclass(frozen=True, kw_only=True)
class Rollback:
    """When to leave the compiled path, and when to try it again.

    Past ``max_recompiles`` graphs, new shapes run eager (the graphs already made keep
    serving). With ``slower_ratio``, a compiled path measured slower than eager by that
    ratio rolls back. ``retry_after`` seconds after a trip the compiled path is tried
    again (one call, a half-open trial); each failed trial doubles the wait, up to
    ``max_retry_after``; ``0`` tries again on the next call. ``None`` keeps eager until
    ``reset()``.
    """

    max_recompiles: int = 8
    slower_ratio: float | None = None
    slower_min_samples: int = 16
    retry_after: float | None = None
    max_retry_after: float = 3600.0

    def __post_init__(self) -> None:
        _check_int("Rollback", "max_recompiles", self.max_recompiles, minimum=1)
        if self.slower_ratio is not None:
            _check_number("Rollback", "slower_ratio", self.slower_ratio, minimum=1.0)
        _check_int("Rollback", "slower_min_samples", self.slower_min_samples, minimum=1)
        if self.retry_after is not None:
            _check_number("Rollback", "retry_after", self.retry_after, minimum=0.0)
        _check_number("Rollback", "max_retry_after", self.max_retry_after, minimum=0.0, strict=True)
        if self.retry_after is not None and self.max_retry_after < self.retry_after:
            raise ConfigError(
                "Rollback(max_retry_after=...) must be >= retry_after "
                f"({self.retry_after!r}), got {self.max_retry_after!r}"
            )

    def next_wait(self, previous: float | None, *, failing: bool) -> float | None:
        """Seconds to wait before the next trial after a trip (``None``: never).

        ``failing`` means the compiled path failed again soon after it last came back
        (a failed trial, or a trip within twice the last wait): the wait doubles, up to
        ``max_retry_after``. Otherwise it starts again from ``retry_after``.
        """
        if self.retry_after is None:
            return None
        if not failing or previous is None:
            return self.retry_after
        return min(max(previous * 2, self.retry_after), self.max_retry_after)
