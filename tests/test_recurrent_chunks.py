"""examples/ppo_recurrent.py with ``--seq-len``: each chunk of L steps is
replayed from the carry stored at its first step, with resets at episode
starts. Its learning comparison is in tests/test_examples.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jrollout as jr

pytest.importorskip("gymnax")
pytest.importorskip("optax")

from examples.common import cli  # noqa: E402
from examples import ppo_recurrent as rec  # noqa: E402

pytestmark = pytest.mark.usefixtures("standard_promotion")


def _replay(apply_fn, params, mb, h0):
  """Logp of the stored actions and values over ``mb`` ``[L, Sb, ...]``."""
  def step(h, xs):
    obs, reset = xs
    h, logits, value = apply_fn(params, h, obs, reset)
    return h, (logits, value)

  _, (logits, value) = jax.lax.scan(step, h0, (mb["obs"], mb["reset"]))
  logp = jnp.take_along_axis(jax.nn.log_softmax(logits),
                             mb["action"][..., None], -1)[..., 0]
  return logp, value


@pytest.mark.parametrize("seq_len", [8, 0])
def test_chunks_replay_from_the_stored_carry(seq_len):
  """lr 0: the replay reproduces the stored log-probabilities and values
  (to float rounding), but only from the right carry."""
  config = rec.Config(num_envs=4, num_steps=32, total_steps=4 * 32 * 2,
                      seeds=1, num_minibatches=2, num_epochs=2, chunks=1,
                      compare=False, lr=0.0, seq_len=seq_len)
  init_fn, update_fn = rec.make_train(config)
  runner, metrics = jax.jit(update_fn)(init_fn(jax.random.key(0)))
  assert float(metrics["logp_change_max"]) < 1e-5
  assert runner.rollout.data["reset"][1:].any()   # episodes start inside
  length = seq_len or config.num_steps
  num = config.num_envs * config.num_steps // length
  mb = jr.take(runner.rollout, np.arange(num), seq_len=length)
  apply_fn, params = runner.train_state.apply_fn, runner.train_state.params
  logp, value = _replay(apply_fn, params, mb, mb["carry"][0])
  np.testing.assert_allclose(logp, mb["logp"], atol=1e-5)
  np.testing.assert_allclose(value, mb["value"], atol=1e-5)
  if seq_len:
    # Chunks started from zeros replay other values (unless fresh).
    _, wrong = _replay(apply_fn, params, mb, jnp.zeros_like(mb["carry"][0]))
    fresh = np.asarray(mb["reset"][0])
    assert not fresh.all()
    gap = np.abs(np.asarray(wrong - mb["value"]))[:, ~fresh].max()
    assert gap > 1e-3, gap


@pytest.mark.parametrize("flags, match", [
    (["--seq-len", "10"], r"--seq-len 10 does not divide --num-steps 32"),
    (["--seq-len", "16", "--num-minibatches", "3"],
     r"--num-minibatches 3 does not divide the 8 sequences"),
])
def test_bad_flags(flags, match):
  config = cli.parse_config(
      ["--num-envs", "4", "--num-steps", "32", *flags], rec.Config)
  with pytest.raises(ValueError, match=match):
    rec.make_train(config)
