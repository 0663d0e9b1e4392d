"""Array facts, dtype checks and the cast rule of writes: static shapes and
dtypes, the dtypes a field or a statistic may have, which casts a write
applies, and the check of a narrowing write (eager, or ``checkify``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np


def x64_enabled() -> bool:
  """Whether JAX keeps 64-bit dtypes now (``jax_enable_x64``, context
  managers included)."""
  return jax.dtypes.canonicalize_dtype(np.int64).itemsize == 8


def is_torch(x: Any) -> bool:
  """Whether ``x`` is a torch object, without importing torch."""
  return type(x).__module__.split(".", 1)[0] == "torch"


def shape_of(value: Any, fn: str | None = None, what: str | None = None
             ) -> tuple[int, ...]:
  """The static shape of an array, tracer, numpy array or nested list.

  Raises:
    TypeError: a ragged nested list; ``fn`` and ``what`` (the argument as
      messages name it, e.g. ``"`rewards`"`` or ``"field 'obs'"``) make the
      message.
  """
  shape = getattr(value, "shape", None)
  if shape is not None:
    return tuple(shape)
  try:
    return np.shape(value)
  except ValueError as err:   # numpy: an inhomogeneous (ragged) sequence
    raise TypeError(_not_array(fn, what, value, err)) from None


def dtype_of(value: Any, fn: str | None = None, what: str | None = None
             ) -> np.dtype:
  """The static dtype of an array, tracer, numpy array, list or tensor
  (``fn`` and ``what`` as for ``shape_of``)."""
  dt = getattr(value, "dtype", None)
  if dt is not None:
    try:
      return np.dtype(dt)
    except TypeError:
      pass  # e.g. a torch dtype: let numpy look at the value
  try:
    return np.asarray(value).dtype
  except (ValueError, TypeError, RuntimeError) as err:
    raise TypeError(_not_array(fn, what, value, err)) from None


def _not_array(fn: str | None, what: str | None, value: Any,
               err: Exception) -> str:
  where = f"{fn}: " if fn else ""
  what = what or "the value"
  kind = type(value).__name__
  if isinstance(value, (list, tuple)):
    kind += ", ragged?"
  return (f"{where}{what} is not an array of numbers ({kind}): "
          f"{str(err).splitlines()[0]}")


# --- Dtypes. ---


def as_dtype(fn: str, what: str, dtype: Any) -> np.dtype:
  """``np.dtype(dtype)``, else a TypeError naming ``fn`` and ``what``; an
  array is refused, not read as its dtype."""
  if not isinstance(dtype, (type, np.dtype)) and hasattr(dtype, "shape"):
    raise TypeError(f"{fn}: {what} must be a dtype, got an array "
                    f"({type(dtype).__name__}); pass its `.dtype`")
  try:
    return np.dtype(dtype)
  except (TypeError, ValueError):
    raise TypeError(f"{fn}: {what} {dtype!r} is not a dtype") from None


def check_dtype(fn: str, key: str | None, dtype: Any) -> np.dtype:
  """A numeric or bool dtype that JAX stores as asked (no silent x64
  truncation), else a TypeError."""
  where = f"field {key!r}: " if key is not None else ""
  dt = as_dtype(fn, f"{where}`dtype`", dtype)
  if not (dt == np.bool_ or jnp.issubdtype(dt, jnp.number)):
    raise TypeError(f"{fn}: {where}`dtype` {dt} is not a numeric or bool "
                    "dtype (e.g. jnp.float32, jnp.int32, jnp.bool_)")
  _check_stored(fn, f"{where}dtype", dt, "register {} or enable x64")
  return dt


def check_float_dtype(fn: str, name: str, dtype: Any) -> np.dtype:
  """A floating dtype that JAX stores as asked, else a TypeError."""
  dt = as_dtype(fn, f"`{name}`", dtype)
  if not jnp.issubdtype(dt, jnp.floating):
    raise TypeError(f"{fn}: `{name}` must be a floating dtype, got "
                    f"{dt.name}")
  _check_stored(fn, f"`{name}`", dt, "use {}")
  return dt


def _check_stored(fn: str, what: str, dt: np.dtype, advice: str) -> None:
  """A TypeError if JAX would store ``dt`` narrower (64 bits with x64 off);
  ``advice`` is formatted with the dtype it would store."""
  canonical = np.dtype(jax.dtypes.canonicalize_dtype(dt))
  if canonical != dt:
    raise TypeError(
        f"{fn}: {what} {dt.name} is not available with jax_enable_x64 "
        f"disabled (JAX would store {canonical.name}); "
        + advice.format(canonical.name))


# --- The cast rule of writes. ---

_KIND_RANK = {"b": 0, "u": 1, "i": 1, "f": 2, "c": 3}


def kind(dt: np.dtype) -> str:
  """numpy's kind letter; bfloat16 and the other ml_dtypes have 'V'."""
  if dt.kind != "V":
    return dt.kind
  if jnp.issubdtype(dt, jnp.floating):
    return "f"
  if jnp.issubdtype(dt, jnp.unsignedinteger):
    return "u"
  return "i" if jnp.issubdtype(dt, jnp.integer) else "V"


def can_cast(src: Any, dst: Any) -> bool:
  """The casts a write applies: bool to anything, integers to integers or
  floats, floats to floats, real to complex; never float to int or bool,
  int to bool or complex to real."""
  src_kind, dst_kind = kind(np.dtype(src)), kind(np.dtype(dst))
  if src_kind == dst_kind or src_kind == "b":
    return True
  if dst_kind == "b":
    return False
  return _KIND_RANK.get(src_kind, 99) <= _KIND_RANK.get(dst_kind, -1)


def overflow_threshold(dst: Any) -> float:
  """The smallest magnitude that rounds to inf in the float dtype ``dst``."""
  info = jnp.finfo(dst)
  return float(info.max) + 2.0 ** (int(info.maxexp) - 2 - int(info.nmant))


def narrows(src: Any, dst: Any, x64: bool | None = None) -> bool:
  """Whether the allowed cast ``src -> dst`` can change a value beyond
  rounding: an integer range not inside ``dst``'s, values above ``dst``'s
  largest float, or (x64 off) a 64-bit ``src``, which JAX would cast first."""
  src, dst = np.dtype(src), np.dtype(dst)
  if x64 is None:
    x64 = x64_enabled()
  if not x64 and np.dtype(jax.dtypes.canonicalize_dtype(src)) != src:
    return True
  src_kind, dst_kind = kind(src), kind(dst)
  if src_kind == "b" or dst_kind == "b":
    return False
  if dst_kind in "iu":
    s, d = jnp.iinfo(src), jnp.iinfo(dst)
    return int(s.min) < int(d.min) or int(s.max) > int(d.max)
  top = (float(jnp.iinfo(src).max) if src_kind in "iu"
         else float(jnp.finfo(src).max))
  return top >= overflow_threshold(dst)


@jax.jit
def _finite_magnitude(x: jax.Array) -> jax.Array:
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    x = jnp.stack([x.real, x.imag])
  if jnp.issubdtype(x.dtype, jnp.signedinteger):
    x = x.astype(jnp.float32)   # abs(int min) wraps to itself
  x = jnp.abs(x)
  return jnp.max(jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype)),
                 initial=0)


def _host_magnitude(a: np.ndarray) -> float:
  """The largest finite ``|x|`` of a numpy array (0 if none)."""
  if a.dtype.kind == "c":
    return max(_host_magnitude(a.real), _host_magnitude(a.imag))
  lo, hi = float(a.min()), float(a.max())
  if not (math.isfinite(lo) and math.isfinite(hi)):   # inf or NaN: finite only
    a = a[np.isfinite(a)]
    if not a.size:
      return 0.0
    lo, hi = float(a.min()), float(a.max())
  return max(hi, -lo)


def cast_error(fn: str, key: str, value: Any, dst: np.dtype,
               leaf: str = "") -> str | None:
  """Why casting the concrete ``value`` to ``dst`` would change it, or None:
  integers must lie in an integer ``dst``'s range, finite values below a
  float ``dst``'s overflow threshold (NaN and inf stay)."""
  arr = value if isinstance(value, jax.Array) else np.asarray(value)
  if not arr.size:
    return None
  src = np.dtype(arr.dtype)
  if kind(src) in "iu" and kind(dst) in "iu":
    lo, hi = (int(v) for v in jax.device_get((arr.min(), arr.max())))
    info = jnp.iinfo(dst)
    dmin, dmax = int(info.min), int(info.max)
    if dmin <= lo and hi <= dmax:
      return None
    return (f"{fn}: field {key!r}{leaf} has {src.name} values in [{lo}, {hi}], "
            f"outside the range of its dtype {dst.name} [{dmin}, {dmax}]: "
            f"the cast would change them (nothing changed); clip or "
            f"cast them yourself first (e.g. `np.clip(v, {dmin}, {dmax})`)")
  big = (float(_finite_magnitude(arr)) if isinstance(arr, jax.Array)
         else _host_magnitude(arr))
  if big < overflow_threshold(dst):
    return None
  return (f"{fn}: field {key!r}{leaf} has finite {src.name} values of "
          f"magnitude up to {big:.6g}, beyond the largest {dst.name} "
          f"({float(jnp.finfo(dst).max):.6g}): the cast would make them inf "
          "(nothing changed); scale or clip them first")


def _traced_cast_check(fn: str, key: str, value: jax.Array, dst: np.dtype,
                       leaf: str) -> None:
  """A ``checkify`` check that a traced narrowing cast keeps the values."""
  where = f"{fn}: field {key!r}{leaf}: a traced {value.dtype} value"
  if kind(np.dtype(value.dtype)) in "iu" and kind(dst) in "iu":
    src, info = jnp.iinfo(value.dtype), jnp.iinfo(dst)
    lo = value.dtype.type(max(int(info.min), int(src.min)))
    hi = value.dtype.type(min(int(info.max), int(src.max)))
    checkify.debug_check(
        jnp.all(value >= lo) & jnp.all(value <= hi),
        f"{where} outside the range of the field's dtype {dst.name} was "
        "written (it wrapped); min {lo}, max {hi}",
        lo=jnp.min(value), hi=jnp.max(value))
    return
  big = _finite_magnitude(value)
  checkify.debug_check(
      big.astype(jnp.float32) < jnp.float32(overflow_threshold(dst)),
      f"{where} beyond the largest {dst.name} was written (it became inf); "
      "magnitude {big}", big=big)


def check_narrowing(fn: str, key: str, value: Any, storage: Any) -> None:
  """The value check of a field whose cast narrows, leaf by leaf."""
  x64 = x64_enabled()
  paths = jax.tree_util.tree_leaves_with_path(value)
  for (path, leaf), stored in zip(paths, jax.tree_util.tree_leaves(storage)):
    dst = np.dtype(stored.dtype)
    if not narrows(dtype_of(leaf), dst, x64):
      continue
    where = f" leaf {jax.tree_util.keystr(path)}" if path else ""
    if isinstance(leaf, jax.core.Tracer):
      _traced_cast_check(fn, key, leaf, dst, where)
      continue
    message = cast_error(fn, key, leaf, dst, where)
    if message is not None:
      raise ValueError(message)
