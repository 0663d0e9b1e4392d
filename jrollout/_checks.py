"""Validators: one check per kind of argument, shared by every entry point.

Each raises in plain Python before any JAX op, at trace time where the fact
is static, naming the function, the argument (and field), what was expected
and what was given; values are checked where concrete. Here too: the cast
rule of writes (which casts a write applies, and which values a narrowing
cast would change) and the check that a state is one live state.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np

from jrollout._state import RolloutState

# --- Python values: ints, bools, shapes, dtypes. ---


def _is_bool(value: Any) -> bool:
  return isinstance(value, (bool, np.bool_))


def check_int(fn: str, name: str, value: Any, *, minimum: int | None = None
              ) -> int:
  """``value`` as a Python int (``>= minimum`` if given).

  Accepts Python and numpy integers and concrete integer 0-d arrays (via
  ``__index__``); refuses bools, floats and everything else.

  Raises:
    TypeError: ``value`` is not an integer (a bool or a float included),
      naming ``fn``, ``name`` and what was given.
    ValueError: ``value`` is below ``minimum``.
  """
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
  """``value`` as a positive Python int: the one check for sizes and counts.

  Raises:
    TypeError: ``value`` is not an integer (a bool or a float included),
      naming ``fn``, ``name`` and what was given.
    ValueError: ``value`` is not positive.
  """
  return check_int(fn, name, value, minimum=1)


def positive_ints(fn: str, name: str, value: Any) -> tuple[int, ...]:
  """A positive int, or a tuple (or list) of them, as a tuple: a grid of
  sizes such as ``num_envs``; each one is checked by ``positive_int``."""
  dims = value if isinstance(value, (tuple, list)) else (value,)
  return tuple(positive_int(fn, name, d) for d in dims)


def check_bool(fn: str, name: str, value: Any, *, none: bool = False
               ) -> Any:
  """A flag: ``True`` or ``False`` (or a numpy bool), nothing truthy; with
  ``none``, ``None`` too (returned as is).

  Raises:
    TypeError: anything else (``"no"``, ``1``, ``None``, an array).
  """
  if none and value is None:
    return None
  if not _is_bool(value):
    allowed = "None, True or False" if none else "True or False"
    raise TypeError(f"{fn}: `{name}` must be {allowed}, got "
                    f"{type(value).__name__} {value!r}")
  return bool(value)


def check_epoch(fn: str, value: Any) -> Any:
  """An epoch number: a concrete int in ``[0, 2**31)``, or a traced integer
  scalar (folded into the key as is).

  Raises:
    TypeError: a bool, a float, a non-integer or non-scalar array.
    ValueError: a concrete epoch outside ``[0, 2**31)``.
  """
  if isinstance(value, jax.core.Tracer):
    if value.shape != () or not jnp.issubdtype(value.dtype, jnp.integer):
      raise TypeError(
          f"{fn}: `epoch` must be an integer scalar, got a traced "
          f"{value.dtype} array of shape {value.shape}")
    return value
  if isinstance(value, (jax.Array, np.ndarray)) and (
      value.shape != () or not jnp.issubdtype(value.dtype, jnp.integer)):
    raise TypeError(f"{fn}: `epoch` must be an integer scalar, got a "
                    f"{value.dtype} array of shape {value.shape}")
  epoch = check_int(fn, "epoch", value, minimum=0)
  if epoch >= 2**31:
    raise ValueError(f"{fn}: `epoch` must be below 2**31, got {epoch}")
  return epoch


def check_shape(fn: str, shape: Any, key: str | None = None, *,
                arg: str = "shape") -> tuple[int, ...]:
  """A per-sample shape: a tuple of non-negative ints (an int means
  ``(int,)``). A bool is not a dimension: ``shape=True`` and
  ``shape=(2, False)`` are refused, not read as ``(1,)`` or ``(2, 0)``.
  ``arg`` is how the message names the argument (``shape['obs']`` for a
  leaf of a tree of shapes)."""
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


def x64_enabled() -> bool:
  """Whether JAX keeps 64-bit dtypes now (``jax_enable_x64``, context
  managers included)."""
  return jax.dtypes.canonicalize_dtype(np.int64).itemsize == 8


# The largest array jrollout allocates: its size in bytes must fit an int64
# (XLA aborts the process on an element count that overflows one).
_MAX_BYTES = 2**63 - 1


def check_size(fn: str, shape: tuple[int, ...], dtype: Any,
               key: str | None = None, doc: str = "") -> None:
  """Refuses an array whose byte size does not fit an int64.

  XLA computes element counts in int64 and aborts the interpreter when the
  product overflows (``overflow in static extent product``); this raises a
  ``ValueError`` first. ``doc`` names the axes in the message.
  """
  nbytes = math.prod(shape) * np.dtype(dtype).itemsize
  if nbytes > _MAX_BYTES:
    where = f"field {key!r}: " if key is not None else ""
    raise ValueError(
        f"{fn}: {where}the array would have shape {tuple(shape)}{doc} of "
        f"{np.dtype(dtype).name}, {nbytes:.3g} bytes, more than any address "
        "space holds (2**63 - 1); check the sizes")


def zeros(fn: str, shape: tuple[int, ...], dtype: Any, key: str | None = None,
          doc: str = "") -> jax.Array:
  """``jnp.zeros(shape, dtype)``; a device out of memory is a MemoryError
  naming ``fn`` (and ``key``; ``doc`` names the axes), not XLA's
  ``RESOURCE_EXHAUSTED``. Call ``check_size`` first."""
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


def check_callable(fn: str, name: str, value: Any) -> None:
  """A function argument (``fn`` of the scans)."""
  if not callable(value):
    raise TypeError(f"{fn}: `{name}` must be a function (carry, minibatch) "
                    f"-> (carry, out), got {type(value).__name__}")


def check_step_output(fn: str, name: str, out: Any) -> Any:
  """What a scan's step function ``name`` returned: a ``(carry, out)`` pair
  (a tuple or list of two), checked at trace time inside the scan body.

  Raises:
    TypeError: anything else, naming ``fn``, ``name`` and what was returned.
  """
  if isinstance(out, (tuple, list)) and len(out) == 2:
    return out
  raise TypeError(f"{fn}: `{name}` must return a pair (carry, out), it "
                  f"returned {_describe(out)}; return (carry, None) if there "
                  "is no output")


def _describe(value: Any) -> str:
  """A short description of a value for messages (never its contents)."""
  if value is None:
    return "None"
  if isinstance(value, (tuple, list)):
    return f"a {type(value).__name__} of length {len(value)}"
  shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
  if shape is not None and dtype is not None:
    return f"an array of dtype {dtype} and shape {tuple(shape)}"
  return f"a {type(value).__name__}"


def _numeric(dtype: np.dtype) -> bool:
  """Whether arrays of ``dtype`` hold numbers (bool included) that JAX
  takes: not str, bytes, Python objects or datetimes."""
  return dtype.kind in "biufc" or (
      dtype.kind == "V" and jnp.issubdtype(dtype, jnp.number))


def check_arrays(fn: str, name: str, tree: Any, *, torch: bool = False
                 ) -> None:
  """A pytree whose leaves are arrays or numbers (a carry, a batch to
  place): a torch tensor (unless ``torch``: a compat class converts them),
  a string, a numpy array of strings or objects or another object is a
  TypeError naming its path, and so are dict keys that cannot be sorted
  (mixed types); a Python int out of the int32 range, with x64 off, is a
  ValueError (JAX would raise an OverflowError)."""
  try:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
  except ValueError:   # JAX sorts dict keys: a dict with mixed key types
    _check_sortable_keys(fn, name, tree)
    raise
  for path, leaf in leaves:
    if type(leaf) is np.ndarray and leaf.dtype.kind in "biufc":
      continue   # the common host leaf, first: this runs on every call
    if isinstance(leaf, (jax.Array, bool, float, complex)):
      continue
    where = f"{name}{jax.tree_util.keystr(path)}"
    if isinstance(leaf, (np.ndarray, np.generic)):
      if _numeric(leaf.dtype):
        continue
      what = "array" if isinstance(leaf, np.ndarray) else "scalar"
      raise TypeError(f"{fn}: `{where}` is a numpy {what} of "
                      f"{_kind_name(leaf.dtype)} (dtype {leaf.dtype}), "
                      "expected numbers (bool, integer, floating or complex)")
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
    kind = type(leaf).__name__
    raise TypeError(f"{fn}: `{where}` is a{'n' * (kind[0] in 'aeiouAEIOU')} "
                    f"{kind}, not an array or a number{hint}")


def _kind_name(dtype: np.dtype) -> str:
  return {"U": "str", "S": "bytes", "O": "Python objects",
          "M": "datetimes", "m": "timedeltas"}.get(dtype.kind, "non-numbers")


def check_str_keys(fn: str, name: str, tree: Any) -> None:
  """Every dict key in ``tree`` (a batch: ``{name: pytree}``) is a str, the
  name of a key, at any depth. A plain loop over the dicts: no flattening.

  Raises:
    TypeError: a key of another type, naming ``fn``, the dict's path in
      ``name`` and the key given.
  """
  if isinstance(tree, dict):
    for key, value in tree.items():
      if type(key) is not str and not isinstance(key, str):
        raise TypeError(
            f"{fn}: `{name}` has the key {key!r} of type "
            f"{type(key).__name__}; expected str keys (names such as 'obs')")
      if type(value) not in _ARRAY_TYPES:   # cheaper than isinstance
        check_str_keys(fn, f"{name}[{key!r}]", value)
    return
  if isinstance(tree, (jax.Array, np.ndarray)):
    _ARRAY_TYPES.add(type(tree))
    return
  if tree is None or isinstance(tree, _NOT_CONTAINERS):
    return
  children = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: x is not tree and isinstance(x, dict))[0]
  for path, child in children:
    if isinstance(child, dict):
      check_str_keys(fn, f"{name}{jax.tree_util.keystr(path)}", child)


# The array classes seen by check_str_keys (jax.Array's isinstance is slow).
_ARRAY_TYPES: set[type] = {np.ndarray}

# Values that hold no dict: check_str_keys stops there.
_NOT_CONTAINERS = (jax.Array, np.ndarray, np.generic, RolloutState, str, bytes,
                   int, float, complex)


def _check_sortable_keys(fn: str, name: str, tree: Any) -> None:
  """Finds the dict whose keys JAX cannot sort (it flattens dicts in
  sorted key order) and raises a TypeError naming it; returns if none."""
  if isinstance(tree, dict):
    try:
      sorted(tree)
    except TypeError:
      kinds = sorted({type(k).__name__ for k in tree})
      raise TypeError(
          f"{fn}: `{name}` has dict keys of types {kinds} that cannot be "
          f"sorted ({list(tree)[:4]!r}); JAX flattens a dict in sorted key "
          "order: use keys of one type") from None
    for key, value in tree.items():
      _check_sortable_keys(fn, f"{name}[{key!r}]", value)
    return
  if tree is None or isinstance(tree, _NOT_CONTAINERS):
    return
  try:
    children = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: x is not tree and isinstance(x, dict))[0]
  except ValueError:
    return
  for path, child in children:
    if isinstance(child, dict):
      _check_sortable_keys(fn, f"{name}{jax.tree_util.keystr(path)}", child)


def as_dtype(fn: str, what: str, dtype: Any) -> np.dtype:
  """``np.dtype(dtype)``, or a TypeError naming ``fn`` and ``what``. An
  array is refused, not read as its dtype (JAX deprecates that)."""
  if not isinstance(dtype, (type, np.dtype)) and hasattr(dtype, "shape"):
    raise TypeError(f"{fn}: {what} must be a dtype, got an array "
                    f"({type(dtype).__name__}); pass its `.dtype`")
  try:
    return np.dtype(dtype)
  except (TypeError, ValueError):
    raise TypeError(f"{fn}: {what} {dtype!r} is not a dtype") from None


def check_dtype(fn: str, key: str | None, dtype: Any) -> np.dtype:
  """A numeric or bool dtype that JAX can store as asked (no silent x64
  truncation)."""
  where = f"field {key!r}: " if key is not None else ""
  dt = as_dtype(fn, f"{where}`dtype`", dtype)
  if not (dt == np.bool_ or jnp.issubdtype(dt, jnp.number)):
    raise TypeError(f"{fn}: {where}`dtype` {dt} is not a numeric or bool "
                    "dtype (e.g. jnp.float32, jnp.int32, jnp.bool_)")
  _check_stored(fn, f"{where}dtype", dt, "register {} or enable x64")
  return dt


def check_float_dtype(fn: str, name: str, dtype: Any) -> np.dtype:
  """A floating dtype that JAX can store as asked (no silent x64
  truncation): the dtype of running statistics and reward scalers.

  Raises:
    TypeError: not a dtype, not floating, or a 64-bit float with x64 off.
  """
  dt = as_dtype(fn, f"`{name}`", dtype)
  if not jnp.issubdtype(dt, jnp.floating):
    raise TypeError(f"{fn}: `{name}` must be a floating dtype, got "
                    f"{dt.name}")
  _check_stored(fn, f"`{name}`", dt, "use {}")
  return dt


def _check_stored(fn: str, what: str, dt: np.dtype, advice: str) -> None:
  """Refuses a dtype that JAX would store narrower (64 bits with x64 off);
  ``advice`` is formatted with the dtype JAX would store."""
  canonical = np.dtype(jax.dtypes.canonicalize_dtype(dt))
  if canonical != dt:
    raise TypeError(
        f"{fn}: {what} {dt.name} is not available with jax_enable_x64 "
        f"disabled (JAX would store {canonical.name}); "
        + advice.format(canonical.name))


# --- Scalar hyperparameters. ---


def concrete_value(value: Any) -> Any | None:
  """A numpy view of ``value`` if it is concrete, None if it is traced."""
  if isinstance(value, jax.core.Tracer):
    return None
  return np.asarray(value)


def check_scalar(fn: str, name: str, value: Any, *,
                 low: float | None = None, high: float | None = None,
                 low_open: bool = False) -> None:
  """A real scalar hyperparameter (``gamma``, ``eps``, ``clip``, ...).

  Accepted: Python ints and floats, numpy real scalars, and 0-d real
  arrays (numpy or JAX, concrete or traced). The range ``[low, high]``
  (``(low, high]`` with ``low_open``) is checked whenever the value is
  concrete, a 0-d JAX array included; a traced value is not checked.

  Raises:
    TypeError: None, a string, a bool, a complex number, or an array of a
      non-real dtype.
    ValueError: an array that is not 0-d (batch over it with ``jax.vmap``),
      or a concrete value outside the range (NaN included).
  """
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
  concrete = concrete_value(value)
  if concrete is None or (low is None and high is None):
    return
  x = float(concrete)
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


def check_real(fn: str, name: str, value: Any) -> None:
  """An array argument of a real dtype (bool, integer or float).

  Raises:
    TypeError: a complex dtype (its imaginary part would be dropped), or a
      value that is not numeric.
  """
  dtype = dtype_of(value, fn, f"`{name}`")
  if not (dtype == np.bool_ or jnp.issubdtype(dtype, jnp.integer)
          or jnp.issubdtype(dtype, jnp.floating)):
    raise TypeError(
        f"{fn}: `{name}` has dtype {dtype}, expected a real (bool, integer "
        "or floating) dtype; a complex value would lose its imaginary part")


# --- Array arguments: dtypes and shapes, read statically. ---


def check_floating(fn: str, name: str, value: Any, why: str | None = None
                   ) -> None:
  """An array argument of a floating dtype. ``why`` ends the message (by
  default, how to cast).

  Raises:
    TypeError: another dtype, or a value that is not an array of numbers.
  """
  dtype = dtype_of(value, fn, f"`{name}`")
  if not jnp.issubdtype(dtype, jnp.floating):
    if why is None:
      why = f"cast it, e.g. `{name}.astype(jnp.float32)`"
    raise TypeError(f"{fn}: `{name}` has dtype {dtype.name}, expected a "
                    f"floating dtype ({why})")


def check_bool_array(fn: str, name: str, value: Any) -> None:
  """An array argument of dtype bool (a mask, episode ends).

  Raises:
    TypeError: another dtype, or a value that is not an array of numbers.
  """
  dtype = dtype_of(value, fn, f"`{name}`")
  if dtype != np.dtype(bool):
    raise TypeError(
        f"{fn}: `{name}` has dtype {dtype.name}, expected bool (e.g. "
        f"`{name}.astype(bool)`, True where it applies)")


def check_flags(fn: str, name: str, value: Any) -> None:
  """Flags (episode ends, a ``valid`` mask): bool or numeric, nonzero is
  True. Static: a NaN among float flags is ``check_flag_values``' job.

  Raises:
    TypeError: another dtype (str, bytes, objects), or not an array.
  """
  dtype = dtype_of(value, fn, f"`{name}`")
  if not (dtype == np.bool_ or jnp.issubdtype(dtype, jnp.number)):
    raise TypeError(
        f"{fn}: `{name}` has dtype {dtype}, expected bool or numeric flags "
        "(nonzero is True)")


def check_flag_values(fn: str, name: str, value: Any) -> None:
  """No NaN among floating flags (``astype(bool)`` would read it as True).

  Bool and integer flags cannot hold one, so this is free for them: the
  dtype decides statically. Concrete floating flags are read on the host
  (for a JAX array, a wait and a copy); traced ones get a ``checkify``
  check, reported when the caller wraps the function with
  ``checkify.checkify`` (it compiles to nothing otherwise).

  Raises:
    ValueError: concrete flags holding a NaN, naming ``fn``, ``name``, how
      many and where the first is.
  """
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
  """An array argument of the shape ``expected`` (``doc`` says where that
  shape comes from, e.g. ``"rewards.shape ([T, E])"``).

  Raises:
    ValueError: another shape.
    TypeError: a value that is not an array of numbers (a ragged list).
  """
  got = shape_of(value, fn, f"`{name}`")
  if got != expected:
    raise ValueError(f"{fn}: `{name}` has shape {got}, expected {expected} = "
                     f"{doc}")


def check_trailing(fn: str, name: str, value: Any, shape: tuple[int, ...],
                   what: str) -> tuple[int, ...]:
  """An array argument ``[..., *shape]``; returns its leading axes.

  Raises:
    ValueError: fewer axes, or trailing axes other than ``shape`` (``what``
      names them in the message).
  """
  got = shape_of(value, fn, f"`{name}`")
  k = len(shape)
  if len(got) < k or got[len(got) - k:] != shape:
    raise ValueError(
        f"{fn}: `{name}` has shape {got}, expected [..., *{shape}] (any "
        f"leading axes, then {what} {shape})")
  return got[:len(got) - k]


def check_instance(fn: str, name: str, value: Any, cls: type,
                   maker: str) -> None:
  """An argument of one of jrollout's state classes (``RunningStats``,
  ``RewardScaler``), made by ``jr.<maker>``.

  Raises:
    TypeError: any other type.
  """
  if not isinstance(value, cls):
    raise TypeError(f"{fn}: `{name}` must be a {cls.__name__} (from "
                    f"jr.{maker}), got {type(value).__name__}")


def check_unstacked(fn: str, name: str, count: Any, what: str) -> None:
  """One state, not a stack made with ``jax.vmap``: its scalar ``count``
  leaf has no axes (``what`` names the state in the message).

  Raises:
    ValueError: ``count`` has axes.
  """
  if jnp.ndim(count) != 0:
    raise ValueError(
        f"{fn}: `{name}` is a stack of {what} (count of shape "
        f"{shape_of(count)}); map over the stack with jax.vmap")


# --- The cast rule of writes. ---

_KIND_RANK = {"b": 0, "u": 1, "i": 1, "f": 2, "c": 3}


def _kind(dt: np.dtype) -> str:
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
  src_kind, dst_kind = _kind(np.dtype(src)), _kind(np.dtype(dst))
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
  if _kind(src) in "iu" and _kind(dst) in "iu":
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
  if _kind(np.dtype(value.dtype)) in "iu" and _kind(dst) in "iu":
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


# --- States and PRNG keys. ---


def deleted(x: Any) -> bool:
  """Whether ``x`` is a concrete JAX array whose buffers were deleted."""
  return isinstance(x, jax.Array) and not isinstance(
      x, jax.core.Tracer) and x.is_deleted()


def consumed_keys(state: RolloutState) -> list[str]:
  """The parts of ``state`` whose buffers were deleted (donated)."""
  parts = {**state.data, "counts": state.counts,
           "out_of_range": state.out_of_range}
  return [name for name, value in parts.items()
          if any(deleted(x) for x in jax.tree_util.tree_leaves(value))]


def consumed_message(fn: str, name: str, parts: list[str]) -> str:
  return (
      f"{fn}: `{name}` was consumed: the buffers of {parts} were deleted "
      "when a call donated them (a jr.RolloutWriter or ExperienceBuffer "
      "consumes the state it is given, and a writer consumes each state "
      "read from it at its next flush). Use the state that call holds now "
      "(`writer.state`), not the one passed in or read before")


def check_state(fn: str, state: Any, name: str = "state") -> RolloutState:
  """One live ``RolloutState``: the check of every function that takes one.

  Static (trace time): the type, and that it is not a stack of states (a
  ``RolloutState`` whose ``counts`` have more axes than ``[K, T]``, as
  ``jax.vmap`` returns; outside ``vmap`` every function would read the
  stack axis as T or E). Eagerly: that no buffer was deleted by a call
  that donated the state.

  Raises:
    TypeError: ``state`` is not a ``RolloutState``.
    ValueError: a stack of states, or a consumed state.
  """
  if not isinstance(state, RolloutState):
    raise TypeError(
        f"{fn}: `{name}` must be a RolloutState, got "
        f"{type(state).__name__} (make one with jr.init and jr.register)")
  counts = state.counts
  if getattr(counts, "ndim", 2) != 2 or (counts is None and any(
      tuple(v.shape[:2]) != (state.num_steps, state.num_envs)
      for v in jax.tree_util.tree_leaves(state.data))):
    one = "take one state out of the stack: jax.tree.map(lambda x: x[i], s)"
    if fn.isidentifier() and fn.islower():   # a function of jr
      how = (f"call {fn} under jax.vmap, which passes it one state at a "
             f"time (jax.vmap(jr.{fn})(states, ...)), or {one}")
    else:   # a writer or buffer object holds one state
      how = one
    if counts is None:
      shapes = jax.tree_util.tree_map(lambda v: tuple(v.shape), state.data)
      what = (f"its storage has shapes {shapes}, not [T, E, ...] with "
              f"[T, E] = [{state.num_steps}, {state.num_envs}]")
    else:
      what = (f"its write counts have shape {tuple(counts.shape)}, one "
              f"state's are [K, T] = {tuple(counts.shape[-2:])}; leading axes "
              f"{tuple(counts.shape[:-2])}")
    raise ValueError(f"{fn}: `{name}` is a stack of states ({what}), e.g. "
                     f"made with jax.vmap; {how}")
  if not isinstance(counts, jax.core.Tracer):
    parts = consumed_keys(state)
    if parts:
      raise ValueError(consumed_message(fn, name, parts))
  return state


@functools.lru_cache(maxsize=None)
def _raw_key_shape(impl: str) -> tuple[int, ...]:
  del impl   # the cache key: the default PRNG implementation
  return jax.eval_shape(
      lambda: jax.random.key_data(jax.random.key(0))).shape


def check_key(fn: str, key: Any, name: str = "key") -> None:
  """One PRNG key: a typed key (``jax.random.key(seed)``, shape ``()``) or
  a raw ``uint32`` key of the default implementation
  (``jax.random.PRNGKey(seed)``). Static: traced keys are checked too.

  Raises:
    TypeError: not a key (an int, a string, a float array, ...).
    ValueError: several keys (a key array of shape ``(n,)``: use
      ``jax.vmap``) or a raw key of the wrong length.
  """
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


# --- Array facts: shapes, dtypes and ints read without converting. ---


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
  try:
    arr = np.asarray(value)
  except (TypeError, ValueError):   # e.g. a ragged list
    raise TypeError(f"expected an integer scalar step, got "
                    f"{type(value).__name__}") from None
  if arr.shape != () or not np.issubdtype(arr.dtype, np.integer):
    raise TypeError(
        f"expected an integer scalar step, got {arr.dtype.name} array of "
        f"shape {arr.shape}")
  return int(arr)
