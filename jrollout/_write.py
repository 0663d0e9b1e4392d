"""Writes into a rollout state: ``update_at``, ``update_all``, their check.

A write is checked in plain Python against the registered fields (names,
leaf paths, shapes, dtypes), so a bad write raises at trace time and changes
nothing; a narrowing cast's values are checked eagerly or by ``checkify``.
Every write then runs one jitted kernel, ``write``: in-place row updates and
one update of the write counts.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jrollout import _casts
from jrollout import _checks
from jrollout import _state
from jrollout._state import is_array
from jrollout._state import RolloutState
from jrollout._types import Array, ArrayLike

# --- The check of a write. ---


class WritePlan(NamedTuple):
  """What a write that passed the static checks needs on every call.

  Attributes:
    narrow: ``(field, leaf index or None, leaf path, dtype)`` of each leaf
      whose cast narrows: its values are checked.
    host: the fields with a host (non-JAX) leaf, copied before the write.
  """
  narrow: tuple[tuple[str, int | None, str, np.dtype], ...]
  host: tuple[str, ...]


def check_values(fn: str, state: RolloutState, data: Any,
                 leading: tuple[int, ...], doc: str,
                 passed: dict[Any, WritePlan] | None = None) -> WritePlan:
  """Checks a write ``{name: [*leading, *shape]}`` (``as_values``' dict)
  against the fields; ``leading`` is ``(E,)`` or ``(T, E)`` (``doc``: their
  letters). ``passed`` caches plans by the values' types, shapes and dtypes
  (a ``RolloutWriter``'s); narrowing values are checked on every call.

  Raises:
    TypeError: not a dict; a value that is not an array of numbers (a torch
      tensor, a ragged list); a dtype not cast safely; a pytree of other
      containers.
    KeyError: an unregistered name.
    ValueError: a shape not ``[*leading, *shape]``; a missing or extra leaf;
      a concrete value that a narrowing cast would change.
  """
  if type(data) is not dict:
    raise TypeError(f"{fn}: `data` must be a dict {{name: array}}, got "
                    f"{type(data).__name__}")
  signature = plan = None
  if passed is not None:
    try:
      signature = (leading, jax.enable_x64.value, *[
          (k, type(v), v.shape, v.dtype) for k, v in data.items()])
      plan = passed.get(signature)
    except (AttributeError, TypeError):   # a pytree or list value
      signature = None
  if plan is None:
    plan = _check_static(fn, state, data, leading, doc)
    if signature is not None:
      passed[signature] = plan   # type: ignore[index]
  for key, index, path, dst in plan.narrow:
    leaf = data[key]
    if index is not None:
      leaf = jax.tree_util.tree_leaves(leaf)[index]
    _casts.check_narrowing(fn, key, leaf, dst, path)
  return plan


def _check_static(fn: str, state: RolloutState, data: Mapping[str, Any],
                  leading: tuple[int, ...], doc: str) -> WritePlan:
  narrow, host = [], []
  x64 = _checks.x64_enabled()
  for key, value in data.items():
    if key not in state.data:
      known = ", ".join(repr(k) for k in state.names) or "none"
      raise KeyError(
          f"{fn}: field {key!r} is not registered (registered: {known}); "
          f"call jr.register(state, {key!r}, shape=..., dtype=...) first")
    leaves = _leaves(fn, key, value, state.data[key])
    for index, (path, leaf, stored) in enumerate(leaves):
      where = f"field {key!r}{path}"
      if _checks.is_torch(leaf):
        raise TypeError(
            f"{fn}: {where} is a torch.Tensor; pass its numpy view "
            "`t.numpy()` (a CPU tensor, no copy) or import it with "
            "jrollout.torch.from_torch(t)")
      got = _checks.dtype_of(leaf, fn, where)
      if not (got == np.bool_ or jnp.issubdtype(got, jnp.number)):
        raise TypeError(f"{fn}: {where} has dtype {got}, not an array of "
                        f"numbers ({type(leaf).__name__})")
      shape, dst = tuple(stored.shape[2:]), np.dtype(stored.dtype)
      got_shape = tuple(_checks.shape_of(leaf, fn, where))
      if got_shape != leading + shape:
        raise ValueError(f"{fn}: {where} has shape {got_shape}, expected "
                         f"{leading + shape} = {doc} + {shape}")
      if not _casts.can_cast(got, dst):
        raise TypeError(
            f"{fn}: {where} has dtype {got.name}, which cannot be cast "
            f"safely to the registered dtype {dst.name}; cast it explicitly "
            f"(e.g. `.astype(jnp.{dst.name})`)")
      if _casts.narrows(got, dst, x64):
        narrow.append((key, index if path else None, path, dst))
      if not isinstance(leaf, jax.Array) and key not in host:
        host.append(key)
  return WritePlan(tuple(narrow), tuple(host))


def _leaves(fn: str, key: str, value: Any, storage: Any
            ) -> list[tuple[str, Any, Any]]:
  """``(" leaf <path>", leaf, stored)`` of each leaf of a field's value
  (``""`` for one array), the paths and containers matched to its
  storage's."""
  if is_array(storage):
    if isinstance(value, dict) or hasattr(type(value), "_fields") or (
        dataclasses.is_dataclass(value)):
      raise TypeError(
          f"{fn}: field {key!r} is registered as one array, got a "
          f"{type(value).__name__}; register a pytree field with "
          f"jr.register(state, {key!r}, like=value)")
    return [("", value, storage)]
  try:
    got, got_def = jax.tree_util.tree_flatten_with_path(value)
  except Exception as err:   # noqa: BLE001
    raise TypeError(f"{fn}: field {key!r} is not a pytree of arrays: "
                    f"{err}") from None
  want, want_def = jax.tree_util.tree_flatten_with_path(storage)
  if got_def != want_def:  # type: ignore[operator]
    got_paths = [jax.tree_util.keystr(p) for p, _ in got]
    want_paths = [jax.tree_util.keystr(p) for p, _ in want]
    missing = [p for p in want_paths if p not in got_paths]
    if missing:
      raise ValueError(
          f"{fn}: field {key!r} is missing leaf {missing[0]}"
          + (f" (and {missing[1:]})" if missing[1:] else "")
          + "; a write gives every leaf of a field")
    extra = [p for p in got_paths if p not in want_paths]
    if extra:
      raise ValueError(
          f"{fn}: field {key!r} has leaf {extra[0]}, which is not "
          f"registered (registered leaves: {want_paths})")
    raise TypeError(
        f"{fn}: field {key!r} has structure {got_def}, registered as "
        f"{want_def} (same leaves, other containers)")
  return [(f" leaf {jax.tree_util.keystr(path)}", leaf, stored)
          for (path, leaf), (_, stored) in zip(got, want)]


def check_step(fn: str, state: RolloutState, step: Any) -> int | None:
  """A write's step: its int if concrete (in ``[0, T)``), None if traced.

  Raises:
    TypeError: not an integer scalar (a bool, a float, an array).
    IndexError: a concrete step outside ``[0, T)``.
  """
  if type(step) is not int:
    dtype, shape = _checks.dtype_of(step, fn, "`step`"), _checks.shape_of(step)
    if shape != () or not jnp.issubdtype(dtype, jnp.integer):
      got = (f"{dtype.name} array of shape {shape}" if hasattr(step, "shape")
             else f"{type(step).__name__} {step!r}")
      raise TypeError(f"{fn}: `step` must be an integer scalar, got {got}")
    if isinstance(step, jax.core.Tracer):
      return None
  concrete = int(step)
  if not 0 <= concrete < state.num_steps:
    raise IndexError(
        f"{fn}: step {concrete} is outside the rollout [0, "
        f"{state.num_steps}) (num_steps={state.num_steps}); nothing was "
        "written")
  return concrete


def stage(state: RolloutState, data: dict[str, Any], plan: WritePlan
          ) -> dict[str, Any]:
  """``data`` with each host leaf copied into its field's dtype: JAX may
  read a numpy argument after a jitted call returns (XLA:CPU aliases an
  aligned one), and the caller may reuse its buffers at once."""
  if not plan.host:
    return data
  staged = dict(data)
  for key in plan.host:
    staged[key] = jax.tree_util.tree_map(   # the storage's structure: a list
        lambda s, v: v if isinstance(v, jax.Array) else np.array(v, s.dtype),
        state.data[key], data[key])
  return staged


# --- The write kernel. ---


def write(state: RolloutState, steps: Array | None, runs: dict[str, Any], *,
          contiguous: bool = False, guard: bool = False, signal: bool = False
          ) -> tuple[RolloutState, Array | None]:
  """The kernel of every write: ``(new state, done)``.

  ``runs[k]``: pieces of field ``k``, rows (leaves ``[E, ...]``) or blocks
  (``[n, E, ...]``). ``steps`` None: one piece, the whole rollout; ``[1]``:
  every row at that step (``guard``: a traced step outside ``[0, T)`` writes
  nothing and counts out of range); ``[sum(n)]``: one step per row, field
  after field (a repeated step keeps its last row; ``contiguous``: a block
  is one dynamic-update-slice at its first step). ``done`` (``signal``): a
  scalar ready once no input is read any more.
  """
  data, rows, offset = dict(state.data), {}, 0
  for key, pieces in runs.items():
    storage = data[key]
    if steps is None:
      data[key] = jax.tree_util.tree_map(
          lambda b, r: jnp.asarray(r, b.dtype), storage, pieces[0])
      rows[key] = state.num_steps
      continue
    ndim = jax.tree_util.tree_leaves(storage)[0].ndim
    n = 0
    for piece in pieces:
      first = jax.tree_util.tree_leaves(piece)[0]
      if jnp.ndim(first) < ndim:
        piece_rows = [piece]
      elif contiguous:
        at = steps[offset + n]
        storage = jax.tree_util.tree_map(
            lambda b, r, at=at: lax.dynamic_update_slice_in_dim(
                b, r.astype(b.dtype), at, 0), storage, piece)
        n += first.shape[0]
        continue
      else:
        piece_rows = [jax.tree_util.tree_map(lambda r, j=j: r[j], piece)
                      for j in range(first.shape[0])]
      for row in piece_rows:
        at = steps[0] if steps.shape[0] == 1 else steps[offset + n]
        storage = jax.tree_util.tree_map(
            lambda b, r, at=at: _set_row(b, r, at, guard), storage, row)
        n += 1
    data[key], rows[key] = storage, n
    offset += n
  counts, out_of_range = _record(state, rows, steps, guard=guard)
  done = jnp.sum(steps) if signal and steps is not None else None
  return state.replace(data=data, counts=counts,
                       out_of_range=out_of_range), done


def _record(state: RolloutState, rows: Mapping[str, int], steps: Array | None,
           *, guard: bool = False) -> tuple[Array, Array]:
  """``(counts, out_of_range)`` after a write of ``rows[k]`` rows of field
  ``k`` (static): every step once (``steps`` None), every row at ``steps[0]``
  (``[1]``; with ``guard`` it may be outside ``[0, T)``: counted there), or
  one step per row, field after field (``[sum(n)]``). Never a scatter."""
  names = state.names
  hits = np.zeros((len(names), 1), np.int32)
  for key, n in rows.items():
    hits[names.index(key)] = 1 if steps is None else n
  if steps is None:
    return state.counts + hits, state.out_of_range
  if steps.shape[0] == 1:
    step, out_of_range = steps[0], state.out_of_range
    if guard:
      in_range = ((step >= 0) & (step < state.num_steps)).astype(jnp.int32)
      out_of_range = out_of_range + hits[:, 0] * (1 - in_range)
      step, hits = jnp.clip(step, 0, state.num_steps - 1), hits * in_range
    column = lax.dynamic_slice_in_dim(state.counts, step, 1, axis=1)
    counts = lax.dynamic_update_slice_in_dim(state.counts, column + hits,
                                             step, axis=1)
    return counts, out_of_range
  t = lax.broadcasted_iota(jnp.int32, (1, state.num_steps), 1)
  per_key, offset = {}, 0
  for key, n in rows.items():
    written = steps[offset:offset + n, None] == t                  # [n, T]
    per_key[key] = jnp.sum(written, axis=0, dtype=jnp.int32)
    offset += n
  zero = jnp.zeros((state.num_steps,), jnp.int32)
  counts = state.counts + jnp.stack([per_key.get(k, zero) for k in names])
  return counts, state.out_of_range


def _set_row(buf: Array, row: Array, step: Array, guard: bool) -> Array:
  """``buf[step] = row``, in place; with ``guard`` a step outside ``[0, T)``
  writes nothing (a FILL_OR_DROP scatter: ``dynamic_update_slice`` would
  clamp it, ``x.at[-1]`` would wrap)."""
  row = jnp.asarray(row, buf.dtype)
  if not guard:
    return lax.dynamic_update_index_in_dim(buf, row, step, 0)
  return buf.at[step].set(row, mode="drop", wrap_negative_indices=False,
                          indices_are_sorted=True, unique_indices=True,
                          out_sharding=jax.typeof(buf).sharding)


STATIC = ("contiguous", "guard", "signal")
write_jit = jax.jit(write, static_argnames=STATIC)


def update_at(state: RolloutState, step: ArrayLike,
              data: dict[str, ArrayLike]) -> RolloutState:
  """Writes one step of some fields: ``storage[k][step] = data[k]``.

  Pure: inside ``jit``/``scan`` XLA updates the storage in place; from a
  Python loop use ``jr.RolloutWriter`` (a pure call copies each field).
  Values are cast to the field's dtype where safe (int to float, float64 to
  float32); a narrowing cast must keep every concrete value, and a traced
  one is checked by ``checkify``. Numpy arrays are copied before the call
  returns.

  Args:
    state: the rollout state.
    step: the step t, an int or integer scalar (traced is fine).
    data: ``{name: [E, *shape]}`` for any subset of the fields (a pytree
      field's value: its whole pytree), or a NamedTuple or dataclass of
      fields.

  Returns:
    A new state with the step written and its write counts increased.

  Raises:
    TypeError: not a RolloutState; a value that is not an array of numbers
      or a dtype not cast safely; a bad step.
    KeyError: an unregistered name.
    ValueError: a shape not ``[E, *shape]``; a concrete value the cast would
      change; a stack of states outside ``vmap``, or a consumed state.
    IndexError: a concrete step outside ``[0, T)``. A traced one writes
      nothing and counts in ``write_counts(state)[k].out_of_range``.

  Example:
    >>> import numpy as np, jrollout as jr
    >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "r")
    >>> state = jr.update_at(state, 1, {"r": np.array([5.0, 6.0])})
    >>> state.data["r"].tolist(), jr.write_counts(state)["r"].per_step.tolist()
    ([[0.0, 0.0], [5.0, 6.0], [0.0, 0.0]], [0, 1, 0])
  """
  fn = "update_at"
  _state.check_state(fn, state)
  concrete = check_step(fn, state, step)
  runs = _runs(fn, state, data, (state.num_envs,), "[E]")
  if not runs:
    return state
  if concrete is not None:
    return write_jit(state, np.array([concrete], np.int32), runs)[0]
  steps = jnp.reshape(jnp.asarray(step, jnp.int32), (1,))
  return write_jit(state, steps, runs, guard=True)[0]


def update_all(state: RolloutState,
               data: dict[str, ArrayLike]) -> RolloutState:
  """Writes whole rollouts of some fields: ``storage[k] = data[k]``.

  Counts as one write of every step of each field given; values are cast
  and checked as by ``update_at``.

  Args:
    state: the rollout state.
    data: ``{name: [T, E, *shape]}`` for any subset of the fields.

  Returns:
    A new state.

  Raises:
    KeyError, ValueError, TypeError: as for ``update_at``.

  Example:
    >>> import numpy as np, jrollout as jr
    >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "r")
    >>> state = jr.update_all(state, {"r": np.ones((3, 2), np.float32)})
    >>> jr.write_counts(state)["r"].per_step.tolist()     # each step once
    [1, 1, 1]
  """
  fn = "update_all"
  _state.check_state(fn, state)
  runs = _runs(fn, state, data, (state.num_steps, state.num_envs), "[T, E]")
  if not runs:
    return state
  return write_jit(state, None, runs)[0]


def _runs(fn: str, state: RolloutState, data: Any, leading: tuple[int, ...],
          doc: str) -> dict[str, Any]:
  """A pure write's checked, staged ``data`` as one piece per field."""
  data = _state.as_values(data)
  plan = check_values(fn, state, data, leading, doc)
  return {k: (v,) for k, v in stage(state, data, plan).items()}
