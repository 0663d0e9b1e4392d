"""Why a save failed, in one line: ``CheckpointSaveError``.

``save_error`` turns a failed write (an ``OSError``, or TensorStore's
``ValueError`` holding the operating system's error code) into a
``CheckpointSaveError`` whose ``errno`` says why, and ``first_line`` cuts any
TensorStore error to its first line; ``quiet_failed_writes`` drops orbax's
logs of the same failure. In a multi-process save ``agree`` tells every
process whether any failed, at the same point, so that all raise there
instead of waiting for the others at orbax's next barrier.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import re
import sys
import threading
import traceback
from typing import Any

import jax

_OS_CODE = re.compile(r"os_error_code='?(\d+)")   # in TensorStore's errors
_AGREE_TIMEOUT_MS = 3_600_000   # how long a process waits for the others


class CheckpointSaveError(OSError):
  """A checkpoint could not be written; what was at its path is unchanged.

  Raised by ``jr.save_rollout`` when a write fails, with ``errno`` saying
  why: ``ENOSPC`` (no space left on the device), ``EDQUOT`` (disk quota),
  ``EFBIG`` (a file-size limit), ``EACCES`` / ``EPERM`` (permission
  denied), ``EROFS`` (a read-only file system), ``EBUSY`` (another save
  into the same directory is running), or what the operating system
  reported. The message names the function, the directory and the cause
  in one line. The checkpoint that was at the directory, if any, is
  unchanged, and nothing of the failed save is left behind. Raised by
  ``jr.RolloutSave`` too, in an ``ocp.CheckpointManager`` when it waits
  for the save (the step's directory is then orbax's temporary one, never
  renamed into place).

  Example:
    >>> import fcntl, os, tempfile, numpy as np, jrollout as jr
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> with open(path + ".jrollout-lock", "w") as lock:
    ...   fcntl.flock(lock, fcntl.LOCK_EX)     # as a running save holds it
    ...   try:
    ...     jr.save_rollout(path, {"x": np.zeros(3)})
    ...   except jr.CheckpointSaveError as e:
    ...     print(e)
    save_rollout: cannot save ...ckpt: another save into it is running
    (a process holds ...ckpt.jrollout-lock) (EBUSY); nothing was written there
    >>> os.path.exists(path)
    False

  Attributes:
    errno: the operating system's error code (``errno.ENOSPC``, ...).
    strerror: the cause, in words.
    filename: the checkpoint's directory.
    fn: the function that failed (``save_rollout``, ``RolloutSave``).
  """

  def __init__(self, fn: str, directory: str, code: int, cause: str,
               outcome: str = ""):
    super().__init__(code, cause, directory)
    self.fn, self.outcome = fn, outcome

  def __str__(self) -> str:
    name = errno.errorcode.get(self.errno or 0, str(self.errno))
    return (f"{self.fn}: cannot save {self.filename}: {self.strerror} "
            f"({name})" + (f"; {self.outcome}" if self.outcome else ""))

  def __reduce__(self):
    return type(self), (self.fn, self.filename, self.errno, self.strerror,
                        self.outcome)


def first_line(error: BaseException, limit: int = 200) -> str:
  """The first line of an error's message, without TensorStore's spec."""
  text = str(error).split("\n", 1)[0].split(" See full TensorStore", 1)[0]
  text = text.split(" [tensorstore_spec=", 1)[0]
  return text if len(text) <= limit else text[:limit] + "..."


def cause_of(error: BaseException) -> tuple[int, str] | None:
  """``(errno, cause in words)`` of a failed write: an ``OSError`` with an
  error code, or TensorStore's error holding one, anywhere in ``error``'s
  chain; None for anything else."""
  seen: set[int] = set()
  chain: BaseException | None = error
  while chain is not None and id(chain) not in seen:
    seen.add(id(chain))
    if isinstance(chain, CheckpointSaveError) and chain.errno:
      return chain.errno, chain.strerror or os.strerror(chain.errno)
    if isinstance(chain, OSError) and chain.errno:
      where = f": {chain.filename}" if chain.filename else ""
      return chain.errno, (chain.strerror or os.strerror(chain.errno)) + where
    found = _OS_CODE.search(str(chain))
    if found:
      code = int(found.group(1))
      return code, os.strerror(code)
    chain = chain.__cause__ or chain.__context__
  return None


def save_error(fn: str, directory: str, error: BaseException,
               outcome: str = "") -> CheckpointSaveError | None:
  """``error`` as a ``CheckpointSaveError`` naming ``fn`` and
  ``directory``, or None if it is no failed write (see ``cause_of``)."""
  found = cause_of(error)
  if found is None:
    return None
  return CheckpointSaveError(fn, directory, *found, outcome)


# ------------------------------------------------- orbax's log of a failure

_INSTALLED = threading.Lock()
_FILTERS: list[logging.Filter] = []


class _DropFailedWrites(logging.Filter):
  """Drops the error logs, with traceback, of an orbax write that failed
  for a reason of the operating system (``cause_of``): orbax's own (on the
  ``absl`` logger), and asyncio's "Task exception was never retrieved" of
  the sibling writes that orbax started with the first and no longer
  awaits once it failed (on the ``asyncio`` logger, when the tasks are
  collected, possibly after the caller has reported the error). orbax raises the
  first failure to its caller, where jrollout reports it as a
  ``CheckpointSaveError``; the rest is the same cause again."""

  def filter(self, record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    if (record.levelno < logging.ERROR or error is None
        or not _from_orbax(record.pathname, error)):
      return True
    return cause_of(error) is None


def _from_orbax(pathname: str, error: BaseException) -> bool:
  """Whether a log record's call site or its error's traceback is
  orbax's."""
  return "orbax" in pathname or any(
      "orbax" in frame.f_code.co_filename
      for frame, _ in traceback.walk_tb(error.__traceback__))


def _abandoned(unraisable: Any) -> bool:
  """Whether an unraisable error is a write abandoned after one failed:
  orbax closes its event loop when the first write fails, and
  TensorStore's callbacks of the others then find it closed."""
  return (isinstance(unraisable.exc_value, RuntimeError)
          and str(unraisable.exc_value) == "Event loop is closed")


def quiet_failed_writes() -> None:
  """Drops, from now on, the logs of orbax's failed writes
  (``_DropFailedWrites`` on the ``absl`` and ``asyncio`` loggers) and the
  errors that the writes orbax abandoned raise when they finish
  (``_abandoned``): noise around the one error the
  caller gets. Nothing else is dropped. Installed once."""
  with _INSTALLED:
    if _FILTERS:
      return
    _FILTERS.append(_DropFailedWrites())
    for name in ("absl", "asyncio"):
      logging.getLogger(name).addFilter(_FILTERS[0])
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
      if not _abandoned(unraisable):
        previous(unraisable)

    sys.unraisablehook = hook


# ---------------------------------------------------- several processes

_ROUNDS: collections.Counter[str] = collections.Counter()
_ROUNDS_LOCK = threading.Lock()


def agree(fn: str, directory: str, phase: str,
          error: BaseException | None) -> None:
  """Raises on every process if any failed at ``phase`` of a save.

  Each process publishes whether it failed (``error``) in the
  coordination service's key-value store under ``directory`` and
  ``phase``, then reads every other process's word. A process that failed
  raises its own ``error``; the others raise a ``CheckpointSaveError``
  naming the first process that failed and its cause. With one process,
  this raises ``error`` if set.

  Every process must call it for the same saves in the same order; the
  keys are numbered per ``(directory, phase)``, so that saves of other
  directories may run meanwhile (the items of an ``ocp.args.Composite``).
  """
  if jax.process_count() == 1:
    if error is not None:
      raise error
    return
  from orbax.checkpoint import multihost  # noqa: PLC0415 (only with several)
  client = multihost.get_jax_distributed_client()
  with _ROUNDS_LOCK:
    _ROUNDS[f"{directory}|{phase}"] += 1
    key = f"jrollout/{phase}/{_ROUNDS[f'{directory}|{phase}']}/{directory}"
  mine = ""
  if error is not None:
    found = cause_of(error) or (errno.EIO, f"{type(error).__name__}: "
                                f"{first_line(error)}")
    mine = f"{found[0]} {found[1]}"
  client.key_value_set(f"{key}/{jax.process_index()}", mine or "ok")
  failed = []
  for i in range(jax.process_count()):
    word = (mine or "ok") if i == jax.process_index() else (
        client.blocking_key_value_get(f"{key}/{i}", _AGREE_TIMEOUT_MS))
    if word != "ok":
      failed.append((i, word))
  if error is not None:
    raise error
  if failed:
    i, word = failed[0]
    code, cause = word.split(" ", 1)
    raise CheckpointSaveError(fn, directory, int(code),
                              f"process {i} failed: {cause}")
