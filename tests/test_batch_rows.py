"""jr.batch_rows: arrays computed after a rollout as rows of its batch."""

from typing import NamedTuple

from hypothesis import given
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jrollout as jr

from tests.conftest import TRANSFORMS


def _state(num_steps, num_envs):
  return jr.register(jr.init(num_envs=num_envs, num_steps=num_steps), "t")


def _reference(x):
  """Row ``e * T + t`` is ``x[t, e]``, written out in plain numpy."""
  x = np.asarray(x)
  t, e = x.shape[:2]
  out = np.empty((e * t, *x.shape[2:]), x.dtype)
  for ei in range(e):
    for ti in range(t):
      out[ei * t + ti] = x[ti, ei]
  return out


class Targets(NamedTuple):
  adv: jax.Array
  ret: jax.Array


@pytest.mark.parametrize("transform", TRANSFORMS)
@given(t=st.integers(1, 6), e=st.integers(1, 6), tail=st.sampled_from(
    [(), (3,), (2, 2)]))
def test_rows_match_numpy_and_keep_the_structure(transform, t, e, tail):
  rng = np.random.default_rng(t * 10 + e)
  values = Targets(rng.normal(size=(t, e, *tail)).astype(np.float32),
                   rng.integers(0, 9, size=(t, e)).astype(np.int32))
  out = transform(jr.batch_rows)(_state(t, e), values)
  assert isinstance(out, Targets)
  np.testing.assert_array_equal(out.adv, _reference(values.adv))
  np.testing.assert_array_equal(out.ret, _reference(values.ret))
  assert out.ret.dtype == jnp.int32


def test_rows_line_up_with_make_batch_and_through_minibatches():
  t, e = 4, 3
  steps = np.arange(t)[:, None] + 100 * np.arange(e)[None, :]   # [T, E]
  state = jr.update_all(_state(t, e), {"t": steps.astype(np.float32)})
  batch, state = jr.make_batch(state)
  adv = (steps * 2 + 1).astype(np.float32)
  batch["adv"] = jr.batch_rows(state, adv)
  np.testing.assert_array_equal(batch["adv"], batch["t"] * 2 + 1)
  for mb in jr.minibatches(jax.random.key(0), batch, 4, num_epochs=2):
    np.testing.assert_array_equal(mb["adv"], mb["t"] * 2 + 1)


def test_under_vmap_over_seeds():
  t, e, seeds = 3, 2, 4
  values = np.arange(seeds * t * e, dtype=np.float32).reshape(seeds, t, e)
  out = jax.vmap(lambda v: jr.batch_rows(_state(t, e), v))(values)
  for s in range(seeds):
    np.testing.assert_array_equal(out[s], _reference(values[s]))


def test_a_transposed_array_is_an_error_naming_the_leaf():
  state = _state(3, 2)
  adv = np.zeros((3, 2), np.float32)
  with pytest.raises(ValueError, match=(
      r"^batch_rows: leaf \['adv'\] has leading shape \(2, 3\), expected "
      r"\(T, E\) = \(3, 2\) of the rollout: it is \[E, T\]; pass it "
      r"time-major")):
    jax.jit(jr.batch_rows)(state, {"adv": adv.T, "ret": adv})
  with pytest.raises(ValueError, match=r"leading shape \(6,\), expected"):
    jr.batch_rows(state, adv.reshape(-1))
  with pytest.raises(ValueError, match=r"leading shape \(3, 5\), expected "
                     r"\(T, E\) = \(3, 2\) of the rollout$"):
    jr.batch_rows(state, np.zeros((3, 5)))


def test_bad_arguments():
  with pytest.raises(TypeError, match="batch_rows: `state` must be a "
                     "RolloutState"):
    jr.batch_rows({"t": np.zeros((3, 2))}, np.zeros((3, 2)))
  with pytest.raises(ValueError, match="batch_rows: `data` holds no array"):
    jr.batch_rows(_state(3, 2), {})
  with pytest.raises(TypeError, match=r"batch_rows: leaf \['x'\] is a str"):
    jr.batch_rows(_state(3, 2), {"x": "adv"})


def test_no_recompilation_in_steady_state(count_compiles):
  f = jax.jit(jr.batch_rows)
  state = _state(4, 2)
  f(state, np.zeros((4, 2), np.float32)).block_until_ready()
  with count_compiles() as c:
    for i in range(3):
      f(state, np.full((4, 2), i, np.float32)).block_until_ready()
  assert c.count == 0
