"""Replacing a checkpoint without ever losing it: ``save_rollout``'s swap.

``replace`` takes the lock ``<path>.jrollout-lock`` (``locked``), undoes what
an interrupted save left (``recover``), has the new checkpoint written into
``<path>.jrollout-new`` and synced (``sync_tree``), and puts it in ``path``'s
place (``install``): one atomic exchange where the file system can
(``exchange``), else two renames through ``<path>.jrollout-old``, which a
restore then reads (``current``); the old checkpoint is deleted last. The
protocol and how it is tested: docs/guides/checkpoints.md, "Faults lose no
checkpoint".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import contextlib
import ctypes
import errno
import os
import shutil
import socket
import time

import jax

from jrollout._checkpoint.errors import agree
from jrollout._checkpoint.errors import CheckpointSaveError
from jrollout._checkpoint.errors import save_error
from jrollout._checkpoint.paths import leftovers
from jrollout._checkpoint.paths import LOCK
from jrollout._checkpoint.paths import NEW
from jrollout._checkpoint.paths import OLD

try:
  import fcntl
except ImportError:   # not POSIX (Windows): saves are not locked there
  fcntl = None  # type: ignore[assignment]


# ----------------------------------------------------------- the renames

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
# What renameat2 fails with where it or the exchange is not supported.
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}


def _load_renameat2() -> Callable[..., int] | None:
  try:
    fn = ctypes.CDLL(None, use_errno=True).renameat2
  except (OSError, AttributeError):   # not glibc 2.28+ (macOS, musl)
    return None
  fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
                 ctypes.c_char_p, ctypes.c_uint]
  fn.restype = ctypes.c_int
  return fn


_RENAMEAT2 = _load_renameat2()


def exchange(a: str, b: str) -> bool:
  """Swaps the directories ``a`` and ``b`` atomically (``renameat2`` with
  ``RENAME_EXCHANGE``: Linux 3.15+ on ext4, xfs, btrfs, tmpfs); False
  (nothing done) where the system or the file system cannot."""
  if _RENAMEAT2 is None:
    return False
  if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b),
                _RENAME_EXCHANGE) == 0:
    return True
  code = ctypes.get_errno()
  if code in _UNSUPPORTED:
    return False
  raise OSError(code, os.strerror(code), a, None, b)


def _fsync(where: str, directory: bool = False) -> None:
  fd = os.open(where, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def sync_tree(root: str) -> None:
  """Syncs every file below ``root``, then every directory (their entries),
  bottom up, ``root`` last."""
  for here, _, files in os.walk(root, topdown=False):
    for name in files:
      _fsync(os.path.join(here, name))
    _fsync(here, directory=True)


def _remove(where: str) -> None:
  if os.path.isdir(where) and not os.path.islink(where):
    shutil.rmtree(where)
  else:
    os.remove(where)


def install(path: str) -> None:
  """Puts the synced ``<path>.jrollout-new`` in ``path``'s place (see the
  module's docstring): by ``exchange``, else by renaming ``path`` aside
  to ``<path>.jrollout-old`` and the new one in; the parent directory is
  synced, and the old checkpoint deleted last."""
  parent, new, old = os.path.dirname(path), path + NEW, path + OLD
  if not os.path.lexists(path):
    os.rename(new, path)
    _fsync(parent, directory=True)
    return
  if exchange(new, path):   # path is the new one, `new` the old one
    _fsync(parent, directory=True)
    shutil.rmtree(new, ignore_errors=True)
    return
  os.rename(path, old)
  try:
    os.rename(new, path)
  except BaseException:
    os.rename(old, path)
    raise
  _fsync(parent, directory=True)
  shutil.rmtree(old, ignore_errors=True)


def recover(path: str) -> None:
  """Undoes what an interrupted save into ``path`` left: the old checkpoint
  put back if it was renamed aside and the new one never came (else
  deleted), the unfinished new one deleted. Call with the lock held."""
  parent, old = os.path.dirname(path), path + OLD
  changed = False
  if os.path.lexists(old):
    if os.path.lexists(path):
      _remove(old)          # the new one is in place: the old one is garbage
    else:
      os.rename(old, path)  # killed between the renames: the old one back
    changed = True
  for name in leftovers(path):
    _remove(os.path.join(parent, name))
    changed = True
  if changed:
    _fsync(parent, directory=True)


def _snapshot(path: str) -> list[tuple[str, int, int]]:
  """``(file, size, mtime)`` below the leftovers of ``path``."""
  parent, found = os.path.dirname(path), []
  for name in leftovers(path):
    for here, _, files in os.walk(os.path.join(parent, name)):
      for file in files:
        with contextlib.suppress(OSError):
          stat = os.stat(os.path.join(here, file))
          found.append((os.path.join(here, file), stat.st_size,
                        stat.st_mtime_ns))
  return sorted(found)


def settle(path: str, quiet_s: float = 0.1, limit_s: float = 5.0) -> None:
  """Waits (up to ``limit_s``) until nothing below the leftovers of a
  failed save into ``path`` has changed for ``quiet_s``: the writes orbax
  abandoned when the first one failed go on in TensorStore's threads, and
  would recreate what ``recover`` deletes."""
  deadline = time.monotonic() + limit_s
  before = _snapshot(path)
  while time.monotonic() < deadline:
    time.sleep(quiet_s)
    now = _snapshot(path)
    if now == before:
      return
    before = now


def current(path: str) -> str:
  """Where the checkpoint of ``path`` is: ``path``, or the old one renamed
  aside by a save interrupted between its two renames."""
  if not os.path.lexists(path) and os.path.isdir(path + OLD):
    return path + OLD
  return path


# ------------------------------------------------------------- the lock


@contextlib.contextmanager
def locked(fn: str, path: str) -> Iterator[None]:
  """Holds ``<path>.jrollout-lock`` (an exclusive ``flock``) while saving;
  ``CheckpointSaveError`` (``EBUSY``) if another save holds it. The kernel
  releases the lock of a process that dies, so a killed save never blocks
  the next one. The file is deleted on release; a lock taken on a file
  that its holder deleted meanwhile is dropped and taken again on the new
  file. Without ``fcntl`` (not POSIX), nothing is locked."""
  if fcntl is None:
    yield
    return
  lock = path + LOCK
  for _ in range(100):
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.pread(fd, 256, 0).decode(errors="replace").strip()
      os.close(fd)
      raise CheckpointSaveError(
          fn, path, errno.EBUSY, f"another save into it is running "
          f"({holder or 'a process'} holds {lock})") from None
    except BaseException:
      os.close(fd)
      raise
    try:
      held = os.fstat(fd)
      now = os.stat(lock)
      if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
        break
    except FileNotFoundError:
      pass
    os.close(fd)   # deleted by the save that held it: lock the new one
  else:
    raise CheckpointSaveError(fn, path, errno.EBUSY,
                              f"other saves keep taking {lock}")
  try:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}"
              .encode(), 0)
    yield
  finally:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(lock)
    os.close(fd)


# -------------------------------------------------------------- a save


def _outcome(path: str) -> str:
  if os.path.lexists(path) or os.path.lexists(path + OLD):
    return "the checkpoint there is unchanged"
  return "nothing was written there"


def _attempt(step: Callable[[], object]) -> Exception | None:
  """Runs ``step``; returns what it raised (an ``Exception``), or None."""
  try:
    step()
  except Exception as e:
    return e
  return None


def _start(fn: str, path: str, stack: contextlib.ExitStack) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  stack.enter_context(locked(fn, path))
  recover(path)


def _write(path: str, write: Callable[[str], None]) -> None:
  write(path + NEW)
  sync_tree(path + NEW)


def replace(fn: str, path: str, check: Callable[[], None],
            write: Callable[[str], None]) -> None:
  """Saves into ``path`` as the module's docstring says: ``check()``
  (with the lock held and leftovers recovered: may raise to refuse the
  save), then ``write(<path>.jrollout-new)``, sync, install.

  In a multi-process save every process writes its shards into the same
  ``<path>.jrollout-new``; only process 0 locks, recovers and installs, and
  ``errors.agree`` tells the others when it failed.

  Raises:
    CheckpointSaveError: a file operation failed on any process (disk
      full, file too large, no permission, read-only file system, another
      save into ``path`` running); what was at ``path`` is unchanged, and
      the partial new checkpoint deleted.
    Whatever ``check`` and ``write`` raise otherwise.
  """
  primary = jax.process_index() == 0
  cleaned = False
  try:
    with contextlib.ExitStack() as stack:
      agree(fn, path, "start", _attempt(
          lambda: _start(fn, path, stack) if primary else None))
      try:
        check()
        agree(fn, path, "written", _attempt(lambda: _write(path, write)))
        agree(fn, path, "installed", _attempt(
            lambda: install(path) if primary else None))
      except BaseException:
        cleaned = True
        if primary:   # the partial new checkpoint, before the lock goes
          with contextlib.suppress(OSError):
            settle(path)
            recover(path)
        raise
  except BaseException as e:
    if cleaned:   # every process raises once the lock is released
      agree(fn, path, "cleaned", None)
    converted = (save_error(fn, path, e, _outcome(path))
                 if isinstance(e, Exception) else None)
    if converted is None:
      raise
    raise converted from None
