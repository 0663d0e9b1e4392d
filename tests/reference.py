"""Plain-numpy models: the original ExperienceBuffer / DictDataset design,
with the exact write tracking jrollout promises (per-step counts and
out-of-range writes), not the original's sum of indices; and GAE from its
definition, with random rollouts to feed it."""

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


def reference_gae(rewards, values, last_value, terminations, truncations=None,
                  final_values=None, gamma=0.99, gae_lambda=0.95):
  """Each env's steps walked backwards, in float64."""
  num_steps, rest = np.shape(rewards)[0], np.shape(rewards)[1:]
  r, v, term = (np.asarray(x, np.float64).reshape(num_steps, -1)
                for x in (rewards, values, terminations))
  lv = np.asarray(last_value, np.float64).reshape(-1)
  trunc = (np.zeros_like(term) if truncations is None
           else np.asarray(truncations).reshape(num_steps, -1))
  fv = (np.zeros_like(v) if final_values is None
        else np.asarray(final_values, np.float64).reshape(num_steps, -1))
  adv = np.zeros_like(r)
  for e in range(r.shape[1]):
    running = 0.0
    for t in reversed(range(num_steps)):
      if term[t, e]:
        target = r[t, e]   # terminal: nothing after this step
      elif trunc[t, e]:
        target = r[t, e] + gamma * fv[t, e]   # the episode's true last obs
      elif t == num_steps - 1:
        target = r[t, e] + gamma * lv[e]
      else:
        target = r[t, e] + gamma * v[t + 1, e]
      if term[t, e] or trunc[t, e]:
        running = 0.0   # the next step belongs to another episode
      running = target - v[t, e] + gamma * gae_lambda * running
      adv[t, e] = running
  adv = adv.reshape((num_steps,) + rest)
  return adv, adv + np.asarray(values, np.float64)


def random_rollout(seed, shape, p_term=0.2, p_trunc=0.2, p_both=0.1):
  """Random float32 inputs with terminations, truncations and both."""
  rng = np.random.default_rng(seed)
  both = rng.random(shape) < p_both
  return dict(rewards=rng.normal(size=shape).astype(np.float32),
              values=rng.normal(size=shape).astype(np.float32),
              last_value=rng.normal(size=shape[1:]).astype(np.float32),
              terminations=(rng.random(shape) < p_term) | both,
              truncations=(rng.random(shape) < p_trunc) | both,
              final_values=rng.normal(size=shape).astype(np.float32))


def call(fn, d, **kwargs):
  return fn(d["rewards"], d["values"], d["last_value"], d["terminations"],
            truncations=d["truncations"], final_values=d["final_values"],
            **kwargs)
