"""The spread that every learning test's threshold sits in.

A learning test runs an example with fixed seeds and asserts a bar on its
final returns. XLA's CPU code differs between machines (instruction sets,
thread counts), so on another machine the same seeds give other runs: a bar
is safe only if it holds across seeds *and* thread settings. This script runs
each slow learning test's exact configuration at several base seeds under
several thread settings, each in a fresh process, and appends one JSON line
per run to ``--out`` (per-seed final returns and what the test asserts).

    python -m benchmarks.scripts.learning_margins --cases recurrent \
        --seeds 0 1 2 --settings default taskset0 no_eigen_mt \
        --out benchmarks/results/learning_margins/runs.jsonl
    python -m benchmarks.scripts.learning_margins --report \
        --out benchmarks/results/learning_margins/runs.jsonl

Every run is deterministic on one machine; the thread settings are what
changes XLA's CPU code here (the tests run under the conftest's
``--xla_force_host_platform_device_count=8``, kept in every setting).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

# Each case: the example module, its arguments as the test passes them (the
# base seed is appended), and how to read its summary into named arrays.
CASES = {
    "cartpole": ("examples.ppo_cartpole", [],
                 {"final": "final_returns"}),
    "recurrent": ("examples.ppo_recurrent", [],
                  {"gru": ("GRU (sequence minibatches)", "final_returns"),
                   "ff": ("feed-forward", "final_returns")}),
    "recurrent_L16": ("examples.ppo_recurrent",
                      ["--no-compare", "--seq-len", "16"],
                      {"chunks": ("GRU (sequence minibatches)",
                                  "final_returns")}),
    "pendulum": ("examples.ppo_pendulum",
                 ["--total-steps", "163840", "--seeds", "2", "--no-compare"],
                 {"final": ("normalised obs + scaled rewards",
                            "final_returns")}),
    "envpool": ("examples.ppo_envpool",
                ["--seeds", "1", "--total-steps", "204800"],
                {"final": "final_returns"}),
    "torch_simulator": ("examples.torch_simulator",
                        ["--num-envs", "1024", "--num-steps", "32",
                         "--updates", "24"],
                        {"initial": "initial_return",
                         "final": "final_return"}),
}

DEVICES = "--xla_force_host_platform_device_count=8"
SETTINGS = {
    # name: (command prefix, extra XLA flags)
    "default": ([], ""),
    "taskset0": (["taskset", "-c", "0"], ""),
    "no_eigen_mt": ([], "--xla_cpu_multi_thread_eigen=false"),
}

_CHILD = """
import json, sys
sys.argv = [sys.argv[0]]
import importlib
mod = importlib.import_module({module!r})
summary = mod.main({argv!r})
print("SUMMARY_JSON " + json.dumps(summary, default=str))
"""


def _read(summary, path):
  if isinstance(path, str):
    return summary[path]
  for part in path:
    summary = summary[part]
  return summary


def run_one(case, seed, setting):
  module, args, fields = CASES[case]
  prefix, flags = SETTINGS[setting]
  with tempfile.TemporaryDirectory() as out:
    argv = [*args, "--seed", str(seed), "--out", out]
    env = dict(os.environ, XLA_FLAGS=f"{DEVICES} {flags}".strip())
    t0 = time.time()
    proc = subprocess.run(
        [*prefix, sys.executable, "-c",
         _CHILD.format(module=module, argv=argv)],
        env=env, capture_output=True, text=True, check=False)
    wall = time.time() - t0
  if proc.returncode != 0:
    raise RuntimeError(f"{case} seed {seed} {setting} failed:\n"
                       f"{proc.stderr[-3000:]}")
  line = [ln for ln in proc.stdout.splitlines()
          if ln.startswith("SUMMARY_JSON ")][-1]
  summary = json.loads(line[len("SUMMARY_JSON "):])
  values = {name: _read(summary, path) for name, path in fields.items()}
  return {"case": case, "seed": seed, "setting": setting,
          "wall_s": round(wall, 1), **values}


def machine():
  model = "unknown"
  try:
    with open("/proc/cpuinfo") as f:
      model = next(ln.split(":", 1)[1].strip() for ln in f
                   if ln.startswith("model name"))
  except (OSError, StopIteration):
    pass
  import jax  # noqa: PLC0415  (only for its version)
  return {"cpu": model, "cores": os.cpu_count(), "jax": jax.__version__,
          "python": platform.python_version()}


def report(path):
  rows = [json.loads(ln) for ln in open(path) if ln.strip()]
  by_case = {}
  for r in rows:
    by_case.setdefault(r["case"], []).append(r)
  for case, rs in sorted(by_case.items()):
    print(f"\n## {case} ({len(rs)} runs)")
    for r in sorted(rs, key=lambda r: (r["setting"], r["seed"])):
      vals = {k: np.round(np.atleast_1d(v), 1).tolist() for k, v in r.items()
              if k not in ("case", "seed", "setting", "wall_s", "machine")}
      print(f"  seed {r['seed']} {r['setting']:<12} {vals}  ({r['wall_s']} s)")
    for name in [k for k in rs[0] if k not in
                 ("case", "seed", "setting", "wall_s", "machine")]:
      per_seed = np.concatenate([np.atleast_1d(r[name]) for r in rs])
      means = np.array([np.mean(r[name]) for r in rs])
      print(f"  {name}: per seed min {per_seed.min():.1f} "
            f"p10 {np.percentile(per_seed, 10):.1f} "
            f"median {np.median(per_seed):.1f} max {per_seed.max():.1f}; "
            f"run means min {means.min():.1f} max {means.max():.1f}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--cases", nargs="+", default=list(CASES),
                      choices=list(CASES))
  parser.add_argument("--seeds", nargs="+", type=int, default=[0])
  parser.add_argument("--settings", nargs="+", default=list(SETTINGS),
                      choices=list(SETTINGS))
  parser.add_argument("--out", required=True)
  parser.add_argument("--report", action="store_true")
  args = parser.parse_args(argv)
  if args.report:
    report(args.out)
    return
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  info = machine()
  for case in args.cases:
    for seed in args.seeds:
      for setting in args.settings:
        row = {**run_one(case, seed, setting), "machine": info}
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as f:
          f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
  main()
