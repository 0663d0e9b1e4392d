"""Tests for jrollout._autoreset and gae's ``valid``: host autoreset modes.

One random stream of transitions per env is written out the way each
autoreset mode stores it in a ``[T, E]`` rollout (next-step: a reset step
after every episode end; same-step: gymnasium's ``final_obs`` only where an
episode ended; in-JAX: gymnax's ``final_observation`` at every step,
truncation cleared where terminated), and every form must give the
advantages of an independent numpy model that sums each episode's
discounted TD errors directly.
"""

import functools

from hypothesis import given
from hypothesis import strategies as st
import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np
import pytest

import jrollout as jr
from tests.conftest import TRANSFORMS

GAMMA, LAMBDA = 0.9, 0.8
pytestmark = pytest.mark.usefixtures("strict_numpy")


# --------------------------------------------------------------------------
# The world: per env, a stream of transitions; its three written forms.
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
# Errors.
# --------------------------------------------------------------------------


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
def test_argument_errors(transform):
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


def test_argument_type_errors():
  term = np.zeros((3, 2), bool)
  with pytest.raises(TypeError, match=r"^autoreset_valid: `truncations` has "
                     r"dtype <U1, expected bool or numeric flags"):
    jr.autoreset_valid(term, np.full((3, 2), "a"), mode="next_step")
  with pytest.raises(TypeError, match=r"^autoreset_valid: `prev_done`"):
    jr.autoreset_valid(term, term, mode="next_step",
                       prev_done=np.full(2, "a"))


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_gae_valid_shape_error(transform):
  x = np.zeros((5, 4), np.float32)
  with pytest.raises(ValueError, match=r"^gae: `valid` has shape \(5, 3\), "
                     r"expected \(5, 4\) = rewards.shape"):
    transform(lambda v: jr.gae(x, x, x[0], x, valid=v))(
        np.ones((5, 3), bool))
  with pytest.raises(ValueError, match=r"^normalize_advantages: `valid` has "
                     r"shape \(4,\), expected \(5, 4\) = advantages.shape"):
    transform(lambda v: jr.normalize_advantages(x, valid=v))(
        np.ones(4, bool))


def test_gae_truncations_without_final_values_points_to_valid():
  x = np.zeros((5, 4), np.float32)
  with pytest.raises(ValueError, match=r"with next-step autoreset, where "
                     r"values\[t \+ 1\] is the final obs, pass "
                     r"valid=jr.autoreset_valid\(...\) and no truncations"):
    jr.gae(x, x, x[0], x, truncations=x)
