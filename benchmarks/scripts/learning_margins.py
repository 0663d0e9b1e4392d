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
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks import run

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
    # The recurrent test's configuration: 8 seeds, no feed-forward run.
    "recurrent_8": ("examples.ppo_recurrent",
                    ["--no-compare", "--seeds", "8"],
                    {"gru": ("GRU (sequence minibatches)", "final_returns")}),
    "recurrent_L16_8": ("examples.ppo_recurrent",
                        ["--no-compare", "--seq-len", "16", "--seeds", "8"],
                        {"chunks": ("GRU (sequence minibatches)",
                                    "final_returns")}),
    "pendulum": ("examples.ppo_pendulum",
                 ["--total-steps", "163840", "--seeds", "2", "--no-compare"],
                 {"final": ("normalised obs + scaled rewards",
                            "final_returns")}),
    "envpool": ("examples.ppo_envpool",
                ["--seeds", "1", "--total-steps", "204800"],
                {"final": "final_returns"}),
    # ppo_brax's slow test: Brax inverted_pendulum, 256 envs x 40 steps x
    # 20 updates, a 5 x 64 critic; eval = the deterministic policy's return
    # (32 envs, 1,000 steps), train = the last 10% of updates' episodes.
    "brax": ("examples.ppo_brax",
             ["--num-envs", "256", "--num-steps", "40", "--num-minibatches",
              "8", "--total-steps", "204800", "--seeds", "2", "--chunks",
              "4", "--eval-envs", "32", "--value-width", "64",
              "--no-compile-cache"],
             {"eval": "eval_returns", "final": "final_returns"}),
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
  """The CPU and versions each run records (``benchmarks.run.machine``
  reads the CPU model)."""
  import jax  # noqa: PLC0415  (only for its version)
  info = run.machine()
  return {"cpu": info["cpu"], "cores": os.cpu_count(), "jax": jax.__version__,
          "python": info["python"]}


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


# What each slow test asserts, as functions of per-seed arrays drawn like the
# test's (``n`` seeds per case); ``analyze`` resamples the measured per-seed
# values to estimate how often each claim would fail on another machine,
# where the same seeds give, in effect, other draws.
CLAIMS = {
    # name: (pool of measured seeds, seeds per test draw, [(label, claim)])
    "cartpole": ("cartpole", {"final": 4}, [
        ("every seed >= 475", lambda d: (d["final"] >= 475).all()),
    ]),
    "pendulum": ("pendulum", {"final": 2}, [
        ("every seed >= -300", lambda d: (d["final"] >= -300).all()),
    ]),
    "envpool": ("envpool", {"final": 1}, [
        ("final >= 150 (old)", lambda d: (d["final"] >= 150).all()),
        ("final >= 100", lambda d: (d["final"] >= 100).all()),
    ]),
    "brax": ("brax", {"eval": 2, "final": 2}, [
        ("every seed's eval >= 500 (old)",
         lambda d: (d["eval"] >= 500).all()),
        ("every seed's eval >= 200", lambda d: (d["eval"] >= 200).all()),
        ("mean eval of the 2 seeds >= 500",
         lambda d: d["eval"].mean() >= 500),
        ("every seed's training return >= 150 (not asserted)",
         lambda d: (d["final"] >= 150).all()),
    ]),
    "torch_simulator": ("torch_simulator", {"initial": 1, "final": 1}, [
        ("initial < 40", lambda d: (d["initial"] < 40).all()),
        ("final > initial + 100",
         lambda d: (d["final"] > d["initial"] + 100).all()),
        ("final > 150", lambda d: (d["final"] > 150).all()),
    ]),
    "recurrent (the test: 4 chunked seeds)": (
        "recurrent", {"chunks": 4}, [
            ("chunks mean >= 70", lambda d: d["chunks"].mean() >= 70),
        ]),
    "recurrent (the stop-53 test: 8 chunked seeds)": (
        "recurrent", {"chunks": 8}, [
            ("chunks mean >= 75", lambda d: d["chunks"].mean() >= 75),
        ]),
    "recurrent (the earlier test: 8 seeds each, whole and chunks)": (
        "recurrent", {"gru": 8, "chunks": 8}, [
            ("GRU, whole and chunks (16 runs), mean >= 75",
             lambda d: np.concatenate([d["gru"], d["chunks"]]).mean() >= 75),
            ("whole: best seed >= 75", lambda d: d["gru"].max() >= 75),
            ("chunks mean >= 75", lambda d: d["chunks"].mean() >= 75),
            ("chunks mean >= 0.5 x whole mean",
             lambda d: d["chunks"].mean() >= 0.5 * d["gru"].mean()),
            ("all four", lambda d: (
                np.concatenate([d["gru"], d["chunks"]]).mean() >= 75
                and d["gru"].max() >= 75 and d["chunks"].mean() >= 75
                and d["chunks"].mean() >= 0.5 * d["gru"].mean())),
        ]),
    "recurrent (the old test: 4 seeds each)": (
        "recurrent", {"gru": 4, "ff": 4, "chunks": 4}, [
            ("feed-forward max <= 60 (the velocities are hidden)",
             lambda d: d["ff"].max() <= 60),
            ("old: whole mean >= 2 x feed-forward mean",
             lambda d: d["gru"].mean() >= 2 * d["ff"].mean()),
            ("old: chunks mean >= whole mean",
             lambda d: d["chunks"].mean() >= d["gru"].mean()),
            ("old: both", lambda d: (
                d["gru"].mean() >= 2 * d["ff"].mean()
                and d["chunks"].mean() >= d["gru"].mean())),
        ]),
}


def _pools(rows):
  pools = {}
  for r in rows:
    case = "recurrent" if r["case"].startswith("recurrent") else r["case"]
    if r["setting"] != "default":
      continue   # identical to default here (see the report); not a draw
    for name, v in r.items():
      if name in ("case", "seed", "setting", "wall_s", "machine"):
        continue
      pools.setdefault(case, {}).setdefault(name, []).extend(
          np.atleast_1d(v).tolist())
  return pools


def analyze(path, draws=100_000):
  """Per claim: the value at the measured base seeds, and the share of
  ``draws`` resampled tests (per-seed values drawn with replacement from all
  measured seeds) in which it fails."""
  rows = [json.loads(ln) for ln in open(path) if ln.strip()]
  pools = _pools(rows)
  rng = np.random.default_rng(0)
  for case, (source, sizes, claims) in CLAIMS.items():
    if source not in pools or any(k not in pools[source] for k in sizes):
      continue
    pool = {k: np.array(v) for k, v in pools[source].items() if k in sizes}
    print(f"\n## {case}: " + ", ".join(
        f"{k} {len(v)} seeds, mean {v.mean():.1f}, sd "
        f"{v.std(ddof=1) if len(v) > 1 else 0.0:.1f}, min {v.min():.1f}"
        for k, v in pool.items()))
    for label, claim in claims:
      fails = sum(not claim({k: rng.choice(pool[k], n) for k, n in
                             sizes.items()}) for _ in range(draws))
      # The same from a normal fitted to each pool: its tails reach past
      # the few seeds measured (the resampling above never does).
      fit = {k: (v.mean(), v.std(ddof=1) if len(v) > 1 else 0.0)
             for k, v in pool.items()}
      normal = sum(not claim({k: rng.normal(*fit[k], n) for k, n in
                              sizes.items()}) for _ in range(draws))
      print(f"  {label}: fails in {fails / draws:.2%} of {draws:,} "
            f"resampled tests, {normal / draws:.2%} drawn from a fitted "
            "normal")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--cases", nargs="+", default=list(CASES),
                      choices=list(CASES))
  parser.add_argument("--seeds", nargs="+", type=int, default=[0])
  parser.add_argument("--settings", nargs="+", default=list(SETTINGS),
                      choices=list(SETTINGS))
  parser.add_argument("--out", required=True)
  parser.add_argument("--report", action="store_true")
  parser.add_argument("--analyze", type=int, metavar="DRAWS", default=0,
                      help="resample the measured seeds DRAWS times per "
                      "claim and report how often each test claim fails")
  args = parser.parse_args(argv)
  if args.report or args.analyze:
    if args.report:
      report(args.out)
    if args.analyze:
      analyze(args.out, args.analyze)
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
