"""Pure functions over a RolloutState: init, register, writes, make_batch.

Every function returns a new state and never mutates its input. Shapes and
dtypes are checked in plain Python before any JAX op, so errors are raised at
trace time and a failed call changes nothing. Write tracking and the write
check belong to ``jrollout._ledger``; the env-major row order to
``jrollout._rows``.

The functions without a leading underscore that are not re-exported by
``jrollout`` (``prepare_step``, ``write_runs_inplace``,
``update_all_inplace``, ``close``) are the interface of
``jrollout._writer.RolloutWriter``.
"""

from __future__ import annotations

import functools
from typing import Any
import warnings

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from jrollout import _checks
from jrollout import _ledger
from jrollout import _rows
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
  num_envs = _checks.positive_int("init", "num_envs", num_envs)
  num_steps = _checks.positive_int("init", "num_steps", num_steps)
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
    ValueError: the key is already registered, the shape is negative, or
      the storage would not fit in memory addresses (its byte size
      overflows an int64).
    TypeError: ``state`` is not a RolloutState, the key is not a str, the
      shape is not a tuple of ints, or the dtype is not a numeric or bool
      dtype available without x64.
    MemoryError: eagerly, the device has no memory for the storage.
  """
  _checks.check_state("register", state)
  if not isinstance(key, str):
    raise TypeError(
        f"register: `key` must be a str, got {type(key).__name__} {key!r}")
  if key in state.data:
    shape0, dtype0 = state.spec(key)
    raise ValueError(
        f"register: key {key!r} is already registered (shape {shape0}, "
        f"dtype {dtype0.name}); each key is registered once")
  shape = _checks.check_shape("register", shape, key)
  dtype = _checks.check_dtype("register", key, dtype)
  t, e = state.num_steps, state.num_envs
  _checks.check_size("register", (t, e, *shape), dtype, key,
                     " = [T, E] + shape")
  row = sorted([*state.data, key]).index(key)

  def insert_zero_row(x):
    # A static slice-and-concatenate: jnp.insert handles any index and, when
    # traced (e.g. registration inside a jitted init), adds an argsort and a
    # cumsum per call, which made up most of the PPO example's extra ops.
    zero = jnp.zeros((1, *x.shape[1:]), x.dtype)
    return jnp.concatenate([x[:row], zero, x[row:]], axis=0)

  storage = _checks.zeros("register", (t, e, *shape), dtype, key,
                         " = [T, E] + shape")
  return state.replace(
      data={**state.data, key: storage},
      counts=insert_zero_row(state.counts),
      out_of_range=insert_zero_row(state.out_of_range),
  )


def prepare_step(fn: str, state: RolloutState, step: Any, values: Any
                 ) -> tuple[int | None, tuple[str, ...]]:
  """Validates a one-step write: ``(concrete step or None if traced,
  narrowing keys)``.

  The narrowing keys (``_checks.check_values``) are those whose values are
  checked on every write; the writer caches them with the write's
  signature and calls ``_checks.check_narrowing`` itself on later writes.
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
  narrow = _checks.check_values(fn, state, values, (state.num_envs,), "[E]")
  return concrete, narrow


def _write_row_or_drop(buf: Array, row: Array, step: Array) -> Array:
  """``buf[step] = row`` if ``0 <= step < T``, else ``buf`` unchanged.

  A one-row scatter in FILL_OR_DROP mode: an out-of-range step writes
  nothing (``dynamic_update_slice`` would clamp it onto the first or last
  step, and ``x.at[-1]`` would wrap to the last). One in-place op per key,
  with no read of the old row (``benchmarks/README.md`` compares the forms).
  """
  # Under explicit sharding the scatter must be told to keep buf's layout.
  return buf.at[step].set(row, mode="drop", wrap_negative_indices=False,
                          indices_are_sorted=True, unique_indices=True,
                          out_sharding=jax.typeof(buf).sharding)


def _write_step(state: RolloutState, step: Array, values: dict[str, Any],
                guard: bool) -> RolloutState:
  """One step: ``guard=False`` only for steps checked to be in range.

  One in-place op per key (a dynamic-update-slice, or for a traced step a
  dropping scatter) and the ledger's column update.
  """
  data = dict(state.data)
  step = jnp.asarray(step, jnp.int32)
  for key, value in values.items():
    row = jnp.asarray(value, data[key].dtype)
    if guard:
      data[key] = _write_row_or_drop(data[key], row, step)
    else:
      data[key] = lax.dynamic_update_index_in_dim(data[key], row, step, 0)
  counts, out_of_range = _ledger.record(state, values, step, guard=guard)
  return state.replace(data=data, counts=counts, out_of_range=out_of_range)


def _write_steps(state: RolloutState, steps: Array,
                 values: tuple[dict[str, Any], ...]) -> RolloutState:
  """Writes ``values[i]`` to the range-checked step ``steps[i]``, in order.

  A step written twice keeps its last value, as sequential ``update_at``.
  """
  for i, step_values in enumerate(values):
    state = _write_step(state, steps[i], step_values, guard=False)
  return state


_write_steps_jit = jax.jit(_write_steps)
_write_steps_donated = jax.jit(_write_steps, donate_argnums=0)
_write_traced_step = jax.jit(functools.partial(_write_step, guard=True))


@functools.lru_cache(maxsize=65536)
def _step_array(step: int) -> Array:
  """A cached device ``[1]`` array for a concrete step: no transfer per call.

  Made eagerly even when ``update_at`` is called with a Python int inside a
  ``jit`` trace: a cached tracer would leak into later programs.
  """
  with jax.ensure_compile_time_eval():
    return jnp.asarray([step], jnp.int32)


def update_at(state: RolloutState, step: ArrayLike,
              values: dict[str, ArrayLike]) -> RolloutState:
  """Writes one step of some keys: ``storage[k][step] = values[k]``.

  Pure: the input state is unchanged. Inside ``jit``/``scan`` XLA updates
  the buffer in place; from a Python loop use ``jr.RolloutWriter`` (or
  ``update_at_inplace``), which donate the state (each pure call copies
  every written key, O(T) per step).

  Args:
    state: the rollout state.
    step: the step t, a Python int or an integer scalar (traced is fine).
    values: ``{key: [E, *shape]}`` for any subset of the registered keys:
      JAX or numpy arrays (a CPU torch tensor as ``t.numpy()``). Safe casts
      (int to float, float64 to float32) are applied; a narrowing cast
      (int64 to int32, int32 to uint8, float64 to float32) must keep every
      concrete value (integers in range, finite floats finite). Traced
      values are converted as XLA converts (integers wrap, floats overflow
      to inf), and a ``checkify`` check reports it under
      ``checkify.checkify``.

  Returns:
    A new state with the step written and its write count increased.

  Raises:
    TypeError: ``state`` is not a RolloutState; a value that is not an
      array of numbers (a torch tensor, a ragged list); a dtype that
      cannot be cast safely (float to int, ...).
    KeyError: an unregistered key.
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
  concrete, narrow = prepare_step("update_at", state, step, values)
  if not values:
    return state
  if narrow:
    values = _checks.host_cast(state, values, narrow)
  if concrete is not None:
    return _write_steps_jit(state, _step_array(concrete), (dict(values),))
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
  used again (use the returned state). ``jr.RolloutWriter`` does the same
  and queues a few steps per dispatch, which costs less per step; inside
  ``jit``/``scan`` use ``update_at``, which XLA already does in place.
  ``step`` must be concrete here.

  If a buffer cannot be donated (for instance a torch tensor still views it
  through DLPack) JAX silently copies it instead, and every step then costs
  O(T). This function checks every buffer of the state after the call and
  warns once per process with a ``DonationWarning`` naming the keys and the
  fix. If warnings are errors, the raised ``DonationWarning`` carries the
  new state in ``.state``, so nothing is lost.

  Args:
    state: the rollout state (consumed).
    step: a concrete int step in ``[0, T)``.
    values: ``{key: [E, *shape]}``, cast as by ``update_at``.

  Returns:
    The new state.

  Raises:
    KeyError, ValueError, TypeError, IndexError: as ``update_at``, before
      anything is donated (``state`` stays usable); TypeError also for a
      traced step. A ``state`` consumed by an earlier donating call is a
      ValueError.
  """
  fn = "update_at_inplace"
  concrete, narrow = prepare_step(fn, state, step, values)
  if concrete is None:
    raise TypeError(
        f"{fn}: `step` must be concrete (a Python int); under jit use "
        "jr.update_at, which XLA already performs in place")
  if not values:
    return state
  if narrow:
    values = _checks.host_cast(state, values, narrow)
  return write_steps_inplace(fn, state, _step_array(concrete),
                             (dict(values),))


def write_steps_inplace(fn: str, state: RolloutState, steps: ArrayLike,
                        values: tuple[dict[str, Any], ...]) -> RolloutState:
  """Writes ``values[i]`` to step ``steps[i]`` (checked), donating ``state``.

  One dispatch for all the steps; warns (``DonationWarning``) if JAX copied
  a buffer instead of updating it in place.
  """
  new = _write_steps_donated(state, steps, values)
  _warn_if_not_donated(fn, state, new)
  return new


def _write_runs(state: RolloutState, steps: Array, runs: dict[str, Any],
                contiguous: bool) -> tuple[RolloutState, Array]:
  """Writes each key's queued rows; returns ``(state, done)``.

  ``runs[k]`` is a ``[n, E, *shape]`` array (a host block) or a tuple of
  ``n`` ``[E, *shape]`` rows. ``steps`` (``[sum(n)] int32``, each in range:
  checked by the caller) holds the step of every row, key after key in the
  sorted order of ``runs`` (the order jit flattens a dict in), rows in the
  order they were queued: a step written twice keeps its last row. With
  ``contiguous`` (static) every key's steps are ``s, s + 1, ...`` and a
  host block is written with one dynamic-update-slice; otherwise row by
  row. Every write is in place, and the ledger is one fused update.
  ``done`` is a scalar computed by the same program: once it is ready, no
  input is read any more.
  """
  data = dict(state.data)
  lengths = {}
  offset = 0
  for key, run in runs.items():
    dtype, n = data[key].dtype, len(run)
    lengths[key] = n
    if contiguous and not isinstance(run, tuple):
      data[key] = lax.dynamic_update_slice_in_dim(
          data[key], run.astype(dtype), steps[offset], 0)
    else:
      for j in range(n):
        data[key] = lax.dynamic_update_index_in_dim(
            data[key], run[j].astype(dtype), steps[offset + j], 0)
    offset += n
  counts = _ledger.record_rows(state, lengths, steps)
  return state.replace(data=data, counts=counts), jnp.sum(steps)


_write_runs_donated = jax.jit(_write_runs, donate_argnums=0,
                              static_argnames="contiguous")


def write_runs_inplace(fn: str, state: RolloutState, steps: np.ndarray,
                       runs: dict[str, Any], contiguous: bool
                       ) -> tuple[RolloutState, Array]:
  """``_write_runs`` donating ``state``: one dispatch, storage updated in
  place; warns (``DonationWarning``) if JAX copied a buffer instead."""
  new, done = _write_runs_donated(state, steps, runs, contiguous=contiguous)
  _warn_if_not_donated(fn, state, new)
  return new, done


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
  counts, out_of_range = _ledger.record(state, values, None)
  return state.replace(data=data, counts=counts, out_of_range=out_of_range)


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
    KeyError, ValueError, TypeError: as for ``update_at`` (the same casts
      and value checks).
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
  _checks.check_state(fn, state)
  narrow = _checks.check_values(fn, state, values,
                                (state.num_steps, state.num_envs), "[T, E]")
  if not values:
    return state
  if narrow:
    values = _checks.host_cast(state, values, narrow)
  write = _write_all_donated if donate else _write_all_jit
  return write(state, dict(values))


@jax.jit
def _flatten(data: dict[str, Array]) -> dict[str, Array]:
  return {k: _rows.env_major(v) for k, v in data.items()}


def close(fn: str, state: RolloutState, check: Any = True, *,
          flatten: bool = False
          ) -> tuple[dict[str, Array] | None, RolloutState]:
  """``(batch or None, state)``: the write check, then tracking reset.

  The body of ``make_batch`` (``flatten=True``) and ``finish_rollout``;
  ``fn`` names the public call in messages.
  """
  _checks.check_state(fn, state)
  _ledger.check(fn, state, check)
  batch = _flatten(state.data) if flatten else None
  return batch, _ledger.reset(state)


def finish_rollout(state: RolloutState, *,
                   check: bool | str = True) -> RolloutState:
  """Runs the write check and restarts write tracking, without flattening.

  The no-copy path: minibatch straight from the state (``scan_minibatches``
  and friends accept a RolloutState and gather from its ``[T, E, ...]``
  storage in env-major order), then call this to close the rollout.
  ``make_batch`` is this plus the flattened batch.

  The write check: every step of every key must have been written exactly
  once since the last ``make_batch``/``finish_rollout`` (a whole-rollout
  write counts once per step), and no write may have been aimed outside
  ``[0, T)``.

  - Eagerly, a failure raises ``IncompleteRolloutError`` (a ValueError)
    naming each bad key with its missing and duplicated steps.
  - Under ``jit``/``vmap``/``scan`` it is a ``checkify`` check: free, and
    dispatch stays asynchronous. Wrap the jitted function with
    ``jax.experimental.checkify.checkify`` to get failures back as an error
    value (``err.throw()`` raises on the host); without that wrapper the
    check compiles to nothing, and ``jr.is_complete(state)`` (taken before
    this call) is the flag to return and test.
  - ``check="callback"`` raises under ``jit`` too, through a host callback
    that runs only on failure; a callback makes JAX dispatch the whole
    program synchronously, so it costs time even when it never fires.
  - ``check=False`` skips the check.

  Args:
    state: the rollout state.
    check: True (default), False or ``"callback"``, as above.

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


def make_batch(state: RolloutState, *, check: bool | str = True
               ) -> tuple[dict[str, Array], RolloutState]:
  """Flattens the rollout into an env-major batch and restarts write tracking.

  ``batch[k][e * T + t] == state.data[k][t, e]`` (swap axes 0 and 1, then
  flatten them). The returned state keeps the storage values and has all
  write counts reset to zero, ready for the next rollout. The write check
  (and how it reports under ``jit``) is that of ``finish_rollout``.

  Args:
    state: the rollout state.
    check: True (default), False or ``"callback"`` (``finish_rollout``).

  Returns:
    ``(batch, new_state)`` with ``batch = {key: [E * T, *shape]}``.

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
