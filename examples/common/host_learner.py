"""The JAX side of a host loop (an env stepped outside JAX: EnvPool,
gymnasium, a torch simulator): the jitted policy and value function, and a
fresh train state and rollout. ``examples/ppo_envpool.py`` adds the PPO
update (``ppo_envpool.Learner``)."""

from __future__ import annotations

import functools

from flax.training.train_state import TrainState
import jax
import jax.numpy as jnp

import jrollout as jr
from examples.common.agent import ActorCritic
from examples.common.agent import make_optimizer
from examples.common.agent import rollout_fields
from examples.common.cli import Config


class HostLearner:
  """The jitted policy of a host loop, shared by its seeds.

  A feed-forward ``ActorCritic`` on ``obs [E, *obs_shape]`` whose steps go
  into the rollout through a ``jr.RolloutWriter``. ``autoreset`` is how the
  env restarts a finished episode, and so what the rollout stores:

  - ``"same_step"``: the step that ends it returns the reset observation;
    the loop stores the value of the true final one under ``final_value``
    (``zero_value`` where nothing was truncated);
  - ``"next_step"``: the step after it is a reset step, not a transition;
    the rollout holds a ``weight`` field (the loss weighs reset steps 0).

  Attributes:
    act: ``act(params, obs, key) -> (action, logp, value, key)``, jitted:
      samples actions for ``obs`` (a host or JAX array, read during the
      call) and returns the next key (no host work).
    value_fn: ``value_fn(params, obs) -> value [E]``, jitted.
    zero_value: ``[E]`` zeros (same-step's ``final_value`` where nothing
      was truncated).
    tx: the optimiser, one for every seed: it is a static field of the
      ``TrainState``, so a new one per seed would recompile the update.

  ``device``: commit ``init``'s state and ``zero_value`` to it. A loop that
  brings in committed arrays (torch's, through DLPack) gets committed
  outputs from the jitted functions, and an uncommitted initial state
  would then make the second update and rollout recompile.
  """

  def __init__(self, config: Config, *, autoreset: str = "same_step",
               obs_shape: tuple[int, ...] = (4,), num_actions: int = 2,
               device: jax.Device | None = None):
    self.config = config
    self.autoreset = autoreset
    self.obs_shape = obs_shape
    self.network = network = ActorCritic(num_actions, config.hidden)
    self.tx = make_optimizer(config)
    self.device = device

    @jax.jit
    def act(params, obs, key):
      key, k_act = jax.random.split(key)
      policy, value = network.apply(params, obs)
      action, logp = policy.sample(k_act)
      return action, logp, value, key

    self.act = act
    self.value_fn = jax.jit(functools.partial(network.apply,
                                              method=ActorCritic.value))
    self.zero_value = jax.device_put(
        jnp.zeros((config.num_envs,), jnp.float32), device)

  def init(self, key) -> tuple[TrainState, jr.RolloutState]:
    """A fresh train state (its step counter an array, as the update's
    output has it) and an empty rollout, on ``device`` if given."""
    config = self.config
    params = self.network.init(key, jnp.zeros(self.obs_shape, jnp.float32))
    train_state = TrainState.create(apply_fn=self.network.apply,
                                    params=params, tx=self.tx)
    next_step = self.autoreset == "next_step"
    rollout = jr.init(config.num_envs, config.num_steps)
    for name, shape, dtype in rollout_fields(
        self.obs_shape, final=None if next_step else "value",
        extra=[("weight", (), jnp.float32)] if next_step else ()):
      rollout = jr.register(rollout, name, shape, dtype)
    state = (train_state.replace(step=jnp.zeros((), jnp.int32)), rollout)
    return state if self.device is None else jax.device_put(state,
                                                            self.device)
