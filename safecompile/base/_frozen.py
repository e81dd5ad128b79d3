"""A read-only, hashable mapping for the values policies keep after validation."""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping
from typing import Any, TypeVar

__all__ = ["FrozenMap"]

_K = TypeVar("_K", bound=Hashable)
_V = TypeVar("_V", bound=Hashable)


class FrozenMap(Mapping[_K, _V]):
    """A mapping that cannot change and can be hashed (its values must be hashable).

    Made from a copy of the given mapping, so changing that mapping afterwards changes
    nothing here. Equal to any mapping with the same items (a ``dict`` too), hashed
    like the set of its items, and shown like a ``dict``.
    """

    __slots__ = ("_data", "_hash")

    def __init__(self, items: Mapping[_K, _V]) -> None:
        self._data: dict[_K, _V] = dict(items)
        self._hash: int | None = None

    def __getitem__(self, key: _K) -> _V:
        return self._data[key]

    def __iter__(self) -> Iterator[_K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._data.items()))
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._data == dict(other.items())
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self._data)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self._data,))
