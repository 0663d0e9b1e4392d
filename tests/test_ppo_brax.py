"""Learning and resume tests of examples/ppo_brax.py (Brax environments)."""

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("brax.envs")   # (imports jaxopt, which warns)
pytest.importorskip("optax")

from examples import ppo_brax  # noqa: E402

# Brax is not strict-promotion clean (see conftest's standard_promotion).
pytestmark = [
    pytest.mark.filterwarnings("ignore:Brax System, piplines:UserWarning"),
    pytest.mark.filterwarnings(
        "ignore:Accessing .* directly from .Data. is deprecated"),
    pytest.mark.usefixtures("standard_promotion")]

# The slow test's run: learning_margins.py's "brax" case (keep them equal).
SMALL = ["--num-envs", "256", "--num-steps", "40", "--num-minibatches", "8",
         "--total-steps", "204800", "--seeds", "2", "--chunks", "4",
         "--eval-envs", "32", "--value-width", "64", "--no-compile-cache"]


def test_ppo_brax_config_flags():
  config = ppo_brax.parse_config(["--env", "hopper", "--backend",
                                  "generalized", "--no-normalize-obs"])
  assert (config.env, config.backend) == ("hopper", "generalized")
  assert not config.normalize_obs
  # Brax's published inverted_pendulum settings are the defaults
  default = ppo_brax.parse_config([])
  assert default.num_envs * default.num_steps == 1024 * 32 * 5
  assert default.num_updates == 13 and default.batch_size == 1024 * 5
  with pytest.raises(SystemExit):
    ppo_brax.parse_config(["--backend", "nope"])


@pytest.mark.slow
def test_ppo_brax_learns_inverted_pendulum(tmp_path):
  """204,800 env steps per seed: every seed's deterministic policy keeps
  the pole up for half of the 1,000 eval steps or more (the training
  episodes of the first updates last 15-40 steps).

  Margin: 8 seeds gave eval returns 766 to 1,000 (median 1,000); the
  training returns (161-460) spread too wide for a bar. See
  benchmarks/results/learning_margins/RESULTS.md ("brax").
  """
  summary = ppo_brax.main([*SMALL, "--out", str(tmp_path)])
  evals = np.array(summary["eval_returns"])
  final = np.array(summary["final_returns"])
  assert evals.shape == final.shape == (2,)
  assert (evals >= 500).all(), evals
  assert summary["finite_losses"]
  assert (tmp_path / "learning_curve.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_ppo_brax_resumes_exactly(tmp_path):
  """A run resumed from its checkpoint at update 2 of 4 ends with the
  parameters of the uninterrupted run, bit for bit."""
  args = ["--num-envs", "32", "--num-steps", "16", "--num-minibatches", "2",
          "--total-steps", "2048", "--seeds", "2", "--chunks", "4",
          "--checkpoint-every", "1", "--eval-envs", "0",
          "--value-width", "32", "--no-compile-cache"]
  ckpt = tmp_path / "ckpt"
  whole = ppo_brax.main([*args, "--checkpoint-dir", str(ckpt),
                         "--out", str(tmp_path / "a")])
  # Drop the checkpoints after update 2: the rerun resumes from there.
  for step in (3, 4):
    shutil.rmtree(ckpt / str(step))
  resumed = ppo_brax.main([*args, "--checkpoint-dir", str(ckpt),
                           "--out", str(tmp_path / "b")])
  assert resumed["params_sha256"] == whole["params_sha256"]
  assert resumed["final_returns"] == whole["final_returns"]
  saved = json.loads((tmp_path / "b" / "summary.json").read_text())
  assert saved["params_sha256"] == whole["params_sha256"]
