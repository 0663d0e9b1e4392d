"""Minibatches of any size: remainder="error" / "drop" / "wrap" (the plan).

Every entry point is checked against one numpy model of the three modes,
given the epoch's order ``p`` read off ``minibatch_indices(key, N, 1)``.
"""

import collections
import functools

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jrollout as jr
from jrollout import compat
from tests.conftest import TRANSFORMS

MODES = ("drop", "wrap")


def _order(key, n, epoch, shuffle=True):
  """The epoch's order p of range(N): independent of B and of the mode."""
  if not shuffle:
    return np.arange(n)
  return np.asarray(jr.minibatch_indices(key, n, 1, epoch=epoch))[:, 0]


def _model(p, b, mode):
  """The numpy model: ``[M, B]`` rows of every minibatch of one epoch."""
  n = len(p)
  if mode == "error":
    assert n % b == 0
  m = -(-n // b) if mode == "wrap" else n // b
  return np.array([[p[(j * b + i) % n] for i in range(b)] for j in range(m)],
                  np.int64).reshape(m, b)


@st.composite
def _request(draw, max_rows=64):
  n = draw(st.integers(1, max_rows))
  b = draw(st.integers(1, n))
  mode = draw(st.sampled_from(("error", *MODES) if n % b == 0 else MODES))
  return n, b, mode


def _collect(carry, mb):
  return carry, mb


@given(req=_request(200), seed=st.integers(0, 2**31 - 1),
       epoch=st.integers(0, 4), shuffle=st.booleans())
def test_minibatch_indices_match_the_model(req, seed, epoch, shuffle):
  n, b, mode = req
  key = jax.random.key(seed)
  got = np.asarray(jr.minibatch_indices(key, n, b, shuffle=shuffle,
                                        epoch=epoch, remainder=mode))
  want = _model(_order(key, n, epoch, shuffle), b, mode)
  np.testing.assert_array_equal(got, want)
  uses = np.bincount(got.ravel(), minlength=n)
  if mode == "drop":
    assert uses.max() <= 1 and uses.sum() == (n // b) * b
  elif mode == "wrap":
    assert uses.min() >= 1 and uses.max() <= 2
    assert (uses == 2).sum() == got.size - n
  else:
    assert (uses == 1).all()


@settings(max_examples=10)
@given(req=_request(), seed=st.integers(0, 2**31 - 1),
       extra=st.lists(st.integers(1, 64), max_size=2),
       num_epochs=st.integers(1, 3))
def test_flat_entry_points_match_the_model(req, seed, extra, num_epochs):
  n, b, mode = req
  lengths = [n] + [min(x, n) for x in extra]
  batch = {f"k{i}": np.arange(length, dtype=np.int32) * 10 + i
           for i, length in enumerate(lengths)}
  key = jax.random.key(seed)
  want = [{k: v[_model(_order(key, n, e), b, mode)[j] % len(v)]
           for k, v in batch.items()}
          for e in range(num_epochs)
          for j in range(len(_model(np.arange(n), b, mode)))]
  got_iter = list(jr.minibatches(key, batch, b, num_epochs=num_epochs,
                                 remainder=mode))
  _, outs = jr.scan_minibatches(_collect, 0, key, batch, b,
                                num_epochs=num_epochs, remainder=mode)
  outs = {k: np.asarray(v).reshape(-1, b) for k, v in outs.items()}
  assert len(got_iter) == len(want)
  for i, mb in enumerate(want):
    for k in batch:
      np.testing.assert_array_equal(got_iter[i][k], mb[k])
      np.testing.assert_array_equal(outs[k][i], mb[k])


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("mode", MODES)
def test_scan_under_jit_and_the_rollout_state_path(transform, mode):
  num_envs, num_steps, b = 3, 7, 5          # N = 21: 5 does not divide it
  state = jr.register(jr.init(num_envs, num_steps), "obs", (2,))
  state = jr.register(state, "act", (), jnp.int32)
  rng = np.random.default_rng(0)
  state = jr.update_all(state, {
      "obs": rng.standard_normal((num_steps, num_envs, 2)).astype(np.float32),
      "act": rng.integers(0, 9, (num_steps, num_envs)).astype(np.int32)})
  batch, _ = jr.make_batch(state)
  key = jax.random.key(3)
  run = transform(functools.partial(jr.scan_minibatches, _collect,
                                    batch_size=b, num_epochs=2,
                                    remainder=mode))
  _, from_state = run(0, key, state)
  _, from_batch = run(0, key, batch)
  for e in range(2):
    idx = _model(_order(key, num_envs * num_steps, e), b, mode)
    for k in batch:
      np.testing.assert_array_equal(from_state[k][e], from_batch[k][e])
      np.testing.assert_array_equal(from_batch[k][e],
                                    np.asarray(batch[k])[idx])


@settings(max_examples=10)
@given(req=_request(12), seed=st.integers(0, 2**31 - 1),
       num_steps=st.integers(1, 4))
def test_sequence_entry_points_split_envs_by_the_model(req, seed, num_steps):
  num_envs, eb, mode = req
  data = {"x": np.arange(num_steps * num_envs * 2, dtype=np.float32)
          .reshape(num_steps, num_envs, 2)}
  key = jax.random.key(seed)
  got_iter = list(jr.sequence_minibatches(key, data, eb, num_epochs=2,
                                          remainder=mode))
  _, outs = jr.scan_sequence_minibatches(_collect, 0, key, data, eb,
                                         num_epochs=2, remainder=mode)
  i = 0
  for e in range(2):
    idx = _model(_order(key, num_envs, e), eb, mode)
    for j, env_idx in enumerate(idx):
      want = data["x"][:, env_idx]
      np.testing.assert_array_equal(got_iter[i]["x"], want)
      np.testing.assert_array_equal(outs["x"][e, j], want)
      i += 1
  assert i == len(got_iter)


@settings(max_examples=10)
@given(req=_request(40), seed=st.integers(0, 2**31 - 1),
       short=st.integers(1, 40))
def test_dict_dataset_follows_the_mode(req, seed, short):
  n, b, mode = req
  data = {"x": np.arange(n), "y": np.arange(min(short, n)) + 100}
  key = jax.random.key(seed)
  ds = compat.DictDataset(b, data, key=key, remainder=mode)
  for e in range(-1, 2):       # the identity order, then epochs 0 and 1
    if e >= 0:
      ds.shuffle()
    idx = _model(_order(key, n, e, shuffle=e >= 0), b, mode)
    assert len(ds) == len(idx) and ds.num_batches() == len(idx)
    got = list(ds)
    for j, mb in enumerate(got):
      np.testing.assert_array_equal(mb["x"], idx[j])
      np.testing.assert_array_equal(mb["y"], data["y"][idx[j] % len(
          data["y"])])
    np.testing.assert_array_equal(ds[-1]["x"], idx[-1])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shard_mode", ["global", "local"])
def test_sharded_follows_the_model_on_8_devices(mode, shard_mode):
  devices = 8
  mesh = jax.make_mesh((devices,), ("envs",))
  n, b = 8 * 7, 8 * 3                   # 24 does not divide 56
  batch = {"x": np.arange(n, dtype=np.int32), "y": np.arange(16,
                                                             dtype=np.int32)}
  key = jax.random.key(5)
  _, outs = jr.scan_minibatches_sharded(
      _collect, 0, key, jr.shard_rows(batch, mesh), b, mesh=mesh,
      mode=shard_mode, num_epochs=2, remainder=mode)
  for e in range(2):
    idx = np.asarray(jr.minibatch_indices_sharded(
        key, n, b, num_shards=devices, mode=shard_mode, epoch=e,
        remainder=mode))                 # [D, M, B/D] global rows
    if shard_mode == "global":
      model = _model(_order(key, n, e), b, mode)
      np.testing.assert_array_equal(
          np.swapaxes(idx, 0, 1).reshape(len(model), b), model)
      _, single = jr.scan_minibatches(_collect, 0, key, batch, b,
                                      num_epochs=2, remainder=mode)
      np.testing.assert_array_equal(
          np.swapaxes(np.asarray(outs["x"])[:, e], 0, 1).reshape(-1, b),
          single["x"][e])
    else:
      local_n = n // devices
      for d in range(devices):
        local = _model(_order(jax.random.fold_in(key, d), local_n, e),
                       b // devices, mode)
        np.testing.assert_array_equal(idx[d], d * local_n + local)
    # Device d's minibatch j takes rows idx[d, j] % L_k of each key.
    np.testing.assert_array_equal(np.asarray(outs["x"])[:, e], idx)
    if shard_mode == "global":
      np.testing.assert_array_equal(np.asarray(outs["y"])[:, e],
                                    idx % 16)


def test_no_recompile_across_epochs_and_rollouts(count_compiles):
  batch = {"x": np.arange(21, dtype=np.float32)}
  data = {"x": np.zeros((4, 7, 2), np.float32)}

  def run(key):
    for mode in MODES:
      for _ in jr.minibatches(key, batch, 5, num_epochs=2, remainder=mode):
        pass
      jr.scan_minibatches(_collect, 0, key, batch, 5, remainder=mode)
      jr.scan_sequence_minibatches(_collect, 0, key, data, 3, remainder=mode)
      jax.block_until_ready(jr.minibatch_indices(key, 21, 5, remainder=mode))

  run(jax.random.key(0))
  with count_compiles() as counter:
    for seed in range(1, 3):
      run(jax.random.key(seed))
  assert counter.count == 0


def test_default_program_is_unchanged_by_the_modes():
  """For a B that divides N, every mode compiles the same program."""
  key = jax.random.key(0)

  def text(mode):
    return jax.jit(functools.partial(
        jr.scan_minibatches, _collect, batch_size=4, remainder=mode)).lower(
            0, key, {"x": jnp.zeros(16)}).as_text()
  assert text("error") == text("drop") == text("wrap")


@pytest.mark.parametrize("mode", ["error", *MODES])
def test_batch_larger_than_rows_is_an_error_in_every_mode(mode, rng_key):
  with pytest.raises(ValueError, match=r"^minibatches: `batch_size` 9 is "
                     r"larger than the number of rows N = 8; use a batch "
                     r"size of at most 8$"):
    jr.minibatches(rng_key, {"x": np.zeros(8)}, 9, remainder=mode)
  with pytest.raises(ValueError, match=r"sequence_minibatches: "
                     r"`batch_size` 5 is larger than the number of rows "
                     r"E = 4"):
    jr.sequence_minibatches(rng_key, {"x": np.zeros((2, 4))}, 5,
                            remainder=mode)


def test_errors_name_the_modes(rng_key):
  with pytest.raises(ValueError, match=r"scan_minibatches: `batch_size` 5 does "
                     r"not divide the number of rows N = 21 \(21 % 5 = 1\); "
                     r"the nearest valid batch sizes are 3 or 7; or pass "
                     r"remainder='drop' \(leave the last 1 rows of each "
                     r"epoch's order out\) or remainder='wrap'"):
    jr.scan_minibatches(_collect, 0, rng_key, {"x": np.zeros(21)}, 5)
  with pytest.raises(ValueError, match=r"minibatch_indices: `remainder` must "
                     r"be one of \('error', 'drop', 'wrap'\), got 'pad'"):
    jr.minibatch_indices(rng_key, 21, 5, remainder="pad")
  with pytest.raises(ValueError, match=r"DictDataset: `remainder` must be one "
                     r"of"):
    compat.DictDataset(5, {"x": np.zeros(21)}, remainder=None)
  mesh = jax.make_mesh((8,), ("envs",))
  with pytest.raises(ValueError, match=r"scan_minibatches_sharded: "
                     r"`batch_size` B = 20 \(the global minibatch size\) is "
                     r"not divisible by the size D = 8 of mesh axis 'envs'"):
    jr.scan_minibatches_sharded(_collect, 0, rng_key,
                                {"x": np.zeros(56)}, 20, mesh=mesh,
                                remainder="wrap")
  with pytest.raises(ValueError, match=r"minibatch_indices_sharded: the number "
                     r"of rows N = 60 is not divisible by the size D = 8"):
    jr.minibatch_indices_sharded(rng_key, 60, 8, num_shards=8,
                               remainder="drop")


def test_wrap_uses_each_row_and_drop_leaves_different_rows_each_epoch():
  key = jax.random.key(11)
  n, b = 1000, 64
  left_out = []
  for e in range(4):
    drop = np.asarray(jr.minibatch_indices(key, n, b, epoch=e,
                                           remainder="drop"))
    left_out.append(set(range(n)) - set(drop.ravel().tolist()))
    wrap = np.asarray(jr.minibatch_indices(key, n, b, epoch=e,
                                           remainder="wrap"))
    counts = collections.Counter(wrap.ravel().tolist())
    assert len(counts) == n and sum(counts.values()) == 16 * 64
  assert all(len(s) == n % b for s in left_out)
  assert len(set.union(*left_out)) > n % b      # not the same rows each time
