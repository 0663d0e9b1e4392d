"""PPO on a CartPole simulator written in plain torch, with a JAX learner.

The environment is not JAX: ``TorchCartPole`` steps E CartPole-v1 copies on
torch tensors from a Python loop (the usual shape of a GPU simulator). Each
step crosses the bridge twice:

- what the simulator returns (the next observations, rewards, flags, and
  the true final observations when an episode was truncated) goes into
  the jitted policy (the observations) and into a jrollout
  ``RolloutState`` through a ``jr.RolloutWriter``: each step is checked and
  queued at once, and every ``flush_every`` steps one jitted call writes
  the queued steps in place (the state is donated), so a step costs a
  fraction of a dispatch and no copy of the rollout;
- the policy's actions go back to torch through ``jrollout.torch.to_torch``.

After each rollout one jitted update function runs PPO in JAX: ``jr.gae``
(time-limit truncations bootstrap from the value of the true final
observation), ``jr.scan_minibatches`` straight from the ``[T, E]`` storage,
and ``jr.finish_rollout`` to check that every step was written exactly once.
The network, loss, policy and update are ``ppo_envpool.Learner``'s (the
learner of ``examples/ppo_envpool.py``, whose ``ppo_update`` makes those
calls), with same-step autoreset; this file is the simulator, the bridge
and the collection through the writer.

The simulator's torch ops and the JAX policy take turns on the same CPU
cores. Unless ``OMP_WAIT_POLICY`` is already set, the module calls
``jrollout.torch.share_cpu_with_torch()`` before it imports torch, so that
torch's OpenMP threads sleep between ops instead of spinning on the cores
the policy needs next (at 16,384 envs on 2 cores the defaults made a step
about 1.6-1.7x the sum of its parts; see ``docs/guides/torch.md``).

No torch tensor ever views a storage buffer of the rollout: the only tensors
exported from JAX are the actions, which are the policy's own outputs. A live
view of a storage buffer would make JAX skip the donation (jrollout warns),
and every flush would copy the rollout again.

``--bridge`` chooses how tensors enter JAX:

- ``numpy`` (CPU tensors only) imports nothing: the step's tensors are
  passed as numpy views (``t.numpy()``, no copy) to the jitted policy,
  which reads them during the call (waited for), and to the writer, which
  copies host values into its staging blocks when they are queued. No JAX
  dispatch and no import per step beyond the policy's own call. The
  observation acted on is queued after the next simulator step, so this
  relies, like ``view``, on the simulator returning new tensors at every
  step (a simulator that reuses its output tensors would need the step's
  observations queued before it steps again).
- ``view`` imports them with ``jrollout.torch.from_torch`` through DLPack
  without a copy: valid here because the writer holds queued JAX arrays
  until their flush and the simulator returns new tensors at every step and
  never writes one it has returned.
- ``copy`` imports them with ``from_torch(copy=True)``: one jitted copy of
  the whole step, about a quarter of the cost of the DLPack imports of its
  tensors at these sizes (``benchmarks/suites/hostloop.py``).
- ``auto`` (the default): ``numpy`` when the simulator runs on the CPU,
  ``view`` on a GPU, where a view costs nothing and a host copy does.

``--obs-groups tensordict`` (the ``tensordict`` extra) steps the simulator
as IsaacLab's rsl_rl wrapper does: observations come as a ``TensorDict`` of
groups (``policy``, ``critic``), episode ends as ``dones`` with the
truncations in ``extras["time_outs"]``. ``from_torch`` converts the
TensorDict to a dict of arrays without a copy, ``time_outs`` become the
rollout's truncations, and the run trains exactly as with plain tensors.

From the repository root:

    python -m examples.torch_simulator               # ~15 s on 2 CPU cores
    python -m examples.torch_simulator --num-envs 64 --num-steps 16 --updates 2
    python -m examples.torch_simulator --obs-groups tensordict
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jrollout as jr
from jrollout.torch import share_cpu_with_torch

# Before torch starts (OpenMP reads the setting once, when torch loads it):
# torch's threads sleep between ops instead of spinning on the cores the JAX
# policy needs next; a value already in the environment is kept. See
# docs/guides/torch.md, "JAX and torch on one CPU".
if "torch" not in sys.modules:
  share_cpu_with_torch()

import torch  # noqa: E402

from jrollout.torch import from_torch_copied  # noqa: E402
from jrollout.torch import to_torch_copied  # noqa: E402
from examples import ppo_envpool  # noqa: E402
from examples.common import cli  # noqa: E402
from examples.common import host_learner  # noqa: E402
from examples.common import reporting  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config(cli.Config):
  """Hyperparameters; every field is a command-line flag.

  One seed for ``updates`` updates: ``--total-steps``, ``--seeds``,
  ``--chunks`` and ``--mask-velocity`` do not apply.
  """
  num_envs: int = 1024
  num_steps: int = 32
  num_minibatches: int = 8
  lr: float = 1e-3
  out: str = "runs/torch_simulator"
  updates: int = 24
  flush_every: int = 16         # RolloutWriter: steps written per dispatch
  bridge: str = "auto"          # "numpy", "view", "copy" or "auto"
  obs_groups: str = "plain"     # "plain" tensors, or "tensordict" groups

  @property
  def num_updates(self) -> int:
    return self.updates


# --- the torch simulator ---------------------------------------------------


class TorchCartPole:
  """E CartPole-v1 environments on torch tensors, with auto-reset.

  The physics of gymnasium's ``CartPoleEnv`` (Euler integration): gravity
  9.8, cart mass 1.0, pole mass 0.1, half pole length 0.5, force 10, tau
  0.02. An episode terminates when ``|x| > 2.4`` or ``|theta| > 12 deg`` and
  is truncated after 500 steps; the reward is 1 for every step. Finished
  environments restart from ``uniform(-0.05, 0.05)`` states.

  ``step`` never writes a tensor it has returned: each call returns new
  tensors, so JAX arrays imported from them (zero-copy) stay valid.
  """

  gravity = 9.8
  masscart = 1.0
  masspole = 0.1
  length = 0.5            # half the pole's length
  force_mag = 10.0
  tau = 0.02
  x_threshold = 2.4
  theta_threshold = 12 * 2 * math.pi / 360
  max_steps = 500

  def __init__(self, num_envs: int, seed: int = 0, device: str = "cpu"):
    self.num_envs = num_envs
    self.device = torch.device(device)
    self.generator = torch.Generator(self.device).manual_seed(seed)
    self.total_mass = self.masspole + self.masscart
    self.polemass_length = self.masspole * self.length
    self.state = self._initial(num_envs)                     # [E, 4]
    self.elapsed = torch.zeros(num_envs, dtype=torch.int32,
                               device=self.device)          # [E]

  def _initial(self, n: int) -> torch.Tensor:
    u = torch.rand((n, 4), generator=self.generator, device=self.device)
    return u * 0.1 - 0.05

  def reset(self) -> torch.Tensor:
    """Restarts every environment; returns the observations ``[E, 4]``."""
    self.state = self._initial(self.num_envs)
    self.elapsed = torch.zeros_like(self.elapsed)
    return self.state

  def step(self, action: torch.Tensor):
    """Advances every env by one step.

    Args:
      action: ``[E]`` integer tensor, 1 pushes right and 0 pushes left.

    Returns:
      ``(obs, reward, terminated, truncated, final_obs)``: ``obs [E, 4]`` is
      the next observation (of a fresh episode where one ended),
      ``final_obs [E, 4]`` the observation reached before any reset,
      ``reward [E] float32``, ``terminated, truncated [E] bool`` (truncated
      only where not terminated).
    """
    x, x_dot, theta, theta_dot = self.state.unbind(1)
    force = torch.where(action == 1, self.force_mag, -self.force_mag)
    costheta, sintheta = torch.cos(theta), torch.sin(theta)
    temp = (force + self.polemass_length * theta_dot**2 * sintheta
            ) / self.total_mass
    thetaacc = (self.gravity * sintheta - costheta * temp) / (
        self.length * (4.0 / 3.0 - self.masspole * costheta**2
                       / self.total_mass))
    xacc = temp - self.polemass_length * thetaacc * costheta / self.total_mass
    x = x + self.tau * x_dot
    x_dot = x_dot + self.tau * xacc
    theta = theta + self.tau * theta_dot
    theta_dot = theta_dot + self.tau * thetaacc
    final_obs = torch.stack([x, x_dot, theta, theta_dot], 1)
    self.elapsed = self.elapsed + 1
    terminated = ((x < -self.x_threshold) | (x > self.x_threshold)
                  | (theta < -self.theta_threshold)
                  | (theta > self.theta_threshold))
    truncated = (self.elapsed >= self.max_steps) & ~terminated
    done = terminated | truncated
    self.state = torch.where(done[:, None], self._initial(self.num_envs),
                             final_obs)
    self.elapsed = torch.where(done, 0, self.elapsed)
    reward = torch.ones(self.num_envs, dtype=torch.float32,
                        device=self.device)
    return self.state, reward, terminated, truncated, final_obs


def rsl_rl_step(sim: TorchCartPole, action: torch.Tensor):
  """One step as IsaacLab's rsl_rl wrapper hands it over: ``(obs, rewards,
  dones, extras)``, where ``obs`` is a ``TensorDict`` of observation groups
  (``{"policy": [E, 4], "critic": [E, 4]}``; CartPole has no privileged
  state, so the critic group repeats the policy's), ``dones [E]`` is
  terminated or truncated and ``extras["time_outs"] [E]`` the truncations,
  with ``extras["final_obs"]`` the observations before the reset (a key
  rsl_rl does not have, for the exact time-limit bootstrap)."""
  import tensordict  # noqa: PLC0415  (the tensordict extra: --obs-groups)
  obs, reward, terminated, truncated, final_obs = sim.step(action)
  groups = tensordict.TensorDict({"policy": obs, "critic": obs},
                                 batch_size=[sim.num_envs])
  return groups, reward, terminated | truncated, {"time_outs": truncated,
                                                  "final_obs": final_obs}


def from_rsl_rl(groups, reward, dones, extras):
  """``(next_obs, reward, terminated, truncated, final_obs)`` from an
  rsl_rl-style step, still in torch: the groups stay one TensorDict for
  ``from_torch``, and ``time_outs`` become the truncations (a time-out is
  not a termination: its value is bootstrapped)."""
  time_outs = extras["time_outs"]
  return groups, reward, dones & ~time_outs, time_outs, extras["final_obs"]


# --- training ----------------------------------------------------------------

PARTS = ("sim", "from_torch", "to_torch", "policy", "buffer")


def step_tree(next_obs, reward, terminated, truncated, final_obs=None):
  """What one step brings into JAX, in one ``from_torch`` call: the
  simulator's outputs, with ``final_obs`` only when an episode was truncated
  (two tree structures, each with its own jitted copy)."""
  step = {"next_obs": next_obs, "reward": reward, "terminated": terminated,
          "truncated": truncated}
  if final_obs is not None:
    step["final_obs"] = final_obs
  return step


def collect(sim, obs_j, rollout, params, key,
            learner: host_learner.HostLearner, ep_return, timings, mode,
            groups=False):
  """Runs one rollout of T steps from the host; returns the new carry.

  ``obs_j`` (``[E, 4]``) is the observation the first step acts on: a JAX
  array, or with ``mode="numpy"`` a numpy view of the simulator's tensor.
  Each step brings in what the simulator returns, the next observation
  included: as numpy views (``mode="numpy"``), or in one
  ``from_torch(..., copy=mode == "copy")`` call. ``learner``'s jitted
  policy acts; the steps go into ``rollout`` through a ``jr.RolloutWriter``
  that writes ``config.flush_every`` queued steps per jitted call. Every
  JAX call, and every flush, is followed by ``block_until_ready`` so that
  ``timings`` (seconds per part, summed) charge each part with its own
  work: ``from_torch`` is the import (or the numpy views), ``policy``
  includes moving numpy observations into the policy call, ``buffer`` is
  the writer's checks and queueing (with its staging copies of numpy
  values) at every step plus its flushes. With ``groups``, the simulator is
  stepped as rsl_rl's wrapper steps it (``rsl_rl_step``) and its
  TensorDict of observation groups goes through ``from_torch``.
  """
  num_steps = rollout.num_steps
  writer = jr.RolloutWriter(rollout, flush_every=learner.config.flush_every)
  before = None         # the state the next flush consumes
  keys = list(jax.random.split(key, num_steps))
  done_sum = torch.zeros((), dtype=torch.float64)
  done_count = torch.zeros((), dtype=torch.int64)
  truncations = 0
  copies = 0            # leaves copied without copy=True (expected: none)
  donated = True
  for t in range(num_steps):
    t1 = time.perf_counter()
    action, logp, value, _ = jax.block_until_ready(
        learner.act(params, obs_j, keys[t]))
    t2 = time.perf_counter()
    action_t, copied = to_torch_copied(action)  # views `action`
    copies += copied                                         # not the rollout
    t3 = time.perf_counter()
    if groups:
      next_obs, reward, terminated, truncated, final_obs = from_rsl_rl(
          *rsl_rl_step(sim, action_t))
    else:
      next_obs, reward, terminated, truncated, final_obs = sim.step(action_t)
    del action_t
    ep_return = ep_return + reward
    done = terminated | truncated
    done_sum = done_sum + torch.where(done, ep_return, 0.0).sum()
    done_count = done_count + done.sum()
    ep_return = torch.where(done, 0.0, ep_return)
    num_truncated = int(truncated.sum())
    any_truncated = num_truncated > 0
    truncations += num_truncated
    t4 = time.perf_counter()
    step = step_tree(next_obs, reward, terminated, truncated,
                     final_obs if any_truncated else None)
    env_j, copied = to_jax(step, mode)
    copies += copied
    if groups:   # the policy group is what the policy and the rollout see
      env_j["next_obs"] = env_j["next_obs"]["policy"]
    t5 = time.perf_counter()
    # Only truncated steps read final_value (gae ignores it elsewhere).
    final_value = learner.zero_value
    if any_truncated:
      final_value = jax.block_until_ready(
          learner.value_fn(params, env_j["final_obs"]))
    t6 = time.perf_counter()
    if not writer.pending:
      before = writer.state
    writer.update_at(t, {
        "obs": obs_j, "action": action, "logp": logp, "value": value,
        "final_value": final_value, "reward": env_j["reward"],
        "terminated": env_j["terminated"], "truncated": env_j["truncated"]})
    if not writer.pending:   # this call flushed: wait for the write
      donated &= before.data["obs"].is_deleted()
      jax.block_until_ready(writer.state)
    t7 = time.perf_counter()
    obs_j = env_j["next_obs"]
    timings["from_torch"] += t5 - t4
    timings["policy"] += (t2 - t1) + (t6 - t5)
    timings["to_torch"] += t3 - t2
    timings["sim"] += t4 - t3
    timings["buffer"] += t7 - t6
  t0 = time.perf_counter()
  flushes = writer.pending > 0
  rollout = jax.block_until_ready(writer.state)   # writes the last steps
  if flushes:
    donated &= before.data["obs"].is_deleted()
  timings["buffer"] += time.perf_counter() - t0
  stats = {"return_sum": float(done_sum), "episodes": int(done_count),
           "truncations": truncations, "bridge_copies": copies,
           "donated": donated}
  return obs_j, rollout, ep_return, stats


def bridge_mode(config: Config, sim: TorchCartPole) -> str:
  """``"numpy"``, ``"view"`` or ``"copy"`` for ``config.bridge`` (see the
  module docstring)."""
  if config.obs_groups == "tensordict":
    if config.bridge == "numpy":
      raise ValueError("--obs-groups tensordict imports the groups with "
                       "from_torch: use --bridge view, copy or auto")
    return "view" if config.bridge == "auto" else config.bridge
  if config.bridge == "auto":
    return "numpy" if sim.device.type == "cpu" else "view"
  if config.bridge == "numpy" and sim.device.type != "cpu":
    raise ValueError(f"--bridge numpy needs a CPU simulator, got device "
                     f"{sim.device}; use --bridge view or copy")
  return config.bridge


def to_jax(tree, mode: str):
  """``(tree, copies)``: simulator tensors as ``collect`` passes them on (see
  ``bridge_mode``), and how many leaves ``view`` copied (expected: none).
  ``numpy`` gives views, which the writer copies when it queues them."""
  if mode == "numpy":
    return jax.tree_util.tree_map(lambda t: t.numpy(), tree), 0
  out, copied = from_torch_copied(tree, copy=mode == "copy")
  unrequested = (sum(jax.tree_util.tree_leaves(copied)) if mode == "view"
                 else 0)
  return out, unrequested


def train(config: Config, verbose: bool = True) -> dict[str, Any]:
  """Trains one seed; returns per-update metrics and the step timings."""
  if config.num_envs * config.num_steps % config.num_minibatches:
    raise ValueError(f"--num-minibatches {config.num_minibatches} must divide "
                     f"num_envs * num_steps = "
                     f"{config.num_envs * config.num_steps}")
  # Arrays imported from torch are committed to their device, so the jitted
  # outputs are too: the learner commits its initial state as well.
  learner = ppo_envpool.Learner(config, autoreset="same_step",
                                device=jax.devices()[0])
  key = jax.random.key(config.seed)
  key, k_net = jax.random.split(key)
  train_state, rollout = learner.init(k_net)   # same-step autoreset
  sim = TorchCartPole(config.num_envs, seed=config.seed)
  mode = bridge_mode(config, sim)
  obs_j, _ = to_jax(sim.reset(), mode)
  ep_return = torch.zeros(config.num_envs)

  # Compile the per-step functions first (on copies), so that the timings
  # below are steady-state costs.
  t0 = time.perf_counter()
  params = train_state.params
  a, lp, v, _ = jax.block_until_ready(learner.act(params, obs_j, key))
  jax.block_until_ready(learner.value_fn(params, obs_j))
  # The bridge's copy is jitted per tree structure: a step with and without
  # final observations.
  e = config.num_envs
  flags = torch.zeros(e, dtype=torch.bool)
  groups = config.obs_groups == "tensordict"
  for final_obs in (None, torch.zeros(e, 4)):
    obs0 = torch.zeros(e, 4)
    if groups:
      import tensordict  # noqa: PLC0415  (the tensordict extra)
      obs0 = tensordict.TensorDict({"policy": obs0, "critic": obs0},
                                   batch_size=[e])
    step, _ = to_jax(step_tree(obs0, torch.zeros(e), flags, flags,
                               final_obs), mode)
  # A writer on a copy compiles every flush a rollout makes (its values of
  # the kinds collect passes: numpy values are staged, JAX ones held).
  warm = jr.RolloutWriter(jax.tree_util.tree_map(jnp.copy, rollout),
                          flush_every=config.flush_every)
  for t in range(config.num_steps):
    warm.update_at(t, {
        "obs": obs_j, "action": a, "logp": lp, "value": v,
        "final_value": learner.zero_value, "reward": step["reward"],
        "terminated": step["terminated"], "truncated": step["truncated"]})
  jax.block_until_ready(warm.state)
  list(jax.random.split(jax.random.split(key, 3)[1], config.num_steps))
  del warm, a, lp, v
  compile_s = time.perf_counter() - t0

  timings = dict.fromkeys(PARTS, 0.0)
  history: list[dict[str, float]] = []
  donated = True
  bridge_copies = 0
  rollout_s = update_s = 0.0
  t_start = time.perf_counter()
  for i in range(config.updates):
    key, k_roll, k_upd = jax.random.split(key, 3)
    t0 = time.perf_counter()
    obs_j, rollout, ep_return, stats = collect(
        sim, obs_j, rollout, train_state.params, k_roll, learner, ep_return,
        timings, mode, groups)
    t1 = time.perf_counter()
    err, (train_state, rollout, metrics) = learner.update(
        train_state, rollout, obs_j, None, k_upd)
    err.throw()   # the write check
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    t2 = time.perf_counter()
    if i == 0:
      compile_s += t2 - t1   # the first update includes its compilation
    else:
      update_s += t2 - t1
    rollout_s += t1 - t0
    donated &= stats["donated"]
    bridge_copies += stats["bridge_copies"]
    ret = (stats["return_sum"] / stats["episodes"] if stats["episodes"]
           else None)   # no episode ended: no return, not 0
    history.append({"update": i + 1, "return": ret,
                    "episodes": stats["episodes"],
                    "truncations": stats["truncations"], **metrics})
    if verbose:
      print(f"update {i + 1:3d}/{config.updates}  return "
            f"{reporting.show(ret):>6} "
            f"({stats['episodes']:5d} episodes)  loss {metrics['loss']:7.4f}  "
            f"entropy {metrics['entropy']:.3f}  rollout {t1 - t0:5.2f} s  "
            f"update {t2 - t1:5.2f} s", flush=True)
  wall_s = time.perf_counter() - t_start
  num_steps = config.updates * config.num_steps
  per_step_ms = {k: 1e3 * v / num_steps for k, v in timings.items()}
  per_step_ms["bridge"] = per_step_ms["from_torch"] + per_step_ms["to_torch"]
  per_step_ms["total"] = sum(per_step_ms[k] for k in PARTS)
  return {"history": history, "per_step_ms": per_step_ms,
          "compile_s": compile_s, "rollout_s": rollout_s,
          "update_s": update_s, "wall_s": wall_s, "donated": donated,
          "bridge_copies": bridge_copies}


def parse_config(argv=None) -> Config:
  return cli.parse_config(argv, Config, __doc__,
                               choices={"bridge": ("auto", "numpy", "view",
                                                   "copy"),
                                        "obs_groups": ("plain",
                                                       "tensordict")})


def main(argv=None) -> dict[str, Any]:
  config = parse_config(argv)
  cli.use_compile_cache(config)   # --compile-cache, before compiling
  wait_policy = os.environ.get("OMP_WAIT_POLICY", "not set")
  print(f"PPO on a torch CartPole-v1 simulator: {config.updates} updates of "
        f"{config.num_envs} envs x {config.num_steps} steps (torch "
        f"{torch.__version__}, jax {jax.__version__} on "
        f"{jax.devices()[0].platform}; OMP_WAIT_POLICY {wait_policy})")
  result = train(config)
  history = result["history"]
  returns = [h["return"] for h in history]
  ms = result["per_step_ms"]
  env_steps = config.updates * config.num_steps * config.num_envs
  print(f"\nmean episodic return: first update {reporting.show(returns[0])}"
        f", last update {reporting.show(returns[-1])}")
  print(f"per env step of all {config.num_envs} envs ({ms['total']:.3f} ms):"
        f" torch sim {ms['sim']:.3f} ms | bridge {ms['bridge']:.3f} ms "
        f"(from_torch {ms['from_torch']:.3f} + to_torch {ms['to_torch']:.3f})"
        f" | JAX policy {ms['policy']:.3f} ms | buffer write "
        f"{ms['buffer']:.3f} ms")
  print(f"bridge share of a step: {100 * ms['bridge'] / ms['total']:.1f}% "
        f"(--bridge {config.bridge}; {result['bridge_copies']} leaves copied "
        "without copy=True); every RolloutWriter "
        f"flush ({config.flush_every} steps) donated the rollout: "
        f"{result['donated']}; time-limit truncations: "
        f"{sum(h['truncations'] for h in history)}")
  print(f"compile {result['compile_s']:.1f} s, rollouts "
        f"{result['rollout_s']:.1f} s ({env_steps / result['rollout_s']:,.0f} "
        f"env steps/s), PPO updates {result['update_s']:.1f} s, wall "
        f"{result['wall_s']:.1f} s")
  summary = {
      "config": dataclasses.asdict(config),
      "returns": returns,
      "history": history,
      "initial_return": returns[0],
      "final_return": returns[-1],
      "per_step_ms": ms,
      "donated": result["donated"],
      "bridge_copies": result["bridge_copies"],
      "finite_losses": bool(np.isfinite([h["loss"] for h in history]).all()),
      "compile_s": result["compile_s"], "rollout_s": result["rollout_s"],
      "update_s": result["update_s"], "wall_s": result["wall_s"],
  }
  print(f"summary: {reporting.write_summary(config.out, summary)}")
  return summary


if __name__ == "__main__":
  main()
