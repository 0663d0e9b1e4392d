"""Checkpoints: round trips against tests/reference.py's numpy model (with
and without jit), targets, directories, orbax managers, damage. Faults
during a save are in tests/test_checkpoint_faults.py."""

import builtins
import errno
import gc
import json
import os
import pathlib
import pickle
import re
import tempfile

import chex
from hypothesis import example
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jrollout as jr
from tests import _checkpoint_worker as worker
from tests import reference
from tests._helpers import assert_same_leaves
from tests._helpers import envs_mesh
from tests._helpers import run_workers
from tests.conftest import TRANSFORMS

# orbax abandons the other reads once one fails (on a loop it closed);
# Python reports them when they are collected.
pytestmark = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(autouse=True)
def _collect_abandoned_reads():
  """Collects them here, under this module's filter."""
  yield
  gc.collect()

DTYPES = [jnp.bool_, jnp.uint8, jnp.int8, jnp.int32, jnp.float16,
          jnp.bfloat16, jnp.float32]


# ----------------------------------------------------------- round trips


def _values(rng, spec, num_envs):
  return {k: reference.random_value(rng, (num_envs, *shape), dtype)
          for k, (shape, dtype) in spec.items()}


def _write(state, ref, step, values, transform=jax.jit):
  """One ``update_at`` on the state and on the model (a dropped write if
  ``step`` is outside [0, T): only possible with a traced step)."""
  ref.update_at(step, values)
  return transform(jr.update_at)(state, step, values)


def _half_written(spec, rng, num_envs=3, num_steps=5, transform=jax.jit):
  """A rollout stopped mid-way: some steps written, one twice, one dropped."""
  state, ref = reference.make_pair(spec, num_envs, num_steps)
  for step in [0, 1, 1, num_steps + 2]:
    state = _write(state, ref, step, _values(rng, spec, num_envs),
                   transform if 0 <= step < num_steps else jax.jit)
  return state, ref


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_a_half_written_rollout_resumes_exactly(tmp_path, transition_spec,
                                                transform):
  """Saved mid-rollout, restored, finished: the same check, batch, dtypes."""
  rng = np.random.default_rng(0)
  state, ref = _half_written(transition_spec, rng, transform=transform)
  jr.save_rollout(tmp_path / "ckpt", state)
  restored = jr.restore_rollout(tmp_path / "ckpt", _fresh(transition_spec))
  reference.assert_state_equals(restored, ref)
  assert_same_leaves(restored, state)
  abstract = jr.restore_rollout(tmp_path / "ckpt", jax.eval_shape(
      lambda: _fresh(transition_spec)))   # onto the default device
  assert_same_leaves(abstract, state)
  with pytest.raises(jr.IncompleteRolloutError) as want:
    jr.make_batch(state)
  with pytest.raises(jr.IncompleteRolloutError) as got:
    jr.make_batch(restored)
  assert str(got.value) == str(want.value)
  done = restored
  for step in [2, 3, 4]:
    done = _write(done, ref, step, _values(rng, transition_spec, 3),
                  transform)
  reference.assert_state_equals(done, ref)
  batch, after = transform(lambda s: jr.make_batch(s, check="off"))(done)
  for k, v in ref.make_batch().items():
    np.testing.assert_array_equal(np.asarray(batch[k]), v)
    assert batch[k].dtype == v.dtype
  reference.assert_state_equals(after, ref)


def _fresh(spec, num_envs=3, num_steps=5):
  return reference.make_pair(spec, num_envs, num_steps)[0]


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


@settings(max_examples=12, deadline=None)   # a compile and a save each
@given(spec=_specs(), num_envs=st.integers(1, 4), num_steps=st.integers(1, 4),
       steps=st.lists(st.integers(-2, 6), max_size=8),
       seed=st.integers(0, 2**16))
@example(spec={}, num_envs=2, num_steps=3, steps=[], seed=0)   # no bytes
@example(spec={"z": ((0, 4), jnp.float32), "x": ((), jnp.float32)},
         num_envs=2, num_steps=3, steps=[1], seed=0)   # a field of no bytes
def test_property_round_trips_of_random_rollouts(spec, num_envs, num_steps,
                                                 steps, seed):
  """Random keys, shapes, dtypes and write patterns (dropped writes too)."""
  rng = np.random.default_rng(seed)
  state, ref = reference.make_pair(spec, num_envs, num_steps)
  for step in steps:
    state = _write(state, ref, step, _values(rng, spec, num_envs))
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
    values = _values(rng, transition_spec, 3)
    writer.update_at(step, values)
    ref.update_at(step, values)
  assert writer.pending == 4
  jr.save_rollout(tmp_path / "writer", writer)
  assert writer.pending == 0          # flushed: none of the 4 steps is lost
  writer = jr.RolloutWriter(jr.restore_rollout(tmp_path / "writer",
                                               _fresh(transition_spec, 3, 6)))
  reference.assert_state_equals(writer.state, ref)
  for step in (4, 5):
    values = _values(rng, transition_spec, 3)
    writer.update_at(step, values)
    ref.update_at(step, values)
  batch = writer.make_batch()
  expected = ref.make_batch()
  for k in expected:
    np.testing.assert_array_equal(np.asarray(batch[k]), expected[k])
  # A writer is no restore target: refused, its pending write kept.
  writer.update_at(0, _values(rng, transition_spec, 3))
  with pytest.raises(TypeError, match=r"RolloutWriter.*writer\.state"):
    jr.restore_rollout(tmp_path / "writer", writer)
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


HELD = (r"restore_rollout: the RolloutState at the root: the checkpoint holds "
        r"num_envs \(E\) 4, num_steps \(T\) 3, fields \['done', 'obs'\], the "
        r"target expects ")


@pytest.mark.parametrize("target, match", [
    (_target(num_envs=8), HELD + r"num_envs \(E\) 8, num_steps \(T\) 3,"),
    (_target(num_steps=5), HELD + r"num_envs \(E\) 4, num_steps \(T\) 5,"),
    (_target(done=None), HELD + r".*fields \['obs'\]$"),
    (_target(reward=((), jnp.float32)),
     HELD + r".*fields \['done', 'obs', 'reward'\]$"),
    (_target(obs=((3,), jnp.float32)),
     (r"restore_rollout: leaf \.data\['obs'\]: the checkpoint holds shape "
      r"\(3, 4, 2\) float32, the target expects shape \(3, 4, 3\) float32")),
    (_target(obs=((2,), jnp.bfloat16)),
     (r"leaf \.data\['obs'\]: the checkpoint holds shape \(3, 4, 2\) "
      r"float32, the target expects shape \(3, 4, 2\) bfloat16")),
    ({"rollout": _target()}, HELD + "none$"),
], ids=["E", "T", "extra-field", "missing-field", "shape", "dtype",
        "nesting"])
def test_mismatched_targets_are_refused_by_name(tmp_path, target, match):
  _saved(tmp_path)
  before = jax.tree_util.tree_map(np.asarray, target)
  with pytest.raises(ValueError, match=match):
    jr.restore_rollout(tmp_path / "ckpt", target)
  # Nothing changed: the target's arrays are alive and hold what they held.
  chex.assert_trees_all_equal(jax.tree_util.tree_map(np.asarray, target),
                              before)


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


# ------------------------------------------------------------ directories


def test_each_save_is_a_new_step_and_the_last_one_is_kept(tmp_path):
  path = tmp_path / "a" / "b" / "ckpt"    # missing parents are created
  assert jr.save_rollout(path, {"x": np.zeros(3)}) == 0
  assert jr.save_rollout(path, {"x": np.ones(3)}) == 1
  assert jr.save_rollout(path, {"y": np.int8(2)}) == 2
  assert sorted(os.listdir(path)) == ["2", "jrollout.lock"]
  assert jr.restore_rollout(path) == {"y": np.int8(2)}


@pytest.mark.parametrize("directory, error, match", [
    ("", ValueError, r"directory '' is empty or holds a NUL"),
    ("runs/a\0b", ValueError, r"directory 'runs/a\\x00b' is empty or holds "
     r"a NUL character"),
    (3, TypeError, r"directory must be a str or os\.PathLike, got int"),
    (None, TypeError, r"directory must be a str or os\.PathLike, got "
     r"NoneType"),
], ids=["empty", "nul", "int", "none"])
@pytest.mark.parametrize("fn", ["save_rollout", "restore_rollout"])
def test_a_directory_that_is_no_path_is_refused(fn, directory, error, match):
  with pytest.raises(error, match=f"^{fn}: " + match):
    if fn == "save_rollout":
      jr.save_rollout(directory, {"x": np.zeros(1)})
    else:
      jr.restore_rollout(directory)


def test_a_file_or_a_directory_of_other_files_is_refused_and_kept(
    tmp_path, monkeypatch):
  (tmp_path / "notes.txt").write_text("mine")
  (tmp_path / "1").mkdir()
  with pytest.raises(ValueError, match=r"save_rollout: directory .* holds 1, "
                     r"notes\.txt and no save_rollout checkpoint; give a new "
                     "or empty directory"):
    jr.save_rollout(tmp_path, {"x": np.zeros(1)})
  monkeypatch.chdir(tmp_path)   # the current directory too
  with pytest.raises(ValueError, match="no save_rollout checkpoint"):
    jr.save_rollout(".", {"x": np.zeros(1)})
  assert sorted(os.listdir(tmp_path)) == ["1", "notes.txt"]
  (tmp_path / "empty").mkdir()   # an empty directory is taken
  jr.save_rollout(tmp_path / "empty", {"x": np.zeros(1)})
  (tmp_path / "file").write_text("x")
  with pytest.raises(ValueError, match=r"save_rollout: directory .*file/ckpt "
                     "cannot be created: it or a directory above it is a "
                     "file"):
    jr.save_rollout(tmp_path / "file" / "ckpt", {"x": np.zeros(1)})
  with pytest.raises(ValueError, match="cannot be created"):
    jr.save_rollout(tmp_path / "file", {"x": np.zeros(1)})
  assert (tmp_path / "file").read_text() == "x"
  assert sorted(os.listdir(tmp_path)) == ["1", "empty", "file", "notes.txt"]


@pytest.mark.parametrize("make, error, match", [
    (lambda p: p.write_text("x"), ValueError, r"is a file, not a checkpoint$"),
    (lambda p: None, FileNotFoundError, r"does not exist$"),
    (lambda p: p.mkdir(), ValueError,
     r"holds no complete checkpoint \(it is empty\)$"),
    (lambda p: (p.mkdir(), (p / "x").write_text("x")), ValueError,
     r"holds no complete checkpoint$"),
    (lambda p: ocp.PyTreeCheckpointer().save(p, args=ocp.args.PyTreeSave(
        {"x": np.ones(2)}, custom_metadata={"format": "jrollout",
                                            "version": 2})), ValueError,
     r"holds no complete checkpoint: it holds a checkpoint of format version "
     r"2 \(jrollout 0\.2\), which this jrollout does not read; restore it "
     r"with jrollout 0\.2 and save"),
], ids=["file", "nothing", "empty", "other", "jrollout-0.2"])
def test_restoring_what_holds_no_checkpoint_names_it(tmp_path, make, error,
                                                     match):
  make(tmp_path / "d")
  with pytest.raises(error, match=rf"^restore_rollout: directory \S+/d "
                     rf"{match}"):
    jr.restore_rollout(tmp_path / "d")


def _fail(kind):
  """A failed write as orbax may raise it."""
  if kind == "cause":
    raise ValueError("write failed") from OSError(errno.ENOSPC, "No space")
  if kind == "context":
    try:
      raise OSError(errno.EFBIG, "File too large")
    except OSError:
      raise RuntimeError("write failed")  # noqa: B904 (a context)
  if kind == "group":   # an ExceptionGroup from Python 3.11 on
    group = getattr(builtins, "ExceptionGroup", None) or pytest.skip("3.10")
    raise group("writes failed", [
        ValueError("a"), OSError(errno.EROFS, "Read-only file system")])
  raise ValueError("OUT_OF_RANGE: File too large [os_error_code='27']")


@pytest.mark.parametrize("kind, code", [
    ("cause", errno.ENOSPC), ("context", errno.EFBIG),
    ("group", errno.EROFS), ("text", errno.EIO)])
def test_a_failed_write_carries_the_errno_of_its_chain(tmp_path, monkeypatch,
                                                       kind, code):
  """The first OSError's code in the chain; message text is never parsed."""
  async def async_save(self, *args, **kwargs):
    _fail(kind)
  monkeypatch.setattr(ocp.PyTreeCheckpointHandler, "async_save", async_save)
  with pytest.raises(jr.CheckpointSaveError) as info:
    jr.save_rollout(tmp_path / "ckpt", {"x": np.ones(2)})
  assert (info.value.errno, info.value.filename) == (code,
                                                     str(tmp_path / "ckpt"))
  assert str(info.value).startswith(f"save_rollout: cannot save {tmp_path}")


# ------------------------------------------------------- misuse of a save


def test_leaves_and_keys_that_cannot_be_saved_are_named(tmp_path):
  cases = [
      ({"a": {"b": np.array(["x", "y"])}}, TypeError,
       r"save_rollout: leaf \['a'\]\['b'\] is an array of dtype <U1"),
      ({"a": np.array([object()], dtype=object)}, TypeError,
       r"leaf \['a'\] is an array of dtype object"),
      ({"a": "text"}, TypeError, r"leaf \['a'\] is str; a checkpoint holds"),
      ({"a": {0: np.ones(2), "b": np.ones(2)}}, TypeError,
       r"save_rollout: the tree cannot be flattened .*use strings"),
      ({1.5: np.ones(2)}, TypeError, r"leaf \[1\.5\] has the dict key 1\.5 "
       r"\(of type float\); use strings"),
      ({"x": np.ones(2), "y": {"x": np.ones(2)}, "y.x": 1}, ValueError,
       r"leaves .* have the same name 'y\.x'|same name"),
      ({"k": jax.random.split(jax.random.key(0), 0)}, ValueError,
       r"leaf \['k'\]: PRNG key arrays with no elements"),
  ]
  for tree, kind, match in cases:
    with pytest.raises(kind, match=match):
      jr.save_rollout(tmp_path / "ckpt", tree)
    assert os.listdir(tmp_path) == []
  state = jr.register(jr.init(2, 3), "obs", (4,))
  jax.jit(lambda s: s, donate_argnums=0)(state)   # consumes state
  with pytest.raises(ValueError, match=(
      r"save_rollout: leaf \['runner'\]\.data\['obs'\] is a deleted array "
      r".*donated")):
    jr.save_rollout(tmp_path / "ckpt", {"runner": state, "x": jnp.ones(2)})
  writer = jr.RolloutWriter(jr.register(jr.init(2, 3), "obs", (4,)))
  early = writer.state
  writer.update_at(0, {"obs": np.ones((2, 4), np.float32)})
  writer.flush()   # consumes `early`
  with pytest.raises(ValueError, match=r"leaf \['s'\]\.data\['obs'\] is a "
                     "deleted array"):
    jr.save_rollout(tmp_path / "ckpt", {"s": early})
  assert os.listdir(tmp_path) == []


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
      state = _write(state, ref, step, _values(rng, spec, 2))
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
  chex.assert_trees_all_equal(
      jax.tree_util.tree_map(np.asarray, got["rollout"]["state"].data),
      refs[2])
  np.testing.assert_array_equal(
      np.asarray(jr.write_counts(got["rollout"]["state"])["obs"].per_step),
      [1, 1, 1, 0])
  assert_same_leaves(got["rollout"]["key"], jax.random.key(2))
  # Without args, a new manager finds the handler by the typestr orbax
  # recorded: it restores as restore_rollout without a target does.
  with ocp.CheckpointManager(tmp_path / "run") as mngr, pytest.raises(
      ValueError, match=r"^RolloutRestore: leaf \['key'\] is a PRNG key"):
    mngr.restore(3)
  # A step another handler wrote is refused by name.
  with ocp.CheckpointManager(tmp_path / "plain") as mngr:
    mngr.save(0, args=ocp.args.Composite(
        x=ocp.args.PyTreeSave({"x": np.ones(2)})))
    mngr.wait_until_finished()
  with ocp.CheckpointManager(tmp_path / "plain") as mngr:
    with pytest.raises(ValueError, match="RolloutRestore: the checkpoint was "
                       "not written by jrollout"):
      mngr.restore(0, args=ocp.args.Composite(
          x=jr.RolloutRestore({"x": np.ones(2)})))


# ------------------------------------------------------------------ damage

T, E, OBS = 4, 16, 64      # obs shards of 4 x 2 x 64 float32: 2 KiB each,
SPEC = {"obs": ((OBS,), jnp.float32), "done": ((), jnp.bool_)}  # not inlined
HEX = r"0x[0-9a-f]{8}"


def _state(seed=0, mesh=None):
  """A written rollout (the last step unwritten) and its numpy model."""
  rng = np.random.default_rng(seed)
  state, ref = reference.make_pair(SPEC, E, T)
  if mesh is not None:
    state = jr.shard(state, mesh)
  for step in range(T - 1):
    state = _write(state, ref, step, _values(rng, SPEC, E))
  return state, ref


def _files(directory):
  """The files of a checkpoint, largest first (the obs bytes)."""
  found = [os.path.join(root, name) for root, _, names in os.walk(directory)
           for name in names if name != "jrollout.lock"]
  return sorted(found, key=os.path.getsize, reverse=True)


def _flip(path, offset=None, length=16):
  with open(path, "r+b") as f:
    data = bytearray(f.read())
    offset = len(data) // 2 if offset is None else offset
    data[offset:offset + length] = bytes(
        b ^ 0xFF for b in data[offset:offset + length])
    f.seek(0)
    f.write(data)


def _damaged(directory, target, match):
  """Restores ``directory`` expecting a CorruptCheckpointError matching
  ``match``; checks its form and that ``target`` is unchanged."""
  before = jax.tree_util.tree_map(np.asarray, target)
  with pytest.raises(jr.CorruptCheckpointError) as info:
    jr.restore_rollout(directory, target)
  text = str(info.value)
  assert isinstance(info.value, ValueError)
  assert text.startswith(f"restore_rollout: damaged checkpoint {directory}"
                         ), text
  assert "; nothing was restored\n  " in text, text
  assert re.search(match, text), f"{match!r} not in:\n{text}"
  assert len(text.splitlines()) <= 6 and len(text) < 1200, text
  chex.assert_trees_all_equal(jax.tree_util.tree_map(np.asarray, target),
                              before)
  return info.value


@pytest.fixture
def saved(tmp_path):
  state, ref = _state()
  jr.save_rollout(tmp_path / "ckpt", state)
  return tmp_path / "ckpt", state, ref


def test_flipped_bytes_are_a_checksum_mismatch_of_their_leaf(saved):
  path, state, ref = saved
  _flip(_files(path)[0])
  error = _damaged(path, _state(1)[0], (
      rf"\n  leaf \.data\['obs'\]: checksum mismatch: its bytes have CRC-32 "
      rf"{HEX}, the save recorded {HEX}$"))
  assert error.leaves == (".data['obs']",)
  back = pickle.loads(pickle.dumps(error))
  assert (str(back), back.leaves, back.problems, back.directory) == (
      str(error), error.leaves, error.problems, error.directory)
  with pytest.raises(jr.CorruptCheckpointError, match="checksum mismatch"):
    jr.restore_rollout(path)   # without a target: verified too
  # verify=False returns the damaged bytes, to salvage the rest.
  salvaged = jr.restore_rollout(path, _state(1)[0], verify=False)
  np.testing.assert_array_equal(np.asarray(salvaged.data["done"]),
                                ref.storage["done"])
  assert not np.array_equal(np.asarray(salvaged.data["obs"]),
                            ref.storage["obs"])
  for verify in (1, None, "yes", np.array(True)):
    with pytest.raises(TypeError, match=r"^restore_rollout: `verify` must be "
                       "True or False"):
      jr.restore_rollout(path, state, verify=verify)


@pytest.mark.parametrize("damage", [
    lambda f: os.truncate(f, os.path.getsize(f) // 2),
    lambda f: os.truncate(f, 0), os.remove,
], ids=["half", "empty", "deleted"])
def test_a_data_file_cut_short_or_deleted_names_its_leaf(saved, damage):
  path, state, _ = saved
  damage(_files(path)[0])
  error = _damaged(path, _state(1)[0],
                   r"\n  leaf \.data\['obs'\] cannot be read \(")
  assert error.leaves == (".data['obs']",)
  with pytest.raises(jr.CorruptCheckpointError, match="cannot be read"):
    jr.restore_rollout(path, _state(1)[0], verify=False)


def test_unreadable_metadata_is_named(tmp_path):
  jr.save_rollout(tmp_path / "ckpt", {"x": np.arange(3.0)})
  metadata = [f for f in _files(tmp_path / "ckpt")
              if b'"checksums"' in pathlib.Path(f).read_bytes()]
  assert len(metadata) == 1   # the custom metadata holds the record
  _flip(metadata[0], offset=0, length=4)
  error = _damaged(tmp_path / "ckpt", {"x": np.zeros(3)},
                   r"\n  its metadata cannot be read \(")
  assert error.leaves == ()


def test_several_damaged_leaves_are_listed(tmp_path):
  rng = np.random.default_rng(1)
  tree = {k: rng.standard_normal((64, 64)).astype(np.float32) for k in "abc"}
  jr.save_rollout(tmp_path / "ckpt", tree)
  largest = _files(tmp_path / "ckpt")[0]   # the three arrays' bytes
  for part in (0.2, 0.5, 0.8):
    _flip(largest, int(part * os.path.getsize(largest)))
  error = _damaged(tmp_path / "ckpt", tree, r"\]: checksum mismatch")
  assert len(error.leaves) == len(error.problems) >= 2, error


def test_a_save_error_pickles_and_names_its_parts():
  error = jr.CheckpointSaveError(28, "No space left on device", "/x")
  error.fn = "RolloutSave"
  saving = pickle.loads(pickle.dumps(error))
  assert (saving.errno, saving.strerror, saving.filename, str(saving)) == (
      28, "No space left on device", "/x", "RolloutSave: cannot save /x: No "
      "space left on device (ENOSPC); the last complete checkpoint there is "
      "kept")


def test_a_checkpoint_manager_item_is_verified(tmp_path):
  state, _ = _state()
  with ocp.CheckpointManager(tmp_path / "run") as mngr:
    mngr.save(0, args=ocp.args.Composite(rollout=jr.RolloutSave(state),
                                         meta=ocp.args.JsonSave({"a": 1})))
    mngr.wait_until_finished()
  _flip(_files(tmp_path / "run" / "0" / "rollout")[0])
  with ocp.CheckpointManager(tmp_path / "run") as mngr:
    with pytest.raises(jr.CorruptCheckpointError, match=(
        r"^RolloutRestore: damaged checkpoint .*rollout; nothing was "
        r"restored\n  leaf \.data\['obs'\]: checksum mismatch")):
      mngr.restore(0, args=ocp.args.Composite(
          rollout=jr.RolloutRestore(_state(1)[0]),
          meta=ocp.args.JsonRestore()))


@settings(max_examples=12, deadline=None)
@given(which=st.integers(0, 50), offset=st.floats(0, 1),
       length=st.integers(1, 64), cut=st.booleans())
def test_property_a_restore_returns_what_was_saved_or_raises(which, offset,
                                                             length, cut):
  """Any file flipped or cut: exactly what was saved, or the error."""
  state, ref = _state(2)
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "ckpt")
    jr.save_rollout(path, state)
    files = _files(path)
    target = files[which % len(files)]
    size = os.path.getsize(target)
    if cut:
      os.truncate(target, int(offset * size))
    elif size:
      _flip(target, min(int(offset * size), size - 1), length)
    try:
      restored = jr.restore_rollout(path, _state(1)[0])
    except jr.CorruptCheckpointError:
      return
    except ValueError as e:   # orbax's own metadata of the step
      assert "jrollout" in str(e) or "checkpoint" in str(e), e
      return
  reference.assert_state_equals(restored, ref)


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
    state = _write(state, ref, step, _values(rng, spec, 16), transform)
  jr.save_rollout(tmp_path / "sharded", state)
  target = jr.shard(_fresh(spec, 16, 4), mesh)
  restored = jr.restore_rollout(tmp_path / "sharded", target)
  assert_same_leaves(restored, state)
  expected = NamedSharding(mesh, P(None, "envs"))
  assert restored.data["obs"].sharding.is_equivalent_to(expected, 3)
  reference.assert_state_equals(restored, ref)
  # The same checkpoint restores onto one device, unverified (a warning).
  with pytest.warns(UserWarning, match=r"leaves \.data\['done'\], \.data\["
                    r"'obs'\] were restored with another sharding than saved"):
    single = jr.restore_rollout(tmp_path / "sharded", _fresh(spec, 16, 4))
  reference.assert_state_equals(single, ref)
  assert single.data["obs"].sharding.device_set == {jax.devices()[0]}


@pytest.mark.skipif(jax.device_count() < D, reason=f"needs {D} devices")
def test_two_processes_save_and_restore_a_sharded_state(tmp_path):
  """2 processes x 4 devices save and restore; 1 x 8 restores it too."""
  run_workers(["tests._checkpoint_worker", "sharded"],
              lambda i: [str(tmp_path)], timeout=240, log_dir=tmp_path)
  for i in range(2):
    got = json.loads((tmp_path / f"out{i}.json").read_text())
    assert got == {"process_count": 2, "device_count": D,
                   "spec": str(P(None, "envs")), "mismatched": []}
  state, ref = worker.expected(jax, jr)
  target = jr.shard(worker.fresh(jr), envs_mesh(D))
  restored = jr.restore_rollout(tmp_path / "ckpt", target)
  reference.assert_state_equals(restored, ref)
  assert_same_leaves(restored, jr.shard(state, envs_mesh(D)))
  for f in _files(tmp_path / "ckpt")[:2]:   # each process's obs shards
    _flip(f, length=4)
  error = _damaged(tmp_path / "ckpt", target, (
      r"leaf \.data\['obs'\]: checksum mismatch in shard \[\[0, 4\], "))
  assert error.leaves == (".data['obs']",)
