"""Validators shared by every entry point: each raises in plain Python before
any JAX op (a traced value: through ``checkify``), naming the function, the
argument (and field), what was expected and what was given.
"""

from __future__ import annotations

from collections.abc import Iterator
import functools
import math
import operator
from typing import Any

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np

def x64_enabled() -> bool:
  """Whether JAX keeps 64-bit dtypes now (context managers included)."""
  return jax.dtypes.canonicalize_dtype(np.int64).itemsize == 8


def is_torch(x: Any) -> bool:
  """Whether ``x`` is a torch object, without importing torch."""
  return type(x).__module__.split(".", 1)[0] == "torch"


def _is_bool(value: Any) -> bool:
  return isinstance(value, (bool, np.bool_))


def _field(key: str | None) -> str:
  return f"field {key!r}: " if key is not None else ""


def shape_of(value: Any, fn: str | None = None, what: str | None = None
             ) -> tuple[int, ...]:
  """The static shape of an array, tracer, tensor or nested list; a ragged
  list is a TypeError from ``fn`` naming ``what`` (e.g. ``"`rewards`"``)."""
  shape = getattr(value, "shape", None)
  return tuple(shape) if shape is not None else _host(value, fn, what).shape


def dtype_of(value: Any, fn: str | None = None, what: str | None = None
             ) -> np.dtype:
  """The static dtype of the same (arguments as for ``shape_of``)."""
  dtype = getattr(value, "dtype", None)
  if dtype is not None:
    try:
      return np.dtype(dtype)
    except TypeError:
      pass  # e.g. a torch dtype: let numpy look at the value
  return _host(value, fn, what).dtype


def _host(value: Any, fn: str | None, what: str | None) -> np.ndarray:
  try:
    return np.asarray(value)
  except (ValueError, TypeError, RuntimeError) as err:
    ragged = ", ragged?" if isinstance(value, (list, tuple)) else ""
    raise TypeError(
        f"{fn + ': ' if fn else ''}{what or 'the value'} is not an array of "
        f"numbers ({type(value).__name__}{ragged}): "
        f"{str(err).splitlines()[0]}") from None


def kind(dt: np.dtype) -> str:
  """numpy's kind letter, also for bfloat16 and the other ml_dtypes."""
  if dt.kind == "V":
    for letter, base in (("f", jnp.floating), ("u", jnp.unsignedinteger),
                         ("i", jnp.integer)):
      if jnp.issubdtype(dt, base):
        return letter
  return dt.kind


def check_int(fn: str, name: str, value: Any, *, minimum: int | None = None
              ) -> int:
  """``value`` as a Python int: a TypeError for a bool or a float, a
  ValueError below ``minimum``."""
  if _is_bool(value):
    raise TypeError(f"{fn}: `{name}` must be an int, got bool {bool(value)}")
  try:
    number = operator.index(value)
  except TypeError:
    raise TypeError(
        f"{fn}: `{name}` must be an int, got {type(value).__name__} "
        f"{value!r}") from None
  if minimum is not None and number < minimum:
    what = "positive" if minimum == 1 else f">= {minimum}"
    raise ValueError(f"{fn}: `{name}` must be {what}, got {number}")
  return number


def positive_int(fn: str, name: str, value: Any) -> int:
  """``check_int`` with minimum 1."""
  return check_int(fn, name, value, minimum=1)


def positive_ints(fn: str, name: str, value: Any) -> tuple[int, ...]:
  """A positive int, or a tuple or list of them, as a tuple."""
  dims = value if isinstance(value, (tuple, list)) else (value,)
  return tuple(positive_int(fn, name, d) for d in dims)


def check_bool(fn: str, name: str, value: Any, *, none: bool = False
               ) -> Any:
  """``True``/``False`` (numpy too; ``None`` with ``none``), else TypeError."""
  if none and value is None:
    return None
  if not _is_bool(value):
    allowed = "None, True or False" if none else "True or False"
    raise TypeError(f"{fn}: `{name}` must be {allowed}, got "
                    f"{type(value).__name__} {value!r}")
  return bool(value)


def check_shape(fn: str, shape: Any, key: str | None = None, *,
                arg: str = "shape") -> tuple[int, ...]:
  """A shape (``arg``) as a tuple of non-negative ints (an int means
  ``(int,)``): a TypeError for a bool, float or str, a ValueError for a
  negative dimension."""
  why = ""
  try:
    if _is_bool(shape) or isinstance(shape, (str, bytes)):
      raise TypeError
    items = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if any(_is_bool(d) for d in items):
      why = " (a bool is not a dimension)"
      raise TypeError
    dims = tuple(operator.index(d) for d in items)
  except TypeError:
    got = f"bool {shape!r}" if _is_bool(shape) else repr(shape)
    raise TypeError(f"{fn}: {_field(key)}`{arg}` must be a tuple of ints, "
                    f"got {got}{why}") from None
  if any(d < 0 for d in dims):
    raise ValueError(f"{fn}: {_field(key)}`{arg}` must be non-negative, got "
                     f"{dims}")
  return dims


def zeros(fn: str, shape: tuple[int, ...], dtype: Any, key: str | None = None,
          doc: str = "") -> jax.Array:
  """``jnp.zeros(shape, dtype)`` (``doc`` names the axes): a ValueError for
  more bytes than an int64 counts (XLA would abort), a MemoryError for
  XLA's ``RESOURCE_EXHAUSTED``."""
  what = f"shape {tuple(shape)}{doc} of {np.dtype(dtype).name}"
  nbytes = math.prod(shape) * np.dtype(dtype).itemsize
  if nbytes > 2**63 - 1:
    raise ValueError(
        f"{fn}: {_field(key)}the array would have {what}, {nbytes:.3g} "
        "bytes, more than any address space holds (2**63 - 1); check the "
        "sizes")
  try:
    return jnp.zeros(shape, dtype)
  except jax.errors.JaxRuntimeError as err:
    if "RESOURCE_EXHAUSTED" not in str(err):
      raise
    raise MemoryError(
        f"{fn}: {_field(key)}no memory for an array of {what} ({nbytes:.3g} "
        f"bytes): {str(err).splitlines()[0]}") from None


_HELD = {"U": "str", "S": "bytes", "O": "Python objects", "M": "datetimes",
         "m": "timedeltas"}


def check_arrays(fn: str, name: str, tree: Any, *, torch: bool = False
                 ) -> None:
  """Every leaf of ``tree`` an array or a number (a torch tensor too with
  ``torch``), else a TypeError naming its path; a TypeError for dict keys
  that cannot be sorted, a ValueError for an int outside int32 (x64 off)."""
  try:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
  except ValueError:   # JAX sorts dict keys: a dict with mixed key types
    for where, found in _dicts(name, tree):
      try:
        sorted(found)
      except TypeError:
        kinds = sorted({type(k).__name__ for k in found})
        raise TypeError(
            f"{fn}: `{where}` has dict keys of types {kinds} that cannot be "
            f"sorted ({list(found)[:4]!r}); JAX flattens a dict in sorted "
            "key order: use keys of one type") from None
    raise
  for path, leaf in leaves:
    if type(leaf) is np.ndarray and leaf.dtype.kind in "biufc":
      continue   # the common host leaf, first: this runs on every call
    if isinstance(leaf, (jax.Array, float, complex)) or (
        torch and is_torch(leaf)):
      continue
    where = f"{name}{jax.tree_util.keystr(path)}"
    if isinstance(leaf, (np.ndarray, np.generic)):
      if kind(leaf.dtype) not in "biufc":
        what = "array" if isinstance(leaf, np.ndarray) else "scalar"
        raise TypeError(
            f"{fn}: `{where}` is a numpy {what} of "
            f"{_HELD.get(leaf.dtype.kind, 'non-numbers')} (dtype "
            f"{leaf.dtype}), expected numbers (bool, integer, floating or "
            "complex)")
    elif isinstance(leaf, int):   # a bool too
      if not -2**31 <= leaf < 2**31 and not x64_enabled():
        raise ValueError(f"{fn}: `{where}` is the Python int {leaf}, "
                         "outside int32 (jax_enable_x64 is off); pass an "
                         "array of the dtype you mean")
    else:
      hint = (" (a torch tensor: pass t.numpy() or jrollout.torch.from_torch"
              "(t))" if is_torch(leaf) else "")
      cls = type(leaf).__name__
      raise TypeError(f"{fn}: `{where}` is a{'n' * (cls[0] in 'aeiouAEIOU')}"
                      f" {cls}, not an array or a number{hint}")


def _dicts(name: str, tree: Any) -> Iterator[tuple[str, dict]]:
  if hasattr(tree, "shape"):   # an array, first: the common leaf
    return
  nodes = jax.tree_util.tree_leaves_with_path(
      tree, is_leaf=lambda x: isinstance(x, dict))   # never sorts a dict
  for path, node in nodes:
    if isinstance(node, dict):
      where = name + jax.tree_util.keystr(path)
      yield where, node
      for key, value in node.items():
        yield from _dicts(f"{where}[{key!r}]", value)


def check_str_keys(fn: str, name: str, tree: Any) -> None:
  """A TypeError naming the dict and key for a dict key that is not a str."""
  for where, found in _dicts(name, tree):
    for key in found:
      if not isinstance(key, str):
        raise TypeError(
            f"{fn}: `{where}` has the key {key!r} of type "
            f"{type(key).__name__}; expected str keys (names such as 'obs')")


def check_scalar(fn: str, name: str, value: Any, *, low: float,
                 high: float | None = None, low_open: bool = False) -> None:
  """A real scalar (Python, numpy or 0-d array), else a TypeError; a
  ValueError if not 0-d or, concrete, outside ``[low, high]`` (``(low,
  high]`` with ``low_open``; NaN is outside)."""
  number = isinstance(value, (int, float)) and not _is_bool(value)
  dtype = type(value) if number else getattr(value, "dtype", None)
  if dtype is None or _is_bool(value) or isinstance(value, complex):
    raise TypeError(
        f"{fn}: `{name}` must be a real number (a float or a 0-d float "
        f"array), got {type(value).__name__} {value!r}")
  try:
    dtype = np.dtype(dtype)
  except TypeError:
    dtype = np.dtype(object)
  if kind(dtype) not in "iuf":
    raise TypeError(f"{fn}: `{name}` must be a real number, got an array of "
                    f"dtype {dtype}")
  shape = tuple(getattr(value, "shape", ()))
  if shape != ():
    raise ValueError(
        f"{fn}: `{name}` has shape {shape}, expected a scalar () (use "
        "jax.vmap to batch over it)")
  if isinstance(value, jax.core.Tracer):
    return
  x = float(np.asarray(value))
  if not (x > low if low_open else x >= low) or (high is not None
                                                 and x > high):
    bound = (f"{'>' if low_open else '>='} {low:g}" if high is None
             else f"in {'(' if low_open else '['}{low:g}, {high:g}]")
    raise ValueError(
        f"{fn}: `{name}` must be {bound}, got {value if number else x!r}")


def check_discount(fn: str, name: str, value: Any) -> None:
  """A discount-like factor in ``[0, 1]`` (``check_scalar``)."""
  check_scalar(fn, name, value, low=0.0, high=1.0)


def _check_kind(fn: str, name: str, value: Any, kinds: str,
                expected: str) -> None:
  dtype = dtype_of(value, fn, f"`{name}`")
  if kind(dtype) not in kinds:
    raise TypeError(f"{fn}: `{name}` has dtype {dtype}, expected {expected}")


def check_real(fn: str, name: str, value: Any) -> None:
  """An array of a real dtype (bool, integer or float), else a TypeError."""
  _check_kind(fn, name, value, "biuf", "a real (bool, integer or floating) "
              "dtype; a complex value would lose its imaginary part")


def check_floating(fn: str, name: str, value: Any, why: str | None = None
                   ) -> None:
  """An array of a floating dtype, else a TypeError ending with ``why``."""
  why = why or f"cast it, e.g. `{name}.astype(jnp.float32)`"
  _check_kind(fn, name, value, "f", f"a floating dtype ({why})")


def check_bool_array(fn: str, name: str, value: Any) -> None:
  """An array of dtype bool, else a TypeError."""
  _check_kind(fn, name, value, "b", f"bool (e.g. `{name}.astype(bool)`, "
              "True where it applies)")


def check_flags(fn: str, name: str, value: Any) -> None:
  """Flags of a bool or numeric dtype (nonzero is True), else a TypeError."""
  _check_kind(fn, name, value, "biufc",
              "bool or numeric flags (nonzero is True)")


def check_flag_values(fn: str, name: str, value: Any) -> None:
  """No NaN in floating flags: a ValueError, or a ``checkify`` check."""
  if not jnp.issubdtype(dtype_of(value, fn, f"`{name}`"), jnp.inexact):
    return
  what = (f"{fn}: `{name}` has NaN at {{count}} of "
          f"{math.prod(shape_of(value))} elements (the first at flat index "
          "{first}); a flag is True or False and NaN would read as True: "
          "replace the NaNs")
  if isinstance(value, jax.core.Tracer):
    nan = jnp.isnan(value).reshape(-1)
    checkify.debug_check(~jnp.any(nan), what, count=jnp.sum(nan),
                         first=jnp.argmax(nan))
    return
  nan = np.isnan(np.asarray(value)).reshape(-1)
  if nan.any():
    raise ValueError(what.format(count=int(nan.sum()),
                                 first=int(np.argmax(nan))))


def check_shape_equal(fn: str, name: str, value: Any,
                      expected: tuple[int, ...], doc: str) -> None:
  """An array of shape ``expected`` (``doc``: whence), else a ValueError."""
  got = shape_of(value, fn, f"`{name}`")
  if got != expected:
    raise ValueError(f"{fn}: `{name}` has shape {got}, expected {expected} = "
                     f"{doc}")


def check_trailing(fn: str, name: str, value: Any, shape: tuple[int, ...],
                   what: str) -> tuple[int, ...]:
  """The leading axes of an array ``[..., *shape]`` (``what``: the trailing
  ones), else a ValueError."""
  got = shape_of(value, fn, f"`{name}`")
  lead = len(got) - len(shape)
  if lead < 0 or got[lead:] != shape:
    raise ValueError(
        f"{fn}: `{name}` has shape {got}, expected [..., *{shape}] (any "
        f"leading axes, then {what} {shape})")
  return got[:lead]


def check_instance(fn: str, name: str, value: Any, cls: type,
                   maker: str) -> None:
  """An instance of ``cls`` (made by ``jr.<maker>``), else a TypeError."""
  if not isinstance(value, cls):
    raise TypeError(f"{fn}: `{name}` must be a {cls.__name__} (from "
                    f"jr.{maker}), got {type(value).__name__}")


def check_unstacked(fn: str, name: str, count: Any, what: str) -> None:
  """A ValueError if the ``count`` leaf has axes: a stack of states."""
  if jnp.ndim(count) != 0:
    raise ValueError(
        f"{fn}: `{name}` is a stack of {what} (count of shape "
        f"{shape_of(count)}); map over the stack with jax.vmap")


@functools.lru_cache(maxsize=None)
def _raw_key_shape(impl: str) -> tuple[int, ...]:
  del impl   # the cache key: the default PRNG implementation
  return jax.eval_shape(
      lambda: jax.random.key_data(jax.random.key(0))).shape


def check_key(fn: str, key: Any) -> None:
  """One PRNG key, typed or raw ``uint32`` of the default implementation: a
  TypeError for a non-key, a ValueError for several keys or a bad raw one."""
  dtype = getattr(key, "dtype", None)
  shape = tuple(getattr(key, "shape", ()) or ())
  hint = "jax.random.key(seed)"
  try:
    typed = dtype is not None and jax.dtypes.issubdtype(dtype,
                                                        jax.dtypes.prng_key)
    raw = not typed and dtype is not None and np.dtype(dtype) == np.uint32
  except TypeError:   # e.g. a torch dtype
    typed = raw = False
  if typed and shape != ():
    raise ValueError(
        f"{fn}: `key` is an array of keys of shape {shape}; expected one "
        "key (shape ()): split it and call once per key, or use jax.vmap")
  if raw and len(shape) == 1:
    impl = getattr(jax.config, "jax_default_prng_impl")  # noqa: B009 (mypy)
    want = _raw_key_shape(str(impl))
    if shape != want:
      raise ValueError(
          f"{fn}: `key` is a raw uint32 key of shape {shape}; the default "
          f"PRNG implementation's raw keys have shape {want}; pass {hint}")
  elif not typed:
    got = (f"{type(key).__name__} {key!r}" if dtype is None
           else f"an array of dtype {dtype} and shape {shape}")
    raise TypeError(f"{fn}: `key` must be a PRNG key ({hint}), got {got}")


def check_dtype(fn: str, key: str | None, dtype: Any,
                floating: bool = False) -> np.dtype:
  """``dtype`` (of field ``key``) as a numeric or bool numpy dtype (floating
  with ``floating``) that JAX stores as asked, else a TypeError (also for a
  64-bit dtype with jax_enable_x64 off)."""
  what = f"{_field(key)}`dtype`"
  if not isinstance(dtype, (type, np.dtype)) and hasattr(dtype, "shape"):
    raise TypeError(f"{fn}: {what} must be a dtype, got an array "
                    f"({type(dtype).__name__}); pass its `.dtype`")
  try:
    dt = np.dtype(dtype)
  except (TypeError, ValueError):
    raise TypeError(f"{fn}: {what} {dtype!r} is not a dtype") from None
  if floating and not jnp.issubdtype(dt, jnp.floating):
    raise TypeError(f"{fn}: {what} must be a floating dtype, got {dt.name}")
  if not (dt == np.bool_ or jnp.issubdtype(dt, jnp.number)):
    raise TypeError(f"{fn}: {what} {dt} is not a numeric or bool dtype (e.g. "
                    "jnp.float32, jnp.int32, jnp.bool_)")
  stored = np.dtype(jax.dtypes.canonicalize_dtype(dt))
  if stored != dt:
    given = what if floating else f"{_field(key)}dtype"
    fix = (f"use {stored.name}" if floating
           else f"register {stored.name} or enable x64")
    raise TypeError(f"{fn}: {given} {dt.name} is not available with "
                    "jax_enable_x64 disabled (JAX would store "
                    f"{stored.name}); {fix}")
  return dt
