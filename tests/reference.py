"""Plain-numpy models of the original ExperienceBuffer / DictDataset design,
with the exact write tracking jrollout promises (per-step counts and
out-of-range writes), not the original's sum of indices."""

import numpy as np

import jrollout as jr


class NumpyBuffer:
  """ExperienceBuffer semantics with exact write tracking."""

  def __init__(self, num_envs, num_steps):
    self.E, self.T = num_envs, num_steps
    self.storage, self.counts, self.oor = {}, {}, {}

  def register(self, key, shape=(), dtype=np.float32):
    assert key not in self.storage
    self.storage[key] = np.zeros((self.T, self.E, *shape), dtype)
    self.counts[key] = np.zeros(self.T, np.int64)
    self.oor[key] = 0

  def update_at(self, step, values):
    for k, v in values.items():
      if 0 <= step < self.T:
        self.storage[k][step] = np.asarray(v).astype(self.storage[k].dtype)
        self.counts[k][step] += 1
      else:
        self.oor[k] += 1

  def update_all(self, values):
    for k, v in values.items():
      self.storage[k][...] = np.asarray(v).astype(self.storage[k].dtype)
      self.counts[k] += 1

  def complete(self):
    return all((c == 1).all() and self.oor[k] == 0
               for k, c in self.counts.items())

  def make_batch(self):
    batch = {}
    for k, v in self.storage.items():
      out = np.empty((self.E * self.T, *v.shape[2:]), v.dtype)
      for e in range(self.E):
        for t in range(self.T):
          out[e * self.T + t] = v[t, e]
      batch[k] = out
    for k in self.counts:
      self.counts[k][:] = 0
      self.oor[k] = 0
    return batch


def epoch_order(key, n, epoch, shuffle=True):
  """An epoch's order p of range(N), read off minibatch_indices(key, N, 1):
  the same for every B and mode (the identity without shuffling)."""
  if not shuffle:
    return np.arange(n)
  return np.asarray(jr.minibatch_indices(key, n, 1, epoch=epoch))[:, 0]


def plan_rows(p, b, mode):
  """The plan's ``[M, B]`` rows: minibatch j takes ``p[(j*B + i) % N]``,
  ``M = N // B`` (``ceil(N / B)`` for ``"wrap"``)."""
  n = len(p)
  assert mode != "error" or n % b == 0
  m = -(-n // b) if mode == "wrap" else n // b
  return np.asarray(p)[np.arange(m * b).reshape(m, b) % n]


def random_value(rng, shape, dtype):
  """Random values of ``dtype``, small enough for every integer type."""
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return rng.random(shape) < 0.5
  if np.issubdtype(dtype, np.integer):
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -100), min(info.max, 100), shape,
                        dtype=dtype)
  return rng.standard_normal(shape).astype(dtype)


def make_pair(spec, num_envs=3, num_steps=5):
  """A RolloutState and a NumpyBuffer holding ``{key: (shape, dtype)}``."""
  state, ref = jr.init(num_envs, num_steps), NumpyBuffer(num_envs, num_steps)
  for key, (shape, dtype) in spec.items():
    state = jr.register(state, key, shape, dtype)
    ref.register(key, shape, dtype)
  return state, ref


def assert_state_equals(state, ref):
  """Storage, dtypes and write counts of ``state`` equal the model's."""
  assert set(state.data) == set(ref.storage)
  for k in ref.storage:
    np.testing.assert_array_equal(np.asarray(state.data[k]), ref.storage[k])
    assert state.data[k].dtype == ref.storage[k].dtype
    counts = jr.write_counts(state)[k]
    np.testing.assert_array_equal(np.asarray(counts.per_step), ref.counts[k])
    assert int(counts.out_of_range) == ref.oor[k]
