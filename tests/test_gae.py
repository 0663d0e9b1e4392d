"""Tests of jrollout._gae and jrollout._autoreset: gae, normalize_advantages
and autoreset_valid.

``gae`` is compared with a numpy double loop (``reference_gae``) and with
numbers computed by rlax; ``autoreset_valid`` with one random stream of
transitions per env written out the way each autoreset mode stores it in a
``[T, E]`` rollout (next-step: a reset step after every episode end;
same-step: gymnasium's ``final_obs`` only where an episode ended; in-JAX:
gymnax's ``final_observation`` at every step, truncation cleared where
terminated): every form must give the advantages of an independent numpy
model that sums each episode's discounted TD errors directly.
"""

import functools
import re

from hypothesis import given
from hypothesis import HealthCheck
from hypothesis import settings
from hypothesis import strategies as st
import hypothesis.extra.numpy as hnp
import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np
import pytest

import jrollout as jr
from jrollout import gae
from jrollout import normalize_advantages
from tests._misuse import assert_same
from tests._misuse import snapshot
from tests.conftest import TRANSFORMS

GAMMA, LAMBDA = 0.9, 0.8
# Every test runs under strict rank and dtype promotion (conftest).
pytestmark = pytest.mark.usefixtures("strict_numpy")


# --------------------------------------------------------------------------
# Plain numpy reference, written per env as "walk each episode backwards".
# --------------------------------------------------------------------------


def reference_gae(rewards, values, last_value, terminations, truncations=None,
                  final_values=None, gamma=0.99, gae_lambda=0.95):
  """Double loop over envs and (backwards) over steps, in float64."""
  rewards = np.asarray(rewards, np.float64)
  values = np.asarray(values, np.float64)
  last_value = np.asarray(last_value, np.float64)
  num_steps = rewards.shape[0]
  rest = rewards.shape[1:]
  r = rewards.reshape(num_steps, -1)
  v = values.reshape(num_steps, -1)
  lv = last_value.reshape(-1)
  term = np.asarray(terminations).reshape(num_steps, -1).astype(bool)
  if truncations is None:
    trunc = np.zeros_like(term)
    fv = np.zeros_like(v)
  else:
    trunc = np.asarray(truncations).reshape(num_steps, -1).astype(bool)
    fv = np.asarray(final_values, np.float64).reshape(num_steps, -1)
  adv = np.zeros_like(r)
  for e in range(r.shape[1]):
    running = 0.0
    for t in reversed(range(num_steps)):
      if term[t, e]:
        target = r[t, e]  # terminal: nothing after this step
      elif trunc[t, e]:
        target = r[t, e] + gamma * fv[t, e]  # the episode's true last obs
      elif t == num_steps - 1:
        target = r[t, e] + gamma * lv[e]  # still running after the rollout
      else:
        target = r[t, e] + gamma * v[t + 1, e]
      if term[t, e] or trunc[t, e]:
        running = 0.0  # the next step belongs to another episode
      running = (target - v[t, e]) + gamma * gae_lambda * running
      adv[t, e] = running
  adv = adv.reshape((num_steps,) + rest)
  return adv, adv + values


def random_rollout(seed, shape, p_term=0.2, p_trunc=0.2, p_both=0.1):
  """Random float32 inputs with terminations, truncations and both."""
  rng = np.random.default_rng(seed)
  rewards = rng.normal(size=shape).astype(np.float32)
  values = rng.normal(size=shape).astype(np.float32)
  last_value = rng.normal(size=shape[1:]).astype(np.float32)
  final_values = rng.normal(size=shape).astype(np.float32)
  terminations = rng.random(shape) < p_term
  truncations = rng.random(shape) < p_trunc
  both = rng.random(shape) < p_both
  terminations |= both
  truncations |= both
  return dict(rewards=rewards, values=values, last_value=last_value,
              terminations=terminations, truncations=truncations,
              final_values=final_values)


def call(fn, d, **kwargs):
  return fn(d["rewards"], d["values"], d["last_value"], d["terminations"],
            truncations=d["truncations"], final_values=d["final_values"],
            **kwargs)


def test_reference_agrees_with_worked_example():
  """Guards the reference itself against the hand-derived numbers."""
  adv, ret = reference_gae(
      [[1.0], [2.0], [3.0]], [[1.0], [2.0], [4.0]], [8.0],
      [[False], [False], [True]], [[False], [True], [False]],
      [[0.0], [6.0], [0.0]], gamma=0.5, gae_lambda=0.5)
  np.testing.assert_array_equal(adv, [[1.75], [3.0], [-1.0]])
  np.testing.assert_array_equal(ret, [[2.75], [5.0], [3.0]])


# --------------------------------------------------------------------------
# gae against the reference.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("seed", [0, 1])
def test_gae_matches_reference(transform, seed):
  d = random_rollout(seed, (16, 5))
  assert d["terminations"].any() and d["truncations"].any()
  assert (d["terminations"] & d["truncations"]).any()
  adv, ret = call(transform(functools.partial(gae, gamma=0.97,
                                              gae_lambda=0.9)), d)
  exp_adv, exp_ret = reference_gae(**d, gamma=0.97, gae_lambda=0.9)
  assert adv.shape == ret.shape == (16, 5)
  assert adv.dtype == ret.dtype == jnp.float32
  np.testing.assert_allclose(adv, exp_adv, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ret, exp_ret, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_gae_default_discounts_match_reference(transform):
  d = random_rollout(2, (8, 3))
  adv, ret = call(transform(gae), d)
  exp_adv, exp_ret = reference_gae(**d)  # gamma=0.99, gae_lambda=0.95
  np.testing.assert_allclose(adv, exp_adv, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ret, exp_ret, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("shape", [(7,), (6, 2, 3)], ids=["T", "TEK"])
def test_gae_other_trailing_shapes(transform, shape):
  d = random_rollout(3, shape, p_term=0.3, p_trunc=0.3)
  adv, ret = call(transform(gae), d, gamma=0.9, gae_lambda=0.8)
  exp_adv, exp_ret = reference_gae(**d, gamma=0.9, gae_lambda=0.8)
  assert adv.shape == ret.shape == shape
  np.testing.assert_allclose(adv, exp_adv, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ret, exp_ret, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_gae_without_truncations_matches_reference(transform):
  d = random_rollout(4, (9, 3))
  adv, ret = transform(functools.partial(gae, gamma=0.9, gae_lambda=0.7))(
      d["rewards"], d["values"], d["last_value"], d["terminations"])
  exp_adv, exp_ret = reference_gae(
      d["rewards"], d["values"], d["last_value"], d["terminations"],
      gamma=0.9, gae_lambda=0.7)
  np.testing.assert_allclose(adv, exp_adv, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ret, exp_ret, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_gae_float_flags_equal_bool_flags(transform):
  d = random_rollout(5, (8, 3))
  f = transform(gae)
  expected = call(f, d)
  d_float = dict(d, terminations=d["terminations"].astype(np.float32),
                 truncations=d["truncations"].astype(np.float32))
  got = call(f, d_float)
  np.testing.assert_array_equal(got[0], expected[0])
  np.testing.assert_array_equal(got[1], expected[1])


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_gae_ignores_final_values_where_not_used(transform):
  """final_values matter only at truncated, non-terminated steps."""
  d = random_rollout(6, (10, 4))
  used = d["truncations"] & ~d["terminations"]
  garbage = np.where(used, d["final_values"], np.nan).astype(np.float32)
  f = transform(gae)
  expected = call(f, d)
  got = call(f, dict(d, final_values=garbage))
  np.testing.assert_array_equal(got[0], expected[0])
  np.testing.assert_array_equal(got[1], expected[1])
  # ...and they do matter where used.
  changed = call(f, dict(d, final_values=d["final_values"] + 1.0))
  assert not np.allclose(changed[0], expected[0])


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gae_computes_in_values_dtype(transform, dtype):
  d = random_rollout(7, (5, 2))
  adv, ret = transform(gae)(
      d["rewards"], jnp.asarray(d["values"], dtype), d["last_value"],
      d["terminations"], truncations=d["truncations"],
      final_values=d["final_values"])
  assert adv.dtype == ret.dtype == dtype
  exp_adv, _ = reference_gae(**d)
  np.testing.assert_allclose(np.asarray(adv, np.float32), exp_adv,
                             rtol=0.1, atol=0.1)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_gae_gamma_as_array(transform):
  d = random_rollout(8, (6, 2))
  adv, _ = call(transform(gae), d, gamma=jnp.float32(0.9),
                gae_lambda=jnp.asarray(0.8, jnp.float32))
  exp_adv, _ = reference_gae(**d, gamma=0.9, gae_lambda=0.8)
  np.testing.assert_allclose(adv, exp_adv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gamma,gae_lambda", [(0.0, 0.95), (0.9, 0.0),
                                              (1.0, 1.0)])
def test_gae_boundary_discounts(gamma, gae_lambda):
  d = random_rollout(9, (6, 2))
  adv, _ = call(gae, d, gamma=gamma, gae_lambda=gae_lambda)
  exp_adv, _ = reference_gae(**d, gamma=gamma, gae_lambda=gae_lambda)
  np.testing.assert_allclose(adv, exp_adv, rtol=1e-5, atol=1e-5)
  if gamma == 0.0:  # one-step advantage r - V
    np.testing.assert_allclose(adv, d["rewards"] - d["values"], rtol=1e-6)


def test_gae_single_step():
  adv, ret = gae(jnp.array([[1.0, 1.0]]), jnp.array([[0.5, 0.5]]),
                 jnp.array([2.0, 2.0]), jnp.array([[False, True]]),
                 gamma=0.5, gae_lambda=0.9)
  np.testing.assert_allclose(adv, [[1.5, 0.5]])
  np.testing.assert_allclose(ret, [[2.0, 1.0]])


def test_gae_jit_does_not_retrace(count_compiles):
  traces = []

  @jax.jit
  def f(*args, **kwargs):
    traces.append(None)
    return gae(*args, **kwargs)

  d = random_rollout(10, (4, 2))
  call(f, d, gamma=0.9, gae_lambda=0.8)
  d = {k: jax.device_put(x) for k, x in random_rollout(11, (4, 2)).items()}
  with count_compiles() as counter:
    adv, _ = call(f, d, gamma=0.95, gae_lambda=0.8)  # new values, same shapes
  assert counter.count == 0
  assert len(traces) == 1
  exp_adv, _ = reference_gae(**d, gamma=0.95, gae_lambda=0.8)
  np.testing.assert_allclose(adv, exp_adv, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------
# vmap over a leading seed axis.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_gae_vmap_over_seeds(transform):
  num_seeds = 3
  ds = [random_rollout(20 + s, (7, 4)) for s in range(num_seeds)]
  stacked = {k: np.stack([d[k] for d in ds]) for k in ds[0]}
  gammas = np.array([0.9, 0.95, 0.99], np.float32)

  def one(r, v, lv, term, trunc, fv, g):
    return gae(r, v, lv, term, truncations=trunc, final_values=fv, gamma=g,
               gae_lambda=0.9)

  adv, ret = transform(jax.vmap(one))(
      stacked["rewards"], stacked["values"], stacked["last_value"],
      stacked["terminations"], stacked["truncations"],
      stacked["final_values"], gammas)
  assert adv.shape == ret.shape == (num_seeds, 7, 4)
  for s, d in enumerate(ds):
    per_adv, per_ret = call(gae, d, gamma=gammas[s], gae_lambda=0.9)
    np.testing.assert_allclose(adv[s], per_adv, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ret[s], per_ret, rtol=1e-6, atol=1e-6)
    exp_adv, _ = reference_gae(**d, gamma=float(gammas[s]), gae_lambda=0.9)
    np.testing.assert_allclose(adv[s], exp_adv, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------
# Hypothesis: small random rollouts against the reference.
# --------------------------------------------------------------------------


@st.composite
def rollouts(draw):
  num_steps = draw(st.integers(1, 6))
  num_envs = draw(st.integers(1, 3))
  shape = (num_steps, num_envs)
  floats = hnp.arrays(np.float32, shape, elements=st.floats(
      -10, 10, width=32))
  flags = hnp.arrays(np.bool_, shape)
  return dict(
      rewards=draw(floats), values=draw(floats),
      last_value=draw(hnp.arrays(np.float32, shape[1:], elements=st.floats(
          -10, 10, width=32))),
      terminations=draw(flags), truncations=draw(flags),
      final_values=draw(floats))


_jit_gae = jax.jit(gae)  # one compile per (T, E), shared across examples


# max_examples comes from the conftest profile when there is one.
@settings(deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(d=rollouts(), gamma=st.floats(0.0, 1.0), gae_lambda=st.floats(0.0, 1.0))
def test_gae_property_matches_reference(d, gamma, gae_lambda):
  adv, ret = call(_jit_gae, d, gamma=gamma, gae_lambda=gae_lambda)
  exp_adv, exp_ret = reference_gae(**d, gamma=gamma, gae_lambda=gae_lambda)
  np.testing.assert_allclose(adv, exp_adv, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(ret, exp_ret, rtol=1e-5, atol=1e-4)
  # The trace is cut at every episode end: A_t there depends on step t only.
  done = d["terminations"] | d["truncations"]
  np.testing.assert_allclose(
      np.where(done, adv, 0.0),
      np.where(done, call(_jit_gae, d, gamma=gamma, gae_lambda=0.0)[0], 0.0),
      rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------
# Pinned numbers.
# --------------------------------------------------------------------------

# Fixed T=6, E=2 rollout, no truncation, gamma=0.9, gae_lambda=0.8.
RLAX_REWARDS = np.array([[1.0, -0.5], [0.0, 2.0], [0.5, 0.0], [-1.0, 1.0],
                         [2.0, 0.25], [0.0, -1.5]], np.float32)
RLAX_VALUES = np.array([[0.5, 1.0], [1.5, -0.25], [0.0, 0.75], [2.0, 0.5],
                        [-0.5, 1.25], [1.0, 0.0]], np.float32)
RLAX_LAST_VALUE = np.array([0.75, -1.0], np.float32)
RLAX_TERMINATIONS = np.array([[0, 0], [1, 0], [0, 0], [0, 1], [0, 0], [0, 1]],
                             bool)
# Computed by rlax 0.1.9 (with jax 0.10.2, float32, in a separate venv; rlax
# is not a test dependency) as
#   jax.vmap(rlax.truncated_generalized_advantage_estimation,
#            in_axes=(1, 1, None, 1), out_axes=1)(
#       RLAX_REWARDS, 0.9 * (1 - RLAX_TERMINATIONS), 0.8,
#       concatenate([RLAX_VALUES, RLAX_LAST_VALUE[None]]))
RLAX_ADVANTAGES = np.array([
    [0.7699999809265137, 0.4121038615703583],
    [-1.5, 2.9681999683380127],
    [1.457254409790039, 0.0599999725818634],
    [-1.1704800128936768, 0.5],
    [3.1660001277923584, -2.0799999237060547],
    [-0.3250000476837158, -1.5],
], np.float32)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_gae_no_truncation_matches_rlax(transform):
  adv, ret = transform(functools.partial(gae, gamma=0.9, gae_lambda=0.8))(
      RLAX_REWARDS, RLAX_VALUES, RLAX_LAST_VALUE, RLAX_TERMINATIONS)
  np.testing.assert_allclose(adv, RLAX_ADVANTAGES, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ret, RLAX_ADVANTAGES + RLAX_VALUES, rtol=1e-5,
                             atol=1e-6)
  # All-False truncations give the same numbers.
  adv2, _ = transform(functools.partial(gae, gamma=0.9, gae_lambda=0.8))(
      RLAX_REWARDS, RLAX_VALUES, RLAX_LAST_VALUE, RLAX_TERMINATIONS,
      truncations=np.zeros((6, 2), bool),
      final_values=np.zeros((6, 2), np.float32))
  np.testing.assert_allclose(adv2, RLAX_ADVANTAGES, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_gae_docstring_worked_example(transform):
  """The T=3, E=1 example in gae's docstring (a doctest) and in
  docs/guides/gae.md, derived by hand in the guide."""
  adv, ret = transform(functools.partial(gae, gamma=0.5, gae_lambda=0.5))(
      jnp.array([[1.0], [2.0], [3.0]]),
      jnp.array([[1.0], [2.0], [4.0]]),
      jnp.array([8.0]),
      jnp.array([[False], [False], [True]]),
      truncations=jnp.array([[False], [True], [False]]),
      final_values=jnp.array([[0.0], [6.0], [0.0]]))
  np.testing.assert_allclose(adv, [[1.75], [3.0], [-1.0]], rtol=1e-6)
  np.testing.assert_allclose(ret, [[2.75], [5.0], [3.0]], rtol=1e-6)
  # The numbers appear in the docstring as written here.
  doc = gae.__doc__
  for text in ("Array([[ 1.75,  3.  , -1.  ]], dtype=float32)",
               "Array([[2.75, 5.  , 3.  ]], dtype=float32)",
               "final_values=jnp.array([[0.0], [6.0], [0.0]])"):
    assert text in doc


# --------------------------------------------------------------------------
# normalize_advantages.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("shape", [(16, 4), (33,)])
def test_normalize_advantages(transform, shape):
  a = np.random.default_rng(0).normal(3.0, 5.0, size=shape).astype(np.float32)
  out = transform(normalize_advantages)(a)
  assert out.shape == shape and out.dtype == jnp.float32
  a64 = a.astype(np.float64)
  expected = (a64 - a64.mean()) / (a64.std() + 1e-8)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.mean(out), 0.0, atol=1e-5)
  np.testing.assert_allclose(np.std(out), 1.0, rtol=1e-5)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_normalize_advantages_constant_and_eps(transform):
  out = transform(normalize_advantages)(jnp.full((3, 2), 7.0))
  np.testing.assert_array_equal(out, np.zeros((3, 2)))
  a = jnp.array([1.0, 2.0, 3.0])
  out = transform(functools.partial(normalize_advantages, eps=1.0))(a)
  std = np.std([1.0, 2.0, 3.0])
  np.testing.assert_allclose(out, np.array([-1.0, 0.0, 1.0]) / (std + 1.0),
                             rtol=1e-6)


def test_normalize_advantages_vmap():
  a = np.random.default_rng(1).normal(size=(3, 10)).astype(np.float32)
  out = jax.vmap(normalize_advantages)(a)
  for s in range(3):
    np.testing.assert_allclose(out[s], normalize_advantages(a[s]), rtol=1e-6,
                               atol=1e-6)


# --------------------------------------------------------------------------
# Autoreset modes. The world: per env, a stream of transitions; its three
# written forms.
# --------------------------------------------------------------------------


def make_stream(rng, length, p_term, p_trunc):
  """Transitions ``i < length``: value of obs_i, reward, flags, V(final obs).

  ``value[i + 1]`` is V of the observation after transition i: the next obs
  of the episode, or the next episode's first obs where i ended one.
  """
  term = rng.random(length) < p_term
  trunc = rng.random(length) < p_trunc
  return dict(value=rng.normal(size=length + 1).astype(np.float32),
              reward=rng.normal(size=length).astype(np.float32),
              term=term, trunc=trunc,
              final=rng.normal(size=length).astype(np.float32))


def next_step_form(s, num_steps, prev_done, prev_final, rng):
  """The stream as EnvPool / gymnasium NEXT_STEP store it, T rows.

  Returns ``(rows, last_value, n)``: rows of (value, reward, term, trunc,
  is_transition) and the number ``n`` of transitions they hold. A reset
  row's value is V(final obs) of the episode that just ended; its reward is
  garbage here (0 in the envs), to show it is never used.
  """
  rows = []
  if prev_done:
    rows.append((prev_final, rng.normal(), False, False, False))
  i = 0
  while len(rows) < num_steps:
    done = s["term"][i] or s["trunc"][i]
    rows.append((s["value"][i], s["reward"][i], s["term"][i], s["trunc"][i],
                 True))
    if done and len(rows) < num_steps:
      rows.append((s["final"][i], rng.normal(), False, False, False))
    i += 1
  last_row_is_transition = rows[-1][4]
  done = s["term"][i - 1] or s["trunc"][i - 1]
  # obs_T: the final obs after a last step that ended an episode, else the
  # next obs (or, after a reset row, the next episode's first obs).
  last_value = (s["final"][i - 1] if last_row_is_transition and done
                else s["value"][i])
  return rows, np.float32(last_value), i


def same_step_form(s, n):
  """The first n transitions as gymnasium SAME_STEP stores them.

  ``final_values`` only where an episode ended (NaN elsewhere: gymnasium
  has no final obs there), both flags may be set.
  """
  done = s["term"][:n] | s["trunc"][:n]
  return dict(rewards=s["reward"][:n], values=s["value"][:n],
              last_value=np.float32(s["value"][n]),
              terminations=s["term"][:n], truncations=s["trunc"][:n],
              final_values=np.where(done, s["final"][:n], np.nan
                                    ).astype(np.float32))


def in_jax_form(s, n):
  """The first n transitions as a gymnax scan stores them.

  ``final_values`` at every step (the next obs where nothing ended) and
  truncation cleared where terminated (``step_envs`` in
  ``examples/common/gymnax_envs.py``).
  """
  done = s["term"][:n] | s["trunc"][:n]
  return dict(rewards=s["reward"][:n], values=s["value"][:n],
              last_value=np.float32(s["value"][n]),
              terminations=s["term"][:n],
              truncations=s["trunc"][:n] & ~s["term"][:n],
              final_values=np.where(done, s["final"][:n], s["value"][1:n + 1]
                                    ).astype(np.float32))


def model_advantages(s, n, gamma=GAMMA, gae_lambda=LAMBDA):
  """The numpy model: A_i = sum_k (gamma lambda)^(k-i) delta_k in float64,
  over transitions k from i to the end of i's episode (or of the data)."""
  value = s["value"].astype(np.float64)
  delta = np.zeros(n)
  for k in range(n):
    if s["term"][k]:
      boot = 0.0
    elif s["trunc"][k]:
      boot = float(s["final"][k])
    else:
      boot = value[k + 1]   # within the episode, or after the data
    delta[k] = s["reward"][k] + gamma * boot - value[k]
  adv = np.zeros(n)
  for i in range(n):
    for k in range(i, n):
      adv[i] += (gamma * gae_lambda) ** (k - i) * delta[k]
      if s["term"][k] or s["trunc"][k]:
        break
  return adv


def make_world(seed, num_steps, num_envs, p_term=0.25, p_trunc=0.2):
  """E streams and their next-step ``[T, E]`` form (plus the model's view)."""
  rng = np.random.default_rng(seed)
  prev_done = rng.random(num_envs) < 0.3
  streams, forms = [], []
  for e in range(num_envs):
    s = make_stream(rng, num_steps, p_term, p_trunc)
    forms.append(next_step_form(s, num_steps, prev_done[e], rng.normal(),
                                rng))
    streams.append(s)
  col = lambda j, dtype: np.array(  # noqa: E731
      [[rows[t][j] for rows, _, _ in forms] for t in range(num_steps)], dtype)
  data = dict(values=col(0, np.float32), rewards=col(1, np.float32),
              terminations=col(2, bool), truncations=col(3, bool),
              valid=col(4, bool), prev_done=prev_done,
              last_value=np.array([lv for _, lv, _ in forms], np.float32))
  return data, streams, [n for _, _, n in forms]


def next_step_gae(data, gamma=GAMMA, gae_lambda=LAMBDA):
  """What a next-step host loop calls: the flags' mask, then gae."""
  valid = jr.autoreset_valid(data["terminations"], data["truncations"],
                             mode="next_step", prev_done=data["prev_done"])
  adv, ret = jr.gae(data["rewards"], data["values"], data["last_value"],
                    data["terminations"], valid=valid, gamma=gamma,
                    gae_lambda=gae_lambda)
  return valid, adv, ret


def gae_of(d):
  return jr.gae(d["rewards"], d["values"], d["last_value"],
                d["terminations"], truncations=d["truncations"],
                final_values=d["final_values"], gamma=GAMMA,
                gae_lambda=LAMBDA)


# --------------------------------------------------------------------------
# The model and the forms agree.
# --------------------------------------------------------------------------


def test_model_agrees_with_the_gae_docstring_example():
  # The same-step example of jr.gae: truncated at 1 (final 6), term at 2.
  s = dict(value=np.array([1, 2, 4, 0], np.float32),
           reward=np.array([1, 2, 3], np.float32),
           term=np.array([False, False, True]),
           trunc=np.array([False, True, False]),
           final=np.array([0, 6, 0], np.float32))
  np.testing.assert_array_equal(model_advantages(s, 3, 0.5, 0.5),
                                [1.75, 3.0, -1.0])


def check_world(data, streams, ns, valid, adv, ret):
  """Every form's advantages equal the model's, at every valid step."""
  np.testing.assert_array_equal(valid, data["valid"])
  adv, ret = np.asarray(adv), np.asarray(ret)
  np.testing.assert_array_equal(adv[~data["valid"]], 0.0)
  np.testing.assert_array_equal(ret[~data["valid"]],
                                data["values"][~data["valid"]])
  for e, (s, n) in enumerate(zip(streams, ns)):
    ours = adv[data["valid"][:, e], e]
    assert ours.shape == (n,)
    np.testing.assert_allclose(ours, model_advantages(s, n), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(ret[data["valid"][:, e], e],
                               ours + s["value"][:n], rtol=1e-6, atol=1e-6)
    if n == 0:
      continue
    for form in (same_step_form(s, n), in_jax_form(s, n)):
      other, other_ret = gae_of(form)
      np.testing.assert_array_equal(np.asarray(other), ours)
      np.testing.assert_array_equal(np.asarray(other_ret),
                                    ret[data["valid"][:, e], e])


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_next_step_matches_model_and_other_forms(transform, seed):
  data, streams, ns = make_world(seed, 16, 5)
  assert (~data["valid"]).any() and data["prev_done"].any()
  assert (data["terminations"] & data["truncations"]).any() or seed
  valid, adv, ret = transform(next_step_gae)(data)
  assert valid.dtype == jnp.bool_ and adv.dtype == jnp.float32
  check_world(data, streams, ns, valid, adv, ret)


@given(seed=st.integers(0, 2**31 - 1), num_steps=st.integers(1, 12),
       num_envs=st.integers(1, 4), p_term=st.sampled_from([0.0, 0.2, 0.6]),
       p_trunc=st.sampled_from([0.0, 0.2, 0.6]))
def test_property_three_forms_agree(seed, num_steps, num_envs, p_term,
                                    p_trunc):
  data, streams, ns = make_world(seed, num_steps, num_envs, p_term, p_trunc)
  valid, adv, ret = jax.jit(next_step_gae)(data)
  check_world(data, streams, ns, valid, adv, ret)


def test_vmap_over_a_stack_of_rollouts():
  worlds = [make_world(seed, 10, 3) for seed in range(4)]
  stacked = jax.tree_util.tree_map(lambda *x: np.stack(x),
                                   *[w[0] for w in worlds])
  valid, adv, ret = jax.jit(jax.vmap(next_step_gae))(stacked)
  for i, (data, streams, ns) in enumerate(worlds):
    check_world(data, streams, ns, valid[i], adv[i], ret[i])


def test_vmap_over_discounts():
  data, _, _ = make_world(3, 10, 3)
  gammas = jnp.array([0.5, 0.9, 0.99], jnp.float32)
  _, adv, _ = jax.vmap(lambda g: next_step_gae(data, gamma=g))(gammas)
  for i, g in enumerate([0.5, 0.9, 0.99]):
    _, want, _ = next_step_gae(data, gamma=g)
    np.testing.assert_allclose(adv[i], want, rtol=1e-6, atol=1e-6)


def test_truncation_bootstraps_from_the_true_final_observation():
  # Env truncated at step 1 (value of its final obs: 10 at step 2, the
  # reset step); step 3 starts a new episode with value 100.
  term = np.zeros((4, 1), bool)
  trunc = np.array([[False], [True], [False], [False]])
  values = np.array([[0.0], [0.0], [10.0], [100.0]], np.float32)
  rewards = np.array([[0.0], [1.0], [-50.0], [0.0]], np.float32)
  valid = jr.autoreset_valid(term, trunc, mode="next_step")
  adv, _ = jr.gae(rewards, values, np.zeros(1, np.float32), term,
                  valid=valid, gamma=0.5, gae_lambda=1.0)
  # A_1 = 1 + 0.5 * 10 (not 100, the next episode; the reset step's -50 is
  # never seen); A_0 = 0 + 0.5 * 0 - 0 + 0.5 * A_1.
  np.testing.assert_allclose(np.asarray(adv)[:, 0], [3.0, 6.0, 0.0, -100.0])


def test_same_step_mode_marks_every_step_and_matches_gae():
  d = same_step_form(make_stream(np.random.default_rng(0), 12, 0.3, 0.3), 12)
  valid = jr.autoreset_valid(d["terminations"], d["truncations"],
                             mode="same_step")
  assert valid.shape == (12,) and bool(valid.all())
  adv, _ = gae_of(d)
  with_valid, _ = jr.gae(d["rewards"], d["values"], d["last_value"],
                         d["terminations"], truncations=d["truncations"],
                         final_values=d["final_values"], valid=valid,
                         gamma=GAMMA, gae_lambda=LAMBDA)
  np.testing.assert_array_equal(with_valid, adv)


def test_gymnasium_autoreset_modes_are_accepted():
  gym_vector = pytest.importorskip("gymnasium.vector")
  term = np.array([[True], [False]])
  trunc = np.zeros((2, 1), bool)
  for mode, want in [(gym_vector.AutoresetMode.NEXT_STEP, [True, False]),
                     (gym_vector.AutoresetMode.SAME_STEP, [True, True])]:
    np.testing.assert_array_equal(
        jr.autoreset_valid(term, trunc, mode=mode)[:, 0], want)
  with pytest.raises(ValueError, match=r"autoreset_valid: `mode` must be one "
                     r"of \('next_step', 'same_step'\).*DISABLED"):
    jr.autoreset_valid(term, trunc, mode=gym_vector.AutoresetMode.DISABLED)


def test_numeric_flags_and_the_first_step():
  term = np.array([[0, 0], [2, 0], [0, 0]], np.int32)
  trunc = np.array([[0.0, 0.0], [0.0, 1.0], [0.0, 0.0]], np.float32)
  valid = jr.autoreset_valid(term, trunc, mode="next_step")
  np.testing.assert_array_equal(valid, [[True, True], [True, True],
                                        [False, False]])
  valid = jr.autoreset_valid(term, trunc, mode="next_step",
                             prev_done=np.array([1, 0], np.int32))
  np.testing.assert_array_equal(valid[0], [False, True])


# --------------------------------------------------------------------------
# Invalid steps weigh nothing downstream.
# --------------------------------------------------------------------------


def numpy_normalize(adv, mask, eps=1e-8):
  a = np.asarray(adv, np.float64)[mask]
  out = np.zeros(np.shape(adv))
  out[mask] = (a - a.mean()) / (a.std() + eps)
  return out


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_normalize_advantages_over_valid_steps(transform):
  data, _, _ = make_world(5, 16, 4)
  _, adv, _ = next_step_gae(data)
  adv = adv.at[~data["valid"]].set(jnp.nan)   # never read
  got = transform(functools.partial(jr.normalize_advantages))(
      adv, valid=data["valid"])
  np.testing.assert_allclose(got, numpy_normalize(adv, data["valid"]),
                             rtol=1e-5, atol=1e-6)
  none = transform(jr.normalize_advantages)(adv, valid=np.zeros((16, 4),
                                                                bool))
  np.testing.assert_array_equal(none, 0.0)
  every = transform(jr.normalize_advantages)(jnp.ones((16, 1), jnp.float32),
                                            valid=np.ones((16, 1), bool))
  np.testing.assert_array_equal(every, 0.0)


def test_minibatches_carry_the_mask_as_a_loss_weight():
  data, _, _ = make_world(7, 8, 4)
  valid, adv, _ = next_step_gae(data)
  state = jr.init(num_envs=4, num_steps=8)
  state = jr.register(state, "advantage")
  state = jr.register(state, "weight")
  state = jr.update_all(state, {"advantage": adv,
                                "weight": valid.astype(jnp.float32)})

  def body(carry, mb):
    total, count = carry
    return (total + (mb["weight"] * mb["advantage"]).sum(),
            count + mb["weight"].sum()), None

  zero = jnp.zeros((), jnp.float32)
  (total, count), _ = jax.jit(
      lambda s, k: jr.scan_minibatches(body, (zero, zero), k, s, 8,
                                       num_epochs=2))(state,
                                                      jax.random.key(0))
  mask = data["valid"]
  assert float(count) == 2 * mask.sum()
  np.testing.assert_allclose(total, 2 * np.asarray(adv)[mask].sum(),
                             rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------
# Misuse: errors at trace time naming the function, the argument, what was
# expected and what was given; NaN flags eagerly or through checkify.
# --------------------------------------------------------------------------


def _args(num_steps=5, num_envs=4):
  z = np.zeros((num_steps, num_envs), np.float32)
  return dict(rewards=z, values=z, last_value=np.zeros(num_envs, np.float32),
              terminations=z.astype(bool))


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("name", ["values", "terminations", "truncations",
                                  "final_values", "valid"])
def test_gae_shape_mismatch(transform, name):
  a = _args()
  kw = dict(truncations=np.zeros((5, 4), bool),
            final_values=np.zeros((5, 4), np.float32),
            valid=np.ones((5, 4), bool))
  bad = np.zeros((3, 4), np.float32)
  if name in a:
    a[name] = bad
  else:
    kw[name] = bad
  with pytest.raises(
      ValueError,
      match=rf"gae: `{name}` has shape \(3, 4\), expected \(5, 4\) = "
      r"rewards.shape \(\[T, E\]\)"):
    transform(gae)(a["rewards"], a["values"], a["last_value"],
                   a["terminations"], **kw)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_gae_last_value_shape(transform):
  a = _args()
  with pytest.raises(
      ValueError,
      match=r"gae: `last_value` has shape \(5, 4\), expected \(4,\) = "
      r"rewards.shape\[1:\]"):
    transform(gae)(a["rewards"], a["values"], a["values"], a["terminations"])


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_gae_rewards_without_time_axis(transform):
  with pytest.raises(ValueError, match=r"gae: `rewards` has shape \(\), "
                     "expected at least one axis"):
    transform(gae)(jnp.float32(0.0), jnp.float32(0.0), jnp.float32(0.0),
                   jnp.bool_(False))


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_gae_zero_steps(transform):
  a = _args(num_steps=0)
  with pytest.raises(ValueError, match=r"gae: `rewards` has shape \(0, 4\), "
                     r"expected T = rewards.shape\[0\] >= 1"):
    transform(gae)(a["rewards"], a["values"], a["last_value"],
                   a["terminations"])


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_gae_truncations_without_final_values(transform):
  a = _args()
  with pytest.raises(ValueError, match=r"gae: `truncations` was given without "
                     r"`final_values`: .*auto-reset.*with next-step autoreset, "
                     r"where values\[t \+ 1\] is the final obs, pass "
                     r"valid=jr.autoreset_valid\(...\) and no truncations"):
    transform(gae)(**a, truncations=a["terminations"])


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_gae_final_values_without_truncations(transform):
  a = _args()
  with pytest.raises(ValueError, match=r"gae: `final_values` was given "
                     r"without `truncations`"):
    transform(gae)(**a, final_values=a["values"])


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_gae_integer_values(transform):
  a = _args()
  with pytest.raises(TypeError, match=r"gae: `values` has dtype int32, "
                     "expected a floating dtype"):
    transform(gae)(a["rewards"], a["values"].astype(np.int32),
                   a["last_value"], a["terminations"])


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("name", ["gamma", "gae_lambda"])
@pytest.mark.parametrize("value", [1.5, -0.1, float("nan")])
def test_gae_discount_out_of_range(transform, name, value):
  a = _args()
  # Bound with partial so the Python float stays static under jit.
  f = transform(functools.partial(gae, **{name: value}))
  with pytest.raises(ValueError,
                     match=rf"gae: `{name}` must be in \[0, 1\], got"):
    f(**a)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_gae_discount_not_scalar(transform):
  a = _args()
  with pytest.raises(ValueError, match=r"gae: `gamma` has shape \(4,\), "
                     r"expected a scalar \(\)"):
    transform(gae)(**a, gamma=jnp.full((4,), 0.9))


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_normalize_advantages_errors(transform):
  f = transform(normalize_advantages)
  with pytest.raises(TypeError, match=r"normalize_advantages: `advantages` "
                     "has dtype int32, expected a floating dtype"):
    f(jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError, match=r"normalize_advantages: `advantages` "
                     r"has shape \(0, 4\), expected at least one element"):
    f(jnp.zeros((0, 4)))
  with pytest.raises(ValueError,
                     match=r"normalize_advantages: `eps` must be >= 0"):
    transform(functools.partial(normalize_advantages, eps=-1.0))(
        jnp.zeros((3,)))
  with pytest.raises(ValueError, match=r"^normalize_advantages: `valid` has "
                     r"shape \(4,\), expected \(5, 4\) = advantages.shape"):
    transform(lambda v: normalize_advantages(jnp.zeros((5, 4)), valid=v))(
        np.ones(4, bool))


def test_arguments_that_fail_inside_numpy_or_jax_name_the_function():
  ones = np.ones((2, 1), np.float32)
  for name in ["rewards", "last_value", "final_values"]:
    args = {"rewards": ones, "values": ones, "last_value": ones[0],
            "terminations": np.zeros((2, 1), bool),
            "truncations": np.zeros((2, 1), bool), "final_values": ones}
    args[name] = args[name] * (1 + 1j)
    with pytest.raises(TypeError, match=rf"^gae: `{name}` has dtype "
                       "complex"):
      gae(**args)
  with pytest.raises(TypeError, match=r"^gae: `rewards` is not an array of "
                     r"numbers \(list, ragged\?\)"):
    gae([[1.0], [2.0, 3.0]], np.ones((2, 1)), np.ones(1),
        np.zeros((2, 1), bool))
  with pytest.raises(TypeError, match=r"^normalize_advantages: `advantages` "
                     r"is not an array of numbers \(PRNGKeyArray\)"):
    normalize_advantages(jax.random.key(0))


def reset_step_with_a_flag():
  """Same-step-like data: an episode of one step right after another."""
  term = np.array([[False, False], [True, False], [True, False],
                   [False, False]])
  return term, np.zeros((4, 2), bool)


def test_inconsistent_flags_raise_eagerly():
  term, trunc = reset_step_with_a_flag()
  with pytest.raises(ValueError, match=(
      r"^autoreset_valid: mode='next_step': a reset step \(the step after "
      r"an episode ended, whose action the env ignores\) has terminations or "
      r"truncations set at \(t=2, e=0\); next-step autoreset never does "
      r"that: is this same-step data \(pass mode='same_step'\), or is "
      r"`prev_done` wrong\?$")):
    jr.autoreset_valid(term, trunc, mode="next_step")
  # prev_done makes step 0 a reset step: its truncation is inconsistent.
  trunc0 = np.zeros((4, 2), bool)
  trunc0[0, 1] = True
  with pytest.raises(ValueError, match=r"at \(t=0, e=1\);"):
    jr.autoreset_valid(np.zeros((4, 2), bool), trunc0, mode="next_step",
                       prev_done=np.array([False, True]))
  # Unchecked, or as same-step data, it is accepted.
  jr.autoreset_valid(term, trunc, mode="next_step", check="off")
  jr.autoreset_valid(term, trunc, mode="same_step")


def test_inconsistent_flags_under_jit_are_a_checkify_check():
  term, trunc = reset_step_with_a_flag()
  fn = functools.partial(jr.autoreset_valid, mode="next_step")
  err, valid = jax.jit(checkify.checkify(fn))(term, trunc)
  assert err.get().startswith(
      "autoreset_valid: mode='next_step': a reset step")
  assert "at 1 (step, env) pairs, the first at flat index 4 of [T, E]" in (
      err.get())
  np.testing.assert_array_equal(valid[:, 0], [True, True, False, False])
  err, _ = jax.jit(checkify.checkify(fn))(np.zeros((4, 2), bool), trunc)
  assert err.get() is None
  # Without checkify the check compiles to nothing (as finish_rollout's).
  jax.block_until_ready(jax.jit(fn)(term, trunc))
  err, _ = jax.jit(checkify.checkify(jax.vmap(fn)))(
      np.stack([term, np.zeros_like(term)]), np.stack([trunc, trunc]))
  assert "a reset step" in err.get()


@pytest.mark.parametrize("transform", [lambda f: f, jax.jit],
                         ids=["nojit", "jit"])
def test_autoreset_valid_argument_errors(transform):
  term = np.zeros((3, 2), bool)

  def call(terminations, truncations, prev_done=None, **kwargs):
    return transform(lambda a, b, p: jr.autoreset_valid(
        a, b, prev_done=p, **kwargs))(terminations, truncations, prev_done)

  with pytest.raises(ValueError, match=r"^autoreset_valid: `mode` must be "
                     r"one of \('next_step', 'same_step'\).*got 'nextstep'"):
    call(term, term, mode="nextstep")
  with pytest.raises(ValueError, match=r"^autoreset_valid: `truncations` has "
                     r"shape \(3, 1\), expected \(3, 2\) = terminations.shape"):
    call(term, term[:, :1], mode="next_step")
  with pytest.raises(ValueError, match=r"^autoreset_valid: `prev_done` has "
                     r"shape \(3,\), expected \(2,\) = terminations.shape"):
    call(term, term, np.zeros(3, bool), mode="next_step")
  with pytest.raises(ValueError, match=r"^autoreset_valid: `terminations` "
                     r"has shape \(0, 2\), expected \[T, E\] with T >= 1"):
    call(term[:0], term[:0], mode="next_step")
  with pytest.raises(ValueError, match=r"^autoreset_valid: `prev_done` was "
                     r"given with mode='same_step'"):
    call(term, term, term[0], mode="same_step")


def test_autoreset_valid_type_errors():
  term = np.zeros((3, 2), bool)
  with pytest.raises(TypeError, match=r"^autoreset_valid: `truncations` has "
                     r"dtype <U1, expected bool or numeric flags"):
    jr.autoreset_valid(term, np.full((3, 2), "a"), mode="next_step")
  with pytest.raises(TypeError, match=r"^autoreset_valid: `prev_done`"):
    jr.autoreset_valid(term, term, mode="next_step",
                       prev_done=np.full(2, "a"))


T, E = 3, 4   # the misuse rollouts


def _rollout(flags=None, where="terminations"):
  r = np.ones((T, E), np.float32)
  kwargs = {"terminations": np.zeros((T, E), np.float32)}
  if flags is not None:
    kwargs[where] = flags
  if where == "truncations":
    kwargs["final_values"] = r
  return (r, r, r[0]), kwargs


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
@pytest.mark.parametrize("where", ["terminations", "truncations", "valid"])
def test_gae_refuses_string_flags_at_trace_time(where, jit):
  flags = np.full((T, E), "no")
  args, kwargs = _rollout(flags, where)
  before = snapshot((args, kwargs))

  def call():
    return jr.gae(*args, **kwargs)

  with pytest.raises(TypeError, match=(
      rf"^gae: `{where}` has dtype <U2, expected bool or numeric flags")):
    jax.jit(call)() if jit else call()
  assert_same((args, kwargs), before)


@pytest.mark.parametrize("where", ["terminations", "truncations", "valid"])
def test_gae_refuses_nan_flags_eagerly(where):
  flags = np.zeros((T, E), np.float32)
  flags[1, 2] = flags[2, 0] = np.nan
  for bad in (flags, jnp.asarray(flags)):
    args, kwargs = _rollout(bad, where)
    before = snapshot((args, kwargs))
    with pytest.raises(ValueError, match=(
        rf"^gae: `{where}` has NaN at 2 of 12 elements \(the first at flat "
        r"index 6\); a flag is True or False and NaN would read as True")):
      jr.gae(*args, **kwargs)
    assert_same((args, kwargs), before)


@pytest.mark.parametrize("vmap", [False, True], ids=["jit", "jit_vmap"])
@pytest.mark.parametrize("where", ["terminations", "truncations", "valid"])
def test_gae_reports_traced_nan_flags_through_checkify(where, vmap):
  """Under jit the values cannot raise: a checkify check reports them when
  the caller functionalises the function (finish_rollout's mechanism), and
  compiles to nothing otherwise (NaN then reads as True, as documented)."""
  flags = np.zeros((T, E), np.float32)
  flags[2, 1] = np.nan
  r = np.ones((T, E), np.float32)

  def f(r, flags):   # every other flag false, final values 1
    zeros = jnp.zeros(r.shape, r.dtype)
    kwargs = {"terminations": zeros, where: flags}
    if where == "truncations":
      kwargs["final_values"] = r
    return jr.gae(r, r, r[0], **kwargs)

  if vmap:   # over envs: each call sees [T] columns
    f = jax.vmap(f, in_axes=1)
  err, _ = jax.jit(checkify.checkify(f))(r, flags)
  size = T if vmap else T * E
  assert err.get().startswith(
      f"gae: `{where}` has NaN at 1 of {size} elements (the first at flat "
      f"index {2 if vmap else 9})")
  err, _ = jax.jit(checkify.checkify(f))(r, np.zeros((T, E), np.float32))
  assert err.get() is None
  adv = jax.jit(f)(r, flags)[0]   # no checkify: no error, no NaN
  assert np.isfinite(np.asarray(adv)).all()


def test_numeric_flags_without_nan_are_accepted_without_recompiling(
    count_compiles):
  gae = jax.jit(jr.gae)
  r = jnp.ones((T, E))
  gae(r, r, r[0], jnp.zeros((T, E)))
  flags = jnp.asarray(np.eye(T, E, dtype=np.float32))
  with count_compiles() as c:
    adv, _ = gae(r, r, r[0], flags)
  assert c.count == 0
  want, _ = jr.gae(r, r, r[0], flags.astype(bool))
  np.testing.assert_array_equal(adv, want)
  # Integer and bool flags cannot hold a NaN: nothing is read back.
  jr.gae(r, r, r[0], np.eye(T, E, dtype=np.int32))


@pytest.mark.parametrize("name", ["terminations", "truncations"])
def test_autoreset_valid_refuses_nan_flags(name):
  """The gae rule holds in autoreset_valid too: NaN would read as True."""
  flags = {"terminations": np.zeros((3, 2), np.float32),
           "truncations": np.zeros((3, 2), np.float32)}
  flags[name][1, 0] = np.nan
  before = {k: v.copy() for k, v in flags.items()}
  msg = (f"autoreset_valid: `{name}` has NaN at 1 of 6 elements (the first "
         "at flat index 2)")
  with pytest.raises(ValueError, match="^" + re.escape(msg)):
    jr.autoreset_valid(**flags, mode="next_step")
  for k in flags:
    np.testing.assert_array_equal(flags[k], before[k])
  err, _ = jax.jit(checkify.checkify(
      lambda f: jr.autoreset_valid(**f, mode="next_step", check="off")))(
          flags)
  assert err.get().startswith(msg), err.get()
  # Without a NaN the same float flags are accepted, and give the same
  # mask as bools.
  clean = {k: np.nan_to_num(v) for k, v in flags.items()}
  np.testing.assert_array_equal(
      jr.autoreset_valid(**clean, mode="next_step"),
      jr.autoreset_valid(**{k: v.astype(bool) for k, v in clean.items()},
                         mode="next_step"))
  with pytest.raises(TypeError, match=r"autoreset_valid: `terminations` has "
                     r"dtype <U1, expected bool or numeric flags"):
    jr.autoreset_valid(np.array([["a", "b"]]), np.zeros((1, 2)),
                       mode="next_step")


def test_normalize_advantages_valid_flags():
  adv = np.arange(6, dtype=np.float32)
  with pytest.raises(TypeError, match=(
      r"^normalize_advantages: `valid` has dtype <U1, expected bool or "
      "numeric flags")):
    jax.jit(lambda a: jr.normalize_advantages(a, valid=np.array(["1"] * 6)))(
        adv)
  valid = np.array([1, 1, np.nan, 1, 0, 1], np.float32)
  before = valid.copy()
  with pytest.raises(ValueError, match=(
      r"^normalize_advantages: `valid` has NaN at 1 of 6 elements \(the "
      r"first at flat index 2\)")):
    jr.normalize_advantages(adv, valid=valid)
  np.testing.assert_array_equal(valid, before)
  err, _ = jax.jit(checkify.checkify(
      lambda a, v: jr.normalize_advantages(a, valid=v)))(adv, valid)
  assert err.get().startswith("normalize_advantages: `valid` has NaN at 1")


