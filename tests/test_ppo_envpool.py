"""Tests of examples/ppo_envpool.py: both env backends, both autoreset modes."""

import json

import numpy as np
import pytest

pytest.importorskip("gymnasium")
pytest.importorskip("optax")

import jax  # noqa: E402

import jrollout as jr  # noqa: E402
from examples import ppo_envpool as pe  # noqa: E402

pytestmark = pytest.mark.usefixtures("standard_promotion")

TINY = ["--num-envs", "8", "--num-steps", "32", "--total-steps", "512",
        "--num-minibatches", "2", "--seeds", "2", "--chunks", "1"]
BACKENDS = [
    pytest.param("envpool", "next_step", id="envpool-next_step"),
    pytest.param("gymnasium", "next_step", id="gymnasium-next_step"),
    pytest.param("gymnasium", "same_step", id="gymnasium-same_step"),
]


def needs(backend):
  if backend == "envpool":
    pytest.importorskip("envpool")


# Each backend and convention once (the rollout test runs every pair).
@pytest.mark.parametrize("backend,autoreset", [BACKENDS[0], BACKENDS[2]])
def test_smoke(tmp_path, backend, autoreset):
  needs(backend)
  summary = pe.main(TINY + ["--backend", backend, "--autoreset", autoreset,
                            "--out", str(tmp_path)])
  assert summary["finite_losses"]
  assert len(summary["final_returns"]) == 2
  # 2 x 8 envs x 64 steps of CartPole end some episodes: next-step data has
  # reset steps (not transitions), same-step data has none.
  if autoreset == "next_step":
    assert 0.8 < summary["valid_frac"] < 1.0
  else:
    assert summary["valid_frac"] == 1.0
  assert set(summary["per_step_ms"]) == {*pe.PARTS, "total"}
  png = tmp_path / "learning_curve.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  saved = json.loads((tmp_path / "summary.json").read_text())
  assert saved["config"]["backend"] == backend
  assert saved["config"]["autoreset"] == autoreset
  assert np.shape(saved["return_curve"]) == (2, 2)   # [seeds, updates]


@pytest.mark.parametrize("backend,autoreset", BACKENDS)
def test_rollout_holds_the_envs_autoreset_convention(backend, autoreset):
  """The stored flags are the env's: in next-step data each reset step
  (after an episode end) has reward 0 and no flag, the action ignored."""
  needs(backend)
  config = pe.Config(num_envs=8, num_steps=48, backend=backend,
                     autoreset=autoreset, flush_every=5)
  learner = pe.Learner(config)
  train_state, rollout = learner.init(jax.random.key(0))
  env, obs = pe.make_env(config, 0)
  timings = dict.fromkeys(pe.PARTS, 0.0)
  _, rollout, _, done = pe.collect(env, obs, rollout, train_state.params,
                                   jax.random.key(1), learner,
                                   pe.Episodes(8), timings)
  env.close()
  assert all(v > 0 for v in timings.values())
  data = jax.device_get(rollout.data)
  ended = data["terminated"] | data["truncated"]
  assert ended.sum() >= 2
  np.testing.assert_array_equal(done, ended[-1])
  valid = np.asarray(jr.autoreset_valid(data["terminated"],
                                        data["truncated"], mode=autoreset))
  if autoreset == "next_step":
    reset = np.zeros_like(ended)
    reset[1:] = ended[:-1]
    np.testing.assert_array_equal(valid, ~reset)
    assert (data["reward"][reset] == 0).all()
    assert (data["reward"][~reset] == 1).all()
    # The reset step's obs is the episode's final one (outside the bounds
    # where it terminated); the next step's is a fresh one in +-0.05.
    term_at = np.argwhere(data["terminated"][:-2])
    assert len(term_at)
    for t, e in term_at:
      x, theta = data["obs"][t + 1, e, 0], data["obs"][t + 1, e, 2]
      assert abs(x) > 2.4 or abs(theta) > 0.2094
      assert (np.abs(data["obs"][t + 2, e]) <= 0.05).all()
  else:
    assert valid.all() and (data["reward"] == 1).all()
    # final_value is V(final obs) where truncated: none here (at 500 steps)
    assert not data["truncated"].any()
    np.testing.assert_array_equal(data["final_value"], 0.0)


def test_same_step_final_obs():
  obs = np.arange(12, dtype=np.float32).reshape(3, 4)
  final = np.empty(3, object)
  final[1] = np.full(4, -1.0, np.float32)
  info = {"final_obs": final, "_final_obs": np.array([False, True, False])}
  got = pe.final_obs(info, obs)
  np.testing.assert_array_equal(got[1], -1.0)
  np.testing.assert_array_equal(got[[0, 2]], obs[[0, 2]])
  np.testing.assert_array_equal(pe.final_obs({}, obs), obs)


def test_seeds_share_the_compiled_functions(count_compiles):
  config = pe.Config(num_envs=4, num_steps=16, total_steps=128,
                     num_minibatches=2, backend="gymnasium")
  learner = pe.Learner(config)
  pe.train_seed(config, 0, learner, verbose=False)
  with count_compiles() as counter:
    pe.train_seed(config, 1, learner, verbose=False)
  assert counter.count == 0


def test_flags_refuse_a_convention_the_backend_lacks():
  with pytest.raises(SystemExit):
    pe.parse_config(["--autoreset", "disabled"])
  with pytest.raises(ValueError, match="--backend envpool resets on the next "
                     "step only; got --autoreset same_step"):
    pe.make_env(pe.Config(autoreset="same_step"), 0)


@pytest.mark.slow
def test_learns_on_envpool(tmp_path):
  """One seed, 100 updates (~30 s): return >= 100 (random: ~22). Margin:
  8 seeds x 3 thread settings gave 193-318 (mean 238, sd 42), the bar 3.3 sd
  below; benchmarks/results/learning_margins/RESULTS.md."""
  pytest.importorskip("envpool")
  summary = pe.main(["--seeds", "1", "--total-steps", "204800",
                     "--out", str(tmp_path)])
  assert summary["final_returns"][0] >= 100, summary["final_returns"]
  assert summary["valid_frac"] < 1.0
