"""E JAX physics environments at once (Brax, MuJoCo Playground), restarted
in place, keeping the true final observation of every episode that ends.

Brax's ``AutoResetWrapper`` (over ``pipeline_state``) and MuJoCo
Playground's (over ``data``) overwrite the observation of the step that ends
an episode with the reset's, so a truncation has only the value of the state
*after* the reset to bootstrap from. Here a step returns both: ``obs``, what
the policy sees next, and ``final_obs``, the observation that step reached;
a truncated step bootstraps from ``V(final_obs)`` through ``jr.gae(...,
truncations=, final_values=)``. Any env with Brax's protocol works:
``env.reset(key) -> state`` and ``env.step(state, action) -> state`` for one
env, ``state.obs`` an array ``[O]`` or a dict of groups, ``state.reward``
and ``state.done`` ``[]``, the whole state restarted leaf by leaf (so the
physics state's name does not matter). Nothing here imports Brax.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from brax import envs
  >>> from examples import brax_env
  >>> env = brax_env.AutoReset(envs.get_environment("inverted_pendulum"),
  ...                          num_envs=8, episode_length=1000)
  >>> state, obs = env.reset(jax.random.key(0))        # obs [8, 4]
  >>> state, out = env.step(state, jnp.zeros((8, 1)))  # out.final_obs [8, 4]
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class ObsGroups:
  """``env`` whose ``state.obs`` is always a dict of observation groups: an
  array observation ``[O]`` becomes ``{"state": [O]}`` (Brax's and
  Playground's name for it); a dict observation is left as it is.

  Example:
    >>> env = brax_env.ObsGroups(envs.get_environment("inverted_pendulum"))
    >>> env.reset(jax.random.key(0)).obs["state"].shape
    (4,)
  """

  def __init__(self, env):
    self.env = env
    self._flat = not isinstance(
        jax.eval_shape(env.reset, jax.random.key(0)).obs, dict)

  @property
  def action_size(self) -> int:
    return self.env.action_size

  def reset(self, key):
    state = self.env.reset(key)
    return state.replace(obs={"state": state.obs}) if self._flat else state

  def step(self, state, action):
    if not self._flat:
      return self.env.step(state, action)
    state = self.env.step(state.replace(obs=state.obs["state"]), action)
    return state.replace(obs={"state": state.obs})


class EnvState(NamedTuple):
  """The E envs between two steps.

  Attributes:
    env: the environment's own state, every leaf ``[E, ...]``.
    steps: ``[E]`` int32, steps taken in each env's current episode.
    key: the PRNG key the next resets are drawn from.
  """
  env: Any
  steps: jax.Array
  key: jax.Array


class Transition(NamedTuple):
  """What one step of the E envs returns.

  Attributes:
    obs: ``[E, O]`` (or a dict of ``[E, ...]`` groups) the next observation
      the policy sees: the new episode's first observation where this step
      ended an episode.
    final_obs: like ``obs``, the observation this step reached, before any
      reset (equal to ``obs`` where no episode ended).
    reward: ``[E]`` float32.
    terminated: ``[E]`` bool, the env said the episode is over (not
      bootstrapped).
    truncated: ``[E]`` bool, the time limit cut the episode (and it did not
      terminate on the same step): bootstrapped from ``V(final_obs)``.
  """
  obs: jax.Array
  final_obs: jax.Array
  reward: jax.Array
  terminated: jax.Array
  truncated: jax.Array


class AutoReset:
  """``num_envs`` copies of ``env``, time-limited and restarted in place.

  An episode ends when the env sets ``done`` (a termination) or when it
  reaches ``episode_length`` steps (a truncation, unless it also
  terminated). The step that ends it returns the true final observation in
  ``Transition.final_obs`` and restarts the env from a fresh
  ``env.reset`` (a new initial state for every episode, drawn from the
  state's key; Brax's wrapper restarts every episode of an env from the
  same first state).

  Both methods are pure and can be jitted and vmapped (over seeds).
  """

  def __init__(self, env, num_envs: int, episode_length: int = 1000):
    if num_envs < 1 or episode_length < 1:
      raise ValueError(f"AutoReset: num_envs and episode_length must be "
                       f"positive, got {num_envs} and {episode_length}")
    self.env = env
    self.num_envs = num_envs
    self.episode_length = episode_length

  @property
  def action_size(self) -> int:
    return self.env.action_size

  def _reset(self, key):
    return jax.vmap(self.env.reset)(jax.random.split(key, self.num_envs))

  def reset(self, key) -> tuple[EnvState, jax.Array]:
    """``(state, obs [E, O] or a dict of [E, ...])``: E fresh episodes."""
    key, k_reset = jax.random.split(key)
    env_state = self._reset(k_reset)
    steps = jnp.zeros((self.num_envs,), jnp.int32)
    return EnvState(env_state, steps, key), env_state.obs

  def step(self, state: EnvState,
           action: jax.Array) -> tuple[EnvState, Transition]:
    """Steps every env with ``action [E, A]``; restarts the ones whose
    episode ended. Returns ``(state, Transition)``."""
    env_state = jax.vmap(self.env.step)(state.env, action)
    steps = state.steps + 1
    terminated = env_state.done > 0
    truncated = (steps >= self.episode_length) & ~terminated
    done = terminated | truncated
    key, k_reset = jax.random.split(state.key)
    fresh = self._reset(k_reset)

    def restart(new, old):
      where = done.reshape(done.shape + (1,) * (old.ndim - 1))
      return jnp.where(where, new, old)

    next_env = jax.tree.map(restart, fresh, env_state)
    out = Transition(obs=next_env.obs, final_obs=env_state.obs,
                     reward=env_state.reward.astype(jnp.float32),
                     terminated=terminated, truncated=truncated)
    next_state = EnvState(next_env, jnp.where(done, 0, steps), key)
    return next_state, out
