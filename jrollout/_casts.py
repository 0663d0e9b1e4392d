"""The cast rule of writes: which dtype casts a write applies, and which
values a narrowing cast would change.

A write's values are cast to the field's dtype when the cast is safe by kind
(``can_cast``); where the cast narrows (a smaller integer range, a float
with a smaller exponent range: ``narrows``), concrete values are checked and
a value the cast would change (an integer out of range, a finite float that
would become inf) is refused (``cast_error``). Traced values are converted
as XLA converts (integers wrap, floats overflow to inf), and a ``checkify``
check reports it when the caller wraps the function with
``checkify.checkify``.
"""

from __future__ import annotations

from collections.abc import Mapping
import functools
import math
from typing import Any

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np

from jrollout._checks import x64_enabled
from jrollout._state import RolloutState


_KIND_RANK = {"b": 0, "u": 1, "i": 1, "f": 2, "c": 3}


def _kind(dt: np.dtype) -> str:
  # bfloat16 and the other ml_dtypes floats have kind 'V'; int4 too.
  kind = dt.kind
  if kind != "V":
    return kind
  if jnp.issubdtype(dt, jnp.floating):
    return "f"
  if jnp.issubdtype(dt, jnp.integer):
    return "u" if jnp.issubdtype(dt, jnp.unsignedinteger) else "i"
  return kind


def can_cast(src: Any, dst: Any) -> bool:
  """The casts a write applies, by kind, as the original design did.

  Allowed: bool to anything, integers to integers or floats, floats to floats
  (e.g. float64 to float32), anything real to complex. Refused: float to int
  or bool, int to bool, complex to real. Where an allowed cast narrows
  (``narrows``), concrete values are checked too.
  """
  src_kind, dst_kind = _kind(np.dtype(src)), _kind(np.dtype(dst))
  if src_kind == dst_kind:
    return True
  if src_kind == "b":
    return True
  if dst_kind == "b":
    return False
  return _KIND_RANK.get(src_kind, 99) <= _KIND_RANK.get(dst_kind, -1)


@functools.lru_cache(maxsize=64)
def overflow_threshold(dst: Any) -> float:
  """The smallest magnitude that rounds to inf in the float dtype ``dst``
  (its largest value plus half an ulp there)."""
  info = jnp.finfo(dst)
  return float(info.max) + 2.0 ** (int(info.maxexp) - 2 - int(info.nmant))


def narrows(src: np.dtype, dst: np.dtype, x64: bool | None = None) -> bool:
  """Whether the allowed cast ``src -> dst`` can change a value beyond
  rounding: an integer range not inside ``dst``'s, floats (or ints) that
  may exceed ``dst``'s largest finite value, or (``x64`` False, the
  default being the current setting) a 64-bit ``src``, which JAX would
  first cast to 32 bits on its own."""
  if x64 is None:
    x64 = x64_enabled()
  return _narrows(np.dtype(src), np.dtype(dst), x64)


@functools.lru_cache(maxsize=1024)
def _narrows(src: np.dtype, dst: np.dtype, x64: bool) -> bool:
  if not x64 and np.dtype(jax.dtypes.canonicalize_dtype(src)) != src:
    return True
  src_kind, dst_kind = _kind(src), _kind(dst)
  if src_kind == "b" or dst_kind == "b":
    return False
  if dst_kind in "iu":
    s, d = jnp.iinfo(src), jnp.iinfo(dst)
    return int(s.min) < int(d.min) or int(s.max) > int(d.max)
  top = (float(jnp.iinfo(src).max) if src_kind in "iu"
         else float(jnp.finfo(src).max))
  return top >= overflow_threshold(dst)


@jax.jit
def _int_range(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  return jnp.min(x), jnp.max(x)


@jax.jit
def _finite_magnitude(x: jax.Array) -> jax.Array:
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    x = jnp.stack([x.real, x.imag])
  if jnp.issubdtype(x.dtype, jnp.signedinteger):
    x = x.astype(jnp.float32)   # abs(int min) wraps to itself, negative
  x = jnp.abs(x)
  return jnp.max(jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype)),
                 initial=0)


def _host_finite_magnitude(a: np.ndarray) -> float:
  """The largest finite ``|x|`` of a numpy array (0 if none): two reductions
  unless the array holds an inf or a NaN."""
  if a.dtype.kind == "c":
    return max(_host_finite_magnitude(a.real), _host_finite_magnitude(a.imag))
  lo, hi = float(a.min()), float(a.max())
  if not (math.isfinite(lo) and math.isfinite(hi)):   # inf or NaN: finite only
    a = a[np.isfinite(a)]
    if not a.size:
      return 0.0
    lo, hi = float(a.min()), float(a.max())
  return max(hi, -lo)


@functools.lru_cache(maxsize=256)
def _int_bounds(dtype: Any) -> tuple[int, int]:
  info = jnp.iinfo(dtype)
  return int(info.min), int(info.max)


def cast_error(fn: str, key: str, value: Any, dst: np.dtype,
               leaf: str = "") -> str | None:
  """Why casting the concrete ``value`` to ``dst`` would change it, or None.

  Only called for narrowing casts (``narrows``), once the write's static
  checks passed. Integers must lie in the range of an integer ``dst``;
  finite values must stay below the overflow threshold of a float ``dst``
  (rounding is accepted; NaN and inf stay). A JAX array is reduced on its
  device (a wait for its value, a scalar or two read back); anything else
  on the host (two numpy reductions, a few microseconds for ``[1024]``).
  """
  is_jax = isinstance(value, jax.Array)
  arr = value if is_jax else np.asarray(value)
  if not arr.size:
    return None
  src = np.dtype(arr.dtype)
  if _kind(src) in "iu" and _kind(dst) in "iu":
    if is_jax:
      lo, hi = (int(v) for v in jax.device_get(_int_range(arr)))
    else:
      lo, hi = int(arr.min()), int(arr.max())
    dmin, dmax = _int_bounds(dst)
    if lo >= dmin and hi <= dmax:
      return None
    return (f"{fn}: field {key!r}{leaf} has {src.name} values in [{lo}, {hi}], "
            f"outside the range of its dtype {dst.name} [{dmin}, {dmax}]: "
            f"the cast would change them (nothing changed); clip or "
            f"cast them yourself first (e.g. `np.clip(v, {dmin}, {dmax})`)")
  big = (float(_finite_magnitude(arr)) if is_jax
         else _host_finite_magnitude(arr))
  if big < overflow_threshold(dst):
    return None
  return (f"{fn}: field {key!r}{leaf} has finite {src.name} values of "
          f"magnitude up to {big:.6g}, beyond the largest {dst.name} "
          f"({float(jnp.finfo(dst).max):.6g}): the cast would make them inf "
          "(nothing changed); scale or clip them first")


def _traced_cast_check(fn: str, key: str, value: jax.Array,
                       dst: np.dtype, leaf: str = "") -> None:
  """A ``checkify`` check that a traced narrowing cast keeps the values."""
  if _kind(np.dtype(value.dtype)) in "iu" and _kind(dst) in "iu":
    info = jnp.iinfo(dst)
    ok = (jnp.all(value >= value.dtype.type(max(int(info.min),
                                                int(jnp.iinfo(value.dtype).min))))
          & jnp.all(value <= value.dtype.type(min(
              int(info.max), int(jnp.iinfo(value.dtype).max)))))
    checkify.debug_check(
        ok, f"{fn}: field {key!r}{leaf}: a traced {value.dtype} value "
        f"outside the range of the field's dtype {dst.name} was written (it "
        "wrapped); "
        "min {lo}, max {hi}", lo=jnp.min(value), hi=jnp.max(value))
    return
  big = _finite_magnitude(value)
  checkify.debug_check(
      big.astype(jnp.float32) < jnp.float32(overflow_threshold(dst)),
      f"{fn}: field {key!r}{leaf}: a traced {value.dtype} value beyond the "
      f"largest {dst.name} was written (it became inf); magnitude {{big}}",
      big=big)



def check_narrowing(fn: str, state: RolloutState, values: Mapping[str, Any],
                    keys: tuple[str, ...]) -> None:
  """The value check of the narrowing ``keys`` of a write (see above)."""
  for key in keys:
    storage = state.data[key]
    if not hasattr(storage, "dtype"):   # a pytree field: leaf by leaf
      _check_tree_narrowing(fn, key, values[key], storage)
      continue
    value, dst = values[key], np.dtype(storage.dtype)
    if isinstance(value, jax.core.Tracer):
      _traced_cast_check(fn, key, value, dst)
      continue
    message = cast_error(fn, key, value, dst)
    if message is not None:
      raise ValueError(message)


def _check_tree_narrowing(fn: str, key: str, value: Any, storage: Any
                          ) -> None:
  """``check_narrowing`` of the leaves of a pytree field whose cast narrows
  (the structures already match)."""
  x64 = x64_enabled()
  for (path, leaf), stored in zip(
      jax.tree_util.tree_leaves_with_path(value),
      jax.tree_util.tree_leaves(storage)):
    dst = np.dtype(stored.dtype)
    if not narrows(np.dtype(leaf.dtype) if hasattr(leaf, "dtype")
                   else np.asarray(leaf).dtype, dst, x64):
      continue
    where = f" leaf {jax.tree_util.keystr(path)}"
    if isinstance(leaf, jax.core.Tracer):
      _traced_cast_check(fn, key, leaf, dst, where)
      continue
    message = cast_error(fn, key, leaf, dst, where)
    if message is not None:
      raise ValueError(message)
