"""Tests of examples/torch_simulator.py: torch CartPole, smoke, learning."""

import json
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gymnax")
pytest.importorskip("optax")

import gymnax  # noqa: E402
from gymnax.environments.classic_control.cartpole import (  # noqa: E402
    EnvState)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from examples import torch_simulator as ts  # noqa: E402

pytestmark = pytest.mark.usefixtures("standard_promotion")


def test_torch_cartpole_matches_gymnax_physics():
  n = 256
  gen = torch.Generator().manual_seed(0)
  # States on both sides of the termination thresholds.
  start = (torch.rand((n, 4), generator=gen) * 2 - 1) * torch.tensor(
      [2.5, 2.0, 0.25, 2.0])
  action = torch.randint(0, 2, (n,), generator=gen)
  sim = ts.TorchCartPole(n, seed=1)
  sim.state = start.clone()
  obs, reward, terminated, truncated, final_obs = sim.step(action)

  env, params = gymnax.make("CartPole-v1")
  cols = {name: jnp.asarray(start[:, i].numpy())
          for i, name in enumerate(["x", "x_dot", "theta", "theta_dot"])}
  state = EnvState(**cols, time=jnp.zeros(n, jnp.int32))
  want_obs, _, _, want_done, _ = jax.vmap(env.step_env, (None, 0, 0, None))(
      jax.random.key(0), state, jnp.asarray(action.numpy()), params)
  np.testing.assert_allclose(final_obs.numpy(), np.asarray(want_obs),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(terminated.numpy(), np.asarray(want_done))
  assert 0 < int(terminated.sum()) < n
  assert not truncated.any()
  assert reward.dtype == torch.float32 and bool((reward == 1).all())
  # Auto-reset: finished envs restart in [-0.05, 0.05]^4, the others go on.
  assert bool((obs[terminated].abs() <= 0.05).all())
  torch.testing.assert_close(obs[~terminated], final_obs[~terminated])


def test_torch_cartpole_time_limit_truncates_and_resets():
  sim = ts.TorchCartPole(4, seed=0)
  sim.state = torch.zeros(4, 4)
  sim.elapsed = torch.tensor([0, 498, 499, 499], dtype=torch.int32)
  sim.state[3, 2] = 0.5   # past 12 degrees: terminated, not truncated
  obs, _, terminated, truncated, final_obs = sim.step(
      torch.tensor([1, 0, 1, 0]))
  assert terminated.tolist() == [False, False, False, True]
  assert truncated.tolist() == [False, False, True, False]
  assert sim.elapsed.tolist() == [1, 499, 0, 0]
  assert float(final_obs[2, 1]) != 0.0   # the physics ran before the reset
  assert bool((obs[2:].abs() <= 0.05).all())
  assert math.isclose(ts.TorchCartPole.theta_threshold, math.radians(12))


def test_torch_simulator_smoke(tmp_path):
  summary = ts.main(["--num-envs", "64", "--num-steps", "16", "--updates",
                     "2", "--out", str(tmp_path)])
  assert summary["finite_losses"]
  saved = json.loads((tmp_path / "summary.json").read_text())
  assert (saved["config"]["num_envs"], saved["config"]["num_steps"]) == (64, 16)
  assert len(saved["returns"]) == len(saved["history"]) == 2
  losses = ("loss", "pg_loss", "v_loss", "entropy")
  for h in saved["history"]:
    assert {"update", "return", "episodes", "truncations", *losses} <= set(h)
    assert all(math.isfinite(h[k]) for k in losses)
  assert [saved["initial_return"], saved["final_return"]] == saved["returns"]
  assert saved["history"][0]["episodes"] > 0
  ms = saved["per_step_ms"]
  parts = ("sim", "from_torch", "to_torch", "policy", "buffer")
  assert set(ms) == {*parts, "bridge", "total"}
  assert all(v > 0 for v in ms.values()), ms
  assert math.isclose(ms["bridge"], ms["from_torch"] + ms["to_torch"])
  assert math.isclose(ms["total"], sum(ms[k] for k in parts))
  # Every write was in place and no leaf crossed the bridge by copy.
  assert saved["donated"] is True and saved["bridge_copies"] == 0


@pytest.fixture
def imports(monkeypatch):
  """The ``(tree, kwargs)`` of each of the example's from_torch calls."""
  from jrollout.torch import from_torch_copied  # noqa: PLC0415
  calls = []

  def recording(tree, **kw):
    calls.append((tree, kw))
    return from_torch_copied(tree, **kw)

  monkeypatch.setattr(ts, "from_torch_copied", recording)
  return calls


def test_torch_simulator_bridge_modes_agree(imports):
  """--bridge numpy, view and copy train the same (bit for bit). view and
  copy import everything the simulator returned in one from_torch call
  per step; numpy (auto on the CPU) imports nothing: numpy views go to the
  policy call and to the writer, which stages a copy when it queues."""
  results = {}
  for bridge in ("numpy", "view", "copy"):
    imports.clear()
    config = ts.parse_config(["--num-envs", "32", "--num-steps", "8",
                              "--updates", "2", "--bridge", bridge])
    results[bridge] = ts.train(config, verbose=False)
    copies = [kw.get("copy") for _, kw in imports]
    if bridge == "numpy":
      assert copies == [], (bridge, len(copies))
    else:
      # The first observations, the two warm-up imports (a step with and
      # without final observations), then one import per step.
      assert len(copies) == 3 + 2 * 8, (bridge, len(copies))
      assert set(copies) == {bridge == "copy"}, (bridge, set(copies))
    assert results[bridge]["bridge_copies"] == 0
    assert results[bridge]["donated"]
  for bridge in ("view", "copy"):
    assert results[bridge]["history"] == results["numpy"]["history"]
  with pytest.raises(SystemExit):
    ts.parse_config(["--bridge", "dlpack"])


def test_tensordict_observation_groups_train_as_plain_tensors(monkeypatch,
                                                             imports):
  """--obs-groups tensordict: the simulator stepped as IsaacLab's rsl_rl
  wrapper steps it (a TensorDict of groups, dones, extras["time_outs"])
  goes through from_torch, which is given the TensorDict itself, and trains
  bit for bit as the plain tensors, time-outs becoming truncations (a short
  time limit makes some)."""
  pytest.importorskip("tensordict")
  import tensordict  # noqa: PLC0415
  monkeypatch.setattr(ts.TorchCartPole, "max_steps", 6)
  results = {}
  for groups, bridge in (("plain", "view"), ("tensordict", "auto"),
                         ("tensordict", "copy")):
    config = ts.parse_config(["--num-envs", "32", "--num-steps", "8",
                              "--updates", "2", "--bridge", bridge,
                              "--obs-groups", groups])
    results[groups, bridge] = ts.train(config, verbose=False)
    assert results[groups, bridge]["bridge_copies"] == 0
  plain = results["plain", "view"]["history"]
  assert sum(h["truncations"] for h in plain) > 0
  seen = [sorted(tree["next_obs"].keys()) for tree, _ in imports
          if isinstance(tree, dict)
          and isinstance(tree.get("next_obs"), tensordict.TensorDict)]
  assert seen and all(keys == ["critic", "policy"] for keys in seen)
  for key in (("tensordict", "auto"), ("tensordict", "copy")):
    assert results[key]["history"] == plain, key
  with pytest.raises(ValueError, match="--obs-groups tensordict imports the "
                     "groups with from_torch"):
    ts.bridge_mode(ts.parse_config(["--obs-groups", "tensordict",
                                    "--bridge", "numpy"]),
                   ts.TorchCartPole(2))


def test_bridge_mode_picks_numpy_on_the_cpu_and_refuses_it_elsewhere():
  import types  # noqa: PLC0415
  cpu = types.SimpleNamespace(device=torch.device("cpu"))
  gpu = types.SimpleNamespace(device=torch.device("cuda", 0))
  for bridge, sim, mode in (("auto", cpu, "numpy"), ("auto", gpu, "view"),
                            ("view", cpu, "view"), ("copy", gpu, "copy")):
    config = ts.parse_config(["--bridge", bridge])
    assert ts.bridge_mode(config, sim) == mode
  with pytest.raises(ValueError, match=r"^--bridge numpy needs a CPU "
                     r"simulator, got device cuda:0; use --bridge view or "
                     r"copy$"):
    ts.bridge_mode(ts.parse_config(["--bridge", "numpy"]), gpu)


def test_torch_simulator_defaults_and_minibatch_check():
  assert ts.parse_config([]).num_envs == 1024
  with pytest.raises(ValueError, match="--num-minibatches 3 must divide"):
    ts.train(ts.parse_config(["--num-envs", "4", "--num-steps", "4",
                              "--num-minibatches", "3"]), verbose=False)


@pytest.mark.slow
def test_torch_simulator_learns(tmp_path):
  """Default budget (~15 s): last > 150 and > first + 100. Margin: 8 seeds
  x 3 thread settings went from 17.0-17.4 to 233-345 (mean 274, sd 36), the
  bars 3.5 and 4.4 sd below; benchmarks/results/learning_margins/RESULTS.md.
  """
  summary = ts.main(["--num-envs", "1024", "--num-steps", "32", "--updates",
                     "24", "--out", str(tmp_path)])
  first, last = summary["initial_return"], summary["final_return"]
  assert first < 40, first                  # a near-random policy
  assert last > first + 100, (first, last)
  assert last > 150, summary["returns"]
  assert summary["donated"] and summary["bridge_copies"] == 0
  # Time-limit truncations happened, so the final-value bootstrap ran.
  assert sum(h["truncations"] for h in summary["history"]) > 0
