"""Checkpoints of rollout states and whole training runs, through orbax.

``save_rollout`` / ``restore_rollout`` write and read one pytree in one
directory. ``RolloutSave`` / ``RolloutRestore`` are the same operations as
orbax ``CheckpointArgs``, for an ``ocp.CheckpointManager`` (numbered steps,
asynchronous saves, ``latest_step()``), alone or inside
``ocp.args.Composite``. Orbax writes every checkpoint into a temporary
directory and renames it when complete, so a save killed half-way is never
read as a checkpoint.

A pytree may hold ``RolloutState``s, ``RolloutWriter``s (saved as their
state after flushing what is queued), arrays (JAX, sharded ones included,
and NumPy), typed PRNG keys and Python scalars: a PPO runner with its
parameters, optimiser state, env state and key saves as one item.

Beyond orbax's own files a checkpoint records, in orbax's custom metadata
of the item, the path, shape and dtype of every leaf and the sizes and keys
of every ``RolloutState``. Restoring checks the target against that record
before reading any array: a mismatch raises a ``ValueError`` that names the
key (or leaf), what the target expects and what the checkpoint holds, and
nothing is restored. Arrays with no elements (a rollout with no keys has
``counts`` ``[0, T]``) are recorded there but not written (orbax refuses
them) and restored as zeros of their recorded shape.

Every checkpoint also records the CRC-32 of each shard of each leaf and the
size of each file (see "checksums" below), and a restore verifies them
before it returns anything: a checkpoint damaged after it was written
raises ``CorruptCheckpointError`` naming the leaf, the directory and what
is wrong, instead of coming back with wrong values.

Dimension letters: T = num_steps, E = num_envs, K = number of keys.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import concurrent.futures
import contextlib
import dataclasses
import gc
import json
import os
import re
import sys
from typing import Any
import warnings
import zlib

from etils import epath  # type: ignore[import-untyped]

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from jrollout._state import RolloutState
from jrollout._types import PyTree
from jrollout._writer import RolloutWriter

_FORMAT = "jrollout"
_VERSION = 2      # 2: with checksums; 1 (before them) is still read
_SCALARS = (bool, int, float)


def _flushed(tree: PyTree) -> PyTree:
  """``tree`` with each ``RolloutWriter`` replaced by its (flushed) state."""
  return jax.tree_util.tree_map(
      lambda x: x.state if isinstance(x, RolloutWriter) else x, tree,
      is_leaf=lambda x: isinstance(x, RolloutWriter))


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


def _leaf_spec(fn: str, where: str, leaf: Any) -> tuple[tuple[int, ...], str]:
  """``(shape, dtype name)`` of a leaf; TypeError for what cannot be saved."""
  if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray,
                       np.generic)):
    return tuple(int(d) for d in leaf.shape), str(leaf.dtype)
  if isinstance(leaf, _SCALARS):
    return (), str(np.asarray(leaf).dtype)
  if isinstance(leaf, RolloutWriter):
    raise TypeError(
        f"{fn}: leaf {where or 'the tree'} is a RolloutWriter, which cannot be "
        "a restore target; pass `writer.state` and wrap the restored state in "
        "a new writer: jr.RolloutWriter(jr.restore_rollout(directory, "
        "writer.state))")
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
                                       "keys": list(node.keys)}
          for path, node in nodes if isinstance(node, RolloutState)}


@dataclasses.dataclass(frozen=True)
class _Leaf:
  path: str                    # jax.tree_util.keystr
  names: tuple[str, ...]       # the orbax nested-dict names
  shape: tuple[int, ...]
  dtype: str
  value: Any


def _leaves(fn: str, tree: PyTree) -> tuple[list[_Leaf], Any]:
  """The leaves of ``tree`` with their specs, and its treedef."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  leaves: list[_Leaf] = []
  seen: dict[tuple[str, ...], str] = {}
  for path, leaf in flat:
    where = jax.tree_util.keystr(path)
    names = _names(path)
    if names in seen:
      raise ValueError(f"{fn}: leaves {seen[names]} and {where} have the same "
                       f"name {'.'.join(names)!r} in a checkpoint; rename one")
    seen[names] = where
    leaves.append(_Leaf(where, names, *_leaf_spec(fn, where, leaf), leaf))
  return leaves, treedef


def _nest(pairs: list[tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
  """``{("a", "b"): x}`` pairs as the nested dict ``{"a": {"b": x}}``."""
  out: dict[str, Any] = {}
  for names, value in pairs:
    node = out
    for name in names[:-1]:
      node = node.setdefault(name, {})
    node[names[-1]] = value
  return out


def _lookup(tree: dict[str, Any], names: tuple[str, ...]) -> Any:
  for name in names:
    tree = tree[name]
  return tree


def _is_key(dtype: str) -> bool:
  return dtype.startswith("key<")


def record(fn: str, item: PyTree) -> dict[str, Any]:
  """What a checkpoint records of ``item`` (and ``check_target`` checks).

  Returns:
    ``{"format", "version", "leaves": {path: {"shape", "dtype"}},
    "rollouts": {path: {"num_envs", "num_steps", "keys"}}}``, JSON-ready,
    with ``path`` a ``jax.tree_util.keystr``. Writers count as their state.
  """
  return _record(fn, _flushed(item))[0]


def _record(fn: str, item: PyTree) -> tuple[dict[str, Any], list[_Leaf]]:
  leaves, _ = _leaves(fn, item)
  meta = {
      "format": _FORMAT,
      "version": _VERSION,
      "leaves": {x.path: {"names": list(x.names), "shape": list(x.shape),
                          "dtype": x.dtype} for x in leaves},
      "rollouts": _rollouts(item),
  }
  return meta, leaves


def _to_orbax(fn: str, item: PyTree
              ) -> tuple[dict[str, Any], dict[str, Any], list[_Leaf]]:
  """The nested dict orbax writes (non-empty leaves), its custom metadata
  and the leaves."""
  meta, leaves = _record(fn, _flushed(item))
  for leaf in leaves:
    if _is_key(leaf.dtype) and 0 in leaf.shape:
      raise ValueError(f"{fn}: leaf {leaf.path}: PRNG key arrays with no "
                       f"elements (shape {leaf.shape}) cannot be saved")
  tree = _nest([(x.names, np.asarray(x.value) if isinstance(
      x.value, _SCALARS) else x.value) for x in leaves if 0 not in x.shape])
  # orbax refuses an item with no arrays; this one is never read back.
  return tree or {"empty": np.zeros((), np.int8)}, meta, leaves


def _where(path: str) -> str:
  return f"the rollout at {path}" if path else "the rollout"


def _key_of(path: str, rollouts: dict[str, Any]) -> str | None:
  """The description of a rollout's storage leaf (``key 'obs' of ...``)."""
  for root, info in rollouts.items():
    for key in info["keys"]:
      if path == f"{root}.data[{key!r}]":
        return f"key {key!r} of {_where(root)}"
  return None


def _check_rollouts(fn: str, src: str, dst: str, found: dict[str, Any],
                    expected: dict[str, Any]) -> None:
  """E, T and the keys of every RolloutState of the target."""
  for path, want in expected.items():
    got = found.get(path)
    if got is None:
      raise ValueError(f"{fn}: {dst} has a RolloutState at "
                       f"{path or 'its root'}; {src} has none there "
                       f"(its rollouts: {sorted(found) or 'none'})")
    for name, letter in (("num_envs", "E"), ("num_steps", "T")):
      if got[name] != want[name]:
        raise ValueError(
            f"{fn}: {_where(path)}: {name} ({letter}) is {got[name]} in "
            f"{src}, {dst} expects {want[name]}")
    keys = f"({src} has keys {got['keys']}, {dst} {want['keys']})"
    for key in want["keys"]:
      if key not in got["keys"]:
        raise ValueError(f"{fn}: {_where(path)}: key {key!r} is registered "
                         f"in {dst} but not in {src} {keys}")
    for key in got["keys"]:
      if key not in want["keys"]:
        raise ValueError(f"{fn}: {_where(path)}: key {key!r} is in {src} "
                         f"but not registered in {dst} {keys}")
  for path in found:
    if path not in expected:
      raise ValueError(f"{fn}: {src} has a RolloutState at "
                       f"{path or 'its root'}; {dst} has none there")


def _check_record(fn: str, meta: Any, src: str) -> None:
  if not (isinstance(meta, dict) and meta.get("format") == _FORMAT):
    raise ValueError(
        f"{fn}: {src} was not written by jrollout (jr.save_rollout or "
        f"jr.RolloutSave): its orbax custom metadata is {meta!r}")
  if meta.get("version") not in (1, _VERSION):
    raise ValueError(f"{fn}: {src} has format version {meta.get('version')}"
                     f", this jrollout reads versions 1 to {_VERSION}")


def check_target(fn: str, meta: Any, target: PyTree, *,
                 src: str = "the checkpoint", dst: str = "the target"
                 ) -> tuple[list[_Leaf], Any]:
  """Checks ``target`` against a record (``record``); returns its leaves.

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
  _check_record(fn, meta, src)
  leaves, treedef = _leaves(fn, target)
  rollouts = _rollouts(target)
  _check_rollouts(fn, src, dst, meta["rollouts"], rollouts)
  found = meta["leaves"]
  paths = {x.path for x in leaves}
  for leaf in leaves:
    if leaf.path not in found:
      raise ValueError(f"{fn}: leaf {leaf.path} of {dst} is not in "
                       f"{src} (its leaves: {_listing(found)})")
  for path in found:
    if path not in paths:
      raise ValueError(f"{fn}: leaf {path} of {src} is not in {dst} "
                       f"(its leaves: {_listing(sorted(paths))})")
  for leaf in leaves:
    got = found[leaf.path]
    got_shape, got_dtype = tuple(got["shape"]), got["dtype"]
    if (got_shape, got_dtype) != (leaf.shape, leaf.dtype):
      what = _key_of(leaf.path, rollouts) or f"leaf {leaf.path}"
      raise ValueError(
          f"{fn}: {what}: {src} holds shape {got_shape} {got_dtype}, {dst} "
          f"expects shape {leaf.shape} {leaf.dtype}")
  return leaves, treedef


def _as_saved(fn: str, meta: Any) -> list[_Leaf]:
  """Target leaves for a restore without a target: NumPy, as recorded."""
  _check_record(fn, meta, "the checkpoint")
  leaves = []
  for path, leaf in meta["leaves"].items():
    if _is_key(leaf["dtype"]):
      raise ValueError(f"{fn}: leaf {path} is a PRNG key array "
                       f"({leaf['dtype']}); restore it with a target")
    leaves.append(_Leaf(path, tuple(leaf["names"]), tuple(leaf["shape"]),
                        leaf["dtype"], np.zeros((), np.dtype(leaf["dtype"]))))
  return leaves


def _listing(paths: Any, limit: int = 8) -> str:
  paths = list(paths)
  shown = ", ".join(paths[:limit])
  return shown + (f", ... ({len(paths)} in all)" if len(paths) > limit else "")


def _abstract(leaf: _Leaf) -> jax.ShapeDtypeStruct:
  """What orbax restores a target leaf as: NumPy, or JAX with a sharding."""
  value = leaf.value
  dtype = value.dtype if hasattr(value, "dtype") else np.dtype(leaf.dtype)
  if isinstance(value, (np.ndarray, np.generic) + _SCALARS):
    return jax.ShapeDtypeStruct(leaf.shape, dtype)   # restored as NumPy
  sharding = getattr(value, "sharding", None)
  if sharding is None:
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=sharding)


def _empty(leaf: _Leaf) -> Any:
  """A leaf with no elements, as the target's kind of array."""
  spec = _abstract(leaf)
  if spec.sharding is None:
    return np.zeros(leaf.shape, spec.dtype)
  if _is_key(leaf.dtype):
    raise ValueError(f"leaf {leaf.path}: a PRNG key array with no elements "
                     "cannot be restored")
  return jnp.zeros(leaf.shape, spec.dtype, device=spec.sharding)


def _as_target_kind(leaf: _Leaf, value: Any) -> Any:
  if isinstance(leaf.value, _SCALARS):
    return type(leaf.value)(np.asarray(value).item())
  if isinstance(leaf.value, np.generic):
    return np.asarray(value)[()]
  return value


# ---------------------------------------------------------------- checksums
#
# A save records, in RECORD_DIR/ of the item's directory:
# - process_<i>.json, by each process once orbax has written its arrays:
#   the CRC-32 (zlib) of the bytes of each shard the process wrote (its
#   addressable shards of replica 0; NumPy leaves and Python scalars:
#   process 0, whole), keyed by the shard's region of the leaf (of the key
#   data for PRNG keys); the size of every file of its OCDBT store; size
#   and CRC-32 of the orbax metadata files it wrote (_METADATA, _sharding,
#   array_metadatas/process_<i>).
# - index.json, by process 0 when orbax has merged the stores (finalize,
#   before the checkpoint is renamed into place): size and CRC-32 of the
#   merged index (manifest.ocdbt, d/*).
# A restore checks, before it reads anything: the size and CRC-32 of the
# recorded metadata and index files (verify); that every data file the
# OCDBT index refers to is there and long enough for the bytes it places
# in it (always: this names the leaves whose bytes are lost, and keeps
# orbax from failing half-way through its reads); the recorded sizes of the
# data files (verify). Then it reads, and checks the CRC-32 of each
# recorded shard it holds whole (verify) before it returns anything.

_RECORD_DIR = "jrollout_checksums"
_INDEX = "index.json"
_ALGORITHM = "crc32"
_Region = tuple[tuple[int, int], ...]


class CorruptCheckpointError(ValueError):
  """A checkpoint damaged after it was written; nothing was restored.

  Raised by ``jr.restore_rollout`` (and ``jr.RolloutRestore`` in an
  ``ocp.CheckpointManager``) when a leaf's bytes differ from the checksum
  recorded when it was saved, a file of the checkpoint is missing or has
  another size than it was written with, a metadata file differs from what
  was written, or a leaf cannot be read. The message names the directory
  and, one line each, the damaged leaves (the key of a RolloutState and its
  pytree path) or files, and what is wrong with them.

  Attributes:
    directory: the checkpoint's directory (in a CheckpointManager: the
      item's directory inside the step's).
    leaves: the pytree paths (``jax.tree_util.keystr``) of the damaged
      leaves; empty when the damage is to metadata, which every leaf needs.
    problems: one line per problem found.
  """

  def __init__(self, fn: str, directory: str, leaves: Sequence[str],
               problems: Sequence[str]):
    self.fn, self.directory = fn, directory
    self.leaves, self.problems = tuple(leaves), tuple(problems)
    shown = list(self.problems[:4])
    if len(self.problems) > 4:
      shown.append(f"... and {len(self.problems) - 4} more")
    super().__init__(
        f"{fn}: damaged checkpoint {directory}; nothing was restored\n  "
        + "\n  ".join(shown))

  def __reduce__(self):
    return type(self), (self.fn, self.directory, self.leaves, self.problems)


class _Damage:
  """The problems found in one checkpoint."""

  def __init__(self, fn: str, directory: Any, rollouts: dict[str, Any]):
    self.fn, self.directory, self.rollouts = fn, str(directory), rollouts
    self.leaves: list[str] = []
    self.problems: list[str] = []

  def name(self, leaf: str) -> str:
    key = _key_of(leaf, self.rollouts)
    return f"{key} (leaf {leaf})" if key else f"leaf {leaf}"

  def add(self, problem: str, leaves: Sequence[str] = ()) -> None:
    if leaves:
      problem = ", ".join(self.name(x) for x in leaves) + ": " + problem
    self.leaves.extend(x for x in leaves if x not in self.leaves)
    self.problems.append(problem)

  def error(self) -> CorruptCheckpointError:
    return CorruptCheckpointError(self.fn, self.directory, self.leaves,
                                  self.problems)


_BLOCK = 1 << 22                          # bytes per CRC-32 task, at least
_WORKERS = min(8, os.cpu_count() or 1)    # CRC-32 threads (zlib frees the GIL)
_POLY = 0xEDB88320                        # CRC-32's polynomial, reflected


def _multmodp(a: int, b: int) -> int:
  """``a * b`` modulo CRC-32's polynomial (zlib's multmodp)."""
  m, p = 1 << 31, 0
  while True:
    if a & m:
      p ^= b
      if a & (m - 1) == 0:
        return p
    m >>= 1
    b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]           # x^(2^k) modulo the polynomial, k = 0..31
for _ in range(31):
  _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def _crc_combine(crc1: int, crc2: int, len2: int) -> int:
  """The CRC-32 of ``A + B`` from those of ``A`` and ``B`` (``len2``
  bytes): zlib's crc32_combine."""
  p, k = 1 << 31, 3        # x^0; x^(8 * len2) by squares of x^(2^3)
  while len2:
    if len2 & 1:
      p = _multmodp(_X2N[k & 31], p)
    len2 >>= 1
    k += 1
  return _multmodp(p, crc1) ^ crc2


def _crcs(arrays: Sequence[Any]) -> list[int]:
  """The CRC-32 of each array's bytes in C order. Large arrays are cut in
  blocks checksummed by ``_WORKERS`` threads, and the blocks' CRC-32s
  combined."""
  views = [np.ascontiguousarray(a).reshape(-1).view(np.uint8)
           for a in arrays]
  total = sum(v.size for v in views)
  if _WORKERS < 2 or total < 2 * _BLOCK:
    return [zlib.crc32(v.data) for v in views]
  block = max(_BLOCK, -(-total // (2 * _WORKERS)))
  with concurrent.futures.ThreadPoolExecutor(_WORKERS) as pool:
    parts = [[(pool.submit(zlib.crc32, v[i:i + block].data),
               min(block, v.size - i)) for i in range(0, v.size, block)]
             for v in views]
    crcs = []
    for blocks in parts:
      crc = 0
      for future, size in blocks:
        crc = _crc_combine(crc, future.result(), size)
      crcs.append(crc)
  return crcs


def _in_background(fn: Any, *args: Any) -> Any:
  """Starts ``fn(*args)`` in a thread; returns a function that waits for
  it and returns its result (or raises its exception)."""
  pool = concurrent.futures.ThreadPoolExecutor(1)
  future = pool.submit(fn, *args)
  pool.shutdown(wait=False)
  return future.result


def _region(index: tuple[slice, ...], shape: tuple[int, ...]) -> _Region:
  """A shard's index as ``((start, stop), ...)`` for every axis."""
  index = tuple(index) + (slice(None),) * (len(shape) - len(index))
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _show(region: _Region) -> str:
  return "[" + ", ".join(f"{a}:{b}" for a, b in region) + "]"


def _raw(value: Any) -> Any:
  """A leaf's bytes as an array: the key data of PRNG keys."""
  if isinstance(value, jax.Array) and jax.dtypes.issubdtype(
      value.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(value)
  return value


def _saved_shards(value: Any) -> list[tuple[_Region, Any]]:
  """The ``(region, host array)`` pieces of a leaf that this process saves."""
  value = _raw(value)
  if isinstance(value, jax.Array):
    shards = [s for s in value.addressable_shards if s.replica_id == 0]
    hosts = jax.device_get([s.data for s in shards])
    return [(_region(s.index, value.shape), h) for s, h in zip(shards, hosts)]
  if jax.process_index() != 0:   # orbax saves NumPy leaves from process 0
    return []
  value = np.asarray(value)
  return [(_region((), value.shape), value)]


def _checksums(leaves: list[_Leaf]) -> dict[str, list[list[Any]]]:
  """``{path: [[region, crc], ...]}`` of the stored leaves' saved shards."""
  shards = [(leaf.path, region, host) for leaf in leaves
            if 0 not in leaf.shape
            for region, host in _saved_shards(leaf.value)]
  out: dict[str, list[list[Any]]] = {}
  for (path, region, _), crc in zip(shards, _crcs([x[2] for x in shards])):
    out.setdefault(path, []).append([[list(r) for r in region], crc])
  return out


def _files(directory: Any, names: list[str], everything: str | None = None
           ) -> tuple[dict[str, int], dict[str, int]]:
  """``({file: size}, {file: crc})``: sizes of the files below
  ``everything``, sizes and CRC-32 of the files ``names`` (those present)."""
  sizes, crcs = {}, {}
  if everything is not None and (directory / everything).exists():
    for root, _, found in (directory / everything).walk():
      for name in found:
        path = epath.Path(root) / name
        sizes[str(path.relative_to(directory))] = path.stat().length
  for name in names:
    if (directory / name).exists():
      content = (directory / name).read_bytes()
      sizes[name], crcs[name] = len(content), zlib.crc32(content)
  return sizes, crcs


def _write_json(directory: Any, name: str, record: dict[str, Any]) -> None:
  (directory / _RECORD_DIR).mkdir(parents=True, exist_ok=True)
  (directory / _RECORD_DIR / name).write_text(json.dumps(record))


def _write_record(directory: Any, checksums: dict[str, Any]) -> None:
  """Writes this process's record (see above) into ``directory``."""
  directory = epath.Path(directory)
  process = jax.process_index()
  metadata = [f"array_metadatas/process_{process}"]
  if process == 0:
    metadata += ["_METADATA", "_sharding"]
  sizes, crcs = _files(directory, metadata, f"ocdbt.process_{process}")
  _write_json(directory, f"process_{process}.json", {
      "algorithm": _ALGORITHM, "process": process, "leaves": checksums,
      "files": sizes, "crcs": crcs})


def _write_index(directory: Any) -> None:
  """Writes the record of the merged index (see above)."""
  directory = epath.Path(directory)
  names = ["manifest.ocdbt"]
  if (directory / "d").exists():
    names += [f"d/{path.name}" for path in sorted((directory / "d").iterdir())]
  sizes, crcs = _files(directory, names)
  _write_json(directory, _INDEX, {"algorithm": _ALGORITHM, "leaves": {},
                                  "files": sizes, "crcs": crcs})


def _metadata(fn: str, directory: Any) -> Any:
  """The custom metadata of a checkpoint, read from its _METADATA file
  (not through orbax, which would open the arrays' index too);
  CorruptCheckpointError if that file is missing or unreadable."""
  damage = _Damage(fn, directory, {})
  path = epath.Path(directory) / "_METADATA"
  if not path.exists():
    damage.add("its metadata file _METADATA is missing")
    raise damage.error()
  try:
    meta = json.loads(path.read_text())
    if not isinstance(meta, dict):
      raise TypeError(f"it holds a {type(meta).__name__}, not an object")
    return meta.get("custom_metadata")
  except (ValueError, TypeError, OSError) as e:
    damage.add(f"its metadata file _METADATA cannot be read "
               f"({type(e).__name__}: {_first_line(e)})")
    raise damage.error() from None


def _first_line(error: BaseException, limit: int = 200) -> str:
  text = str(error).split("\n", 1)[0].split(" See full TensorStore", 1)[0]
  text = text.split(" [tensorstore_spec=", 1)[0]
  return text if len(text) <= limit else text[:limit] + "..."


def _records(fn: str, directory: Any, meta: dict[str, Any]
             ) -> list[dict[str, Any]] | None:
  """The records of every process that saved, and of the index; None (and
  a warning) for a checkpoint written before jrollout recorded them."""
  info = meta.get("checksums")
  damage = _Damage(fn, directory, meta["rollouts"])
  if meta["version"] >= 2 and not isinstance(info, dict):
    damage.add("its metadata file _METADATA has no checksums entry")
    raise damage.error()
  if info is None:
    warnings.warn(
        f"{fn}: checkpoint {directory} was written by an older jrollout, "
        "without checksums: it is restored unverified (save it again to "
        "record them)", UserWarning, stacklevel=4)
    return None
  directory = epath.Path(directory)
  records = []
  names = [f"process_{i}.json" for i in range(info["processes"])]
  for name in [*names, _INDEX]:
    where = f"{_RECORD_DIR}/{name}"
    try:
      record = json.loads((directory / where).read_text())
      if record["algorithm"] != _ALGORITHM:
        raise ValueError(f"unknown algorithm {record['algorithm']!r}")
      for field in ("leaves", "files", "crcs"):
        if not isinstance(record[field], dict):
          raise TypeError(f"{field} is a {type(record[field]).__name__}")
      records.append(record)
    except FileNotFoundError:
      damage.add(f"its checksum record {where} is missing")
    except (ValueError, KeyError, TypeError, OSError) as e:
      damage.add(f"its checksum record {where} cannot be read "
                 f"({type(e).__name__}: {_first_line(e)})")
  if damage.problems:
    raise damage.error()
  return records


def _check_files(fn: str, directory: Any, meta: dict[str, Any],
                 records: list[dict[str, Any]] | None) -> None:
  """Checks, before anything is read, the files a restore will read.

  With ``records`` (verify): the size and CRC-32 of the metadata and index
  files. Always: that every file the OCDBT index refers to is there and
  long enough for the bytes it places in it (the leaves whose bytes are
  lost are named). With ``records``: that every data file has the size it
  was written with. Raises CorruptCheckpointError listing the problems.
  """
  directory = epath.Path(directory)
  damage = _Damage(fn, directory, meta["rollouts"])
  written = {name: size for record in records or []
             for name, size in record["files"].items()}
  for record in records or []:
    for name, crc in record["crcs"].items():
      kind = ("index" if name == "manifest.ocdbt" or name.startswith("d/")
              else "metadata")
      why = _changed(directory / name, written[name], crc)
      if why:
        damage.add(f"{kind} file {name} {why}")
  if damage.problems:
    raise damage.error()
  refs = _index_refs(directory, damage)
  if damage.problems:
    raise damage.error()
  by_key = {".".join(leaf["names"]): path
            for path, leaf in meta["leaves"].items()}
  sizes: dict[str, int | None] = {}
  lost: dict[str, tuple[int, set[str]]] = {}   # file: (bytes needed, leaves)
  for key, file, end in refs:
    if file not in sizes:
      sizes[file] = ((directory / file).stat().length
                     if (directory / file).exists() else None)
    size = sizes[file]
    if size is None or size < end:
      need, leaves = lost.get(file, (0, set()))
      leaves.add(by_key.get(key.rsplit("/", 1)[0], f"(key {key})"))
      lost[file] = (max(need, end), leaves)
  for file, (need, leaves) in lost.items():
    size, saved = sizes[file], written.get(file)
    if size is None:
      why = "is missing" + (f" (the save wrote {saved} bytes)" if saved
                            else "")
    else:
      why = (f"is {size} bytes, shorter than the "
             + (f"{saved} bytes the save wrote" if saved else
                f"{need} bytes its index refers to"))
    damage.add(f"file {file} {why}", sorted(leaves))
  for name, size in written.items():   # damage where no leaf's bytes are
    if name not in lost and not any(name in r["crcs"] for r in records or []):
      why = _changed(directory / name, size, None)
      if why:
        damage.add(f"file {name} {why}")
  if damage.problems:
    raise damage.error()


def _changed(path: Any, size: int, crc: int | None) -> str | None:
  """What differs in a file from what the save wrote, or None."""
  if not path.exists():
    return f"is missing (the save wrote {size} bytes)"
  got = path.stat().length
  if got != size:
    return (f"is {got} bytes, {'shorter' if got < size else 'longer'} than "
            f"the {size} bytes the save wrote")
  if crc is not None:
    now = zlib.crc32(path.read_bytes())
    if now != crc:
      return (f"differs from what the save wrote (CRC-32 {now:#010x}, "
              f"recorded {crc:#010x})")
  return None


_VALUE = re.compile(r"value:([^:]*):([^:]*):(\d+):(\d+)")


def _index_refs(directory: Any, damage: _Damage
                ) -> list[tuple[str, str, int]]:
  """``[(key, file, end of its bytes)]`` of every value the checkpoint's
  OCDBT index places in a data file. A problem is added to ``damage`` if
  TensorStore cannot read the index; ``[]`` if there is no OCDBT index or
  its dump has a form this code does not know."""
  if not (directory / "manifest.ocdbt").exists():
    if (directory / "d").exists():
      damage.add("index file manifest.ocdbt is missing")
    return []
  url = str(directory).rstrip("/") + "/"
  if "://" not in url:
    url = "file://" + url
  refs = []
  try:
    base = ts.KvStore.open(url).result()
    manifest = ts.ocdbt.dump(base).result()
    nodes = [manifest["versions"][-1]["root"]["location"]]
    while nodes:
      node = ts.ocdbt.dump(base, nodes.pop()).result()
      for entry in node["entries"]:
        for field in entry.values():
          if isinstance(field, str) and field.startswith("btreenode::"):
            nodes.append(field)
        found = _VALUE.fullmatch(str(entry.get("indirect_value", "")))
        if found is not None:
          key = entry["key"]
          refs.append((key.decode() if isinstance(key, bytes) else str(key),
                       found.group(1) + found.group(2),
                       int(found.group(3)) + int(found.group(4))))
  except ValueError as e:   # TensorStore's errors: "DATA_LOSS: ..."
    if re.match(r"[A-Z_]+: ", str(e)):
      damage.add(f"its index (manifest.ocdbt, d/) cannot be read "
                 f"({_first_line(e)})")
    return []
  except (KeyError, IndexError, TypeError, AttributeError):
    return []   # a dump of another form: leave the checks to the read
  return refs


_TS_ERROR = re.compile(r'([A-Z_]+): Error reading "([^"]*)" in OCDBT '
                       r"database at [^:]*: (.*)")


def _read_failure(error: BaseException, stored: list[_Leaf]
                  ) -> tuple[str | None, str] | None:
  """``(leaf path or None, what went wrong)`` of a failed read of the
  arrays, or None if ``error`` is not TensorStore failing to read."""
  by_key = {".".join(x.names): x.path for x in stored}
  seen: set[int] = set()
  chain: BaseException | None = error
  while chain is not None and id(chain) not in seen:
    seen.add(id(chain))
    match = _TS_ERROR.match(str(chain))
    if match:
      code, key, why = match.groups()
      leaf = by_key.get(key.rsplit("/", 1)[0])
      return leaf, f"cannot be read ({code}: {why.split(chr(10))[0]})"
    chain = chain.__cause__ or chain.__context__
  text = str(error)
  if "Encountered error while reading array" in text or re.match(
      r"[A-Z_]+: ", text):
    key = re.search(r"'path': '([^']*)/'", text)
    leaf = by_key.get(key.group(1)) if key else None
    return leaf, f"cannot be read ({_first_line(error)})"
  return None


@contextlib.contextmanager
def _quiet_abandoned_reads() -> Iterator[None]:
  """Silences orbax's reads abandoned after one failed.

  When one array cannot be read, orbax's event loop is closed with the
  other reads pending; each then raises, when it is garbage collected, an
  ``Exception`` holding TensorStore's driver spec, which Python prints as
  "Exception ignored in: <coroutine ...>". Those (and only those) are
  dropped here, and collected before this returns.
  """
  previous = sys.unraisablehook

  def hook(unraisable: Any) -> None:
    if not str(unraisable.exc_value).startswith(
        "Encountered error while reading array index"):
      previous(unraisable)

  sys.unraisablehook = hook
  try:
    yield
  except BaseException:
    gc.collect()
    raise
  finally:
    sys.unraisablehook = previous


def _pieces(value: Any) -> dict[_Region, Any]:
  """This process's restored pieces of a leaf, by region."""
  value = _raw(value)
  if isinstance(value, jax.Array):
    shards: dict[_Region, Any] = {}
    for shard in value.addressable_shards:
      shards.setdefault(_region(shard.index, value.shape), shard.data)
    hosts = jax.device_get(list(shards.values()))
    return dict(zip(shards, hosts))
  value = np.asarray(value)
  return {_region((), value.shape): value}


def _assemble(region: _Region, pieces: dict[_Region, Any]
              ) -> tuple[np.ndarray | None, bool]:
  """``region`` copied out of ``pieces``: ``(array, True)``; ``(None,
  partly)`` when the pieces do not cover it (``partly``: some of it)."""
  if region in pieces:
    return pieces[region], True
  out, covered = None, 0
  for where, piece in pieces.items():
    lo = [max(a, c) for (a, _), (c, _) in zip(region, where)]
    hi = [min(b, d) for (_, b), (_, d) in zip(region, where)]
    if any(a >= b for a, b in zip(lo, hi)):
      continue
    if out is None:
      out = np.empty([b - a for a, b in region], piece.dtype)
    src = tuple(slice(a - c, b - c) for a, b, (c, _) in zip(lo, hi, where))
    dst = tuple(slice(a - c, b - c) for a, b, (c, _) in zip(lo, hi, region))
    out[dst] = piece[src]
    covered += int(np.prod([b - a for a, b in zip(lo, hi)]))
  if out is not None and covered == out.size:
    return out, True
  return None, out is not None


def _verify(leaves: list[_Leaf], values: list[Any],
            records: list[dict[str, Any]], damage: _Damage) -> list[str]:
  """Checks every recorded shard this process holds whole; adds the
  mismatches to ``damage``. Returns the leaves with shards split between
  processes (not verified here)."""
  split: list[str] = []
  checks = []    # (leaf, region, its bytes here, recorded crc, whole leaf)
  for leaf, value in zip(leaves, values):
    chunks = [chunk for record in records
              for chunk in record["leaves"].get(leaf.path, [])]
    if not chunks:
      continue
    pieces = _pieces(value)
    for region_list, crc in chunks:
      region = tuple((int(a), int(b)) for a, b in region_list)
      array, partly = _assemble(region, pieces)
      if array is not None:
        checks.append((leaf, region, array, crc,
                       array.shape == np.shape(_raw(value))))
      elif partly and leaf.path not in split:
        split.append(leaf.path)
  for (leaf, region, _, crc, whole), got in zip(
      checks, _crcs([x[2] for x in checks])):
    if got != crc and leaf.path not in damage.leaves:
      where = "" if whole else f" in shard {_show(region)}"
      damage.add(f"checksum mismatch{where}: its bytes have CRC-32 "
                 f"{got:#010x}, the save recorded {crc:#010x}", [leaf.path])
  return split


class RolloutCheckpointHandler(ocp.PyTreeCheckpointHandler):
  """orbax's ``PyTreeCheckpointHandler`` with jrollout's record and checks.

  Used through ``RolloutSave`` / ``RolloutRestore`` (registered with orbax,
  so an ``ocp.CheckpointManager`` picks this handler itself) or through
  ``save_rollout`` / ``restore_rollout``. Arrays are written uncompressed
  by default (``use_compression=False``): rollout data are mostly floats,
  which zstd barely shrinks, and compressing them costs more time than
  the smaller write saves (benchmarks/scripts/checkpoint_bench.py). Other
  keyword arguments go to ``ocp.PyTreeCheckpointHandler``.

  Beyond orbax's files, a save writes the checksum records of
  ``jrollout_checksums/`` (each process its own, once its arrays are
  written; process 0 the merged index's in ``finalize``), and a restore
  verifies them (``RolloutRestore.verify``).
  """

  def __init__(self, **kwargs: Any):
    kwargs.setdefault("use_compression", False)
    super().__init__(**kwargs)

  @staticmethod
  def _save_args(args: Any) -> tuple[ocp.args.PyTreeSave, list[_Leaf]]:
    """orbax's arguments, and the leaves to checksum."""
    if not isinstance(args, RolloutSave):
      raise TypeError(f"RolloutCheckpointHandler saves jr.RolloutSave args, "
                      f"got {type(args).__name__}")
    tree, meta, leaves = _to_orbax(args.fn, args.item)
    meta["checksums"] = {"algorithm": _ALGORITHM,
                         "processes": jax.process_count()}
    return ocp.args.PyTreeSave(tree, custom_metadata=meta), leaves

  async def async_save(self, directory, item=None, save_args=None,
                       args=None):
    del item, save_args
    pytree_args, leaves = self._save_args(args)
    checksums = _in_background(_checksums, leaves)   # while orbax copies
    try:
      futures = await super().async_save(directory, args=pytree_args)
    finally:
      record = checksums()   # before returning: the caller may then donate
    # The record is written once orbax's writes are done, before orbax
    # renames the checkpoint into place.
    return [ocp.future.ChainedFuture(
        list(futures or []), lambda: _write_record(directory, record))]

  def save(self, directory, item=None, save_args=None, args=None):
    del item, save_args
    pytree_args, leaves = self._save_args(args)
    checksums = _in_background(_checksums, leaves)   # while orbax writes
    try:
      super().save(directory, args=pytree_args)
    finally:
      record = checksums()
    _write_record(directory, record)

  def finalize(self, directory):
    super().finalize(directory)   # merges the processes' OCDBT stores
    _write_index(directory)

  def restore(self, directory, item=None, args=None):
    del item
    if not isinstance(args, RolloutRestore):
      raise TypeError(f"RolloutCheckpointHandler restores jr.RolloutRestore "
                      f"args, got {type(args).__name__}")
    fn = args.fn
    if not isinstance(args.verify, (bool, np.bool_)):
      raise TypeError(f"{fn}: verify must be True or False, got "
                      f"{args.verify!r} ({type(args.verify).__name__})")
    meta = _metadata(fn, directory)
    _check_record(fn, meta, "the checkpoint")
    records = _records(fn, directory, meta) if args.verify else None
    _check_files(fn, directory, meta, records)   # before the target too
    damage = _Damage(fn, directory, meta["rollouts"])
    if args.item is None:
      leaves, treedef = _as_saved(fn, meta), None
    else:
      leaves, treedef = check_target(fn, meta, args.item)
    stored = [x for x in leaves if 0 not in x.shape]
    restored: dict[str, Any] = {}
    if stored:
      abstract = _nest([(x.names, _abstract(x)) for x in stored])
      with _quiet_abandoned_reads():
        try:
          restored = super().restore(directory, args=ocp.args.PyTreeRestore(
              abstract, restore_args=ocp.checkpoint_utils
              .construct_restore_args(abstract)))
        except Exception as e:   # TensorStore's errors are plain Exceptions
          failure = _read_failure(e, stored)
          if failure is None:
            raise
          damage.add(failure[1], [failure[0]] if failure[0] else [])
        if not restored:     # raised outside the except: no driver dump
          raise damage.error()
    if records is not None:
      split = _verify(stored, [_lookup(restored, x.names) for x in stored],
                      records, damage)
      if split:
        warnings.warn(
            f"{fn}: {directory}: shards of leaves {_listing(split, 4)} are "
            "split between processes by the target's sharding, so no "
            "process could verify them; restore with the save's sharding to "
            "verify every shard", UserWarning, stacklevel=3)
    if damage.problems:
      raise damage.error()
    values = [_as_target_kind(x, _lookup(restored, x.names))
              if 0 not in x.shape else _empty(x) for x in leaves]
    if treedef is None:
      return _nest([(x.names, v) for x, v in zip(leaves, values)])
    return jax.tree_util.tree_unflatten(treedef, values)


@ocp.args.register_with_handler(RolloutCheckpointHandler, for_save=True)
@dataclasses.dataclass
class RolloutSave(ocp.args.CheckpointArgs):
  """orbax save arguments for a rollout, writer or any pytree holding them.

  For an ``ocp.CheckpointManager``; the item is saved as
  ``jr.save_rollout`` saves it (writers flushed first, checksums
  recorded: ``async_save`` returns once they are computed, so the arrays
  may then be donated). Example::

    mngr = ocp.CheckpointManager(directory)
    mngr.save(step, args=ocp.args.Composite(
        runner=jr.RolloutSave(runner), meta=ocp.args.JsonSave(meta)))

  Attributes:
    item: a ``RolloutState``, a ``RolloutWriter`` or a pytree of them, arrays
      (``jax.Array`` sharded or not, NumPy), typed PRNG keys and
      bool/int/float.
    fn: the name errors start with.
  """
  item: PyTree
  fn: str = dataclasses.field(default="RolloutSave", repr=False)


@ocp.args.register_with_handler(RolloutCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class RolloutRestore(ocp.args.CheckpointArgs):
  """orbax restore arguments: checked against ``item``, restored like it.

  The target ``item`` has the structure of the saved item, with arrays or
  ``jax.ShapeDtypeStruct`` leaves (``jax.eval_shape`` of the function that
  built the state). Each JAX leaf is restored with the target leaf's
  sharding (a ``ShapeDtypeStruct`` without one: the default device), a
  NumPy leaf as NumPy, a Python scalar as the same type. The target is
  checked first (see ``jr.restore_rollout``), and the restored bytes are
  verified against the checksums recorded at save time before anything is
  returned (``jr.CorruptCheckpointError`` if the checkpoint is damaged).
  Without a target, the saved leaves come back as NumPy arrays in nested
  dicts, as ``jr.restore_rollout`` describes.

  Attributes:
    item: the target pytree, or None.
    verify: check the checksums recorded at save time (see
      ``jr.restore_rollout``).
    fn: the name errors start with.
  """
  item: PyTree = None
  verify: bool = True
  fn: str = dataclasses.field(default="RolloutRestore", repr=False)


def _path(fn: str, directory: Any) -> str:
  """``directory`` as an absolute path; ValueError if it is ``""``."""
  try:
    path = os.fspath(directory)
  except TypeError:
    raise TypeError(f"{fn}: directory must be a str or os.PathLike, got "
                    f"{type(directory).__name__}") from None
  if isinstance(path, bytes):
    path = os.fsdecode(path)
  if not path:
    raise ValueError(f"{fn}: directory is '' (empty): give the checkpoint's "
                     "own directory, e.g. 'runs/ckpt'")
  return os.path.abspath(path)


# What orbax writes into a checkpoint directory, as (file names, {directory
# name: what it holds}), names as regular expressions.
_Layout = tuple[tuple[str, ...], dict[str, Any]]
_DATA: _Layout = (("[0-9a-f]+",), {})
_LAYOUT: _Layout = (
    ("_METADATA", "_CHECKPOINT_METADATA", "_sharding", "manifest.ocdbt",
     "commit_success.txt"),
    {"d": _DATA, "array_metadatas": ((r"process_\d+",), {}),
     r"ocdbt\.process_\d+": (("manifest.ocdbt",), {"d": _DATA}),
     _RECORD_DIR: ((r"process_\d+\.json", r"index\.json"), {})})


def _foreign(path: str, layout: _Layout = _LAYOUT, rel: str = ""
             ) -> list[str]:
  """The entries below the directory ``path`` that no checkpoint holds
  (relative paths; a foreign directory is not listed further)."""
  files, dirs = layout
  foreign = []
  for name in sorted(os.listdir(path)):
    full, where = os.path.join(path, name), os.path.join(rel, name)
    if os.path.islink(full):
      foreign.append(where)
    elif os.path.isdir(full):
      sub = next((v for k, v in dirs.items() if re.fullmatch(k, name)), None)
      if sub is None:
        foreign.append(where)
      else:
        foreign.extend(_foreign(full, sub, where))
    elif not any(re.fullmatch(k, name) for k in files):
      foreign.append(where)
  return foreign


def _replaceable(fn: str, path: str) -> None:
  """Refuses to let ``overwrite`` delete ``path`` unless it is a jrollout
  checkpoint (or an empty directory): ValueError saying why."""
  def refuse(why: str) -> ValueError:
    return ValueError(
        f"{fn}: directory {path} {why}; overwrite=True only replaces a "
        "checkpoint written by jrollout, so nothing was deleted")

  real = os.path.realpath(path)
  cwd = os.path.realpath(os.getcwd())
  home = os.path.realpath(os.path.expanduser("~"))
  if real == os.path.dirname(real):
    raise refuse("is the filesystem root")
  if real == home:
    raise refuse("is the home directory")
  if real == cwd:
    raise refuse("is the current directory")
  if cwd.startswith(real.rstrip(os.sep) + os.sep):
    raise refuse(f"holds the current directory ({cwd})")
  if os.path.islink(path):
    raise refuse(f"is a symbolic link (to {os.readlink(path)})")
  if not os.path.isdir(path):
    raise refuse("is a file, not a checkpoint directory")
  if not os.listdir(path):
    return   # an empty directory: nothing to lose
  foreign = _foreign(path)
  if foreign:
    raise refuse(f"is not a jrollout checkpoint: it holds "
                 f"{_listing(foreign, 4)}, which a checkpoint does not")
  meta = os.path.join(path, "_METADATA")
  try:
    with open(meta, encoding="utf-8") as f:
      custom = json.load(f).get("custom_metadata")
  except (OSError, ValueError, AttributeError) as e:
    raise refuse(f"is not a readable jrollout checkpoint (its _METADATA: "
                 f"{type(e).__name__}: {e}); delete it yourself if it is a "
                 "damaged one") from None
  if not (isinstance(custom, dict) and custom.get("format") == _FORMAT):
    raise refuse("is an orbax checkpoint not written by jrollout")


def save_rollout(directory: str | os.PathLike, item: PyTree, *,
                 overwrite: bool = False) -> None:
  """Saves a rollout (or any pytree holding rollouts) to ``directory``.

  The checkpoint is written into a temporary directory and renamed to
  ``directory`` when complete (orbax's atomic finalisation): a save that
  dies half-way leaves no ``directory``. Returns when the checkpoint is on
  disk. Every process of a multi-process run must call it, with the same
  directory; each writes its shards. The CRC-32 of every shard each process
  writes, and the size of every file, are recorded with the checkpoint
  (in ``directory/jrollout_checksums/``), for ``restore_rollout`` to verify;
  they are computed while orbax writes.

  Example:
    >>> import os, shutil, tempfile
    >>> import jrollout as jr
    >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "obs", (4,))
    >>> path = os.path.join(tempfile.mkdtemp(), "rollout")
    >>> jr.save_rollout(path, state)
    >>> restored = jr.restore_rollout(path, state)   # checked, then read
    >>> restored.data["obs"].shape, restored.counts.shape
    ((3, 2, 4), (1, 3))
    >>> shutil.rmtree(os.path.dirname(path))

  Args:
    directory: the checkpoint's directory; it must not exist, unless
      ``overwrite``.
    item: a ``RolloutState`` (mid-rollout included: the write counts and
      out-of-range counters are saved), a ``RolloutWriter`` (its queued
      writes are flushed first, so none is lost), or a pytree of those,
      arrays, typed PRNG keys and bool/int/float.
    overwrite: replace an existing ``directory``, which must then be a
      checkpoint written by jrollout (or an empty directory): anything else
      (a file, a directory holding other files, the current directory or
      one above it, the home directory, ``/``) is refused and nothing is
      deleted. The old checkpoint is deleted when the save starts, so a
      crash during the save leaves neither: for periodic checkpoints use
      an ``ocp.CheckpointManager`` with ``RolloutSave`` (numbered steps,
      the latest complete one kept).

  Raises:
    ValueError: ``directory`` is ``""``, exists (and not ``overwrite``), is
      not a jrollout checkpoint (with ``overwrite``), or is below a file;
      or two leaves would have the same name in the checkpoint.
    TypeError: ``overwrite`` is not a bool, ``directory`` not a path, or a
      leaf cannot be saved (named in the message).
  """
  fn = "save_rollout"
  if not isinstance(overwrite, (bool, np.bool_)):
    raise TypeError(f"{fn}: overwrite must be True or False, got "
                    f"{overwrite!r} ({type(overwrite).__name__})")
  path = _path(fn, directory)
  if os.path.lexists(path):
    if not overwrite:
      raise ValueError(f"{fn}: directory {path} already exists; choose a new "
                       "directory, or pass overwrite=True to replace the "
                       "checkpoint there")
    _replaceable(fn, path)
  else:
    parent = os.path.dirname(path)
    while not os.path.lexists(parent):
      parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
      raise ValueError(f"{fn}: directory {path} cannot be created: {parent} "
                       "is a file")
  with ocp.Checkpointer(RolloutCheckpointHandler()) as ckptr:
    ckptr.save(path, args=RolloutSave(item, fn=fn), force=bool(overwrite))


def restore_rollout(directory: str | os.PathLike,
                    target: PyTree = None, *, verify: bool = True) -> PyTree:
  """Restores what ``save_rollout`` saved, checked against ``target`` first.

  ``target`` describes what to restore: the saved kind of state with the
  same keys, shapes, dtypes, E and T (a freshly built one, the state being
  replaced, or its ``jax.eval_shape``). Nothing is read until the whole
  target has been checked against the checkpoint's record, and the target
  is not changed. Each array is restored with the sharding of the target's
  leaf (so a state sharded with ``jr.shard`` comes back on the same mesh
  with the same sharding), NumPy leaves as NumPy.

  A ``RolloutState`` comes back exactly: storage, write counts and
  out-of-range counters, so a state saved mid-rollout finishes its rollout
  and ``make_batch`` reports what the original would have. To go on
  writing from a host loop, wrap it in a new writer::

    writer = jr.RolloutWriter(jr.restore_rollout(directory, writer.state))

  Without a target, every saved leaf comes back as a NumPy array, in nested
  dicts keyed by the names on its path (a dict's keys, a node's attribute
  names, a sequence's indices as strings): a dict of arrays comes back as
  it was; a ``RolloutState`` comes back as ``{"data": {...}, "counts": ...,
  "out_of_range": ...}``. There is no target to check then (the checksums
  are still verified), and PRNG keys need a target.

  Every leaf read is verified before anything is returned: the CRC-32 of
  each of its shards must equal the one recorded when it was saved (each
  process checks the shards it restores), and the checkpoint's files must
  all be there, with the sizes they were written with. A damaged
  checkpoint raises ``jr.CorruptCheckpointError`` naming the directory,
  the damaged leaves (the key of a RolloutState) and what is wrong. A
  checkpoint written before jrollout recorded checksums is restored with
  a warning that it cannot be verified.

  Args:
    directory: a checkpoint written by ``save_rollout``.
    target: a ``RolloutState`` or pytree like the saved item, with array or
      ``jax.ShapeDtypeStruct`` leaves; or None.
    verify: check the checksums (the default). ``False`` skips them,
      saving one CRC-32 pass over the bytes read (measured by
      benchmarks/scripts/checkpoint_bench.py): damaged bytes are then
      returned as they are, which can salvage what a damaged checkpoint
      still holds. A file missing or too short for the bytes
      the checkpoint's index places in it still raises
      ``CorruptCheckpointError``.

  Returns:
    The restored pytree, with ``target``'s structure (nested dicts without
    a target).

  Raises:
    CorruptCheckpointError: ``directory`` is a damaged checkpoint (above).
    FileNotFoundError: ``directory`` does not exist.
    ValueError: ``directory`` is a file, an incomplete (interrupted)
      checkpoint, no checkpoint or not a jrollout one, or does not match
      ``target``: a RolloutState's E or T, its keys, or a key's (leaf's)
      shape or dtype. The message names the key, what the target expects
      and what the checkpoint holds.
    TypeError: ``verify`` is not a bool.
  """
  fn = "restore_rollout"
  if not isinstance(verify, (bool, np.bool_)):
    raise TypeError(f"{fn}: verify must be True or False, got {verify!r} "
                    f"({type(verify).__name__})")
  path = _path(fn, directory)
  _restorable(fn, path)
  with ocp.Checkpointer(RolloutCheckpointHandler()) as ckptr:
    try:
      return ckptr.restore(path, args=RolloutRestore(
          target, verify=bool(verify), fn=fn))
    except ValueError as e:
      if str(e).startswith("Found incomplete checkpoint"):
        raise ValueError(_incomplete(fn, path)) from None
      raise


_TMP = ".orbax-checkpoint-tmp"


def _incomplete(fn: str, path: str) -> str:
  return (f"{fn}: directory {path} is an incomplete checkpoint: the save "
          "writing it was interrupted; restore an earlier checkpoint")


def _restorable(fn: str, path: str) -> None:
  """Refuses what is no checkpoint directory, naming what it is."""
  if not os.path.exists(path):
    parent, name = os.path.split(path)
    partial = (sorted(x for x in os.listdir(parent) if x.startswith(
        name + _TMP)) if os.path.isdir(parent) else [])
    raise FileNotFoundError(
        f"{fn}: directory {path} does not exist" + (
            f" (a save into it was interrupted and left {partial[-1]})"
            if partial else ""))
  if not os.path.isdir(path):
    raise ValueError(f"{fn}: directory {path} is a file, not a checkpoint "
                     "directory")
  if _TMP in os.path.basename(path):
    raise ValueError(_incomplete(fn, path))
  if not os.path.exists(os.path.join(path, "_METADATA")):
    names = sorted(os.listdir(path))
    ours = [name for name in names if name not in _foreign(path)]
    if ours:
      raise CorruptCheckpointError(fn, path, (), [
          f"its metadata file _METADATA is missing (it holds "
          f"{_listing(names, 4)})"])
    raise ValueError(
        f"{fn}: directory {path} is not a checkpoint: it has no _METADATA "
        f"file ({'it holds ' + _listing(names, 4) if names else 'it is empty'}"
        ")")
