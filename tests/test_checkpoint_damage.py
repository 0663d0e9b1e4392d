"""Damaged checkpoints: never restored silently (issue #29).

A checkpoint damaged after it was written (bytes flipped, a file cut short
or deleted, metadata unreadable) raises ``jr.CorruptCheckpointError``,
naming the directory, the leaf (the key of a RolloutState) and what is
wrong, in a few lines; nothing is returned. Checked on a single-device
state, on an 8-device sharded state, through a CheckpointManager, for
every file of a checkpoint, and as a property: a restore returns exactly
what was saved or raises.
"""

import json
import os
import pickle
import re
import shutil
import tempfile
import zlib

from hypothesis import given
from hypothesis import strategies as st
import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jrollout as jr
from jrollout._checkpoint import checksums
from jrollout._checkpoint import damage as checkpoint_damage
from tests import reference
from tests._helpers import assert_same_leaves
from tests._helpers import envs_mesh

D = 8
T, E, OBS = 4, 16, 64      # obs shards of 4 x 2 x 64 float32: 2 KiB each,
SPEC = {"obs": ((OBS,), jnp.float32), "done": ((), jnp.bool_)}  # not inlined
HEX = r"0x[0-9a-f]{8}"


def _state(seed=0, mesh=None):
  """A written rollout (and its numpy model)."""
  rng = np.random.default_rng(seed)
  state, ref = reference.make_pair(SPEC, E, T)
  if mesh is not None:
    state = jr.shard(state, mesh)
  for step in range(T - 1):     # the last step unwritten: counts matter
    values = {k: reference.random_value(rng, (E, *shape), dtype)
              for k, (shape, dtype) in SPEC.items()}
    ref.update_at(step, values)
    state = jax.jit(jr.update_at)(state, step, values)
  return state, ref


def _target(mesh=None):
  state = reference.make_pair(SPEC, E, T)[0]
  return state if mesh is None else jr.shard(state, mesh)


def _files(directory):
  return sorted(os.path.relpath(os.path.join(root, name), directory)
                for root, _, names in os.walk(directory) for name in names)


def _largest(directory):
  """The largest data file (it holds the obs bytes)."""
  return max((f for f in _files(directory) if f.startswith("ocdbt.process_")),
             key=lambda f: os.path.getsize(os.path.join(directory, f)))


def _flip(path, offset=None, length=16):
  with open(path, "rb") as f:
    data = bytearray(f.read())
  offset = len(data) // 2 if offset is None else offset
  data[offset:offset + length] = bytes(b ^ 0xFF for b in
                                       data[offset:offset + length])
  with open(path, "wb") as f:
    f.write(data)


def _truncate(path, size=None):
  size = os.path.getsize(path) // 2 if size is None else size
  os.truncate(path, size)


def _damaged(directory, target, match):
  """Restores ``directory`` expecting a CorruptCheckpointError matching
  ``match``; checks its form and that ``target`` is unchanged."""
  before = jax.tree_util.tree_map(np.asarray, jax.tree_util.tree_map(
      lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(
          x.dtype, jax.dtypes.prng_key) else x, target))
  with pytest.raises(jr.CorruptCheckpointError) as info:
    jr.restore_rollout(directory, target)
  error = info.value
  text = str(error)
  assert isinstance(error, ValueError)
  assert text.startswith(f"restore_rollout: damaged checkpoint {directory}; "
                         "nothing was restored\n  "), text
  assert re.search(match, text), f"{match!r} not in:\n{text}"
  assert len(text.splitlines()) <= 6 and len(text) < 1200, text
  assert "TensorStore" not in text and "driver" not in text, text
  assert error.directory == str(directory)
  after = jax.tree_util.tree_map(np.asarray, jax.tree_util.tree_map(
      lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(
          x.dtype, jax.dtypes.prng_key) else x, target))
  jax.tree_util.tree_map(np.testing.assert_array_equal, after, before)
  return error


OBS_LEAF = r"field 'obs' of the rollout \(leaf \.data\['obs'\]\)"


# ------------------------------------------------------ a single device


@pytest.fixture
def saved(tmp_path):
  state, ref = _state()
  jr.save_rollout(tmp_path / "ckpt", state)
  return tmp_path / "ckpt", state, ref


def test_an_intact_checkpoint_records_and_verifies(saved):
  path, state, ref = saved
  record = json.loads((path / "jrollout_checksums" / "process_0.json")
                      .read_text())
  assert record["algorithm"] == "crc32" and record["process"] == 0
  obs = np.asarray(state.data["obs"])
  assert record["leaves"][".data['obs']"] == [
      [[[0, T], [0, E], [0, OBS]], zlib.crc32(obs.tobytes())]]
  assert (path / "jrollout_checksums" / "index.json").is_file()
  restored = jr.restore_rollout(path, _target())
  reference.assert_state_equals(restored, ref)
  assert_same_leaves(restored, state, shardings=False)


def test_flipped_bytes_are_a_checksum_mismatch(saved):
  path, state, _ = saved
  _flip(path / _largest(path))
  error = _damaged(path, _target(), rf"\n  {OBS_LEAF}: checksum mismatch: "
                   rf"its bytes have CRC-32 {HEX}, the save recorded {HEX}$")
  assert error.leaves == (".data['obs']",)
  # verify=False reads the damaged bytes as they are (to salvage them).
  got = jr.restore_rollout(path, _target(), verify=False)
  assert not np.array_equal(np.asarray(got.data["obs"]),
                            np.asarray(state.data["obs"]))
  np.testing.assert_array_equal(np.asarray(got.data["done"]),
                                np.asarray(state.data["done"]))


@pytest.mark.parametrize("damage, match", [
    (_truncate, r"is (\d+) bytes, shorter than the (\d+) bytes the save "
     "wrote$"),
    (os.remove, r"is missing \(the save wrote \d+ bytes\)$"),
], ids=["truncated", "deleted"])
def test_a_data_file_cut_short_or_deleted_is_named(saved, damage, match):
  path, _, _ = saved
  name = _largest(path)
  damage(path / name)
  error = _damaged(path, _target(), rf"\n  {OBS_LEAF}: file {name} {match}")
  assert error.leaves == (".data['obs']",)
  # Without the records (verify=False), the OCDBT index tells the same.
  with pytest.raises(jr.CorruptCheckpointError, match=rf"{OBS_LEAF}: file "
                     rf"{name} (is missing|is \d+ bytes, shorter than the "
                     r"\d+ bytes its index refers to)$"):
    jr.restore_rollout(path, _target(), verify=False)


def _as_version_1(path):
  """Makes a checkpoint look written before checksums (format version 1,
  no checksums entry, no jrollout_checksums/), as jrollout wrote them."""
  meta = json.loads((path / "_METADATA").read_text())
  del meta["custom_metadata"]["checksums"]
  meta["custom_metadata"]["version"] = 1
  (path / "_METADATA").write_text(json.dumps(meta))
  shutil.rmtree(path / "jrollout_checksums")
  return meta


def test_a_failed_read_is_named_without_a_driver_dump(tmp_path, monkeypatch):
  """The last line of defence: a read that fails in TensorStore (here: an
  old checkpoint, and an index this code does not understand)."""
  jr.save_rollout(tmp_path / "ckpt", {"w": np.ones(1000, np.float32)})
  _as_version_1(tmp_path / "ckpt")
  os.remove(tmp_path / "ckpt" / _largest(tmp_path / "ckpt"))
  monkeypatch.setattr(checkpoint_damage, "_index_refs", lambda *args: [])
  with pytest.warns(UserWarning, match="without checksums"):
    error = _damaged(tmp_path / "ckpt", {"w": np.zeros(1000, np.float32)},
                     r"\n  leaf \['w'\]: cannot be read \([A-Z_]+: .*\)$")
  assert error.leaves == ("['w']",)


@pytest.mark.parametrize("damage, match", [
    (lambda p: p.write_text("{not json"),
     r"its metadata file _METADATA cannot be read \(JSONDecodeError: "),
    (lambda p: _flip(p, length=4),
     r"its metadata file _METADATA cannot be read \(UnicodeDecodeError: "),
    (lambda p: p.write_text(p.read_text().replace('"num_envs": 16',
                                                  '"num_envs": 61')),
     rf"metadata file _METADATA differs from what the save wrote \(CRC-32 "
     rf"{HEX}, recorded {HEX}\)"),
    (os.remove, r"its metadata file _METADATA is missing \(it holds "),
], ids=["garbage", "flipped", "valid-json", "deleted"])
def test_unreadable_metadata_is_named(saved, damage, match):
  path, _, _ = saved
  damage(path / "_METADATA")
  error = _damaged(path, _target(), rf"\n  {match}")
  assert error.leaves == ()


@pytest.mark.parametrize("name, damage, match", [
    ("jrollout_checksums/process_0.json", os.remove,
     r"its checksum record jrollout_checksums/process_0\.json is missing"),
    ("jrollout_checksums/index.json", lambda p: _flip(p, 0, 1),
     r"its checksum record jrollout_checksums/index\.json cannot be read"),
    ("manifest.ocdbt", _truncate,
     r"index file manifest\.ocdbt is \d+ bytes, shorter than the \d+"),
    ("array_metadatas/process_0", lambda p: _flip(p, length=1),
     r"metadata file array_metadatas/process_0 differs from what the save "
     r"wrote"),
], ids=["record-deleted", "record-flipped", "index-truncated",
        "array-metadata-flipped"])
def test_damaged_records_and_indexes_are_named(saved, name, damage, match):
  path, _, _ = saved
  damage(path / name)
  _damaged(path, _target(), rf"\n  {match}")


def test_several_damages_are_listed(tmp_path):
  tree = {f"w{i}": np.full((600,), i, np.float32) for i in range(6)}
  jr.save_rollout(tmp_path / "ckpt", tree)
  record = json.loads((tmp_path / "ckpt" / "jrollout_checksums" /
                       "process_0.json").read_text())
  # Flip a byte of every leaf: each one's bytes are in a data file.
  restored = jr.restore_rollout(tmp_path / "ckpt", tree)
  for leaf in jax.tree_util.tree_leaves(restored):
    assert isinstance(leaf, np.ndarray)
  for name in record["files"]:
    if name.startswith("ocdbt.process_0/d/"):
      path = tmp_path / "ckpt" / name
      with open(path, "rb") as f:
        data = f.read()
      for i in range(6):   # each leaf is 600 floats equal to i
        at = data.find(np.full(600, i, np.float32).tobytes())
        if at >= 0:
          _flip(path, at + 8, 1)
  error = _damaged(tmp_path / "ckpt", tree, r"\n  ... and 2 more$")
  assert sorted(error.leaves) == [f"['w{i}']" for i in range(6)]
  assert len(error.problems) == 6
  assert all(re.match(r"leaf \['w\d'\]: checksum mismatch: its bytes", p)
             for p in error.problems)


def test_the_error_pickles_and_names_its_parts(saved):
  path, _, _ = saved
  _flip(path / _largest(path))
  with pytest.raises(jr.CorruptCheckpointError) as info:
    jr.restore_rollout(path, _target())
  again = pickle.loads(pickle.dumps(info.value))
  assert type(again) is jr.CorruptCheckpointError
  assert str(again) == str(info.value)
  assert (again.directory, again.leaves, again.problems) == (
      info.value.directory, info.value.leaves, info.value.problems)


def test_restoring_without_a_target_is_verified_too(saved):
  path, state, _ = saved
  got = jr.restore_rollout(path)
  np.testing.assert_array_equal(got["data"]["obs"], np.asarray(
      state.data["obs"]))
  _flip(path / _largest(path))
  with pytest.raises(jr.CorruptCheckpointError, match=rf"{OBS_LEAF}: "
                     "checksum mismatch"):
    jr.restore_rollout(path)


@pytest.mark.parametrize("verify", ["no", 1, None])
def test_verify_must_be_a_bool(saved, verify):
  path, _, _ = saved
  with pytest.raises(TypeError, match=r"restore_rollout: `verify` must be "
                     rf"True or False, got {type(verify).__name__} "
                     rf"{re.escape(repr(verify))}$"):
    jr.restore_rollout(path, _target(), verify=verify)


def test_a_checkpoint_without_checksums_restores_with_a_warning(saved):
  """As jrollout wrote them before checksums: format version 1, no
  ``checksums`` entry, no jrollout_checksums/."""
  path, state, ref = saved
  meta = _as_version_1(path)
  custom = meta["custom_metadata"]
  with pytest.warns(UserWarning, match=rf"restore_rollout: checkpoint {path} "
                    r"was written by an older jrollout, without checksums: it "
                    r"is restored unverified"):
    restored = jr.restore_rollout(path, _target())
  reference.assert_state_equals(restored, ref)
  assert_same_leaves(restored, state, shardings=False)
  # A version-2 checkpoint that lost its checksums entry is damaged.
  custom["version"] = 2
  (path / "_METADATA").write_text(json.dumps(meta))
  _damaged(path, _target(), r"its metadata file _METADATA has no checksums "
           r"entry")


# ------------------------------------------------ 8 devices, sharded


@pytest.mark.skipif(jax.device_count() < D, reason=f"needs {D} devices")
def test_a_sharded_state_records_and_checks_each_shard(tmp_path):
  mesh = envs_mesh(D)
  state, ref = _state(1, mesh)
  jr.save_rollout(tmp_path / "ckpt", state)
  record = json.loads((tmp_path / "ckpt" / "jrollout_checksums" /
                       "process_0.json").read_text())
  obs = np.asarray(state.data["obs"])
  shards = record["leaves"][".data['obs']"]
  assert len(shards) == D
  for (t, e, o), crc in shards:
    assert t == [0, T] and o == [0, OBS] and e[1] - e[0] == E // D
    assert crc == zlib.crc32(obs[:, e[0]:e[1]].tobytes())
  restored = jr.restore_rollout(tmp_path / "ckpt", _target(mesh))
  reference.assert_state_equals(restored, ref)
  assert restored.data["obs"].sharding.is_equivalent_to(
      NamedSharding(mesh, P(None, "envs")), 3)
  # The same checkpoint onto one device: the shards are assembled to check.
  single = jr.restore_rollout(tmp_path / "ckpt", _target())
  reference.assert_state_equals(single, ref)


@pytest.mark.skipif(jax.device_count() < D, reason=f"needs {D} devices")
@pytest.mark.parametrize("damage, match", [
    (_flip, rf"{OBS_LEAF}: checksum mismatch in shard \[0:{T}, \d+:\d+, "
     rf"0:{OBS}\]: its bytes have CRC-32 {HEX}, the save recorded {HEX}$"),
    (_truncate, rf"{OBS_LEAF}: file ocdbt\.process_0/d/[0-9a-f]+ is \d+ "
     r"bytes, shorter than the \d+ bytes the save wrote$"),
    (os.remove, rf"{OBS_LEAF}: file ocdbt\.process_0/d/[0-9a-f]+ is missing"),
], ids=["flipped", "truncated", "deleted"])
@pytest.mark.parametrize("onto", ["mesh", "one-device"])
def test_a_damaged_sharded_checkpoint_is_refused(tmp_path, damage, match,
                                                 onto):
  mesh = envs_mesh(D)
  state, _ = _state(2, mesh)
  jr.save_rollout(tmp_path / "ckpt", state)
  damage(tmp_path / "ckpt" / _largest(tmp_path / "ckpt"))
  target = _target(mesh if onto == "mesh" else None)
  error = _damaged(tmp_path / "ckpt", target, rf"\n  {match}")
  assert error.leaves == (".data['obs']",)
  if damage is not _flip:   # named from the index, before any read
    with pytest.raises(jr.CorruptCheckpointError, match=rf"{OBS_LEAF}: file "
                       r"ocdbt\.process_0/d/[0-9a-f]+ is "):
      jr.restore_rollout(tmp_path / "ckpt", target, verify=False)


@pytest.mark.skipif(jax.device_count() < D, reason=f"needs {D} devices")
def test_damaged_metadata_of_a_sharded_checkpoint_is_refused(tmp_path):
  mesh = envs_mesh(D)
  jr.save_rollout(tmp_path / "ckpt", _state(3, mesh)[0])
  (tmp_path / "ckpt" / "_METADATA").write_bytes(b"\x00" * 10)
  _damaged(tmp_path / "ckpt", _target(mesh),
           r"its metadata file _METADATA cannot be read")


# -------------------------------------------------- CheckpointManager


def test_a_checkpoint_manager_item_is_verified(tmp_path):
  state, ref = _state(4)
  options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
  with ocp.CheckpointManager(tmp_path / "run", options=options) as mngr:
    mngr.save(1, args=ocp.args.Composite(rollout=jr.RolloutSave(state)))
    mngr.wait_until_finished()
    item = tmp_path / "run" / "1" / "rollout"
    got = mngr.restore(1, args=ocp.args.Composite(
        rollout=jr.RolloutRestore(_target())))
    reference.assert_state_equals(got["rollout"], ref)
    _flip(item / _largest(item))
    with pytest.raises(jr.CorruptCheckpointError, match=(
        rf"RolloutRestore: damaged checkpoint {item}; nothing was restored"
        rf"\n  {OBS_LEAF}: checksum mismatch")):
      mngr.restore(1, args=ocp.args.Composite(
          rollout=jr.RolloutRestore(_target())))
    got = mngr.restore(1, args=ocp.args.Composite(
        rollout=jr.RolloutRestore(_target(), verify=False)))
    assert not np.array_equal(np.asarray(got["rollout"].data["obs"]),
                              np.asarray(state.data["obs"]))


# ------------------------------------------------- every file, every way


def _runner():
  """A runner holding every kind of leaf, each large enough to be written
  to a data file (OCDBT keeps values under 1 KiB in its index)."""
  state, _ = _state(5)
  return {"rollout": state, "key": jax.random.split(jax.random.key(1), 200),
          "w": np.arange(600, dtype=np.float32), "step": 7, "lr": 0.5}


DAMAGES = {
    "flip": _flip,
    "first-bit": lambda p: _flip(p, 0, 1) if os.path.getsize(p) else None,
    "last-bit": lambda p: _flip(p, os.path.getsize(p) - 1, 1)
    if os.path.getsize(p) else None,
    "half": _truncate,
    "empty": lambda p: _truncate(p, 0),
    "delete": os.remove,
}


@pytest.mark.parametrize("kind", ["single", "sharded", "runner"])
def test_every_damage_to_every_file_is_refused_or_harmless(tmp_path, kind):
  """Each file of a checkpoint, damaged each way in turn: the restore
  returns exactly what was saved (the damage hit nothing it reads) or
  raises CorruptCheckpointError; never anything else, never other data."""
  if kind == "sharded" and jax.device_count() < D:
    pytest.skip(f"needs {D} devices")
  mesh = envs_mesh(D) if kind == "sharded" else None
  item = _runner() if kind == "runner" else _state(6, mesh)[0]
  target = (item if kind == "runner" else _target(mesh))
  jr.save_rollout(tmp_path / "ckpt", item)
  refused = set()
  for name in _files(tmp_path / "ckpt"):
    for damage in DAMAGES.values():
      copy = tmp_path / "copy"
      shutil.rmtree(copy, ignore_errors=True)
      shutil.copytree(tmp_path / "ckpt", copy)
      damage(copy / name)
      try:
        got = jr.restore_rollout(copy, target)
      except jr.CorruptCheckpointError as e:
        assert "TensorStore" not in str(e) and len(str(e)) < 1200, str(e)
        refused.add(name)
        continue
      assert_same_leaves(got, item, shardings=False)
  # Every data, metadata and index file orbax reads is protected.
  files = set(_files(tmp_path / "ckpt"))
  assert {"_METADATA", "manifest.ocdbt", "array_metadatas/process_0",
          "jrollout_checksums/process_0.json",
          "jrollout_checksums/index.json"} <= refused
  assert {f for f in files if f.startswith(("d/", "ocdbt.process_0/d/"))
          } <= refused


# ------------------------------------------------------------ property


@st.composite
def _damage(draw):
  return (draw(st.integers(0, 10**6)), draw(st.sampled_from(
      ["flip", "bit", "truncate", "delete", "zero", "append"])),
      draw(st.integers(0, 10**9)), draw(st.integers(1, 64)))


@given(spec_seed=st.integers(0, 2**16), num_envs=st.sampled_from([8, 16]),
       obs=st.sampled_from([1, 40, 300]), damages=st.lists(_damage(),
                                                           max_size=2))
def test_property_a_restore_returns_what_was_saved_or_raises(
    spec_seed, num_envs, obs, damages):
  rng = np.random.default_rng(spec_seed)
  spec = {"obs": ((obs,), jnp.float32), "a": ((), jnp.int32)}
  state, ref = reference.make_pair(spec, num_envs, 3)
  for step in range(3):
    state = jr.update_at(state, step, {
        k: reference.random_value(rng, (num_envs, *shape), dtype)
        for k, (shape, dtype) in spec.items()})
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "ckpt")
    jr.save_rollout(path, state)
    for pick, how, at, length in damages:
      files = [f for f in _files(path)]
      name = os.path.join(path, files[pick % len(files)])
      if not os.path.exists(name):
        continue
      size = os.path.getsize(name)
      if how == "flip" and size:
        _flip(name, at % size, length)
      elif how == "bit" and size:
        _flip(name, at % size, 1)
      elif how == "truncate":
        _truncate(name, at % (size + 1))
      elif how == "delete":
        os.remove(name)
      elif how == "zero" and size:
        with open(name, "r+b") as f:
          f.seek(at % size)
          f.write(b"\x00" * length)
      elif how == "append":
        with open(name, "ab") as f:
          f.write(b"\x01" * length)
    target = reference.make_pair(spec, num_envs, 3)[0]
    try:
      got = jr.restore_rollout(path, target)
    except jr.CorruptCheckpointError as e:
      assert e.directory == path and e.problems
      return
  assert_same_leaves(got, state, shardings=False)


# --------------------------------------------------- the CRC-32 itself


@given(sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=4),
       block=st.integers(1, 700), seed=st.integers(0, 2**16))
def test_property_block_crcs_combine_to_zlibs(sizes, block, seed):
  rng = np.random.default_rng(seed)
  arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
  old = checksums._BLOCK, checksums._WORKERS
  try:
    checksums._BLOCK, checksums._WORKERS = block, 3
    assert checksums.crcs(arrays) == [zlib.crc32(a.tobytes())
                                       for a in arrays]
  finally:
    checksums._BLOCK, checksums._WORKERS = old
