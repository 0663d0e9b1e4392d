"""Pure functions over a RolloutState: init, register, writes, make_batch.

Every function returns a new state and never mutates its input. Shapes and
dtypes are checked in plain Python before any JAX op, so errors are raised at
trace time and a failed call changes nothing.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple
import warnings

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jrollout import _checks
from jrollout._state import RolloutState
from jrollout._types import Array, ArrayLike


def init(num_envs: int, num_steps: int) -> RolloutState:
  """An empty rollout state for E = ``num_envs`` envs over T = ``num_steps``.

  Args:
    num_envs: E, a positive int.
    num_steps: T, a positive int.

  Returns:
    A RolloutState with no keys; add them with ``register``.

  Example:
    >>> import jrollout as jr
    >>> state = jr.init(num_envs=4, num_steps=8)
    >>> state = jr.register(state, "obs", shape=(3,))
    >>> state.data["obs"].shape
    (8, 4, 3)
  """
  num_envs = _checks.check_size("init", "num_envs", num_envs)
  num_steps = _checks.check_size("init", "num_steps", num_steps)
  return RolloutState(data={}, counts=jnp.zeros((0, num_steps), jnp.int32),
                      out_of_range=jnp.zeros((0,), jnp.int32),
                      num_envs=num_envs, num_steps=num_steps)


def register(state: RolloutState, key: str, shape: tuple[int, ...] = (),
             dtype: Any = jnp.float32) -> RolloutState:
  """Adds a key with zero-initialised storage ``[T, E, *shape]``.

  Args:
    state: the rollout state.
    key: a new key (a str); registering a key twice is an error.
    shape: the per-env, per-step shape, ``()`` for a scalar.
    dtype: the storage dtype. 64-bit dtypes need ``jax_enable_x64``.

  Returns:
    A new state with the key added.

  Raises:
    ValueError: the key is already registered, or the shape is negative.
    TypeError: the key is not a str, or the dtype is not available.
  """
  if not isinstance(key, str):
    raise TypeError(
        f"register: `key` must be a str, got {type(key).__name__} {key!r}")
  if key in state.data:
    shape0, dtype0 = state.spec(key)
    raise ValueError(
        f"register: key {key!r} is already registered (shape {shape0}, "
        f"dtype {np.dtype(dtype0).name}); each key is registered once")
  shape = _checks.check_shape("register", key, shape)
  dtype = _checks.check_dtype("register", key, dtype)
  t, e = state.num_steps, state.num_envs
  row = sorted([*state.data, key]).index(key)
  return state.replace(
      data={**state.data, key: jnp.zeros((t, e, *shape), dtype)},
      counts=jnp.insert(state.counts, row, 0, axis=0),
      out_of_range=jnp.insert(state.out_of_range, row, 0),
  )


def _prepare_step(fn: str, state: RolloutState, step: Any,
                  values: Any) -> int | None:
  """Validates a one-step write; returns the concrete step or None if traced."""
  _checks.check_values(fn, state, values, (state.num_envs,), "[E]")
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
  return concrete


def _written_rows(state: RolloutState, keys) -> np.ndarray:
  """``[K, 1]`` int32: 1 in the rows of ``keys`` in the ``[K, T]`` counts."""
  order = state.keys
  hits = np.zeros((len(order), 1), np.int32)
  hits[[order.index(k) for k in keys]] = 1
  return hits


def _write_row_or_drop(buf: Array, row: Array, step: Array) -> Array:
  """``buf[step] = row`` if ``0 <= step < T``, else ``buf`` unchanged.

  A one-row scatter in FILL_OR_DROP mode: an out-of-range step writes
  nothing (``dynamic_update_slice`` would clamp it onto the first or last
  step, and ``x.at[-1]`` would wrap to the last). One in-place op per key;
  a clamped update of ``where(in_range, row, old_row)`` needs a read of the
  old row too, which cost 1.8x more in a vmapped ``lax.scan`` on XLA:CPU.
  """
  # Under explicit sharding the scatter must be told to keep buf's layout.
  return buf.at[step].set(row, mode="drop", wrap_negative_indices=False,
                          indices_are_sorted=True, unique_indices=True,
                          out_sharding=jax.typeof(buf).sharding)


def _write_step(state: RolloutState, step: Array, values: dict[str, Any],
                guard: bool) -> RolloutState:
  """The write itself. ``guard=False`` only for steps checked to be in range.

  One in-place op per key (a dynamic-update-slice, or for a traced step a
  dropping scatter) and one for the counts: column ``step`` of ``[K, T]``
  plus a static 0/1 column for the keys written. (A multi-index scatter
  into the counts cost more than all the storage writes together inside a
  small-E ``lax.scan`` on XLA:CPU.)
  """
  t = state.num_steps
  data = dict(state.data)
  hits = _written_rows(state, values)
  step = jnp.asarray(step, jnp.int32)
  if guard:
    in_range = (step >= 0) & (step < t)
    safe = jnp.clip(step, 0, t - 1)
  else:
    safe = step
  for key, value in values.items():
    buf = data[key]
    row = jnp.asarray(value, buf.dtype)
    if guard:
      data[key] = _write_row_or_drop(buf, row, step)
    else:
      data[key] = lax.dynamic_update_index_in_dim(buf, row, step, 0)
  column = lax.dynamic_slice_in_dim(state.counts, safe, 1, axis=1)
  if guard:
    hit = in_range.astype(jnp.int32)
    counts = lax.dynamic_update_slice_in_dim(
        state.counts, column + hits * hit, safe, axis=1)
    oor = state.out_of_range + hits[:, 0] * (1 - hit)
    return state.replace(data=data, counts=counts, out_of_range=oor)
  counts = lax.dynamic_update_slice_in_dim(state.counts, column + hits, safe,
                                           axis=1)
  return state.replace(data=data, counts=counts)


_write_checked_step = jax.jit(functools.partial(_write_step, guard=False))
_write_traced_step = jax.jit(functools.partial(_write_step, guard=True))
_write_checked_step_donated = jax.jit(
    functools.partial(_write_step, guard=False), donate_argnums=0)


@functools.lru_cache(maxsize=65536)
def _step_array(step: int) -> Array:
  """A cached device scalar for a concrete step: no host transfer per call."""
  return jnp.asarray(step, jnp.int32)


def update_at(state: RolloutState, step: ArrayLike,
              values: dict[str, ArrayLike]) -> RolloutState:
  """Writes one step of some keys: ``storage[k][step] = values[k]``.

  Pure: the input state is unchanged. Inside ``jit``/``scan`` XLA updates
  the buffer in place; from a Python loop use ``update_at_inplace``, which
  donates the state (each pure call copies every written key, O(T) per step).

  Args:
    state: the rollout state.
    step: the step t, a Python int or an integer scalar (traced is fine).
    values: ``{key: [E, *shape]}`` for any subset of the registered keys.
      Safe casts (int to float, float64 to float32) are applied.

  Returns:
    A new state with the step written and its write count increased.

  Raises:
    KeyError: an unregistered key.
    ValueError: a value's shape is not ``[E, *shape]``.
    TypeError: a dtype that cannot be cast safely (float to int, ...).
    IndexError: a concrete step outside ``[0, T)``. A traced step outside
      the range writes nothing; it is counted in
      ``write_counts(state)[key].out_of_range`` and
      reported by ``make_batch``.
  """
  concrete = _prepare_step("update_at", state, step, values)
  if not values:
    return state
  if concrete is not None:
    return _write_checked_step(state, _step_array(concrete), dict(values))
  return _write_traced_step(state, step, dict(values))


class DonationWarning(RuntimeWarning):
  """``update_at_inplace`` could not update some storage in place.

  Attributes:
    state: the new state the call produced. When warnings are turned into
      errors the call raises this warning instead of returning; the input
      state may already be consumed, so recover the result from here.
  """

  def __init__(self, message: str, state: RolloutState | None = None):
    super().__init__(message)
    self.state = state


_donation_warned = False


def update_at_inplace(state: RolloutState, step: int,
                      values: dict[str, ArrayLike]) -> RolloutState:
  """``update_at`` that donates ``state``: O(1) per step from a Python loop.

  The input ``state`` is consumed: its arrays are deleted and must not be
  used again (use the returned state). Use this in host-driven collection
  loops (e.g. a torch simulator); inside ``jit``/``scan`` use ``update_at``,
  which XLA already does in place. ``step`` must be concrete here.

  If a buffer cannot be donated (for instance a torch tensor still views it
  through DLPack) JAX silently copies it instead, and every step then costs
  O(T). This function checks every buffer of the state after the call and
  warns once per process with a ``DonationWarning`` naming the keys and the
  fix. If warnings are errors, the raised ``DonationWarning`` carries the
  new state in ``.state``, so nothing is lost.

  Args:
    state: the rollout state (consumed).
    step: a concrete int step in ``[0, T)``.
    values: ``{key: [E, *shape]}``.

  Returns:
    The new state.
  """
  concrete = _prepare_step("update_at_inplace", state, step, values)
  if concrete is None:
    raise TypeError(
        "update_at_inplace: `step` must be concrete (a Python int); under "
        "jit use jr.update_at, which XLA already performs in place")
  if not values:
    return state
  new = _write_checked_step_donated(state, _step_array(concrete),
                                    dict(values))
  _warn_if_not_donated("update_at_inplace", state, new)
  return new


def _warn_if_not_donated(fn: str, state: RolloutState, new: RolloutState,
                         skip: frozenset[str] = frozenset()) -> None:
  global _donation_warned
  if _donation_warned:
    return
  kept = sorted(k for k, v in state.data.items() if k not in skip
                and not getattr(v, "is_deleted", lambda: True)())
  if kept:
    _donation_warned = True
    warnings.warn(DonationWarning(
        f"{fn}: the storage of {kept} was copied, not updated in place: JAX "
        "skipped donating it, most likely because a torch tensor (DLPack "
        "view) still shares that buffer. Every step now copies the whole "
        "rollout (O(T) per step). Fix: drop the views (`del tensor`) before "
        "writing, or export with jrollout.torch.to_torch(..., copy=True). "
        "(Warned once.)", new), stacklevel=3)


def _write_all(state: RolloutState, values: dict[str, Any]) -> RolloutState:
  data = dict(state.data)
  for key, value in values.items():
    data[key] = jnp.asarray(value, data[key].dtype)
  counts = state.counts + _written_rows(state, values)
  return state.replace(data=data, counts=counts)


_write_all_jit = jax.jit(_write_all)
_write_all_donated = jax.jit(_write_all, donate_argnums=0)


def update_all(state: RolloutState,
               values: dict[str, ArrayLike]) -> RolloutState:
  """Writes whole rollouts of some keys: ``storage[k] = values[k]``.

  Counts as one write of every step of each key given.

  Args:
    state: the rollout state.
    values: ``{key: [T, E, *shape]}`` for any subset of the registered keys.

  Returns:
    A new state.

  Raises:
    KeyError, ValueError, TypeError: as for ``update_at``.
  """
  return _update_all(state, values, fn="update_all", donate=False)


def update_all_inplace(state: RolloutState, values: dict[str, ArrayLike], *,
                       fn: str = "update_all") -> RolloutState:
  """``update_all`` that donates ``state`` (for the host-loop writer)."""
  new = _update_all(state, values, fn=fn, donate=True)
  if new is not state:
    # A key written whole gets a new buffer either way: check the others.
    _warn_if_not_donated(fn, state, new, skip=frozenset(values))
  return new


def _update_all(state: RolloutState, values: dict[str, ArrayLike], *,
                fn: str, donate: bool) -> RolloutState:
  _checks.check_values(fn, state, values, (state.num_steps, state.num_envs),
                       "[T, E]")
  if not values:
    return state
  write = _write_all_donated if donate else _write_all_jit
  return write(state, dict(values))


def _env_major(x: Array) -> Array:
  """``[T, E, *s] -> [E * T, *s]`` with row ``e * T + t`` = ``x[t, e]``."""
  return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


@jax.jit
def _flatten(data: dict[str, Array]) -> dict[str, Array]:
  return {k: _env_major(v) for k, v in data.items()}


def _reset_tracking(state: RolloutState) -> RolloutState:
  # Outside any jit that returns the storage: a jitted function returning
  # the whole state would copy every storage buffer (no donation).
  return state.replace(counts=jnp.zeros_like(state.counts),
                       out_of_range=jnp.zeros_like(state.out_of_range))


def _is_concrete(tree) -> bool:
  return not any(isinstance(x, jax.core.Tracer)
                 for x in jax.tree_util.tree_leaves(tree))


def _host_check(fn: str, keys: tuple[str, ...], counts, out_of_range) -> None:
  """Raises IncompleteRolloutError for host counts ``[..., K, T]``.

  Leading axes, if any, are a ``vmap``-ed stack of buffers; the message
  names the first incomplete one.
  """
  counts, out_of_range = np.asarray(counts), np.asarray(out_of_range)
  for index in np.ndindex(counts.shape[:-2]):
    _checks.raise_if_incomplete(
        {k: counts[index][i] for i, k in enumerate(keys)},
        {k: out_of_range[index][i] for i, k in enumerate(keys)}, fn,
        f" (buffer {index} of a vmapped stack)" if index else "")


@functools.lru_cache(maxsize=None)
def _traced_check(fn: str, keys: tuple[str, ...]):
  """The write check for traced counts: a host callback, only on failure.

  ``lax.cond`` skips the callback when the rollout is complete, so a check
  inside a jitted training loop costs a few comparisons. Under ``vmap`` a
  batched predicate would turn the cond into a select that always calls
  back; the custom vmap rule instead reduces the predicate over the whole
  stack (recursively for nested vmaps) and calls back once, with the stack,
  only if some buffer is incomplete.
  """
  def report(counts, out_of_range):
    _host_check(fn, keys, counts, out_of_range)

  def complete(counts, out_of_range):
    return jnp.all(counts == 1) & jnp.all(out_of_range == 0)

  @jax.custom_batching.custom_vmap
  def check(counts, out_of_range):
    lax.cond(complete(counts, out_of_range),
             lambda c, o: None,
             lambda c, o: jax.debug.callback(report, c, o),
             counts, out_of_range)
    return complete(counts, out_of_range)

  @check.def_vmap
  def check_stack(axis_size, in_batched, counts, out_of_range):
    counts, out_of_range = (
        x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
        for x, batched in zip((counts, out_of_range), in_batched))
    check(counts, out_of_range)    # one cond for the whole stack
    per_buffer = (jnp.all(counts == 1, axis=(1, 2))
                  & jnp.all(out_of_range == 0, axis=1))
    return per_buffer, True

  return check


def finish_rollout(state: RolloutState, *, check: bool = True) -> RolloutState:
  """Runs the write check and restarts write tracking, without flattening.

  The no-copy path: minibatch straight from the state (``scan_minibatches``
  and friends accept a RolloutState and gather from its ``[T, E, ...]``
  storage in env-major order), then call this to close the rollout.
  ``make_batch`` is this plus the flattened batch.

  The write check: every step of every key must have been written exactly
  once since the last ``make_batch``/``finish_rollout`` (a whole-rollout
  write counts once per step), and no write may have been aimed outside
  ``[0, T)``.
  - Called eagerly, a failure raises ``IncompleteRolloutError`` (a
    ValueError) naming each bad key with its missing and duplicated steps.
  - Under ``jit``/``vmap``/``scan`` the same check runs on the host through
    ``jax.debug.callback``; a failure makes the jitted call raise a
    ``JaxRuntimeError`` whose message contains the same text. Use
    ``jr.is_complete(state)`` for a traced boolean flag instead, and
    ``check=False`` to skip the callback (for speed).
  - A host callback in a jitted program costs dispatch, even when it never
    fires: JAX calls such a program through its Python path and, on
    XLA:CPU, runs it synchronously, so the call returns only when the work
    is done (a 10-update PPO call returned after 36.4 ms of its 36.4 ms
    with the check, after 0.41 ms without: ``jax`` 0.10.2, 2-core CPU), and
    the PPO example ran 4-6% faster without it. For asynchronous dispatch,
    pass ``check=False`` and return
    ``jr.is_complete(state)`` (taken before this call) as an output to
    test on the host.

  Args:
    state: the rollout state.
    check: run the write check (default True).

  Returns:
    The state with the same storage and all write counts reset to zero.

  Raises:
    IncompleteRolloutError: eagerly, if the write check fails.
  """
  return _finish(state, check, "finish_rollout")


def _finish(state: RolloutState, check: bool, fn: str) -> RolloutState:
  _check(fn, state, check)
  return _reset_tracking(state)


def _check(fn: str, state: RolloutState, check: bool) -> None:
  if not check:
    return
  if _is_concrete((state.counts, state.out_of_range)):
    _host_check(fn, state.keys, *jax.device_get((state.counts,
                                                  state.out_of_range)))
  else:
    _traced_check(fn, state.keys)(state.counts, state.out_of_range)


def make_batch(state: RolloutState, *,
               check: bool = True) -> tuple[dict[str, Array], RolloutState]:
  """Flattens the rollout into an env-major batch and restarts write tracking.

  ``batch[k][e * T + t] == state.data[k][t, e]`` (swap axes 0 and 1, then
  flatten them). The returned state keeps the storage values and has all
  write counts reset to zero, ready for the next rollout. The write check
  (and how it reports under ``jit``) is that of ``finish_rollout``.

  Args:
    state: the rollout state.
    check: run the write check (default True).

  Returns:
    ``(batch, new_state)`` with ``batch = {key: [E * T, *shape]}``.

  Raises:
    IncompleteRolloutError: eagerly, if the write check fails; nothing is
      returned and ``state`` is unchanged.
  """
  return _make_batch(state, check, "make_batch")


def _make_batch(state: RolloutState, check: bool,
                fn: str) -> tuple[dict[str, Array], RolloutState]:
  _check(fn, state, check)
  return _flatten(state.data), _reset_tracking(state)


def is_complete(state: RolloutState) -> Array:
  """A bool scalar: every step of every key written exactly once, none outside.

  Works under ``jit`` and ``vmap`` (the traced-flag form of ``make_batch``'s
  check).
  """
  return jnp.all(state.counts == 1) & jnp.all(state.out_of_range == 0)


class WriteCounts(NamedTuple):
  """Write tracking of one key since the last ``make_batch``.

  Attributes:
    per_step: ``[T] int32``, how many times each step was written.
    out_of_range: ``[] int32``, writes aimed outside ``[0, T)`` (dropped).
  """
  per_step: Array
  out_of_range: Array


def write_counts(state: RolloutState) -> dict[str, WriteCounts]:
  """``{key: WriteCounts(per_step=[T], out_of_range=[])}``."""
  return {k: WriteCounts(state.counts[i], state.out_of_range[i])
          for i, k in enumerate(state.keys)}


