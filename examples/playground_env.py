"""MuJoCo Playground environments for examples/ppo_brax.py: loading one by
name with the physics implementation chosen (``impl="jax"`` runs offline on
the CPU), Playground's tuned PPO settings for it as ``ppo_brax.Config``
fields, and ``Privileged``, which adds a ``privileged_state`` observation
group (the full ``qpos``/``qvel``) for an asymmetric critic. The only module
that imports ``mujoco_playground`` (the ``playground`` extra); the DM Control
Suite envs load offline, the robot tasks fetch their models from the network.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from mujoco_playground import registry
from mujoco_playground.config import dm_control_suite_params


def load(name: str, impl: str = "jax"):
  """Playground's env ``name`` (``registry.load``) on physics ``impl``
  (``"jax"`` or ``"warp"``).

  Raises:
    ValueError: ``name`` is not a Playground env (the message lists the
      DM Control Suite's).
  """
  if name not in registry.ALL_ENVS:
    raise ValueError(
        f"--env {name!r} is neither a Brax nor a MuJoCo Playground env; "
        f"Playground's DM Control Suite: {', '.join(dm_control_suite_names())}")
  return registry.load(name, config_overrides={"impl": impl})


def dm_control_suite_names() -> tuple[str, ...]:
  return tuple(registry.dm_control_suite.ALL_ENVS)


def tuned_settings(name: str) -> dict[str, Any]:
  """Playground's PPO settings for ``name`` (``brax_ppo_config``) as
  ``ppo_brax.Config`` fields.

  Brax's trainer collects ``batch_size * num_minibatches / num_envs``
  unrolls of ``unroll_length`` steps per update: one rollout of T = their
  product steps here, the same env steps; ``num_updates_per_batch`` is the
  number of epochs. Only the DM Control Suite's settings are read offline
  (``{}`` for another env: ``Config``'s defaults stay).

  Raises:
    ValueError: the settings repeat actions (``action_repeat`` > 1), which
      ``brax_env.AutoReset`` does not do.
  """
  if name not in registry.dm_control_suite.ALL_ENVS:
    return {}
  c = dm_control_suite_params.brax_ppo_config(name)
  if c.action_repeat != 1:
    raise ValueError(f"tuned_settings: {name} repeats actions "
                     f"({c.action_repeat}); ppo_brax steps every action once")
  unrolls = c.batch_size * c.num_minibatches // c.num_envs
  settings = {
      "num_envs": c.num_envs, "num_steps": unrolls * c.unroll_length,
      "total_steps": c.num_timesteps, "num_epochs": c.num_updates_per_batch,
      "num_minibatches": c.num_minibatches, "lr": c.learning_rate,
      "gamma": c.discounting, "ent_coef": c.entropy_cost,
      "reward_scaling": c.reward_scaling,
      "normalize_obs": c.normalize_observations,
      "episode_length": c.episode_length,
      "max_grad_norm": c.get("max_grad_norm") or 0.0}
  network = c.get("network_factory", {})
  for part in ("policy", "value"):
    sizes = network.get(f"{part}_hidden_layer_sizes")
    if sizes and len(set(sizes)) == 1:
      settings[f"{part}_layers"], settings[f"{part}_width"] = (
          len(sizes), sizes[0])
  return settings


class Privileged:
  """``env`` with the observation ``{"state": obs, "privileged_state":
  [qpos, qvel]}``: the policy's observation and the full physics state,
  which an asymmetric critic reads (``--value-obs privileged_state``), as
  Playground's robot tasks provide it.

  Example:
    >>> env = Privileged(load("CartpoleBalance"))
    >>> jax.tree.map(jnp.shape, env.reset(jax.random.key(0)).obs)
    {'privileged_state': (4,), 'state': (5,)}
  """

  def __init__(self, env):
    self.env = env

  @property
  def action_size(self) -> int:
    return self.env.action_size

  def _groups(self, state):
    full = jnp.concatenate([state.data.qpos, state.data.qvel])
    return state.replace(obs={"state": state.obs, "privileged_state": full})

  def reset(self, key):
    return self._groups(self.env.reset(key))

  def step(self, state, action):
    state = self.env.step(state.replace(obs=state.obs["state"]), action)
    return self._groups(state)
