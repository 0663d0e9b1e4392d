"""Tests for jrollout._gae: gae and normalize_advantages."""

import functools

from hypothesis import given
from hypothesis import HealthCheck
from hypothesis import settings
from hypothesis import strategies as st
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrollout._gae import gae
from jrollout._gae import normalize_advantages
from tests.conftest import TRANSFORMS

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
# Errors.
# --------------------------------------------------------------------------


def _args(num_steps=5, num_envs=4):
  z = np.zeros((num_steps, num_envs), np.float32)
  return dict(rewards=z, values=z, last_value=np.zeros(num_envs, np.float32),
              terminations=z.astype(bool))


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("name", ["values", "terminations", "truncations",
                                  "final_values"])
def test_gae_shape_mismatch(transform, name):
  a = _args()
  kw = dict(truncations=np.zeros((5, 4), bool),
            final_values=np.zeros((5, 4), np.float32))
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
                     r"`final_values`: .*auto-reset"):
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
