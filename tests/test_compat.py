"""Tests of jrollout.compat against the functional API and numpy models."""

import subprocess
import sys
import warnings

import chex
from hypothesis import given
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jrollout as jr
from jrollout.compat import DictDataset
from jrollout.compat import ExperienceBuffer
from tests import reference
from tests._helpers import random_batch as _batch
from tests.reference import NumpyBuffer
from tests.reference import random_value


# --- numpy models of the original classes ------------------------------------


class OriginalBuffer(NumpyBuffer):
  """NumpyBuffer plus the original's running sum of written step indices."""

  def __init__(self, num_envs, num_steps):
    super().__init__(num_envs, num_steps)
    self.index_sum = 0

  def update_at(self, step, values):
    super().update_at(step, values)
    self.index_sum += step * len(values)

  def update_all(self, values):
    super().update_all(values)
    self.index_sum += len(values) * self.T * (self.T - 1) // 2

  def make_batch(self):
    self.index_sum = 0
    return super().make_batch()

  def problems(self):
    """{key: (missing steps, duplicated steps)} of the exact check."""
    out = {}
    for k, c in self.counts.items():
      missing, dup = np.flatnonzero(c == 0), np.flatnonzero(c > 1)
      if len(missing) or len(dup):
        out[k] = (missing.tolist(), dup.tolist())
    return out


class NumpyDictDataset:
  """The original DictDataset, with the order given instead of drawn."""

  def __init__(self, batch_size, tensor_dict, order=None):
    self.data = {k: np.asarray(v) for k, v in tensor_dict.items()}
    self.n = max(len(v) for v in self.data.values())
    assert self.n % batch_size == 0
    self.b = batch_size
    self.order = np.arange(self.n) if order is None else np.asarray(order)

  def __len__(self):
    return self.n // self.b

  def __getitem__(self, j):
    idx = self.order[j * self.b:(j + 1) * self.b]
    return {k: v[idx % len(v)] for k, v in self.data.items()}


# --- helpers -----------------------------------------------------------------


def _pair(spec, num_envs=3, num_steps=4):
  buf, ref = ExperienceBuffer(num_envs, num_steps), OriginalBuffer(
      num_envs, num_steps)
  for key, (shape, dtype) in spec.items():
    buf.register_key(key, shape, dtype)
    ref.register(key, shape, dtype)
  return buf, ref


def _assert_dict_equal(got, expected):
  chex.assert_trees_all_equal(
      {k: np.asarray(v) for k, v in got.items()},
      {k: np.asarray(v) for k, v in expected.items()})


def _assert_buffer_equals(buf, ref):
  for k in ref.storage:
    np.testing.assert_array_equal(np.asarray(getattr(buf, k)), ref.storage[k])
    counts = jr.write_counts(buf.state)[k].per_step
    np.testing.assert_array_equal(np.asarray(counts), ref.counts[k])
  assert buf.total_sum() == ref.index_sum


def _fill(buf, ref, rng, steps=None):
  """Writes the given (default: all) steps of every key of ``ref``."""
  for t in range(ref.T) if steps is None else steps:
    for k, v in ref.storage.items():
      value = random_value(rng, (ref.E, *v.shape[2:]), v.dtype)
      buf.update_data(k, t, value)
      ref.update_at(t, {k: value})


SPEC = {"obs": ((2,), jnp.float32), "act": ((), jnp.int32)}


# --- ExperienceBuffer --------------------------------------------------------


def test_register_key_storage_and_attribute_access(transition_spec):
  buf, ref = _pair(transition_spec, num_envs=2, num_steps=3)
  for k, (shape, dtype) in transition_spec.items():
    arr = getattr(buf, k)
    assert arr is buf.state.data[k]
    assert arr.shape == (3, 2, *shape) and arr.dtype == dtype
    assert not np.asarray(arr).any()
  assert buf.state.names == tuple(sorted(transition_spec))
  assert (buf.num_envs, buf.num_steps, buf.device) == (2, 3, None)
  assert "obs" in dir(buf)
  assert repr(buf).startswith("ExperienceBuffer(num_envs=2, num_steps=3")
  with pytest.raises(AttributeError, match=r"no attribute or registered key "
                     r"'missing' \(registered keys: 'action', 'done'"):
    _ = buf.missing
  with pytest.raises(AttributeError, match="cannot set attribute 'obs'; "
                     "write storage with update_data"):
    buf.obs = np.zeros((3, 2, 3), np.float32)
  _assert_buffer_equals(buf, ref)
  buf.register_key("r")   # the defaults, an int shape, a dtype's name
  buf.register_key("a", 4, "int32")
  assert buf.r.shape == (3, 2) and buf.r.dtype == jnp.float32
  assert buf.a.shape == (3, 2, 4) and buf.a.dtype == jnp.int32


@pytest.mark.parametrize("num_envs", [1, 3])
def test_writes_and_make_dict_match_functional_and_numpy(num_envs,
                                                         transition_spec):
  rng = np.random.default_rng(num_envs)
  buf, ref = _pair(transition_spec, num_envs=num_envs, num_steps=4)
  state = jr.init(num_envs, 4)
  for k, (shape, dtype) in transition_spec.items():
    state = jr.register(state, k, shape, dtype)
  for t in range(4):
    for k, (shape, dtype) in transition_spec.items():
      if k == "image":
        continue
      value = random_value(rng, (num_envs, *shape), dtype)
      if t % 2:
        value = jnp.asarray(value)  # JAX and numpy inputs alike.
      buf.update_data(k, t, value)
      ref.update_at(t, {k: value})
      state = jr.update_at(state, t, {k: value})
  image = random_value(rng, (4, num_envs, 2, 2), np.uint8)
  buf.batch_update_data("image", image)
  ref.update_all({"image": image})
  state = jr.update_all(state, {"image": image})
  _assert_buffer_equals(buf, ref)
  assert buf.total_sum() == len(transition_spec) * 6

  batch = buf.make_dict()
  expected, _ = jr.make_batch(state)
  _assert_dict_equal(batch, ref.make_batch())
  _assert_dict_equal(batch, expected)
  for k, v in batch.items():
    assert v.shape == (num_envs * 4, *transition_spec[k][0])
    assert v.dtype == transition_spec[k][1] and isinstance(v, jax.Array)
  # Tracking was reset, the storage kept its values.
  assert buf.total_sum() == 0
  _assert_buffer_equals(buf, ref)
  # The batch is independent: the next in-place writes leave it intact.
  _fill(buf, ref, rng, steps=[0])
  assert not any(v.is_deleted() for v in batch.values())
  _assert_dict_equal(batch, expected)


def test_total_sum_cannot_tell_an_incomplete_rollout_but_make_dict_can():
  buf = _pair(SPEC, num_envs=2, num_steps=4)[0]
  for t in (0, 3, 3):   # 0 + 3 + 3 == 0 + 1 + 2 + 3, steps 1, 2 missing
    buf.update_data("obs", t, np.ones((2, 2), np.float32))
  buf.batch_update_data("act", np.ones((4, 2), np.int32))
  assert buf.total_sum() == 2 * 6   # the original's complete number
  with pytest.raises(jr.IncompleteRolloutError):
    buf.make_dict()
  assert buf.total_sum() == 12  # A failed make_dict resets nothing.


@given(ops=st.lists(st.tuples(st.sampled_from(["obs", "act", "all_act"]),
                              st.integers(0, 3)), max_size=12),
       seed=st.integers(0, 2**16))
def test_property_random_writes_match_original(ops, seed):
  rng = np.random.default_rng(seed)
  buf, ref = _pair(SPEC, num_envs=2, num_steps=4)
  for key, step in ops:
    if key == "all_act":
      value = random_value(rng, (4, 2), np.int32)
      buf.batch_update_data("act", value)
      ref.update_all({"act": value})
    else:
      shape, dtype = SPEC[key]
      value = random_value(rng, (2, *shape), dtype)
      buf.update_data(key, step, value)
      ref.update_at(step, {key: value})
  _assert_buffer_equals(buf, ref)
  problems = ref.problems()
  if problems:
    with pytest.raises(jr.IncompleteRolloutError) as info:
      buf.make_dict()
    message = str(info.value)
    assert message.startswith("ExperienceBuffer.make_dict: make_batch: the "
                              "rollout is not complete")
    for k, (_missing, dup) in problems.items():
      assert f"field {k!r}" in message
      for t in dup:
        assert f"{t} (x{int(ref.counts[k][t])})" in message
    assert ("missing steps" in message) == any(
        p[0] for p in problems.values())
    _assert_buffer_equals(buf, ref)  # Unchanged by the failed call.
  else:
    _assert_dict_equal(buf.make_dict(), ref.make_batch())
    _assert_buffer_equals(buf, ref)


def test_make_dict_incomplete_names_key_and_steps_then_recovers():
  rng = np.random.default_rng(1)
  buf, ref = _pair(SPEC, num_envs=2, num_steps=5)
  _fill(buf, ref, rng, steps=[0, 3, 4])
  value = random_value(rng, (2,), np.int32)
  buf.update_data("act", 3, value)
  ref.update_at(3, {"act": value})
  with pytest.raises(jr.IncompleteRolloutError,
                     match=r"(?s)^ExperienceBuffer\.make_dict: make_batch: "
                     r"the rollout is not complete.*field 'act': missing steps "
                     r"\[1-2\]; duplicated steps 3 \(x2\)\n  field 'obs': "
                     r"missing steps \[1-2\]$"):
    buf.make_dict()
  _assert_buffer_equals(buf, ref)
  # Fill in the gaps: still refused (act step 3 twice), until a fresh rollout.
  _fill(buf, ref, rng, steps=[1, 2])
  with pytest.raises(jr.IncompleteRolloutError, match=r"duplicated steps 3"):
    buf.make_dict()
  fresh = _pair(SPEC, num_envs=2, num_steps=3)[0]
  with pytest.raises(jr.IncompleteRolloutError,
                     match=r"field 'obs': missing steps \[0-2\]"):
    fresh.make_dict()


def test_update_data_is_in_place_and_state_is_always_current():
  rng = np.random.default_rng(2)
  buf, ref = _pair(SPEC, num_envs=2, num_steps=3)
  old_obs, old_state = buf.obs, buf.state
  _fill(buf, ref, rng, steps=[0])
  # Documented: update_data donates, so arrays taken before it are deleted.
  assert old_obs.is_deleted() and old_state.counts.is_deleted()
  assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(buf.state))
  _assert_buffer_equals(buf, ref)
  # batch_update_data is the pure update_all: nothing is deleted.
  before = buf.state
  buf.batch_update_data("act", np.ones((3, 2), np.int32))
  assert not before.data["act"].is_deleted()


ERRORS = [
    (lambda b: b.update_data("obs", 0, np.ones((3, 2), np.float32)),
     ValueError, r"^ExperienceBuffer\.update_data: field "
     r"'obs' has shape \(3, 2\), expected \(2, 2\) = \[E\] \+ \(2,\)$"),
    (lambda b: b.update_data("act", 0, np.ones(2, np.float32)), TypeError,
     r"^ExperienceBuffer\.update_data: field 'act' has "
     "dtype float32, which cannot be cast safely"),
    (lambda b: b.update_data("obs", 3, np.ones((2, 2))), IndexError,
     r"^ExperienceBuffer\.update_data: step 3 is outside "
     r"the rollout \[0, 3\)"),
    (lambda b: b.update_data("obs", -1, np.ones((2, 2))), IndexError,
     r"step -1 is outside the rollout"),
    (lambda b: b.update_data("obs", 0.0, np.ones((2, 2))), TypeError,
     r"^ExperienceBuffer\.update_data: `step`"),
    (lambda b: b.update_data("rew", 0, np.ones(2)), KeyError,
     r"ExperienceBuffer\.update_data: key 'rew' is not registered "
     r"\(registered: 'act', 'obs'\); call register_key\('rew'"),
    (lambda b: b.batch_update_data("obs", np.ones((2, 2, 2))), ValueError,
     r"^ExperienceBuffer\.batch_update_data: update_all: field 'obs' has shape "
     r"\(2, 2, 2\), expected \(3, 2, 2\) = \[T, E\] \+ \(2,\)$"),
    (lambda b: b.batch_update_data("nope", np.ones((3, 2))), KeyError,
     r"ExperienceBuffer\.batch_update_data: key 'nope' is not registered"),
    (lambda b: b.register_key("obs", (2,)), ValueError,
     r"^ExperienceBuffer\.register_key: register: field 'obs' is already "
     r"registered \(shape \(2,\), dtype float32\)"),
    (lambda b: b.register_key("x", (-1,)), ValueError,
     r"^ExperienceBuffer\.register_key: register: field 'x': `shape` must be "
     "non-negative"),
    (lambda b: b.register_key(3), TypeError,
     r"^ExperienceBuffer\.register_key: register: `name` must be a str"),
    (lambda b: b.register_key("x", (), "float64"), TypeError,
     r"dtype float64 is not available with jax_enable_x64 disabled"),
]


@pytest.mark.parametrize("call, exc, match", ERRORS)
def test_errors_name_the_method_and_leave_the_buffer_unchanged(call, exc,
                                                               match):
  rng = np.random.default_rng(3)
  buf, ref = _pair(SPEC, num_envs=2, num_steps=3)
  _fill(buf, ref, rng, steps=[0])
  with pytest.raises(exc, match=match):
    call(buf)
  assert buf.state.names == ("act", "obs")
  _assert_buffer_equals(buf, ref)
  _fill(buf, ref, rng, steps=[1, 2])  # The buffer still works.
  _assert_dict_equal(buf.make_dict(), ref.make_batch())


def test_device_places_storage_and_writes():
  devices = jax.devices()
  assert ExperienceBuffer(2, 3, "cpu").device == jax.devices("cpu")[0]
  if len(devices) < 2:
    pytest.skip("needs two devices")
  assert ExperienceBuffer(2, 3, "cpu:1").device == devices[1]
  buf = ExperienceBuffer(2, 3, device=devices[1])
  buf.register_key("obs", (2,))
  buf.update_data("obs", 0, np.ones((2, 2), np.float32))
  buf.update_data("obs", 1, jax.device_put(jnp.ones((2, 2)), devices[0]))
  buf.update_data("obs", 2, jnp.ones((2, 2)))
  buf.register_key("act", (), jnp.int32)
  buf.batch_update_data("act", np.ones((3, 2), np.int32))
  assert buf.obs.devices() == {devices[1]} == buf.act.devices()
  batch = buf.make_dict()
  assert all(v.devices() == {devices[1]} for v in batch.values())
  np.testing.assert_array_equal(batch["obs"], np.ones((6, 2)))


# --- state_dict --------------------------------------------------------------


def _filled(spec, steps=(0, 1)):
  """A 3-env, 4-step buffer and its model, ``steps`` of every key written."""
  buf, ref = _pair(spec)
  _fill(buf, ref, np.random.default_rng(6), steps)
  return buf, ref


def test_state_dict_round_trips_through_orbax_and_numpy(tmp_path,
                                                        transition_spec):
  buf, ref = _filled(transition_spec)
  sd = buf.state_dict()
  assert set(sd) == {"num_envs", "num_steps", "data", "counts",
                     "out_of_range"}
  assert (sd["num_envs"], sd["num_steps"]) == (3, 4)
  # Later writes donate the buffer's arrays; the state_dict keeps its own.
  buf.update_data("obs", 2, np.ones((3, 3), np.float32))
  np.testing.assert_array_equal(np.asarray(sd["data"]["obs"]),
                                ref.storage["obs"])
  jr.save_rollout(tmp_path / "sd", sd)
  fresh, _ = _filled(transition_spec, steps=())
  fresh.load_state_dict(jr.restore_rollout(tmp_path / "sd",
                                           fresh.state_dict()))
  reference.assert_state_equals(fresh.state, ref)
  # From numpy copies (as a torch user's pickled dict would come back).
  other, _ = _filled(transition_spec, steps=())
  other.load_state_dict(jax.tree_util.tree_map(np.asarray, sd))
  reference.assert_state_equals(other.state, ref)


def test_state_dict_round_trips_through_torch_save(tmp_path):
  torch = pytest.importorskip("torch")
  from jrollout.torch import to_torch  # noqa: PLC0415 - torch is optional
  buf, ref = _filled(SPEC)
  torch.save(to_torch(buf.state_dict(), copy=True), tmp_path / "buf.pt")
  fresh, _ = _filled(SPEC, steps=())
  fresh.load_state_dict(torch.load(tmp_path / "buf.pt"))
  reference.assert_state_equals(fresh.state, ref)


@pytest.mark.parametrize("change, match", [
    (lambda sd: sd.update(num_envs=5),
     (r"load_state_dict: the RolloutState at the root: the state_dict holds "
      r"num_envs \(E\) 5, .*, the buffer expects num_envs \(E\) 3")),
    (lambda sd: sd["data"].pop("act"),
     r"the state_dict holds .*fields \['obs'\], the buffer expects .*fields "
     r"\['act', 'obs'\]"),
    (lambda sd: sd["data"].update(extra=np.zeros((4, 3), np.float32)),
     r"the state_dict holds .*fields \['act', 'extra', 'obs'\], the buffer"),
    (lambda sd: sd["data"].update(obs=np.zeros((4, 3, 2), np.int32)),
     (r"leaf \.data\['obs'\]: the state_dict holds shape \(4, 3, 2\) "
      r"int32, the buffer expects shape \(4, 3, 2\) float32")),
    (lambda sd: sd.pop("counts"), r"the state_dict has no 'counts' entry"),
    (lambda sd: sd.update(more=1), r"unknown entry 'more'"),
], ids=["E", "missing", "extra", "dtype", "no-counts", "unknown"])
def test_load_state_dict_refuses_mismatches_and_changes_nothing(change,
                                                                 match):
  buf, ref = _filled(SPEC)
  sd = jax.tree_util.tree_map(np.asarray, buf.state_dict())
  change(sd)
  with pytest.raises(ValueError, match=match):
    buf.load_state_dict(sd)
  reference.assert_state_equals(buf.state, ref)


# --- DictDataset -------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, True])
def test_dataset_matches_numpy_model_with_modulo_wrap(shuffle, rng_key):
  batch = _batch([12, 5, 3, 12])
  ds = DictDataset(4, batch, shuffle=shuffle, key=rng_key)
  kept = {k: v.copy() for k, v in batch.items()}
  for v in batch.values():
    v[:] = -1   # the dataset copied its inputs
  batch = kept
  if shuffle:
    idx = jr.minibatch_indices(rng_key, 12, 4, epoch=0)
  else:
    idx = jr.minibatch_indices(None, 12, 4, shuffle=False)
  np.testing.assert_array_equal(ds.indices, idx)
  model = NumpyDictDataset(4, batch, order=np.asarray(idx).ravel())
  assert len(ds) == ds.num_batches() == len(model) == 3
  assert (ds.batch_size, ds.num_rows) == (4, 12)
  for j in range(3):
    mb = ds[j]
    assert all(isinstance(v, jax.Array) and v.shape == (4, 2)
               for v in mb.values())
    _assert_dict_equal(mb, model[j])
    _assert_dict_equal(mb, jr.take(batch, idx[j]))
    _assert_dict_equal(ds[j - 3], mb)   # indexed like a list
    _assert_dict_equal(ds[np.int64(j)], mb)
  for j in (3, -4, 100):
    with pytest.raises(IndexError, match=rf"DictDataset index {j} is out of "
                       "range for 3 minibatches"):
      ds[j]  # pylint: disable=pointless-statement
  with pytest.raises(TypeError, match="DictDataset indices must be integers, "
                     "got slice"):
    ds[0:2]  # pylint: disable=pointless-statement


def test_shuffle_draws_the_epochs_of_the_functional_iterator(rng_key):
  batch = _batch([8, 3])
  ds = DictDataset(2, batch, key=rng_key)
  got = []
  for _ in range(3):
    ds.shuffle()
    got.extend(ds)
  expected = list(jr.minibatches(rng_key, batch, 2, num_epochs=3))
  assert len(got) == len(expected) == 12
  for g, e in zip(got, expected):
    _assert_dict_equal(g, e)
  # shuffle=True at construction is the first of these orders.
  first = DictDataset(2, batch, shuffle=True, key=rng_key)
  for g, e in zip(first, expected[:4]):
    _assert_dict_equal(g, e)
  default = DictDataset(8, _batch([64]), shuffle=True)   # key 0
  for epoch in range(2):
    np.testing.assert_array_equal(default.indices, jr.minibatch_indices(
        jax.random.key(0), 64, 8, epoch=epoch))
    default.shuffle()


@pytest.mark.parametrize("cls, args, kwargs, exc, match", [
    (ExperienceBuffer, (0, 3), {}, ValueError,
     r"^ExperienceBuffer: init: `num_envs` must be positive, got 0"),
    (ExperienceBuffer, (2, 2.5), {}, TypeError,
     r"^ExperienceBuffer: init: `num_steps` must be an int"),
    (ExperienceBuffer, (2, 3, "tpu"), {}, ValueError,
     r"^ExperienceBuffer: device 'tpu' is not available to JAX"),
    (ExperienceBuffer, (2, 3, 7), {}, TypeError,
     r"^ExperienceBuffer: `device` must be None, a str such as 'cpu'"),
    (DictDataset, (5, _batch([12])), {}, ValueError,
     r"^DictDataset: `batch_size` 5 does not divide the number of rows N = 12"
     r" \(12 % 5 = 2\); the nearest valid batch sizes are 4 or 6"),
    (DictDataset, (16, _batch([12, 3])), {}, ValueError,
     r"^DictDataset: `batch_size` 16 is larger than the number of rows"),
    (DictDataset, (0, _batch([12])), {}, ValueError,
     r"^DictDataset: `batch_size` must be positive"),
    (DictDataset, (2, {}), {}, ValueError,
     r"^DictDataset: `batch` is empty"),
    (DictDataset, (2, [np.ones(4)]), {}, TypeError,
     r"^DictDataset: `tensor_dict` must be a dict \{key: array\}, got list"),
    (DictDataset, (2, {"x": np.ones((0, 2))}), {}, ValueError,
     r"^DictDataset: field 'x' has zero rows"),
    (DictDataset, (2, {"x": np.float32(1)}), {}, ValueError,
     r"^DictDataset: field 'x' is a scalar"),
    (DictDataset, (2, _batch([4])), {"key": 0}, TypeError,
     r"^DictDataset: `key` must be a PRNG key \(jax.random.key\(seed\)\), got "
     "int"),
])
def test_constructor_errors(cls, args, kwargs, exc, match):
  with pytest.raises(exc, match=match):
    cls(*args, **kwargs)


def test_buffer_to_dataset_equals_the_functional_pipeline(rng_key):
  rng = np.random.default_rng(4)
  buf, ref = _pair(SPEC, num_envs=3, num_steps=4)
  _fill(buf, ref, rng)
  state = buf.state  # make_dict does not donate: this stays valid.
  ds = DictDataset(4, buf.make_dict(), shuffle=True, key=rng_key)
  expected = list(jr.minibatches(rng_key, state, 4))
  assert len(ds) == len(expected) == 3
  for g, e in zip(ds, expected):
    _assert_dict_equal(g, e)


# --- torch -------------------------------------------------------------------


def test_compat_does_not_import_torch():
  code = (
      "import sys, numpy as np\n"
      "from jrollout.compat import ExperienceBuffer, DictDataset\n"
      "b = ExperienceBuffer(2, 1); b.register_key('o')\n"
      "b.update_data('o', 0, np.ones(2, np.float32))\n"
      "ds = DictDataset(1, b.make_dict(), shuffle=True); list(ds)\n"
      "assert 'torch' not in sys.modules, 'torch was imported'\n")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, check=False, timeout=120)
  assert result.returncode == 0, result.stderr


def test_torch_dtypes_and_tensors_in():
  torch = pytest.importorskip("torch")
  buf = ExperienceBuffer(2, 3, device=torch.device("cpu"))
  ref = OriginalBuffer(2, 3)
  for k, shape, tdt, ndt in [("obs", (2,), torch.float32, np.float32),
                             ("act", (), torch.int32, np.int32),
                             ("done", (), torch.bool, np.bool_),
                             ("img", (2,), torch.uint8, np.uint8)]:
    buf.register_key(k, torch.Size(shape), tdt)
    ref.register(k, shape, ndt)
    assert getattr(buf, k).dtype == ndt
  with pytest.raises(TypeError, match=r"^ExperienceBuffer\.register_key: "
                     "register: field 'x': dtype int64 is not available"):
    buf.register_key("x", (), torch.int64)
  rng = np.random.default_rng(5)
  for t in range(3):
    obs = torch.from_numpy(rng.standard_normal((2, 2)))  # float64
    act = torch.from_numpy(rng.integers(0, 9, 2))  # int64
    done = torch.tensor([True, t == 1])
    buf.update_data("obs", t, obs)
    buf.update_data("act", t, act)
    buf.update_data("done", t, done)
    ref.update_at(t, {"obs": obs.numpy(), "act": act.numpy(),
                      "done": done.numpy()})
    # The tensor was copied: changing it later does not reach the buffer.
    obs.fill_(99.0)
    act.fill_(99)
  img = torch.from_numpy(rng.integers(0, 255, (3, 2, 2)).astype(np.uint8))
  buf.batch_update_data("img", img)
  ref.update_all({"img": img.numpy().copy()})
  img.fill_(0)
  _assert_buffer_equals(buf, ref)
  _assert_dict_equal(buf.make_dict(), ref.make_batch())


def test_torch_tensor_requiring_grad_is_refused():
  torch = pytest.importorskip("torch")
  buf = _pair(SPEC, num_envs=2, num_steps=3)[0]
  grad = torch.ones((2, 2), requires_grad=True)
  with pytest.raises(ValueError, match=r"^ExperienceBuffer\.update_data: key "
                     r"'obs': the tensor requires grad; store `\.detach\(\)`"):
    buf.update_data("obs", 0, grad)
  with pytest.raises(ValueError, match=r"^ExperienceBuffer\.batch_update_data"
                     ": key 'obs': the tensor requires grad"):
    buf.batch_update_data("obs", torch.ones((3, 2, 2), requires_grad=True))
  assert buf.total_sum() == 0 and not np.asarray(buf.obs).any()
  buf.update_data("obs", 0, grad.detach())
  np.testing.assert_array_equal(buf.obs[0], np.ones((2, 2)))
  with pytest.raises(ValueError, match=r"^DictDataset: key 'x': the tensor "
                     "requires grad"):
    DictDataset(1, {"x": grad})


def test_dataset_torch_in_and_out(rng_key):
  torch = pytest.importorskip("torch")
  x = torch.randn(12, 3)
  y = torch.arange(6)  # int64: 32 bits without x64, as JAX does for numpy.
  ds = DictDataset(4, {"x": x, "y": y}, shuffle=True, key=rng_key,
                   as_torch=True)
  model = NumpyDictDataset(4, {"x": x.numpy().copy(), "y": y.numpy()},
                           order=np.asarray(ds.indices).ravel())
  x.fill_(0)  # Converted as a copy: the dataset keeps the old values.
  for j, mb in enumerate(ds):
    assert isinstance(mb["x"], torch.Tensor) and mb["x"].shape == (4, 3)
    assert mb["y"].dtype == torch.int32
    _assert_dict_equal({k: v.numpy() for k, v in mb.items()}, model[j])
  ds.as_torch = False
  assert isinstance(ds[0]["x"], jax.Array)


def test_donation_warning_leaves_the_buffer_consistent():
  pytest.importorskip("torch")
  from jrollout.torch import to_torch  # noqa: PLC0415 - torch is optional
  rng = np.random.default_rng(6)
  buf, ref = _pair(SPEC, num_envs=2, num_steps=3)
  _fill(buf, ref, rng, steps=[0])
  view = to_torch(buf.obs)  # A live DLPack view: JAX cannot donate obs.
  value = random_value(rng, (2, 2), np.float32)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    with pytest.raises(RuntimeWarning, match="RolloutWriter: the storage "
                       r"of \['obs'\] was copied"):
      buf.update_data("obs", 1, value)
  ref.update_at(1, {"obs": value})
  # The write landed and the buffer holds the new, live state.
  assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(buf.state))
  _assert_buffer_equals(buf, ref)
  # The view still shows the storage as it was before that write.
  np.testing.assert_array_equal(view.numpy()[0], ref.storage["obs"][0])
  assert not view.numpy()[1:].any()
  del view
  _fill(buf, ref, rng, steps=[2])
  value = random_value(rng, (2,), np.int32)
  buf.update_data("act", 1, value)
  ref.update_at(1, {"act": value})
  _assert_dict_equal(buf.make_dict(), ref.make_batch())
