"""The cast rule of writes: which casts a write applies, which of them can
change a value, and the check of a narrowing write (eager, or ``checkify``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np

from jrollout._checks import kind

_KIND_RANK = {"b": 0, "u": 1, "i": 1, "f": 2, "c": 3}


def can_cast(src: Any, dst: Any) -> bool:
  """The casts a write applies: bool to anything, integers to integers or
  floats, floats to floats, real to complex; never float to int or bool,
  int to bool or complex to real."""
  src_kind, dst_kind = kind(np.dtype(src)), kind(np.dtype(dst))
  if src_kind == dst_kind or src_kind == "b":
    return True
  return _KIND_RANK.get(src_kind, 99) <= _KIND_RANK.get(dst_kind, -1)


def overflow_threshold(dst: Any) -> float:
  """The smallest magnitude that rounds to inf in the float dtype ``dst``."""
  info = jnp.finfo(dst)
  return float(info.max) + 2.0 ** (int(info.maxexp) - 2 - int(info.nmant))


def narrows(src: Any, dst: Any, x64: bool) -> bool:
  """Whether the allowed cast ``src -> dst`` can change a value beyond
  rounding: an integer range not inside ``dst``'s, values above ``dst``'s
  largest float, or (``x64`` off) a 64-bit ``src``, which JAX would cast
  first."""
  src, dst = np.dtype(src), np.dtype(dst)
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
  """The largest finite ``|x|`` of a non-empty numpy array (0 if none)."""
  if a.dtype.kind == "c":
    return max(_host_magnitude(a.real), _host_magnitude(a.imag))
  lo, hi = float(a.min()), float(a.max())
  if not (math.isfinite(lo) and math.isfinite(hi)):   # inf or NaN: finite only
    a = a[np.isfinite(a)]
    lo, hi = float(a.min(initial=0)), float(a.max(initial=0))
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
    dmin, dmax = int(jnp.iinfo(dst).min), int(jnp.iinfo(dst).max)
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


def check_narrowing(fn: str, key: str, leaf: Any, dst: np.dtype,
                    where: str = "") -> None:
  """A ``leaf`` of field ``key`` (``where``: its path) whose cast to ``dst``
  narrows keeps its values: a ValueError (``cast_error``) when concrete, a
  ``checkify`` check when traced."""
  if not isinstance(leaf, jax.core.Tracer):
    message = cast_error(fn, key, leaf, dst, where)
    if message is not None:
      raise ValueError(message)
    return
  what = f"{fn}: field {key!r}{where}: a traced {leaf.dtype} value"
  if kind(np.dtype(leaf.dtype)) in "iu" and kind(dst) in "iu":
    src, info = jnp.iinfo(leaf.dtype), jnp.iinfo(dst)
    lo = leaf.dtype.type(max(int(info.min), int(src.min)))
    hi = leaf.dtype.type(min(int(info.max), int(src.max)))
    checkify.debug_check(
        jnp.all(leaf >= lo) & jnp.all(leaf <= hi),
        f"{what} outside the range of the field's dtype {dst.name} was "
        "written (it wrapped); min {lo}, max {hi}",
        lo=jnp.min(leaf), hi=jnp.max(leaf))
  else:
    big = _finite_magnitude(leaf)
    checkify.debug_check(
        big.astype(jnp.float32) < jnp.float32(overflow_threshold(dst)),
        f"{what} beyond the largest {dst.name} was written (it became "
        "inf); magnitude {big}", big=big)
