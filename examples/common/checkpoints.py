"""A whole training run saved with orbax and resumed exactly
(``RunCheckpoint``), and the error that stops a run whose save failed."""

from __future__ import annotations

import atexit
import contextlib
import errno
import gc
import logging
import os
import sys

import numpy as np
import orbax.checkpoint as ocp

import jrollout as jr
from examples.common import cli


class RunCheckpoint:
  """Saves a whole run with orbax and resumes it exactly.

  Each checkpoint, numbered by the updates done, holds the runner (the
  parameters, optimiser state, env state, rollout and PRNG key of every
  seed) as ``jr.RolloutSave``, the metrics history so far, and the
  settings. An ``ocp.CheckpointManager`` writes them asynchronously (the
  next chunk runs meanwhile) into temporary directories renamed when
  complete, keeps the last ``KEEP``, and resumes from the latest complete
  one that verifies. Checkpoints are taken at chunk ends, once
  ``checkpoint_every`` updates have passed since the last, and after the
  last update.

  A checkpoint damaged after it was written (``jr.CorruptCheckpointError``:
  a leaf whose bytes differ from their checksum, a file missing or cut
  short; or a settings item that cannot be read) is reported on stderr
  with its update and what is damaged, moved aside to ``<update>.damaged``
  in the same directory (never deleted), and the next older checkpoint is
  tried, down to starting afresh.

  A save that fails (a full disk, a file-size limit, no permission:
  ``jr.CheckpointSaveError`` or another ``OSError``, seen when the next
  save starts or at ``close``) stops the run with ``CheckpointFailed``: one
  line naming the directory, the update and the cause. Orbax never renames
  a failed save into place, so the last complete checkpoint is the latest
  one, and a rerun of the same command once the cause is fixed resumes
  from it.
  """

  IGNORED = cli.HOST_ONLY   # may change between the runs of one directory
  KEEP = 3   # checkpoints kept: a damaged latest one leaves older ones
  HISTORY_AXIS = 1   # metrics are [seeds, updates]: joined along updates
  CLEANUP_TMP = False   # leave an interrupted save's temporary directory

  def __init__(self, config):
    path = config.checkpoint_dir
    self._directory = path if "://" in path else os.path.abspath(path)
    if config.checkpoint_every < 1:
      raise ValueError(f"--checkpoint-every must be a positive number of "
                       f"updates, got {config.checkpoint_every}")
    self._every = config.checkpoint_every
    self._num_updates = config.num_updates
    self._settings = cli.settings(config, self.IGNORED)
    self._last = 0
    self._pending = None   # the update of the save in flight
    self._mngr = ocp.CheckpointManager(
        self._directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=self.KEEP, enable_async_checkpointing=True,
            cleanup_tmp_directories=self.CLEANUP_TMP))

  def resume(self, runner):
    """``(runner, history, updates done)`` of the latest checkpoint that
    verifies (the fresh runner, ``[]`` and 0 if there is none)."""
    for step in sorted(self._mngr.all_steps(), reverse=True):
      try:
        got = self._restore(step, runner)
      except (jr.CorruptCheckpointError, _DamagedSettings) as e:
        what = ("; ".join(e.problems)
                if isinstance(e, jr.CorruptCheckpointError) else str(e))
      else:
        self._say(f"resumed from {self._directory} at update {step}")
        self._last = step
        return got["runner"], [got["history"]], step
      _collect_quietly()   # outside the except block: orbax's reads freed
      self._set_aside(step, what)
    return runner, [], 0

  def _say(self, message: str) -> None:
    print(message, flush=True)

  def _restore(self, step: int, runner):
    try:
      settings = self._mngr.restore(step, args=ocp.args.Composite(
          settings=ocp.args.JsonRestore()))["settings"]
    except (ValueError, OSError) as e:   # JSON unreadable, file missing
      raise _DamagedSettings(f"its settings cannot be read ({e})") from None
    if settings != self._settings:
      diff = {k: (settings.get(k), v) for k, v in self._settings.items()
              if settings.get(k) != v}
      raise ValueError(
          f"--checkpoint-dir {self._directory}: its checkpoint at update "
          f"{step} was written with other settings ({{flag: (saved, now)}}: "
          f"{diff}); use another directory or the same flags")
    return self._mngr.restore(step, args=ocp.args.Composite(
        runner=jr.RolloutRestore(runner), history=jr.RolloutRestore()))

  def _set_aside(self, step: int, what: str) -> None:
    """Reports a damaged checkpoint (``what`` is damaged) on stderr and
    moves it aside."""
    path = os.path.join(self._directory, str(step))
    aside = f"{path}.damaged"
    n = 1
    while os.path.exists(aside):
      n += 1
      aside = f"{path}.damaged{n}"
    os.rename(path, aside)
    self._mngr.reload()
    print(f"--checkpoint-dir {self._directory}: the checkpoint at update "
          f"{step} is damaged: {what}; moved it to {aside}, trying the one "
          "before", file=sys.stderr, flush=True)

  def save(self, done_updates: int, runner, history) -> None:
    """Starts an asynchronous save if one is due (see the class), once
    the previous one is complete; ``CheckpointFailed`` if either fails."""
    if (done_updates - self._last < self._every
        and done_updates < self._num_updates):
      return
    metrics = {k: np.concatenate([h[k] for h in history],
                                 axis=self.HISTORY_AXIS)
               for k in history[0]}
    self._wait()
    self._pending = done_updates
    self._stopping_on_failure(
        self._mngr.save, done_updates, args=ocp.args.Composite(
            runner=jr.RolloutSave(runner), history=jr.RolloutSave(metrics),
            settings=ocp.args.JsonSave(self._settings)))
    self._last = done_updates

  def _wait(self) -> None:
    """Waits for the save in flight; ``CheckpointFailed`` if it failed."""
    if self._mngr is not None:   # None: stopped by a failed save
      self._stopping_on_failure(self._mngr.wait_until_finished)

  def _stopping_on_failure(self, call, *args, **kwargs) -> None:
    """``call(*args, **kwargs)``; ``CheckpointFailed`` if it raised an
    ``OSError``, raised outside the ``except`` block once the manager is
    dropped and the failed save's garbage collected (``_collect_quietly``),
    so that the run's last line on stderr is its reason (``_quiet_exit``
    keeps it last). Orbax's own error logs, printed as the save failed,
    stay."""
    try:
      call(*args, **kwargs)
      return
    except OSError as e:
      failed = self._failed(e)
    _collect_quietly()
    atexit.register(_quiet_exit)
    raise failed

  def _failed(self, error: OSError) -> CheckpointFailed:
    """The error that stops the run after the save in flight failed; the
    manager is closed and dropped (its failed futures with it)."""
    mngr, self._mngr = self._mngr, None
    with contextlib.suppress(Exception):
      mngr.close()
    kept = "none"
    with contextlib.suppress(Exception):
      mngr.reload()
      latest = mngr.latest_step()
      kept = "none" if latest is None else f"update {latest}"
    if error.errno:
      cause = (f"{error.strerror} "
               f"({errno.errorcode.get(error.errno, error.errno)})")
    else:
      cause = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return CheckpointFailed(
        f"--checkpoint-dir {self._directory}: saving the checkpoint at "
        f"update {self._pending} failed: {cause}; the last complete "
        f"checkpoint ({kept}) is kept: fix the cause (free space) and rerun "
        "the same command to resume from it")

  def close(self) -> None:
    """Waits for the last save to be complete (``CheckpointFailed`` if it
    failed)."""
    self._wait()
    if self._mngr is not None:
      self._mngr.close()


def _collect_quietly() -> None:
  """Collects the garbage of a failed orbax call without its reports.

  A failed orbax save or restore leaves the tasks it started beside the
  one that failed: asyncio logs each task whose exception was never
  retrieved, and Python reports each read coroutine whose close raised
  ("Exception ignored in ..."), with TensorStore's details, whenever they
  are collected. The example has already reported the failure in one line,
  so it collects them here with the ``asyncio`` logger off and
  ``sys.unraisablehook`` a no-op, for this collection alone. An
  application's choice: jrollout itself installs no hooks or filters.
  """
  log = logging.getLogger("asyncio")
  disabled, log.disabled = log.disabled, True
  hook, sys.unraisablehook = sys.unraisablehook, lambda unraisable: None
  try:
    gc.collect()
  finally:
    log.disabled = disabled
    sys.unraisablehook = hook


def _quiet_exit() -> None:
  """At the exit of a run stopped by a failed save, after its reason was
  printed: stderr (fd 2) goes to /dev/null. What orbax's failed save left
  behind and the garbage collector missed (an abandoned task, a coroutine
  never awaited) is collected as the interpreter shuts down, after the
  atexit callbacks, and would report itself below the reason."""
  sys.stderr.flush()
  os.dup2(os.open(os.devnull, os.O_WRONLY), 2)


class CheckpointFailed(SystemExit):
  """A run's checkpoint could not be saved: the run stops.

  A ``SystemExit``, so that the command prints its one-line message on
  stderr, without a traceback, and exits with status 1.
  """


class _DamagedSettings(ValueError):
  """A checkpoint's settings item cannot be read."""
