"""The doctor's shape sweep: which shapes to try after the examples."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from safecompile.base.torchcompat import pytree

from .report import Example

__all__ = ["sweep_calls", "tensors"]


def sweep_calls(
    given: Sequence[Example] | None, examples: Sequence[Example]
) -> tuple[list[tuple[str, Example]], str]:
    """The sweep's calls, and a line saying what they vary: the target's own (``given``;
    ``()`` for none), else sizes around the first example's leading and sequence dims."""
    if given is not None:
        if not given:
            return [], "none (the target's sweep=())"
        return [(e.label(), e) for e in given], f"the target's {len(given)} call(s)"
    example = examples[0]
    sized = [t for t in tensors(example) if t.ndim >= 1 and t.shape[0] > 0]
    if not sized:
        return [], "none: the first example has no tensor with a dim to vary"
    batch = sized[0].shape[0]
    plans = [(0, batch, _batch_sizes(batch), "leading (batch) dim")]
    seq_src = next(filter(_has_sequence_dim, sized), None)
    if seq_src is not None:
        seq = seq_src.shape[1]
        plans.append((1, seq, _seq_sizes(seq), "dim 1 (sequence)"))
    calls: list[tuple[str, Example]] = []
    said: list[str] = []
    seen = {e.label() for e in examples}  # compiled already
    for dim, length, sizes, words in plans:
        said.append(f"{words} {length} -> {', '.join(map(str, sizes))}")
        for size in sizes:
            resized = _resize(example, dim, length, size)
            label = resized.label()
            if label not in seen:
                seen.add(label)
                calls.append((label, resized))
    return calls, "; ".join(said)


def tensors(example: Example) -> list[torch.Tensor]:
    leaves, _ = pytree.tree_flatten((example.args, dict(example.kwargs)))
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _has_sequence_dim(t: torch.Tensor) -> bool:
    """Dim 1 reads as a sequence: a 3-d (or more) tensor's, or token ids' and masks'."""
    return (t.ndim >= 3 or (t.ndim == 2 and not t.is_floating_point())) and t.shape[1] > 0


def _batch_sizes(n: int) -> list[int]:
    return sorted({1, 2, 3, 5, n + 1, 2 * n} - {n})


def _seq_sizes(n: int) -> list[int]:
    return sorted({max(1, n // 4), max(1, n // 2), n - 1, n + 1, n + n // 2, 2 * n} - {n, 0})


def _resize(example: Example, dim: int, length: int, size: int) -> Example:
    """``example`` with dim ``dim`` of every tensor whose dim is ``length`` made ``size``
    long, by repeating or cutting its own values (so token ids and masks stay valid)."""

    def one(t: torch.Tensor) -> torch.Tensor:
        if t.ndim <= dim or t.shape[dim] != length:
            return t
        index = torch.arange(size, device=t.device) % length
        return t.index_select(dim, index)

    args, kwargs = pytree.tree_map_only(torch.Tensor, one, (example.args, dict(example.kwargs)))
    return Example(tuple(args), dict(kwargs))
