"""Saving and restoring a W2 rollout, next to plain NumPy files.

checkpoint_save_W2: ``jr.save_rollout`` (orbax, with jrollout's record,
checksums and syncs) vs ``np.save`` of the same arrays, one ``.npy`` per
array, with and without an ``fsync`` of each file (``save_rollout`` syncs
every file and directory entry). Every call writes a new directory and
deletes it, so the times include creating files.

checkpoint_restore_W2: ``jr.restore_rollout`` (with and without
``verify``, the CRC-32 of every shard and the file sizes) vs ``np.load`` of
each file; the files are in the page cache. Both rows also report MB/s.
No target: orbax's fixed costs (a checkpointer, metadata files, the
temporary directory and the rename) dominate small states. Needs the
``checkpoint`` extra (orbax-checkpoint).
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import tempfile

import jax
import numpy as np

import jrollout as jr
from benchmarks import harness as h
from benchmarks import workloads as wl

NP_SAVE, NP_LOAD = "np.save, one file per array", "np.load, one file per array"


def _setup(config: h.Config):
  try:
    import orbax.checkpoint  # noqa: F401, PLC0415 - the checkpoint extra.
  except ImportError as err:
    raise h.Skip("needs the checkpoint extra (orbax-checkpoint)") from err
  w = wl.get("W2", config.quick)
  state = wl.full_state(w, wl.rollout(w))
  host = {str(i): np.asarray(a)
          for i, a in enumerate(jax.tree_util.tree_leaves(state))}
  root = tempfile.mkdtemp(prefix="jrollout-bench-")
  atexit.register(shutil.rmtree, root, ignore_errors=True)
  return state, host, root


_COUNTER = itertools.count()


def _fresh(root: str) -> str:
  """A new path under ``root`` (each save writes a new directory)."""
  return os.path.join(root, str(next(_COUNTER)))


def _np_save(host, path: str, sync: bool) -> None:
  os.mkdir(path)
  for name, a in host.items():
    with open(os.path.join(path, name + ".npy"), "wb") as f:
      np.save(f, a)
      if sync:
        f.flush()
        os.fsync(f.fileno())
  if sync:
    fd = os.open(path, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)


def _save_build(config: h.Config) -> list[h.Impl]:
  state, host, root = _setup(config)

  def jr_save():
    def run():
      path = _fresh(root)
      jr.save_rollout(path, state)
      shutil.rmtree(path)
    return run

  def np_save(sync: bool):
    def setup():
      def run():
        path = _fresh(root)
        _np_save(host, path, sync)
        shutil.rmtree(path)
      return run
    return setup

  return [h.Impl("jr.save_rollout", jr_save, "jrollout"),
          h.Impl(NP_SAVE, np_save(False), "numpy"),
          h.Impl(NP_SAVE + " + fsync", np_save(True), "numpy")]


def _restore_build(config: h.Config) -> list[h.Impl]:
  state, host, root = _setup(config)
  saved, npy = os.path.join(root, "orbax"), os.path.join(root, "npy")
  jr.save_rollout(saved, state)
  _np_save(host, npy, sync=False)

  def jr_restore(**kwargs):
    def setup():
      return lambda: jax.block_until_ready(
          jr.restore_rollout(saved, state, **kwargs))
    return setup

  def np_load():
    return lambda: [np.load(os.path.join(npy, name + ".npy"))
                    for name in host]

  def values(out):   # the restored arrays, in leaf order
    leaves = (jax.tree_util.tree_leaves(out) if isinstance(out, jr.RolloutState)
              else out)
    return {str(i): a for i, a in enumerate(leaves)}

  return [h.Impl("jr.restore_rollout", jr_restore(), "jrollout", values),
          h.Impl("jr.restore_rollout(verify=False)", jr_restore(verify=False),
                 "jrollout", values),
          h.Impl(NP_LOAD, np_load, "numpy", values)]


def _megabytes(config: h.Config) -> float:
  w = wl.get("W2", config.quick)
  return w.nbytes / 1e6


MEASUREMENTS = [
    h.Measurement(
        name="checkpoint_save_W2",
        description=("save a complete W2 rollout to a new directory (then "
                     "delete it)"),
        build=_save_build, baseline=NP_SAVE + " + fsync", max_rounds=5,
        work=_megabytes, work_unit="MB"),
    h.Measurement(
        name="checkpoint_restore_W2",
        description="restore a saved W2 rollout (files in the page cache)",
        build=_restore_build, baseline=NP_LOAD, max_rounds=5,
        work=_megabytes, work_unit="MB"),
]
