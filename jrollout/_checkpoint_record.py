"""What a checkpoint records of a pytree, and a restore target's checks.

A record lists each leaf's path, orbax name, shape and dtype, and each
RolloutState's sizes and fields; ``check_target`` compares a target with it
before anything is read, and ``verify`` compares the bytes read with the
CRC-32 that ``checksums`` recorded of each saved shard.
"""

from __future__ import annotations

import json
from typing import Any
from typing import NamedTuple
import warnings
import zlib

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np

from jrollout._state import deleted
from jrollout._state import RolloutState
from jrollout._types import PyTree

FORMAT, VERSION = "jrollout", 3
SCALARS = (bool, int, float)


class Leaf(NamedTuple):
  """A leaf of a saved item or restore target, with its spec."""
  path: str                    # jax.tree_util.keystr
  names: tuple[str, ...]       # orbax's nested-dict names
  shape: tuple[int, ...]
  dtype: str
  value: Any


def is_writer(x: Any) -> bool:
  """A host-loop writer (``jr.RolloutWriter``): its type has ``flush`` and
  ``state`` (asked of the type: reading ``state`` flushes)."""
  return callable(getattr(type(x), "flush", None)) and hasattr(
      type(x), "state")


def _spec(fn: str, where: str, leaf: Any) -> tuple[tuple[int, ...], str]:
  """``(shape, dtype name)`` of a leaf; TypeError for what cannot be saved."""
  if isinstance(leaf, SCALARS):
    return (), str(np.asarray(leaf).dtype)
  dtype: Any = getattr(leaf, "dtype", None)
  if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray,
                       np.generic)) and (
      dtype == np.bool_ or jnp.issubdtype(dtype, np.number)
      or jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)):
    return tuple(int(d) for d in leaf.shape), str(dtype)
  what = f"an array of dtype {dtype}" if dtype else type(leaf).__name__
  remedy = ("; pass `writer.state` and wrap the restored state in a new "
            "writer" if is_writer(leaf) else "")
  raise TypeError(
      f"{fn}: leaf {where or 'the tree'} is {what}; a checkpoint holds JAX or "
      "NumPy arrays of numbers, bools or typed PRNG keys, bool/int/float, "
      f"RolloutStates and writers (jax.ShapeDtypeStruct as a target){remedy}")


def flatten(fn: str, tree: PyTree, is_leaf: Any = None
            ) -> tuple[list[Leaf], Any]:
  """The leaves of ``tree`` with their specs (none with ``is_leaf``), and
  its treedef; TypeError for a dict key that is no string, ValueError for
  two leaves of one orbax name."""
  try:
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf)
  except (TypeError, ValueError) as e:   # dict keys that cannot be sorted
    raise TypeError(f"{fn}: the tree cannot be flattened ({e}); a checkpoint"
                    " names leaves by their dict keys: use strings") from None
  leaves: list[Leaf] = []
  seen: dict[str, str] = {}
  for path, value in flat:
    where = jax.tree_util.keystr(path)
    keys = [x.key for x in path if isinstance(x, jax.tree_util.DictKey)]
    for key in keys:
      if not isinstance(key, str):
        raise TypeError(f"{fn}: leaf {where} has the dict key {key!r} (of type"
                        f" {type(key).__name__}); use strings as dict keys")
    names = tuple(jax.tree_util.keystr((x,), simple=True) for x in path)
    name = ".".join(names)   # as orbax names the leaf's array
    if name in seen:
      raise ValueError(f"{fn}: leaves {seen[name]} and {where} have the same "
                       f"name {name!r} in a checkpoint; rename one")
    seen[name] = where
    spec = ((), "") if is_leaf else _spec(fn, where, value)
    leaves.append(Leaf(where, names, *spec, value))
  return leaves, treedef


def _rollouts(tree: PyTree) -> dict[str, list[Any]]:
  """``{key path: [E, T, fields]}`` of each RolloutState in ``tree``."""
  nodes = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, RolloutState))[0]
  return {jax.tree_util.keystr(path): [x.num_envs, x.num_steps, list(x.names)]
          for path, x in nodes if isinstance(x, RolloutState)}


def record(fn: str, item: PyTree) -> tuple[dict[str, Any], list[Leaf]]:
  """The record of ``item`` (its writers flushed first) and its leaves;
  an error naming the first leaf that cannot be saved."""
  writers, treedef = flatten(fn, item, is_writer)
  for leaf in writers:
    if is_writer(leaf.value):
      leaf.value.flush()
  item = treedef.unflatten([x.value.state if is_writer(x.value) else x.value
                            for x in writers])
  leaves = flatten(fn, item)[0]
  for leaf in leaves:
    if deleted(leaf.value):
      raise ValueError(
          f"{fn}: leaf {leaf.path} is a deleted array (a call donated its "
          "buffers: jax.jit with donate_argnums, a RolloutWriter's flush); "
          "save the state that call returned")
    if leaf.dtype.startswith("key<") and 0 in leaf.shape:
      raise ValueError(f"{fn}: leaf {leaf.path}: PRNG key arrays with no "
                       f"elements (shape {leaf.shape}) cannot be saved")
  return {"format": FORMAT, "version": VERSION, "rollouts": _rollouts(item),
          "leaves": {x.path: {"names": list(x.names), "shape": list(x.shape),
                              "dtype": x.dtype} for x in leaves}}, leaves


def _rollout(info: list[Any] | None) -> str:
  if info is None:
    return "none"
  return f"num_envs (E) {info[0]}, num_steps (T) {info[1]}, fields {info[2]}"


def listing(paths: Any, limit: int = 8) -> str:
  shown = list(paths)
  more = f", ... ({len(shown)} in all)" if len(shown) > limit else ""
  return ", ".join(shown[:limit]) + more


def check_target(fn: str, meta: Any, target: PyTree, *,
                 src: str = "the checkpoint", dst: str = "the target"
                 ) -> tuple[list[Leaf], Any]:
  """Checks ``target`` against a record; returns its ``(leaves, treedef)``
  (the record's leaves and None if ``target`` is None).

  Raises:
    ValueError: ``meta`` is no jrollout record, or ``target`` differs from
      it: its leaves (a RolloutState's fields), their shapes or dtypes.
    TypeError: a target leaf that cannot be restored.
  """
  if not (isinstance(meta, dict) and meta.get("format") == FORMAT):
    raise ValueError(f"{fn}: {src} was not written by jrollout (save_rollout "
                     f"or RolloutSave): its orbax custom metadata is {meta!r}")
  if meta.get("version") != VERSION:
    raise ValueError(f"{fn}: {src} has format version {meta.get('version')}"
                     f"; this jrollout reads version {VERSION}")
  found = meta["leaves"]
  if target is None:   # the saved leaves, as NumPy
    for path, x in found.items():
      if x["dtype"].startswith("key<"):
        raise ValueError(f"{fn}: leaf {path} is a PRNG key array "
                         f"({x['dtype']}); restore it with a target")
    return [Leaf(path, tuple(x["names"]), tuple(x["shape"]), x["dtype"],
                 np.zeros((), x["dtype"])) for path, x in found.items()], None
  leaves, treedef = flatten(fn, target)
  want = _rollouts(target)
  for path in sorted(set(want) | set(meta["rollouts"])):
    held, expects = meta["rollouts"].get(path), want.get(path)
    if held != expects:
      raise ValueError(
          f"{fn}: the RolloutState at {path or 'the root'}: {src} holds "
          f"{_rollout(held)}, {dst} expects {_rollout(expects)}")
  paths = [x.path for x in leaves]
  for path in paths:
    if path not in found:
      raise ValueError(f"{fn}: leaf {path} of {dst} is not in {src} (its "
                       f"leaves: {listing(found)})")
  for path in found:
    if path not in paths:
      raise ValueError(f"{fn}: leaf {path} of {src} is not in {dst} (its "
                       f"leaves: {listing(sorted(paths))})")
  for leaf in leaves:
    got = (tuple(found[leaf.path]["shape"]), found[leaf.path]["dtype"])
    if got != (leaf.shape, leaf.dtype):
      raise ValueError(
          f"{fn}: leaf {leaf.path}: {src} holds shape {got[0]} "
          f"{got[1]}, {dst} expects shape {leaf.shape} {leaf.dtype}")
  return leaves, treedef


def _crcs(value: Any, saved: bool) -> dict[str, int]:
  """``{region: CRC-32}`` of this process's shards of a leaf (when
  ``saved``: replica 0's, and NumPy leaves on process 0 only)."""
  if isinstance(value, jax.Array) and jax.dtypes.issubdtype(
      value.dtype, jax.dtypes.prng_key):
    value = jax.random.key_data(value)
  if not isinstance(value, jax.Array):
    whole = str([[0, n] for n in np.shape(value)])
    shards = {whole: value} if not saved or jax.process_index() == 0 else {}
  else:
    shards = {str([list(s.indices(n)[:2]) for s, n in zip(
        (*x.index, *[slice(None)] * (value.ndim - len(x.index))),
        value.shape)]): x.data for x in value.addressable_shards
              if not saved or x.replica_id == 0}
  return {region: zlib.crc32(np.ascontiguousarray(host).reshape(-1).view(
      np.uint8).data) for region, host in jax.device_get(shards).items()}


def checksums(leaves: list[Leaf]) -> dict[str, dict[str, int]]:
  """``{leaf path: {region: CRC-32}}`` of every process's saved shards."""
  mine = {x.path: _crcs(x.value, saved=True) for x in leaves
          if 0 not in x.shape}
  if jax.process_count() == 1:
    return mine
  words = np.frombuffer(json.dumps(mine).encode(), np.uint8)
  size = int(multihost_utils.process_allgather(np.int32(words.size)).max())
  merged: dict[str, dict[str, int]] = {}
  for row in multihost_utils.process_allgather(
      np.pad(words, (0, size - words.size))):
    for path, regions in json.loads(bytes(row).rstrip(b"\0")).items():
      merged.setdefault(path, {}).update(regions)
  return merged


def verify(fn: str, where: str, leaves: list[Leaf], values: list[Any],
           recorded: dict[str, dict[str, int]]) -> dict[str, str]:
  """``{leaf path: problem}`` of each leaf whose shards held here differ
  from their ``recorded`` CRC-32; a warning for leaves restored with
  another sharding (no recorded shard held whole here)."""
  bad: dict[str, str] = {}
  unchecked = []
  for leaf, value in zip(leaves, values):
    saved = recorded.get(leaf.path, {})
    held = {region: crc for region, crc in _crcs(value, saved=False).items()
            if region in saved}
    if saved and not held and jax.process_count() == 1:
      unchecked.append(leaf.path)
    for region, got in held.items():
      if got != saved[region] and leaf.path not in bad:
        shard = f" in shard {region}" if len(saved) > 1 else ""
        bad[leaf.path] = (
            f"leaf {leaf.path}: checksum mismatch{shard}: its bytes have "
            f"CRC-32 {got:#010x}, the save recorded {saved[region]:#010x}")
  if unchecked:
    warnings.warn(f"{fn}: {where}: leaves {listing(unchecked, 4)} were "
                  "restored with another sharding than saved, so their "
                  "checksums were not verified", UserWarning, stacklevel=4)
  return bad


def abstract(leaf: Leaf) -> jax.ShapeDtypeStruct:
  """What orbax restores a target leaf as: NumPy, or JAX with a sharding."""
  dtype = getattr(leaf.value, "dtype", None) or np.dtype(leaf.dtype)
  sharding = None
  if not isinstance(leaf.value, (np.ndarray, np.generic) + SCALARS):
    sharding = getattr(leaf.value, "sharding", None) or (
        jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
  return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=sharding)


def as_target(leaf: Leaf, restored: dict[tuple[str, ...], Any]) -> Any:
  """A restored leaf (``restored``: flattened by names) as the target's
  kind (no elements: zeros)."""
  spec = abstract(leaf)
  if 0 in leaf.shape and spec.sharding is None:
    return np.zeros(leaf.shape, spec.dtype)
  if 0 in leaf.shape:
    return jnp.zeros(leaf.shape, spec.dtype, device=spec.sharding)
  if isinstance(leaf.value, SCALARS):
    return type(leaf.value)(np.asarray(restored[leaf.names]).item())
  if isinstance(leaf.value, np.generic):
    return np.asarray(restored[leaf.names])[()]
  return restored[leaf.names]
