"""Brax's PPO trainer vs examples/ppo_brax.py, same settings, side by side.

Brax's trainer (``brax.training.agents.ppo.train``) runs in the newest JAX it
supports (0.9.2: on 0.10.2 it fails at start), ppo_brax in that JAX and the
current one; each side runs in the interpreter given for it, one seed per
fresh process, one process at a time. Both get Brax's published settings
for the env (``SETTINGS``), the same networks (policy 4 x 32, value 5 x 256,
swish) and the same env steps. Per run: the final eval return (the
deterministic policy, 128 envs, 1,000 steps, the return of each env's first
episode, as Brax's evaluator), training time without compile, compile time,
env steps/s. One JSON line per run goes to ``--out``/runs.jsonl;
``--report`` writes the table (markdown) and the chart.

    python -m benchmarks.scripts.brax_compare \\
        --brax-python /work/venv-jax092/bin/python \\
        --jrollout-python .venv/bin/python /work/venv-jax092/bin/python \\
        --env inverted_pendulum --seeds 0 1 2 3 --out benchmarks/results/brax
    python -m benchmarks.scripts.brax_compare --report \\
        --out benchmarks/results/brax

Brax's compile time is the JAX compile events (tracing, lowering, XLA
compile: ``jax.monitoring``) during its training epochs; its training time
is its ``training/walltime`` (the epochs, evaluations excluded) less that.
ppo_brax's are its ``compile_s`` (lowering and compiling its jitted chunk)
and ``run_s``. Neither side uses a persistent compilation cache here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time

# Brax's published settings: inverted_pendulum's as issue 41 quotes them
# (Brax's training notebook); hopper's as we recall the same notebook (it is
# not shipped with Brax, so not checked here). num_evals=2: one eval before
# training, one after (the evals are not counted in training time).
SETTINGS = {
    "inverted_pendulum": dict(
        num_timesteps=2_000_000, num_evals=2, reward_scaling=10,
        episode_length=1000, normalize_observations=True, action_repeat=1,
        unroll_length=5, num_minibatches=32, num_updates_per_batch=4,
        discounting=0.97, learning_rate=3e-4, entropy_cost=1e-2,
        num_envs=2048, batch_size=1024),
    "hopper": dict(
        num_timesteps=6_553_600, num_evals=2, reward_scaling=10,
        episode_length=1000, normalize_observations=True, action_repeat=1,
        unroll_length=20, num_minibatches=32, num_updates_per_batch=8,
        discounting=0.997, learning_rate=3e-4, entropy_cost=1e-3,
        num_envs=2048, batch_size=512),
}
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


def brax_steps(s: dict) -> tuple[int, int]:
  """``(env steps per training step, training steps)`` Brax's trainer
  runs for ``s`` (its own rounding of ``num_timesteps``)."""
  per_step = s["batch_size"] * s["unroll_length"] * s["num_minibatches"]
  evals = max(s["num_evals"] - 1, 1)
  n = -(-s["num_timesteps"] // (evals * per_step))
  return per_step, n * evals


def ppo_brax_args(env: str, backend: str, s: dict, seed: int,
                  total_steps: int | None) -> list[str]:
  """ppo_brax's flags for Brax's settings ``s``: one rollout of
  ``T = batch_size * num_minibatches / num_envs * unroll_length`` steps
  per update (Brax's env steps per training step), as many updates."""
  per_step, n = brax_steps(s)
  T = per_step // s["num_envs"]
  return ["--env", env, "--backend", backend,
          "--num-envs", str(s["num_envs"]), "--num-steps", str(T),
          "--total-steps", str(total_steps or per_step * n),
          "--num-minibatches", str(s["num_minibatches"]),
          "--num-epochs", str(s["num_updates_per_batch"]),
          "--gamma", str(s["discounting"]), "--lr", str(s["learning_rate"]),
          "--ent-coef", str(s["entropy_cost"]),
          "--reward-scaling", str(s["reward_scaling"]),
          "--episode-length", str(s["episode_length"]),
          "--chunks", str(n), "--seeds", "1", "--seed", str(seed),
          "--no-compile-cache"]


def run_brax(args) -> dict:
  """Brax's trainer in this process (the ``--side brax`` child)."""
  import jax  # noqa: PLC0415 - the child imports JAX, the parent does not
  from brax import envs  # noqa: PLC0415
  from brax.training.agents.ppo import train as ppo  # noqa: PLC0415

  events: list[tuple[float, float]] = []

  def listen(name, secs, **kwargs):
    del kwargs
    if name in COMPILE_EVENTS:
      events.append((time.perf_counter(), secs))

  jax.monitoring.register_event_duration_secs_listener(listen)
  s = dict(SETTINGS[args.env])
  if args.total_steps:
    s["num_timesteps"] = args.total_steps
  progress: list[tuple[float, int, dict]] = []

  def progress_fn(step, metrics):
    progress.append((time.perf_counter(), int(step),
                     {k: float(v) for k, v in metrics.items()}))

  env = envs.get_environment(args.env, backend=args.backend)
  t0 = time.perf_counter()
  ppo.train(environment=env, seed=args.seed, progress_fn=progress_fn,
            num_eval_envs=128, deterministic_eval=True, **s)
  wall = time.perf_counter() - t0
  first_eval = progress[0][0]
  compile_s = sum(d for t, d in events if t > first_eval)
  last = progress[-1][2]
  train_s = last["training/walltime"] - compile_s
  steps = progress[-1][1]
  return {"side": "brax", "jax": jax.__version__, "env": args.env,
          "backend": args.backend, "seed": args.seed,
          "eval_return": last["eval/episode_reward"],
          "eval_returns_over_training": [p[2]["eval/episode_reward"]
                                         for p in progress],
          "env_steps": steps, "train_s": train_s, "compile_s": compile_s,
          "to_first_eval_s": first_eval - t0, "wall_s": wall,
          "env_steps_per_s": steps / train_s, "settings": s}


def run_jrollout(python: str, env: str, backend: str, seed: int,
                 total_steps: int | None, root: str) -> dict:
  """ppo_brax under ``python`` in a fresh process."""
  with tempfile.TemporaryDirectory() as out:
    cmd = [python, "-m", "examples.ppo_brax", "--out", out,
           *ppo_brax_args(env, backend, SETTINGS[env], seed, total_steps)]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    if proc.returncode:
      raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "summary.json")) as f:
      summary = json.load(f)
  return {"side": "jrollout", "jax": summary["jax"], "env": env,
          "backend": backend, "seed": seed,
          "eval_return": summary["eval_returns"][0],
          "training_return": summary["final_returns"][0],
          "env_steps": summary["env_steps_per_seed"],
          "train_s": summary["run_s"], "compile_s": summary["compile_s"],
          "init_s": summary["init_s"], "wall_s": summary["wall_s"],
          "env_steps_per_s": summary["env_steps_per_s"],
          "params_sha256": summary["params_sha256"],
          "command": " ".join(cmd[1:3] + cmd[5:])}


def run_all(args) -> None:
  root = os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "runs.jsonl")
  jobs = []
  for seed in args.seeds:
    if args.brax_python:
      jobs.append(("brax", args.brax_python, seed))
    for py in args.jrollout_python:
      jobs.append(("jrollout", py, seed))
  for side, python, seed in jobs:
    t0 = time.perf_counter()
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if side == "brax":
      with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [python, "-m", "benchmarks.scripts.brax_compare", "--side",
               "brax", "--env", args.env, "--backend", args.backend,
               "--seeds", str(seed), "--json", f.name]
        if args.total_steps:
          cmd += ["--total-steps", str(args.total_steps)]
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
        if proc.returncode:
          raise RuntimeError(f"{' '.join(cmd)} failed:\n"
                             f"{proc.stderr[-3000:]}")
        with open(f.name) as g:
          record = json.load(g)
    else:
      record = run_jrollout(python, args.env, args.backend, seed,
                            args.total_steps, root)
    record["python"] = python
    record["note"] = args.note
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU time over the whole process (compile and evals included): how
    # many of the machine's cores it kept busy.
    record["cores_busy"] = ((cpu1.ru_utime - cpu0.ru_utime
                             + cpu1.ru_stime - cpu0.ru_stime)
                            / (time.perf_counter() - t0))
    print(f"{record['side']:8s} jax {record['jax']:7s} seed {seed}: eval "
          f"{record['eval_return']:7.1f}  train {record['train_s']:6.1f} s  "
          f"compile {record['compile_s']:5.1f} s  "
          f"{record['env_steps_per_s']:9,.0f} steps/s  "
          f"({time.perf_counter() - t0:.0f} s, "
          f"{record['cores_busy']:.2f} cores busy)", flush=True)
    with open(path, "a") as f:
      f.write(json.dumps(record) + "\n")


def report(args) -> None:
  """The per-run table and the mean/spread per side, as markdown; a chart
  of eval return and training time per side."""
  import numpy as np  # noqa: PLC0415 - report only

  with open(os.path.join(args.out, "runs.jsonl")) as f:
    runs = [json.loads(line) for line in f if line.strip()]
  runs = [r for r in runs if r["env"] == args.env
          and (not args.note or r.get("note") == args.note)]
  brax = {r["seed"]: r for r in runs if r["side"] == "brax"}

  def ratios(r: dict) -> tuple[float, float]:
    """``r``'s training and compile time over Brax's, same seed."""
    b = brax.get(r["seed"])
    if b is None:
      return math.nan, math.nan
    return r["train_s"] / b["train_s"], r["compile_s"] / b["compile_s"]

  lines = ["| side | JAX | seed | eval return | training s (no compile) "
           "| compile s | env steps/s | training / Brax's | compile / "
           "Brax's |", "|---|---|---|---|---|---|---|---|---|"]
  groups: dict[tuple[str, str], list[dict]] = {}
  for r in runs:
    groups.setdefault((r["side"], r["jax"]), []).append(r)
    train_ratio, compile_ratio = ratios(r)
    lines.append(f"| {r['side']} | {r['jax']} | {r['seed']} | "
                 f"{r['eval_return']:.1f} | {r['train_s']:.1f} | "
                 f"{r['compile_s']:.1f} | {r['env_steps_per_s']:,.0f} | "
                 f"{train_ratio:.2f} | {compile_ratio:.2f} |")
  lines += ["", "| side | JAX | seeds | eval return mean [min, max] | "
            "training s mean | compile s mean | env steps/s mean | "
            "training / Brax's, median [min, max] | compile / Brax's, "
            "median |", "|---|---|---|---|---|---|---|---|---|"]
  for (side, jax_version), rs in groups.items():
    ev = np.array([r["eval_return"] for r in rs])
    train_ratio, compile_ratio = np.array([ratios(r) for r in rs]).T
    lines.append(
        f"| {side} | {jax_version} | {len(rs)} | {ev.mean():.1f} "
        f"[{ev.min():.1f}, {ev.max():.1f}] | "
        f"{np.mean([r['train_s'] for r in rs]):.1f} | "
        f"{np.mean([r['compile_s'] for r in rs]):.1f} | "
        f"{np.mean([r['env_steps_per_s'] for r in rs]):,.0f} | "
        f"{np.median(train_ratio):.2f} [{train_ratio.min():.2f}, "
        f"{train_ratio.max():.2f}] | {np.median(compile_ratio):.2f} |")
  table = "\n".join(lines)
  print(table)
  with open(os.path.join(args.out, f"table_{args.env}.md"), "w") as f:
    f.write(table + "\n")
  import matplotlib  # noqa: PLC0415 - report only
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415 - after use("Agg")
  fig, axes = plt.subplots(1, 3, figsize=(11, 3.5))
  labels = [f"{side}\nJAX {v}" for side, v in groups]
  for ax, key, title in zip(
      axes, ("eval_return", "train_s", "compile_s"),
      ("final eval return", "training s (no compile)", "compile s")):
    for i, rs in enumerate(groups.values()):
      ys = [r[key] for r in rs]
      ax.scatter([i] * len(ys), ys, alpha=0.7)
      ax.hlines(np.mean(ys), i - 0.25, i + 0.25, color="k")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_title(title)
    ax.grid(alpha=0.3)
  fig.suptitle(f"Brax {args.env}: Brax's PPO trainer vs ppo_brax "
               "(per seed; bar: mean)")
  fig.tight_layout()
  png = os.path.join(args.out, f"brax_{args.env}.png")
  fig.savefig(png, dpi=110)
  print(png)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--env", default="inverted_pendulum",
                      choices=sorted(SETTINGS))
  parser.add_argument("--backend", default="positional")
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
  parser.add_argument("--total-steps", type=int, default=0,
                      help="instead of the settings' num_timesteps")
  parser.add_argument("--brax-python", default="",
                      help="interpreter for Brax's trainer ('': skip it)")
  parser.add_argument("--jrollout-python", nargs="*", default=[],
                      help="interpreters for ppo_brax, one run each")
  parser.add_argument("--out", default="benchmarks/results/brax")
  parser.add_argument("--note", default="",
                      help="stored with each run; --report filters on it")
  parser.add_argument("--report", action="store_true")
  parser.add_argument("--side", choices=["brax"], help=argparse.SUPPRESS)
  parser.add_argument("--json", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.side == "brax":
    args.seed = args.seeds[0]
    record = run_brax(args)
    with open(args.json, "w") as f:
      json.dump(record, f)
  elif args.report:
    report(args)
  else:
    run_all(args)


if __name__ == "__main__":
  sys.exit(main())
