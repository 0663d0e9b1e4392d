"""What a checkpoint records of a pytree, and the checks of a target.

``to_orbax`` turns an item into the nested dict orbax writes and a record
kept in orbax's custom metadata: the path, shape and dtype of every leaf and
the sizes and fields of every ``RolloutState``. Arrays with no elements are
recorded but not written (orbax refuses them) and restored as zeros; writers
(``flush()`` and ``state``, as ``jr.RolloutWriter``) are saved as their
flushed state. ``check_target`` checks a restore target against a record
before anything is read, and ``check_matches`` one state against another
(``ExperienceBuffer.load_state_dict``).

Dimension letters: T = num_steps, E = num_envs, K = number of fields.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
import dataclasses
from typing import Any, Protocol, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np

from jrollout import _checks
from jrollout._state import RolloutState
from jrollout._types import PyTree

FORMAT = "jrollout"
VERSION = 2      # 2: with checksums; 1 (before them) is still read
SCALARS = (bool, int, float)


class Flushable(Protocol):
  """A host-loop writer, as ``jr.RolloutWriter``: ``flush()`` writes what
  is queued, and ``state`` is the state with every write applied. A save
  flushes it and saves its state."""

  @property
  def state(self) -> RolloutState: ...

  def flush(self) -> None: ...


_FLUSHABLE: dict[type, bool] = {}   # a cache: is_flushable by type


def is_flushable(x: Any) -> TypeGuard[Flushable]:
  """Whether ``x`` is a writer (its type defines ``flush`` and ``state``;
  looked up on the type: reading ``state`` on a writer would flush it)."""
  kind = type(x)
  found = _FLUSHABLE.get(kind)
  if found is None:
    found = _FLUSHABLE[kind] = (callable(getattr(kind, "flush", None))
                                and hasattr(kind, "state"))
  return found


def _flushed_state(writer: Flushable) -> RolloutState:
  writer.flush()
  return writer.state


def flushed(tree: PyTree) -> PyTree:
  """``tree`` with each writer flushed and replaced by its state."""
  return jax.tree_util.tree_map(
      lambda x: _flushed_state(x) if is_flushable(x) else x, tree,
      is_leaf=is_flushable)


def _names(path: tuple[Any, ...]) -> tuple[str, ...]:
  """A key path as strings, one per level (orbax's nested-dict names)."""
  names = []
  for entry in path:
    if isinstance(entry, jax.tree_util.DictKey):
      names.append(str(entry.key))
    elif isinstance(entry, jax.tree_util.GetAttrKey):
      names.append(entry.name)
    elif isinstance(entry, jax.tree_util.SequenceKey):
      names.append(str(entry.idx))
    else:   # FlattenedIndexKey of a custom node
      names.append(str(entry.key))
  return tuple(names)


def _numeric(dtype: Any) -> bool:
  """Whether a checkpoint can hold arrays of ``dtype``: bools, numbers
  (bfloat16 and the other ml_dtypes included) and typed PRNG keys."""
  try:
    return bool(dtype == np.bool_ or jnp.issubdtype(dtype, np.number)
                or jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
  except TypeError:
    return False


def _leaf_spec(fn: str, where: str, leaf: Any) -> tuple[tuple[int, ...], str]:
  """``(shape, dtype name)`` of a leaf; TypeError for what cannot be saved."""
  if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray,
                       np.generic)):
    if not _numeric(leaf.dtype):
      raise TypeError(
          f"{fn}: leaf {where or 'the tree'} is an array of dtype "
          f"{leaf.dtype}; a checkpoint holds arrays of numbers, bools and "
          "typed PRNG keys (strings and objects cannot be saved)")
    return tuple(int(d) for d in leaf.shape), str(leaf.dtype)
  if isinstance(leaf, SCALARS):
    return (), str(np.asarray(leaf).dtype)
  if is_flushable(leaf):
    raise TypeError(
        f"{fn}: leaf {where or 'the tree'} is a {type(leaf).__name__}, which "
        "cannot be a restore target; pass `writer.state` and wrap the "
        "restored state in a new writer: jr.RolloutWriter(jr.restore_rollout("
        "directory, writer.state))")
  raise TypeError(
      f"{fn}: leaf {where or 'the tree'} is a {type(leaf).__name__}; a "
      "checkpoint holds JAX or NumPy arrays, jax.ShapeDtypeStruct (as a "
      "restore target), RolloutStates, RolloutWriters and bool/int/float")


def _rollouts(tree: PyTree) -> dict[str, dict[str, Any]]:
  """``{key path: {"num_envs", "num_steps", "keys"}}`` of each RolloutState."""
  nodes = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, RolloutState))[0]
  return {jax.tree_util.keystr(path): {"num_envs": node.num_envs,
                                       "num_steps": node.num_steps,
                                       "keys": list(node.names)}
          for path, node in nodes if isinstance(node, RolloutState)}


@dataclasses.dataclass(frozen=True)
class Leaf:
  """A leaf of a saved item or of a restore target, with its spec."""
  path: str                    # jax.tree_util.keystr
  names: tuple[str, ...]       # the orbax nested-dict names
  shape: tuple[int, ...]
  dtype: str
  value: Any


def _leaves(fn: str, tree: PyTree) -> tuple[list[Leaf], Any]:
  """The leaves of ``tree`` with their specs, and its treedef."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  leaves: list[Leaf] = []
  seen: dict[tuple[str, ...], str] = {}
  for path, leaf in flat:
    where = jax.tree_util.keystr(path)
    names = _names(path)
    if names in seen:
      raise ValueError(f"{fn}: leaves {seen[names]} and {where} have the same "
                       f"name {'.'.join(names)!r} in a checkpoint; rename one")
    seen[names] = where
    leaves.append(Leaf(where, names, *_leaf_spec(fn, where, leaf), leaf))
  return leaves, treedef


def nest(pairs: list[tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
  """``{("a", "b"): x}`` pairs as the nested dict ``{"a": {"b": x}}``."""
  out: dict[str, Any] = {}
  for names, value in pairs:
    node = out
    for name in names[:-1]:
      node = node.setdefault(name, {})
    node[names[-1]] = value
  return out


def lookup(tree: dict[str, Any], names: tuple[str, ...]) -> Any:
  """The value at ``names`` in nested dicts (``nest``'s inverse)."""
  for name in names:
    tree = tree[name]
  return tree


def is_key(dtype: str) -> bool:
  """Whether a recorded dtype name is a typed PRNG key's."""
  return dtype.startswith("key<")


def _record(fn: str, item: PyTree) -> tuple[dict[str, Any], list[Leaf]]:
  """``({"format", "version", "leaves": {path: {"names", "shape",
  "dtype"}}, "rollouts": {path: {"num_envs", "num_steps", "keys"}}},
  leaves)``: the record is JSON-ready, ``path`` a ``jax.tree_util.keystr``."""
  leaves, _ = _leaves(fn, item)
  meta = {
      "format": FORMAT,
      "version": VERSION,
      "leaves": {x.path: {"names": list(x.names), "shape": list(x.shape),
                          "dtype": x.dtype} for x in leaves},
      "rollouts": _rollouts(item),
  }
  return meta, leaves


def _check_keys(fn: str, tree: PyTree, path: tuple[Any, ...] = ()) -> None:
  """TypeError naming the first dict key of ``tree`` that is not a string
  (a checkpoint names leaves by their keys; JAX cannot even sort mixed
  ones)."""
  if isinstance(tree, dict):
    for key in tree:
      if not isinstance(key, str):
        where = jax.tree_util.keystr(path) or "the tree's root"
        raise TypeError(
            f"{fn}: the dict at {where} has the key {key!r} (of type "
            f"{type(key).__name__}); a checkpoint names each leaf by the "
            "dict keys on its path, which must be strings")
    for key, value in tree.items():
      _check_keys(fn, value, (*path, jax.tree_util.DictKey(key)))
    return
  if tree is None or is_flushable(tree):
    return
  children = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: x is not tree)[0]
  for below, child in children:
    if below:   # () is a leaf: tree itself
      _check_keys(fn, child, (*path, *below))


def _check_live(fn: str, leaves: list[Leaf], rollouts: dict[str, Any]
                ) -> None:
  """ValueError naming the first leaf whose buffers were deleted."""
  for leaf in leaves:
    if _checks.deleted(leaf.value):
      what = key_of(leaf.path, rollouts)
      what = f"{what} (leaf {leaf.path})" if what else f"leaf {leaf.path}"
      raise ValueError(
          f"{fn}: {what} is a deleted array: its buffers were deleted when "
          "a call donated them (jax.jit with donate_argnums, "
          "update_at_inplace, a RolloutWriter's flush, ExperienceBuffer "
          "writes); save the state that call returned (`writer.state`)")


def to_orbax(fn: str, item: PyTree
             ) -> tuple[dict[str, Any], dict[str, Any], list[Leaf]]:
  """The nested dict orbax writes (non-empty leaves), its custom metadata
  (the record) and the leaves; writers are flushed and saved as their
  state."""
  _check_keys(fn, item)
  meta, leaves = _record(fn, flushed(item))
  _check_live(fn, leaves, meta["rollouts"])
  for leaf in leaves:
    if is_key(leaf.dtype) and 0 in leaf.shape:
      raise ValueError(f"{fn}: leaf {leaf.path}: PRNG key arrays with no "
                       f"elements (shape {leaf.shape}) cannot be saved")
  tree = nest([(x.names, np.asarray(x.value) if isinstance(
      x.value, SCALARS) else x.value) for x in leaves if 0 not in x.shape])
  # orbax refuses an item with no arrays; this one is never read back.
  return tree or {"empty": np.zeros((), np.int8)}, meta, leaves


def _where(path: str) -> str:
  return f"the rollout at {path}" if path else "the rollout"


def key_of(path: str, rollouts: dict[str, Any]) -> str | None:
  """The description of a rollout's storage leaf (``field 'obs' of ...``)."""
  for root, info in rollouts.items():
    for key in info["keys"]:
      prefix = f"{root}.data[{key!r}]"
      if path == prefix:
        return f"field {key!r} of {_where(root)}"
      if path.startswith(prefix):   # a leaf of a pytree field
        return f"field {key!r} leaf {path[len(prefix):]} of {_where(root)}"
  return None


def listing(paths: Iterable[str], limit: int = 8) -> str:
  """The first ``limit`` of ``paths``, comma-separated, and how many."""
  shown = list(paths)
  text = ", ".join(shown[:limit])
  return text + (f", ... ({len(shown)} in all)" if len(shown) > limit else "")


def _same_members(want: Iterable[Any], got: Collection[Any],
                  missing: Callable[[Any], str],
                  extra: Callable[[Any], str]) -> None:
  """ValueError ``missing(x)`` for the first ``x`` of ``want`` not in
  ``got``, then ``extra(x)`` for the first of ``got`` not in ``want``."""
  wanted = list(want)
  members = set(wanted)
  for x in wanted:
    if x not in got:
      raise ValueError(missing(x))
  for x in got:
    if x not in members:
      raise ValueError(extra(x))


def _check_rollout(fn: str, src: str, dst: str, path: str,
                   got: dict[str, Any], want: dict[str, Any]) -> None:
  """E, T and the keys of the RolloutState at ``path``."""
  for name, letter in (("num_envs", "E"), ("num_steps", "T")):
    if got[name] != want[name]:
      raise ValueError(
          f"{fn}: {_where(path)}: {name} ({letter}) is {got[name]} in "
          f"{src}, {dst} expects {want[name]}")
  keys = f"({src} has fields {got['keys']}, {dst} {want['keys']})"
  _same_members(
      want["keys"], got["keys"],
      lambda key: (f"{fn}: {_where(path)}: field {key!r} is registered in "
                   f"{dst} but not in {src} {keys}"),
      lambda key: (f"{fn}: {_where(path)}: field {key!r} is in {src} but not "
                   f"registered in {dst} {keys}"))


def _check_rollouts(fn: str, src: str, dst: str, found: dict[str, Any],
                    expected: dict[str, Any]) -> None:
  """E, T and the keys of every RolloutState of the target."""
  for path, want in expected.items():
    got = found.get(path)
    if got is None:
      raise ValueError(f"{fn}: {dst} has a RolloutState at "
                       f"{path or 'its root'}; {src} has none there "
                       f"(its rollouts: {sorted(found) or 'none'})")
    _check_rollout(fn, src, dst, path, got, want)
  for path in found:
    if path not in expected:
      raise ValueError(f"{fn}: {src} has a RolloutState at "
                       f"{path or 'its root'}; {dst} has none there")


def check_record(fn: str, meta: Any, src: str) -> None:
  """ValueError unless ``meta`` is a record of a version this code reads."""
  if not (isinstance(meta, dict) and meta.get("format") == FORMAT):
    raise ValueError(
        f"{fn}: {src} was not written by jrollout (jr.save_rollout or "
        f"jr.RolloutSave): its orbax custom metadata is {meta!r}")
  if meta.get("version") not in (1, VERSION):
    raise ValueError(f"{fn}: {src} has format version {meta.get('version')}"
                     f", this jrollout reads versions 1 to {VERSION}")


def check_target(fn: str, meta: Any, target: PyTree, *,
                 src: str = "the checkpoint", dst: str = "the target"
                 ) -> tuple[list[Leaf], Any]:
  """Checks ``target`` against a record (``to_orbax``'s); returns its leaves.

  Args:
    fn: the caller, for messages.
    meta: the record of what is to be restored (a checkpoint's custom
      metadata).
    target: the pytree to restore into (arrays or ``jax.ShapeDtypeStruct``).
    src: what ``meta`` describes, for messages.
    dst: what ``target`` is, for messages.

  Returns:
    ``(leaves, treedef)`` of the target.

  Raises:
    ValueError: ``meta`` is no jrollout record, or the target differs from
      it: a RolloutState's E, T or keys, the set of leaves, or a leaf's
      shape or dtype. The message names the key or leaf, what the target
      expects and what ``src`` holds.
    TypeError: a target leaf of a type that cannot be restored.
  """
  check_record(fn, meta, src)
  leaves, treedef = _leaves(fn, target)
  rollouts = _rollouts(target)
  _check_rollouts(fn, src, dst, meta["rollouts"], rollouts)
  found = meta["leaves"]
  paths = [x.path for x in leaves]
  _same_members(
      paths, found,
      lambda path: (f"{fn}: leaf {path} of {dst} is not in {src} (its "
                    f"leaves: {listing(found)})"),
      lambda path: (f"{fn}: leaf {path} of {src} is not in {dst} (its "
                    f"leaves: {listing(sorted(paths))})"))
  for leaf in leaves:
    got = found[leaf.path]
    got_shape, got_dtype = tuple(got["shape"]), got["dtype"]
    if (got_shape, got_dtype) != (leaf.shape, leaf.dtype):
      what = key_of(leaf.path, rollouts) or f"leaf {leaf.path}"
      raise ValueError(
          f"{fn}: {what}: {src} holds shape {got_shape} {got_dtype}, {dst} "
          f"expects shape {leaf.shape} {leaf.dtype}")
  return leaves, treedef


def check_matches(fn: str, found: PyTree, target: PyTree, *, src: str,
                  dst: str) -> None:
  """Checks ``target`` against ``found`` as a restore checks a target
  against a checkpoint's record (``check_target``): the same RolloutStates
  (E, T, keys), leaves, shapes and dtypes; ValueError naming the key (or
  leaf), what ``dst`` expects and what ``src`` holds."""
  check_target(fn, _record(fn, found)[0], target, src=src, dst=dst)


def as_saved(fn: str, meta: Any) -> list[Leaf]:
  """Target leaves for a restore without a target: NumPy, as recorded."""
  check_record(fn, meta, "the checkpoint")
  leaves = []
  for path, leaf in meta["leaves"].items():
    if is_key(leaf["dtype"]):
      raise ValueError(f"{fn}: leaf {path} is a PRNG key array "
                       f"({leaf['dtype']}); restore it with a target")
    leaves.append(Leaf(path, tuple(leaf["names"]), tuple(leaf["shape"]),
                       leaf["dtype"], np.zeros((), np.dtype(leaf["dtype"]))))
  return leaves


def abstract(leaf: Leaf) -> jax.ShapeDtypeStruct:
  """What orbax restores a target leaf as: NumPy, or JAX with a sharding."""
  value = leaf.value
  dtype = value.dtype if hasattr(value, "dtype") else np.dtype(leaf.dtype)
  if isinstance(value, (np.ndarray, np.generic) + SCALARS):
    return jax.ShapeDtypeStruct(leaf.shape, dtype)   # restored as NumPy
  sharding = getattr(value, "sharding", None)
  if sharding is None:
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=sharding)


def _empty(leaf: Leaf) -> Any:
  """A leaf with no elements, as the target's kind of array."""
  spec = abstract(leaf)
  if spec.sharding is None:
    return np.zeros(leaf.shape, spec.dtype)
  if is_key(leaf.dtype):
    raise ValueError(f"leaf {leaf.path}: a PRNG key array with no elements "
                     "cannot be restored")
  return jnp.zeros(leaf.shape, spec.dtype, device=spec.sharding)


def _as_target_kind(leaf: Leaf, value: Any) -> Any:
  if isinstance(leaf.value, SCALARS):
    return type(leaf.value)(np.asarray(value).item())
  if isinstance(leaf.value, np.generic):
    return np.asarray(value)[()]
  return value


def rebuild(leaves: list[Leaf], treedef: Any, restored: dict[str, Any]
            ) -> PyTree:
  """The restored pytree: each leaf as the target's kind (a leaf with no
  elements: zeros), in the target's structure (nested dicts without
  ``treedef``). ``restored``: orbax's nested dict of the stored leaves."""
  values = [_as_target_kind(x, lookup(restored, x.names))
            if 0 not in x.shape else _empty(x) for x in leaves]
  if treedef is None:
    return nest([(x.names, v) for x, v in zip(leaves, values)])
  return jax.tree_util.tree_unflatten(treedef, values)
