"""A torch simulator and a JAX learner in one process: who gets the cores.

``examples/torch_simulator.py`` steps a torch CartPole simulator and a jitted
JAX policy in turn, in one process. Each runtime has a thread pool that keeps
its threads spinning for a while after each operation (torch's OpenMP pool,
XLA's CPU pool), on the cores the other needs next. This script measures it:

- ``floor``: each part of the example's step (simulator, bridge, policy,
  buffer write) timed alone, each in a fresh process that does only that
  part, with the example's defaults otherwise. The sum is what a step would
  cost if the parts did not get in each other's way.
- ``example``: the example itself (``python -m examples.torch_simulator``),
  in a fresh process per run, under a named configuration of environment
  variables; its per-step timings come from its ``summary.json``.
- ``switch``: in one process, each part timed right after itself and right
  after other work (the other part, a numpy pass over 16 MB, a sleep): what
  taking turns costs when no thread pool spins.
- ``sweep``: the floor and every configuration, at several sizes, several
  runs each, in an order that interleaves configurations; writes a Markdown
  table of every run (not only medians: the default is erratic) to
  ``--out``.

From the repository root::

    python -m benchmarks.scripts.torch_jax_cores sweep --num-envs 16384 \
        --runs 3 --out benchmarks/results/torch_jax_cores
    python -m benchmarks.scripts.torch_jax_cores floor --num-envs 16384
    python -m benchmarks.scripts.torch_jax_cores example --num-envs 16384 \
        --config passive --runs 5

Every figure is milliseconds per env step of all E envs, the mean over the
timed steps of a run (the example's own estimator).
"""

# Each part imports only what it needs, in the process that runs it.
# ruff: noqa: PLC0415

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

# Configurations of the example: environment variables set before the
# process starts. "default" sets nothing: whatever the example does by
# itself (since issue 28 it calls jr.share_cpu_with_torch(), which sets
# OMP_WAIT_POLICY=PASSIVE when the variable is not set); the others
# override it.
CONFIGS: dict[str, dict[str, str]] = {
    "default": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "torch-1-thread": {"OMP_NUM_THREADS": "1"},
    "xla-1-thread": {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false "
                                  "intra_op_parallelism_threads=1"},
    "passive+xla-1-thread": {
        "OMP_WAIT_POLICY": "PASSIVE",
        "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false "
                     "intra_op_parallelism_threads=1"},
    "gomp-spin-10k": {"GOMP_SPINCOUNT": "10000"},
}
PARTS = ("sim", "bridge", "policy", "buffer")


# --- each part alone --------------------------------------------------------


def _part(part: str, num_envs: int, steps: int, seed: int = 0) -> float:
  """Mean ms per env step of ``part`` alone, as the example runs it."""
  if part == "sim":
    return _sim_alone(num_envs, steps, seed)
  if part == "bridge":
    return _bridge_alone(num_envs, steps, seed)
  if part == "policy":
    return _policy_alone(num_envs, steps, seed)
  if part == "buffer":
    return _buffer_alone(num_envs, steps, seed)
  raise ValueError(f"unknown part {part!r}")


def _sim_alone(num_envs: int, steps: int, seed: int) -> float:
  """The simulator's step and the episode bookkeeping (the example's "sim")
  on random actions: torch only, JAX never starts."""
  import torch
  from examples.torch_simulator import TorchCartPole
  sim = TorchCartPole(num_envs, seed=seed)
  sim.reset()
  gen = torch.Generator().manual_seed(seed)
  actions = [torch.randint(0, 2, (num_envs,), generator=gen,
                           dtype=torch.int32) for _ in range(steps)]
  ep_return = torch.zeros(num_envs)
  done_sum = torch.zeros((), dtype=torch.float64)
  done_count = torch.zeros((), dtype=torch.int64)
  total = 0.0
  for i in range(-steps // 4, steps):       # a quarter of warm-up steps
    t0 = time.perf_counter()
    _, reward, terminated, truncated, _ = sim.step(actions[i])
    ep_return = ep_return + reward
    done = terminated | truncated
    done_sum = done_sum + torch.where(done, ep_return, 0.0).sum()
    done_count = done_count + done.sum()
    ep_return = torch.where(done, 0.0, ep_return)
    int(truncated.sum())
    if i >= 0:
      total += time.perf_counter() - t0
  return 1e3 * total / steps


def _bridge_alone(num_envs: int, steps: int, seed: int) -> float:
  """``to_torch`` of the actions and the step's tensors as the example's
  default bridge on the CPU passes them (numpy views)."""
  import jax
  import jax.numpy as jnp
  import torch
  from jrollout.torch import to_torch
  from examples.torch_simulator import step_tree, to_jax
  gen = torch.Generator().manual_seed(seed)
  make_action = jax.jit(lambda i: jnp.full((num_envs,), i % 2, jnp.int32))
  flags = torch.zeros(num_envs, dtype=torch.bool)
  total = 0.0
  for i in range(-steps // 4, steps):
    step = step_tree(torch.rand((num_envs, 4), generator=gen),
                     torch.ones(num_envs), flags, flags)
    action = jax.block_until_ready(make_action(i))   # a new array, as the
    t0 = time.perf_counter()                         # policy's output is
    action_t = to_torch(action)
    del action_t
    to_jax(step, "numpy")
    if i >= 0:
      total += time.perf_counter() - t0
  return 1e3 * total / steps


def learner_fixture(num_envs: int, seed: int = 0):
  """``(learner, params, key)``: the example's ``HostLearner`` for
  ``num_envs`` envs on the first device, its initial parameters, and the
  key they came from."""
  import jax
  from examples import ppo_core
  from examples.torch_simulator import Config
  learner = ppo_core.HostLearner(Config(num_envs=num_envs),
                                 device=jax.devices()[0])
  key = jax.random.key(seed)
  return learner, learner.init(key)[0].params, key


def _policy_alone(num_envs: int, steps: int, seed: int) -> float:
  """The jitted policy on numpy observations, waited for (the example's
  "policy" without its rare value calls for truncated episodes)."""
  import jax
  import numpy as np
  learner, params, key = learner_fixture(num_envs, seed)
  act = learner.act
  rng = np.random.default_rng(seed)
  obs = [rng.uniform(-0.05, 0.05, (num_envs, 4)).astype(np.float32)
         for _ in range(8)]
  keys = list(jax.random.split(key, steps))
  jax.block_until_ready(act(params, obs[0], keys[0]))
  total = 0.0
  for i in range(-steps // 4, steps):
    t0 = time.perf_counter()
    jax.block_until_ready(act(params, obs[i % 8], keys[i]))
    if i >= 0:
      total += time.perf_counter() - t0
  return 1e3 * total / steps


def _buffer_alone(num_envs: int, steps: int, seed: int) -> float:
  """The example's writes: a ``RolloutWriter`` (16 steps a flush) fed the
  step's values as the example feeds them (numpy simulator outputs, JAX
  policy outputs), rollout after rollout, waiting for each flush."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import jrollout as jr
  from examples import ppo_core
  from examples.torch_simulator import Config
  config = Config(num_envs=num_envs)
  learner = ppo_core.HostLearner(config, device=jax.devices()[0])
  rollout = learner.init(jax.random.key(seed))[1]
  rng = np.random.default_rng(seed)
  e = num_envs
  host = {"obs": rng.uniform(-1, 1, (e, 4)).astype(np.float32),
          "reward": np.ones(e, np.float32),
          "terminated": np.zeros(e, bool), "truncated": np.zeros(e, bool)}
  dev = jax.device_put({"action": jnp.zeros(e, jnp.int32),
                        "logp": jnp.zeros(e), "value": jnp.zeros(e),
                        "final_value": jnp.zeros(e)}, jax.devices()[0])
  values = {**host, **dev}
  total = 0.0
  timed = 0
  rounds = max(2, -(-steps // config.num_steps)) + 1
  for r in range(rounds):       # the first rollout compiles: not timed
    writer = jr.RolloutWriter(rollout, flush_every=config.flush_every)
    for t in range(config.num_steps):
      t0 = time.perf_counter()
      writer.update_at(t, values)
      if not writer.pending:
        jax.block_until_ready(writer.state)
      if r:
        total += time.perf_counter() - t0
    t0 = time.perf_counter()
    rollout = jax.block_until_ready(writer.state)
    if r:
      total += time.perf_counter() - t0
      timed += config.num_steps
    rollout = jr.finish_rollout(rollout, check=False)
  return 1e3 * total / timed


# --- the cost of taking turns, in one process ------------------------------


def switch(num_envs: int, rounds: int,
           seed: int = 0) -> dict[str, dict[str, list[float]]]:
  """Each part of the step timed right after itself and right after other
  work, in this one process, configured as the example configures it.

  Returns ``{part: {before: [ms, ...]}}`` for the parts ``sim``,
  ``policy`` and ``to_torch``, each timed ``rounds`` times after each of:
  itself (back to back, as the floor runs it), the other part (as the
  example's loop runs it), a numpy pass over 16 MB (no JAX, no torch: only
  the caches are changed), and a 5 ms sleep (nothing runs). The befores
  rotate within a round, so drifts hit them alike. No thread pool can spin
  across a numpy pass or a sleep, so where the part is as slow after them
  as after the other part, the cost is not the other runtime's threads.
  """
  import jrollout as jr
  jr.share_cpu_with_torch()            # no-op when already set or imported
  import jax
  import numpy as np
  import torch
  from jrollout.torch import to_torch
  from examples.torch_simulator import TorchCartPole
  learner, params, key = learner_fixture(num_envs, seed)
  rng = np.random.default_rng(seed)
  obs = rng.uniform(-0.05, 0.05, (num_envs, 4)).astype(np.float32)
  sim = TorchCartPole(num_envs, seed=seed)
  sim.reset()
  gen = torch.Generator().manual_seed(seed)
  actions = [torch.randint(0, 2, (num_envs,), generator=gen,
                           dtype=torch.int32) for _ in range(8)]
  junk = np.ones(4 << 20, np.float32)              # 16 MB

  def sim_step(i):
    int(sim.step(actions[i % 8])[3].sum())

  def policy(i):
    return jax.block_until_ready(learner.act(params, obs, key))[0]

  out = {}                 # the policy output to_torch converts next

  def convert(i):
    to_torch(out["action"])

  def fresh_action(before):
    def run(i):
      before(i)
      out["action"] = policy(i)      # to_torch always gets a fresh output
    return run

  others = {
      "numpy 16 MB pass": lambda i: np.add(junk, 1.0, out=junk),
      "5 ms sleep": lambda i: time.sleep(0.005)}
  plans = {
      "sim": (sim_step, {"itself": sim_step, "the policy": policy,
                         **others}),
      "policy": (policy, {"itself": policy, "the simulator": sim_step,
                          **others}),
      "to_torch": (convert, {
          "itself": fresh_action(lambda i: None),
          "the simulator": fresh_action(sim_step),
          **{k: fresh_action(f) for k, f in others.items()}}),
  }
  # to_torch "after itself" still follows the policy call that makes its
  # input (a fresh array, as in the example); the other rows add work
  # between that call and the conversion.
  res: dict[str, dict[str, list[float]]] = {}
  for part, (target, befores) in plans.items():
    res[part] = {k: [] for k in befores}
    for f in befores.values():            # warm-up: compiles, allocates
      f(0)
      target(0)
    names = list(befores)
    for r in range(rounds):
      for k in names[r % len(names):] + names[:r % len(names)]:
        befores[k](r)
        t0 = time.perf_counter()
        target(r)
        res[part][k].append(1e3 * (time.perf_counter() - t0))
  return res


def switch_report(num_envs: int,
                  res: dict[str, dict[str, list[float]]]) -> str:
  """A Markdown table of ``switch``'s result: median and quartiles in ms,
  and each median over the part's median after itself."""
  lines = [f"E = {num_envs}, OMP_WAIT_POLICY="
           f"{os.environ.get('OMP_WAIT_POLICY', 'not set')}",
           "", "| part | timed right after | median ms | p25 | p75 | "
           "x after itself |", "|---|---|---|---|---|---|"]
  for part, rows in res.items():
    base = statistics.median(rows["itself"])
    for k, v in rows.items():
      q = statistics.quantiles(v, n=4)
      med = statistics.median(v)
      lines.append(f"| {part} | {k} | {med:.3f} | {q[0]:.3f} | {q[2]:.3f} "
                   f"| {med / base:.2f} |")
  return "\n".join(lines)


# --- runs in fresh processes ------------------------------------------------


def _env(config: str) -> dict[str, str]:
  env = dict(os.environ)
  for name in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT",
               "XLA_FLAGS"):
    env.pop(name, None)
  env.update(CONFIGS[config])
  return env


def run_part(part: str, num_envs: int, steps: int,
             config: str = "default") -> float:
  """``part`` alone in a fresh process, under ``config`` ("default": no
  variable set; the simulator then spins, as torch does by default, since
  torch is imported before the example module)."""
  out = subprocess.run(
      [sys.executable, "-m", "benchmarks.scripts.torch_jax_cores", "part",
       part, "--num-envs", str(num_envs), "--steps", str(steps)],
      env=_env(config), check=True, capture_output=True, text=True)
  return float(out.stdout.strip().splitlines()[-1])


def run_example(config: str, num_envs: int, updates: int) -> dict[str, float]:
  """One run of the example in a fresh process; its per-step ms by part."""
  with tempfile.TemporaryDirectory() as out:
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "examples.torch_simulator", "--num-envs",
         str(num_envs), "--updates", str(updates), "--out", out],
        env=_env(config), check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    with open(os.path.join(out, "summary.json")) as f:
      summary = json.load(f)
  ms = summary["per_step_ms"]
  return {"sim": ms["sim"], "bridge": ms["bridge"], "policy": ms["policy"],
          "buffer": ms["buffer"], "total": ms["total"],
          "update_s": summary["update_s"] / max(updates - 1, 1),
          "wall_s": wall}


def floor(num_envs: int, steps: int,
          config: str = "default") -> dict[str, float]:
  parts = {p: run_part(p, num_envs, steps, config) for p in PARTS}
  parts["total"] = sum(parts[p] for p in PARTS)
  return parts


def _fmt(row: dict[str, float]) -> str:
  return " | ".join(f"{row[k]:.2f}" for k in (*PARTS, "total"))


def sweep(sizes: list[int], configs: list[str], runs: int, updates: int,
          out: str | None) -> str:
  """Every configuration and the floor, ``runs`` times each, interleaved."""
  lines = []
  header = ("| E | configuration | run | sim | bridge | policy | buffer | "
            "total ms/step | x floor | update s |")
  for e in sizes:
    steps = updates * 32
    rows: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
    floors: list[dict[str, float]] = []
    for r in range(runs):
      floors.append(floor(e, steps))
      print(f"E={e} run {r + 1} floor: {_fmt(floors[-1])}", flush=True)
      for c in configs:
        rows[c].append(run_example(c, e, updates))
        print(f"E={e} run {r + 1} {c}: {_fmt(rows[c][-1])}", flush=True)
    floor_total = statistics.median(f["total"] for f in floors)
    lines += [f"\n### {e} envs\n", header,
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r, f in enumerate(floors):
      lines.append(f"| {e} | floor (each part alone) | {r + 1} | {_fmt(f)} "
                   f"| {f['total'] / floor_total:.2f} | |")
    for c in configs:
      for r, row in enumerate(rows[c]):
        lines.append(f"| {e} | {c} | {r + 1} | {_fmt(row)} | "
                     f"{row['total'] / floor_total:.2f} | "
                     f"{row['update_s']:.2f} |")
    med = {c: statistics.median(row["total"] for row in rows[c])
           for c in configs}
    lines.append("\nmedian total ms/step: floor "
                 f"{floor_total:.2f}; " + "; ".join(
                     f"{c} {m:.2f} ({m / floor_total:.2f}x)"
                     for c, m in med.items()))
  text = _report(sizes, configs, runs, updates) + "\n".join(lines) + "\n"
  if out:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "RESULTS.md"), "w") as f:
      f.write(text)
  return text


def _report(sizes, configs, runs, updates) -> str:
  import torch
  import jax
  load = os.getloadavg()
  conf = "\n".join(f"- `{c}`: " + (" ".join(f"`{k}={v}`" for k, v in
                                            CONFIGS[c].items()) or
                                   "nothing set (the example's defaults)")
                   for c in configs)
  return (
      "# torch simulator + JAX learner in one process\n\n"
      f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
      f"{platform.processor() or platform.machine()}, {os.cpu_count()} "
      f"cores, load {load[0]:.1f} at the start; torch {torch.__version__}, "
      f"jax {jax.__version__}.\n\n"
      f"Command: `python -m benchmarks.scripts.torch_jax_cores sweep "
      f"--num-envs {','.join(map(str, sizes))} --configs "
      f"{','.join(configs)} --runs {runs} --updates {updates}`\n\n"
      "Milliseconds per env step of all E envs (mean over the run's "
      f"{updates} x 32 steps). The floor runs each part alone in its own "
      "process. `x floor`: the run's total over the median floor total. "
      "`update s`: one PPO update (not part of the step).\n\n"
      f"Configurations (environment variables set before the process "
      f"starts):\n\n{conf}\n")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = parser.add_subparsers(dest="cmd", required=True)
  p = sub.add_parser("part", help="one part alone (prints ms per step)")
  p.add_argument("part", choices=PARTS)
  p.add_argument("--num-envs", type=int, default=16384)
  p.add_argument("--steps", type=int, default=192)
  f = sub.add_parser("floor", help="every part alone, each in a process")
  f.add_argument("--num-envs", type=int, default=16384)
  f.add_argument("--steps", type=int, default=192)
  f.add_argument("--config", choices=CONFIGS, default="default")
  w = sub.add_parser("switch", help="each part after itself and after "
                     "other work, in one process")
  w.add_argument("--num-envs", type=int, default=16384)
  w.add_argument("--rounds", type=int, default=200)
  x = sub.add_parser("example", help="runs of the example")
  x.add_argument("--num-envs", type=int, default=16384)
  x.add_argument("--config", choices=CONFIGS, default="default")
  x.add_argument("--runs", type=int, default=5)
  x.add_argument("--updates", type=int, default=6)
  s = sub.add_parser("sweep", help="floor + every configuration")
  s.add_argument("--num-envs", default="1024,4096,16384")
  s.add_argument("--configs", default=",".join(CONFIGS))
  s.add_argument("--runs", type=int, default=3)
  s.add_argument("--updates", type=int, default=6)
  s.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  if args.cmd == "part":
    print(f"{_part(args.part, args.num_envs, args.steps):.6f}")
  elif args.cmd == "floor":
    row = floor(args.num_envs, args.steps, args.config)
    print(json.dumps(row))
  elif args.cmd == "switch":
    print(switch_report(args.num_envs, switch(args.num_envs, args.rounds)))
  elif args.cmd == "example":
    for r in range(args.runs):
      row = run_example(args.config, args.num_envs, args.updates)
      print(f"run {r + 1}: {_fmt(row)}  (update {row['update_s']:.2f} s, "
            f"wall {row['wall_s']:.1f} s)", flush=True)
  else:
    configs = args.configs.split(",")
    unknown = set(configs) - set(CONFIGS)
    if unknown:
      parser.error(f"unknown configurations {sorted(unknown)}; known: "
                   f"{sorted(CONFIGS)}")
    print(sweep([int(n) for n in args.num_envs.split(",")], configs,
                args.runs, args.updates, args.out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
