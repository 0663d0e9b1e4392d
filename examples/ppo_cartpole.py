"""PPO on gymnax CartPole-v1, built on jrollout: several seeds at once.

The whole training run is jitted and vmapped over seeds:
- each rollout is a ``lax.scan`` that writes every step into a jrollout
  ``RolloutState`` with ``jr.update_at`` (no scan outputs);
- ``jr.gae`` computes advantages from the ``[T, E]`` storage, telling
  terminations (no bootstrap) from time-limit truncations (bootstrap from the
  value of the true final observation);
- ``jr.scan_minibatches`` runs the epochs straight from the state (no
  flattened copy) and ``jr.finish_rollout`` checks that every step of
  every key was written exactly once and restarts the write tracking. The
  check is a ``checkify`` check: the host loop's ``checkify.checkify``
  returns it as an error value and raises on the host, with no callback in
  the program, so every call dispatches asynchronously.

Progress is printed from a host loop over jitted chunks of updates; at the
end a summary table and a learning curve (PNG) are written to ``--out``.
The agent (network, loss, env step, update) and the host loop are in
``examples/ppo_core.py``; this file puts them together for CartPole
(``make_train``) with the command line and the run checkpoint. From the
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
import os
from typing import Any

import gymnax
import jax
import numpy as np

from examples import ppo_core


@dataclasses.dataclass(frozen=True)
class Config(ppo_core.Config):
  """PPO on CartPole-v1; every field is a flag (see ``ppo_core.Config``)."""
  out: str = "runs/ppo_cartpole"
  checkpoint_dir: str = ""     # save here, resume from here ("": off)
  checkpoint_every: int = 100  # updates between checkpoints (at chunk ends)


# The run-level checkpoint and the parameters' hash live in ppo_core (which
# does not import gymnax, so examples/ppo_sharded.py can use them before
# jax.distributed starts); these names stay for this example's readers.
RunCheckpoint = ppo_core.RunCheckpoint
params_sha256 = ppo_core.params_sha256


def make_train(config: Config):
  """Returns ``(init_fn, update_fn)``; both are pure and vmappable.

  ``init_fn(key) -> ppo_core.Runner``; ``update_fn(runner) -> (runner,
  metrics)`` runs one PPO update (rollout, GAE, epochs:
  ``ppo_core.make_update``).
  """
  env, env_params = gymnax.make("CartPole-v1")
  network = ppo_core.ActorCritic(env.action_space(env_params).n,
                                 config.hidden)

  def init_fn(key):
    return ppo_core.init_runner(key, config, env, env_params, network)

  env_step = ppo_core.make_env_step(config, env, env_params, network)
  return init_fn, ppo_core.make_update(
      config, env_step, ppo_core.final_obs_bootstrap(network))


def train(config: Config, verbose: bool = True,
          make_train_fn=None) -> dict[str, Any]:
  """``ppo_core.train`` of this agent (or of ``make_train_fn``'s), saving
  and resuming with ``RunCheckpoint`` if ``config.checkpoint_dir`` is set."""
  checkpoint = RunCheckpoint(config) if config.checkpoint_dir else None
  return ppo_core.train(config, make_train_fn or make_train, verbose,
                        checkpoint=checkpoint)


def parse_config(argv=None) -> Config:
  return ppo_core.parse_config(argv, Config, __doc__)


def main(argv=None) -> dict[str, Any]:
  config = parse_config(argv)
  ppo_core.use_compile_cache(config)   # --compile-cache, before compiling
  print(f"PPO CartPole-v1 on jrollout: {config.seeds} seeds x "
        f"{config.num_updates} updates of {config.num_envs} envs x "
        f"{config.num_steps} steps ({jax.devices()[0].platform})")
  result = train(config)
  metrics = result["metrics"]
  final = ppo_core.final_returns(metrics)
  os.makedirs(config.out, exist_ok=True)
  steps_per_update = config.num_envs * config.num_steps
  png = os.path.join(config.out, "learning_curve.png")
  window = max(1, config.num_updates // 50)
  ppo_core.save_curve(
      {"PPO (jrollout)": ppo_core.episode_returns(metrics, window)},
      steps_per_update, png, "PPO on CartPole-v1")
  print("\nseed | final return (last 10% of updates) | episodes | final loss")
  for i in range(config.seeds):
    last = max(1, int(round(config.num_updates * 0.1)))
    episodes = int(metrics["episodes"][i, -last:].sum())
    print(f"{i:4d} | {final[i]:35.1f} | {episodes:8d}"
          f" | {metrics['loss'][i, -1]:10.4f}")
  total_steps = config.seeds * config.num_updates * steps_per_update
  print(f"\ncompile {result['compile_s']:.1f} s, run {result['run_s']:.1f} s "
        f"({total_steps / max(result['run_s'], 1e-9):,.0f} env steps/s over "
        "all seeds), "
        f"wall {result['wall_s']:.1f} s")
  print(f"learning curve: {png}")
  summary = {"config": dataclasses.asdict(config),
             "final_returns": final.tolist(),
             "params_sha256": params_sha256(
                 result["runner"].train_state.params),
             "compile_s": result["compile_s"], "run_s": result["run_s"],
             "wall_s": result["wall_s"],
             "finite_losses": bool(np.isfinite(metrics["loss"]).all())}
  ppo_core.write_summary(config.out, summary)
  return summary


if __name__ == "__main__":
  main()
