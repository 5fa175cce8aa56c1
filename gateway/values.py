"""``@value``: a record that is frozen where it is checked and cheap where it is built.

A frozen dataclass pays one ``object.__setattr__`` call per field on every construction, about
four times the cost of a plain one. The records the gateway builds for every request (the parsed
request, its key, the routing snapshot and decision, the upstream request) use ``@value``
instead: mypy checks them as frozen (assigning a field is a type error, ``mypy --strict`` runs in
CI), and at run time they are plain slotted dataclasses that compare and hash by value, as a
frozen one does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar, dataclass_transform

_T = TypeVar("_T")


@dataclass_transform(frozen_default=True)
def value(cls: type[_T]) -> type[_T]:
    """A slotted dataclass, equal and hashable by its fields, frozen for the type checker."""
    return dataclass(slots=True, unsafe_hash=True)(cls)
