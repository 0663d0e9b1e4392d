"""Tests of jrollout._checkpoint: exact round trips, checked restores, crashes.

Every restored state is compared with the plain-numpy model of
tests/reference.py (storage, dtypes, per-step write counts, out-of-range
counters), then finished and batched next to the model, under jit and not.
"""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time

from hypothesis import given
from hypothesis import strategies as st
import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jrollout as jr
from jrollout.compat import ExperienceBuffer
from tests import _checkpoint_worker as worker
from tests import reference
from tests._helpers import assert_same_leaves
from tests._helpers import envs_mesh
from tests._helpers import child_env
from tests._helpers import free_port
from tests._helpers import ROOT
from tests.conftest import TRANSFORMS

DTYPES = [jnp.bool_, jnp.uint8, jnp.int8, jnp.int32, jnp.float16,
          jnp.bfloat16, jnp.float32]


def _write(state, ref, step, values, transform=jax.jit):
  """One ``update_at`` on the state and on the model (a dropped write if
  ``step`` is outside [0, T): only possible with a traced step)."""
  ref.update_at(step, values)
  return transform(jr.update_at)(state, step, values)


def _half_written(spec, rng, num_envs=3, num_steps=5, transform=jax.jit):
  """A rollout stopped mid-way: some steps written, one twice, one dropped."""
  state, ref = reference.make_pair(spec, num_envs, num_steps)
  for step in [0, 1, 1, num_steps + 2]:
    values = {k: reference.random_value(rng, (num_envs, *shape), dtype)
              for k, (shape, dtype) in spec.items()}
    state = _write(state, ref, step, values, transform if 0 <= step <
                   num_steps else jax.jit)
  return state, ref


def _finish(state, ref, rng, spec, steps, transform):
  for step in steps:
    values = {k: reference.random_value(rng, (state.num_envs, *shape), dtype)
              for k, (shape, dtype) in spec.items()}
    state = _write(state, ref, step, values, transform)
  return state


def test_public_api():
  for name in ("save_rollout", "restore_rollout", "RolloutSave",
               "RolloutRestore", "CorruptCheckpointError",
               "CheckpointSaveError"):
    assert name in jr.__all__ and getattr(jr, name).__doc__


# ----------------------------------------------------------- round trips


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_a_half_written_rollout_resumes_exactly(tmp_path, transition_spec,
                                                transform):
  """Saved mid-rollout (a step written twice, a write dropped), restored,
  finished: the same write-check failure, then the same batch."""
  state, ref = _half_written(transition_spec, np.random.default_rng(0),
                             transform=transform)
  jr.save_rollout(tmp_path / "ckpt", state)
  restored = jr.restore_rollout(tmp_path / "ckpt", _fresh(transition_spec))
  reference.assert_state_equals(restored, ref)
  assert_same_leaves(restored, state)
  with pytest.raises(jr.IncompleteRolloutError) as want:
    jr.make_batch(state)
  with pytest.raises(jr.IncompleteRolloutError) as got:
    jr.make_batch(restored)
  assert str(got.value) == str(want.value)
  done = _finish(restored, ref, np.random.default_rng(1), transition_spec,
                 [2, 3, 4], transform)
  orig = _finish(state, reference.make_pair(transition_spec)[1],
                 np.random.default_rng(1), transition_spec, [2, 3, 4],
                 transform)
  assert_same_leaves(done, orig)
  reference.assert_state_equals(done, ref)
  batch, after = transform(lambda s: jr.make_batch(s, check="off"))(done)
  for k, v in ref.make_batch().items():
    np.testing.assert_array_equal(np.asarray(batch[k]), v)
  reference.assert_state_equals(after, ref)


def _fresh(spec, num_envs=3, num_steps=5):
  return reference.make_pair(spec, num_envs, num_steps)[0]


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_a_complete_rollout_batches_as_the_original(tmp_path, transition_spec,
                                                    transform):
  rng = np.random.default_rng(2)
  state, ref = reference.make_pair(transition_spec, 4, 3)
  state = _finish(state, ref, rng, transition_spec, range(3), transform)
  jr.save_rollout(tmp_path / "ckpt", state)
  restored = jr.restore_rollout(tmp_path / "ckpt", _fresh(transition_spec,
                                                          4, 3))
  batch, after = transform(jr.make_batch)(restored)
  expected = ref.make_batch()
  for k in expected:
    np.testing.assert_array_equal(np.asarray(batch[k]), expected[k])
    assert batch[k].dtype == expected[k].dtype
  reference.assert_state_equals(after, ref)


def test_abstract_targets_restore_onto_the_default_device(tmp_path,
                                                          transition_spec):
  state, ref = _half_written(transition_spec, np.random.default_rng(3))
  jr.save_rollout(tmp_path / "ckpt", state)
  target = jax.eval_shape(lambda: _fresh(transition_spec))
  restored = jr.restore_rollout(tmp_path / "ckpt", target)
  reference.assert_state_equals(restored, ref)
  for leaf in jax.tree_util.tree_leaves(restored):
    assert isinstance(leaf, jax.Array)
    assert leaf.sharding.device_set == {jax.devices()[0]}


def test_empty_states_and_empty_keys(tmp_path):
  state = jr.init(2, 3)                    # counts [0, 3]: no bytes at all
  jr.save_rollout(tmp_path / "none", state)
  restored = jr.restore_rollout(tmp_path / "none", jr.init(2, 3))
  assert_same_leaves(restored, state)
  assert restored.counts.shape == (0, 3)
  with pytest.raises(ValueError, match=r"num_steps \(T\) is 3 in the "
                     r"checkpoint, the target expects 4"):
    jr.restore_rollout(tmp_path / "none", jr.init(2, 4))
  state = jr.register(jr.register(jr.init(2, 3), "z", (0, 4)), "x")
  state = jr.update_at(state, 1, {"z": jnp.zeros((2, 0, 4)),
                                  "x": jnp.ones(2)})
  jr.save_rollout(tmp_path / "zero", state)
  restored = jr.restore_rollout(tmp_path / "zero", jr.register(
      jr.register(jr.init(2, 3), "z", (0, 4)), "x"))
  assert_same_leaves(restored, state)


def test_stacked_states_and_whole_runners_round_trip(tmp_path):
  """A vmapped stack of rollouts inside a runner with keys and scalars."""
  def build(seed):
    state = jr.register(jr.register(jr.init(4, 3), "obs", (2,)), "done",
                        dtype=jnp.bool_)
    return jr.update_at(state, seed % 3, {
        "obs": jnp.full((4, 2), seed, jnp.float32),
        "done": jnp.ones(4, bool)})
  stack = jax.vmap(build)(jnp.arange(5))
  runner = {"rollout": stack, "key": jax.random.split(jax.random.key(1), 5),
            "params": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
            "update": 7, "lr": 0.5, "stop": False,
            "step": np.int32(3)}
  jr.save_rollout(tmp_path / "runner", runner)
  target = dict(runner, rollout=jax.vmap(build)(jnp.zeros(5, jnp.int32)),
                key=jax.random.split(jax.random.key(0), 5), update=0,
                lr=0.0, stop=True, step=np.int32(0))
  restored = jr.restore_rollout(tmp_path / "runner", target)
  assert_same_leaves(restored["rollout"], stack)
  assert_same_leaves(restored["key"], runner["key"])
  assert isinstance(restored["params"]["w"], np.ndarray)
  np.testing.assert_array_equal(restored["params"]["w"], runner["params"]["w"])
  assert (restored["update"], restored["lr"], restored["stop"]) == (7, 0.5,
                                                                   False)
  assert type(restored["update"]) is int and type(restored["stop"]) is bool
  assert restored["step"] == 3 and restored["step"].dtype == np.int32
  # The restored stack is usable under vmap like the original.
  counts = jax.vmap(jr.is_complete)(restored["rollout"])
  np.testing.assert_array_equal(counts, jax.vmap(jr.is_complete)(stack))


def test_without_a_target_leaves_come_back_as_saved_numpy(tmp_path):
  state = jr.update_at(jr.register(jr.init(2, 3), "obs", (2,)), 1,
                       {"obs": jnp.ones((2, 2))})
  tree = {"history": {"loss": np.arange(6, dtype=np.float32).reshape(2, 3),
                      "done": np.array([True, False])},
          "rollout": state, "update": 4, "seq": [np.int8(1), np.zeros(0)]}
  jr.save_rollout(tmp_path / "tree", tree)
  got = jr.restore_rollout(tmp_path / "tree")
  assert set(got) == {"history", "rollout", "update", "seq"}
  for name, value in tree["history"].items():
    assert got["history"][name].dtype == value.dtype
    np.testing.assert_array_equal(got["history"][name], value)
  assert got["update"] == 4 and isinstance(got["update"], np.ndarray)
  assert set(got["rollout"]) == {"data", "counts", "out_of_range"}
  np.testing.assert_array_equal(got["rollout"]["data"]["obs"],
                                np.asarray(state.data["obs"]))
  np.testing.assert_array_equal(got["rollout"]["counts"], [[0, 1, 0]])
  assert got["seq"]["0"] == 1 and got["seq"]["1"].shape == (0,)
  jr.save_rollout(tmp_path / "key", {"key": jax.random.key(0)})
  with pytest.raises(ValueError, match=r"leaf \['key'\] is a PRNG key"):
    jr.restore_rollout(tmp_path / "key")


_NAMES = st.text("abcdefgh_", min_size=1, max_size=4)


@st.composite
def _specs(draw):
  keys = draw(st.lists(_NAMES, min_size=0, max_size=4, unique=True))
  return {k: (tuple(draw(st.lists(st.integers(0, 3), max_size=2))),
              draw(st.sampled_from(DTYPES))) for k in keys}


@given(spec=_specs(), num_envs=st.integers(1, 4), num_steps=st.integers(1, 4),
       steps=st.lists(st.integers(-2, 6), max_size=8),
       seed=st.integers(0, 2**16))
def test_property_round_trips_of_random_rollouts(spec, num_envs, num_steps,
                                                 steps, seed):
  """Random keys, shapes, dtypes and write patterns (dropped writes too)."""
  rng = np.random.default_rng(seed)
  state, ref = reference.make_pair(spec, num_envs, num_steps)
  for step in steps:
    values = {k: reference.random_value(rng, (num_envs, *shape), dtype)
              for k, (shape, dtype) in spec.items()}
    state = _write(state, ref, step, values)
  with tempfile.TemporaryDirectory() as tmp:
    jr.save_rollout(os.path.join(tmp, "ckpt"), state)
    restored = jr.restore_rollout(os.path.join(tmp, "ckpt"),
                                  _fresh(spec, num_envs, num_steps))
  reference.assert_state_equals(restored, ref)
  assert_same_leaves(restored, state)
  np.testing.assert_array_equal(jr.is_complete(restored), ref.complete())


# ---------------------------------------------------------------- writer


def test_a_writer_is_flushed_before_saving_and_resumes(tmp_path,
                                                       transition_spec):
  rng = np.random.default_rng(4)
  state, ref = reference.make_pair(transition_spec, 3, 6)
  writer = jr.RolloutWriter(state, flush_every=100)
  for step in range(4):
    values = {k: reference.random_value(rng, (3, *shape), dtype)
              for k, (shape, dtype) in transition_spec.items()}
    writer.update_at(step, values)
    ref.update_at(step, values)
  assert writer.pending == 4
  jr.save_rollout(tmp_path / "writer", writer)
  assert writer.pending == 0          # flushed: none of the 4 steps is lost
  writer = jr.RolloutWriter(jr.restore_rollout(tmp_path / "writer",
                                               _fresh(transition_spec, 3, 6)))
  reference.assert_state_equals(writer.state, ref)
  for step in (4, 5):
    values = {k: reference.random_value(rng, (3, *shape), dtype)
              for k, (shape, dtype) in transition_spec.items()}
    writer.update_at(step, values)
    ref.update_at(step, values)
  batch = writer.make_batch()
  expected = ref.make_batch()
  for k in expected:
    np.testing.assert_array_equal(np.asarray(batch[k]), expected[k])


def test_a_writer_is_no_restore_target(tmp_path):
  state = jr.register(jr.init(2, 2), "x")
  jr.save_rollout(tmp_path / "ckpt", state)
  writer = jr.RolloutWriter(_fresh({"x": ((), jnp.float32)}, 2, 2))
  writer.update_at(0, {"x": jnp.ones(2)})
  with pytest.raises(TypeError, match=r"RolloutWriter.*writer\.state"):
    jr.restore_rollout(tmp_path / "ckpt", writer)
  assert writer.pending == 1


# ------------------------------------------------------ mismatched targets


def _saved(tmp_path):
  state = jr.register(jr.register(jr.init(4, 3), "obs", (2,)), "done",
                      dtype=jnp.bool_)
  state = jr.update_at(state, 0, {"obs": jnp.ones((4, 2))})
  jr.save_rollout(tmp_path / "ckpt", state)
  return state


def _target(num_envs=4, num_steps=3, obs=((2,), jnp.float32),
            done=((), jnp.bool_), **more):
  spec = {"obs": obs, "done": done, **more}
  return _fresh({k: v for k, v in spec.items() if v is not None}, num_envs,
                num_steps)


@pytest.mark.parametrize("target, match", [
    (_target(num_envs=8),
     (r"restore_rollout: the rollout: num_envs \(E\) is 4 in the checkpoint, "
      r"the target expects 8")),
    (_target(num_steps=5),
     r"num_steps \(T\) is 3 in the checkpoint, the target expects 5"),
    (_target(done=None),
     r"field 'done' is in the checkpoint but not registered in the target"),
    (_target(reward=((), jnp.float32)),
     r"field 'reward' is registered in the target but not in the checkpoint"),
    (_target(obs=((3,), jnp.float32)),
     (r"field 'obs' of the rollout: the checkpoint holds shape \(3, 4, 2\) "
      r"float32, the target expects shape \(3, 4, 3\) float32")),
    (_target(obs=((2,), jnp.bfloat16)),
     (r"field 'obs' of the rollout: the checkpoint holds shape \(3, 4, 2\) "
      r"float32, the target expects shape \(3, 4, 2\) bfloat16")),
    ({"rollout": _target()},
     (r"the target has a RolloutState at \['rollout'\]; the checkpoint has "
      r"none there")),
], ids=["E", "T", "extra-key", "missing-key", "shape", "dtype", "nesting"])
def test_mismatched_targets_are_refused_by_name(tmp_path, target, match):
  _saved(tmp_path)
  before = jax.tree_util.tree_map(np.asarray, target)
  with pytest.raises(ValueError, match=match):
    jr.restore_rollout(tmp_path / "ckpt", target)
  # Nothing changed: the target's arrays are alive and hold what they held.
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         jax.tree_util.tree_map(np.asarray, target), before)


def test_mismatched_pytree_leaves_are_named(tmp_path):
  tree = {"w": np.zeros((2, 3), np.float32), "step": 3}
  jr.save_rollout(tmp_path / "tree", tree)
  with pytest.raises(ValueError, match=r"leaf \['w'\]: the checkpoint holds "
                     r"shape \(2, 3\) float32, the target expects shape "
                     r"\(3, 2\) float32"):
    jr.restore_rollout(tmp_path / "tree", dict(tree, w=np.zeros((3, 2),
                                                                np.float32)))
  with pytest.raises(ValueError, match=r"leaf \['b'\] of the target is not in "
                     r"the checkpoint"):
    jr.restore_rollout(tmp_path / "tree", dict(tree, b=np.zeros(1)))
  with pytest.raises(ValueError, match=r"leaf \['step'\] of the checkpoint is "
                     r"not in the target"):
    jr.restore_rollout(tmp_path / "tree", {"w": tree["w"]})
  with pytest.raises(ValueError, match=r"leaf \['step'\].*int64.*float64"):
    jr.restore_rollout(tmp_path / "tree", dict(tree, step=3.0))
  with pytest.raises(TypeError, match=r"leaf \['f'\] is a str"):
    jr.save_rollout(tmp_path / "bad", {"f": "text"})
  assert not (tmp_path / "bad").exists()


def test_checkpoints_of_others_and_missing_ones_are_refused(tmp_path):
  state = _saved(tmp_path)
  with pytest.raises(ValueError, match="already exists"):
    jr.save_rollout(tmp_path / "ckpt", state)
  jr.save_rollout(tmp_path / "ckpt", state, overwrite=True)
  with pytest.raises(FileNotFoundError):
    jr.restore_rollout(tmp_path / "nothing", state)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(str(tmp_path / "plain"), {"x": np.ones(2)})
  with pytest.raises(ValueError, match="not written by jrollout"):
    jr.restore_rollout(tmp_path / "plain", {"x": np.ones(2)})


# ------------------------------------------------------ CheckpointManager


def test_a_checkpoint_manager_saves_steps_asynchronously(tmp_path):
  rng = np.random.default_rng(5)
  spec = {"obs": ((2,), jnp.float32), "a": ((), jnp.int32)}
  state, ref = reference.make_pair(spec, 2, 4)
  options = ocp.CheckpointManagerOptions(max_to_keep=2,
                                         enable_async_checkpointing=True)
  refs = {}
  with ocp.CheckpointManager(tmp_path / "run", options=options) as mngr:
    for step in range(4):
      values = {k: reference.random_value(rng, (2, *shape), dtype)
                for k, (shape, dtype) in spec.items()}
      state = _write(state, ref, step, values)
      mngr.save(step, args=ocp.args.Composite(
          rollout=jr.RolloutSave({"state": state, "key": jax.random.key(
              step)}), meta=ocp.args.JsonSave({"step": step})))
      refs[step] = jax.tree_util.tree_map(np.copy, ref.storage)
    mngr.wait_until_finished()
    assert mngr.all_steps() == [2, 3] and mngr.latest_step() == 3
    target = {"state": _fresh(spec, 2, 4), "key": jax.random.key(0)}
    got = mngr.restore(2, args=ocp.args.Composite(
        rollout=jr.RolloutRestore(target), meta=ocp.args.JsonRestore()))
  assert got["meta"] == {"step": 2}
  for k, v in refs[2].items():
    np.testing.assert_array_equal(np.asarray(got["rollout"]["state"].data[k]),
                                  v)
  np.testing.assert_array_equal(
      np.asarray(jr.write_counts(got["rollout"]["state"])["obs"].per_step),
      [1, 1, 1, 0])
  assert_same_leaves(got["rollout"]["key"], jax.random.key(2))


# ------------------------------------------------------------------- compat


def _buffer(spec, num_envs=3, num_steps=4, steps=(0, 1)):
  rng = np.random.default_rng(6)
  buf = ExperienceBuffer(num_envs, num_steps)
  ref = reference.NumpyBuffer(num_envs, num_steps)
  for key, (shape, dtype) in spec.items():
    buf.register_key(key, shape, dtype)
    ref.register(key, shape, dtype)
  for step in steps:
    for key, (shape, dtype) in spec.items():
      value = reference.random_value(rng, (num_envs, *shape), dtype)
      buf.update_data(key, step, value)
      ref.update_at(step, {key: value})
  return buf, ref


def test_experience_buffer_state_dict_round_trips(tmp_path, transition_spec):
  buf, ref = _buffer(transition_spec)
  sd = buf.state_dict()
  assert set(sd) == {"num_envs", "num_steps", "data", "counts",
                     "out_of_range"}
  assert (sd["num_envs"], sd["num_steps"]) == (3, 4)
  # Later writes donate the buffer's arrays; the state_dict keeps its own.
  buf.update_data("obs", 2, np.ones((3, 3), np.float32))
  np.testing.assert_array_equal(np.asarray(sd["data"]["obs"]),
                                ref.storage["obs"])
  # Through orbax.
  jr.save_rollout(tmp_path / "sd", sd)
  fresh, _ = _buffer(transition_spec, steps=())
  fresh.load_state_dict(jr.restore_rollout(tmp_path / "sd",
                                           fresh.state_dict()))
  reference.assert_state_equals(fresh.state, ref)
  # From numpy copies (as a torch user's pickled dict would come back).
  other, _ = _buffer(transition_spec, steps=())
  other.load_state_dict(jax.tree_util.tree_map(np.asarray, sd))
  reference.assert_state_equals(other.state, ref)
  # The loaded buffer finishes its rollout like the model.
  for step in (2, 3):
    for key, (shape, dtype) in transition_spec.items():
      value = reference.random_value(np.random.default_rng(step),
                                     (3, *shape), dtype)
      other.update_data(key, step, value)
      ref.update_at(step, {key: value})
  batch = other.make_dict()
  for k, v in ref.make_batch().items():
    np.testing.assert_array_equal(np.asarray(batch[k]), v)


def test_experience_buffer_state_dict_through_torch(tmp_path):
  torch = pytest.importorskip("torch")
  from jrollout.torch import to_torch  # noqa: PLC0415 (torch is optional)
  spec = {"obs": ((2,), jnp.float32), "action": ((), jnp.int32)}
  buf, ref = _buffer(spec)
  sd = buf.state_dict()
  tensors = {k: (v if isinstance(v, int) else to_torch(v, copy=True)
                 if not isinstance(v, dict) else
                 {n: to_torch(a, copy=True) for n, a in v.items()})
             for k, v in sd.items()}
  torch.save(tensors, tmp_path / "buf.pt")
  fresh, _ = _buffer(spec, steps=())
  fresh.load_state_dict(torch.load(tmp_path / "buf.pt"))
  reference.assert_state_equals(fresh.state, ref)


@pytest.mark.parametrize("change, match", [
    (lambda sd: sd.update(num_envs=5),
     (r"load_state_dict: the rollout: num_envs \(E\) is 5 in the state_dict, "
      r"the buffer expects 3")),
    (lambda sd: sd["data"].pop("action"),
     r"field 'action' is registered in the buffer but not in the state_dict"),
    (lambda sd: sd["data"].update(extra=np.zeros((4, 3), np.float32)),
     r"field 'extra' is in the state_dict but not registered in the buffer"),
    (lambda sd: sd["data"].update(obs=np.zeros((4, 3, 3), np.int32)),
     (r"field 'obs' of the rollout: the state_dict holds shape \(4, 3, 3\) "
      r"int32, the buffer expects shape \(4, 3, 3\) float32")),
    (lambda sd: sd.pop("counts"), r"the state_dict has no 'counts' entry"),
    (lambda sd: sd.update(more=1), r"unknown entry 'more'"),
], ids=["E", "missing", "extra", "dtype", "no-counts", "unknown"])
def test_load_state_dict_refuses_mismatches_and_changes_nothing(change,
                                                                 match):
  spec = {"obs": ((3,), jnp.float32), "action": ((), jnp.int32)}
  buf, ref = _buffer(spec)
  sd = jax.tree_util.tree_map(np.asarray, buf.state_dict())
  change(sd)
  with pytest.raises(ValueError, match=match):
    buf.load_state_dict(sd)
  reference.assert_state_equals(buf.state, ref)


# ------------------------------------------------------------------ sharded

D = 8


@pytest.mark.skipif(jax.device_count() < D, reason=f"needs {D} devices")
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_a_sharded_state_comes_back_with_its_sharding(tmp_path, transform):
  spec = {"obs": ((3,), jnp.float32), "done": ((), jnp.bool_)}
  state, ref = reference.make_pair(spec, 16, 4)
  rng = np.random.default_rng(7)
  mesh = envs_mesh(D)
  state = jr.shard(state, mesh)
  for step in (0, 2):
    values = {k: reference.random_value(rng, (16, *shape), dtype)
              for k, (shape, dtype) in spec.items()}
    state = _write(state, ref, step, values, transform)
  jr.save_rollout(tmp_path / "sharded", state)
  target = jr.shard(_fresh(spec, 16, 4), mesh)
  restored = jr.restore_rollout(tmp_path / "sharded", target)
  assert_same_leaves(restored, state)
  expected = NamedSharding(mesh, P(None, "envs"))
  assert restored.data["obs"].sharding.is_equivalent_to(expected, 3)
  reference.assert_state_equals(restored, ref)
  # The same checkpoint restores unsharded onto one device, too.
  single = jr.restore_rollout(tmp_path / "sharded", _fresh(spec, 16, 4))
  reference.assert_state_equals(single, ref)
  assert single.data["obs"].sharding.device_set == {jax.devices()[0]}


@pytest.mark.skipif(jax.device_count() < D, reason=f"needs {D} devices")
def test_two_processes_save_and_restore_a_sharded_state(tmp_path):
  """2 processes x 4 devices save one checkpoint and restore it; this
  process (8 devices) restores the same checkpoint and checks it too."""
  port = str(free_port())
  env = child_env()
  procs = [subprocess.Popen(
      [sys.executable, "-m", "tests._checkpoint_worker", "sharded", str(i),
       "2", port, str(tmp_path)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True) for i in range(2)]
  logs = []
  for proc in procs:
    try:
      logs.append(proc.communicate(timeout=240)[0])
    except subprocess.TimeoutExpired:
      for p in procs:
        p.kill()
      pytest.fail("the two processes did not finish in 240 s (a hang?)")
  if any(p.returncode for p in procs):
    pytest.fail("a worker failed:\n" + "\n".join(log[-3000:] for log in logs))
  for i in range(2):
    got = json.loads((tmp_path / f"out{i}.json").read_text())
    assert got == {"process_count": 2, "device_count": D,
                   "spec": str(P(None, "envs")), "mismatched": []}
  state, ref = worker.expected(jax, jr)
  restored = jr.restore_rollout(tmp_path / "ckpt",
                                jr.shard(worker.fresh(jr), envs_mesh(D)))
  reference.assert_state_equals(restored, ref)
  assert_same_leaves(restored, jr.shard(state, envs_mesh(D)))
  # Each process recorded the CRC-32 of the shards it wrote (#29); this
  # process reads them all, so it checks both records.
  records = [json.loads((tmp_path / "ckpt" / "jrollout_checksums" /
                         f"process_{i}.json").read_text()) for i in range(2)]
  for i, record in enumerate(records):
    envs = sorted(tuple(region[1]) for region, _ in
                  record["leaves"][".data['obs']"])
    assert envs == [(e, e + 2) for e in range(8 * i, 8 * i + 8, 2)]
  second = max((tmp_path / "ckpt" / "ocdbt.process_1" / "d").iterdir(),
               key=lambda p: p.stat().st_size)
  data = bytearray(second.read_bytes())
  data[100:116] = bytes(b ^ 0xFF for b in data[100:116])   # in a shard
  second.write_bytes(bytes(data))
  with pytest.raises(jr.CorruptCheckpointError, match=(
      r"field 'obs' of the rollout \(leaf \.data\['obs'\]\): checksum "
      r"mismatch in shard \[0:4, (8|10|12|14):(10|12|14|16), 0:64\]: ")):
    jr.restore_rollout(tmp_path / "ckpt",
                       jr.shard(worker.fresh(jr), envs_mesh(D)))


# ------------------------------------------------------------------ crashes


def test_a_save_killed_half_way_is_never_read(tmp_path):
  """SIGKILL a process while it writes a checkpoint (its temporary
  directory exists): the partial one is refused, earlier ones restore."""
  with subprocess.Popen(
      [sys.executable, "-m", "tests._checkpoint_worker", "saves",
       str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True) as proc:
    try:
      for line in proc.stdout:
        if line.startswith("saving 2"):   # checkpoints 0 and 1 are complete
          break
      else:
        pytest.fail("the saving process ended early")
      tmp_dirs = []
      deadline = time.monotonic() + 60
      while not tmp_dirs and time.monotonic() < deadline:
        tmp_dirs = [p for p in tmp_path.iterdir()
                    if ".orbax-checkpoint-tmp" in p.name]
      assert tmp_dirs, "no save in progress was seen"
      os.kill(proc.pid, signal.SIGKILL)
    finally:
      proc.kill()
  names = sorted(p.name for p in tmp_path.iterdir())
  partial = [n for n in names if ".orbax-checkpoint-tmp" in n]
  complete = [n for n in names if re.fullmatch(r"ckpt_\d+", n)]
  assert partial and complete[:2] == ["ckpt_0", "ckpt_1"]
  target = jax.eval_shape(lambda: worker.big(jnp, jr, 0))
  for name in complete:
    i = int(name.split("_")[1])
    restored = jr.restore_rollout(tmp_path / name, target)
    np.testing.assert_array_equal(np.asarray(restored.data["obs"][0, 0, :3]),
                                  [i, i, i])
    np.testing.assert_array_equal(np.asarray(restored.counts), 1)
  # The interrupted one was written beside its final name, which does not
  # exist; its temporary directory is refused as incomplete.
  stem = partial[0].split(".jrollout-new")[0]
  assert stem not in complete
  with pytest.raises(FileNotFoundError, match="a save into it was "
                     "interrupted and left " + re.escape(partial[0])):
    jr.restore_rollout(tmp_path / stem, target)
  with pytest.raises(ValueError, match="incomplete checkpoint"):
    jr.restore_rollout(tmp_path / partial[0], target)
  # Saving again under that name discards the leftovers (and the lock file
  # of the killed save) and completes.
  jr.save_rollout(tmp_path / stem, worker.big(jnp, jr, 9))
  restored = jr.restore_rollout(tmp_path / stem, target)
  assert float(restored.data["obs"][0, 0, 0]) == 9
  assert not [p.name for p in tmp_path.iterdir()
              if p.name.startswith(stem + ".")]


# ------------------------------------------------------- the PPO example

EXAMPLE_ARGS = ["--total-steps", "8192", "--num-envs", "4", "--num-steps",
                "64", "--num-minibatches", "2", "--seeds", "2", "--chunks",
                "16", "--checkpoint-every", "2"]   # 32 updates, 16 chunks


def _run(args, out, kill_after=None, kill_on=None, worker=None):
  """Runs the example (through ``tests._checkpoint_worker example N`` if
  ``worker`` is N); SIGKILLs it after ``kill_after`` progress lines or at
  the line starting with ``kill_on``. Returns its output lines."""
  command = (["-m", "examples.ppo_cartpole"] if worker is None else
             ["-m", "tests._checkpoint_worker", "example", str(worker)])
  # The runs of one test share a compile cache (beside `out`): the first
  # compiles, the others load its executables (the same bits either way).
  cache = ["--compile-cache", str(pathlib.Path(out).parent / "compiled")]
  lines, progress = [], 0
  with subprocess.Popen(
      [sys.executable, *command, *args, *cache, "--out", str(out)], cwd=ROOT,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
    try:
      for line in proc.stdout:
        lines.append(line)
        progress += line.startswith("update ")
        if (kill_after is not None and progress == kill_after) or (
            kill_on is not None and line.startswith(kill_on)):
          os.kill(proc.pid, signal.SIGKILL)
          break
    finally:
      proc.kill()
    code = proc.wait()
  if kill_after is None and kill_on is None:
    assert code == 0, "".join(lines[-30:])
  else:
    assert code == -signal.SIGKILL, "".join(lines[-30:])
  return lines


def _resumed_at(lines):
  starts = [int(line.split()[-1]) for line in lines
            if line.startswith("resumed from")]
  assert len(starts) == 1, "".join(lines)
  return starts[0]


@pytest.mark.slow
def test_the_example_killed_three_times_ends_as_an_uninterrupted_run(
    tmp_path):
  """SIGKILL after some progress lines, twice, then during a save: each
  rerun of the same command resumes from the latest complete checkpoint,
  and the last one ends with the parameters (SHA-256) and final returns of
  a run never interrupted, bit for bit."""
  pytest.importorskip("gymnax")
  pytest.importorskip("optax")
  ckpt = tmp_path / "ckpt"
  args = [*EXAMPLE_ARGS, "--checkpoint-dir", str(ckpt)]
  _run(EXAMPLE_ARGS, tmp_path / "plain")
  first = _run(args, tmp_path / "out", kill_after=3)
  assert not any(line.startswith("resumed") for line in first)
  second = _run(args, tmp_path / "out", kill_after=3)
  start = _resumed_at(second)
  assert 0 < start < 32
  complete = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
  # The third run hangs in its first save, which never completes.
  third = _run(args, tmp_path / "out", kill_on="hanging in save", worker=1)
  resumed = _resumed_at(third)
  assert resumed >= start
  partial = [p.name for p in ckpt.iterdir() if ".orbax-checkpoint-tmp" in
             p.name]
  assert partial, sorted(p.name for p in ckpt.iterdir())
  done = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
  assert done and done[-1] >= complete[-1]
  last = _run(args, tmp_path / "out")
  assert _resumed_at(last) == done[-1] < 32
  plain = json.loads((tmp_path / "plain" / "summary.json").read_text())
  resumed_summary = json.loads((tmp_path / "out" / "summary.json").read_text())
  assert resumed_summary["params_sha256"] == plain["params_sha256"]
  assert resumed_summary["final_returns"] == plain["final_returns"]
  # A finished run's rerun restores the final checkpoint and says the same.
  again = _run(args, tmp_path / "again")
  assert _resumed_at(again) == 32
  summary = json.loads((tmp_path / "again" / "summary.json").read_text())
  assert summary["params_sha256"] == plain["params_sha256"]
  assert summary["final_returns"] == plain["final_returns"]
  # Damage after the fact (#29): 16 bytes of the latest checkpoint's largest
  # file flipped, the next one's largest data file deleted. The rerun says
  # so on stderr (update and leaf), moves both aside, resumes from the one
  # before and ends as the uninterrupted run.
  assert sorted(int(p.name) for p in ckpt.iterdir()) == [28, 30, 32]
  largest = max((p for p in (ckpt / "32").rglob("*") if p.is_file()),
                key=lambda p: p.stat().st_size)
  data = bytearray(largest.read_bytes())
  middle = len(data) // 2
  data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])
  largest.write_bytes(bytes(data))
  deleted = max((ckpt / "30" / "runner").glob("ocdbt.process_0/d/*"),
                key=lambda p: p.stat().st_size)
  deleted.unlink()
  damaged = _run(args, tmp_path / "damaged")
  text = "".join(damaged)
  assert re.search(
      rf"--checkpoint-dir {ckpt}: the checkpoint at update 32 is damaged: "
      r"(leaf|key) .*: checksum mismatch.*; moved it to "
      rf"{ckpt / '32.damaged'}, trying the one before", text), text
  assert re.search(
      rf"the checkpoint at update 30 is damaged: .*leaf .*: file "
      rf"{deleted.relative_to(ckpt / '30' / 'runner')} is missing \(the save "
      rf"wrote \d+ bytes\); moved it to {ckpt / '30.damaged'}", text), text
  assert "TensorStore" not in text
  assert _resumed_at(damaged) == 28
  assert (ckpt / "32.damaged").is_dir() and (ckpt / "30.damaged").is_dir()
  summary = json.loads((tmp_path / "damaged" / "summary.json").read_text())
  assert summary["params_sha256"] == plain["params_sha256"]
  assert summary["final_returns"] == plain["final_returns"]
  assert sorted(p.name for p in ckpt.iterdir()) == [
      "28", "30", "30.damaged", "32", "32.damaged"]


@pytest.mark.slow
@pytest.mark.usefixtures("standard_promotion")
def test_the_example_refuses_a_directory_of_other_settings(tmp_path):
  pytest.importorskip("gymnax")
  from examples import ppo_cartpole  # noqa: PLC0415 (gymnax is optional)
  args = ["--total-steps", "512", "--num-envs", "4", "--num-steps", "32",
          "--num-minibatches", "2", "--seeds", "1", "--chunks", "2",
          "--checkpoint-every", "2", "--checkpoint-dir", str(tmp_path / "ckpt"),
          "--out",
          str(tmp_path / "out")]
  first = ppo_cartpole.main(args)
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["2", "4"]
  with pytest.raises(ValueError, match=r"other settings.*'lr': \(0\.00025, "
                     r"0\.001\)"):
    ppo_cartpole.main([*args, "--lr", "0.001"])
  again = ppo_cartpole.main(args)
  assert again["params_sha256"] == first["params_sha256"]
  with pytest.raises(ValueError, match="--checkpoint-every must be a "
                     "positive"):
    ppo_cartpole.main([*args, "--checkpoint-every", "0"])
