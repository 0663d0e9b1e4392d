"""The static check of a write, and its cache.

``check_values`` checks a ``{name: array}`` write against the registered
fields (names, shapes, dtypes: ``_check_static``) and caches what passed by
the write's signature in one process-global dict (``_PASSED``), so a loop
that writes the same signature again pays a dict lookup; the values of a
narrowing cast are checked on every call (``jrollout._casts``).
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import functools
from typing import Any, NamedTuple
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from jrollout._casts import can_cast
from jrollout._casts import check_narrowing
from jrollout._casts import narrows
from jrollout._checks import dtype_of
from jrollout._checks import is_torch
from jrollout._checks import shape_of
from jrollout._state import is_array
from jrollout._state import RolloutState


class WritePlan(NamedTuple):
  """What a write that passed the static checks needs on every call.

  Cached with the write's signature (``check_values``).

  Attributes:
    narrow: the keys whose cast narrows: their values are checked on every
      write (``check_narrowing``).
    host: ``(key, dtype)`` of each flat field given a host value (a numpy
      array, a list, a number) and its storage dtype: the write copies the
      value into a new array of that dtype (``jrollout._buffer``), so the
      caller may reuse its buffer as soon as the call returns.
    host_trees: ``(key, dtypes)`` of each pytree field with a host leaf,
      ``dtypes`` a tuple over the value's leaves (in ``tree_flatten``
      order): the storage dtype of each host leaf, copied the same way,
      and None for a JAX array, taken as it is. Exact for the leaves' types
      because the signature holds them. Apart from ``host`` so that a flat
      write asks no type per field.
  """
  narrow: tuple[str, ...]
  host: tuple[tuple[str, np.dtype], ...]
  host_trees: tuple[tuple[str, Any], ...] = ()


Layout = dict[str, int]


def write_layout(state: RolloutState) -> Layout:
  """``{name: spec id}``: what ``check_values`` reads of a state (each field's
  storage shape and dtype, as ``_spec_id``). A caller that writes many
  states of one layout (the writer) takes it once and passes it to
  ``check_values``."""
  return {k: _tree_spec_id(v) for k, v in state.data.items()}


# id(state) -> (weak reference to it, its layout): the layout of a state
# that a host-loop write made (``keep_layout``), so that the next write of
# it reads no storage spec. A write never changes a field's shape or dtype,
# and a state is immutable, so the entry holds for the state's life; the
# reference drops the entry when the state dies (and tells a new object
# with a reused id apart). Not an attribute of the state: the ints are
# this process's spec ids, and a pickled state must not carry them.
_LAYOUTS: dict[int, tuple[Any, Layout]] = {}


def kept_layout(state: RolloutState) -> Layout | None:
  """The layout ``keep_layout`` recorded for ``state``, or None."""
  entry = _LAYOUTS.get(id(state))
  if entry is None or entry[0]() is not state:
    return None
  return entry[1]


def keep_layout(state: RolloutState, layout: Layout) -> None:
  """Records ``layout`` (``write_layout`` of a state of the same storage
  shapes and dtypes) as ``state``'s, until ``state`` is collected."""
  key = id(state)
  _LAYOUTS[key] = (weakref.ref(state, functools.partial(_drop, key)), layout)


def _drop(key: int, _: Any) -> None:
  entry = _LAYOUTS.get(key)
  if entry is not None and entry[0]() is None:
    del _LAYOUTS[key]


# (storage shape, dtype) -> a small int, never reused: signatures hold the
# int (cheaper to hash on every write than the shape and dtype).
_SPEC_IDS: dict[tuple[Any, ...], int] = {}


def _spec_id(shape: tuple[int, ...], dtype: Any) -> int:
  spec = (tuple(shape), np.dtype(dtype))
  spec_id = _SPEC_IDS.get(spec)
  if spec_id is None:
    spec_id = _SPEC_IDS[spec] = len(_SPEC_IDS)
  return spec_id


def check_values(fn: str, state: RolloutState, data: Any,
                 leading: tuple[int, ...], leading_doc: str,
                 layout: Layout | None = None) -> WritePlan:
  """Checks a ``{name: array}`` write against the registered fields.

  Static checks (keys, shapes, dtypes) first, cached by the write's
  signature; then, for the keys whose cast narrows, the values: concrete
  ones are checked now (``cast_error``), traced ones get a ``checkify``
  check.

  The cache (``_PASSED``, the only one for writes) is keyed by everything
  the static checks read (``_signature``): the checking function itself,
  ``leading``, the x64 setting, and per field its name, the value's type,
  shape and dtype and the field's storage shape and dtype. A hit is exactly
  a write that would pass again, so the cache cannot go stale.

  Args:
    fn: name of the public function, for messages.
    state: the state being written.
    data: ``{name: [*leading, *shape]}``.
    leading: the expected leading axes, e.g. ``(E,)`` or ``(T, E)``.
    leading_doc: their letters, e.g. ``"[E]"``, for messages.
    layout: ``write_layout(state)``, if the caller holds it (it saves
      reading the storage arrays' shapes and dtypes on every call).

  Returns:
    The write's ``WritePlan``.

  Raises:
    TypeError: ``data`` is not a dict; a value that is not an array of
      numbers (a torch tensor, a ragged list, a string); a dtype that
      cannot be cast safely (``can_cast``).
    KeyError: an unregistered name.
    ValueError: a shape that is not ``[*leading, *shape]``; a concrete
      value that the cast would change.
  """
  if type(data) is not dict and not isinstance(data, Mapping):
    raise TypeError(
        f"{fn}: `data` must be a dict {{name: array}}, got "
        f"{type(data).__name__}")
  signature = _signature(state, data, leading, layout)
  try:
    plan = _PASSED.get(signature) if signature is not None else None
  except TypeError:   # an unhashable shape: not cached
    plan = signature = None
  if plan is None:
    plan = _check_static(fn, state, data, leading, leading_doc)
    if signature is not None:
      if len(_PASSED) >= 1024:
        _PASSED.clear()
      _PASSED[signature] = plan
  if plan.narrow:
    check_narrowing(fn, state, data, plan.narrow)
  return plan


def _check_static(fn: str, state: RolloutState, values: Mapping[str, Any],
                  leading: tuple[int, ...], leading_doc: str) -> WritePlan:
  narrow: list[str] = []
  host: list[Any] = []
  host_trees: list[Any] = []
  x64 = jax.enable_x64.value   # as read by _signature (x64_enabled's value)
  for key, value in values.items():
    if key not in state.data:
      known = ", ".join(repr(k) for k in state.names) or "none"
      raise KeyError(
          f"{fn}: field {key!r} is not registered (registered: {known}); "
          f"call jr.register(state, {key!r}, shape=..., dtype=...) first")
    storage = state.data[key]
    if not is_array(storage):
      _check_tree(fn, key, value, storage, leading, leading_doc, x64,
                  narrow, host_trees)
      continue
    if is_torch(value):
      raise TypeError(
          f"{fn}: field {key!r} is a torch.Tensor; pass its numpy view "
          "`t.numpy()` (a CPU tensor, no copy: staged or read like any "
          "numpy array) or import it with jrollout.torch.from_torch(t)")
    if isinstance(value, dict) or hasattr(type(value), "_fields") or (
        dataclasses.is_dataclass(value)):
      raise TypeError(
          f"{fn}: field {key!r} is registered as one array, got a "
          f"{type(value).__name__}; register a pytree field with "
          f"jr.register(state, {key!r}, like=value)")
    got_dtype = dtype_of(value, fn, f"field {key!r}")
    if not (got_dtype == np.bool_ or jnp.issubdtype(got_dtype, jnp.number)):
      raise TypeError(
          f"{fn}: field {key!r} has dtype {got_dtype}, not an array of "
          f"numbers ({type(value).__name__})")
    shape, dst = state.spec(key)
    expected = leading + shape
    got_shape = shape_of(value, fn, f"field {key!r}")
    if tuple(got_shape) != expected:
      raise ValueError(
          f"{fn}: field {key!r} has shape {tuple(got_shape)}, expected "
          f"{expected} = {leading_doc} + {shape}")
    if not can_cast(got_dtype, dst):
      raise TypeError(
          f"{fn}: field {key!r} has dtype {got_dtype.name}, which cannot be "
          f"cast safely to the registered dtype {dst.name}; "
          f"cast it explicitly (e.g. `.astype(jnp.{dst.name})`)")
    if narrows(got_dtype, dst, x64):
      narrow.append(key)
    if not isinstance(value, (jax.Array, jax.core.Tracer)):
      host.append((key, dst))
  return WritePlan(tuple(narrow), tuple(host), tuple(host_trees))


def _check_tree(fn: str, key: str, value: Any, storage: Any,
                leading: tuple[int, ...], leading_doc: str, x64: bool,
                narrow: list[str], host_trees: list[Any]) -> None:
  """``_check_static`` of a pytree field: the value has exactly the field's
  leaves (paths and containers), each checked as a flat field's value."""
  try:
    got = jax.tree_util.tree_flatten_with_path(value)
  except Exception as err:   # noqa: BLE001
    raise TypeError(f"{fn}: field {key!r} is not a pytree of arrays: "
                    f"{err}") from None
  want, want_def = jax.tree_util.tree_flatten_with_path(storage)
  got_paths = {jax.tree_util.keystr(p): leaf for p, leaf in got[0]}
  want_paths = [jax.tree_util.keystr(p) for p, _ in want]
  missing = [p for p in want_paths if p not in got_paths]
  if missing:
    raise ValueError(
        f"{fn}: field {key!r} is missing leaf {missing[0]}"
        + (f" (and {missing[1:]})" if missing[1:] else "")
        + "; a write gives every leaf of a field")
  extra = [p for p in got_paths if p not in set(want_paths)]
  if extra:
    raise ValueError(
        f"{fn}: field {key!r} has leaf {extra[0]}, which is not registered "
        f"(registered leaves: {want_paths})")
  if got[1] != want_def:  # type: ignore[operator]
    raise TypeError(
        f"{fn}: field {key!r} has structure {got[1]}, registered as "
        f"{want_def} (same leaves, other containers)")
  dtypes, any_host, narrows_any = [], False, False
  for (path, leaf), (_, stored) in zip(got[0], want):
    where = f"field {key!r} leaf {jax.tree_util.keystr(path)}"
    if is_torch(leaf):
      raise TypeError(f"{fn}: {where} is a torch.Tensor; pass its numpy "
                      "view `t.numpy()` or import it with "
                      "jrollout.torch.from_torch(t)")
    got_dtype = dtype_of(leaf, fn, where)
    if not (got_dtype == np.bool_ or jnp.issubdtype(got_dtype, jnp.number)):
      raise TypeError(f"{fn}: {where} has dtype {got_dtype}, not an array "
                      f"of numbers ({type(leaf).__name__})")
    shape, dst = tuple(stored.shape[2:]), np.dtype(stored.dtype)
    expected = leading + shape
    got_shape = tuple(shape_of(leaf, fn, where))
    if got_shape != expected:
      raise ValueError(f"{fn}: {where} has shape {got_shape}, expected "
                       f"{expected} = {leading_doc} + {shape}")
    if not can_cast(got_dtype, dst):
      raise TypeError(
          f"{fn}: {where} has dtype {got_dtype.name}, which cannot be cast "
          f"safely to the registered dtype {dst.name}; cast it explicitly "
          f"(e.g. `.astype(jnp.{dst.name})`)")
    narrows_any |= narrows(got_dtype, dst, x64)
    host_leaf = not isinstance(leaf, (jax.Array, jax.core.Tracer))
    any_host |= host_leaf
    dtypes.append(dst if host_leaf else None)
  if narrows_any:
    narrow.append(key)
  if any_host:
    host_trees.append((key, tuple(dtypes)))


# The one cache of writes that passed the static checks: signature ->
# WritePlan. Cleared when full (a loop writes a few signatures, each once).
_PASSED: dict[tuple[Any, ...], WritePlan] = {}


def _signature(state: RolloutState, values: Mapping[str, Any],
               leading: tuple[int, ...], layout: Layout | None
               ) -> tuple[Any, ...] | None:
  """Everything ``_check_static`` decides on, or None if it cannot be keyed.

  ``_check_static`` itself stands for the rules (a changed function is
  another key); a value's type decides the torch refusal and whether it
  is a host value; a dtype that is not a numpy dtype (``dtype_of`` would
  look at the values) or an unknown key is not cached. Run on every write:
  each lookup here is one of the writer's microseconds.
  """
  sig: list[Any] = [_check_static, leading, jax.enable_x64.value]
  data = state.data if layout is None else None
  try:
    for key, value in values.items():
      try:
        dtype = value.dtype
      except AttributeError:   # a pytree field's value (or not an array)
        entry = _tree_entry(key, value, data, layout)
        if entry is None:
          return None
        sig.append(entry)
        continue
      if type(dtype) not in _NUMPY_DTYPES:
        if not isinstance(dtype, np.dtype):
          return None
        _NUMPY_DTYPES.add(type(dtype))
      if data is not None:
        stored = data[key]
        spec = _SPEC_IDS.get((stored.shape, stored.dtype))
        if spec is None:
          spec = _spec_id(stored.shape, stored.dtype)
      else:
        spec = layout[key]  # type: ignore[index]
      sig.append((key, type(value), value.shape, dtype, spec))
  except (KeyError, AttributeError):
    return None   # e.g. an unknown key or a list value: take the slow path
  return tuple(sig)


def _tree_entry(key: str, value: Any, data: Any, layout: Layout | None
                ) -> tuple[Any, ...] | None:
  """``_signature``'s entry for a pytree value: its treedef, each leaf's
  type, shape and dtype, and the field's storage spec; None if a leaf's
  dtype is not a numpy dtype."""
  spec = _tree_spec_id(data[key]) if data is not None else layout[key]  # type: ignore[index]
  try:   # dicts, lists and plain tuples of numpy-dtyped arrays: no flatten
    return (key, "plain", _plain_spec(value, typed=True), spec)
  except _NotPlain:
    pass
  leaves, treedef = jax.tree_util.tree_flatten(value)
  specs = []
  for leaf in leaves:
    dtype = leaf.dtype
    if type(dtype) not in _NUMPY_DTYPES:
      if not isinstance(dtype, np.dtype):
        return None
      _NUMPY_DTYPES.add(type(dtype))
    specs.append((type(leaf), leaf.shape, dtype))
  return (key, treedef, tuple(specs), spec)


class _NotPlain(Exception):
  """A storage node other than a dict, list or plain tuple."""


def _plain_spec(tree: Any, typed: bool = False) -> Any:
  """A key of a pytree of dicts, lists and plain tuples of arrays with a
  numpy dtype: its node types, dict keys (in order) and each array's shape
  and dtype (and type, if ``typed``: a value's, which decides the host
  copy). Equal keys mean the same structure and leaves; built without
  JAX's flattening, on every write of a pytree field.

  Raises:
    _NotPlain: another node (a NamedTuple, a dataclass, None) or leaf (a
      list of numbers, a torch tensor): the caller flattens through JAX.
  """
  kind = type(tree)
  if kind is dict:
    items: Any = tree.items()
  elif kind is list or kind is tuple:
    items = enumerate(tree)
  else:
    raise _NotPlain
  parts: list[Any] = [kind]
  for k, v in items:
    dtype = getattr(v, "dtype", None)
    if dtype is None:
      parts.append((k, _plain_spec(v, typed)))
    elif type(dtype) not in _NUMPY_DTYPES:
      raise _NotPlain   # not a numpy dtype (or one not seen yet)
    else:
      parts.append((k, type(v), v.shape, dtype) if typed
                   else (k, v.shape, dtype))
  return tuple(parts)


def _tree_spec_id(storage: Any) -> int:
  """``_spec_id`` of a field's storage, one array or a pytree of them."""
  if is_array(storage):
    return _spec_id(storage.shape, storage.dtype)
  try:
    spec: Any = ("plain", _plain_spec(storage))
  except _NotPlain:   # NamedTuples, dataclasses: through JAX
    leaves, treedef = jax.tree_util.tree_flatten(storage)
    spec = ("tree", treedef, tuple((x.shape, x.dtype) for x in leaves))
  spec_id = _SPEC_IDS.get(spec)
  if spec_id is None:
    spec_id = _SPEC_IDS[spec] = len(_SPEC_IDS)
  return spec_id


# The classes of the numpy dtypes seen (np.dtype's isinstance is slow).
_NUMPY_DTYPES: set[type] = set()
