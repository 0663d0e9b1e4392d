"""Data-parallel PPO on gymnax CartPole-v1 across devices, built on jrollout.

One training run spread over D devices of a 1-D mesh with axis ``"envs"``:

- the E envs, their observations and the ``RolloutState`` storage are split
  over the devices (``jr.shard`` / ``jr.shard_rows``: device ``d`` steps and
  stores its own ``E / D`` envs); the network parameters and optimizer state
  are replicated. The rollout, GAE and ``jr.update_at`` / ``jr.update_all``
  run in one jitted function whose compiled code moves no env data between
  devices;
- the epochs run in ``jr.scan_minibatches(..., mesh=)``: in the default
  ``--mode local`` each device shuffles and minibatches its own rows (no data
  moves); ``--mode global`` uses the single-device order (the batch is
  all-gathered once per update). The update function runs on every device on
  its ``B / D`` rows and averages the gradients across devices by
  differentiating ``jax.lax.pmean(loss, "envs")`` (under ``shard_map``'s
  ``check_vma``, the gradient of a replicated parameter is already summed
  over devices, so pmean-ing the loss, not the gradients, gives the mean).
  Advantages are normalised per device, over its ``B / D`` rows.

The network, loss, env step, advantages and PPO hyperparameters are those
of ``examples/ppo_cartpole.py``; this file lays them out over the devices.
On a host with fewer devices than ``--devices`` (e.g. a CPU), XLA is asked
for that many host devices before JAX starts: they share the CPU cores, so
this shows the mechanics, not a speed-up. From the repository root:

    python -m examples.ppo_sharded                  # 8 devices, local mode
    python -m examples.ppo_sharded --devices 4 --mode global

Several processes (hosts): start the same command on every one with
``--distributed``; ``--devices`` is then the global device count D, and a
CPU process asks for ``D / P`` host devices. ``--coordinator HOST:PORT``
(process 0's address, a free port), ``--num-processes P`` and
``--process-id I`` say who is who; without them JAX detects the cluster
(SLURM, Open MPI, Kubernetes, Cloud TPU). Process 0 prints and writes
``--out``/summary.json (with the SHA-256 of the final parameters) and
params.npz; the others stay quiet (gloo itself prints one "[Gloo] Rank N is
connected" line per device). On two machines:

    python -m examples.ppo_sharded --distributed --coordinator 10.0.0.1:1234 \\
        --num-processes 2 --process-id 0       # on 10.0.0.1
    python -m examples.ppo_sharded --distributed --coordinator 10.0.0.1:1234 \\
        --num-processes 2 --process-id 1       # on the other machine

and P processes on one machine, with one command (``examples/launch_local``
adds those four flags):

    python -m examples.launch_local --num-processes 2 examples.ppo_sharded

With ``--checkpoint-dir DIR`` the whole run is saved to DIR every
``--checkpoint-every`` updates (every process writes its own shards; DIR
must be one directory that every process sees), and a rerun of the same
command resumes from the latest complete checkpoint and ends as an
uninterrupted run does, bit for bit.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
from typing import Any

DEFAULT_DEVICES = 8


def _request_host_devices(argv) -> None:
  """Asks XLA for ``--devices`` host devices; only works before JAX starts.

  Harmless on an accelerator host: the flag only shapes the CPU platform.
  With ``--distributed`` it does nothing: ``start_distributed`` asks for
  ``D / P`` devices per process instead.
  """
  if "jax" in sys.modules:
    return   # too late to change; the caller set the devices up (tests do)
  parser = argparse.ArgumentParser(add_help=False)
  parser.add_argument("--devices", type=int, default=DEFAULT_DEVICES)
  parser.add_argument("--distributed", action="store_true")
  known = parser.parse_known_args(argv)[0]
  if known.distributed:
    return
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={known.devices}"
    ).strip()


if __name__ == "__main__":
  _request_host_devices(sys.argv[1:])

# JAX may start only after _request_host_devices: the imports come here.
# Importing jax, flax, optax or orbax does not start XLA's backend; gymnax
# does (it builds arrays at import), so it is imported in make_train, after
# start_distributed.
import jax  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

import jrollout as jr  # noqa: E402
from examples.common import agent  # noqa: E402
from examples.common import checkpoints  # noqa: E402
from examples.common import cli  # noqa: E402
from examples.common import loss  # noqa: E402
from examples.common import reporting  # noqa: E402
from examples.common import training  # noqa: E402

AXIS = "envs"


@dataclasses.dataclass(frozen=True)
class Config(cli.Config):
  """Every field is a command-line flag. E and B (``batch_size``) are global:
  over all devices, each of which takes ``E / D`` envs and ``B / D`` rows.
  One training run: ``--seeds`` does not apply."""
  num_envs: int = 64             # E, split over the devices
  num_steps: int = 64
  total_steps: int = 64 * 64 * 40
  chunks: int = 5                # host round-trips for progress printing
  out: str = "runs/ppo_sharded"
  devices: int = DEFAULT_DEVICES  # D, over all processes
  mode: str = "local"            # minibatching: "local" or "global"
  distributed: bool = False      # join a multi-process run (the 3 below)
  coordinator: str = ""          # process 0's HOST:PORT ("": detect)
  num_processes: int = 0         # P (0: detect)
  process_id: int = -1           # this process, 0..P-1 (-1: detect)
  checkpoint_dir: str = ""       # save here, resume from here ("": off)
  checkpoint_every: int = 10     # updates between checkpoints (chunk ends)


def check_distributed_flags(config: Config) -> None:
  """ValueError for process flags that cannot work; runs before JAX starts."""
  given = [flag for flag, value in (
      ("--coordinator", config.coordinator),
      ("--num-processes", config.num_processes != 0),
      ("--process-id", config.process_id != -1)) if value]
  if given and not config.distributed:
    raise ValueError(f"{', '.join(given)} only apply with --distributed "
                     "(a multi-process run); add it, or drop them")
  if config.num_processes < 0:
    raise ValueError(f"--num-processes must be at least 1 (or 0: detect "
                     f"it), got {config.num_processes}")
  if config.process_id < -1 or (
      config.num_processes and config.process_id >= config.num_processes):
    raise ValueError(f"--process-id must be in 0..P-1 = 0.."
                     f"{max(config.num_processes, 1) - 1} (or -1: detect "
                     f"it), got {config.process_id}")
  if config.coordinator and not re.fullmatch(r".+:\d+", config.coordinator):
    raise ValueError(f"--coordinator must be HOST:PORT (process 0's address "
                     f"and a free port), got {config.coordinator!r}")
  if config.num_processes and config.devices % config.num_processes:
    raise ValueError(f"--devices {config.devices} (the global device count) "
                     f"is not a multiple of --num-processes "
                     f"{config.num_processes}")


def start_distributed(config: Config) -> None:
  """Joins the other processes; must run before anything starts XLA.

  Calls ``jax.distributed.initialize`` with the process flags (the ones
  left unset are detected by JAX), sets the CPU collectives to gloo and
  asks the CPU platform for ``D / P`` devices in this process.
  """
  check_distributed_flags(config)
  try:
    jax.distributed.initialize(
        coordinator_address=config.coordinator or None,
        num_processes=config.num_processes or None,
        process_id=None if config.process_id < 0 else config.process_id)
  except ValueError as e:   # what neither the flags nor a cluster gave
    raise ValueError(
        f"--distributed: {e} No cluster (SLURM, Open MPI, Kubernetes, Cloud "
        "TPU) was detected to give it: pass --coordinator HOST:PORT "
        "--num-processes P --process-id I") from e
  num_processes = config.num_processes
  if not num_processes:
    # Detected by initialize; JAX has no public way to read it before the
    # backend starts, and the backend's device count must be set before.
    from jax._src import distributed  # noqa: PLC0415 - private, see above
    num_processes = distributed.global_state.num_processes
  if config.devices % num_processes:
    raise ValueError(f"--devices {config.devices} (the global device count) "
                     f"is not a multiple of the {num_processes} processes")
  # Both only shape the CPU platform (harmless on an accelerator host) and
  # only take effect before the backend starts: that is now.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.config.update("jax_num_cpu_devices", config.devices // num_processes)


def make_mesh(config: Config) -> jax.sharding.Mesh:
  devices = jax.devices()
  if config.distributed and len(devices) != config.devices:
    raise ValueError(
        f"--devices {config.devices}: the {jax.process_count()} processes "
        f"have {len(devices)} {devices[0].platform} devices in all; with "
        "--distributed, --devices is the global device count")
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
  """``(init_fn, update_fn)``, both jittable, over the mesh's ``"envs"``.

  ``ppo_cartpole``'s runner, env step and advantages, with the envs, the
  rollout and the advantages laid out over the devices, and the epochs in
  ``jr.scan_minibatches(..., mesh=)``.
  """
  # Imports gymnax, which starts XLA: only after start_distributed.
  from examples import ppo_cartpole  # noqa: PLC0415
  import gymnax  # noqa: PLC0415
  env, env_params = gymnax.make("CartPole-v1")
  network = agent.ActorCritic(env.action_space(env_params).n, config.hidden)
  replicated = NamedSharding(mesh, P())

  def init_fn(key):
    runner = ppo_cartpole.init_runner(key, config, env, env_params, network)
    # Envs split over the devices; the learner's state replicated.
    env_state, obs, ep_return = jr.shard_rows(
        (runner.env_state, runner.obs, runner.ep_return), mesh)
    train_state = jax.lax.with_sharding_constraint(runner.train_state,
                                                   replicated)
    return ppo_cartpole.Runner(train_state, env_state, obs, ep_return,
                               jr.shard(runner.rollout, mesh, AXIS),
                               runner.key)

  env_step = ppo_cartpole.make_env_step(config, env, env_params, network)
  advantages = ppo_cartpole.make_advantages(config, network)
  # The mean over devices: its gradient is the averaged gradient.
  sgd_step = loss.make_sgd_step(config,
                                reduce=lambda out: jax.lax.pmean(out, AXIS))

  def update_fn(runner):
    runner, episodes = training.collect(env_step, runner, config.num_steps)
    adv, targets = advantages(runner)
    # GAE's [T, E] outputs laid out as the rollout (E over the devices).
    rollout = jr.update_all(runner.rollout, jr.shard_rows(
        {"advantage": adv, "target": targets}, mesh, dim=1))
    key, k_epochs = jax.random.split(runner.key)
    # Each device's sgd_step runs on its B / D rows.
    train_state, losses = jr.scan_minibatches(
        sgd_step, runner.train_state, k_epochs, rollout, config.batch_size,
        mesh=mesh, axis_name=AXIS, mode=config.mode,
        num_epochs=config.num_epochs)
    runner = runner._replace(train_state=train_state,
                             rollout=jr.finish_rollout(rollout), key=key)
    return runner, {**episodes, **loss.loss_metrics(losses)}

  return init_fn, update_fn


class ShardedCheckpoint(checkpoints.RunCheckpoint):
  """Saves the sharded run with orbax on every process and resumes it.

  ``checkpoints.RunCheckpoint`` (one ``jr.RolloutSave`` of the runner, the
  metrics history ``{name: [updates]}`` and the settings, per checkpoint
  numbered by the updates done; asynchronous saves; the last two kept) for
  one run whose arrays span several processes: every process calls ``save``
  and ``resume``, writes its own shards of the env state and rollout (the
  replicated parameters once) into the same directory, and restores them
  with the sharding of the fresh runner. Only process 0 prints. The
  process flags may change between runs (a new coordinator port, say);
  ``--devices`` and the rest may not.

  It resumes from the latest complete checkpoint only: a damaged one
  raises ``jr.CorruptCheckpointError`` instead of being moved aside, since
  every process would try to move the same directory.

  A save that fails on one process (a full disk) stops that process with
  ``checkpoints.CheckpointFailed`` at its next save; the others wait at
  orbax's commit barrier until it times out. The step is never renamed
  into place, so the rerun resumes from the last complete checkpoint.
  """

  IGNORED = ("out", "checkpoint_dir", "checkpoint_every", "distributed",
             "coordinator", "num_processes", "process_id", "compile_cache")
  KEEP = 2
  HISTORY_AXIS = 0   # metrics are [updates]
  CLEANUP_TMP = True

  def resume(self, runner):
    """``(runner, history, updates done)`` of the latest checkpoint."""
    step = self._mngr.latest_step()
    if step is None:
      return runner, [], 0
    got = self._restore(step, runner)
    self._say(f"resumed from {self._directory} at update {step}")
    self._last = step
    return got["runner"], [got["history"]], step

  def _say(self, message: str) -> None:
    if jax.process_index() == 0:
      print(message, flush=True)


def sync_processes(name: str, timeout_s: int = 3600) -> None:
  """Waits until every process gets here (no-op with one process).

  A barrier of the coordination service (through orbax), with no device
  work. Called before a collective runs for the first time: gloo gives a
  process 30 s to join its peers there, and compile times differ between
  processes by more than that on busy machines.
  """
  sync = ocp.multihost.get_barrier_sync_fn()
  sync(key=f"ppo_sharded/{name}", timeout_ms=timeout_s * 1000)


def collective_counts(compiled_text: str) -> dict[str, int]:
  """How many collectives of each kind a compiled HLO module contains."""
  found = re.findall(r"\b(all-gather|all-to-all|collective-permute|"
                     r"all-reduce|reduce-scatter)(?:-start)?\(", compiled_text)
  return {kind: found.count(kind) for kind in sorted(set(found))}


def save_params(path: str, params) -> None:
  """Writes the (replicated) parameters to an ``.npz``, one array per leaf,
  named by its path (``params/actor/layers_0/kernel``)."""
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  np.savez(path, **{
      jax.tree_util.keystr(where, simple=True, separator="/"):
      np.asarray(jax.device_get(leaf)) for where, leaf in leaves})


def chunk_sizes(config: Config) -> list[int]:
  """The updates of each jitted chunk: equal ones, then the remainder."""
  num_updates = config.num_updates
  if num_updates < 1:
    raise ValueError(f"--total-steps {config.total_steps} is less than one "
                     f"rollout ({config.num_envs * config.num_steps} steps)")
  size = max(1, num_updates // max(1, config.chunks))
  sizes = [size] * (num_updates // size)
  if num_updates % size:
    sizes.append(num_updates % size)
  return sizes


def train(config: Config, verbose: bool = True) -> dict[str, Any]:
  """Trains one run on the mesh; resumes it from ``--checkpoint-dir``.

  Returns:
    ``{"metrics": {name: [updates]}, "runner", "mesh", "collectives" (of
    one compiled chunk), "compile_s", "run_s", "wall_s", "resumed_at"}``
    (``resumed_at``: the updates restored from a checkpoint, 0 if none).
  """
  sizes = chunk_sizes(config)
  num_updates = config.num_updates
  mesh = make_mesh(config)
  init_fn, update_fn = make_train(config, mesh)
  lead = jax.process_index() == 0
  t0 = time.perf_counter()
  runner = jax.block_until_ready(
      jax.jit(init_fn)(jax.random.key(config.seed)))
  compiled, compile_s, run_s = {}, time.perf_counter() - t0, 0.0
  history: list[dict[str, np.ndarray]] = []
  sync_processes("initialised")   # orbax's first barrier is a collective
  checkpoint = ShardedCheckpoint(config) if config.checkpoint_dir else None
  done = 0
  if checkpoint is not None:
    runner, history, done = checkpoint.resume(runner)
  resumed_at = done
  bounds = np.cumsum([0] + sizes).tolist()
  if done not in bounds:
    raise ValueError(f"--checkpoint-dir: the checkpoint at update {done} "
                     f"is not at a chunk end ({bounds})")
  steps_per_update = config.num_envs * config.num_steps
  t_start = time.perf_counter()
  for n in sizes[bounds.index(done):]:
    if n not in compiled:
      t0 = time.perf_counter()
      chunk = jax.jit(lambda r, n=n: jax.lax.scan(
          lambda r, _: update_fn(r), r, None, length=n), donate_argnums=0)
      compiled[n] = chunk.lower(runner).compile()
      compile_s += time.perf_counter() - t0
      sync_processes(f"compiled_{n}")
    t0 = time.perf_counter()
    runner, metrics = compiled[n](runner)
    metrics = jax.device_get(metrics)   # replicated scalars: fine on any host
    dt = time.perf_counter() - t0
    run_s += dt
    done += n
    history.append(metrics)
    if checkpoint is not None:
      checkpoint.save(done, runner, history)
    if verbose and lead:
      ret = metrics["episode_return_sum"].sum() / max(
          metrics["episodes"].sum(), 1)
      print(f"update {done:4d}/{num_updates}  env steps "
            f"{done * steps_per_update:>8,d}  return {ret:6.1f}  loss "
            f"{metrics['loss'][-1]:8.4f}  {n * steps_per_update / dt:,.0f} "
            "steps/s", flush=True)
  if checkpoint is not None:
    checkpoint.close()
  metrics = {k: np.concatenate([h[k] for h in history]) for k in history[0]}
  if not compiled:   # resumed from the last update: nothing left to run
    compiled[sizes[0]] = jax.jit(
        lambda r: jax.lax.scan(lambda r, _: update_fn(r), r, None,
                               length=sizes[0])
    ).lower(runner).compile()
  return {"metrics": metrics, "runner": runner, "mesh": mesh,
          "collectives": collective_counts(compiled[sizes[0]].as_text()),
          "compile_s": compile_s, "run_s": run_s,
          "wall_s": time.perf_counter() - t_start, "resumed_at": resumed_at}


def parse_config(argv=None) -> Config:
  return cli.parse_config(argv, Config, __doc__,
                               choices={"mode": ("local", "global")})


def main(argv=None) -> dict[str, Any]:
  config = parse_config(argv)
  check_distributed_flags(config)
  cli.use_compile_cache(config)   # --compile-cache, before compiling
  if config.distributed:
    start_distributed(config)   # before anything starts XLA's backend
  lead = jax.process_index() == 0
  if lead:
    print(f"data-parallel PPO on CartPole-v1: {config.devices} "
          f"{jax.devices()[0].platform} device(s) over "
          f"{jax.process_count()} process(es); E = {config.num_envs} envs "
          f"({config.num_envs // max(config.devices, 1)} per device) x T = "
          f"{config.num_steps} steps, B = {config.batch_size} "
          f"({config.batch_size // max(config.devices, 1)} per device), "
          f"{config.mode} minibatching, {config.num_updates} updates",
          flush=True)
  result = train(config)
  metrics = result["metrics"]
  one_seed = {k: metrics[k][None] for k in ("episode_return_sum", "episodes")}
  returns = reporting.episode_returns(one_seed)[0]
  final = reporting.final_returns(one_seed)[0]
  rollout_spec = result["runner"].rollout.data["obs"].sharding.spec
  summary = {
      "config": dataclasses.asdict(config),
      "devices": config.devices, "mode": config.mode,
      "processes": jax.process_count(),
      "updates": int(returns.size),
      "returns": reporting.or_none(returns),
      "final_return": reporting.or_none(final)[0],   # None: no episode
      # replicated: every process holds all of it, and the same
      "params_sha256": reporting.params_sha256(
          result["runner"].train_state.params),
      "finite_losses": bool(np.isfinite(metrics["loss"]).all()),
      "update_collectives": result["collectives"],
      "rollout_sharding": str(rollout_spec),
      "resumed_at": result["resumed_at"],
      "compile_s": result["compile_s"], "run_s": result["run_s"],
      "wall_s": result["wall_s"],
  }
  if lead:
    print(f"\nfinal return (last 10% of updates) {reporting.show(final)}; "
          "compile "
          f"{result['compile_s']:.1f} s, run {result['run_s']:.1f} s; "
          f"params sha256 {summary['params_sha256'][:16]}...")
    why = ("the gradient and metric all-reduces only: no env data moves"
           if config.mode == "local" else
           "all-gathers: the batch, once per update (global mode); "
           "all-reduces: gradients and metrics")
    print(f"collectives in one compiled chunk of updates: "
          f"{result['collectives'] or 'none'} ({why})")
    print(f"rollout storage layout: {rollout_spec}")
    reporting.write_summary(config.out, summary)
    save_params(os.path.join(config.out, "params.npz"),
                result["runner"].train_state.params)
    print(f"summary and final parameters: {config.out}/summary.json, "
          "params.npz", flush=True)
  if config.distributed:
    jax.distributed.shutdown()   # waits for every process to get here
  return summary


if __name__ == "__main__":
  main()
