"""What the guard learnt about each bucket (plan key): verified with its output cut, or
rejected, and its calls and padding waste. At most :data:`MAX_BUCKETS` entries, the
oldest forgotten first (a forgotten bucket is simply verified again)."""

from __future__ import annotations

import copy
import enum
import math
import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from safecompile.base import torchcompat
from safecompile.observe.log import torch_missing

from .buckets import Bucketer, CutSpec, Plan

__all__ = ["MAX_BUCKETS", "BucketEntry", "BucketStatus", "BucketTable", "unmark"]

MAX_BUCKETS = 1024


class BucketStatus(enum.Enum):
    NEW = "new"  # not verified yet: the next call learns its cut and checks its padding
    READY = "ready"
    REJECTED = "rejected"  # padding changes results, or its range cannot compile: eager


@dataclass(slots=True, eq=False)
class BucketEntry:
    """What the guard knows about one bucket."""

    label: str
    status: BucketStatus = BucketStatus.NEW
    cuts: CutSpec | None = None
    why: str | None = None
    calls: int = 0
    padded_calls: int = 0
    padded_elements: int = 0
    real_elements: int = 0
    # Across restarts (persist.restart): the plan key, whether its verdict was looked up,
    # what an earlier process found ("verified"/"rejected"), and its saved cut.
    key: Hashable = None
    looked_up: bool = False
    restored: str | None = None
    saved: list[Any] | None = None

    def count(self, plan: Plan, *, padded: bool) -> None:
        """One call served; padding waste counts the bucketed dims' elements."""
        self.calls += 1
        if padded:
            real = math.prod(plan.lengths)
            self.padded_calls += 1
            self.padded_elements += math.prod(plan.sizes) - real
            self.real_elements += real

    def to_dict(self) -> dict[str, Any]:
        waste = self.padded_elements / max(1, self.padded_elements + self.real_elements)
        return {
            "status": self.status.value,
            "calls": self.calls,
            "padded_calls": self.padded_calls,
            "padding_waste": waste,
            "cut": self.cuts.describe() if self.cuts is not None else None,
            "why": self.why,
            "restored": self.restored,
        }


class BucketTable:
    """The bucket entries of one guarded callable."""

    def __init__(self, bucketer: Bucketer) -> None:
        self.bucketer = bucketer
        self.pads = bucketer.strategy == "pad"
        self._lock = threading.Lock()
        self.entries: OrderedDict[Hashable, BucketEntry] = OrderedDict()

    def entry(self, plan: Plan) -> BucketEntry:
        """The entry of a bucketed plan (made when first seen)."""
        with self._lock:
            found = self.entries.get(plan.key)
            if found is None:
                found = BucketEntry(label=plan.describe(), key=plan.key)
                self.entries[plan.key] = found
                if len(self.entries) > MAX_BUCKETS:
                    self.entries.popitem(last=False)
            return found

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()

    def report(self) -> dict[str, Any]:
        """Each bucket seen, by label."""
        with self._lock:
            return {e.label: e.to_dict() for e in self.entries.values()}

    def summary(self) -> dict[str, Any]:
        """The policy as resolved: the strategy in use (``"auto"`` resolved), the axes
        and their sizes, and how many buckets (graphs) that makes at most."""
        policy = self.bucketer.policy
        return {
            "strategy": self.bucketer.strategy,
            "requested": policy.strategy,
            "axes": {
                a.name if a.name is not None else "length": list(a.sizes) for a in policy.axes
            },
            "buckets": policy.bucket_count,
        }

    def mark_range(
        self, plan: Plan, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        """``strategy="dynamic"``: mark each bucketed dim dynamic over its bucket's range
        (one length, or only 0 or 1, stays static). Returns what :func:`unmark` needs:
        left on the caller's tensors, the marks would recompile every other compiled
        function they reach."""
        ranges: dict[int, tuple[int, int]] = {}
        for axis, spec in enumerate(self.bucketer.policy.axes):
            size, length = plan.sizes[axis], plan.lengths[axis]
            if size not in spec.sizes:
                continue  # a length torch specialises (0, 1): a static graph of its own
            index = spec.sizes.index(size)
            low = max(2, spec.sizes[index - 1] + 1) if index > 0 else 2
            if low <= length and low < size:
                ranges[axis] = (low, size)
        if not ranges:
            return []  # every range holds one length: a static graph
        found, _ = self.bucketer._find(args, kwargs)
        marked = []
        for param, _, tensor in found:
            saved = {a: copy.copy(getattr(tensor, a)) for a in _MARKS if hasattr(tensor, a)}
            marked.append((tensor, saved))
            for dim, axis in param.dims:
                if axis in ranges:
                    low, high = ranges[axis]
                    missing = torchcompat.mark_dynamic(tensor, dim % tensor.dim(), low, high)
                    if missing is not None:
                        torch_missing(missing)
        return marked


_MARKS = torchcompat.DYNAMIC_MARKS


def unmark(marked: list[tuple[torch.Tensor, dict[str, Any]]]) -> None:
    """Put the caller's tensors' dynamo marks back as they were before we marked them."""
    for tensor, saved in marked:
        for name in _MARKS:
            if name in saved:
                setattr(tensor, name, saved[name])
            elif hasattr(tensor, name):
                delattr(tensor, name)
