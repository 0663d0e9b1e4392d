"""PPO on gymnax CartPole-v1, built on jrollout: several seeds at once.

The whole training run is jitted and vmapped over seeds. One update is, in
the order of this file:

1. collect (``make_env_step``): a ``lax.scan`` of T steps of E envs that
   writes every step into a jrollout ``RolloutState`` with ``jr.update_at``
   (no scan outputs), the true final observation of each step included;
2. advantages (``make_advantages``): ``jr.gae`` from the ``[T, E]``
   storage, telling terminations (no bootstrap) from time-limit
   truncations (bootstrap from the value of the true final observation),
   written back with ``jr.update_all``;
3. minibatches and 4. the update (``make_update``): ``jr.scan_minibatches``
   runs the epochs of gradient steps straight from the state (no flattened
   copy), and ``jr.finish_rollout`` checks that every step of every field
   was written exactly once and restarts the write tracking. The check is
   a ``checkify`` check: the host loop's ``checkify.checkify`` returns it
   as an error value and raises on the host, with no callback in the
   program, so every call dispatches asynchronously.

What is not jrollout's lives in ``examples/common/``: the network and
optimiser (``agent``), the PPO loss (``loss``), gymnax stepping
(``gymnax_envs``), the host loop over jitted chunks of updates that prints
progress (``training``), the curve and ``summary.json`` (``reporting``), the
run checkpoint (``checkpoints``) and the flags (``cli``). From the
repository root:

    python -m examples.ppo_cartpole                 # defaults solve CartPole
    python -m examples.ppo_cartpole --seeds 8 --total-steps 300000

With ``--checkpoint-dir DIR`` the whole run (parameters, optimiser state,
env state, rollout, PRNG key, update counter and metrics history) is saved
to DIR every ``--checkpoint-every`` updates, asynchronously, and a rerun of
the same command resumes from the latest complete checkpoint in DIR: its
curve and summary (``params_sha256``, the final returns) are those of an
uninterrupted run, bit for bit. A checkpoint damaged since it was written
(it fails jrollout's checksums) is reported on stderr, moved aside to
DIR/<update>.damaged, and the run resumes from the newest older one that
verifies (three are kept), or from the start.

    python -m examples.ppo_cartpole --checkpoint-dir runs/ckpt   # killed...
    python -m examples.ppo_cartpole --checkpoint-dir runs/ckpt   # ...resumes
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, NamedTuple

from flax.training.train_state import TrainState
import gymnax
import jax
import jax.numpy as jnp
import numpy as np

import jrollout as jr
from examples.common import agent
from examples.common import checkpoints
from examples.common import cli
from examples.common import gymnax_envs
from examples.common import loss
from examples.common import reporting
from examples.common import training


@dataclasses.dataclass(frozen=True)
class Config(cli.Config):
  """PPO on CartPole-v1; every field is a flag (see ``cli.Config``)."""
  out: str = "runs/ppo_cartpole"
  checkpoint_dir: str = ""     # save here, resume from here ("": off)
  checkpoint_every: int = 100  # updates between checkpoints (at chunk ends)


class Runner(NamedTuple):
  """Everything one seed carries from update to update."""
  train_state: TrainState
  env_state: Any
  obs: jax.Array             # [E, *obs_shape] the policy's input
  ep_return: jax.Array       # [E] running undiscounted return
  rollout: jr.RolloutState
  key: jax.Array


def init_runner(key, config: Config, env, env_params,
                network: agent.ActorCritic) -> Runner:
  """A fresh learner and envs, and an empty rollout of E envs x T steps
  holding the fields ``make_env_step`` writes (``final_obs`` among them)."""
  key, train_state, obs, env_state = gymnax_envs.init_learner(
      key, config, env, env_params, network)
  rollout = jr.init(config.num_envs, config.num_steps)
  for name, shape, dtype in agent.rollout_fields(
      obs.shape[1:], agent.action_spec(network), final="obs"):
    rollout = jr.register(rollout, name, shape, dtype)
  return Runner(train_state, env_state, obs, jnp.zeros(config.num_envs),
                rollout, key)


def make_env_step(config: Config, env, env_params,
                  network: agent.ActorCritic):
  """1. Collect: the rollout's scan body.

  ``env_step((runner, done_return, done_count), t)`` acts, steps every env
  (auto-reset), writes step ``t`` of the rollout with ``jr.update_at`` and
  accumulates the undiscounted returns of the episodes that ended.
  """
  def env_step(carry, t):
    runner, done_return, done_count = carry
    key, k_act, k_env = jax.random.split(runner.key, 3)
    policy, value = network.apply(runner.train_state.params, runner.obs)
    action, logp = policy.sample(k_act)
    obs, env_state, reward, terminated, truncated, info = (
        gymnax_envs.step_envs(env, env_params, k_env, runner.env_state,
                              action))
    # The true final observation (before the auto-reset): valued after the
    # rollout in one batched forward, used only where truncated.
    final_obs = gymnax_envs.mask_obs(info["final_observation"], config)
    rollout = jr.update_at(runner.rollout, t, {
        "obs": runner.obs, "action": action, "logp": logp, "value": value,
        "reward": reward, "terminated": terminated, "truncated": truncated,
        "final_obs": final_obs})
    ep_return, done_return, done_count = gymnax_envs.count_episodes(
        runner.ep_return, reward, terminated | truncated, done_return,
        done_count)
    runner = runner._replace(
        env_state=env_state, obs=gymnax_envs.mask_obs(obs, config),
        ep_return=ep_return, rollout=rollout, key=key)
    return (runner, done_return, done_count), None

  return env_step


def make_advantages(config: Config, network: agent.ActorCritic):
  """2. Advantages: ``advantages(runner) -> (advantages, targets)``, both
  ``[T, E]``, by ``jr.gae`` on the rollout's storage (read, not copied).

  The values of the observation after the rollout and of every stored
  final observation come from one batched forward each; a truncated step
  bootstraps from its final observation's value, a terminated one from
  nothing.
  """
  value = functools.partial(network.apply, method=agent.ActorCritic.value)

  def advantages(runner):
    data, params = runner.rollout.data, runner.train_state.params
    return jr.gae(
        data["reward"], data["value"], value(params, runner.obs),
        data["terminated"], truncations=data["truncated"],
        final_values=value(params, data["final_obs"]),
        gamma=config.gamma, gae_lambda=config.gae_lambda)

  return advantages


def make_update(config: Config, network: agent.ActorCritic, env_step):
  """``update_fn(runner) -> (runner, metrics)``: one PPO update, pure and
  vmappable, as ``training.train`` takes it.

  1. ``env_step`` over the T steps of a rollout (``training.collect``);
  2. ``make_advantages``'s ``jr.gae``, written with ``jr.update_all``;
  3. ``jr.scan_minibatches``: ``num_epochs`` epochs of ``B = batch_size``
     shuffled rows, straight from the rollout's storage, each minibatch
     ``{name: [B, ...]}`` taking 4. one gradient step on the PPO loss;
  then ``jr.finish_rollout``. ``metrics``: ``episode_return_sum`` and
  ``episodes`` (of the episodes that ended) and the loss means.
  """
  advantages = make_advantages(config, network)
  sgd_step = loss.make_sgd_step(config)

  def update_fn(runner):
    runner, episodes = training.collect(env_step, runner, config.num_steps)
    adv, targets = advantages(runner)
    rollout = jr.update_all(runner.rollout,
                            {"advantage": adv, "target": targets})
    key, k_epochs = jax.random.split(runner.key)
    train_state, losses = jr.scan_minibatches(
        sgd_step, runner.train_state, k_epochs, rollout, config.batch_size,
        num_epochs=config.num_epochs)
    runner = runner._replace(train_state=train_state,
                             rollout=jr.finish_rollout(rollout), key=key)
    return runner, {**episodes, **loss.loss_metrics(losses)}

  return update_fn


def make_train(config: Config):
  """Returns ``(init_fn, update_fn)``; both are pure and vmappable.

  ``init_fn(key) -> Runner``; ``update_fn(runner) -> (runner, metrics)``
  runs one PPO update (``make_update``).
  """
  env, env_params = gymnax.make("CartPole-v1")
  network = agent.ActorCritic(env.action_space(env_params).n, config.hidden)

  def init_fn(key):
    return init_runner(key, config, env, env_params, network)

  env_step = make_env_step(config, env, env_params, network)
  return init_fn, make_update(config, network, env_step)


def train(config: Config, verbose: bool = True,
          make_train_fn=None) -> dict[str, Any]:
  """``training.train`` of this agent (or of ``make_train_fn``'s), saving
  and resuming with ``checkpoints.RunCheckpoint`` if
  ``config.checkpoint_dir`` is set."""
  checkpoint = (checkpoints.RunCheckpoint(config) if config.checkpoint_dir
                else None)
  return training.train(config, make_train_fn or make_train, verbose,
                        checkpoint=checkpoint)


def parse_config(argv=None) -> Config:
  return cli.parse_config(argv, Config, __doc__)


def main(argv=None) -> dict[str, Any]:
  config = parse_config(argv)
  cli.use_compile_cache(config)   # --compile-cache, before compiling
  print(f"PPO CartPole-v1 on jrollout: {config.seeds} seeds x "
        f"{config.num_updates} updates of {config.num_envs} envs x "
        f"{config.num_steps} steps ({jax.devices()[0].platform})")
  result = train(config)
  metrics = result["metrics"]
  final = reporting.final_returns(metrics)
  os.makedirs(config.out, exist_ok=True)
  steps_per_update = config.num_envs * config.num_steps
  png = os.path.join(config.out, "learning_curve.png")
  window = max(1, config.num_updates // 50)
  reporting.save_curve(
      {"PPO (jrollout)": reporting.episode_returns(metrics, window)},
      steps_per_update, png, "PPO on CartPole-v1")
  print("\nseed | final return (last 10% of updates) | episodes | final loss")
  for i in range(config.seeds):
    last = max(1, int(round(config.num_updates * 0.1)))
    episodes = int(metrics["episodes"][i, -last:].sum())
    print(f"{i:4d} | {reporting.show(final[i]):>35} | {episodes:8d}"
          f" | {metrics['loss'][i, -1]:10.4f}")
  total_steps = config.seeds * config.num_updates * steps_per_update
  print(f"\ncompile {result['compile_s']:.1f} s, run {result['run_s']:.1f} s "
        f"({total_steps / max(result['run_s'], 1e-9):,.0f} env steps/s over "
        "all seeds), "
        f"wall {result['wall_s']:.1f} s")
  print(f"learning curve: {png}")
  summary = {"config": dataclasses.asdict(config),
             "final_returns": reporting.or_none(final),
             "params_sha256": reporting.params_sha256(
                 result["runner"].train_state.params),
             "compile_s": result["compile_s"], "run_s": result["run_s"],
             "wall_s": result["wall_s"],
             "finite_losses": bool(np.isfinite(metrics["loss"]).all())}
  reporting.write_summary(config.out, summary)
  return summary


if __name__ == "__main__":
  main()
