"""Pure functions over a RolloutState: init, register, writes, make_batch.

Every function returns a new state and never mutates its input. Shapes and
dtypes are checked in plain Python before any JAX op, so errors are raised at
trace time and a failed call changes nothing. Write tracking and the write
check belong to ``jrollout._ledger``; the env-major row order to
``jrollout._rows``.

Every write goes through one kernel, ``_write`` (jitted as is, and donating
the state): one step of some fields, queued runs of rows, or whole rollouts.
Every host-loop write (``update_at_inplace``, ``RolloutWriter``,
``compat.ExperienceBuffer``) goes through ``write_inplace``, the donating
call with its check that JAX really donated. Host values are copied first
(``_stage``), so a caller may reuse its numpy buffers once a call returns.

The functions without a leading underscore that are not re-exported by
``jrollout`` (``prepare_step``, ``write_inplace``, ``step_inplace``,
``write_all``, ``close``, ``host_copy``, ``aligned_empty``) are the
host-loop seam, the one internal interface other modules write through:
``jrollout._writer.RolloutWriter`` uses them, ``jrollout.compat`` only
``step_inplace`` (everything else it does goes through ``jrollout``'s
public functions).
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import sys
from typing import Any
import warnings

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jrollout import _checks
from jrollout import _containers
from jrollout import _ledger
from jrollout import _rows
from jrollout import _write_check
from jrollout._state import is_array
from jrollout._state import RolloutState
from jrollout._types import Array, ArrayLike, Check


def init(num_envs: int, num_steps: int, *, like: Any = None) -> RolloutState:
  """An empty rollout state for E = ``num_envs`` envs over T = ``num_steps``.

  Args:
    num_envs: E, a positive int.
    num_steps: T, a positive int.
    like: optional, one step of a whole transition: a dict, NamedTuple or
      registered dataclass (flax.struct, chex) of ``[E, ...]`` values (any
      pytree each). Every field is registered as by ``register(state,
      name, like=value)``, and for a NamedTuple or dataclass ``make_batch``
      and the minibatch functions return the batch in that type. Only
      shapes and dtypes are read.

  Returns:
    A RolloutState with no fields (or the fields of ``like``); add fields
    with ``register``.

  Raises:
    TypeError: ``like`` is not a dict or a container of named fields.
    ValueError: a field of ``like`` is None; and as for ``register``.

  Example:
    >>> import jrollout as jr
    >>> state = jr.init(num_envs=4, num_steps=8)
    >>> state = jr.register(state, "obs", shape=(3,))
    >>> state.data["obs"].shape
    (8, 4, 3)
  """
  num_envs = _checks.positive_int("init", "num_envs", num_envs)
  num_steps = _checks.positive_int("init", "num_steps", num_steps)
  state = RolloutState(data={}, counts=jnp.zeros((0, num_steps), jnp.int32),
                       out_of_range=jnp.zeros((0,), jnp.int32),
                       num_envs=num_envs, num_steps=num_steps)
  if like is None:
    return state
  if type(like) is dict:
    fields, container = like, None
  else:
    found = _containers.named_fields(like)
    if found is None:
      raise TypeError(
          "init: `like` must be one step of a transition: a dict, a "
          "NamedTuple or a registered dataclass of named fields, got "
          f"{type(like).__name__}")
    fields, container = found
  for name, value in fields.items():
    if value is None:
      raise ValueError(f"init: field {name!r} of `like` is None; give one "
                       "step's value of every field")
    state = _register("init", state, name, like=value)
  return state.replace(container=container)


def register(state: RolloutState, name: str, shape: tuple[int, ...] = (),
             dtype: Any = jnp.float32, *, like: Any = None) -> RolloutState:
  """Adds a field ``name`` with zero-initialised storage ``[T, E, *shape]``.

  With ``like``, one step's example value of the field (any pytree of
  ``[E, ...]`` arrays, e.g. ``{"pixels": [E, 64, 64, 3], "vec": [E, 8]}``),
  the storage is that pytree of ``[T, E, ...]`` leaves (only the leaves'
  shapes and dtypes are read; ``shape`` and ``dtype`` must be left out).
  Writes of the field then give the whole pytree, every leaf.

  Args:
    state: the rollout state.
    name: the new field's name (a str); registering a name twice is an
      error.
    shape: the per-env, per-step shape, ``()`` for a scalar.
    dtype: the storage dtype. 64-bit dtypes need ``jax_enable_x64``.
    like: optional, the field's value for one step (see above).

  Returns:
    A new state with the field added.

  Raises:
    ValueError: the name is already registered, the shape is negative, or
      the storage would not fit in memory addresses (its byte size
      overflows an int64).
    TypeError: ``state`` is not a RolloutState, the name is not a str, the
      shape is not a tuple of ints, or the dtype is not a numeric or bool
      dtype available without x64.
    MemoryError: eagerly, the device has no memory for the storage.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jrollout as jr
    >>> state = jr.init(num_envs=4, num_steps=8)
    >>> state = jr.register(state, "obs", shape=(3,))
    >>> state = jr.register(state, "done", dtype=jnp.bool_)
    >>> state.data["obs"].shape, state.data["done"].dtype    # [T, E, ...]
    ((8, 4, 3), dtype('bool'))
    >>> state.names, state.counts.shape     # write counts [K, T], names sorted
    (('done', 'obs'), (2, 8))
    >>> state = jr.register(state, "img", like={
    ...     "a": np.zeros((4, 2), np.float32), "b": np.zeros(4, bool)})
    >>> jax.tree.map(lambda x: x.shape, state.data["img"])
    {'a': (8, 4, 2), 'b': (8, 4)}
  """
  if like is not None and (shape != () or dtype is not jnp.float32):
    raise TypeError("register: give either `like` or `shape`/`dtype`, not "
                    "both")
  if isinstance(state, RolloutState) and state.container is not None:
    raise ValueError(
        f"register: this state holds the fields of a "
        f"{state.container.type_name} (init(like=...)), in which make_batch "
        f"returns the batch; field {name!r} would not be in it. Add it to "
        "the container type, or compute it after the rollout and align it "
        "with jr.batch_rows")
  return _register("register", state, name, shape, dtype, like=like)


def _register(fn: str, state: RolloutState, name: str,
              shape: tuple[int, ...] = (), dtype: Any = jnp.float32, *,
              like: Any = None) -> RolloutState:
  _checks.check_state(fn, state)
  if not isinstance(name, str):
    raise TypeError(
        f"{fn}: `name` must be a str, got {type(name).__name__} {name!r}")
  if name in state.data:
    if not is_array(state.data[name]):
      raise ValueError(f"{fn}: field {name!r} is already registered (a "
                       "pytree); each name is registered once")
    shape0, dtype0 = state.spec(name)
    raise ValueError(
        f"{fn}: field {name!r} is already registered (shape {shape0}, "
        f"dtype {dtype0.name}); each name is registered once")
  t, e = state.num_steps, state.num_envs
  if like is not None:
    storage = _like_storage(fn, state, name, like)
  else:
    shape = _checks.check_shape(fn, shape, name)
    dtype = _checks.check_dtype(fn, name, dtype)
    _checks.check_size(fn, (t, e, *shape), dtype, name, " = [T, E] + shape")
    storage = None
  row = sorted([*state.data, name]).index(name)

  def insert_zero_row(x):
    # A static slice-and-concatenate: jnp.insert handles any index and, when
    # traced (e.g. registration inside a jitted init), adds an argsort and a
    # cumsum per call, which made up most of the PPO example's extra ops.
    zero = jnp.zeros((1, *x.shape[1:]), x.dtype)
    return jnp.concatenate([x[:row], zero, x[row:]], axis=0)

  if storage is None:
    storage = _checks.zeros(fn, (t, e, *shape), dtype, name,
                            " = [T, E] + shape")
  return state.replace(
      data={**state.data, name: storage},
      counts=insert_zero_row(state.counts),
      out_of_range=insert_zero_row(state.out_of_range),
  )


def _like_storage(fn: str, state: RolloutState, name: str, like: Any) -> Any:
  """Zero storage ``[T, E, ...]`` for each leaf of one step's value ``like``
  (a bare array gives a flat field, as ``register(shape=, dtype=)``)."""
  t, e = state.num_steps, state.num_envs
  leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
  if not leaves:
    raise ValueError(f"{fn}: field {name!r}: `like` holds no arrays")
  zeros = []
  for path, leaf in leaves:
    where = f"field {name!r} leaf {jax.tree_util.keystr(path)}" if path else (
        f"field {name!r}")
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
      raise TypeError(f"{fn}: {where} of `like` is a {type(leaf).__name__}, "
                      "expected an array [E, ...] (its shape and dtype)")
    got = tuple(leaf.shape)
    if got[:1] != (e,):
      raise ValueError(f"{fn}: {where} of `like` has shape {got}, expected "
                       f"[E, ...] with E = {e} (one step of every env)")
    dtype = _checks.check_dtype(fn, name, leaf.dtype)
    _checks.check_size(fn, (t, *got), dtype, name, " = [T, E] + shape")
    zeros.append(_checks.zeros(fn, (t, *got), dtype, name,
                               " = [T, E] + shape"))
  return jax.tree_util.tree_unflatten(treedef, zeros)


def prepare_step(fn: str, state: RolloutState, step: Any, data: Any,
                 layout: _write_check.Layout | None = None
                 ) -> tuple[int | None, _write_check.WritePlan]:
  """Validates a one-step write: ``(concrete step or None if traced, plan)``.

  The plan (``_write_check.check_values``, cached by the write's signature;
  ``layout`` as there) names the fields whose values are checked on every
  write and the host arrays to copy (``_stage``).
  """
  _checks.check_state(fn, state)
  try:
    concrete = _checks.concrete_int(step)
  except TypeError as e:
    raise TypeError(f"{fn}: `step`: {e}") from None
  if concrete is not None and not 0 <= concrete < state.num_steps:
    raise IndexError(
        f"{fn}: step {concrete} is outside the rollout [0, "
        f"{state.num_steps}) (num_steps={state.num_steps}); nothing was "
        "written")
  if concrete is None and not jnp.issubdtype(jnp.result_type(step),
                                             jnp.integer):
    raise TypeError(f"{fn}: `step` must be an integer scalar, got dtype "
                    f"{jnp.result_type(step)}")
  if concrete is None and np.shape(step) != ():
    raise TypeError(f"{fn}: `step` must be a scalar, got shape "
                    f"{np.shape(step)}")
  plan = _write_check.check_values(fn, state, data, (state.num_envs,), "[E]",
                                   layout)
  return concrete, plan


def _stage(data: dict[str, Any], plan: _write_check.WritePlan
           ) -> dict[str, Any]:
  """``data`` with each host array copied into a new array of its field's
  dtype (``plan.host``, ``plan.host_trees``), once checked.

  JAX may read a numpy argument of a jitted call after the call returns
  (XLA:CPU aliases a 64-byte aligned one), so a caller that reuses its
  buffer at once could change what is written; the copy is the write's
  own. Cast on the host, a 64-bit value goes straight to the field's dtype
  (JAX would first cast int64 to int32, wrapping, without x64). One
  ``memcpy``-speed copy of the step, usually no more: an aligned copy is
  read by XLA without another.
  """
  if not (plan.host or plan.host_trees):
    return data
  staged = dict(data)
  for key, dtype in plan.host:
    staged[key] = host_copy(data[key], dtype)
  for key, dtypes in plan.host_trees:   # None: a JAX leaf, taken as it is
    leaves, treedef = jax.tree_util.tree_flatten(data[key])
    staged[key] = jax.tree_util.tree_unflatten(treedef, [
        v if d is None else host_copy(v, d)
        for v, d in zip(leaves, dtypes, strict=True)])
  return staged


def host_copy(value: Any, dtype: np.dtype) -> np.ndarray:
  """A new numpy array of ``value`` cast to ``dtype``, 64-byte aligned when
  large (XLA:CPU then reads it without a copy of its own)."""
  value = np.asarray(value)
  if value.size * dtype.itemsize < _ALIGN_FROM:
    return np.array(value, dtype)
  out = aligned_empty(value.shape, dtype)
  out[...] = value
  return out


_ALIGN_FROM = 1 << 16   # bytes: below this, an unaligned copy costs less


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
  """``np.empty`` at a 64-byte aligned address.

  XLA:CPU takes a numpy argument of a jitted call without a copy only when
  it is 64-byte aligned; large numpy allocations are not (glibc's mmap'd
  chunks start 16 bytes into a page).
  """
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape)) * dtype.itemsize
  raw = np.empty(nbytes + 64, np.uint8)
  start = -raw.ctypes.data % 64
  return raw[start:start + nbytes].view(dtype).reshape(shape)


def _write_row_or_drop(buf: Array, row: Array, step: Array) -> Array:
  """``buf[step] = row`` if ``0 <= step < T``, else ``buf`` unchanged.

  A one-row scatter in FILL_OR_DROP mode: an out-of-range step writes
  nothing (``dynamic_update_slice`` would clamp it onto the first or last
  step, and ``x.at[-1]`` would wrap to the last). One in-place op per field,
  with no read of the old row (``benchmarks/notes/findings.md`` compares
  the forms).
  """
  # Under explicit sharding the scatter must be told to keep buf's layout.
  return buf.at[step].set(row, mode="drop", wrap_negative_indices=False,
                          indices_are_sorted=True, unique_indices=True,
                          out_sharding=jax.typeof(buf).sharding)


def _write(state: RolloutState, steps: Array | None, runs: dict[str, Any], *,
           contiguous: bool = False, guard: bool = False, signal: bool = False
           ) -> tuple[RolloutState, Array | None]:
  """The write kernel of every write: ``(new state, done)``.

  ``runs[k]`` holds rows of field ``k``: a tuple of ``[E, *shape]`` rows, a
  block ``[n, E, *shape]`` or a single row ``[E, *shape]``. ``steps``
  says where they go:

  - None: each run is a whole rollout ``[T, E, *shape]`` (``update_all``);
  - ``[1] int32``: every row at that step (one step of several fields:
    ``update_at``); with ``guard`` (static) the step may be outside
    ``[0, T)`` (traced): it writes nothing and counts as out of range;
  - ``[sum(n)] int32``: the step of each row, field after field in the sorted
    order of ``runs`` (the order jit flattens a dict in), rows in the order
    they were queued (``RolloutWriter``); a step written twice keeps its
    last row. With ``contiguous`` (static) every field's steps are
    ``s, s + 1, ...`` and a block is written with one dynamic-update-slice.

  Every other row is one dynamic-update-slice (a dropping scatter with
  ``guard``): in place under ``jit``, or with the state donated. The
  ledger is one ``_ledger.record``. ``done``, with ``signal`` (static), is
  a scalar computed by the same program: once it is ready, no input is
  read any more (the writer then reuses its staging blocks); otherwise
  None (an output costs a few microseconds per call).
  """
  data = dict(state.data)
  rows = {}
  offset = 0
  for key, run in runs.items():
    buf = data[key]
    if not is_array(buf):   # a pytree field: the same writes, leaf by leaf
      data[key], rows[key] = _write_tree(buf, run, steps, offset, guard,
                                         state.num_steps, contiguous)
      if steps is not None:
        offset += rows[key]
      continue
    if steps is None:
      data[key], rows[key] = jnp.asarray(run, buf.dtype), state.num_steps
      continue
    if not isinstance(run, tuple) and jnp.ndim(run) < buf.ndim:
      run = (run,)
    if contiguous and not isinstance(run, tuple):   # a block, s, s + 1, ...
      buf = lax.dynamic_update_slice_in_dim(buf, run.astype(buf.dtype),
                                            steps[offset], 0)
    else:
      for j, row in enumerate(run):
        at = steps[0] if steps.shape[0] == 1 else steps[offset + j]
        row = jnp.asarray(row, buf.dtype)
        buf = (_write_row_or_drop(buf, row, at) if guard
               else lax.dynamic_update_index_in_dim(buf, row, at, 0))
    data[key] = buf
    rows[key] = len(run)
    offset += len(run)
  counts, out_of_range = _ledger.record(state, rows, steps, guard=guard)
  done = jnp.sum(steps) if signal and steps is not None else None
  return state.replace(data=data, counts=counts,
                       out_of_range=out_of_range), done


def _write_tree(buf: Any, run: Any, steps: Array | None, offset: int,
                guard: bool, num_steps: int, contiguous: bool = False
                ) -> tuple[Any, int]:
  """``_write`` of one pytree field: ``(new storage, rows written)``.

  ``run`` is the field's whole rollout (``steps`` None); of the field's
  structure, one row (leaves ``[E, ...]``) or a block of ``n`` rows (leaves
  ``[n, E, ...]``: the writer's staging blocks); or a tuple of rows (the
  writer's held JAX rows: never of the field's structure).
  """
  if steps is None:
    return jax.tree_util.tree_map(lambda b, r: jnp.asarray(r, b.dtype),
                                  buf, run), num_steps
  if (jax.tree_util.tree_structure(run)  # type: ignore[operator]
      == jax.tree_util.tree_structure(buf)):
    first, first_buf = (jax.tree_util.tree_leaves(run)[0],
                        jax.tree_util.tree_leaves(buf)[0])
    if jnp.ndim(first) < jnp.ndim(first_buf):
      run = (run,)
    elif contiguous:   # a block at s, s + 1, ...: one update per leaf
      new = jax.tree_util.tree_map(
          lambda b, r: lax.dynamic_update_slice_in_dim(
              b, r.astype(b.dtype), steps[offset], 0), buf, run)
      return new, first.shape[0]
    else:
      block = run
      run = tuple(jax.tree_util.tree_map(lambda r, j=j: r[j], block)
                  for j in range(first.shape[0]))
  for j, row in enumerate(run):
    at = steps[0] if steps.shape[0] == 1 else steps[offset + j]

    def one(b, r, at=at):
      r = jnp.asarray(r, b.dtype)
      return (_write_row_or_drop(b, r, at) if guard
              else lax.dynamic_update_index_in_dim(b, r, at, 0))

    buf = jax.tree_util.tree_map(one, buf, row)
  return buf, len(run)


_STATIC = ("contiguous", "guard", "signal")
_write_jit = jax.jit(_write, static_argnames=_STATIC)
_write_donated = jax.jit(_write, donate_argnums=0, static_argnames=_STATIC)


@functools.lru_cache(maxsize=65536)
def _step_array(step: int) -> Array:
  """A cached device ``[1]`` array for a concrete step: no transfer per call.

  Made eagerly even when ``update_at`` is called with a Python int inside a
  ``jit`` trace: a cached tracer would leak into later programs.
  """
  with jax.ensure_compile_time_eval():
    return jnp.asarray([step], jnp.int32)


def update_at(state: RolloutState, step: ArrayLike,
              data: dict[str, ArrayLike]) -> RolloutState:
  """Writes one step of some fields: ``storage[k][step] = data[k]``.

  Pure: the input state is unchanged. Inside ``jit``/``scan`` XLA updates
  the buffer in place; from a Python loop use ``jr.RolloutWriter`` (or
  ``update_at_inplace``), which donate the state (each pure call copies
  every written key, O(T) per step).

  Args:
    state: the rollout state.
    step: the step t, a Python int or an integer scalar (traced is fine).
    data: ``{name: [E, *shape]}`` for any subset of the registered fields:
      JAX or numpy arrays (a CPU torch tensor as ``t.numpy()``); a pytree
      field's value is its whole pytree (every leaf ``[E, ...]``); a
      NamedTuple or dataclass of fields (``init(like=)``) is read as the
      dict of its fields. Safe casts
      (int to float, float64 to float32) are applied; a narrowing cast
      (int64 to int32, int32 to uint8, float64 to float32) must keep every
      concrete value (integers in range, finite floats finite). Traced
      values are converted as XLA converts (integers wrap, floats overflow
      to inf), and a ``checkify`` check reports it under
      ``checkify.checkify``. Numpy arrays are copied before the call
      returns: the caller may reuse its buffers at once.

  Returns:
    A new state with the step written and its write count increased.

  Raises:
    TypeError: ``state`` is not a RolloutState; a value that is not an
      array of numbers (a torch tensor, a ragged list); a dtype that
      cannot be cast safely (float to int, ...).
    KeyError: an unregistered name.
    ValueError: a value's shape is not ``[E, *shape]``; a concrete value
      the cast would change; ``state`` is a stack of states outside
      ``jax.vmap``, or was consumed (donated) by an earlier call.
    IndexError: a concrete step outside ``[0, T)``. A traced step outside
      the range writes nothing; it is counted in
      ``write_counts(state)[key].out_of_range`` and
      reported by ``make_batch``.

  Example:
    >>> import numpy as np, jrollout as jr
    >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "r")
    >>> state = jr.update_at(state, 1, {"r": np.array([5.0, 6.0])})
    >>> state.data["r"].tolist()
    [[0.0, 0.0], [5.0, 6.0], [0.0, 0.0]]
    >>> jr.write_counts(state)["r"].per_step.tolist()
    [0, 1, 0]
  """
  data = _containers.as_values("update_at", data)
  concrete, plan = prepare_step("update_at", state, step, data)
  if not data:
    return state
  data = _stage(data, plan)
  if concrete is not None:
    return _write_jit(state, _step_array(concrete), data)[0]
  steps = jnp.reshape(jnp.asarray(step, jnp.int32), (1,))
  return _write_jit(state, steps, data, guard=True)[0]


class DonationWarning(RuntimeWarning):
  """A host-loop write could not update some storage in place.

  JAX copied the buffers it could not donate (most often because a torch
  tensor still views them through DLPack); the write itself is complete.
  Python's warning filter decides how often it shows: by default once per
  call site and message (``warnings.simplefilter("once",
  jr.DonationWarning)`` for once per process, ``"error"`` to raise it).

  Attributes:
    state: the new state the write produced. ``RolloutWriter`` and
      ``compat.ExperienceBuffer`` already hold it when the warning is
      issued; ``update_at_inplace`` raising this warning as an error (the
      input state may already be consumed) leaves it only here.

  Example:
    >>> import warnings, numpy as np, jrollout as jr
    >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "r")
    >>> view = np.asarray(state.data["r"])    # a live view blocks donation
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   state = jr.update_at_inplace(state, 0, {"r": np.ones(2)})
    >>> w = caught[0].message
    >>> type(w).__name__, w.state is state    # the write is complete
    ('DonationWarning', True)
  """

  def __init__(self, message: str, state: RolloutState | None = None):
    super().__init__(message)
    self.state = state


def update_at_inplace(state: RolloutState, step: int,
                      data: dict[str, ArrayLike]) -> RolloutState:
  """``update_at`` that donates ``state``: O(1) per step from a Python loop.

  The input ``state`` is consumed: its arrays are deleted and must not be
  used again (use the returned state). ``jr.RolloutWriter`` does the same
  and queues a few steps per dispatch, which costs less per step; inside
  ``jit``/``scan`` use ``update_at``, which XLA already does in place.
  ``step`` must be concrete here. Numpy arrays are copied before the call
  returns: the caller may reuse its buffers at once.

  If a buffer cannot be donated (for instance a torch tensor still views it
  through DLPack) JAX silently copies it instead, and every step then costs
  O(T). This function checks every buffer of the state after the call and
  warns with a ``DonationWarning`` naming the fields and the fix (shown as
  Python's warning filter says: by default once per call site). If
  warnings are errors, the raised ``DonationWarning`` carries the new
  state in ``.state``, so nothing is lost.

  Args:
    state: the rollout state (consumed).
    step: a concrete int step in ``[0, T)``.
    data: ``{name: [E, *shape]}``, cast as by ``update_at``.

  Returns:
    The new state.

  Raises:
    KeyError, ValueError, TypeError, IndexError: as ``update_at``, before
      anything is donated (``state`` stays usable); TypeError also for a
      traced step. A ``state`` consumed by an earlier donating call is a
      ValueError.

  Example:
    >>> import numpy as np, jrollout as jr
    >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "r")
    >>> old = state
    >>> for t in range(3):                     # a host loop
    ...   state = jr.update_at_inplace(state, t, {"r": np.array([t, 10 + t])})
    >>> state.data["r"].tolist()               # [T, E]
    [[0.0, 10.0], [1.0, 11.0], [2.0, 12.0]]
    >>> old.data["r"].is_deleted()             # the input was consumed
    True
  """
  return step_inplace("update_at_inplace", state, step, data)


Commit = Callable[[RolloutState, Array | None], None]


def step_inplace(fn: str, state: RolloutState, step: Any,
                 data: dict[str, ArrayLike], *, device: Any = None,
                 commit: Commit | None = None) -> RolloutState:
  """``update_at_inplace`` named ``fn`` in messages: checks, copies host
  arrays, puts the data on ``device`` if given, then ``write_inplace``
  (``commit`` as there)."""
  if type(data) is not dict:   # a container of fields (a dict: as it is)
    data = _containers.as_values(fn, data)
  # A state this function made carries its layout (the next write reads no
  # storage spec: a pytree field's costs a walk of its storage).
  layout = _write_check.kept_layout(state)
  concrete, plan = prepare_step(fn, state, step, data, layout)
  if concrete is None:
    raise TypeError(
        f"{fn}: `step` must be concrete (a Python int); under jit use "
        "jr.update_at, which XLA already performs in place")
  if not data:
    return state
  data = _stage(data, plan)
  if device is not None:
    data = jax.device_put(data, device)
  new = write_inplace(fn, state, _step_array(concrete), data,
                      commit=commit)[0]
  _write_check.keep_layout(new, layout if layout is not None
                           else _write_check.write_layout(new))
  return new


def write_inplace(fn: str, state: RolloutState, steps: Any,
                  runs: dict[str, Any], *, contiguous: bool = False,
                  signal: bool = False, commit: Commit | None = None
                  ) -> tuple[RolloutState, Array | None]:
  """The host-loop write: ``_write`` donating ``state``, ``(new, done)``.

  Every host-loop write goes through here (``update_at_inplace``,
  ``RolloutWriter``'s flushes and ``update_all``, ``ExperienceBuffer``):
  one dispatch, storage updated in place. ``steps`` and ``runs`` are as
  for ``_write``; their checks are the caller's.

  Then every storage buffer of ``state`` is asked whether JAX donated it
  (a key written whole is not asked: it gets a new buffer either way). If
  some were copied, a ``DonationWarning`` naming them is issued, after
  ``commit(new, done)``: a caller that keeps the state (a writer, a
  buffer object) stores it there, so a warning raised as an error loses
  nothing. The warning's text is fixed per ``fn`` and keys, so Python's
  filter shows it once per call site unless told otherwise.
  """
  if contiguous or signal:   # static arguments only where needed: faster
    new, done = _write_donated(state, steps, runs, contiguous=contiguous,
                               signal=signal)
  else:
    new, done = _write_donated(state, steps, runs)
  if commit is not None:
    commit(new, done)
  copied = sorted(k for k, v in state.data.items()
                  if (steps is not None or k not in runs)
                  and not _deleted(v))
  if copied:
    warnings.warn(DonationWarning(
        f"{fn}: the storage of {copied} was copied, not updated in place: "
        "JAX skipped donating it, most likely because a torch tensor "
        "(DLPack view) still shares that buffer. Every step now copies the "
        "whole rollout (O(T) per step). Fix: drop the views (`del tensor`) "
        "before writing, or export with jrollout.torch.to_torch(..., "
        "copy=True).", new), stacklevel=_caller_level())
  return new, done


def _deleted(field: Any) -> bool:
  """Whether every buffer of a field (an array or a pytree) was donated.

  A flat field's array is asked directly: ``isinstance(x, jax.Array)``
  costs several times the question, on every field of every step."""
  is_deleted = getattr(field, "is_deleted", None)
  if is_deleted is not None:
    return is_deleted()
  return all(getattr(x, "is_deleted", lambda: True)()   # a pytree field
             for x in _checks.storage_leaves(field))


def _caller_level() -> int:
  """The ``stacklevel`` of the first frame outside jrollout, for warnings."""
  frame, level = sys._getframe(1), 1
  while (frame.f_back is not None and frame.f_globals.get(
      "__name__", "").partition(".")[0] == "jrollout"):
    frame, level = frame.f_back, level + 1
  return level


def update_all(state: RolloutState,
               data: dict[str, ArrayLike]) -> RolloutState:
  """Writes whole rollouts of some fields: ``storage[k] = data[k]``.

  Counts as one write of every step of each field given.

  Args:
    state: the rollout state.
    data: ``{name: [T, E, *shape]}`` for any subset of the registered fields
      (numpy arrays are copied before the call returns).

  Returns:
    A new state.

  Raises:
    KeyError, ValueError, TypeError: as for ``update_at`` (the same casts
      and value checks).

  Example:
    >>> import numpy as np, jrollout as jr
    >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "r")
    >>> rewards = np.arange(6, dtype=np.float32).reshape(3, 2)   # [T, E]
    >>> state = jr.update_all(state, {"r": rewards})
    >>> state.data["r"].tolist()
    [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    >>> jr.write_counts(state)["r"].per_step.tolist()     # each step once
    [1, 1, 1]
  """
  return write_all("update_all", state, data, donate=False)


def update_all_inplace(state: RolloutState, data: dict[str, ArrayLike]
                       ) -> RolloutState:
  """``update_all`` that donates ``state``: whole rollouts, written in place.

  The input ``state`` is consumed as by ``update_at_inplace`` (with the same
  ``DonationWarning`` if a buffer could not be donated); a field written
  whole gets a new buffer either way, so what is saved is the copy of the
  fields not written. Inside ``jit`` use ``update_all``.

  Args:
    state: the rollout state (consumed).
    data: ``{name: [T, E, *shape]}``, cast as by ``update_at``.

  Returns:
    The new state.

  Raises:
    KeyError, ValueError, TypeError: as ``update_all``, before anything is
      donated (``state`` stays usable).

  Example:
    >>> import numpy as np, jrollout as jr
    >>> state = jr.register(jr.init(num_envs=2, num_steps=2), "r")
    >>> state = jr.register(state, "v")
    >>> old = state
    >>> state = jr.update_all_inplace(state, {"r": np.ones((2, 2))})
    >>> state.data["r"].tolist(), old.data["v"].is_deleted()
    ([[1.0, 1.0], [1.0, 1.0]], True)
  """
  return write_all("update_all_inplace", state, data)


def write_all(fn: str, state: RolloutState, data: dict[str, ArrayLike], *,
              donate: bool = True, commit: Commit | None = None
              ) -> RolloutState:
  """The body of ``update_all_inplace`` (``donate=False``: ``update_all``)
  for the host-loop writers; ``commit`` as for ``write_inplace``."""
  _checks.check_state(fn, state)
  data = _containers.as_values(fn, data)
  plan = _write_check.check_values(fn, state, data,
                                   (state.num_steps, state.num_envs), "[T, E]")
  if not data:
    return state
  data = _stage(data, plan)
  if donate:
    return write_inplace(fn, state, None, data, commit=commit)[0]
  return _write_jit(state, None, data)[0]


@jax.jit
def _flatten(data: dict[str, Any]) -> dict[str, Any]:
  return jax.tree_util.tree_map(_rows.env_major, data)


def close(fn: str, state: RolloutState, check: Any = "error", *,
          flatten: bool = False
          ) -> tuple[Any, RolloutState]:
  """``(batch or None, state)``: the write check, then tracking reset.

  The body of ``make_batch`` (``flatten=True``) and ``finish_rollout``;
  ``fn`` names the public call in messages.
  """
  _checks.check_state(fn, state)
  _ledger.check(fn, state, check)
  batch = _flatten(state.data) if flatten else None
  if batch is not None and state.container is not None:
    batch = state.container.rebuild(batch)
  return batch, _ledger.reset(state)


def finish_rollout(state: RolloutState, *,
                   check: Check = "error") -> RolloutState:
  """Runs the write check and restarts write tracking, without flattening.

  The no-copy path: minibatch straight from the state (``scan_minibatches``
  and friends accept a RolloutState and gather from its ``[T, E, ...]``
  storage in env-major order), then call this to close the rollout.
  ``make_batch`` is this plus the flattened batch.

  The write check: every step of every field must have been written exactly
  once since the last ``make_batch``/``finish_rollout`` (a whole-rollout
  write counts once per step), and no write may have been aimed outside
  ``[0, T)``.

  - Eagerly, a failure raises ``IncompleteRolloutError`` (a ValueError)
    naming each bad field with its missing and duplicated steps.
  - Under ``jit``/``vmap``/``scan`` it is a ``checkify`` check: free, and
    dispatch stays asynchronous. Wrap the jitted function with
    ``jax.experimental.checkify.checkify`` to get failures back as an error
    value (``err.throw()`` raises on the host); without that wrapper the
    check compiles to nothing, and ``jr.is_complete(state)`` (taken before
    this call) is the flag to return and test.
  - ``check="callback"`` raises under ``jit`` too, through a host callback
    that runs only on failure; a callback makes JAX dispatch the whole
    program synchronously, so it costs time even when it never fires.
  - ``check="off"`` skips the check.

  Args:
    state: the rollout state.
    check: ``"error"`` (default), ``"callback"`` or ``"off"``, as above.

  Returns:
    The state with the same storage and all write counts reset to zero.

  Raises:
    IncompleteRolloutError: eagerly, if the write check fails.

  Example:
    >>> import jax, numpy as np, jrollout as jr
    >>> from jax.experimental import checkify
    >>> state = jr.register(jr.init(num_envs=2, num_steps=2), "r")
    >>> state = jr.update_at(state, 0, {"r": np.ones(2)})   # step 1 missing
    >>> close = jax.jit(checkify.checkify(jr.finish_rollout))
    >>> err, _ = close(state)
    >>> print(err.get().split(" (")[0])
    finish_rollout: the rollout is not complete
  """
  return close("finish_rollout", state, check)[1]


def make_batch(state: RolloutState, *, check: Check = "error"
               ) -> tuple[Any, RolloutState]:
  """Flattens the rollout into an env-major batch and restarts write tracking.

  ``batch[k][e * T + t] == state.data[k][t, e]`` (swap axes 0 and 1, then
  flatten them). The returned state keeps the storage values and has all
  write counts reset to zero, ready for the next rollout. The write check
  (and how it reports under ``jit``) is that of ``finish_rollout``.

  Args:
    state: the rollout state.
    check: ``"error"`` (default), ``"callback"`` or ``"off"``
      (``finish_rollout``).

  Returns:
    ``(batch, new_state)`` with ``batch = {name: [E * T, *shape]}`` (a
    pytree field: its pytree of ``[E * T, ...]`` leaves); for a state made
    with ``init(like=transition)`` of a NamedTuple or dataclass, the batch
    is that type holding the rows.

  Raises:
    IncompleteRolloutError: eagerly, if the write check fails; nothing is
      returned and ``state`` is unchanged.

  Example:
    >>> import numpy as np, jrollout as jr
    >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "t")
    >>> steps = np.array([[0, 10], [1, 11], [2, 12]], np.float32)  # [T, E]
    >>> batch, state = jr.make_batch(jr.update_all(state, {"t": steps}))
    >>> batch["t"].tolist()      # env 0's steps, then env 1's
    [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]
  """
  batch, state = close("make_batch", state, check, flatten=True)
  assert batch is not None
  return batch, state
