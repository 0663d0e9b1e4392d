"""Validators: one check per kind of argument, shared by every entry point.

Each raises in plain Python before any JAX op (at trace time where the fact
is static), naming the function, the argument (and field), what was
expected and what was given. The cast rule lives in ``_casts``, the check of
a live state in ``_state``.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Iterator
from typing import Any

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np

from jrollout._casts import dtype_of, is_torch, kind, shape_of, x64_enabled

# --- Python values and trees: ints, bools, shapes, sizes, leaves. ---


def _is_bool(value: Any) -> bool:
  return isinstance(value, (bool, np.bool_))


def check_int(fn: str, name: str, value: Any, *, minimum: int | None = None
              ) -> int:
  """``value`` as a Python int (``>= minimum`` if given); a bool or a float is
  a TypeError, a value below ``minimum`` a ValueError."""
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
  """``value`` as a positive Python int (``check_int``, minimum 1)."""
  return check_int(fn, name, value, minimum=1)


def positive_ints(fn: str, name: str, value: Any) -> tuple[int, ...]:
  """A positive int, or a tuple or list of them, as a tuple."""
  dims = value if isinstance(value, (tuple, list)) else (value,)
  return tuple(positive_int(fn, name, d) for d in dims)


def check_bool(fn: str, name: str, value: Any, *, none: bool = False
               ) -> Any:
  """``True`` or ``False`` (a numpy bool too; ``None`` with ``none``), else a
  TypeError: nothing merely truthy."""
  if none and value is None:
    return None
  if not _is_bool(value):
    allowed = "None, True or False" if none else "True or False"
    raise TypeError(f"{fn}: `{name}` must be {allowed}, got "
                    f"{type(value).__name__} {value!r}")
  return bool(value)


def check_shape(fn: str, shape: Any, key: str | None = None, *,
                arg: str = "shape") -> tuple[int, ...]:
  """A per-sample shape as a tuple of non-negative ints (an int means
  ``(int,)``, a bool is refused); ``arg`` names the argument."""
  where = f"field {key!r}: " if key is not None else ""
  if _is_bool(shape):
    raise TypeError(f"{fn}: {where}`{arg}` must be a tuple of ints, got bool "
                    f"{shape!r}")
  if isinstance(shape, (int, np.integer)):
    shape = (shape,)
  why = ""
  try:
    if isinstance(shape, (str, bytes)):
      raise TypeError
    items = tuple(shape)
    if any(_is_bool(d) for d in items):
      why = " (a bool is not a dimension)"
      raise TypeError
    dims = tuple(operator.index(d) for d in items)
  except TypeError:
    raise TypeError(f"{fn}: {where}`{arg}` must be a tuple of ints, got "
                    f"{shape!r}{why}") from None
  if any(d < 0 for d in dims):
    raise ValueError(f"{fn}: {where}`{arg}` must be non-negative, got {dims}")
  return dims


_MAX_BYTES = 2**63 - 1


def check_size(fn: str, shape: tuple[int, ...], dtype: Any,
               key: str | None = None, doc: str = "") -> None:
  """A ValueError if an array of ``shape`` and ``dtype`` would not fit an
  int64 of bytes (XLA would abort); ``doc`` names the axes."""
  nbytes = math.prod(shape) * np.dtype(dtype).itemsize
  if nbytes > _MAX_BYTES:
    where = f"field {key!r}: " if key is not None else ""
    raise ValueError(
        f"{fn}: {where}the array would have shape {tuple(shape)}{doc} of "
        f"{np.dtype(dtype).name}, {nbytes:.3g} bytes, more than any address "
        "space holds (2**63 - 1); check the sizes")


def zeros(fn: str, shape: tuple[int, ...], dtype: Any, key: str | None = None,
          doc: str = "") -> jax.Array:
  """``jnp.zeros(shape, dtype)``, with out of device memory a MemoryError
  naming ``fn`` (and ``key``) instead of XLA's ``RESOURCE_EXHAUSTED``."""
  try:
    return jnp.zeros(shape, dtype)
  except jax.errors.JaxRuntimeError as err:
    if "RESOURCE_EXHAUSTED" not in str(err):
      raise
    where = f"field {key!r}: " if key is not None else ""
    raise MemoryError(
        f"{fn}: {where}no memory for an array of shape {tuple(shape)}{doc} "
        f"of {np.dtype(dtype).name} "
        f"({math.prod(shape) * np.dtype(dtype).itemsize:.3g} bytes): "
        f"{str(err).splitlines()[0]}") from None


def check_arrays(fn: str, name: str, tree: Any, *, torch: bool = False
                 ) -> None:
  """A TypeError naming the path of a leaf of ``tree`` that is not an array or
  a number (a torch tensor is allowed with ``torch``), or of a dict whose keys
  cannot be sorted; a ValueError for a Python int outside int32, x64 off."""
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
    if isinstance(leaf, (jax.Array, bool, float, complex)):
      continue
    where = f"{name}{jax.tree_util.keystr(path)}"
    if isinstance(leaf, (np.ndarray, np.generic)):
      if kind(leaf.dtype) in "biufc":
        continue
      what = "array" if isinstance(leaf, np.ndarray) else "scalar"
      held = {"U": "str", "S": "bytes", "O": "Python objects",
              "M": "datetimes", "m": "timedeltas"}.get(leaf.dtype.kind,
                                                       "non-numbers")
      raise TypeError(f"{fn}: `{where}` is a numpy {what} of {held} (dtype "
                      f"{leaf.dtype}), expected numbers (bool, integer, "
                      "floating or complex)")
    if torch and is_torch(leaf):
      continue
    if isinstance(leaf, int):
      if not x64_enabled() and not -2**31 <= leaf < 2**31:
        raise ValueError(f"{fn}: `{where}` is the Python int {leaf}, "
                         "outside int32 (jax_enable_x64 is off); pass an "
                         "array of the dtype you mean")
      continue
    hint = (" (a torch tensor: pass t.numpy() or jrollout.torch.from_torch"
            "(t))" if is_torch(leaf) else "")
    cls = type(leaf).__name__
    raise TypeError(f"{fn}: `{where}` is a{'n' * (cls[0] in 'aeiouAEIOU')} "
                    f"{cls}, not an array or a number{hint}")


def _dicts(name: str, tree: Any) -> Iterator[tuple[str, dict]]:
  """Every dict in ``tree``, at any depth, with its path from ``name``."""
  if hasattr(tree, "shape"):   # an array, first: the common leaf
    return
  if isinstance(tree, dict):
    yield name, tree
    children = [(f"[{key!r}]", value) for key, value in tree.items()]
  else:
    try:   # one level: the node's children (a leaf is its own only child)
      flat = jax.tree_util.tree_flatten_with_path(
          tree, is_leaf=lambda x: x is not tree)[0]
    except ValueError:
      return
    children = [(jax.tree_util.keystr(path), child)
                for path, child in flat if path]
  for where, child in children:
    yield from _dicts(name + where, child)


def check_str_keys(fn: str, name: str, tree: Any) -> None:
  """A TypeError naming the dict and key if any dict key in ``tree``, at any
  depth, is not a str."""
  for where, found in _dicts(name, tree):
    for key in found:
      if not isinstance(key, str):
        raise TypeError(
            f"{fn}: `{where}` has the key {key!r} of type "
            f"{type(key).__name__}; expected str keys (names such as 'obs')")


# --- Scalars and array arguments: dtypes and shapes, read statically. ---


def check_scalar(fn: str, name: str, value: Any, *,
                 low: float | None = None, high: float | None = None,
                 low_open: bool = False) -> None:
  """A real scalar (Python, numpy or a 0-d array), else a TypeError; a
  ValueError if not 0-d or, when concrete, outside ``[low, high]``
  (``(low, high]`` with ``low_open``)."""
  dtype: Any
  if isinstance(value, (int, float)) and not _is_bool(value):
    dtype, shape = np.dtype(type(value)), ()
  else:
    dtype = getattr(value, "dtype", None)
    if dtype is None or _is_bool(value) or isinstance(value, complex):
      raise TypeError(
          f"{fn}: `{name}` must be a real number (a float or a 0-d float "
          f"array), got {type(value).__name__} {value!r}")
    shape = tuple(getattr(value, "shape", ()))
  try:
    dtype = np.dtype(dtype)
  except TypeError:
    dtype = np.dtype(object)
  if not (jnp.issubdtype(dtype, jnp.floating)
          or jnp.issubdtype(dtype, jnp.integer)):
    raise TypeError(f"{fn}: `{name}` must be a real number, got an array of "
                    f"dtype {dtype}")
  if shape != ():
    raise ValueError(
        f"{fn}: `{name}` has shape {shape}, expected a scalar () (use "
        "jax.vmap to batch over it)")
  if isinstance(value, jax.core.Tracer) or (low is None and high is None):
    return
  x = float(np.asarray(value))
  low_ok = low is None or (x > low if low_open else x >= low)
  if not (low_ok and (high is None or x <= high)):
    if high is None:
      bound = f"{'>' if low_open else '>='} {low:g}"
    else:
      bound = f"in {'(' if low_open else '['}{low:g}, {high:g}]"
    given = value if isinstance(value, (int, float)) else x
    raise ValueError(f"{fn}: `{name}` must be {bound}, got {given!r}")


def check_discount(fn: str, name: str, value: Any) -> None:
  """A discount-like factor in ``[0, 1]`` (``check_scalar``)."""
  check_scalar(fn, name, value, low=0.0, high=1.0)


def _check_kind(fn: str, name: str, value: Any, kinds: str,
                expected: str) -> None:
  """A TypeError unless ``value``'s dtype is of one of ``kinds`` (the
  letters of ``_casts.kind``); ``expected`` says what it should be."""
  dtype = dtype_of(value, fn, f"`{name}`")
  if kind(dtype) not in kinds:
    raise TypeError(
        f"{fn}: `{name}` has dtype {dtype}, expected {expected}")


def check_real(fn: str, name: str, value: Any) -> None:
  """An array of a real dtype (bool, integer or float), else a TypeError."""
  _check_kind(fn, name, value, "biuf", "a real (bool, integer or floating) "
              "dtype; a complex value would lose its imaginary part")


def check_floating(fn: str, name: str, value: Any, why: str | None = None
                   ) -> None:
  """An array of a floating dtype, else a TypeError ending with ``why``
  (by default, how to cast)."""
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
  """No NaN among floating flags: a ValueError when concrete, a ``checkify``
  check when traced; free for bool and integer flags."""
  dtype = dtype_of(value, fn, f"`{name}`")
  if not jnp.issubdtype(dtype, jnp.inexact):
    return
  size = math.prod(shape_of(value))
  what = (f"{fn}: `{name}` has NaN at {{count}} of {size} elements (the "
          "first at flat index {first}); a flag is True or False and NaN "
          "would read as True: replace the NaNs")
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
  """An array of shape ``expected`` (``doc`` says where it comes from), else
  a ValueError."""
  got = shape_of(value, fn, f"`{name}`")
  if got != expected:
    raise ValueError(f"{fn}: `{name}` has shape {got}, expected {expected} = "
                     f"{doc}")


def check_trailing(fn: str, name: str, value: Any, shape: tuple[int, ...],
                   what: str) -> tuple[int, ...]:
  """An array ``[..., *shape]``; returns its leading axes, else a ValueError
  (``what`` names the trailing axes)."""
  got = shape_of(value, fn, f"`{name}`")
  k = len(shape)
  if len(got) < k or got[len(got) - k:] != shape:
    raise ValueError(
        f"{fn}: `{name}` has shape {got}, expected [..., *{shape}] (any "
        f"leading axes, then {what} {shape})")
  return got[:len(got) - k]


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


# --- PRNG keys. ---


@functools.lru_cache(maxsize=None)
def _raw_key_shape(impl: str) -> tuple[int, ...]:
  del impl   # the cache key: the default PRNG implementation
  return jax.eval_shape(
      lambda: jax.random.key_data(jax.random.key(0))).shape


def check_key(fn: str, key: Any, name: str = "key") -> None:
  """One PRNG key, typed (shape ``()``) or raw ``uint32`` of the default
  implementation: a TypeError for a non-key, a ValueError for several keys
  or a raw key of the wrong shape."""
  dtype = getattr(key, "dtype", None)
  shape = tuple(getattr(key, "shape", ()) or ())
  hint = "jax.random.key(seed)"
  try:
    typed = dtype is not None and jax.dtypes.issubdtype(dtype,
                                                        jax.dtypes.prng_key)
  except TypeError:   # e.g. a torch dtype
    typed = False
  if typed:
    if shape != ():
      raise ValueError(
          f"{fn}: `{name}` is an array of keys of shape {shape}; expected "
          "one key (shape ()): split it and call once per key, or use "
          "jax.vmap")
    return
  try:
    raw = dtype is not None and np.dtype(dtype) == np.uint32
  except TypeError:   # e.g. a torch dtype
    raw = False
  if raw and len(shape) == 1:
    impl = getattr(jax.config, "jax_default_prng_impl")  # noqa: B009 (mypy)
    want = _raw_key_shape(str(impl))
    if shape == want:
      return
    raise ValueError(
        f"{fn}: `{name}` is a raw uint32 key of shape {shape}; the default "
        f"PRNG implementation's raw keys have shape {want}; pass {hint}")
  got = (f"{type(key).__name__} {key!r}" if dtype is None
         else f"an array of dtype {dtype} and shape {shape}")
  raise TypeError(f"{fn}: `{name}` must be a PRNG key ({hint}), got {got}")
