"""Checkpoints written by an earlier jrollout still restore.

``tests/data/checkpoint_v2`` (``jr.save_rollout``) and
``tests/data/manager_v2`` (step 1 of an ``ocp.CheckpointManager``, item
``rollout`` saved with ``jr.RolloutSave``) were written by jrollout at git
revision 98d6c44 (format version 2: with checksums) and orbax-checkpoint
0.12.8, both of ``_item()`` below (14 KB in all). They pin the on-disk
format: the record in orbax's custom metadata, the checksum records, and
the handler's type string in the manager's step metadata.
"""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jrollout as jr
from tests import reference
from tests._helpers import ROOT

DATA = ROOT / "tests" / "data"


def _item():
  """What the fixtures hold: a half-written rollout (step 1 never written),
  a NumPy array, a typed PRNG key and a Python int."""
  state = jr.register(jr.register(jr.init(2, 3), "obs", (2,)), "done", (),
                      jnp.bool_)
  state = jr.update_at(state, 0, {"obs": jnp.arange(4.0).reshape(2, 2),
                                  "done": jnp.array([True, False])})
  state = jr.update_at(state, 2, {"obs": -jnp.ones((2, 2)),
                                  "done": jnp.array([False, True])})
  return {"rollout": state, "w": np.arange(3, dtype=np.float64),
          "key": jax.random.key(3), "step": 5}


def _reference():
  """The rollout of ``_item()``, written into the NumPy model."""
  ref = reference.NumpyBuffer(2, 3)
  ref.register("obs", (2,))
  ref.register("done", (), np.bool_)
  ref.update_at(0, {"obs": np.arange(4.0, dtype=np.float32).reshape(2, 2),
                    "done": np.array([True, False])})
  ref.update_at(2, {"obs": -np.ones((2, 2), np.float32),
                    "done": np.array([False, True])})
  return ref


def _check(got):
  reference.assert_state_equals(got["rollout"], _reference())
  np.testing.assert_array_equal(got["w"], np.arange(3, dtype=np.float64))
  assert isinstance(got["w"], np.ndarray) and got["w"].dtype == np.float64
  assert jax.dtypes.issubdtype(got["key"].dtype, jax.dtypes.prng_key)
  np.testing.assert_array_equal(jax.random.key_data(got["key"]),
                                jax.random.key_data(jax.random.key(3)))
  assert type(got["step"]) is int and got["step"] == 5
  with pytest.raises(jr.IncompleteRolloutError):   # still half-written
    jr.make_batch(got["rollout"])


@pytest.mark.parametrize("verify", [True, False])
def test_a_checkpoint_of_format_version_2_restores(tmp_path, verify):
  path = shutil.copytree(DATA / "checkpoint_v2", tmp_path / "ckpt")
  _check(jr.restore_rollout(path, _item(), verify=verify))


def test_a_checkpoint_manager_step_of_format_version_2_restores(tmp_path):
  path = shutil.copytree(DATA / "manager_v2", tmp_path / "mngr")
  with ocp.CheckpointManager(path) as mngr:
    assert mngr.latest_step() == 1
    got = mngr.restore(1, args=ocp.args.Composite(
        rollout=jr.RolloutRestore(_item())))
  _check(got.rollout)


def test_a_manager_step_restores_without_args_by_its_recorded_handler(
    tmp_path):
  """orbax finds the handler of an item restored without args by the type
  string the step recorded (``jrollout._checkpoint.RolloutCheckpointHandler``
  since 0.1): jrollout's handler must still answer to it. It does, and
  refuses the item's PRNG key without a target, as a restore without a
  target does."""
  path = shutil.copytree(DATA / "manager_v2", tmp_path / "mngr")
  recorded = json.loads((path / "1" / "_CHECKPOINT_METADATA").read_text())
  assert recorded["item_handlers"] == {
      "rollout": "jrollout._checkpoint.RolloutCheckpointHandler"}
  with ocp.CheckpointManager(path) as mngr:
    with pytest.raises(ValueError, match=r"^RolloutRestore: leaf \['key'\] "
                       r"is a PRNG key array \(key<fry>\); restore it with a "
                       "target$"):
      mngr.restore(1)

def test_the_checksums_of_a_checkpoint_of_format_version_2_are_checked(
    tmp_path):
  """Its checksum records are still read and checked against the bytes
  read: a CRC-32 that differs from the bytes of ``w`` names that leaf."""
  path = shutil.copytree(DATA / "checkpoint_v2", tmp_path / "ckpt")
  record = path / "jrollout_checksums" / "process_0.json"
  content = json.loads(record.read_text())
  [[region, crc]] = content["leaves"]["['w']"]
  assert region == [[0, 3]]
  content["leaves"]["['w']"] = [[region, crc ^ 1]]
  record.write_text(json.dumps(content))
  with pytest.raises(jr.CorruptCheckpointError,
                     match=r"leaf \['w'\]: checksum mismatch: ") as info:
    jr.restore_rollout(path, _item())
  assert info.value.leaves == ("['w']",)
  _check(jr.restore_rollout(path, _item(), verify=False))
