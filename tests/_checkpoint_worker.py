"""Subprocesses of the checkpoint tests: ``python -m tests._checkpoint_worker
sharded PROCESS_ID NUM_PROCESSES PORT DIR`` (see ``sharded``) or ``example
hang|full ...`` (see ``example``)."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from tests import _helpers   # imports no JAX: start_worker sets XLA_FLAGS

T, E, OBS = 4, 16, 64   # an obs shard (4 x 2 x 64 float32) is 2 KiB: OCDBT
SPEC = {"obs": ((OBS,), np.float32), "done": ((), np.bool_),   # puts it in
        "action": ((), np.int32)}                  # a data file, not inline
WRITES = (0, 2, 2, T + 1)   # step 2 twice; T + 1 is dropped (traced step)


def fresh(jr):
  """The registered, zero-filled rollout (unsharded)."""
  state = jr.init(E, T)
  for key, (shape, dtype) in SPEC.items():
    state = jr.register(state, key, shape, dtype)
  return state


def _values(step):
  rng = np.random.default_rng(step)
  return {"obs": rng.standard_normal((E, OBS)).astype(np.float32),
          "done": rng.random(E) < 0.5,
          "action": rng.integers(0, 5, E).astype(np.int32)}


def write(jax, jr, state):
  """``WRITES`` applied with a traced step, values from ``_values``."""
  for i, step in enumerate(WRITES):
    state = jax.jit(jr.update_at)(state, step, _values(10 * i + step))
  return state


def expected(jax, jr):
  """``(state, model)``: the written rollout unsharded and its numpy model."""
  from tests import reference  # noqa: PLC0415 (imports JAX: after XLA_FLAGS)
  state, model = reference.make_pair(SPEC, E, T)
  for i, step in enumerate(WRITES):
    model.update_at(step, _values(10 * i + step))
  return write(jax, jr, state), model


def sharded(argv) -> None:
  """One of two ``jax.distributed`` processes of 4 fake CPU devices: they
  save a rollout sharded over all 8 to ``DIR/ckpt``, restore it onto that
  sharding and report each local shard's match with ``expected`` in
  ``DIR/out{PROCESS_ID}.json``."""
  jax, jr, mesh, (directory,) = _helpers.start_worker(argv)
  state = write(jax, jr, jr.shard(fresh(jr), mesh))
  path = os.path.join(directory, "ckpt")
  jr.save_rollout(path, state)
  restored = jr.restore_rollout(path, jr.shard(fresh(jr), mesh))
  _, model = expected(jax, jr)
  keys = sorted(model.storage)   # the rows of counts and out_of_range
  want = restored.replace(
      data=model.storage,
      counts=np.stack([model.counts[k] for k in keys]).astype(np.int32),
      out_of_range=np.array([model.oor[k] for k in keys], np.int32))
  mismatched = [
      jax.tree_util.keystr(path)
      for (path, arr), ref, leaf in zip(
          jax.tree_util.tree_leaves_with_path(restored),
          jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(state))
      if arr.sharding != leaf.sharding or not all(
          np.array_equal(np.asarray(shard.data), ref[shard.index])
          for shard in arr.addressable_shards)]
  out = os.path.join(directory, f"out{jax.process_index()}.json")
  with open(out, "w") as f:
    json.dump({"process_count": jax.process_count(),
               "device_count": jax.device_count(),
               "spec": str(restored.data["obs"].sharding.spec),
               "mismatched": mismatched}, f)
  jax.distributed.shutdown()


class _Hang:
  """An orbax commit future that never completes."""

  def result(self, timeout=None):
    del timeout
    print("hanging in save", flush=True)
    time.sleep(600)


def example(argv) -> None:
  """``examples.ppo_cartpole`` with ARGS. ``hang N ARGS``: its N-th save
  writes its data, prints ``hanging in save`` and never completes (the test
  kills it there); ``full N LIMIT ARGS``: files limited to LIMIT bytes (a
  full disk) from its N-th checkpoint on."""
  import resource  # noqa: PLC0415
  from examples import ppo_cartpole  # noqa: PLC0415 (JAX after XLA_FLAGS)
  from jrollout import _checkpoint  # noqa: PLC0415
  mode, at, calls = argv[0], int(argv[1]), []
  handler = _checkpoint.RolloutCheckpointHandler
  original = handler.async_save

  async def async_save(self, directory, *args, **kwargs):
    calls.append(directory)
    count = len(calls)   # the items of a checkpoint are saved concurrently
    if mode == "full" and count == 2 * at - 1:   # 2 items a checkpoint
      print(f"disk full from save {at}", flush=True)
      resource.setrlimit(resource.RLIMIT_FSIZE,
                         (int(argv[2]), resource.RLIM_INFINITY))
    futures = list(await original(self, directory, *args, **kwargs) or [])
    hang = mode == "hang" and count == at
    return futures + [_Hang()] if hang else futures

  handler.async_save = async_save
  ppo_cartpole.main(argv[3 if mode == "full" else 2:])


if __name__ == "__main__":
  {"sharded": sharded, "example": example}[sys.argv[1]](sys.argv[2:])
