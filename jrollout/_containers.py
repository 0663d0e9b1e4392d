"""Containers of fields: a whole transition as one value.

A PureJaxRL-style ``Transition(obs, action, ...)`` NamedTuple, a
``flax.struct`` or ``chex`` dataclass, holds one value per field. Written
(``update_at(state, t, transition)``) it is read as ``{field name:
value}``; registered with ``init(like=transition)`` its one-level treedef is
kept (``Container``) so ``make_batch`` and the minibatch functions give the
batch back in that type. A dict needs neither: it already is ``{name:
value}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from jrollout._state import RolloutState


class Container(NamedTuple):
  """The type of a container of fields, without its values (hashable: a
  static attribute of ``RolloutState`` and of a minibatch layout).

  Attributes:
    treedef: the container's treedef with one leaf per field.
    names: the fields' names in the treedef's order.
    type_name: the container's class name, for messages.
  """
  treedef: Any
  names: tuple[str, ...]
  type_name: str

  def rebuild(self, fields: Mapping[str, Any]) -> Any:
    """The container holding ``fields[name]`` for each of its fields."""
    return self.treedef.unflatten([fields[name] for name in self.names])


def _is_field_value(parent: Any) -> Any:
  return lambda y: y is not parent


def named_fields(value: Any) -> tuple[dict[str, Any], Container] | None:
  """``({name: field value}, Container)`` of a NamedTuple or a registered
  dataclass (flax.struct, chex) whose children are named; None for
  anything else (a dict, an array, a plain tuple or list, None)."""
  if (type(value) is dict or value is None
      or isinstance(value, (jax.Array, np.ndarray, list, np.generic))
      or (isinstance(value, tuple) and not hasattr(type(value), "_fields"))):
    return None
  try:
    children, treedef = jax.tree_util.tree_flatten_with_path(
        value, is_leaf=_is_field_value(value))
  except Exception:   # noqa: BLE001  (not a pytree jax can flatten)
    return None
  if not children or children[0][1] is value:
    return None   # a leaf: an array-like or an unregistered object
  names = []
  for path, _ in children:
    entry = path[0]
    name = getattr(entry, "name", getattr(entry, "key", None))
    if len(path) != 1 or not isinstance(name, str):
      return None
    names.append(name)
  if len(set(names)) != len(names):
    return None
  fields = {name: child for name, (_, child) in zip(names, children)}
  return fields, Container(treedef, tuple(names), type(value).__name__)


def as_values(fn: str, values: Any) -> Any:
  """A write's ``values`` as ``{name: value}``: a dict as it is, a container
  of fields (``named_fields``) as the dict of its fields, anything else as
  it is (the write check refuses it)."""
  if type(values) is dict:
    return values
  if isinstance(values, Mapping):   # a chex dataclass is a Mapping too
    return dict(values.items())
  found = named_fields(values)
  if found is None:
    return values
  del fn
  return found[0]


def batch_fields(batch: Any) -> tuple[Any, Container | None]:
  """``(dict of fields, Container)`` of a container batch (a NamedTuple or
  a dataclass of rows, as ``make_batch`` returns it for ``init(like=)``);
  ``(batch, None)`` for anything else."""
  if type(batch) is dict or isinstance(batch, RolloutState):
    return batch, None
  found = named_fields(batch)
  if found is None:
    return batch, None
  return found
