"""Smoke and learning tests of the examples (the README's main job)."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jrollout as jr

pytest.importorskip("gymnax")
pytest.importorskip("optax")

from examples import ppo_cartpole as ppo  # noqa: E402
from examples import ppo_core  # noqa: E402
from examples import ppo_recurrent as rec  # noqa: E402

pytestmark = pytest.mark.usefixtures("standard_promotion")


def test_ppo_cartpole_smoke(tmp_path):
  summary = ppo.main(["--total-steps", "3072", "--num-envs", "4",
                      "--num-steps", "128", "--seeds", "2", "--chunks", "2",
                      "--out", str(tmp_path)])
  assert summary["finite_losses"]
  assert len(summary["final_returns"]) == 2
  png = tmp_path / "learning_curve.png"
  assert png.stat().st_size > 1000
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  saved = json.loads((tmp_path / "summary.json").read_text())
  assert saved["config"]["seeds"] == 2


def test_ppo_cartpole_config_flags():
  config = ppo.parse_config(["--num-envs", "16", "--no-anneal-lr",
                             "--lr", "1e-3", "--out", "x"])
  assert (config.num_envs, config.anneal_lr, config.lr, config.out) == (
      16, False, 1e-3, "x")
  assert config.batch_size == 16 * config.num_steps // config.num_minibatches


def test_ppo_cartpole_train_raises_on_an_incomplete_rollout():
  # The example closes each rollout with jr.finish_rollout's default check
  # (a checkify check) and functionalises it in the host loop: no host
  # callback in the jitted update; the failure comes back as a value.
  config = ppo.Config(num_envs=2, num_steps=8, total_steps=2 * 16, seeds=2,
                      num_minibatches=2, chunks=1)

  def make_faulty(cfg):
    init_fn, update_fn = ppo.make_train(cfg)

    def update(runner):   # step 3 of "reward" written before the rollout
      rollout = jr.update_at(runner.rollout, 3,
                             {"reward": jnp.zeros(cfg.num_envs)})
      return update_fn(runner._replace(rollout=rollout))
    return init_fn, update

  init_fn, update_fn = ppo.make_train(config)
  keys = init_fn(jax.random.key(0)).rollout.keys
  dup = " ".join("1" if k == "reward" else "0" for k in keys)
  with pytest.raises(jr.IncompleteRolloutError,
                     match=r"^train: updates 0-1: finish_rollout: the rollout "
                     r"is not complete .* steps written more than once "
                     + re.escape(f"[{dup}]")):
    ppo.train(config, verbose=False, make_train_fn=make_faulty)
  # The same config trains cleanly with the example's own update, and the
  # compiled chunk holds no host callback (asynchronous dispatch).
  ppo.train(config, verbose=False)
  runner = jax.jit(jax.vmap(init_fn))(jax.random.split(jax.random.key(0), 2))
  text = ppo_core.make_chunk(config, update_fn, 2).lower(runner).as_text()
  assert "callback" not in text


@pytest.mark.slow
def test_ppo_cartpole_learns_with_defaults(tmp_path):
  """The acceptance bar: every seed's return over the last 10% >= 475."""
  summary = ppo.main(["--out", str(tmp_path)])
  final = np.array(summary["final_returns"])
  assert final.shape == (4,)
  assert (final >= 475).all(), final


def test_ppo_recurrent_smoke(tmp_path):
  summary = rec.main(["--total-steps", "4096", "--num-envs", "8",
                      "--num-steps", "64", "--seeds", "2", "--chunks", "2",
                      "--out", str(tmp_path)])
  for agent in ("GRU (sequence minibatches)", "feed-forward"):
    assert summary[agent]["finite_losses"]
    assert len(summary[agent]["final_returns"]) == 2
  png = tmp_path / "recurrent_vs_feedforward.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_ppo_recurrent_beats_feedforward_on_masked_cartpole(tmp_path):
  """The recurrent acceptance bars, on the example's defaults.

  The GRU on whole rollouts clearly beats the feed-forward agent with the
  same budget; and chunks of 16 steps (``--seq-len 16``, each replayed from
  its stored carry) learn at least as well as whole rollouts on the same
  seeds. One test, so the whole-rollout run (about 160 CPU s) is shared. At
  half the budget the chunks were behind (mean final return 57 against 72),
  so the budget is not smaller.
  """
  summary = rec.main(["--out", str(tmp_path / "whole")])
  gru = np.array(summary["GRU (sequence minibatches)"]["final_returns"])
  ff = np.array(summary["feed-forward"]["final_returns"])
  assert gru.mean() >= 2 * ff.mean(), (gru, ff)
  chunked = rec.main(["--no-compare", "--seq-len", "16",
                      "--out", str(tmp_path / "L16")])
  chunks = np.array(chunked["GRU (sequence minibatches)"]["final_returns"])
  print("final returns per seed: seq_len 16", chunks, "whole", gru)
  assert chunks.mean() >= gru.mean(), (chunks, gru)
  assert chunks.mean() >= 2 * 22, chunks   # a random policy gets ~22
