"""PPO on a host vector env (EnvPool or gymnasium CartPole-v1), JAX learner.

The environments step on the host, as in the best-known single-file PPO
implementations: EnvPool's C++ vector env (``--backend envpool``, the
default) or a gymnasium vector env (``--backend gymnasium``, via
``gymnasium.make_vec(..., vectorization_mode="sync")``). Both reset a
finished env on the *next* call by default (next-step autoreset): the step
that ends an episode returns its true final observation, and the next step
ignores the action and returns the reset observation with reward 0. Such a
reset step is not a transition: ``jr.autoreset_valid`` marks it,
``jr.gae(..., valid=...)`` gives it zero advantage and does not chain across
it, and a time-limit truncation bootstraps from ``values[t + 1]``, the value
of the episode's true final observation. gymnasium's same-step mode
(``--autoreset same_step``: the final observation comes in
``info["final_obs"]``) is handled the in-JAX way, with ``truncations`` and
``final_values``. Same agent, same result, either way.

Per env step the host loop runs the jitted policy on the observations,
steps the env with its actions, and writes the step through a
``jr.RolloutWriter`` in one call: the policy's outputs (JAX arrays, held
until the flush) and the env's observations, rewards and flags (numpy,
copied into the writer's staging blocks at once). The writer checks every
write when it is made and writes ``flush_every`` steps per jitted call, in
place (``collect``). After each rollout one jitted, ``checkify``-wrapped
update runs PPO (``Learner.ppo_update``): ``jr.autoreset_valid`` and
``jr.gae``, then ``jr.scan_minibatches`` straight from the rollout's
``[T, E]`` storage with the valid mask as the loss weight, then
``jr.finish_rollout`` (the write check). Seeds run one after another and
share the compiled functions (``Learner``, which
``examples/torch_simulator.py`` uses too). From the repository root (needs
``pip install -e ".[envpool]"``):

    python -m examples.ppo_envpool                      # EnvPool, 4 seeds
    python -m examples.ppo_envpool --backend gymnasium --autoreset same_step

It prints progress lines and a per-step time breakdown (env | bridge |
policy | buffer write), and writes ``learning_curve.png`` and
``summary.json`` to ``--out``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any
import warnings

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np

import jrollout as jr
from examples.common import cli
from examples.common import host_learner
from examples.common import loss
from examples.common import reporting

BACKENDS = ("envpool", "gymnasium")
PARTS = ("env", "bridge", "policy", "buffer")


@dataclasses.dataclass(frozen=True)
class Config(cli.Config):
  """Hyperparameters; every field is a command-line flag.

  Seeds ``seed .. seed + seeds - 1`` train one after another; ``chunks`` is
  the number of progress lines per seed; ``mask_velocity`` does not apply.
  """
  num_envs: int = 32
  num_steps: int = 64
  total_steps: int = 800_000
  num_minibatches: int = 4
  lr: float = 5e-4
  backend: str = "envpool"
  autoreset: str = "next_step"  # next_step | same_step (gymnasium only)
  flush_every: int = 16         # RolloutWriter: steps written per dispatch
  out: str = "runs/ppo_envpool"


# --- the host vector env ----------------------------------------------------


def make_env(config: Config, seed: int):
  """``(env, obs [E, 4])``: the vector env, reset with ``seed``."""
  if config.backend == "envpool":
    if config.autoreset != "next_step":
      raise ValueError(f"--backend envpool resets on the next step only; got "
                       f"--autoreset {config.autoreset} (use --backend "
                       "gymnasium for same_step)")
    with warnings.catch_warnings():
      # EnvPool builds its spaces from float64 bounds (on import, make and
      # reset); gymnasium warns that it casts them to float32.
      warnings.filterwarnings("ignore", "(?s).*precision lowered",
                              UserWarning)
      import envpool  # noqa: PLC0415 (the optional `envpool` extra)
      env = envpool.make_gymnasium("CartPole-v1", num_envs=config.num_envs,
                                   seed=seed)
      obs, _ = env.reset()
  else:
    import gymnasium  # noqa: PLC0415 (the optional `envpool` extra)
    mode = {"next_step": gymnasium.vector.AutoresetMode.NEXT_STEP,
            "same_step": gymnasium.vector.AutoresetMode.SAME_STEP}
    env = gymnasium.make_vec(
        "CartPole-v1", num_envs=config.num_envs, vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": mode[config.autoreset]})
    obs, _ = env.reset(seed=seed)
  return env, np.asarray(obs, np.float32)


def final_obs(info: dict[str, Any], obs: np.ndarray) -> np.ndarray:
  """``[E, 4]``: gymnasium same-step's final observations where an episode
  ended (``info["final_obs"]``, an object array), ``obs`` elsewhere."""
  out = obs.copy()
  ended = info.get("_final_obs", np.zeros(len(obs), bool))
  for e in np.flatnonzero(ended):
    out[e] = info["final_obs"][e]
  return out


# --- the host loop ----------------------------------------------------------


class Episodes:
  """Undiscounted returns of the episodes that end, on the host."""

  def __init__(self, num_envs: int):
    self.running = np.zeros(num_envs)
    self.total, self.count = 0.0, 0

  def add(self, reward, done) -> None:
    self.running += reward
    self.total += float(self.running[done].sum())
    self.count += int(done.sum())
    self.running[done] = 0.0

  def take(self) -> tuple[float, int]:
    out = (self.total, self.count)
    self.total, self.count = 0.0, 0
    return out


def collect(env, obs, rollout, params, key, learner: Learner,
            episodes: Episodes, timings: dict[str, float], wait: bool = True):
  """One rollout of T steps of every env, written through a RolloutWriter.

  Each step goes to the writer in one ``update_at`` call: what the policy
  computed (``action``, ``logp``, ``value``; same-step's ``final_value``)
  as JAX arrays, held until the flush, and what the env returned (the
  observation acted on, ``reward``, ``terminated``, ``truncated``) as
  numpy arrays, copied into the writer's staging blocks at once. The
  writer writes ``flush_every`` steps per jitted call, in place.

  Returns ``(obs, rollout, key, done)`` with ``done [E]`` the last step's
  ``terminated | truncated`` (the next rollout's ``prev_done``). Each part
  of a step is timed into ``timings`` (seconds, summed): ``env`` (the env
  step and the episode bookkeeping), ``policy`` (the jitted policy, which
  reads the observations, waited for; same-step's values of final
  observations), ``bridge`` (the actions to numpy), ``buffer`` (the
  writer's checks, staging copies and queueing, and its writes, waited
  for). With ``wait=False`` the writer's flushes are not waited for (the
  writer itself never waits): each runs while the loop goes on, and its
  time lands in whatever waits next, so ``timings`` no longer charge each
  part with its own work; the end-to-end benchmark runs this way.
  """
  config = learner.config
  num_steps = config.num_steps
  same_step = config.autoreset == "same_step"
  writer = jr.RolloutWriter(rollout, flush_every=config.flush_every)
  done = None
  for t in range(num_steps):
    t1 = time.perf_counter()
    action, logp, value, key = jax.block_until_ready(
        learner.act(params, obs, key))
    t2 = time.perf_counter()
    action_np = np.asarray(action)
    t3 = time.perf_counter()
    # EnvPool and gymnasium's vector envs return new arrays at every step:
    # `obs` still holds the observation acted on.
    next_obs, reward, terminated, truncated, info = env.step(action_np)
    next_obs = np.asarray(next_obs, np.float32)
    done = terminated | truncated
    episodes.add(reward, done)
    t4 = time.perf_counter()
    step = {"obs": obs, "action": action, "logp": logp, "value": value,
            "reward": reward, "terminated": terminated,
            "truncated": truncated}
    if same_step:   # V(final obs) where truncated, in-JAX style
      step["final_value"] = learner.zero_value
      if truncated.any():
        step["final_value"] = jax.block_until_ready(
            learner.value_fn(params, final_obs(info, next_obs)))
    t5 = time.perf_counter()
    flushes = writer.pending + 1 == config.flush_every
    writer.update_at(t, step)
    if flushes and wait:
      jax.block_until_ready(writer.state)
    t6 = time.perf_counter()
    obs = next_obs
    timings["bridge"] += t3 - t2
    timings["policy"] += (t2 - t1) + (t5 - t4)
    timings["env"] += t4 - t3
    timings["buffer"] += t6 - t5
  t0 = time.perf_counter()
  rollout = jax.block_until_ready(writer.state)   # writes the last steps
  timings["buffer"] += time.perf_counter() - t0
  return obs, rollout, key, done


# --- the JAX side -----------------------------------------------------------


class Learner(host_learner.HostLearner):
  """The jitted policy (``host_learner.HostLearner``) and the PPO update
  below, built once and shared by every seed, for ``config.autoreset``'s
  mode (or ``autoreset``'s: ``examples/torch_simulator.py`` uses this
  learner with ``"same_step"``).

  ``update(train_state, rollout, last_obs, prev_done, key) -> (err,
  (train_state, rollout, metrics))``: ``ppo_update`` jitted and
  ``checkify``-wrapped (``err`` carries ``jr.finish_rollout``'s write check
  and ``jr.autoreset_valid``'s flag check), donating the train state and
  the rollout.
  """

  def __init__(self, config: Config, *, autoreset: str | None = None,
               device: jax.Device | None = None):
    super().__init__(config, autoreset=autoreset or config.autoreset,
                     device=device)
    self.sgd_step = loss.make_sgd_step(config)
    self.update = jax.jit(checkify.checkify(self.ppo_update,
                                            errors=checkify.user_checks),
                          donate_argnums=(0, 1))

  def ppo_update(self, train_state, rollout, last_obs, prev_done, key):
    """One PPO update on a collected rollout: 2. advantages, 3. minibatches
    and 4. their gradient steps, then the rollout's close.

    ``last_obs [E, 4]``: the observation after the rollout; ``prev_done
    [E]``: whether the step before the rollout ended an episode (next-step
    autoreset only; ``None`` with same-step). Returns ``(train_state,
    rollout, metrics)``, ``metrics`` the loss means and ``valid_frac``.
    """
    config, next_step = self.config, self.autoreset == "next_step"
    data = rollout.data   # [T, E, ...] storage, no copy
    # Next-step autoreset: a reset step is not a transition. It gets no
    # advantage, nothing is chained across it, the loss weighs it 0, and a
    # truncation bootstraps from the next step's stored value. Same-step:
    # a truncation bootstraps from its true final observation's value.
    valid = jr.autoreset_valid(
        data["terminated"], data["truncated"], mode=self.autoreset,
        prev_done=prev_done if next_step else None)
    last_value = self.value_fn(train_state.params, last_obs)
    if next_step:
      ends, extra = {"valid": valid}, {"weight": valid.astype(jnp.float32)}
    else:
      ends = {"truncations": data["truncated"],
              "final_values": data["final_value"]}
      extra = {}
    advantages, targets = jr.gae(
        data["reward"], data["value"], last_value, data["terminated"],
        **ends, gamma=config.gamma, gae_lambda=config.gae_lambda)
    rollout = jr.update_all(
        rollout, {"advantage": advantages, "target": targets, **extra})
    # Epochs of shuffled minibatches of B rows, straight from the storage.
    train_state, losses = jr.scan_minibatches(
        self.sgd_step, train_state, key, rollout, config.batch_size,
        num_epochs=config.num_epochs)
    return train_state, jr.finish_rollout(rollout), {
        **loss.loss_metrics(losses),
        "valid_frac": valid.mean(dtype=jnp.float32)}


def train_seed(config: Config, seed: int, learner: Learner,
               verbose: bool = True) -> dict[str, Any]:
  """Trains one seed; returns its per-update history and step timings."""
  key = jax.random.key(seed)
  key, k_net, k_act = jax.random.split(key, 3)
  train_state, rollout = learner.init(k_net)
  env, obs = make_env(config, seed)
  episodes = Episodes(config.num_envs)
  prev_done = np.zeros(config.num_envs, bool)
  timings = dict.fromkeys(PARTS, 0.0)
  history = {k: [] for k in ("episode_return_sum", "episodes", "loss",
                             "entropy", "valid_frac")}
  every = max(1, config.num_updates // max(1, config.chunks))
  rollout_s = update_s = 0.0
  t_start = time.perf_counter()
  for i in range(config.num_updates):
    key, k_upd = jax.random.split(key)
    t0 = time.perf_counter()
    obs, rollout, k_act, done = collect(env, obs, rollout,
                                        train_state.params, k_act, learner,
                                        episodes, timings)
    t1 = time.perf_counter()
    err, (train_state, rollout, metrics) = learner.update(
        train_state, rollout, obs, prev_done, k_upd)
    err.throw()   # the write check, or next-step flags that are not
    metrics = jax.device_get(metrics)
    t2 = time.perf_counter()
    rollout_s += t1 - t0
    update_s += t2 - t1
    prev_done = done
    total, count = episodes.take()
    history["episode_return_sum"].append(total)
    history["episodes"].append(count)
    for k in ("loss", "entropy", "valid_frac"):
      history[k].append(float(metrics[k]))
    if verbose and ((i + 1) % every == 0 or i + 1 == config.num_updates):
      recent = slice(max(0, i + 1 - every), i + 1)
      ret = (sum(history["episode_return_sum"][recent])
             / max(1, sum(history["episodes"][recent])))
      steps = (i + 1) * config.num_envs * config.num_steps
      print(f"seed {seed}  update {i + 1:4d}/{config.num_updates}  env steps "
            f"{steps:>9,d}  return {ret:6.1f}  loss {metrics['loss']:7.4f}  "
            f"valid {metrics['valid_frac']:.3f}  "
            f"{steps / (time.perf_counter() - t_start):,.0f} steps/s",
            flush=True)
  env.close()
  num_steps = config.num_updates * config.num_steps
  per_step_ms = {k: 1e3 * v / num_steps for k, v in timings.items()}
  per_step_ms["total"] = sum(per_step_ms[k] for k in PARTS)
  return {"history": {k: np.asarray(v) for k, v in history.items()},
          "per_step_ms": per_step_ms, "rollout_s": rollout_s,
          "update_s": update_s, "wall_s": time.perf_counter() - t_start}


def train(config: Config, verbose: bool = True) -> dict[str, Any]:
  """Trains ``config.seeds`` seeds one after another.

  Returns ``{"metrics": {name: [seeds, updates]}, "per_step_ms", ...}``;
  the first seed's first rollout and update include the compilation.
  """
  if config.backend not in BACKENDS:
    raise ValueError(f"--backend must be one of {BACKENDS}, got "
                     f"{config.backend!r}")
  jr.autoreset_valid(np.zeros((1, 1), bool), np.zeros((1, 1), bool),
                     mode=config.autoreset)   # checks --autoreset
  if config.num_updates < 1:
    raise ValueError(f"--total-steps {config.total_steps} is less than one "
                     f"rollout ({config.num_envs * config.num_steps} steps)")
  learner = Learner(config)
  runs = [train_seed(config, config.seed + s, learner, verbose)
          for s in range(config.seeds)]
  metrics = {k: np.stack([r["history"][k] for r in runs])
             for k in runs[0]["history"]}
  # The first seed's timings include compilation; report the others' when
  # there are any.
  timed = runs[1:] or runs
  per_step_ms = {k: float(np.mean([r["per_step_ms"][k] for r in timed]))
                 for k in runs[0]["per_step_ms"]}
  env_steps = config.num_updates * config.num_steps * config.num_envs
  return {"metrics": metrics, "per_step_ms": per_step_ms,
          "rollout_steps_per_s": float(np.mean(
              [env_steps / r["rollout_s"] for r in timed])),
          "wall_s": [r["wall_s"] for r in runs],
          "update_s": [r["update_s"] for r in runs]}


def parse_config(argv=None) -> Config:
  return cli.parse_config(
      argv, Config, __doc__,
      choices={"backend": BACKENDS, "autoreset": ("next_step", "same_step")})


def main(argv=None) -> dict[str, Any]:
  config = parse_config(argv)
  cli.use_compile_cache(config)   # --compile-cache, before compiling
  print(f"PPO on {config.backend} CartPole-v1 ({config.autoreset} "
        f"autoreset): {config.seeds} seeds one after another, "
        f"{config.num_updates} updates of {config.num_envs} envs x "
        f"{config.num_steps} steps each (jax {jax.__version__} on "
        f"{jax.devices()[0].platform})")
  result = train(config)
  metrics = result["metrics"]
  final = reporting.final_returns(metrics)
  ms = result["per_step_ms"]
  print(f"\nfinal return per seed (last 10% of updates): "
        f"{reporting.show(final)}")
  print(f"per step of all {config.num_envs} envs ({ms['total']:.3f} ms): env "
        f"{ms['env']:.3f} | bridge {ms['bridge']:.3f} | policy "
        f"{ms['policy']:.3f} | buffer write {ms['buffer']:.3f} ms; rollouts "
        f"{result['rollout_steps_per_s']:,.0f} env steps/s")
  os.makedirs(config.out, exist_ok=True)
  steps_per_update = config.num_envs * config.num_steps
  png = os.path.join(config.out, "learning_curve.png")
  curve = reporting.episode_returns(metrics, window=5)   # [seeds, updates]
  reporting.save_curve(
      {f"{config.backend}, {config.autoreset}": curve},
      steps_per_update, png,
      f"PPO on {config.backend} CartPole-v1 (host loop, jrollout)")
  summary = {
      "config": dataclasses.asdict(config),
      "final_returns": reporting.or_none(final),
      # null where no episode ended in the window
      "return_curve": np.where(np.isnan(curve), None, curve).tolist(),
      "solved": bool((final >= 475).all()),
      "finite_losses": bool(np.isfinite(metrics["loss"]).all()),
      "valid_frac": float(metrics["valid_frac"].mean()),
      "per_step_ms": ms,
      "rollout_steps_per_s": result["rollout_steps_per_s"],
      "wall_s": result["wall_s"], "update_s": result["update_s"],
  }
  path = reporting.write_summary(config.out, summary)
  print(f"learning curve: {png}\nsummary: {path}")
  return summary


if __name__ == "__main__":
  main()
