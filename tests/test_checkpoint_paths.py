"""Tests of the directories ``save_rollout`` / ``restore_rollout`` accept.

``save_rollout(..., overwrite=True)`` only ever replaces a jrollout
checkpoint: every other kind of path is refused before orbax is called,
and the user's files are still there afterwards.
"""

import os
import re

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jrollout as jr


def _state(value=1.0):
  state = jr.register(jr.init(2, 3), "obs", (2,))
  return jr.update_all(state, {"obs": jnp.full((3, 2, 2), value)})


def _user_file(directory, name="model.pt"):
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, name)
  with open(path, "wb") as f:
    f.write(b"the user's weights")
  return path


def _survives(path):
  with open(path, "rb") as f:
    assert f.read() == b"the user's weights"


@pytest.fixture
def no_orbax_save(monkeypatch):
  """Makes reaching orbax's save (which deletes with ``force``) a failure,
  for the paths where a wrong refusal would delete what is not ours."""
  def save(*args, **kwargs):
    raise AssertionError("save_rollout reached orbax: it would have deleted")
  monkeypatch.setattr(ocp.Checkpointer, "save", save)


def _refused(path, match, **kwargs):
  with pytest.raises(ValueError, match=match) as info:
    jr.save_rollout(path, _state(), overwrite=True, **kwargs)
  assert str(info.value).startswith("save_rollout: directory")
  return info.value


def test_the_empty_path_is_refused(tmp_path, monkeypatch):
  user = _user_file(tmp_path)
  monkeypatch.chdir(tmp_path)
  for overwrite in (True, False):
    with pytest.raises(ValueError, match=r"save_rollout: directory is '' "
                       r"\(empty\)"):
      jr.save_rollout("", _state(), overwrite=overwrite)
  _survives(user)
  assert os.listdir(tmp_path) == ["model.pt"]


@pytest.mark.parametrize("relative", [".", "./", "sub/..", os.getcwd])
def test_the_current_directory_is_refused(tmp_path, monkeypatch, relative):
  user = _user_file(tmp_path)
  os.mkdir(tmp_path / "sub")
  monkeypatch.chdir(tmp_path)
  path = relative() if callable(relative) else relative
  _refused(path, "is the current directory; overwrite=True only replaces a "
           "checkpoint written by jrollout, so nothing was deleted")
  _survives(user)


@pytest.mark.parametrize("up", ["..", "../.."])
def test_a_parent_of_the_current_directory_is_refused(tmp_path, monkeypatch,
                                                      up):
  user = _user_file(tmp_path)
  inner = tmp_path / "a" / "b"
  inner.mkdir(parents=True)
  monkeypatch.chdir(inner)
  _refused(up, rf"holds the current directory \({inner}\)")
  _survives(user)
  assert inner.is_dir()


def test_the_root_is_refused(no_orbax_save):
  _refused("/", "is the filesystem root")
  _refused("/../..", "is the filesystem root")


def test_the_home_directory_is_refused(tmp_path, monkeypatch):
  home = tmp_path / "home"
  user = _user_file(home)
  monkeypatch.setenv("HOME", str(home))
  _refused(home, "is the home directory")
  _survives(user)


def test_a_file_is_refused(tmp_path):
  user = _user_file(tmp_path)
  _refused(user, "is a file, not a checkpoint directory")
  _survives(user)


def test_a_directory_of_other_files_is_refused(tmp_path):
  user = _user_file(tmp_path / "runs")
  os.mkdir(tmp_path / "runs" / "logs")
  _refused(tmp_path / "runs", r"is not a jrollout checkpoint: it holds logs, "
           r"model\.pt, which a checkpoint does not")
  _survives(user)
  assert (tmp_path / "runs" / "logs").is_dir()


@pytest.mark.parametrize("where", [".", "d", "ocdbt.process_0",
                                   "ocdbt.process_0/d", "array_metadatas"])
def test_a_checkpoint_holding_a_foreign_file_is_refused(tmp_path, where):
  jr.save_rollout(tmp_path / "ckpt", _state())
  user = _user_file(tmp_path / "ckpt" / where, "notes.txt")
  name = os.path.normpath(os.path.join(where, "notes.txt"))
  _refused(tmp_path / "ckpt", rf"is not a jrollout checkpoint: it holds "
           rf"{name}, which")
  with open(user, "rb") as f:
    assert f.read() == b"the user's weights"
  os.remove(user)   # the checkpoint itself is intact
  got = jr.restore_rollout(tmp_path / "ckpt", _state(0.0))
  np.testing.assert_array_equal(np.asarray(got.data["obs"]), 1.0)


def test_other_checkpoints_and_links_are_refused(tmp_path):
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(str(tmp_path / "theirs"), {"w": np.ones(3)})
  _refused(tmp_path / "theirs", "is an orbax checkpoint not written by "
           "jrollout")
  with ocp.StandardCheckpointer() as ckptr:
    got = ckptr.restore(str(tmp_path / "theirs"))
  np.testing.assert_array_equal(got["w"], np.ones(3))
  jr.save_rollout(tmp_path / "ours", _state())
  os.symlink(tmp_path / "ours", tmp_path / "link")
  _refused(tmp_path / "link", "is a symbolic link")
  assert (tmp_path / "ours" / "_METADATA").is_file()
  with open(tmp_path / "ours" / "_METADATA", "w") as f:
    f.write("{not json")
  _refused(tmp_path / "ours", r"is not a readable jrollout checkpoint \(its "
           r"_METADATA: JSONDecodeError.*delete it yourself")
  assert (tmp_path / "ours" / "_METADATA").read_text() == "{not json"


def test_a_checkpoint_or_an_empty_directory_is_replaced(tmp_path):
  jr.save_rollout(tmp_path / "ckpt", _state(1.0))
  jr.save_rollout(tmp_path / "ckpt", _state(2.0), overwrite=True)
  got = jr.restore_rollout(tmp_path / "ckpt", _state(0.0))
  np.testing.assert_array_equal(np.asarray(got.data["obs"]), 2.0)
  os.mkdir(tmp_path / "empty")
  jr.save_rollout(tmp_path / "empty", _state(3.0), overwrite=np.True_)
  got = jr.restore_rollout(tmp_path / "empty", _state(0.0))
  np.testing.assert_array_equal(np.asarray(got.data["obs"]), 3.0)


@pytest.mark.parametrize("overwrite", ["no", "", 1, 0, None, 1.0])
def test_overwrite_must_be_a_bool(tmp_path, overwrite):
  jr.save_rollout(tmp_path / "ckpt", _state(1.0))
  with pytest.raises(TypeError, match=r"save_rollout: `overwrite` must be "
                     rf"True or False, got {type(overwrite).__name__} "
                     rf"{re.escape(repr(overwrite))}$"):
    jr.save_rollout(tmp_path / "ckpt", _state(2.0), overwrite=overwrite)
  with pytest.raises(TypeError, match="save_rollout: `overwrite`"):
    jr.save_rollout(tmp_path / "new", _state(2.0), overwrite=overwrite)
  assert not (tmp_path / "new").exists()
  got = jr.restore_rollout(tmp_path / "ckpt", _state(0.0))
  np.testing.assert_array_equal(np.asarray(got.data["obs"]), 1.0)


def test_an_existing_destination_is_named(tmp_path):
  jr.save_rollout(tmp_path / "ckpt", _state())
  with pytest.raises(ValueError, match=rf"save_rollout: directory "
                     rf"{tmp_path / 'ckpt'} already exists; choose a new "
                     r"directory, or pass overwrite=True"):
    jr.save_rollout(tmp_path / "ckpt", _state())
  user = _user_file(tmp_path)
  with pytest.raises(ValueError, match="already exists"):
    jr.save_rollout(user, _state())
  _survives(user)


def test_a_directory_below_a_file_is_refused(tmp_path):
  user = _user_file(tmp_path)
  with pytest.raises(ValueError, match=rf"save_rollout: directory {user}/a/b "
                     rf"cannot be created: {user} is a file"):
    jr.save_rollout(os.path.join(user, "a", "b"), _state())
  _survives(user)


def test_missing_parents_are_created(tmp_path):
  jr.save_rollout(tmp_path / "a" / "b" / "ckpt", _state(4.0))
  got = jr.restore_rollout(tmp_path / "a" / "b" / "ckpt", _state(0.0))
  np.testing.assert_array_equal(np.asarray(got.data["obs"]), 4.0)


@pytest.mark.parametrize("directory", [None, 3, ["a"]])
def test_a_directory_that_is_no_path_is_refused(directory):
  with pytest.raises(TypeError, match=r"save_rollout: directory must be a str "
                     rf"or os.PathLike, got {type(directory).__name__}"):
    jr.save_rollout(directory, _state())


def _trees():
  """Items of every kind a checkpoint holds (see test_checkpoint.py)."""
  import jax  # noqa: PLC0415 (only here)
  from jax.sharding import AxisType  # noqa: PLC0415
  state = _state()
  yield "state", state
  yield "nothing", jr.init(2, 3)
  yield "runner", {"rollout": jax.vmap(lambda _: state)(jnp.arange(3)),
                   "key": jax.random.split(jax.random.key(1), 3),
                   "w": np.ones((2, 3), np.float32), "update": 7, "lr": 0.5}
  if jax.device_count() >= 8:
    mesh = jax.make_mesh((8,), ("envs",), axis_types=(AxisType.Auto,))
    big = jr.update_all(jr.register(jr.init(16, 3), "obs", (2,)),
                        {"obs": jnp.ones((3, 16, 2))})
    yield "sharded", jr.shard(big, mesh)


@pytest.mark.parametrize("name", ["state", "nothing", "runner", "sharded"])
def test_checkpoints_of_every_kind_can_be_replaced(tmp_path, name):
  trees = dict(_trees())
  if name not in trees:
    pytest.skip("needs 8 devices")
  jr.save_rollout(tmp_path / "ckpt", trees[name])
  jr.save_rollout(tmp_path / "ckpt", trees[name], overwrite=True)
  jr.restore_rollout(tmp_path / "ckpt", trees[name])


# ------------------------------------------------- restore_rollout's paths


def test_restoring_a_missing_directory_names_it(tmp_path):
  with pytest.raises(FileNotFoundError, match=rf"restore_rollout: directory "
                     rf"{tmp_path / 'none'} does not exist$"):
    jr.restore_rollout(tmp_path / "none", _state())
  os.mkdir(tmp_path / "ckpt.orbax-checkpoint-tmp-123")
  with pytest.raises(FileNotFoundError, match=r"does not exist \(a save into "
                     r"it was interrupted and left "
                     r"ckpt\.orbax-checkpoint-tmp-123\)"):
    jr.restore_rollout(tmp_path / "ckpt", _state())
  with pytest.raises(ValueError, match=r"restore_rollout: directory .*tmp-123 "
                     r"is an incomplete checkpoint: the save writing it was "
                     r"interrupted"):
    jr.restore_rollout(tmp_path / "ckpt.orbax-checkpoint-tmp-123", _state())
  with pytest.raises(ValueError, match=r"restore_rollout: directory is ''"):
    jr.restore_rollout("", _state())


def test_restoring_a_file_or_a_plain_directory_names_it(tmp_path):
  user = _user_file(tmp_path / "runs")
  with pytest.raises(ValueError, match=rf"restore_rollout: directory {user} "
                     r"is a file, not a checkpoint directory"):
    jr.restore_rollout(user, _state())
  with pytest.raises(ValueError, match=r"restore_rollout: directory .*runs is "
                     r"not a checkpoint: it has no _METADATA file \(it holds "
                     r"model\.pt\)"):
    jr.restore_rollout(tmp_path / "runs", _state())
  os.mkdir(tmp_path / "empty")
  with pytest.raises(ValueError, match=r"has no _METADATA file \(it is "
                     r"empty\)"):
    jr.restore_rollout(tmp_path / "empty")
  _survives(user)
