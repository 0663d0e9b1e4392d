"""PPO on JAX physics (Brax, MuJoCo Playground), built on jrollout: several
seeds at once.

``--env`` takes a Brax environment (default ``inverted_pendulum``; physics
``--backend``, default ``positional``) or a MuJoCo Playground one
(``CartpoleBalance``, ...; ``--impl``, default ``jax``, the one that runs on
the CPU; ``examples/playground_env.py``). The agent is Brax's PPO trainer's
(``brax.training.agents.ppo``), which Playground trains with: a
tanh-squashed Gaussian policy (4 x 32) and a value network (5 x 256), swish,
LeCun-uniform init; its loss. The defaults are Brax's published
``inverted_pendulum`` settings, or Playground's tuned settings for the env
(``brax_ppo_config``); ``--preset cpu`` sizes a run for a 2-core CPU
(``PRESETS``); flags given override both, and the settings used are printed
at start. Observations are a dict of groups, stored as one pytree field
(an array observation is ``{"state": obs}``); ``--policy-obs`` and
``--value-obs`` pick the group each network reads (an asymmetric critic:
``--privileged --value-obs privileged_state`` on a Playground env); each
group is normalised by its own statistics. The whole training run is jitted
and vmapped over seeds; one update is, in the open:

- the rollout: a ``lax.scan`` of T steps of E envs (``brax_env.AutoReset``)
  that writes each step into a ``RolloutState`` with ``jr.update_at``: the
  raw observation, the pre-tanh action, its log-probability, the scaled
  reward, ``terminated``/``truncated`` and the *true final observation* of
  the step (before the env restarts);
- the values of the stored observations, of the one after the rollout and
  of the final observation of every truncated step (batched forwards after
  the scan; ``truncation_values``), then ``jr.gae(..., truncations=,
  final_values=)``: a time-limit truncation bootstraps from
  ``V(final obs)``, a termination from nothing;
  values, advantages and targets go in with ``jr.update_all``;
- the observation statistics: ``jr.update_running_stats`` with the rollout's
  ``[T, E, ...]`` observation groups, once per update before the epochs (as Brax
  does); the networks see ``jr.normalize(stats, obs)``;
- the epochs: ``jr.scan_minibatches`` straight from the rollout's storage,
  then ``jr.finish_rollout`` (its write check comes back as a ``checkify``
  error value, raised on the host).

At the end every seed's deterministic policy (``tanh(mean)``) is evaluated
as Brax evaluates: 128 envs for 1,000 steps, the return of each env's first
episode. Outputs, in ``--out``: progress lines, ``summary.json`` (eval and
training returns per seed, ``params_sha256``, compile and run times, env
steps/s) and the learning curve (PNG). A return over a window in which no
episode ended is shown as ``none`` and saved as ``null``. From the
repository root:

    python -m examples.ppo_brax                          # inverted_pendulum
    python -m examples.ppo_brax --env hopper --total-steps 5000000
    python -m examples.ppo_brax --env CartpoleBalance --preset cpu

``--checkpoint-dir DIR`` saves the whole run every ``--checkpoint-every``
updates and a rerun of the same command resumes from it, bit for bit
(``checkpoints.RunCheckpoint``). JAX's persistent compilation cache is on by
default (``--compile-cache DIR``, off with ``--no-compile-cache``).

Where it still differs from Brax's trainer (see
benchmarks/results/brax/RESULTS.md): GAE runs over the whole T-step rollout
with the values from collection time (Brax: over each 5-step unroll, with
the values of the current parameters, recomputed in every minibatch);
truncations bootstrap from the true final observation (Brax: they get no
advantage, ``bootstrap_on_timeout=False``); each episode starts from a
fresh reset (Brax: every episode of an env restarts from its first state).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from typing import Any, NamedTuple, Sequence

from brax import envs
import flax.linen as nn
from flax.training.train_state import TrainState
import jax
import jax.numpy as jnp
import numpy as np
import optax

from examples import brax_env
from examples.common import checkpoints
from examples.common import cli
from examples.common import gymnax_envs
from examples.common import loss
from examples.common import reporting
from examples.common import training
import jrollout as jr

ACTIVATIONS = {"swish": nn.swish, "tanh": nn.tanh, "relu": nn.relu}
BACKENDS = ("positional", "generalized", "spring", "mjx")
IMPLS = ("jax", "warp")
# --preset cpu: a run sized for 2 CPU cores (the env's tuned learning
# rate, discount and costs kept); see tests/test_ppo_brax.py's margin.
PRESETS: dict[str, dict[str, Any]] = {
    "": {},
    "cpu": {"num_envs": 256, "num_steps": 64, "num_minibatches": 8,
            "num_epochs": 4, "total_steps": 1_048_576, "value_width": 64,
            "eval_envs": 32, "chunks": 8},
}


@dataclasses.dataclass(frozen=True)
class Config(cli.Config):
  """PPO on a Brax env; every field is a flag (see ``cli.Config``).

  The defaults are Brax's published ``inverted_pendulum`` settings: 2,048
  envs, ``discounting=0.97``, ``learning_rate=3e-4``, ``entropy_cost=1e-2``,
  ``reward_scaling=10``, 4 epochs of 32 minibatches, PPO clip 0.3, no
  gradient clipping, a constant learning rate. Brax collects 16 unrolls of
  5 steps per update: here one rollout of T = 80 steps, the same 163,840
  env steps; 13 updates are the 2,129,920 steps Brax's trainer runs for
  ``num_timesteps=2_000_000``. ``parse_config`` replaces the defaults with
  a Playground env's tuned settings and ``--preset``'s. ``hidden`` and
  ``mask_velocity`` do not apply (the network sizes are ``--policy-*`` /
  ``--value-*``).
  """
  env: str = "inverted_pendulum"
  backend: str = "positional"     # Brax envs
  impl: str = "jax"               # Playground envs: "jax" or "warp"
  preset: str = ""                # "cpu": PRESETS["cpu"] over the defaults
  privileged: bool = False        # Playground: add "privileged_state"
  policy_obs: str = "state"       # the observation group the policy reads
  value_obs: str = "state"        # and the critic's
  episode_length: int = 1000
  num_envs: int = 2048
  num_steps: int = 80
  total_steps: int = 2_129_920
  num_epochs: int = 4
  num_minibatches: int = 32
  lr: float = 3e-4
  anneal_lr: bool = False
  gamma: float = 0.97
  gae_lambda: float = 0.95
  clip_eps: float = 0.3
  ent_coef: float = 1e-2
  vf_coef: float = 0.5
  max_grad_norm: float = 0.0      # 0: no clipping (Brax's default)
  reward_scaling: float = 10.0    # rewards are multiplied by it for GAE
  normalize_obs: bool = True
  obs_clip: float = 0.0           # bound on normalised obs (0: none, Brax)
  policy_layers: int = 4
  policy_width: int = 32
  value_layers: int = 5
  value_width: int = 256
  activation: str = "swish"
  eval_envs: int = 128            # deterministic eval at the end (0: none)
  eval_steps: int = 1000
  chunks: int = 13
  out: str = "runs/ppo_brax"
  checkpoint_dir: str = ""        # save here, resume from here ("": off)
  checkpoint_every: int = 5       # updates between checkpoints


# ------------------------------------------------------------ the agent

class TanhGaussian(NamedTuple):
  """Brax's ``NormalTanhDistribution``: a diagonal Gaussian over pre-tanh
  actions ``[..., A]`` (``loc``, ``scale = softplus(.) + 0.001``); the env
  gets ``tanh(u)``. Log-probabilities include tanh's Jacobian."""
  loc: jax.Array
  scale: jax.Array

  @staticmethod
  def _log_det_jacobian(u):
    return 2.0 * (math.log(2.0) - u - jax.nn.softplus(-2.0 * u))

  def log_prob(self, u):
    """``[...]``: the log-density of ``tanh(u)`` for pre-tanh ``u``."""
    z = (u - self.loc) / self.scale
    logp = -0.5 * z**2 - 0.5 * math.log(2 * math.pi) - jnp.log(self.scale)
    return jnp.sum(logp - self._log_det_jacobian(u), -1)

  def sample(self, key):
    """``(u [..., A], logp [...])``: a pre-tanh sample and its log-prob."""
    u = self.loc + self.scale * jax.random.normal(key, self.loc.shape)
    return u, self.log_prob(u)

  def entropy(self, key):
    """``[...]``: the Gaussian's entropy plus tanh's log-Jacobian at one
    sample (Brax's estimate)."""
    u = self.loc + self.scale * jax.random.normal(key, self.loc.shape)
    per_dim = (0.5 + 0.5 * math.log(2 * math.pi) + jnp.log(self.scale)
               + self._log_det_jacobian(u))
    return per_dim.sum(-1)

  def mode(self):
    """``[..., A]``: the deterministic action ``tanh(loc)``."""
    return jnp.tanh(self.loc)


class MLP(nn.Module):
  """Brax's ``networks.MLP``: Dense layers with LeCun-uniform kernels, the
  activation after every layer but the last."""
  sizes: Sequence[int]
  activation: str = "swish"

  @nn.compact
  def __call__(self, x):
    for i, size in enumerate(self.sizes):
      x = nn.Dense(size, kernel_init=nn.initializers.lecun_uniform(),
                   name=f"hidden_{i}")(x)
      if i < len(self.sizes) - 1:
        x = ACTIVATIONS[self.activation](x)
    return x


class ActorCritic(nn.Module):
  """Separate policy and value MLPs on a dict of normalised observation
  groups ``{name: [..., O_name]}``: the policy reads group ``policy_obs``,
  the critic group ``value_obs``."""
  action_size: int
  policy_sizes: Sequence[int] = (32,) * 4
  value_sizes: Sequence[int] = (256,) * 5
  activation: str = "swish"
  policy_obs: str = "state"
  value_obs: str = "state"

  def setup(self):
    self.policy = MLP((*self.policy_sizes, 2 * self.action_size),
                      self.activation)
    self.critic = MLP((*self.value_sizes, 1), self.activation)

  def __call__(self, obs):
    """obs {name: [..., O]} -> (TanhGaussian over [..., A], value [...])."""
    return self.pi(obs), self.value(obs)

  def pi(self, obs):
    loc, scale = jnp.split(self.policy(obs[self.policy_obs]), 2, axis=-1)
    return TanhGaussian(loc, jax.nn.softplus(scale) + 0.001)

  def value(self, obs):
    return jnp.squeeze(self.critic(obs[self.value_obs]), -1)


def make_network(config: Config, action_size: int) -> ActorCritic:
  return ActorCritic(action_size,
                     (config.policy_width,) * config.policy_layers,
                     (config.value_width,) * config.value_layers,
                     config.activation, config.policy_obs, config.value_obs)


def is_brax_env(name: str) -> bool:
  return name in envs._envs   # Brax's registry has no public listing


def make_env(config: Config) -> brax_env.AutoReset:
  """``config.env``, ``num_envs`` at once: a Brax env on
  ``config.backend``, else a Playground env on ``config.impl``.

  Raises:
    ValueError: ``--privileged`` with a Brax env, or ``--policy-obs`` /
      ``--value-obs`` naming a group the observation does not have.
  """
  if is_brax_env(config.env):
    if config.privileged:
      raise ValueError("--privileged needs a Playground env (it adds the "
                       f"physics state of `data`), got {config.env!r}")
    env = envs.get_environment(config.env, backend=config.backend)
  else:
    from examples import playground_env  # noqa: PLC0415 - the extra
    env = playground_env.load(config.env, config.impl)
    if config.privileged:
      env = playground_env.Privileged(env)
  env = brax_env.ObsGroups(env)
  groups = jax.eval_shape(env.reset, jax.random.key(0)).obs
  for flag, group in [("policy_obs", config.policy_obs),
                      ("value_obs", config.value_obs)]:
    if group not in groups:
      raise ValueError(f"--{flag.replace('_', '-')} {group!r}: {config.env}"
                       f" observes the groups {sorted(groups)}")
  return brax_env.AutoReset(env, config.num_envs, config.episode_length)


class Runner(NamedTuple):
  train_state: TrainState
  env_state: brax_env.EnvState
  obs: dict[str, jax.Array]    # {group: [E, O]} raw observation
  obs_stats: jr.RunningStats   # of the raw observations, {group: (O,)}
  ep_return: jax.Array         # [E] running undiscounted return
  rollout: jr.RolloutState
  key: jax.Array


def truncation_values(value, final_obs, truncated, episode_length: int):
  """``[T, E]``: ``value`` of the true final observation ``final_obs``
  (``[T, E, O]``, or a pytree of such leaves) at every truncated step
  (``truncated``, ``[T, E]``), 0 elsewhere (``jr.gae`` reads
  ``final_values`` only where truncated).

  With T <= ``episode_length`` an env truncates at most once per rollout
  (a truncation ends an episode of ``episode_length`` steps), so one
  forward of E observations, each env's truncated step's, does instead of
  T * E of them; otherwise every step's is computed.
  """
  T, E = truncated.shape
  if T > episode_length:
    return value(final_obs)
  t = jnp.argmax(truncated, axis=0)   # each env's truncated step, or 0
  e = jnp.arange(E)
  return jnp.zeros(truncated.shape, jnp.float32).at[t, e].set(
      value(jax.tree.map(lambda x: x[t, e], final_obs)))


def make_train(config: Config):
  """Returns ``(init_fn, update_fn)``; both are pure and vmappable.

  ``init_fn(key) -> Runner``; ``update_fn(runner) -> (runner, metrics)``
  runs one PPO update (rollout, GAE, statistics, epochs).
  """
  env = make_env(config)
  action_size = env.action_size
  obs_like = jax.eval_shape(env.reset, jax.random.key(0))[1]   # [E, ...]
  obs_shapes = jax.tree.map(lambda x: x.shape[1:], obs_like)
  network = make_network(config, action_size)
  clip = config.obs_clip or None
  tx = optax.adam(config.lr)
  if config.max_grad_norm > 0:
    tx = optax.chain(optax.clip_by_global_norm(config.max_grad_norm), tx)

  def norm(stats, obs):
    return jr.normalize(stats, obs, clip=clip) if config.normalize_obs else obs

  def init_fn(key):
    key, k_net, k_env = jax.random.split(key, 3)
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape[1:], x.dtype),
                         obs_like)
    params = network.init(k_net, zeros)
    train_state = TrainState.create(apply_fn=network.apply, params=params,
                                    tx=tx)
    env_state, obs = env.reset(k_env)
    rollout = jr.init(config.num_envs, config.num_steps)
    for name in ("obs", "final_obs"):   # one pytree field each
      rollout = jr.register(rollout, name, like=obs_like)
    for name, shape in [("action", (action_size,)), ("logp", ()),
                        ("value", ()), ("reward", ()), ("advantage", ()),
                        ("target", ())]:
      rollout = jr.register(rollout, name, shape, jnp.float32)
    for name in ("terminated", "truncated"):
      rollout = jr.register(rollout, name, (), jnp.bool_)
    return Runner(train_state, env_state, obs,
                  jr.init_running_stats(obs_shapes),
                  jnp.zeros(config.num_envs), rollout, key)

  def env_step(carry, t):
    """Acts, steps the envs and writes step ``t`` with ``jr.update_at``."""
    runner, done_return, done_count = carry
    key, k_act = jax.random.split(runner.key)
    params = runner.train_state.params
    policy = network.apply(params, norm(runner.obs_stats, runner.obs),
                           method=ActorCritic.pi)
    u, logp = policy.sample(k_act)
    env_state, out = env.step(runner.env_state, jnp.tanh(u))
    rollout = jr.update_at(runner.rollout, t, {
        "obs": runner.obs, "action": u, "logp": logp,
        "reward": out.reward * config.reward_scaling,
        "terminated": out.terminated, "truncated": out.truncated,
        "final_obs": out.final_obs})
    ep_return, done_return, done_count = gymnax_envs.count_episodes(
        runner.ep_return, out.reward, out.terminated | out.truncated,
        done_return, done_count)
    runner = runner._replace(env_state=env_state, obs=out.obs,
                             ep_return=ep_return, rollout=rollout, key=key)
    return (runner, done_return, done_count), None

  def loss_fn(params, stats, mb, key):
    """Brax's PPO loss on a minibatch ``{name: [B, ...]}``."""
    policy, value = network.apply(params, norm(stats, mb["obs"]))
    ratio = jnp.exp(policy.log_prob(mb["action"]) - mb["logp"])
    adv = jr.normalize_advantages(mb["advantage"])
    pg_loss = -jnp.mean(jnp.minimum(
        ratio * adv,
        jnp.clip(ratio, 1 - config.clip_eps, 1 + config.clip_eps) * adv))
    v_loss = 0.5 * config.vf_coef * jnp.mean((mb["target"] - value) ** 2)
    entropy = jnp.mean(policy.entropy(key))
    total = pg_loss + v_loss - config.ent_coef * entropy
    return total, (pg_loss, v_loss, entropy)

  def update_fn(runner: Runner):
    # 1. The rollout: T steps of E envs, each written with jr.update_at.
    (runner, done_return, done_count), _ = jax.lax.scan(
        env_step, (runner, jnp.float32(0), jnp.int32(0)),
        jnp.arange(config.num_steps))
    rollout, stats = runner.rollout, runner.obs_stats
    data = rollout.data   # [T, E, ...] storage, no copy
    # 2. The values of the stored observations [T, E], of the one after
    # the rollout [E] and of the true final observation of every truncated
    # step, in batched forwards (the parameters did not change during the
    # rollout; XLA:CPU runs the 5 x 256 critic far slower inside the scan);
    # then GAE: truncations bootstrap from V(true final observation).
    params = runner.train_state.params

    def value(obs):
      return network.apply(params, norm(stats, obs),
                           method=ActorCritic.value)

    values = value(data["obs"])
    advantages, targets = jr.gae(
        data["reward"], values, value(runner.obs),
        data["terminated"], truncations=data["truncated"],
        final_values=truncation_values(value, data["final_obs"],
                                       data["truncated"],
                                       config.episode_length),
        gamma=config.gamma, gae_lambda=config.gae_lambda)
    rollout = jr.update_all(rollout, {"value": values,
                                      "advantage": advantages,
                                      "target": targets})
    # 3. The observation statistics, with this rollout's [T, E, ...] groups.
    if config.normalize_obs:
      stats = jr.update_running_stats(stats, data["obs"])

    # 4. The epochs, straight from the rollout; then its write check.
    def sgd_step(carry, mb):
      train_state, key = carry
      key, k_loss = jax.random.split(key)
      (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
          train_state.params, stats, mb, k_loss)
      return (train_state.apply_gradients(grads=grads), key), (loss, *aux)

    key, k_epochs, k_loss = jax.random.split(runner.key, 3)
    (train_state, _), losses = jr.scan_minibatches(
        sgd_step, (runner.train_state, k_loss), k_epochs, rollout,
        config.batch_size, num_epochs=config.num_epochs)
    # The write check as a flag the host tests (see ``train``).
    complete = jr.is_complete(rollout)
    rollout = jr.finish_rollout(rollout, check="off")
    metrics = {"episode_return_sum": done_return, "episodes": done_count,
               "rollout_complete": complete, **loss.loss_metrics(losses)}
    runner = runner._replace(train_state=train_state, obs_stats=stats,
                             rollout=rollout, key=key)
    return runner, metrics

  return init_fn, update_fn


def make_evaluate(config: Config):
  """``evaluate(train_state, obs_stats, key) -> [eval_envs]`` returns, as
  Brax's evaluator: ``eval_envs`` envs run the deterministic policy
  (``tanh(mean)``) for ``eval_steps`` steps; each env's return is the sum
  of the rewards of its first episode."""
  env = make_env(dataclasses.replace(config, num_envs=config.eval_envs))
  network = make_network(config, env.action_size)
  clip = config.obs_clip or None

  def evaluate(train_state, obs_stats, key):
    state, obs = env.reset(key)

    def step(carry, _):
      state, obs, ret, active = carry
      x = jr.normalize(obs_stats, obs, clip=clip) if config.normalize_obs \
          else obs
      action = network.apply(train_state.params, x,
                             method=ActorCritic.pi).mode()
      state, out = env.step(state, action)
      ret = ret + jnp.where(active, out.reward, 0.0)
      active = active & ~(out.terminated | out.truncated)
      return (state, out.obs, ret, active), None

    init = (state, obs, jnp.zeros(config.eval_envs),
            jnp.ones(config.eval_envs, bool))
    (_, _, ret, _), _ = jax.lax.scan(step, init, None,
                                     length=config.eval_steps)
    return ret

  return evaluate


def evaluate_seeds(config: Config, runner: Runner) -> dict[str, Any]:
  """Every seed's eval returns (``make_evaluate``, seeds vmapped): ``{
  "eval_returns": [seeds] means over the envs, "eval_compile_s",
  "eval_s"}``."""
  evaluate = make_evaluate(config)
  keys = jax.random.split(jax.random.key(config.seed + 10_000), config.seeds)
  t0 = time.perf_counter()
  fn = jax.jit(jax.vmap(evaluate)).lower(
      runner.train_state, runner.obs_stats, keys).compile()
  t1 = time.perf_counter()
  ret = np.asarray(fn(runner.train_state, runner.obs_stats, keys))
  return {"eval_returns": ret.mean(1).tolist(),
          "eval_compile_s": t1 - t0, "eval_s": time.perf_counter() - t1}


def train(config: Config, verbose: bool = True,
          make_train_fn=make_train) -> dict[str, Any]:
  """Trains ``config.seeds`` seeds at once with the shared host loop
  (``examples.common.training.train``), saving and resuming with
  ``checkpoints.RunCheckpoint`` if ``config.checkpoint_dir`` is set.

  Unchecked chunks (``checked=False``): each update returns
  ``jr.is_complete``, since ``checkify`` refuses the batched shuffle of
  N = E * T not a power of two (80 x 2,048 here).

  Raises:
    ValueError: if ``total_steps`` is less than one rollout.
    jr.IncompleteRolloutError: if an update closed an incomplete rollout.
  """
  checkpoint = (checkpoints.RunCheckpoint(config) if config.checkpoint_dir
                else None)
  return training.train(config, make_train_fn, verbose, checkpoint,
                        checked=False)


def env_defaults(env: str, preset: str) -> dict[str, Any]:
  """The settings that replace ``Config``'s defaults for ``env`` and
  ``preset``: Playground's tuned ones for a Playground env
  (``playground_env.tuned_settings``), then ``PRESETS[preset]``."""
  tuned: dict[str, Any] = {}
  if not is_brax_env(env):
    from examples import playground_env  # noqa: PLC0415 - the extra
    tuned = playground_env.tuned_settings(env)
  return {**tuned, **PRESETS[preset]}


def parse_config(argv=None) -> Config:
  """A ``Config`` from command-line flags, one per dataclass field, over
  ``env_defaults(--env, --preset)``: a flag given wins over both."""
  argv = sys.argv[1:] if argv is None else list(argv)
  config = cli.parse_config(argv, Config, __doc__, choices={
      "backend": BACKENDS, "impl": IMPLS, "preset": tuple(PRESETS),
      "activation": tuple(ACTIVATIONS)})
  given = {a[2:].split("=")[0].replace("-", "_") for a in argv
           if a.startswith("--")}
  given |= {name[3:] for name in given if name.startswith("no_")}
  defaults = env_defaults(config.env, config.preset)
  return dataclasses.replace(config, **{
      k: v for k, v in defaults.items() if k not in given})


def main(argv=None) -> dict[str, Any]:
  config = parse_config(argv)
  cli.use_compile_cache(config)   # --compile-cache, before compiling
  steps_per_update = config.num_envs * config.num_steps
  physics = config.backend if is_brax_env(config.env) else config.impl
  print(f"PPO {config.env} ({physics}) on jrollout: {config.seeds} "
        f"seeds x {config.num_updates} updates of {config.num_envs} envs x "
        f"{config.num_steps} steps = {config.num_updates * steps_per_update:,}"
        f" env steps per seed ({jax.devices()[0].platform})", flush=True)
  defaults = env_defaults(config.env, config.preset)
  if defaults:
    print("settings (tuned for the env, --preset, then flags): " + ", ".join(
        f"{k}={getattr(config, k)}" for k in defaults), flush=True)
  result = train(config)
  metrics, runner = result["metrics"], result["runner"]
  final = reporting.final_returns(metrics)
  total_steps = config.seeds * config.num_updates * steps_per_update
  summary: dict[str, Any] = {
      "config": dataclasses.asdict(config),
      "jax": jax.__version__,
      "env_steps_per_seed": config.num_updates * steps_per_update,
      "final_returns": reporting.or_none(final),
      "params_sha256": reporting.params_sha256(runner.train_state.params),
      "compile_s": result["compile_s"], "run_s": result["run_s"],
      "init_s": result["init_s"], "wall_s": result["wall_s"],
      "env_steps_per_s": total_steps / max(result["run_s"], 1e-9),
      "finite_losses": bool(np.isfinite(metrics["loss"]).all()),
  }
  if config.eval_envs > 0:
    summary.update(evaluate_seeds(config, runner))
  os.makedirs(config.out, exist_ok=True)
  png = os.path.join(config.out, "learning_curve.png")
  reporting.save_curve(
      {"PPO (jrollout)": reporting.episode_returns(metrics)},
      steps_per_update, png, f"PPO on {config.env} ({physics})")
  print(f"\nseed | eval return (deterministic, {config.eval_envs} envs) | "
        "training return (last 10% of updates)")
  for i in range(config.seeds):
    ev = (f"{summary['eval_returns'][i]:.1f}" if config.eval_envs > 0
          else "none")
    print(f"{i:4d} | {ev:>41} | {reporting.show(final[i]):>8}")
  print(f"\ncompile {result['compile_s']:.1f} s, run {result['run_s']:.1f} s "
        f"({summary['env_steps_per_s']:,.0f} env steps/s over all seeds), "
        f"wall {result['wall_s']:.1f} s")
  path = reporting.write_summary(config.out, summary)
  print(f"learning curve: {png}\nsummary: {path}")
  return summary


if __name__ == "__main__":
  main()
