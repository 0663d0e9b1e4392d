"""Saving and restoring rollouts: the public functions and orbax's handler.

``save_rollout`` / ``restore_rollout`` write and read one pytree in one
directory; ``RolloutSave`` / ``RolloutRestore`` are the same operations as
orbax ``CheckpointArgs`` for an ``ocp.CheckpointManager``. Both go through
``RolloutCheckpointHandler``, which composes an ``ocp.PyTreeCheckpointHandler``
(its ``args=`` API only) with jrollout's record (``record``), checksums
(``checksums``) and damage checks (``damage``); ``save_rollout`` replaces a
checkpoint through ``swap``.

Dimension letters: T = num_steps, E = num_envs, K = number of fields.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any
import warnings

from etils import epath  # type: ignore[import-untyped]

import jax
import orbax.checkpoint as ocp

from jrollout import _checks
from jrollout._checkpoint import checksums
from jrollout._checkpoint import errors
from jrollout._checkpoint import paths
from jrollout._checkpoint import swap
from jrollout._checkpoint.damage import check_files
from jrollout._checkpoint.damage import Damage
from jrollout._checkpoint.damage import metadata
from jrollout._checkpoint.damage import quiet_abandoned_reads
from jrollout._checkpoint.damage import read_failure
from jrollout._checkpoint.record import abstract
from jrollout._checkpoint.record import as_saved
from jrollout._checkpoint.record import check_record
from jrollout._checkpoint.record import check_target
from jrollout._checkpoint.record import Leaf
from jrollout._checkpoint.record import listing
from jrollout._checkpoint.record import lookup
from jrollout._checkpoint.record import nest
from jrollout._checkpoint.record import rebuild
from jrollout._checkpoint.record import to_orbax
from jrollout._types import PyTree

__all__ = ("RolloutCheckpointHandler",
           "RolloutRestore", "RolloutSave", "restore_rollout",
           "save_rollout")


class RolloutCheckpointHandler(ocp.AsyncCheckpointHandler):
  """orbax's ``PyTreeCheckpointHandler`` with jrollout's record and checks.

  Used through ``RolloutSave`` / ``RolloutRestore`` (registered with orbax,
  so an ``ocp.CheckpointManager`` picks this handler itself) or through
  ``save_rollout`` / ``restore_rollout``. Arrays are written uncompressed
  by default (``use_compression=False``: zstd barely shrinks rollout
  floats and made a save about 3x slower, docs/guides/checkpoints.md).
  Beyond orbax's files, a save writes the checksum records of
  ``jrollout_checksums/`` (each process its own once its arrays are
  written; process 0 the merged index's in ``finalize``), and a restore
  verifies them (``RolloutRestore.verify``).

  Args:
    caller: the name messages start with (``save_rollout``,
      ``restore_rollout``); by default the args' class, ``RolloutSave`` or
      ``RolloutRestore``.
    **kwargs: for ``ocp.PyTreeCheckpointHandler``.
  """

  @classmethod
  def typestr(cls) -> str:
    # The name orbax records in each CheckpointManager step and looks the
    # handler up by (a restore without args): the class's path before it
    # moved into jrollout._checkpoint.api, kept so old steps still resolve.
    return "jrollout._checkpoint.RolloutCheckpointHandler"

  def __init__(self, *, caller: str | None = None, **kwargs: Any):
    kwargs.setdefault("use_compression", False)
    self._pytree = ocp.PyTreeCheckpointHandler(**kwargs)
    self._caller = caller

  def _save_args(self, args: Any) -> tuple[Any, list[Leaf]]:
    """orbax's ``PyTreeSave`` arguments, and the leaves to checksum."""
    if not isinstance(args, RolloutSave):
      raise TypeError(f"RolloutCheckpointHandler saves jr.RolloutSave args, "
                      f"got {type(args).__name__}")
    tree, meta, leaves = to_orbax(self._caller or "RolloutSave", args.item)
    meta["checksums"] = {"algorithm": checksums.ALGORITHM,
                         "processes": jax.process_count()}
    return ocp.args.PyTreeSave(tree, custom_metadata=meta), leaves

  async def async_save(self, directory: epath.Path,
                       args: RolloutSave | None = None) -> list[Any]:
    """Starts the save; returns one commit future, which waits for orbax's
    and writes this process's checksum record once the arrays are written
    (before orbax renames the checkpoint into place). A failed write
    raises ``CheckpointSaveError`` from it, on every process."""
    pytree_args, leaves = self._save_args(args)
    errors.quiet_failed_writes()
    crcs = checksums.in_background(checksums.checksums, leaves)
    futures, error = [], None
    try:   # the checksums are computed while orbax copies
      futures = await self._pytree.async_save(directory, args=pytree_args)
    except Exception as e:   # a failed write: raised, agreed, by the commit
      if errors.cause_of(e) is None:
        raise
      error = e
    finally:
      record = crcs()   # before returning: the caller may then donate
    return [_Commit(self._caller or "RolloutSave", directory,
                    list(futures or []), record, error)]

  def save(self, directory: epath.Path,
           args: RolloutSave | None = None) -> None:
    """Saves ``args.item`` and this process's checksum record;
    ``CheckpointSaveError`` (on every process) if a write fails."""
    pytree_args, leaves = self._save_args(args)
    errors.quiet_failed_writes()
    crcs = checksums.in_background(checksums.checksums, leaves)

    def write() -> None:
      try:   # the checksums are computed while orbax writes
        self._pytree.save(directory, args=pytree_args)
      finally:
        record = crcs()
      checksums.write_record(directory, record)

    _agree_on_write(self._caller or "RolloutSave", directory, write)

  def finalize(self, directory: epath.Path) -> None:
    self._pytree.finalize(directory)   # merges the processes' OCDBT stores
    checksums.write_index(directory)

  def metadata(self, directory: epath.Path) -> Any:
    return self._pytree.metadata(directory)

  def close(self) -> None:
    self._pytree.close()

  def restore(self, directory: epath.Path,
              args: RolloutRestore | None = None) -> PyTree:
    """Checks the target and the files, reads, verifies, then returns."""
    if not isinstance(args, RolloutRestore):
      raise TypeError(f"RolloutCheckpointHandler restores jr.RolloutRestore "
                      f"args, got {type(args).__name__}")
    fn = self._caller or "RolloutRestore"
    verify = _checks.check_bool(fn, "verify", args.verify)
    meta = metadata(fn, directory)
    check_record(fn, meta, "the checkpoint")
    records = checksums.records(fn, directory, meta) if verify else None
    check_files(fn, directory, meta, records)   # before the target too
    if args.item is None:
      leaves, treedef = as_saved(fn, meta), None
    else:
      leaves, treedef = check_target(fn, meta, args.item)
    damage = Damage(fn, directory, meta["rollouts"])
    stored = [x for x in leaves if 0 not in x.shape]
    restored = self._read(directory, stored, damage)
    if records is not None:
      split = checksums.verify(
          stored, [lookup(restored, x.names) for x in stored], records,
          damage)
      if split:
        warnings.warn(
            f"{fn}: {directory}: shards of leaves {listing(split, 4)} are "
            "split between processes by the target's sharding, so no "
            "process could verify them; restore with the save's sharding to "
            "verify every shard", UserWarning, stacklevel=3)
    damage.raise_any()
    return rebuild(leaves, treedef, restored)

  def _read(self, directory: epath.Path, stored: list[Leaf],
            damage: Damage) -> dict[str, Any]:
    """orbax's nested dict of the ``stored`` leaves; CorruptCheckpointError
    (with ``damage``'s problems) if TensorStore cannot read one."""
    if not stored:
      return {}
    tree = nest([(x.names, abstract(x)) for x in stored])
    restored: dict[str, Any] = {}
    with quiet_abandoned_reads():
      try:
        restored = self._pytree.restore(directory, args=ocp.args.PyTreeRestore(
            tree, restore_args=ocp.checkpoint_utils.construct_restore_args(
                tree)))
      except Exception as e:   # TensorStore's errors are plain Exceptions
        failure = read_failure(e, stored)
        if failure is None:
          raise
        damage.add(failure[1], [failure[0]] if failure[0] else [])
      if not restored:     # raised outside the except: no driver dump
        raise damage.error()
    return restored


def _agree_on_write(fn: str, directory: Any, write: Any) -> None:
  """Runs ``write()``; a failed write raises ``CheckpointSaveError``
  naming ``directory``, on every process (``errors.agree``)."""
  error: BaseException | None = None
  try:
    write()
  except Exception as e:
    error = e
    converted = errors.save_error(fn, str(directory), e)
    if converted is not None:
      converted.__context__, converted.__suppress_context__ = e, True
      error = converted
  errors.agree(fn, str(directory), "write", error)


class _Commit:
  """The commit future of ``RolloutCheckpointHandler.async_save``: waits
  for orbax's futures, writes the checksum record, and agrees with the
  other processes on the outcome (``_agree_on_write``), once."""

  def __init__(self, fn: str, directory: Any, futures: list[Any],
               record: Any, error: BaseException | None):
    self._fn, self._directory, self._futures = fn, directory, futures
    self._record, self._error = record, error
    self._done: list[BaseException | None] = []
    self._lock = threading.Lock()

  def _write(self) -> None:
    if self._error is not None:
      raise self._error
    for future in self._futures:
      future.result()
    checksums.write_record(self._directory, self._record)

  def result(self, timeout: float | None = None) -> None:
    del timeout   # orbax's own futures have none either
    with self._lock:
      if not self._done:
        try:
          _agree_on_write(self._fn, self._directory, self._write)
          self._done.append(None)
        except BaseException as e:
          self._done.append(e)
    if self._done[0] is not None:
      raise self._done[0]

  def cancel(self) -> None:
    for future in self._futures:
      if hasattr(future, "cancel"):
        future.cancel()


@ocp.args.register_with_handler(RolloutCheckpointHandler, for_save=True)
@dataclasses.dataclass
class RolloutSave(ocp.args.CheckpointArgs):
  """orbax save arguments for a rollout, writer or any pytree holding them.

  For an ``ocp.CheckpointManager``; the item is saved as
  ``jr.save_rollout`` saves it (writers flushed first, checksums
  recorded: ``async_save`` returns once they are computed, so the arrays
  may then be donated), alone or as an item of an ``ocp.args.Composite``.

  Example:
    >>> import os, tempfile, numpy as np, orbax.checkpoint as ocp
    >>> import jrollout as jr
    >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "r")
    >>> state = jr.update_at(state, 1, {"r": np.array([5.0, 6.0])})
    >>> d = tempfile.mkdtemp()
    >>> with ocp.CheckpointManager(os.path.join(d, "run")) as m:
    ...   _ = m.save(7, args=ocp.args.Composite(
    ...       run=jr.RolloutSave(state), meta=ocp.args.JsonSave({"lr": 0.1})))
    ...   m.wait_until_finished()
    ...   got = m.restore(m.latest_step(), args=ocp.args.Composite(
    ...       run=jr.RolloutRestore(state), meta=ocp.args.JsonRestore()))
    >>> got["run"].data["r"].tolist(), got["meta"]
    ([[0.0, 0.0], [5.0, 6.0], [0.0, 0.0]], {'lr': 0.1})

  Attributes:
    item: a ``RolloutState``, a ``RolloutWriter`` or a pytree of them, arrays
      (``jax.Array`` sharded or not, NumPy), typed PRNG keys and
      bool/int/float.
  """
  item: PyTree


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

  Example:
    >>> import os, tempfile, jax, numpy as np, orbax.checkpoint as ocp
    >>> import jrollout as jr
    >>> def build():
    ...   return jr.register(jr.init(num_envs=2, num_steps=3), "r")
    >>> state = jr.update_at(build(), 2, {"r": np.array([1.0, 2.0])})
    >>> m = ocp.CheckpointManager(os.path.join(tempfile.mkdtemp(), "run"))
    >>> _ = m.save(0, args=jr.RolloutSave(state)); m.wait_until_finished()
    >>> target = jax.eval_shape(build)              # shapes only, no arrays
    >>> m.restore(0, args=jr.RolloutRestore(target)).data["r"].tolist()
    [[0.0, 0.0], [0.0, 0.0], [1.0, 2.0]]
    >>> m.restore(0, args=jr.RolloutRestore())["counts"]   # no target: NumPy
    array([[0, 0, 1]], dtype=int32)
    >>> m.close()

  Attributes:
    item: the target pytree, or None.
    verify: check the checksums recorded at save time (see
      ``jr.restore_rollout``).
  """
  item: PyTree = None
  verify: bool = True


def save_rollout(directory: str | os.PathLike, item: PyTree, *,
                 overwrite: bool = False) -> None:
  """Saves a rollout (or any pytree holding rollouts) to ``directory``.

  The checkpoint is written beside ``directory`` (into
  ``directory.jrollout-new``), synced to disk (every file and directory
  entry), and only then put in ``directory``'s place, in one atomic
  exchange where the file system can, the old checkpoint deleted last. So
  ``directory`` holds the old checkpoint or the new one, whole, whatever
  happens to the save: a kill, a full disk, a crash of the machine. What
  an interrupted save leaves beside ``directory`` is cleaned up by the next
  save into it, and ``restore_rollout`` reads the old checkpoint meanwhile.
  Returns when the checkpoint is on disk. While it runs, the save holds
  the lock file ``directory.jrollout-lock``: a second save into the same
  directory fails at once (``CheckpointSaveError``, ``errno.EBUSY``).

  Every process of a multi-process run must call it, with the same
  directory; each writes its shards, and if any fails to, every process
  raises ``CheckpointSaveError``. The CRC-32 of every shard each process
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
      ``overwrite``. Missing parent directories are created.
    item: a ``RolloutState`` (mid-rollout included: the write counts and
      out-of-range counters are saved), a ``RolloutWriter`` (its queued
      writes are flushed first, so none is lost), or a pytree of those,
      arrays of numbers, bools or typed PRNG keys, and bool/int/float;
      its dicts' keys must be strings.
    overwrite: replace an existing ``directory``, which must then be a
      checkpoint written by jrollout (or an empty directory): anything else
      (a file, a directory holding other files, the current directory or
      one above it, the home directory, ``/``) is refused and nothing is
      deleted. The old checkpoint stays until the new one is on disk.

  Raises:
    CheckpointSaveError: a write failed (``errno``: ``ENOSPC`` no space
      left, ``EFBIG`` file too large, ``EACCES`` permission denied,
      ``EROFS`` read-only file system, ``EBUSY`` another save into
      ``directory`` is running, ...); ``directory`` is unchanged.
    ValueError: ``directory`` is ``""``, exists (and not ``overwrite``), is
      not a jrollout checkpoint (with ``overwrite``), or is below a file;
      two leaves would have the same name in the checkpoint; or a leaf is
      a deleted array (donated: save the state the donating call returned).
    TypeError: ``overwrite`` is not a bool, ``directory`` not a path, a
      leaf cannot be saved (a string, an object, an array of strings), or a
      dict key is not a string (named in the message).
  """
  fn = "save_rollout"
  overwrite = _checks.check_bool(fn, "overwrite", overwrite)
  path = paths.path(fn, directory)
  paths.check_parent(fn, path)

  def write(staging: str) -> None:
    with ocp.Checkpointer(RolloutCheckpointHandler(caller=fn)) as ckptr:
      ckptr.save(staging, args=RolloutSave(item))

  swap.replace(
      fn, path, lambda: paths.check_destination(
          fn, path, overwrite), write)


def restore_rollout(directory: str | os.PathLike,
                    item: PyTree = None, *, verify: bool = True) -> PyTree:
  """Restores what ``save_rollout`` saved, checked against ``item`` first.

  ``item``, the target, describes what to restore: the saved kind of state
  with the same fields, shapes, dtypes, E and T (a freshly built one, the
  state being replaced, or its ``jax.eval_shape``). Nothing is read until
  the whole target has been checked against the checkpoint's record, and
  the target is not changed. Each array is restored with the sharding of the
  target's leaf (so a state sharded with ``jr.shard`` comes back on the
  same mesh with the same sharding), NumPy leaves as NumPy.

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

  If a save into ``directory`` died between the two renames of its
  fallback swap (see ``save_rollout``), ``directory`` does not exist and the
  old checkpoint, renamed aside to ``directory.jrollout-old``, is restored.

  Example:
    >>> import os, tempfile, numpy as np, jrollout as jr
    >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "r")
    >>> state = jr.update_at(state, 1, {"r": np.array([5.0, 6.0])})
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> jr.save_rollout(path, state)
    >>> target = jr.register(jr.init(num_envs=2, num_steps=3), "r")  # fresh
    >>> restored = jr.restore_rollout(path, target)
    >>> restored.data["r"].tolist(), restored.counts.tolist()  # counts [K, T]
    ([[0.0, 0.0], [5.0, 6.0], [0.0, 0.0]], [[0, 1, 0]])
    >>> jr.restore_rollout(path)["data"]["r"][1]   # no target: NumPy in dicts
    array([5., 6.], dtype=float32)

  Args:
    directory: a checkpoint written by ``save_rollout``.
    item: the target: a ``RolloutState`` or pytree like the saved item,
      with array or ``jax.ShapeDtypeStruct`` leaves; or None.
    verify: check the checksums (the default). ``False`` skips the CRC-32
      pass over the bytes read (what it costs: docs/guides/checkpoints.md)
      and returns damaged bytes as they are, to salvage what a damaged
      checkpoint still holds; a file missing or too short for the bytes
      the checkpoint's index places in it still raises
      ``CorruptCheckpointError``.

  Returns:
    The restored pytree, with ``item``'s structure (nested dicts without
    a target).

  Raises:
    CorruptCheckpointError: ``directory`` is a damaged checkpoint (above).
    FileNotFoundError: ``directory`` does not exist.
    ValueError: ``directory`` is a file, an incomplete (interrupted)
      checkpoint, no checkpoint or not a jrollout one, or does not match
      ``item``: a RolloutState's E or T, its fields, or a field's (leaf's)
      shape or dtype. The message names the field, what the target expects
      and what the checkpoint holds.
    TypeError: ``verify`` is not a bool.
  """
  fn = "restore_rollout"
  verify = _checks.check_bool(fn, "verify", verify)
  path = swap.current(paths.path(fn, directory))
  paths.check_restorable(fn, path)
  with ocp.Checkpointer(RolloutCheckpointHandler(caller=fn)) as ckptr:
    try:
      return ckptr.restore(path, args=RolloutRestore(item, verify=verify))
    except ValueError as e:
      if str(e).startswith("Found incomplete checkpoint"):
        raise ValueError(paths.incomplete(fn, path)) from None
      raise

