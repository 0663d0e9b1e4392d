"""Data-parallel PPO on gymnax CartPole-v1 across devices, built on jrollout.

One training run spread over D devices of a 1-D mesh with axis ``"envs"``:

- the E envs, their observations and the ``RolloutState`` storage are split
  over the devices (``jr.shard`` / ``jr.shard_rows``: device ``d`` steps and
  stores its own ``E / D`` envs); the network parameters and optimizer state
  are replicated. The rollout, GAE and ``jr.update_at`` / ``jr.update_all``
  run in one jitted function whose compiled code moves no env data between
  devices;
- the epochs run in ``jr.scan_minibatches_sharded``: in the default
  ``--mode local`` each device shuffles and minibatches its own rows (no data
  moves); ``--mode global`` uses the single-device order (the batch is
  all-gathered once per update). The update function runs on every device on
  its ``B / D`` rows and averages the gradients across devices by
  differentiating ``jax.lax.pmean(loss, "envs")`` (under ``shard_map``'s
  ``check_vma``, the gradient of a replicated parameter is already summed
  over devices, so pmean-ing the loss, not the gradients, gives the mean).
  Advantages are normalised per device, over its ``B / D`` rows.

The network, loss, env step and PPO hyperparameters are those of
``examples/ppo_cartpole.py``, from ``examples/ppo_core.py``.
On a host with fewer devices than ``--devices`` (e.g. a CPU), XLA is asked
for that many host devices before JAX starts: they share the CPU cores, so
this shows the mechanics, not a speed-up. From the repository root:

    python -m examples.ppo_sharded                  # 8 devices, local mode
    python -m examples.ppo_sharded --devices 4 --mode global

On several hosts, start the same command on each with ``--distributed``
(``jax.distributed.initialize()``, see the README); ``--devices`` is then the
global device count.
"""

from __future__ import annotations

import argparse
import functools
import dataclasses
import json
import os
import re
import sys
import time
from typing import Any

DEFAULT_DEVICES = 8


def _request_host_devices(argv) -> None:
  """Asks XLA for ``--devices`` host devices; only works before JAX starts.

  Harmless on an accelerator host: the flag only shapes the CPU platform.
  """
  if "jax" in sys.modules:
    return   # too late to change; the caller set the devices up (tests do)
  parser = argparse.ArgumentParser(add_help=False)
  parser.add_argument("--devices", type=int, default=DEFAULT_DEVICES)
  count = parser.parse_known_args(argv)[0].devices
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={count}").strip()


if __name__ == "__main__":
  _request_host_devices(sys.argv[1:])

# JAX may start only after _request_host_devices: the imports come here.
import jax  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import gymnax  # noqa: E402

import jrollout as jr  # noqa: E402
from examples import ppo_core  # noqa: E402

AXIS = "envs"


@dataclasses.dataclass(frozen=True)
class Config(ppo_core.Config):
  """Every field is a command-line flag. E and B (``batch_size``) are global:
  over all devices, each of which takes ``E / D`` envs and ``B / D`` rows.
  One training run: ``--seeds`` does not apply."""
  num_envs: int = 64             # E, split over the devices
  num_steps: int = 64
  total_steps: int = 64 * 64 * 40
  chunks: int = 5                # host round-trips for progress printing
  out: str = "runs/ppo_sharded"
  devices: int = DEFAULT_DEVICES
  mode: str = "local"            # minibatching: "local" or "global"
  distributed: bool = False      # call jax.distributed.initialize() first


def make_mesh(config: Config) -> jax.sharding.Mesh:
  devices = jax.devices()
  if len(devices) < config.devices:
    raise SystemExit(
        f"--devices {config.devices}: only {len(devices)} "
        f"{devices[0].platform} device(s). On a CPU host, run "
        "`python -m examples.ppo_sharded` (it sets "
        "XLA_FLAGS=--xla_force_host_platform_device_count before JAX "
        "starts) or set that flag yourself.")
  return jax.make_mesh((config.devices,), (AXIS,),
                       axis_types=(AxisType.Auto,),
                       devices=devices[:config.devices])


def make_train(config: Config, mesh: jax.sharding.Mesh):
  """``(init_fn, update_fn)``, both jittable, over the mesh's ``"envs"``."""
  env, env_params = gymnax.make("CartPole-v1")
  network = ppo_core.ActorCritic(env.action_space(env_params).n,
                                 config.hidden)
  num_envs, num_steps = config.num_envs, config.num_steps
  replicated = NamedSharding(mesh, P())

  def init_fn(key):
    key, train_state, obs, env_state = ppo_core.init_learner(
        key, config, env, env_params, network)
    rollout = ppo_core.register_keys(jr.init(num_envs, num_steps),
                                     final="obs")
    # Envs split over the devices; the learner's state replicated.
    env_state, obs, ep_return = jr.shard_rows(
        (env_state, obs, jnp.zeros(num_envs)), mesh)
    train_state = jax.lax.with_sharding_constraint(train_state, replicated)
    return ppo_core.Runner(train_state, env_state, obs, ep_return,
                           jr.shard(rollout, mesh, AXIS), key)

  env_step = ppo_core.make_env_step(config, env, env_params, network)

  def sgd_step(train_state, mb):
    """Runs on every device on its ``B / D`` rows, inside shard_map."""
    def loss_fn(params):
      loss, aux = ppo_core.ppo_loss(params, train_state.apply_fn, mb, config)
      # The mean over devices: its gradient is the averaged gradient.
      return jax.lax.pmean((loss, aux), AXIS)

    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        train_state.params)
    return train_state.apply_gradients(grads=grads), (loss, *aux)

  def update_fn(runner: ppo_core.Runner, _=None):
    (runner, done_return, done_count), _ = jax.lax.scan(
        env_step, (runner, jnp.float32(0), jnp.int32(0)),
        jnp.arange(num_steps))
    rollout = runner.rollout
    params = runner.train_state.params
    value = functools.partial(network.apply, method=ppo_core.ActorCritic.value)
    data = rollout.data   # [T, E, ...], E split over the devices
    advantages, targets = jr.gae(
        data["reward"], data["value"], value(params, runner.obs),
        data["terminated"], truncations=data["truncated"],
        final_values=value(params, data["final_obs"]),
        gamma=config.gamma, gae_lambda=config.gae_lambda)
    rollout = jr.update_all(rollout, jr.shard_rows(
        {"advantage": advantages, "target": targets}, mesh, dim=1))
    key, k_epochs = jax.random.split(runner.key)
    train_state, losses = jr.scan_minibatches_sharded(
        sgd_step, runner.train_state, k_epochs, rollout, config.batch_size,
        mesh=mesh, axis=AXIS, mode=config.mode, num_epochs=config.num_epochs)
    rollout = jr.finish_rollout(rollout)
    metrics = {
        "episode_return_sum": done_return,
        "episodes": done_count,
        "loss": losses[0].mean(),   # [D, epochs, M]: equal over devices
        "pg_loss": losses[1].mean(),
        "v_loss": losses[2].mean(),
        "entropy": losses[3].mean(),
    }
    runner = runner._replace(train_state=train_state, rollout=rollout, key=key)
    return runner, metrics

  return init_fn, update_fn


def collective_counts(compiled_text: str) -> dict[str, int]:
  """How many collectives of each kind a compiled HLO module contains."""
  found = re.findall(r"\b(all-gather|all-to-all|collective-permute|"
                     r"all-reduce|reduce-scatter)(?:-start)?\(", compiled_text)
  return {kind: found.count(kind) for kind in sorted(set(found))}


def train(config: Config, verbose: bool = True) -> dict[str, Any]:
  mesh = make_mesh(config)
  init_fn, update_fn = make_train(config, mesh)
  num_updates = config.num_updates
  if num_updates < 1:
    raise ValueError(f"--total-steps {config.total_steps} is less than one "
                     f"rollout ({config.num_envs * config.num_steps} steps)")
  size = max(1, num_updates // max(1, config.chunks))
  sizes = [size] * (num_updates // size)
  if num_updates % size:
    sizes.append(num_updates % size)
  t0 = time.perf_counter()
  runner = jax.block_until_ready(
      jax.jit(init_fn)(jax.random.key(config.seed)))
  compiled, compile_s, run_s, history = {}, time.perf_counter() - t0, 0.0, []
  steps_per_update = config.num_envs * config.num_steps
  done = 0
  t_start = time.perf_counter()
  for n in sizes:
    if n not in compiled:
      t0 = time.perf_counter()
      chunk = jax.jit(lambda r, n=n: jax.lax.scan(update_fn, r, None,
                                                  length=n),
                      donate_argnums=0)
      compiled[n] = chunk.lower(runner).compile()
      compile_s += time.perf_counter() - t0
    t0 = time.perf_counter()
    runner, metrics = compiled[n](runner)
    metrics = jax.device_get(metrics)   # replicated scalars: fine on any host
    dt = time.perf_counter() - t0
    run_s += dt
    done += n
    history.append(metrics)
    if verbose and jax.process_index() == 0:
      ret = metrics["episode_return_sum"].sum() / max(
          metrics["episodes"].sum(), 1)
      print(f"update {done:4d}/{num_updates}  env steps "
            f"{done * steps_per_update:>8,d}  return {ret:6.1f}  loss "
            f"{metrics['loss'][-1]:8.4f}  {n * steps_per_update / dt:,.0f} "
            "steps/s", flush=True)
  metrics = {k: np.concatenate([h[k] for h in history]) for k in history[0]}
  return {"metrics": metrics, "runner": runner, "mesh": mesh,
          "collectives": collective_counts(compiled[sizes[0]].as_text()),
          "compile_s": compile_s, "run_s": run_s,
          "wall_s": time.perf_counter() - t_start}


def parse_config(argv=None) -> Config:
  return ppo_core.parse_config(argv, Config, __doc__,
                               choices={"mode": ("local", "global")})


def main(argv=None) -> dict[str, Any]:
  config = parse_config(argv)
  if config.distributed:
    jax.distributed.initialize()   # coordinator etc. from the environment
  lead = jax.process_index() == 0
  if lead:
    print(f"data-parallel PPO on CartPole-v1: {config.devices} "
          f"{jax.devices()[0].platform} device(s) x {jax.process_count()} "
          f"process(es) in total; E = {config.num_envs} envs "
          f"({config.num_envs // max(config.devices, 1)} per device) x T = "
          f"{config.num_steps} steps, B = {config.batch_size} "
          f"({config.batch_size // max(config.devices, 1)} per device), "
          f"{config.mode} minibatching, {config.num_updates} updates")
  result = train(config)
  metrics = result["metrics"]
  returns = metrics["episode_return_sum"] / np.maximum(metrics["episodes"], 1)
  last = max(1, int(round(config.num_updates * 0.1)))
  final = float(metrics["episode_return_sum"][-last:].sum() /
                max(metrics["episodes"][-last:].sum(), 1))
  rollout_spec = result["runner"].rollout.data["obs"].sharding.spec
  summary = {
      "config": dataclasses.asdict(config),
      "devices": config.devices, "mode": config.mode,
      "updates": int(returns.size),
      "returns": returns.tolist(), "final_return": final,
      "finite_losses": bool(np.isfinite(metrics["loss"]).all()),
      "update_collectives": result["collectives"],
      "rollout_sharding": str(rollout_spec),
      "compile_s": result["compile_s"], "run_s": result["run_s"],
      "wall_s": result["wall_s"],
  }
  if lead:
    print(f"\nfinal return (last 10% of updates) {final:.1f}; compile "
          f"{result['compile_s']:.1f} s, run {result['run_s']:.1f} s")
    why = ("the gradient and metric all-reduces only: no env data moves"
           if config.mode == "local" else
           "all-gathers: the batch, once per update (global mode); "
           "all-reduces: gradients and metrics")
    print(f"collectives in one compiled chunk of updates: "
          f"{result['collectives'] or 'none'} ({why})")
    print(f"rollout storage layout: {rollout_spec}")
    os.makedirs(config.out, exist_ok=True)
    with open(os.path.join(config.out, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
  return summary


if __name__ == "__main__":
  main()
