"""MuJoCo Playground's own recipe vs examples/ppo_brax.py, side by side.

Playground trains with Brax's PPO trainer (``learning/train_jax_ppo.py``:
``brax.training.agents.ppo.train`` with ``wrapper.wrap_for_brax_training``
and the tuned ``dm_control_suite_params.brax_ppo_config``). That trainer
runs on jax 0.9.2, ppo_brax on the current JAX; each side runs in the
interpreter given for it (both need the ``playground`` extra), one seed per
fresh process, one process at a time, the same settings and env steps.
``--size cpu`` (the default) replaces the tuned batch, which does not fit 2
cores, by ``CPU``: 256 envs, 8 unrolls of 8 steps per update (T = 64 here),
8 minibatches of 2,048 steps, 4 epochs, a 5 x 64 value network (ppo_brax's
``--preset cpu``); ``--size tuned`` keeps Playground's. Per run: the final
eval return (the deterministic policy, 128 envs, 1,000 steps, as Brax
evaluates), training time without compile, compile time, env steps/s
(measured as ``brax_compare`` does). One JSON line per run goes to
``--out``/runs.jsonl; ``--report`` writes the table and chart
(``brax_compare.report``).

    python -m benchmarks.scripts.playground_compare \\
        --brax-python /work/venv-jax092/bin/python \\
        --jrollout-python .venv/bin/python --env CartpoleBalance \\
        --seeds 0 1 2 3 --out benchmarks/results/playground
    python -m benchmarks.scripts.playground_compare --report \\
        --env CartpoleBalance --out benchmarks/results/playground

Where the two algorithms differ (both sides keep theirs): ppo_brax's GAE
runs once per update over the whole T-step rollout with the values of
collection time (Brax: per unroll, recomputed every minibatch); a truncation
(every DM Control episode ends by one at 1,000 steps) bootstraps from the
value of the true final observation (Brax masks it out of the loss); each
episode restarts from a fresh reset (Playground's wrapper: from the env's
first state); ppo_brax shuffles single transitions (Brax: whole unrolls).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from benchmarks.scripts import brax_compare

# Brax-trainer settings that replace the tuned ones for 2 CPU cores: the
# same run as ppo_brax's --preset cpu (T = 8 unrolls x 8 steps).
CPU = dict(num_envs=256, batch_size=256, num_minibatches=8, unroll_length=8,
           num_updates_per_batch=4, num_timesteps=1_048_576, num_evals=2)
CPU_VALUE_SIZES = (64,) * 5


def settings(env: str, size: str, total_steps: int) -> dict:
  """The Brax trainer's keyword arguments for ``env`` (no network)."""
  from mujoco_playground.config import dm_control_suite_params  # noqa: PLC0415

  s = dict(dm_control_suite_params.brax_ppo_config(env))
  s.pop("network_factory", None)
  s["num_evals"] = 2   # one eval before training, one after
  if size == "cpu":
    s.update(CPU)
  if total_steps:
    s["num_timesteps"] = total_steps
  return s


def run_brax(args) -> dict:
  """Playground's recipe in this process (the ``--side brax`` child)."""
  import jax  # noqa: PLC0415 - the child imports JAX, the parent does not
  from brax.training.agents.ppo import networks  # noqa: PLC0415
  from brax.training.agents.ppo import train as ppo  # noqa: PLC0415
  from mujoco_playground import registry  # noqa: PLC0415
  from mujoco_playground import wrapper  # noqa: PLC0415

  events: list[tuple[float, float]] = []

  def listen(name, secs, **kwargs):
    del kwargs
    if name in brax_compare.COMPILE_EVENTS:
      events.append((time.perf_counter(), secs))

  jax.monitoring.register_event_duration_secs_listener(listen)
  s = settings(args.env, args.size, args.total_steps)
  factory = networks.make_ppo_networks
  if args.size == "cpu":
    factory = functools.partial(factory,
                                value_hidden_layer_sizes=CPU_VALUE_SIZES)
  progress: list[tuple[float, int, dict]] = []

  def progress_fn(step, metrics):
    progress.append((time.perf_counter(), int(step),
                     {k: float(v) for k, v in metrics.items()}))

  overrides = {"impl": args.impl}
  env = registry.load(args.env, config_overrides=overrides)
  eval_env = registry.load(args.env, config_overrides=overrides)
  t0 = time.perf_counter()
  ppo.train(environment=env, eval_env=eval_env, seed=args.seed,
            wrap_env_fn=wrapper.wrap_for_brax_training,
            network_factory=factory, progress_fn=progress_fn,
            num_eval_envs=128, deterministic_eval=True, **s)
  wall = time.perf_counter() - t0
  first_eval = progress[0][0]
  compile_s = sum(d for t, d in events if t > first_eval)
  last = progress[-1][2]
  train_s = last["training/walltime"] - compile_s
  steps = progress[-1][1]
  return {"side": "brax", "jax": jax.__version__, "env": args.env,
          "impl": args.impl, "size": args.size, "seed": args.seed,
          "eval_return": last["eval/episode_reward"],
          "env_steps": steps, "train_s": train_s, "compile_s": compile_s,
          "wall_s": wall, "env_steps_per_s": steps / train_s,
          "settings": s}


def ppo_brax_args(args, seed: int) -> list[str]:
  """ppo_brax's flags for the same run (``brax_compare.ppo_brax_args``)."""
  s = settings(args.env, args.size, args.total_steps)
  flags = brax_compare.ppo_brax_args(args.env, "positional", s, seed,
                                     args.total_steps or None)
  flags += ["--impl", args.impl]
  if args.size == "cpu":
    flags += ["--value-width", str(CPU_VALUE_SIZES[0]),
              "--value-layers", str(len(CPU_VALUE_SIZES))]
  return flags


def run_jrollout(args, python: str, seed: int, root: str) -> dict:
  """ppo_brax under ``python`` in a fresh process."""
  with tempfile.TemporaryDirectory() as out:
    cmd = [python, "-m", "examples.ppo_brax", "--out", out,
           *ppo_brax_args(args, seed)]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    if proc.returncode:
      raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "summary.json")) as f:
      summary = json.load(f)
  return {"side": "jrollout", "jax": summary["jax"], "env": args.env,
          "impl": args.impl, "size": args.size, "seed": seed,
          "eval_return": summary["eval_returns"][0],
          "training_return": summary["final_returns"][0],
          "env_steps": summary["env_steps_per_seed"],
          "train_s": summary["run_s"], "compile_s": summary["compile_s"],
          "wall_s": summary["wall_s"],
          "env_steps_per_s": summary["env_steps_per_s"],
          "params_sha256": summary["params_sha256"],
          "command": " ".join(cmd[1:3] + cmd[5:])}


def run_all(args) -> None:
  root = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  os.makedirs(args.out, exist_ok=True)
  jobs = []
  for seed in args.seeds:
    if args.brax_python:
      jobs.append(("brax", args.brax_python, seed))
    jobs += [("jrollout", py, seed) for py in args.jrollout_python]
  for side, python, seed in jobs:
    t0 = time.perf_counter()
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if side == "brax":
      with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [python, "-m", "benchmarks.scripts.playground_compare",
               "--side", "brax", "--env", args.env, "--impl", args.impl,
               "--size", args.size, "--seeds", str(seed), "--json", f.name,
               "--total-steps", str(args.total_steps)]
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
        if proc.returncode:
          raise RuntimeError(f"{' '.join(cmd)} failed:\n"
                             f"{proc.stderr[-3000:]}")
        with open(f.name) as g:
          record = json.load(g)
    else:
      record = run_jrollout(args, python, seed, root)
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    record.update(python=python, note=args.note, cores_busy=(
        cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime)
        / (time.perf_counter() - t0))
    print(f"{side:8s} jax {record['jax']:7s} seed {seed}: eval "
          f"{record['eval_return']:7.1f}  train {record['train_s']:6.1f} s  "
          f"compile {record['compile_s']:5.1f} s  "
          f"{record['env_steps_per_s']:9,.0f} steps/s", flush=True)
    with open(os.path.join(args.out, "runs.jsonl"), "a") as f:
      f.write(json.dumps(record) + "\n")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--env", default="CartpoleBalance")
  parser.add_argument("--impl", default="jax", choices=["jax", "warp"])
  parser.add_argument("--size", default="cpu", choices=["cpu", "tuned"])
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
  parser.add_argument("--total-steps", type=int, default=0,
                      help="instead of the settings' num_timesteps")
  parser.add_argument("--brax-python", default="",
                      help="interpreter for Playground's recipe ('': skip)")
  parser.add_argument("--jrollout-python", nargs="*", default=[],
                      help="interpreters for ppo_brax, one run each")
  parser.add_argument("--out", default="benchmarks/results/playground")
  parser.add_argument("--note", default="",
                      help="stored with each run; --report filters on it")
  parser.add_argument("--report", action="store_true")
  parser.add_argument("--side", choices=["brax"], help=argparse.SUPPRESS)
  parser.add_argument("--json", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.side == "brax":
    args.seed = args.seeds[0]
    with open(args.json, "w") as f:
      json.dump(run_brax(args), f)
  elif args.report:
    brax_compare.report(args)
  else:
    run_all(args)


if __name__ == "__main__":
  sys.exit(main())
