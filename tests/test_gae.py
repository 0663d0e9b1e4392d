"""gae, normalize_advantages and autoreset_valid against numpy models:
``reference_gae`` (tests/reference.py), numbers computed by rlax, and one
random stream of transitions per env written as each autoreset mode stores
it (next-step, same-step, in-JAX), whose advantages every form must give."""

import functools
import re

import chex
from hypothesis import given
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
from tests.reference import call
from tests.reference import random_rollout
from tests.reference import reference_gae
from tests.conftest import TRANSFORMS

GAMMA, LAMBDA = 0.9, 0.8
pytestmark = pytest.mark.usefixtures("strict_numpy")
close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("shape, gamma, gae_lambda, variant", [
    ((16, 5), 0.97, 0.9, "truncated"),
    ((8, 3), None, None, "truncated"),          # the defaults 0.99, 0.95
    ((7,), 0.9, 0.8, "truncated"),              # [T]
    ((6, 2, 3), 0.9, 0.8, "truncated"),         # [T, E, K]
    ((9, 3), 0.9, 0.7, "no truncations"),
    ((1, 2), 0.5, 0.9, "no truncations"),       # one step
    ((6, 2), 0.0, 0.95, "truncated"),           # one-step advantage r - V
    ((6, 2), 0.9, 0.0, "truncated"),
    ((6, 2), 1.0, 1.0, "truncated"),
    ((6, 2), jnp.float32(0.9), jnp.asarray(0.8, jnp.float32), "truncated"),
    ((5, 2), None, None, "bfloat16"),           # computed in values.dtype
    ((5, 2), None, None, "float16"),
])
def test_gae_matches_reference(transform, shape, gamma, gae_lambda, variant):
  d = random_rollout(0, shape)
  if shape == (16, 5):
    assert d["terminations"].any() and d["truncations"].any()
    assert (d["terminations"] & d["truncations"]).any()
  discounts = {} if gamma is None else dict(gamma=gamma,
                                            gae_lambda=gae_lambda)
  if variant == "no truncations":
    d = dict(d, truncations=None, final_values=None)
  dtype = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}.get(
      variant, jnp.float32)
  inputs = (d if dtype == jnp.float32
            else dict(d, values=jnp.asarray(d["values"], dtype)))
  adv, ret = call(transform(functools.partial(gae, **discounts)), inputs)
  want_adv, want_ret = reference_gae(**d, **{k: float(v) for k, v in
                                             discounts.items()})
  assert adv.shape == ret.shape == shape
  assert adv.dtype == ret.dtype == dtype
  tol = 1e-5 if dtype == jnp.float32 else 0.1
  np.testing.assert_allclose(np.asarray(adv, np.float32), want_adv, rtol=tol,
                             atol=tol)
  np.testing.assert_allclose(np.asarray(ret, np.float32), want_ret, rtol=tol,
                             atol=tol)
  if gamma == 0.0:
    close(adv, d["rewards"] - d["values"])


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_gae_flags_and_unused_final_values(transform):
  """Numeric flags equal bool ones; final_values read at truncated steps."""
  d = random_rollout(6, (10, 4))
  f = transform(gae)
  want = call(f, d)
  floats = dict(d, terminations=d["terminations"].astype(np.float32),
                truncations=d["truncations"].astype(np.int32))
  chex.assert_trees_all_equal(call(f, floats), want)
  used = d["truncations"] & ~d["terminations"]
  garbage = np.where(used, d["final_values"], np.nan).astype(np.float32)
  chex.assert_trees_all_equal(call(f, dict(d, final_values=garbage)), want)
  changed = call(f, dict(d, final_values=d["final_values"] + 1.0))
  assert not np.allclose(changed[0], want[0])


def test_gae_jit_does_not_retrace(count_compiles):
  traces = []

  @jax.jit
  def f(*args, **kwargs):
    traces.append(None)
    return gae(*args, **kwargs)

  call(f, random_rollout(10, (4, 2)), gamma=0.9, gae_lambda=0.8)
  d = {k: jax.device_put(x) for k, x in random_rollout(11, (4, 2)).items()}
  with count_compiles() as counter:
    adv, _ = call(f, d, gamma=0.95, gae_lambda=0.8)
  assert counter.count == 0 and len(traces) == 1
  close(adv, reference_gae(**d, gamma=0.95, gae_lambda=0.8)[0])


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_gae_vmap_over_seeds_and_discounts(transform):
  ds = [random_rollout(20 + s, (7, 4)) for s in range(3)]
  stacked = {k: np.stack([d[k] for d in ds]) for k in ds[0]}
  gammas = np.array([0.9, 0.95, 0.99], np.float32)
  adv, ret = transform(jax.vmap(lambda d, g: call(
      gae, d, gamma=g, gae_lambda=0.9)))(stacked, gammas)
  assert adv.shape == ret.shape == (3, 7, 4)
  for s, d in enumerate(ds):
    want = reference_gae(**d, gamma=float(gammas[s]), gae_lambda=0.9)
    close(adv[s], want[0])
    close(ret[s], want[1])


@st.composite
def rollouts(draw):
  shape = (draw(st.integers(1, 6)), draw(st.integers(1, 3)))
  floats = st.floats(-10, 10, width=32)
  arrays = functools.partial(hnp.arrays, np.float32, elements=floats)
  return dict(rewards=draw(arrays(shape)), values=draw(arrays(shape)),
              last_value=draw(arrays(shape[1:])),
              terminations=draw(hnp.arrays(np.bool_, shape)),
              truncations=draw(hnp.arrays(np.bool_, shape)),
              final_values=draw(arrays(shape)))


_jit_gae = jax.jit(gae)   # one compile per (T, E), shared across examples


@given(d=rollouts(), gamma=st.floats(0.0, 1.0), gae_lambda=st.floats(0.0, 1.0))
def test_gae_property_matches_reference(d, gamma, gae_lambda):
  adv, ret = call(_jit_gae, d, gamma=gamma, gae_lambda=gae_lambda)
  want_adv, want_ret = reference_gae(**d, gamma=gamma, gae_lambda=gae_lambda)
  np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-4)
  # The trace is cut at every episode end: A_t there depends on step t only.
  done = d["terminations"] | d["truncations"]
  one_step = call(_jit_gae, d, gamma=gamma, gae_lambda=0.0)[0]
  np.testing.assert_allclose(np.where(done, adv, 0.0),
                             np.where(done, one_step, 0.0), rtol=1e-6,
                             atol=1e-6)


# A fixed T=6, E=2 rollout without truncation, gamma=0.9, gae_lambda=0.8.
RLAX_REWARDS = np.array([[1.0, -0.5], [0.0, 2.0], [0.5, 0.0], [-1.0, 1.0],
                         [2.0, 0.25], [0.0, -1.5]], np.float32)
RLAX_VALUES = np.array([[0.5, 1.0], [1.5, -0.25], [0.0, 0.75], [2.0, 0.5],
                        [-0.5, 1.25], [1.0, 0.0]], np.float32)
RLAX_LAST_VALUE = np.array([0.75, -1.0], np.float32)
RLAX_TERMINATIONS = np.array([[0, 0], [1, 0], [0, 0], [0, 1], [0, 0], [0, 1]],
                             bool)
# Computed by rlax 0.1.9 (jax 0.10.2, float32, in a separate venv; rlax is
# not a test dependency) as
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
@pytest.mark.parametrize("truncations", [None, np.zeros((6, 2), bool)])
def test_gae_no_truncation_matches_rlax(transform, truncations):
  final = None if truncations is None else np.zeros((6, 2), np.float32)
  adv, ret = transform(functools.partial(gae, gamma=0.9, gae_lambda=0.8))(
      RLAX_REWARDS, RLAX_VALUES, RLAX_LAST_VALUE, RLAX_TERMINATIONS,
      truncations=truncations, final_values=final)
  np.testing.assert_allclose(adv, RLAX_ADVANTAGES, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ret, RLAX_ADVANTAGES + RLAX_VALUES, rtol=1e-5,
                             atol=1e-6)


def numpy_normalize(adv, mask=None, eps=1e-8):
  a = np.asarray(adv, np.float64)
  mask = np.ones(a.shape, bool) if mask is None else mask
  out = np.zeros(a.shape)
  out[mask] = (a[mask] - a[mask].mean()) / (a[mask].std() + eps)
  return out


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("shape", [(16, 4), (33,)])
def test_normalize_advantages(transform, shape):
  a = np.random.default_rng(0).normal(3.0, 5.0, size=shape).astype(np.float32)
  out = transform(normalize_advantages)(a)
  assert out.shape == shape and out.dtype == jnp.float32
  close(out, numpy_normalize(a))
  np.testing.assert_array_equal(
      transform(normalize_advantages)(jnp.full((3, 2), 7.0)), 0.0)
  out = transform(functools.partial(normalize_advantages, eps=1.0))(a)
  close(out, numpy_normalize(a, eps=1.0))
  out = jax.vmap(transform(normalize_advantages))(a.reshape(-1, shape[-1]))
  for row, want in zip(out, a.reshape(-1, shape[-1])):
    close(row, numpy_normalize(want))


def make_stream(rng, length, p_term, p_trunc):
  """Transitions ``i < length``: V(obs_i), reward, flags, V(final obs);
  ``value[i + 1]`` is the next obs's, the next episode's first where i
  ended one."""
  return dict(value=rng.normal(size=length + 1).astype(np.float32),
              reward=rng.normal(size=length).astype(np.float32),
              term=rng.random(length) < p_term,
              trunc=rng.random(length) < p_trunc,
              final=rng.normal(size=length).astype(np.float32))


def next_step_form(s, num_steps, prev_done, prev_final, rng):
  """The stream as EnvPool / gymnasium NEXT_STEP store it: ``(rows,
  last_value, n)``, T rows of (value, reward, term, trunc, is_transition)
  holding ``n`` transitions; a reset row holds V(final obs) of the episode
  that just ended and a reward never used."""
  rows = []
  if prev_done:
    rows.append((prev_final, rng.normal(), False, False, False))
  i = 0
  while len(rows) < num_steps:
    rows.append((s["value"][i], s["reward"][i], s["term"][i], s["trunc"][i],
                 True))
    if (s["term"][i] or s["trunc"][i]) and len(rows) < num_steps:
      rows.append((s["final"][i], rng.normal(), False, False, False))
    i += 1
  done = s["term"][i - 1] or s["trunc"][i - 1]
  # obs_T: the final obs after a last step that ended an episode, else the
  # next obs (or, after a reset row, the next episode's first obs).
  last = s["final"][i - 1] if rows[-1][4] and done else s["value"][i]
  return rows, np.float32(last), i


def same_step_form(s, n):
  """The first n transitions as gymnasium SAME_STEP stores them: final
  values only where an episode ended (NaN elsewhere), both flags may be set."""
  done = s["term"][:n] | s["trunc"][:n]
  return dict(rewards=s["reward"][:n], values=s["value"][:n],
              last_value=np.float32(s["value"][n]),
              terminations=s["term"][:n], truncations=s["trunc"][:n],
              final_values=np.where(done, s["final"][:n], np.nan
                                    ).astype(np.float32))


def in_jax_form(s, n):
  """The first n transitions as a gymnax scan stores them: final values at
  every step, truncation cleared where terminated (``step_envs`` in
  ``examples/common/gymnax_envs.py``)."""
  done = s["term"][:n] | s["trunc"][:n]
  return dict(rewards=s["reward"][:n], values=s["value"][:n],
              last_value=np.float32(s["value"][n]),
              terminations=s["term"][:n],
              truncations=s["trunc"][:n] & ~s["term"][:n],
              final_values=np.where(done, s["final"][:n], s["value"][1:n + 1]
                                    ).astype(np.float32))


def model_advantages(s, n, gamma=GAMMA, gae_lambda=LAMBDA):
  """A_i = sum_k (gamma lambda)^(k-i) delta_k in float64, over transitions
  k from i to the end of i's episode (or of the data)."""
  value = s["value"].astype(np.float64)
  delta = np.zeros(n)
  for k in range(n):
    boot = (0.0 if s["term"][k] else float(s["final"][k]) if s["trunc"][k]
            else value[k + 1])
    delta[k] = s["reward"][k] + gamma * boot - value[k]
  adv = np.zeros(n)
  for i in range(n):
    for k in range(i, n):
      adv[i] += (gamma * gae_lambda) ** (k - i) * delta[k]
      if s["term"][k] or s["trunc"][k]:
        break
  return adv


def make_world(seed, num_steps, num_envs, p_term=0.25, p_trunc=0.2):
  """E streams and their next-step ``[T, E]`` form."""
  rng = np.random.default_rng(seed)
  prev_done = rng.random(num_envs) < 0.3
  streams, forms = [], []
  for e in range(num_envs):
    streams.append(make_stream(rng, num_steps, p_term, p_trunc))
    forms.append(next_step_form(streams[-1], num_steps, prev_done[e],
                                rng.normal(), rng))

  def column(j, dtype):
    return np.array([[rows[t][j] for rows, _, _ in forms]
                     for t in range(num_steps)], dtype)

  data = dict(values=column(0, np.float32), rewards=column(1, np.float32),
              terminations=column(2, bool), truncations=column(3, bool),
              valid=column(4, bool), prev_done=prev_done,
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


def check_world(data, streams, ns, valid, adv, ret):
  """Every form's advantages equal the model's, at every valid step."""
  mask = data["valid"]
  np.testing.assert_array_equal(valid, mask)
  adv, ret = np.asarray(adv), np.asarray(ret)
  np.testing.assert_array_equal(adv[~mask], 0.0)
  np.testing.assert_array_equal(ret[~mask], data["values"][~mask])
  for e, (s, n) in enumerate(zip(streams, ns)):
    ours, our_ret = adv[mask[:, e], e], ret[mask[:, e], e]
    assert ours.shape == (n,)
    close(ours, model_advantages(s, n))
    np.testing.assert_allclose(our_ret, ours + s["value"][:n], rtol=1e-6,
                               atol=1e-6)
    for form in ([same_step_form(s, n), in_jax_form(s, n)] if n else []):
      got = call(_jit_gae, form, gamma=GAMMA, gae_lambda=LAMBDA)
      chex.assert_trees_all_equal(tuple(map(np.asarray, got)), (ours, our_ret))


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_next_step_matches_model_and_other_forms(transform, seed):
  data, streams, ns = make_world(seed, 16, 5)
  assert (~data["valid"]).any() and data["prev_done"].any()
  assert (data["terminations"] & data["truncations"]).any() or seed
  valid, adv, ret = transform(next_step_gae)(data)
  assert valid.dtype == jnp.bool_ and adv.dtype == jnp.float32
  check_world(data, streams, ns, valid, adv, ret)


@given(seed=st.integers(0, 2**31 - 1), num_steps=st.sampled_from([1, 5, 12]),
       num_envs=st.sampled_from([1, 4]),
       p_term=st.sampled_from([0.0, 0.2, 0.6]),
       p_trunc=st.sampled_from([0.0, 0.2, 0.6]))
def test_property_three_forms_agree(seed, num_steps, num_envs, p_term,
                                    p_trunc):
  data, streams, ns = make_world(seed, num_steps, num_envs, p_term, p_trunc)
  check_world(data, streams, ns, *jax.jit(next_step_gae)(data))


def test_gymnasium_modes_numeric_flags_and_the_first_step():
  term = np.array([[0, 0], [2, 0], [0, 0]], np.int32)
  trunc = np.array([[0.0, 0.0], [0.0, 1.0], [0.0, 0.0]], np.float32)
  np.testing.assert_array_equal(jr.autoreset_valid(term, trunc,
                                                   mode="next_step"),
                                [[1, 1], [1, 1], [0, 0]])
  valid = jr.autoreset_valid(term, trunc, mode="next_step",
                             prev_done=np.array([1, 0], np.int32))
  np.testing.assert_array_equal(valid[0], [False, True])
  same = jr.autoreset_valid(term[:, 0], trunc[:, 0], mode="same_step")
  assert same.shape == (3,) and bool(same.all())   # [T]: every step
  gym_vector = pytest.importorskip("gymnasium.vector")
  for mode, want in [(gym_vector.AutoresetMode.NEXT_STEP, [True, False]),
                     (gym_vector.AutoresetMode.SAME_STEP, [True, True])]:
    np.testing.assert_array_equal(jr.autoreset_valid(
        term[1:, :1] > 0, trunc[1:, :1] > 0, mode=mode)[:, 0], want)
  with pytest.raises(ValueError, match=r"autoreset_valid: `mode` must be one "
                     r"of \('next_step', 'same_step'\).*DISABLED"):
    jr.autoreset_valid(term, trunc, mode=gym_vector.AutoresetMode.DISABLED)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_normalize_advantages_over_the_valid_steps(transform):
  """The mean and std of the valid steps; invalid ones (NaN here) map to 0."""
  data, _, _ = make_world(5, 8, 4)
  _, adv, _ = next_step_gae(data)
  mask = data["valid"]
  norm = transform(jr.normalize_advantages)
  close(norm(adv.at[~mask].set(jnp.nan), valid=mask),
        numpy_normalize(adv, mask))
  np.testing.assert_array_equal(norm(adv, valid=np.zeros((8, 4), bool)), 0.0)
  np.testing.assert_array_equal(norm(jnp.ones((8, 1)),
                                     valid=np.ones((8, 1), bool)), 0.0)


# --- Misuse: errors at trace time naming the function, the argument, what
# was expected and what was given; NaN flags eagerly or through checkify. --

T, E = 3, 4


def _args(num_steps=T):
  z = np.zeros((num_steps, E), np.float32)
  return dict(rewards=z, values=z, last_value=np.zeros(E, np.float32),
              terminations=z.astype(bool))


_BAD = np.zeros((2, E), np.float32)
_TRUNC = dict(truncations=np.zeros((T, E), bool),
              final_values=np.zeros((T, E), np.float32))
GAE_ERRORS = [
    *[({**_TRUNC, "valid": np.ones((T, E), bool), name: _BAD}, ValueError,
       rf"`{name}` has shape \(2, 4\), expected \(3, 4\) = rewards.shape "
       r"\(\[T, E\]\)")
      for name in ["values", "terminations", "truncations", "final_values",
                   "valid"]],
    ({"last_value": np.zeros((T, E))}, ValueError, r"`last_value` has shape "
     r"\(3, 4\), expected \(4,\) = rewards.shape\[1:\]"),
    ({"rewards": np.float32(0)}, ValueError, r"`rewards` has shape \(\), "
     r"expected \[T, E\] or \[T\] with T = rewards.shape\[0\] >= 1"),
    (_args(0), ValueError, r"`rewards` has shape \(0, 4\), expected"),
    ({"truncations": np.zeros((T, E), bool)}, ValueError,
     r"`truncations` was given without `final_values`: .*auto-reset.*with "
     r"next-step autoreset, where values\[t \+ 1\] is the final obs, pass "
     r"valid=jr.autoreset_valid\(...\) and no truncations"),
    ({"final_values": np.zeros((T, E), np.float32)}, ValueError,
     r"`final_values` was given without `truncations`"),
    ({"values": np.zeros((T, E), np.int32)}, TypeError, r"`values` has dtype "
     "int32, expected a floating dtype"),
    *[({name: v}, ValueError, rf"`{name}` must be in \[0, 1\], got")
      for name in ["gamma", "gae_lambda"] for v in [1.5, -0.1, float("nan")]],
    ({"gamma": jnp.full((4,), 0.9)}, ValueError, r"`gamma` has shape \(4,\), "
     r"expected a scalar \(\)"),
    *[({**_TRUNC, name: np.ones(shape, np.complex64)}, TypeError,
       rf"`{name}` has dtype complex")
      for name, shape in [("rewards", (T, E)), ("final_values", (T, E)),
                          ("last_value", (E,))]],
    *[({**_TRUNC, name: np.full((T, E), "no")}, TypeError,
       rf"`{name}` has dtype <U2, expected bool or numeric flags")
      for name in ["terminations", "truncations", "valid"]],
]


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("change, exc, match", GAE_ERRORS)
def test_gae_refuses(transform, change, exc, match):
  """Static arguments (discounts, lists) are bound, the arrays traced."""
  args = {**_args(), **change}
  static = {k: v for k, v in args.items()
            if k in ("gamma", "gae_lambda") or not isinstance(
                v, (np.ndarray, jax.Array)) or v.dtype.kind == "U"}
  arrays = {k: v for k, v in args.items() if k not in static}
  before = snapshot(arrays)
  with pytest.raises(exc, match=f"^gae: {match}"):
    transform(functools.partial(gae, **static))(**arrays)
  assert_same(arrays, before)


_ADV = jnp.zeros((5, 4))


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("value, kw, exc, match", [
    (jnp.zeros((3,), jnp.int32), {}, TypeError, r"`advantages` has dtype "
     "int32, expected a floating dtype"),
    (jnp.zeros((0, 4)), {}, ValueError, r"`advantages` has shape \(0, 4\), "
     "expected at least one element"),
    (jax.random.key(0), {}, TypeError, r"`advantages` is not an array of "
     r"numbers \(PRNGKeyArray\)"),
    (_ADV, dict(eps=-1.0), ValueError, r"`eps` must be >= 0"),
    (_ADV, dict(valid=np.ones(4, bool)), ValueError, r"`valid` has shape "
     r"\(4,\), expected \(5, 4\) = advantages.shape"),
    (_ADV, dict(valid=np.array(["1"] * 20).reshape(5, 4)), TypeError,
     r"`valid` has dtype <U1, expected bool or numeric flags"),
])
def test_normalize_advantages_refuses(transform, value, kw, exc, match):
  if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
    transform = lambda f: f   # noqa: E731 - a key is no jit argument here
  with pytest.raises(exc, match=f"^normalize_advantages: {match}"):
    transform(functools.partial(normalize_advantages, **kw))(value)


def _flag_call(fn, where, flags):
  """``fn`` with the flags ``where`` set to ``flags``, the others 0."""
  r = jnp.ones(flags.shape, jnp.float32)
  zeros = jnp.zeros(flags.shape, jnp.float32)
  if fn == "autoreset_valid":
    kw = {"terminations": zeros, "truncations": zeros, where: flags}
    return jr.autoreset_valid(**kw, mode="next_step", check="off")
  if fn == "normalize_advantages":
    return jr.normalize_advantages(r, valid=flags)
  kw = {"terminations": zeros, where: flags}
  if where == "truncations":
    kw["final_values"] = r
  return jr.gae(r, r, r[0], **kw)[0]


FLAG_USES = [("gae", "terminations"), ("gae", "truncations"), ("gae", "valid"),
             ("autoreset_valid", "terminations"),
             ("autoreset_valid", "truncations"),
             ("normalize_advantages", "valid")]


@pytest.mark.parametrize("fn, where", FLAG_USES)
def test_nan_flags_raise_eagerly_and_through_checkify(fn, where):
  """NaN flags: eagerly a ValueError, under jit a checkify check."""
  flags = np.zeros((T, E), np.float32)
  flags[1, 2] = flags[2, 0] = np.nan
  msg = (f"{fn}: `{where}` has NaN at 2 of 12 elements (the first at flat "
         "index 6); a flag is True or False and NaN would read as True")
  for bad in (flags, jnp.asarray(flags)):
    before = snapshot(bad)
    with pytest.raises(ValueError, match="^" + re.escape(msg)):
      _flag_call(fn, where, bad)
    assert_same(bad, before)
  run = jax.jit(checkify.checkify(lambda f: _flag_call(fn, where, f)))
  assert run(flags)[0].get().startswith(msg)
  assert run(np.nan_to_num(flags))[0].get() is None
  out = jax.jit(lambda f: _flag_call(fn, where, f))(flags)
  assert np.isfinite(np.asarray(out, np.float32)).all()   # NaN reads as True
  if fn == "gae":   # over envs: each call sees [T] columns
    err, _ = jax.jit(checkify.checkify(jax.vmap(
        lambda f: _flag_call(fn, where, f), in_axes=1)))(flags)
    assert err.get().startswith(f"gae: `{where}` has NaN at 1 of {T} "
                                "elements (the first at flat index")


def test_inconsistent_flags_raise_eagerly_or_through_checkify():
  # Same-step-like data: an episode of one step right after another.
  term = np.array([[0, 0], [1, 0], [1, 0], [0, 0]], bool)
  trunc = np.zeros((4, 2), bool)
  with pytest.raises(ValueError, match=(
      r"^autoreset_valid: mode='next_step': a reset step \(the step after "
      r"an episode ended, whose action the env ignores\) has terminations or "
      r"truncations set at \(t=2, e=0\); next-step autoreset never does "
      r"that: is this same-step data \(pass mode='same_step'\), or is "
      r"`prev_done` wrong\?$")):
    jr.autoreset_valid(term, trunc, mode="next_step")
  trunc0 = np.zeros((4, 2), bool)   # prev_done makes step 0 a reset step
  trunc0[0, 1] = True
  with pytest.raises(ValueError, match=r"at \(t=0, e=1\);"):
    jr.autoreset_valid(np.zeros((4, 2), bool), trunc0, mode="next_step",
                       prev_done=np.array([False, True]))
  jr.autoreset_valid(term, trunc, mode="next_step", check="off")
  jr.autoreset_valid(term, trunc, mode="same_step")
  fn = functools.partial(jr.autoreset_valid, mode="next_step")
  err, valid = jax.jit(checkify.checkify(fn))(term, trunc)
  assert err.get().startswith(
      "autoreset_valid: mode='next_step': a reset step")
  assert "at 1 (step, env) pairs, the first at flat index 4 of [T, E]" in (
      err.get())
  np.testing.assert_array_equal(valid[:, 0], [True, True, False, False])
  assert jax.jit(checkify.checkify(fn))(np.zeros((4, 2), bool), trunc)[
      0].get() is None
  jax.block_until_ready(jax.jit(fn)(term, trunc))   # no checkify: nothing
  err, _ = jax.jit(checkify.checkify(jax.vmap(fn)))(
      np.stack([term, np.zeros_like(term)]), np.stack([trunc, trunc]))
  assert "a reset step" in err.get()


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("term, trunc, prev_done, kw, exc, match", [
    ("ok", "ok", None, {"mode": "nextstep"}, ValueError, r"`mode` must be one "
     r"of \('next_step', 'same_step'\).*got 'nextstep'"),
    ("ok", "narrow", None, {}, ValueError, r"`truncations` has shape "
     r"\(3, 1\), expected \(3, 2\) = terminations.shape"),
    ("ok", "ok", np.zeros(3, bool), {}, ValueError, r"`prev_done` has shape "
     r"\(3,\), expected \(2,\) = terminations.shape"),
    ("empty", "empty", None, {}, ValueError, r"`terminations` has shape "
     r"\(0, 2\), expected \[T, E\] with T >= 1"),
    ("ok", "ok", np.zeros(2, bool), {"mode": "same_step"}, ValueError,
     r"`prev_done` was given with mode='same_step'"),
    ("ok", "str", None, {}, TypeError, r"`truncations` has dtype <U1, "
     "expected bool or numeric flags"),
    ("ok", "ok", np.full(2, "a"), {}, TypeError, r"`prev_done` has dtype"),
    ("str", "ok", None, {}, TypeError, r"`terminations` has dtype <U1"),
])
def test_autoreset_valid_refuses(transform, term, trunc, prev_done, kw, exc,
                                 match):
  arrays = {"ok": np.zeros((3, 2), bool), "narrow": np.zeros((3, 1), bool),
            "empty": np.zeros((0, 2), bool), "str": np.full((3, 2), "a")}
  args = [arrays[term], arrays[trunc], prev_done]
  fn = functools.partial(jr.autoreset_valid, **{"mode": "next_step", **kw})
  if any(np.asarray(a).dtype.kind == "U" for a in args if a is not None):
    transform = lambda f: f   # noqa: E731 - a str array is no jit argument
  with pytest.raises(exc, match=f"^autoreset_valid: {match}"):
    transform(lambda a, b, p: fn(a, b, prev_done=p))(*args)
