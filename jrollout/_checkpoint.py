"""Checkpoints of rollouts and whole runs, on orbax's public API.

``save_rollout`` saves a pytree as the next step of an orbax
``CheckpointManager`` directory, so the last complete step survives any
failed save; ``restore_rollout`` restores the latest step. Both use
``RolloutCheckpointHandler`` (``RolloutSave`` / ``RolloutRestore`` in any
manager), which records each leaf's path, shape and dtype and the CRC-32 of
each saved shard in orbax's custom metadata, checks a restore target against
that record before reading, and verifies the bytes read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
from typing import Any
import warnings
import zlib

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jrollout import _checks
from jrollout import _state
from jrollout._state import RolloutState
from jrollout._types import PyTree

FORMAT, VERSION = "jrollout", 3
LOCK = "jrollout.lock"   # in a save_rollout directory: held while saving
SCALARS = (bool, int, float)


class CheckpointSaveError(OSError):
  """A checkpoint could not be written; the last complete one is kept.

  Raised by ``save_rollout`` and ``RolloutSave`` when a write fails (or
  another save into the directory runs: ``errno.EBUSY``). The message
  names the function, the directory and the cause.

  Attributes:
    errno: the operating system's code where one is known, else ``EIO``.
    strerror: the cause.
    filename: the checkpoint's directory.
    fn: the function that failed.
  """

  fn = "save_rollout"

  def __str__(self) -> str:
    code = errno.errorcode.get(self.errno or 0, self.errno)
    return (f"{self.fn}: cannot save {self.filename}: {self.strerror} "
            f"({code}); the last complete checkpoint there is kept")


class CorruptCheckpointError(ValueError):
  """A checkpoint damaged after it was written; nothing was restored.

  Raised when a leaf's bytes differ from the CRC-32 recorded at save time,
  or a leaf or the metadata cannot be read; the message names the
  directory, the damaged leaves and what is wrong, one line each.

  Attributes:
    directory: the item's directory.
    leaves: the ``jax.tree_util.keystr`` paths of the damaged leaves.
    problems: one line per problem.
  """

  def __init__(self, fn: str, directory: str, leaves: Any, problems: Any):
    self.fn, self.directory = fn, directory
    self.leaves, self.problems = tuple(leaves), tuple(problems)
    super().__init__(f"{fn}: damaged checkpoint {directory}; nothing was "
                     "restored\n  " + "\n  ".join(self.problems))

  def __reduce__(self):
    return type(self), (self.fn, self.directory, self.leaves, self.problems)


def _first_line(error: BaseException) -> str:
  """The first line of the error at the root of ``error``'s causes."""
  while error.__cause__ is not None:
    error = error.__cause__
  text = f"{type(error).__name__}: {str(error).strip()}".split("\n")[0]
  return text if len(text) < 400 else f"{text[:240]} ... {text[-120:]}"


def _save_error(fn: str, directory: Any, error: BaseException | None,
                code: int = errno.EIO, cause: str = "") -> CheckpointSaveError:
  """A failed write as a ``CheckpointSaveError``, with the code of the
  first ``OSError`` among ``error``'s causes (else ``code``)."""
  found = error
  while found is not None and not getattr(found, "errno", None):
    found = found.__cause__ or found.__context__
  if isinstance(found, OSError) and found.errno:
    code, cause = found.errno, found.strerror or os.strerror(found.errno)
  elif error is not None:
    cause = _first_line(error)
  saving = CheckpointSaveError(code, cause, str(directory))
  saving.fn = fn
  return saving


def _is_writer(x: Any) -> bool:
  """A host-loop writer (``jr.RolloutWriter``): its type has ``flush`` and
  ``state`` (asked of the type: reading ``state`` flushes)."""
  return callable(getattr(type(x), "flush", None)) and hasattr(
      type(x), "state")


def _flushed(writer: Any) -> RolloutState:
  writer.flush()
  return writer.state


@dataclasses.dataclass(frozen=True)
class Leaf:
  """A leaf of a saved item or restore target, with its spec."""
  path: str                    # jax.tree_util.keystr
  names: tuple[str, ...]       # orbax's nested-dict names
  shape: tuple[int, ...]
  dtype: str
  value: Any


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
            "writer" if _is_writer(leaf) else "")
  raise TypeError(
      f"{fn}: leaf {where or 'the tree'} is {what}; a checkpoint holds JAX or "
      "NumPy arrays of numbers, bools or typed PRNG keys, bool/int/float, "
      f"RolloutStates and writers (jax.ShapeDtypeStruct as a target){remedy}")


def _flatten(fn: str, tree: PyTree, is_leaf: Any, paths: Any = None
             ) -> tuple[list[Any], Any]:
  """``tree``'s leaves (with their paths, if ``paths``) and treedef."""
  try:
    if paths:
      return jax.tree_util.tree_flatten_with_path(tree, is_leaf)
    return jax.tree_util.tree_flatten(tree, is_leaf)
  except (TypeError, ValueError) as e:   # dict keys that cannot be sorted
    raise TypeError(f"{fn}: the tree cannot be flattened ({e}); a checkpoint"
                    " names leaves by their dict keys: use strings") from None


def _leaves(fn: str, tree: PyTree) -> tuple[list[Leaf], Any]:
  """The leaves of ``tree`` with their specs, and its treedef."""
  flat, treedef = _flatten(fn, tree, None, jax.tree_util.keystr)
  leaves: list[Leaf] = []
  seen: dict[str, str] = {}
  for path, value in flat:
    where = jax.tree_util.keystr(path)
    for entry in path:
      key = getattr(entry, "key", "")
      if isinstance(entry, jax.tree_util.DictKey) and not isinstance(key, str):
        raise TypeError(f"{fn}: leaf {where} has the dict key {key!r} (of type"
                        f" {type(key).__name__}); use strings as dict keys")
    names = tuple(str(getattr(x, "name", getattr(x, "idx", getattr(
        x, "key", x)))) for x in path)
    name = ".".join(names)   # as orbax names the leaf's array
    if name in seen:
      raise ValueError(f"{fn}: leaves {seen[name]} and {where} have the same "
                       f"name {name!r} in a checkpoint; rename one")
    seen[name] = where
    leaves.append(Leaf(where, names, *_spec(fn, where, value), value))
  return leaves, treedef


def _rollouts(tree: PyTree) -> dict[str, list[Any]]:
  """``{key path: [E, T, fields]}`` of each RolloutState in ``tree``."""
  nodes = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, RolloutState))[0]
  return {jax.tree_util.keystr(path): [x.num_envs, x.num_steps, list(x.names)]
          for path, x in nodes if isinstance(x, RolloutState)}


def _record(fn: str, item: PyTree) -> tuple[dict[str, Any], list[Leaf]]:
  leaves, _ = _leaves(fn, item)
  return {"format": FORMAT, "version": VERSION, "rollouts": _rollouts(item),
          "leaves": {x.path: {"names": list(x.names), "shape": list(x.shape),
                              "dtype": x.dtype} for x in leaves}}, leaves


def _rollout(info: list[Any] | None) -> str:
  if info is None:
    return "none"
  return f"num_envs (E) {info[0]}, num_steps (T) {info[1]}, fields {info[2]}"


def _saveable(fn: str, item: PyTree) -> tuple[dict[str, Any], list[Leaf]]:
  """The record and leaves of ``item``, its writers flushed; an error
  naming the first leaf that cannot be saved."""
  flat, treedef = _flatten(fn, item, _is_writer)
  meta, leaves = _record(fn, treedef.unflatten(
      [_flushed(x) if _is_writer(x) else x for x in flat]))
  for leaf in leaves:
    if _state.deleted(leaf.value):
      raise ValueError(
          f"{fn}: leaf {leaf.path} is a deleted array (a call donated its "
          "buffers: jax.jit with donate_argnums, a RolloutWriter's flush); "
          "save the state that call returned")
    if leaf.dtype.startswith("key<") and 0 in leaf.shape:
      raise ValueError(f"{fn}: leaf {leaf.path}: PRNG key arrays with no "
                       f"elements (shape {leaf.shape}) cannot be saved")
  return meta, leaves


def _listing(paths: Any, limit: int = 8) -> str:
  shown = list(paths)
  more = f", ... ({len(shown)} in all)" if len(shown) > limit else ""
  return ", ".join(shown[:limit]) + more


def check_target(fn: str, meta: Any, target: PyTree, *,
                 src: str = "the checkpoint", dst: str = "the target"
                 ) -> tuple[list[Leaf], Any]:
  """Checks ``target`` against a record; returns its ``(leaves, treedef)``.

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
  if target is None:   # the saved leaves, as NumPy
    leaves = []
    for path, x in meta["leaves"].items():
      if x["dtype"].startswith("key<"):
        raise ValueError(f"{fn}: leaf {path} is a PRNG key array "
                         f"({x['dtype']}); restore it with a target")
      leaves.append(Leaf(path, tuple(x["names"]), tuple(x["shape"]),
                         x["dtype"], np.zeros((), x["dtype"])))
    return leaves, None
  leaves, treedef = _leaves(fn, target)
  want = _rollouts(target)
  for path in sorted(set(want) | set(meta["rollouts"])):
    held, expects = meta["rollouts"].get(path), want.get(path)
    if held != expects:
      raise ValueError(
          f"{fn}: the RolloutState at {path or 'the root'}: {src} holds "
          f"{_rollout(held)}, {dst} expects {_rollout(expects)}")
  found, paths = meta["leaves"], [x.path for x in leaves]
  for path in [p for p in paths if p not in found]:
    raise ValueError(f"{fn}: leaf {path} of {dst} is not in {src} (its "
                     f"leaves: {_listing(found)})")
  for path in [p for p in found if p not in paths]:
    raise ValueError(f"{fn}: leaf {path} of {src} is not in {dst} (its "
                     f"leaves: {_listing(sorted(paths))})")
  for leaf in leaves:
    got = (tuple(found[leaf.path]["shape"]), found[leaf.path]["dtype"])
    if got != (leaf.shape, leaf.dtype):
      raise ValueError(
          f"{fn}: leaf {leaf.path}: {src} holds shape {got[0]} "
          f"{got[1]}, {dst} expects shape {leaf.shape} {leaf.dtype}")
  return leaves, treedef


def check_matches(fn: str, found: PyTree, target: PyTree, *, src: str,
                  dst: str) -> None:
  """Checks ``target`` against the pytree ``found`` as a restore would."""
  check_target(fn, _record(fn, found)[0], target, src=src, dst=dst)


def _shards(value: Any, saved: bool) -> dict[str, np.ndarray]:
  """``{region: host bytes}`` of this process's shards of a leaf (when
  ``saved``: replica 0's, and NumPy leaves on process 0 only)."""
  if isinstance(value, jax.Array) and jax.dtypes.issubdtype(
      value.dtype, jax.dtypes.prng_key):
    value = jax.random.key_data(value)
  if not isinstance(value, jax.Array):
    whole = str([[0, n] for n in np.shape(value)])
    mine = not saved or jax.process_index() == 0
    return {whole: np.asarray(value)} if mine else {}
  shards = [x for x in value.addressable_shards
            if not saved or x.replica_id == 0]
  regions = [str([list(s.indices(n)[:2]) for s, n in zip(
      (*x.index, *[slice(None)] * (value.ndim - len(x.index))), value.shape)])
             for x in shards]
  return dict(zip(regions, jax.device_get([x.data for x in shards])))


def _crc(array: np.ndarray) -> int:
  return zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8)
                    .data)


def _checksums(leaves: list[Leaf]) -> dict[str, dict[str, int]]:
  """``{leaf path: {region: CRC-32}}`` of every process's saved shards."""
  mine = {x.path: {region: _crc(host) for region, host in _shards(
      x.value, saved=True).items()} for x in leaves if 0 not in x.shape}
  if jax.process_count() == 1:
    return mine
  words = np.frombuffer(json.dumps(mine).encode(), np.uint8)
  size = int(multihost_utils.process_allgather(np.int32(words.size)).max())
  merged: dict[str, dict[str, int]] = {}
  for row in multihost_utils.process_allgather(
      np.pad(words, (0, size - words.size))):
    for path, crcs in json.loads(bytes(row).rstrip(b"\0")).items():
      merged.setdefault(path, {}).update(crcs)
  return merged


def _verify(fn: str, where: str, leaves: list[Leaf], values: list[Any],
            meta: Any) -> None:
  """CorruptCheckpointError naming each leaf whose shards held here differ
  from their CRC-32; a warning for leaves restored with another sharding
  (no recorded shard held whole here)."""
  bad, problems, unchecked = [], [], []
  for leaf, value in zip(leaves, values):
    recorded = meta["checksums"].get(leaf.path, {})
    held = {region: _crc(host) for region, host in _shards(
        value, saved=False).items() if region in recorded}
    if recorded and not held and jax.process_count() == 1:
      unchecked.append(leaf.path)
    for region, got in held.items():
      if got != recorded[region] and leaf.path not in bad:
        bad.append(leaf.path)
        shard = f" in shard {region}" if len(recorded) > 1 else ""
        problems.append(
            f"leaf {leaf.path}: checksum mismatch"
            f"{shard}: its bytes have CRC-32 {got:#010x}, the save recorded "
            f"{recorded[region]:#010x}")
  if unchecked:
    warnings.warn(f"{fn}: {where}: leaves {_listing(unchecked, 4)} were "
                  "restored with another sharding than saved, so their "
                  "checksums were not verified", UserWarning, stacklevel=4)
  if bad:
    raise CorruptCheckpointError(fn, where, bad, problems)


def _nest(pairs: list[tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
  """``[(("a", "b"), x)]`` as ``{"a": {"b": x}}``."""
  out: dict[str, Any] = {}
  for names, value in pairs:
    node = out
    for name in names[:-1]:
      node = node.setdefault(name, {})
    node[names[-1]] = value
  return out


def _abstract(leaf: Leaf) -> jax.ShapeDtypeStruct:
  """What orbax restores a target leaf as: NumPy, or JAX with a sharding."""
  dtype = getattr(leaf.value, "dtype", None) or np.dtype(leaf.dtype)
  if isinstance(leaf.value, (np.ndarray, np.generic) + SCALARS):
    return jax.ShapeDtypeStruct(leaf.shape, dtype)
  sharding = getattr(leaf.value, "sharding", None) or (
      jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
  return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=sharding)


def _as_target(leaf: Leaf, restored: dict[str, Any]) -> Any:
  """A restored leaf as the target's kind (no elements: zeros)."""
  if 0 in leaf.shape:
    spec = _abstract(leaf)
    if spec.sharding is None:
      return np.zeros(leaf.shape, spec.dtype)
    return jnp.zeros(leaf.shape, spec.dtype, device=spec.sharding)
  value = restored
  for name in leaf.names:
    value = value[name]
  if isinstance(leaf.value, SCALARS):
    return type(leaf.value)(np.asarray(value).item())
  return np.asarray(value)[()] if isinstance(leaf.value, np.generic) else value


class _Commit:
  """orbax's commit futures of an async save; a failure raised from
  ``result`` as a ``CheckpointSaveError``."""

  def __init__(self, fn: str, directory: Any, futures: list[Any]):
    self.fn, self.directory, self.futures = fn, directory, futures

  def result(self, timeout: float | None = None) -> None:
    for future in self.futures:
      try:
        future.result(timeout)
      except Exception as e:
        raise _save_error(self.fn, self.directory, e) from e


class RolloutCheckpointHandler(ocp.PyTreeCheckpointHandler):
  """orbax's ``PyTreeCheckpointHandler`` with jrollout's record and checks.

  An ``ocp.CheckpointManager`` picks it for ``RolloutSave`` and
  ``RolloutRestore`` args. Arrays are written uncompressed by default.

  Args:
    caller: the function named in messages (default: the args' class).
    **kwargs: for ``ocp.PyTreeCheckpointHandler``.
  """

  @classmethod
  def typestr(cls) -> str:
    return "jrollout._checkpoint.RolloutCheckpointHandler"

  def __init__(self, *, caller: str | None = None, **kwargs: Any):
    super().__init__(**{"use_compression": False, **kwargs})
    self._caller = caller

  def _save_args(self, args: Any) -> tuple[str, ocp.args.PyTreeSave]:
    fn = self._caller or "RolloutSave"
    meta, leaves = _saveable(fn, args.item)
    meta["checksums"] = _checksums(leaves)
    tree = _nest([(x.names, np.asarray(x.value) if isinstance(
        x.value, SCALARS) else x.value) for x in leaves if 0 not in x.shape])
    # orbax refuses an item without arrays; this one is never read back.
    tree = tree or {"empty": np.zeros((), np.int8)}
    return fn, ocp.args.PyTreeSave(tree, custom_metadata=meta)

  async def async_save(self, directory: Any, args: Any = None) -> Any:
    fn, pytree_args = self._save_args(args)
    try:
      futures = await super().async_save(directory, args=pytree_args)
    except Exception as e:
      raise _save_error(fn, directory, e) from e
    return [_Commit(fn, directory, list(futures or []))]

  def save(self, directory: Any, args: Any = None) -> None:
    fn, pytree_args = self._save_args(args)
    try:
      super().save(directory, args=pytree_args)
    except Exception as e:
      raise _save_error(fn, directory, e) from e

  def restore(self, directory: Any, args: Any = None) -> PyTree:
    fn, where = self._caller or "RolloutRestore", str(directory)
    verify = _checks.check_bool(fn, "verify", args.verify)
    try:
      meta = self.metadata(directory).custom_metadata
    except Exception as e:
      raise CorruptCheckpointError(fn, where, (), [
          f"its metadata cannot be read ({_first_line(e)})"]) from e
    leaves, treedef = check_target(fn, meta, args.item)
    stored = [x for x in leaves if 0 not in x.shape]
    restored = self._read(fn, directory, stored)
    values = [_as_target(x, restored) for x in leaves]
    if verify:
      _verify(fn, where, leaves, values, meta)
    if treedef is None:
      return _nest([(x.names, v) for x, v in zip(leaves, values)])
    return jax.tree_util.tree_unflatten(treedef, values)

  def _read(self, fn: str, directory: Any, stored: list[Leaf]) -> Any:
    """orbax's nested dict of ``stored``; CorruptCheckpointError naming
    the leaves that cannot be read (each then read alone to find them)."""
    def read(leaves: list[Leaf]) -> Any:
      tree = _nest([(x.names, _abstract(x)) for x in leaves])
      return super(RolloutCheckpointHandler, self).restore(
          directory, args=ocp.args.PyTreeRestore(
              tree, ocp.checkpoint_utils.construct_restore_args(tree),
              partial_restore=True))
    if not stored:
      return {}
    try:
      return read(stored)
    except Exception as e:   # TensorStore's errors reach here as Exception
      error = e
    bad, problems = [], []
    for leaf in stored:
      try:
        read([leaf])
      except Exception as e:
        bad.append(leaf.path)
        problems.append(f"leaf {leaf.path} cannot be read ({_first_line(e)})")
    raise CorruptCheckpointError(fn, str(directory), bad, problems or [
        f"its leaves cannot be read ({_first_line(error)})"]) from error


@ocp.args.register_with_handler(RolloutCheckpointHandler, for_save=True)
@dataclasses.dataclass
class RolloutSave(ocp.args.CheckpointArgs):
  """orbax save args: ``item`` saved as ``save_rollout`` saves it.

  For any ``ocp.CheckpointManager``, alone or in ``ocp.args.Composite``.
  Writers are flushed, and the CRC-32 of each shard is recorded before
  the save returns (its arrays may then be donated).

  Attributes:
    item: a ``RolloutState``, ``RolloutWriter`` or pytree of them, arrays
      (JAX, sharded or not; NumPy), typed PRNG keys and bool/int/float.

  Example:
    >>> import tempfile, orbax.checkpoint as ocp, jrollout as jr
    >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "r")
    >>> with ocp.CheckpointManager(tempfile.mkdtemp()) as manager:
    ...   _ = manager.save(0, args=jr.RolloutSave(state))
    ...   manager.wait_until_finished()
    ...   back = manager.restore(0, args=jr.RolloutRestore(state))
    >>> back.names
    ('r',)
  """
  item: PyTree


@ocp.args.register_with_handler(RolloutCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class RolloutRestore(ocp.args.CheckpointArgs):
  """orbax restore args: restored as ``restore_rollout`` restores.

  Attributes:
    item: the target pytree (see ``restore_rollout``), or None.
    verify: check the CRC-32 recorded at save time.
  """
  item: PyTree = None
  verify: bool = True


def _path(fn: str, directory: Any) -> str:
  """``directory`` as an absolute path; a clear error for what is none."""
  try:
    found = os.fsdecode(os.fspath(directory))
  except TypeError:
    raise TypeError(f"{fn}: directory must be a str or os.PathLike, got "
                    f"{type(directory).__name__}") from None
  if not found or "\0" in found:
    raise ValueError(f"{fn}: directory {found!r} is empty or holds a NUL "
                     "character ('\\0'); give a path such as 'runs/ckpt'")
  return os.path.abspath(found)


@contextlib.contextmanager
def _locked(fn: str, path: str) -> Any:
  """Holds ``path/LOCK`` (process 0's ``flock``) while saving;
  CheckpointSaveError (EBUSY) on every process if another save holds it."""
  fd, busy = None, 0
  if jax.process_index() == 0:
    fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      busy = 1
  if jax.process_count() > 1:
    busy = int(multihost_utils.broadcast_one_to_all(np.int32(busy)))
  try:
    if busy:
      raise _save_error(fn, path, None, errno.EBUSY,
                        f"another save into it is running (it holds {LOCK})")
    yield
  finally:
    if fd is not None:
      os.close(fd)


def save_rollout(directory: str | os.PathLike, item: PyTree) -> int:
  """Saves a rollout, or any pytree of them, as the next checkpoint.

  ``directory`` is an orbax ``CheckpointManager`` directory: step 0, 1, ...
  is written into a temporary directory renamed into place when complete,
  and only then is the previous step deleted, so a kill or a full disk at
  any moment leaves the last complete checkpoint whole. A save holds
  ``directory/jrollout.lock``: a second one fails at once.

  Example:
    >>> import os, tempfile, jrollout as jr
    >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "obs", (4,))
    >>> path = os.path.join(tempfile.mkdtemp(), "rollout")
    >>> jr.save_rollout(path, state), jr.save_rollout(path, state)
    (0, 1)

  Args:
    directory: new, empty, or written by ``save_rollout``.
    item: a ``RolloutState``, a ``RolloutWriter`` (flushed first), or a
      pytree of those, arrays of numbers, bools or typed PRNG keys, and
      bool/int/float, with string dict keys.

  Returns:
    The step saved.

  Raises:
    CheckpointSaveError: a write failed, or another save is running.
    ValueError: ``directory`` is ``""``, holds a NUL, is a file, or holds
      other files; two leaves share a name; a leaf was donated.
    TypeError: ``directory`` is no path; a leaf or dict key cannot be saved.
  """
  fn = "save_rollout"
  path = _path(fn, directory)
  _saveable(fn, item)   # refused before anything is written
  if os.path.isdir(path) and os.listdir(path) and not os.path.exists(
      os.path.join(path, LOCK)):
    raise ValueError(f"{fn}: directory {path} holds "
                     f"{_listing(sorted(os.listdir(path)), 4)} and no "
                     "save_rollout checkpoint; give a new or empty directory")
  try:
    os.makedirs(path, exist_ok=True)
  except (FileExistsError, NotADirectoryError):
    raise ValueError(f"{fn}: directory {path} cannot be created: it or a "
                     "directory above it is a file") from None
  except OSError as e:
    raise _save_error(fn, path, e) from None
  try:
    with _locked(fn, path), ocp.CheckpointManager(
        path, item_handlers=RolloutCheckpointHandler(caller=fn),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=1, enable_async_checkpointing=False,
            cleanup_tmp_directories=True)) as manager:
      latest = manager.latest_step()
      step = 0 if latest is None else latest + 1
      manager.save(step, args=RolloutSave(item))
  except Exception as e:   # the item was checked above: a failed write
    if isinstance(e, CheckpointSaveError) and e.filename == path:
      raise
    raise _save_error(fn, path, e) from e
  return step


def restore_rollout(directory: str | os.PathLike, item: PyTree = None, *,
                    verify: bool = True) -> PyTree:
  """Restores the latest checkpoint ``save_rollout`` saved in ``directory``.

  The target ``item`` (a fresh state, or its ``jax.eval_shape``) is checked
  against the checkpoint's record before anything is read. JAX leaves come
  back with the target's sharding, NumPy leaves as NumPy, a RolloutState
  exactly (write counts too); without a target, NumPy in nested dicts.

  Example:
    >>> import os, tempfile, numpy as np, jrollout as jr
    >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "r")
    >>> state = jr.update_at(state, 1, {"r": np.array([5.0, 6.0])})
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> _ = jr.save_rollout(path, state)
    >>> jr.restore_rollout(path, state).counts.tolist()   # [K, T]
    [[0, 1, 0]]
    >>> jr.restore_rollout(path)["data"]["r"][1]   # no target: NumPy
    array([5., 6.], dtype=float32)

  Args:
    directory: a directory ``save_rollout`` wrote.
    item: the target pytree (arrays or ``jax.ShapeDtypeStruct``), or None.
    verify: compare each shard read with its recorded CRC-32 (``False``
      returns damaged bytes as they are, to salvage them).

  Raises:
    CorruptCheckpointError: a leaf's bytes differ from their CRC-32, or a
      leaf or the metadata cannot be read (each damaged leaf named).
    FileNotFoundError: ``directory`` does not exist.
    ValueError: ``directory`` is a file or holds no complete checkpoint,
      or ``item`` does not match it (the leaf, expected and found named).
    TypeError: ``verify`` is not a bool.
  """
  fn = "restore_rollout"
  verify = _checks.check_bool(fn, "verify", verify)
  path = _path(fn, directory)
  if not os.path.isdir(path):
    raise (ValueError(f"{fn}: directory {path} is a file, not a checkpoint")
           if os.path.exists(path) else
           FileNotFoundError(f"{fn}: directory {path} does not exist"))
  with ocp.CheckpointManager(
      path, item_handlers=RolloutCheckpointHandler(caller=fn),
      options=ocp.CheckpointManagerOptions(create=False)) as manager:
    if manager.latest_step() is None:
      raise ValueError(f"{fn}: directory {path} holds no complete checkpoint"
                       f"{'' if os.listdir(path) else ' (it is empty)'}")
    return manager.restore(manager.latest_step(),
                           args=RolloutRestore(item, verify=verify))
