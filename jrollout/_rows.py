"""Where minibatch rows come from: every row layout, in one place.

A minibatch is a gather of rows by index from one of three layouts:
``FlatRows`` (a batch ``{name: pytree of [L_k, ...]}``, row ``i`` of field
``k`` is ``leaf[i % L_k]``), ``RolloutRows`` (a ``RolloutState``'s ``[T, E,
...]`` storage read in ``make_batch``'s env-major order without the
flattened copy) and ``_minibatch.ChunkRows`` (sequences). A layout is a
small frozen value, so it can be a static argument of ``jax.jit``; calling
it gathers (``layout(data, idx)``), ``sharded_dim`` is the axis a mesh
splits and ``shard`` one device's share.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jrollout import _checks
from jrollout import _state
from jrollout._state import Container
from jrollout._state import RolloutState
from jrollout._types import Array, PyTree


def env_major(x: Array) -> Array:
  """``[T, E, *s] -> [E * T, *s]`` with row ``e * T + t`` = ``x[t, e]``."""
  return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _gather(leaf: Array, rows: Array) -> Array:
  return jnp.asarray(leaf).at[rows].get(mode="promise_in_bounds")


@dataclasses.dataclass(frozen=True)
class Layout:
  """A row layout; with a ``container`` (a NamedTuple or dataclass type of
  fields: ``jrollout._state.Container``) its minibatches come back in it."""

  container: Container | None = dataclasses.field(default=None, kw_only=True)

  def __call__(self, data: dict[str, PyTree], idx: Array) -> Any:
    rows = self.gather(data, idx)
    return rows if self.container is None else self.container.rebuild(rows)

  def gather(self, data: dict[str, PyTree], idx: Array) -> dict[str, PyTree]:
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class FlatRows(Layout):
  """``{name: pytree of [L_k, ...]}``: row ``i`` of field ``k`` is row
  ``i % L_k`` of its leaves."""

  sharded_dim = 0

  def gather(self, data: dict[str, PyTree], idx: Array
             ) -> dict[str, PyTree]:
    """``{k: data[k][idx % L_k]}``, leaves ``[*idx.shape, ...]``."""
    out = {}
    for key, value in data.items():
      rows = idx % jax.tree_util.tree_leaves(value)[0].shape[0]
      out[key] = jax.tree_util.tree_map(lambda x, r=rows: _gather(x, r),
                                        value)
    return out

  def shard(self, num_shards: int) -> FlatRows:
    """One device's share: the same layout over its ``L_k / D`` rows."""
    del num_shards
    return self

  def check_shardable(self, fn: str, lengths: dict[str, int],
                      num_shards: int, axis: Any) -> None:
    for key, length in lengths.items():
      if length % num_shards:
        raise ValueError(
            f"{fn}: field {key!r} has L_k = {length} rows, not divisible by "
            f"the size D = {num_shards} of mesh axis {axis!r}: its shards "
            "would differ in size and the devices could disagree on the "
            "number of minibatches (a multi-host run would hang); use a "
            f"length divisible by {num_shards}")


@dataclasses.dataclass(frozen=True)
class RolloutRows(Layout):
  """``{name: [T, E, ...]}`` storage read as make_batch's env-major rows."""

  num_steps: int
  num_envs: int
  sharded_dim = 1

  def gather(self, data: dict[str, PyTree], idx: Array
             ) -> dict[str, PyTree]:
    """``{k: env_major(data[k])[idx]}`` without the flattened copy."""
    t, e = self.num_steps, self.num_envs
    flat = (idx % t) * e + idx // t   # row e * T + t is storage row t * E + e
    return jax.tree_util.tree_map(
        lambda x: _gather(x.reshape(t * e, *x.shape[2:]), flat), dict(data))

  def shard(self, num_shards: int) -> RolloutRows:
    """One device's share: its ``E / D`` envs, all T steps."""
    return dataclasses.replace(self, num_envs=self.num_envs // num_shards)

  def check_shardable(self, fn: str, lengths: dict[str, int] | None,
                      num_shards: int, axis: Any) -> None:
    del lengths
    if self.num_envs % num_shards:
      raise ValueError(
          f"{fn}: num_envs E = {self.num_envs} is not divisible by the size "
          f"{num_shards} of mesh axis {axis!r}: devices would hold different "
          "numbers of envs, hence rows, and disagree on the number of "
          "minibatches")


def _check_live(fn: str, where: str, leaf: Any) -> None:
  """Refuses a deleted (donated) array with a message naming it."""
  if _state.deleted(leaf):
    raise ValueError(
        f"{fn}: {where} is a deleted array (donated to an earlier call, e.g. "
        "a storage array of a state that a RolloutWriter consumed at a "
        "flush); read the writer's current `writer.state` instead")


def _is_state(fn: str, source: Any, name: str, expected: str) -> bool:
  """True for a RolloutState with keys, False for a non-empty dict of
  arrays with str keys; raises for anything else (``name``: the argument,
  ``expected``: the dict it should be)."""
  if isinstance(source, RolloutState):
    _state.check_state(fn, source, name)
    if not source.data:
      raise ValueError(f"{fn}: the RolloutState has no registered fields")
    return True
  if not isinstance(source, Mapping):
    raise TypeError(f"{fn}: `{name}` must be {expected} or a RolloutState, "
                    f"got {type(source).__name__}")
  _checks.check_str_keys(fn, name, source)
  if not source:
    raise ValueError(f"{fn}: `{name}` is empty (no fields)")
  _checks.check_arrays(fn, name, source)
  return False


def rows(fn: str, batch: Any
         ) -> tuple[Any, dict[str, PyTree], dict[str, int]]:
  """``(layout, data, {name: L_k})`` of a batch dict or a RolloutState.

  Raises:
    TypeError: ``batch`` is neither, or a dict key is not a str.
    ValueError: no fields, a field with no arrays, a scalar or zero-length
      array, or leaves of one key with different leading lengths.
  """
  batch, container = _state.batch_fields(batch)
  if _is_state(fn, batch, "batch", "a dict {name: array}"):
    n = batch.num_envs * batch.num_steps
    return (RolloutRows(batch.num_steps, batch.num_envs,
                        container=batch.container), dict(batch.data),
            {k: n for k in batch.data})
  lengths = {}
  for key, value in batch.items():
    leaves = jax.tree_util.tree_leaves_with_path(value)
    if not leaves:
      raise ValueError(f"{fn}: field {key!r} holds no arrays")
    first_path, first = leaves[0]
    for path, leaf in leaves:
      _check_live(fn, f"field {key!r}{jax.tree_util.keystr(path)}", leaf)
      shape = np.shape(leaf)
      if not shape:
        raise ValueError(
            f"{fn}: field {key!r}{jax.tree_util.keystr(path)} is a scalar; "
            "every array needs a leading row axis")
      if shape[0] != np.shape(first)[0]:
        raise ValueError(
            f"{fn}: field {key!r} has mismatched leading shapes: "
            f"{key!r}{jax.tree_util.keystr(first_path)} has "
            f"{np.shape(first)[0]} rows but "
            f"{key!r}{jax.tree_util.keystr(path)} has {shape[0]}")
    if np.shape(first)[0] == 0:
      raise ValueError(f"{fn}: field {key!r} has zero rows; every field "
                       "needs at least one")
    lengths[key] = np.shape(first)[0]
  return FlatRows(container=container), dict(batch), lengths


def env_rows(fn: str, data: Any
             ) -> tuple[Container | None, dict[str, PyTree], tuple[int, int]]:
  """``(container, data, (T, E))`` for sequences; every leaf shares ``[T,
  E]`` and every dict key is a str."""
  data, container = _state.batch_fields(data)
  if _is_state(fn, data, "data", "a dict of time-major [T, E, ...] arrays"):
    return (data.container, dict(data.data),
            (data.num_steps, data.num_envs))
  expected = None
  for path, leaf in jax.tree_util.tree_leaves_with_path(data):
    _check_live(fn, f"leaf {jax.tree_util.keystr(path)}", leaf)
    shape = tuple(np.shape(leaf)[:2])
    if len(shape) < 2:
      raise ValueError(f"{fn}: leaf {jax.tree_util.keystr(path)} has shape "
                       f"{np.shape(leaf)}, expected time-major [T, E, ...]")
    if expected is None:
      expected, first = shape, jax.tree_util.keystr(path)
    elif shape != expected:
      raise ValueError(
          f"{fn}: leaf {jax.tree_util.keystr(path)} has leading shape "
          f"{shape} but {first} has {expected}; every leaf must share "
          "[T, E]")
  if expected is None:
    raise ValueError(f"{fn}: `data` holds no arrays")
  if 0 in expected:
    raise ValueError(f"{fn}: [T, E] = {expected} has a zero-length axis")
  return container, dict(data), expected


def batch_rows(state: RolloutState, data: PyTree) -> PyTree:
  """Arrays computed after a rollout (``gae``'s ``[T, E, ...]`` advantages,
  returns) as rows of its env-major batch: row ``e * T + t`` is ``leaf[t,
  e]``. Each leaf's leading ``(T, E)`` is checked, so a forgotten transpose
  is an error, not misaligned rows; the structure of `data` is kept.

  Args:
    state: the rollout `data` belongs to (only its T and E are read).
    data: a pytree of ``[T, E, ...]`` arrays.

  Returns:
    The same pytree of ``[E * T, ...]`` arrays.

  Raises:
    TypeError: `state` is not a ``RolloutState``, or a leaf is not an array.
    ValueError: a leaf's leading shape is not ``(T, E)`` (the message says
      so when it is ``(E, T)``), or `data` holds no array.

  Example:
    >>> import numpy as np, jrollout as jr
    >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "t")
    >>> steps = np.array([[0, 10], [1, 11], [2, 12]], np.float32)  # [T, E]
    >>> batch, state = jr.make_batch(jr.update_all(state, {"t": steps}))
    >>> adv = steps + 100.0                       # e.g. from jr.gae, [T, E]
    >>> batch["t"].tolist()
    [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]
    >>> jr.batch_rows(state, {"adv": adv})["adv"].tolist()   # aligned
    [100.0, 101.0, 102.0, 110.0, 111.0, 112.0]
    >>> jr.batch_rows(state, adv.T)
    Traceback (most recent call last):
      ...
    ValueError: batch_rows: ... it is [E, T]; pass it time-major
  """
  fn = "batch_rows"
  state = _state.check_state(fn, state)
  want = (state.num_steps, state.num_envs)
  leaves = jax.tree_util.tree_leaves_with_path(data)
  if not leaves:
    raise ValueError(f"{fn}: `data` holds no array")
  for path, leaf in leaves:
    where = jax.tree_util.keystr(path) or "(the tree itself)"
    if not hasattr(leaf, "shape"):
      raise TypeError(f"{fn}: leaf {where} is a {type(leaf).__name__}, "
                      "expected an array [T, E, ...]")
    _check_live(fn, f"leaf {where}", leaf)
    got = tuple(np.shape(leaf)[:2])
    if got != want:
      hint = (": it is [E, T]; pass it time-major" if got == want[::-1]
              else "")
      raise ValueError(
          f"{fn}: leaf {where} has leading shape {got}, expected (T, E) = "
          f"{want} of the rollout{hint}")
  return jax.tree_util.tree_map(env_major, data)
