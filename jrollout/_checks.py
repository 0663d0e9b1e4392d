"""Trace-time validators: sizes, shapes, dtypes, casts, steps and writes.

Everything here that raises does so in plain Python on static information
(shapes, dtypes, tree structure, concrete integers), before any JAX op runs,
so a failed call never leaves a half-updated state behind.
"""

from __future__ import annotations

from collections.abc import Mapping
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jrollout._state import RolloutState


def positive_int(fn: str, name: str, value: Any) -> int:
  """``value`` as a positive Python int: the one check for sizes and counts.

  Raises:
    TypeError: ``value`` is not an integer (a bool or a float included),
      naming ``fn``, ``name`` and what was given.
    ValueError: ``value`` is not positive.
  """
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{fn}: `{name}` must be an int, got bool {bool(value)}")
  try:
    size = operator.index(value)
  except TypeError:
    raise TypeError(
        f"{fn}: `{name}` must be an int, got {type(value).__name__} "
        f"{value!r}") from None
  if size <= 0:
    raise ValueError(f"{fn}: `{name}` must be positive, got {size}")
  return size


def check_discount(fn: str, name: str, value: Any) -> None:
  """A discount-like factor: in ``[0, 1]`` if a Python number, else 0-d.

  Raises:
    TypeError: a bool.
    ValueError: a number outside ``[0, 1]``, or an array that is not a
      scalar (traced values are not range-checked).
  """
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{fn}: `{name}` must be a number, got bool {value!r}")
  if isinstance(value, (int, float, np.integer, np.floating)):
    if not 0.0 <= float(value) <= 1.0:
      raise ValueError(f"{fn}: `{name}` must be in [0, 1], got {value!r}")
    return
  if shape_of(value) != ():
    raise ValueError(
        f"{fn}: `{name}` has shape {shape_of(value)}, expected a scalar () "
        "(use jax.vmap to batch over it)")


def check_shape(fn: str, key: str, shape: Any) -> tuple[int, ...]:
  """A tuple of non-negative ints (a per-env, per-step shape)."""
  if isinstance(shape, int):
    shape = (shape,)
  try:
    shape = tuple(operator.index(d) for d in shape)
  except TypeError:
    raise TypeError(
        f"{fn}: key {key!r}: `shape` must be a tuple of ints, got "
        f"{shape!r}") from None
  if any(d < 0 for d in shape):
    raise ValueError(
        f"{fn}: key {key!r}: `shape` must be non-negative, got {shape}")
  return shape


def check_dtype(fn: str, key: str, dtype: Any) -> np.dtype:
  """A dtype that JAX can store as asked (no silent x64 truncation)."""
  try:
    dt = np.dtype(dtype)
  except TypeError:
    raise TypeError(
        f"{fn}: key {key!r}: `dtype` {dtype!r} is not a dtype") from None
  canonical = jax.dtypes.canonicalize_dtype(dt)
  if canonical != dt:
    raise TypeError(
        f"{fn}: key {key!r}: dtype {dt.name} is not available with "
        f"jax_enable_x64 disabled (JAX would store {np.dtype(canonical).name});"
        f" register {np.dtype(canonical).name} or enable x64")
  return dt


_KIND_RANK = {"b": 0, "u": 1, "i": 1, "f": 2, "V": 2, "c": 3}


def _kind(dt: np.dtype) -> str:
  # bfloat16 and the other ml_dtypes floats have kind 'V'; treat as float.
  if dt.kind == "V" and jnp.issubdtype(dt, jnp.floating):
    return "f"
  return dt.kind


def can_cast(src: np.dtype, dst: np.dtype) -> bool:
  """The casts ``update_at`` applies silently, as the original design did.

  Allowed: bool to anything, integers to integers or floats, floats to floats
  (e.g. float64 to float32), anything real to complex. Refused: float to int
  or bool, int to bool, complex to real.
  """
  src_kind, dst_kind = _kind(np.dtype(src)), _kind(np.dtype(dst))
  if src_kind == dst_kind:
    return True
  if src_kind == "b":
    return True
  if dst_kind == "b":
    return False
  return _KIND_RANK.get(src_kind, 99) <= _KIND_RANK.get(dst_kind, -1)


def check_values(fn: str, state: RolloutState, values: Any,
                 leading: tuple[int, ...], leading_doc: str) -> None:
  """Checks a ``{key: array}`` write against the registered keys.

  Args:
    fn: name of the public function, for messages.
    state: the state being written.
    values: ``{key: [*leading, *shape]}``.
    leading: the expected leading axes, e.g. ``(E,)`` or ``(T, E)``.
    leading_doc: their letters, e.g. ``"[E]"``, for messages.
  """
  if not isinstance(values, Mapping):
    raise TypeError(
        f"{fn}: `values` must be a dict {{key: array}}, got "
        f"{type(values).__name__}")
  signature = _signature(state, values, leading)
  if signature is not None and signature in _PASSED:
    return   # the same shapes and dtypes passed before: a hot write loop
  for key, value in values.items():
    if key not in state.data:
      known = ", ".join(repr(k) for k in state.keys) or "none"
      raise KeyError(
          f"{fn}: key {key!r} is not registered (registered: {known}); "
          f"call jr.register(state, {key!r}, shape=..., dtype=...) first")
    shape, dtype = state.spec(key)
    expected = leading + shape
    got_shape = shape_of(value)
    if tuple(got_shape) != expected:
      raise ValueError(
          f"{fn}: key {key!r} has shape {tuple(got_shape)}, expected "
          f"{expected} = {leading_doc} + {shape}")
    got_dtype = dtype_of(value)
    if not can_cast(got_dtype, dtype):
      raise TypeError(
          f"{fn}: key {key!r} has dtype {got_dtype.name}, which cannot be "
          f"cast safely to the registered dtype {np.dtype(dtype).name}; "
          f"cast it explicitly (e.g. `.astype(jnp.{np.dtype(dtype).name})`)")


  if signature is not None:
    if len(_PASSED) >= 1024:
      _PASSED.clear()
    _PASSED.add(signature)


# Signatures of writes that passed check_values. The check depends only on
# static shapes and dtypes, so a cache keyed by them is exact.
_PASSED: set[tuple[Any, ...]] = set()


def _signature(state: RolloutState, values: Mapping[str, Any],
               leading: tuple[int, ...]) -> tuple[Any, ...] | None:
  """The static facts ``check_values`` decides on, or None if unhashable."""
  sig = [leading]
  data = state.data
  try:
    for key, value in values.items():
      stored = data[key]
      sig.append((key, value.shape, value.dtype, stored.shape[2:],
                  stored.dtype))
    signature = tuple(sig)
    hash(signature)
  except (KeyError, AttributeError, TypeError):
    return None   # e.g. an unknown key or a list value: take the slow path
  return signature


def shape_of(value: Any) -> tuple[int, ...]:
  """The static shape of an array, tracer, numpy array or nested list."""
  shape = getattr(value, "shape", None)
  return tuple(shape) if shape is not None else np.shape(value)


def dtype_of(value: Any) -> np.dtype:
  """The static dtype of an array, tracer, numpy array, list or tensor."""
  dt = getattr(value, "dtype", None)
  if dt is not None:
    try:
      return np.dtype(dt)
    except TypeError:
      pass  # e.g. a torch dtype: let numpy look at the value
  return np.asarray(value).dtype


def concrete_int(value: Any) -> int | None:
  """The Python int of a concrete integer scalar, None if it is traced."""
  if isinstance(value, jax.core.Tracer):
    return None
  if isinstance(value, bool):
    raise TypeError(f"expected an integer step, got bool {value!r}")
  try:
    return operator.index(value)
  except TypeError:
    pass
  arr = np.asarray(value)
  if arr.shape != () or not np.issubdtype(arr.dtype, np.integer):
    raise TypeError(
        f"expected an integer scalar step, got {arr.dtype.name} array of "
        f"shape {arr.shape}")
  return int(arr)
