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
import os
import pathlib
from typing import Any

from flax.traverse_util import flatten_dict
from flax.traverse_util import unflatten_dict
import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp

from jrollout import _checkpoint_record as records
from jrollout import _checks
from jrollout._types import PyTree

LOCK = "jrollout.lock"   # in a save_rollout directory: held while saving


class CheckpointSaveError(OSError):
  """A checkpoint could not be written; the last complete one is kept.

  Raised by ``save_rollout`` and ``RolloutSave`` when a write fails, or
  another save into the directory runs (``errno.EBUSY``). Attributes:
  ``errno`` (of the first ``OSError`` among the failure's causes and
  contexts, else ``EIO``), ``strerror`` (the cause), ``filename`` (the
  directory) and ``fn`` (the function that failed).
  """

  fn = "save_rollout"

  def __str__(self) -> str:
    code = errno.errorcode.get(self.errno or 0, self.errno)
    return (f"{self.fn}: cannot save {self.filename}: {self.strerror} "
            f"({code}); the last complete checkpoint there is kept")


class CorruptCheckpointError(ValueError):
  """A checkpoint damaged after it was written; nothing was restored.

  Raised when a leaf's bytes differ from the CRC-32 recorded at save time,
  or a leaf or the metadata cannot be read. Attributes: ``directory``,
  ``leaves`` (the ``jax.tree_util.keystr`` paths of the damaged leaves) and
  ``problems`` (one line each, also in the message).
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


def _save_error(fn: str, directory: Any, error: BaseException
                ) -> CheckpointSaveError:
  """``error`` as a ``CheckpointSaveError`` with the code and text of the
  first ``OSError`` among its causes, contexts and exception groups'
  members (else ``EIO`` and the first line of ``error``)."""
  todo: list[Any] = [error]
  seen: list[BaseException] = []
  while todo and not (isinstance(todo[0], OSError) and todo[0].errno):
    found = todo.pop(0)
    if found is not None and all(found is not x for x in seen):
      seen.append(found)
      todo += [found.__cause__, found.__context__,
               *getattr(found, "exceptions", ())]
  code, cause = errno.EIO, _first_line(error)
  if todo:
    code = todo[0].errno
    cause = todo[0].strerror or os.strerror(code)
  saving = CheckpointSaveError(code, cause, str(directory))
  saving.fn = fn
  return saving


@contextlib.contextmanager
def _saving(fn: str, directory: Any) -> Any:
  """Raises what fails inside as a ``CheckpointSaveError`` of
  ``directory``."""
  try:
    yield
  except Exception as e:
    raise _save_error(fn, directory, e) from e


def check_matches(fn: str, found: PyTree, target: PyTree, *, src: str,
                  dst: str) -> None:
  """Checks ``target`` against the pytree ``found`` as a restore would."""
  records.check_target(fn, records.record(fn, found)[0], target, src=src,
                       dst=dst)


class _Commit:
  """orbax's commit futures of an async save; a failure raised from
  ``result`` as a ``CheckpointSaveError``."""

  def __init__(self, fn: str, directory: Any, futures: list[Any]):
    self.fn, self.directory, self.futures = fn, directory, futures

  def result(self, timeout: float | None = None) -> None:
    with _saving(self.fn, self.directory):
      for future in self.futures:
        future.result(timeout)


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
    meta, leaves = records.record(fn, args.item)
    meta["checksums"] = records.checksums(leaves)
    tree = unflatten_dict({x.names: np.asarray(x.value) if isinstance(
        x.value, records.SCALARS) else x.value for x in leaves
                           if 0 not in x.shape})
    # orbax refuses an item without arrays; this one is never read back.
    tree = tree or {"empty": np.zeros((), np.int8)}
    return fn, ocp.args.PyTreeSave(tree, custom_metadata=meta)

  async def async_save(self, directory: Any, args: Any = None) -> Any:
    fn, pytree_args = self._save_args(args)
    with _saving(fn, directory):
      futures = await super().async_save(directory, args=pytree_args)
    return [_Commit(fn, directory, list(futures or []))]

  def save(self, directory: Any, args: Any = None) -> None:
    fn, pytree_args = self._save_args(args)
    with _saving(fn, directory):
      super().save(directory, args=pytree_args)

  def restore(self, directory: Any, args: Any = None) -> PyTree:
    fn, where = self._caller or "RolloutRestore", str(directory)
    verify = _checks.check_bool(fn, "verify", args.verify)
    try:
      meta = self.metadata(directory).custom_metadata
    except Exception as e:
      raise CorruptCheckpointError(fn, where, (), [
          f"its metadata cannot be read ({_first_line(e)})"]) from e
    leaves, treedef = records.check_target(fn, meta, args.item)
    stored = [x for x in leaves if 0 not in x.shape]
    restored = flatten_dict(self._read(fn, directory, stored)
                            if stored else {})
    values = [records.as_target(x, restored) for x in leaves]
    bad = records.verify(fn, where, leaves, values, meta["checksums"]
                         ) if verify else {}
    if bad:
      raise CorruptCheckpointError(fn, where, bad, bad.values())
    if treedef is None:
      return unflatten_dict({x.names: v for x, v in zip(leaves, values)})
    return jax.tree_util.tree_unflatten(treedef, values)

  def _read(self, fn: str, directory: Any, stored: list[records.Leaf]
            ) -> Any:
    """orbax's nested dict of ``stored``; CorruptCheckpointError naming
    the leaves that cannot be read (each then read alone to find them)."""
    def read(leaves: list[records.Leaf]) -> Any:
      tree = unflatten_dict({x.names: records.abstract(x) for x in leaves})
      return super(RolloutCheckpointHandler, self).restore(
          directory, args=ocp.args.PyTreeRestore(
              tree, ocp.checkpoint_utils.construct_restore_args(tree),
              partial_restore=True))
    try:
      return read(stored)
    except Exception as e:   # TensorStore's errors reach here as Exception
      first = _first_line(e)
    problems = {}
    for leaf in stored:
      try:
        read([leaf])
      except Exception as e:
        problems[leaf.path] = (f"leaf {leaf.path} cannot be read "
                               f"({_first_line(e)})")
    raise CorruptCheckpointError(fn, str(directory), problems,
                                 problems.values() or [
        f"its leaves cannot be read ({first})"])


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
def _locked(path: str) -> Any:
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
      raise CheckpointSaveError(
          errno.EBUSY, f"another save into it is running (it holds {LOCK})",
          path)
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
  records.record(fn, item)   # refused before anything is written
  if os.path.isdir(path) and os.listdir(path) and not os.path.exists(
      os.path.join(path, LOCK)):
    raise ValueError(f"{fn}: directory {path} holds "
                     f"{records.listing(sorted(os.listdir(path)), 4)} and no "
                     "save_rollout checkpoint; give a new or empty directory")
  try:
    os.makedirs(path, exist_ok=True)
  except (FileExistsError, NotADirectoryError):
    raise ValueError(f"{fn}: directory {path} cannot be created: it or a "
                     "directory above it is a file") from None
  except OSError as e:
    raise _save_error(fn, path, e) from None
  # The item was checked above: what fails now is a write.
  with _saving(fn, path), _locked(path), ocp.CheckpointManager(
      path, item_handlers=RolloutCheckpointHandler(caller=fn),
      options=ocp.CheckpointManagerOptions(
          max_to_keep=1, enable_async_checkpointing=False,
          cleanup_tmp_directories=True)) as manager:
    latest = manager.latest_step()
    step = 0 if latest is None else latest + 1
    manager.save(step, args=RolloutSave(item))
  return step


def _no_step(fn: str, path: str) -> ValueError:
  """Why ``path`` holds no step: empty, other files, or jrollout 0.2's
  format (one orbax checkpoint in the directory itself)."""
  why = "" if os.listdir(path) else " (it is empty)"
  with contextlib.suppress(Exception):
    meta = ocp.PyTreeCheckpointHandler().metadata(
        pathlib.Path(path)).custom_metadata
    if meta.get("format") == records.FORMAT:
      why = (f": it holds a checkpoint of format version {meta['version']} "
             "(jrollout 0.2), which this jrollout does not read; restore it "
             "with jrollout 0.2 and save the pytree again with save_rollout")
  return ValueError(f"{fn}: directory {path} holds no complete checkpoint"
                    f"{why}")


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
    ValueError: ``directory`` is a file or holds no complete checkpoint
      (one of jrollout 0.2 is named), or ``item`` does not match it.
    TypeError: ``verify`` is not a bool.
  """
  fn = "restore_rollout"
  path = _path(fn, directory)
  if not os.path.isdir(path):
    raise (ValueError(f"{fn}: directory {path} is a file, not a checkpoint")
           if os.path.exists(path) else
           FileNotFoundError(f"{fn}: directory {path} does not exist"))
  with ocp.CheckpointManager(
      path, item_handlers=RolloutCheckpointHandler(caller=fn),
      options=ocp.CheckpointManagerOptions(create=False)) as manager:
    if manager.latest_step() is None:
      raise _no_step(fn, path)
    return manager.restore(manager.latest_step(),
                           args=RolloutRestore(item, verify=verify))
