"""PPO sweep: jrollout against the same-algorithm JAX idiom, by envs and seeds.

PPO on CartPole at the pure-JAX reference's hyperparameters (128 steps per
rollout, 4 epochs x 4 minibatches), at 4, 64 and 256 envs with one seed and
at 4 envs with 16 vmapped seeds. Each configuration is measured as
``ppo_compare`` measures one: both implementations are one jitted function
for the whole training run (``ppo_compare.build``; the idiom is
``benchmarks/baselines/ppo_idiom.py``, which differs only in the data path),
compiled ahead (``lower().compile()``, timed apart), then run in interleaved
rounds, the order rotated each round, in one process. Both run the same
number of env steps. Reported: compile and run time (median [min-max]), env
steps/s (from the median run time), CPU time over wall time, and the
jrollout/idiom run-time ratio (median and range of the per-round ratios).

Writes ``RESULTS.md``, ``results.json`` and ``ppo_sweep.png`` (env steps/s
per configuration, jrollout vs idiom, the ratio annotated; compile time
beside it) to ``benchmarks/results/ppo_sweep/``; ``--quick`` and partial runs
(``--configs``, ``--scale``) write elsewhere (see ``--out``).

    python -m benchmarks.scripts.ppo_sweep                # ~10 min, 2 cores
    python -m benchmarks.scripts.ppo_sweep --quick        # smoke test, ~20 s
    python -m benchmarks.scripts.ppo_sweep --configs E64 --scale 4
    python -m benchmarks.scripts.ppo_sweep --render DIR/results.json --note ..
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Any

from benchmarks import run as bench_run
from benchmarks.scripts import ppo_compare

HERE = pathlib.Path(__file__).resolve().parent.parent   # benchmarks/
JR, IDIOM = "jrollout", "jax idiom"
IMPLS = {JR: ppo_compare.IMPLS[JR], IDIOM: ppo_compare.IMPLS[IDIOM]}
COLOURS = {JR: "#1f77b4", IDIOM: "#2ca02c"}


@dataclasses.dataclass(frozen=True)
class Sweep:
  name: str       # short name, for --configs
  label: str      # chart tick label
  config: Any     # ppo_cartpole.Config; total_steps is per seed


def _config(num_envs: int, seeds: int, total_steps: int):
  return dataclasses.replace(ppo_compare.REFERENCE, num_envs=num_envs,
                             seeds=seeds, total_steps=total_steps)


# total_steps per seed, chosen so that a run lasts about 3-5 s on a quiet
# 2-core machine: the PPO update's epochs scale with the rows, so env steps/s
# grows little with num_envs on a CPU. Runs 4x as long gave the same env
# steps/s within noise (see benchmarks/results/ppo_sweep/RESULTS.md, notes).
CONFIGS = [
    Sweep("E4", "4 envs\n1 seed", _config(4, 1, 2**18)),          # 512 upd.
    Sweep("E64", "64 envs\n1 seed", _config(64, 1, 2**19)),       # 64 upd.
    Sweep("E256", "256 envs\n1 seed", _config(256, 1, 2**19)),    # 16 upd.
    Sweep("S16", "4 envs\n16 seeds", _config(4, 16, 2**15)),      # 64 upd.
]
# One configuration: compiling a 16-seed program takes 10-25 s on 2 cores.
QUICK_CONFIGS = ("E4",)


def env_steps(config) -> int:
  """Env steps of one training run, all seeds: ``S * U * E * T``."""
  return (config.seeds * config.num_updates * config.num_envs
          * config.num_steps)


def _load() -> list[float]:
  return [round(x, 2) for x in os.getloadavg()]


def _ratios(a: list[float], b: list[float]) -> list[float]:
  return [x / y for x, y in zip(a, b)]


def summarise(sweep: Sweep, out: dict) -> dict:
  """The per-configuration record of results.json (raw lists kept)."""
  config = sweep.config
  steps = env_steps(config)
  impls = {}
  for name, m in out.items():
    run, comp = m["run"], m["compile"]
    impls[name] = {
        "compile_s": comp, "compile_cpu_s": m["compile_cpu"], "run_s": run,
        "cpu_over_wall": m["cpu"],
        "final_return_per_seed": [float(x) for x in m["final"]],
        "run_s_median": statistics.median(run),
        "compile_s_median": statistics.median(comp),
        "env_steps_per_s": steps / statistics.median(run),
        "env_steps_per_s_min_max": [steps / max(run), steps / min(run)],
    }
  run_ratios = _ratios(out[JR]["run"], out[IDIOM]["run"])
  compile_ratios = _ratios(out[JR]["compile"], out[IDIOM]["compile"])
  return {
      "name": sweep.name, "label": sweep.label,
      "num_envs": config.num_envs, "num_steps": config.num_steps,
      "seeds": config.seeds, "num_updates": config.num_updates,
      "total_steps_per_seed": config.total_steps,
      "num_epochs": config.num_epochs,
      "num_minibatches": config.num_minibatches,
      "env_steps_per_run": steps, "impls": impls,
      "run_ratio": statistics.median(run_ratios),
      "run_ratio_min_max": [min(run_ratios), max(run_ratios)],
      "compile_ratio": statistics.median(compile_ratios),
  }


def versions() -> dict[str, str]:
  """``benchmarks.run.versions`` for the PPO runs (no torch)."""
  return bench_run.versions(
      ("jax", "jaxlib", "flax", "optax", "gymnax", "numpy", "matplotlib"),
      watched=("jrollout", "examples", "benchmarks/scripts",
               "benchmarks/baselines"), torch_threads=False)


def machine_line(info: dict, vers: dict) -> str:
  """``'<cpu model>, <N> cores, jax <v>'``: the chart's and docs' line."""
  return (f"{info.get('cpu', '?')}, {info.get('cpus usable', '?')} cores, "
          f"jax {vers.get('jax')}")


# ---------------------------------------------------------------- reports

def _range(xs, fmt="{:.2f}") -> str:
  return (fmt.format(statistics.median(xs)) + " ["
          + fmt.format(min(xs)) + "-" + fmt.format(max(xs)) + "]")


def summary_table(records: list[dict]) -> str:
  lines = ["| configuration | env steps per run | jrollout env steps/s "
           "| idiom env steps/s | run time jrollout / idiom [min-max] "
           "| run s jrollout | run s idiom | compile s jrollout / idiom |",
           "| --- | ---: | ---: | ---: | --- | --- | --- | --- |"]
  for rec in records:
    jr, idiom = rec["impls"][JR], rec["impls"][IDIOM]
    lo, hi = rec["run_ratio_min_max"]
    lines.append(
        f"| {rec['label'].replace(chr(10), ', ')} "
        f"| {rec['env_steps_per_run']:,} "
        f"| {jr['env_steps_per_s']:,.0f} | {idiom['env_steps_per_s']:,.0f} "
        f"| **{rec['run_ratio']:.2f}x** [{lo:.2f}-{hi:.2f}] "
        f"| {_range(jr['run_s'])} | {_range(idiom['run_s'])} "
        f"| {jr['compile_s_median']:.1f} / {idiom['compile_s_median']:.1f} "
        f"({rec['compile_ratio']:.2f}x) |")
  return "\n".join(lines)


def detail_table(records: list[dict]) -> str:
  lines = ["| configuration | implementation | compile s | compile CPU s "
           "| run s | env steps/s [min-max] | run CPU / wall | final return "
           "(mean over seeds) |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
  for rec in records:
    for name, m in rec["impls"].items():
      lo, hi = m["env_steps_per_s_min_max"]
      final = m["final_return_per_seed"]
      lines.append(
          f"| {rec['name']}: {rec['num_envs']} envs x {rec['num_steps']} "
          f"steps x {rec['seeds']} seed(s), {rec['num_updates']} updates "
          f"| {name} | {_range(m['compile_s'])} "
          f"| {_range(m['compile_cpu_s'])} | {_range(m['run_s'])} "
          f"| {m['env_steps_per_s']:,.0f} [{lo:,.0f}-{hi:,.0f}] "
          f"| {statistics.median(m['cpu_over_wall']):.2f} "
          f"| {sum(final) / len(final):.1f} |")
  return "\n".join(lines)


def write_markdown(path: pathlib.Path, result: dict, chart: str | None):
  quick = result["quick"]
  lines = [
      "# PPO sweep: jrollout vs the same-algorithm JAX idiom",
      "",
      f"Generated by `{result['command']}` on {result['started']} "
      f"({result['wall_s']:.0f} s)."
      + (" **Quick mode: tiny runs, numbers not meaningful.**"
         if quick else ""),
      "",
      f"Machine: **{result['machine_line']}**.",
      "",
      "## Summary",
      "",
      summary_table(result["configs"]),
      "",
      "Env steps/s is env steps per run over the median run time. The ratio "
      "is the median of the per-round ratios of run times (below 1: "
      "jrollout is faster), with their range.",
      "",
      "## Method",
      "",
      "PPO on gymnax CartPole-v1 with the pure-JAX reference's "
      "hyperparameters (128 steps per rollout, 4 epochs x 4 minibatches, "
      "lr 2.5e-4 annealed, GAE 0.99 / 0.95, clip 0.2, a 64-unit tanh MLP). "
      "`jrollout` is `examples/ppo_cartpole.py`'s agent; `jax idiom` is "
      "`benchmarks/baselines/ppo_idiom.py`, the same environment, network, "
      "loss, optimiser and algorithm (time limits bootstrapped from the "
      "true final observation) with the idiom's data path: `lax.scan` "
      "outputs, a reverse-scan GAE, `jax.random.permutation` + gather + "
      "reshape + `lax.scan` per epoch. Each is one jitted function for the "
      "whole training run (`benchmarks/scripts/ppo_compare.py`'s `build`: "
      "seeds initialised with `lax.map`, trained under `vmap`, wrapped in "
      "`checkify`). Per configuration, in one process: "
      f"{result['compiles']} interleaved compile(s) of each "
      "(`lower().compile()`, timed apart), one untimed warm-up run each, "
      f"then {result['rounds']} rounds, each running both once, the order "
      "rotated each round. Both run the same env steps. \"Run CPU / "
      "wall\" is the process's user + system time over wall time (1.00: one "
      "busy core; below 1, the process waited for a core); \"compile CPU "
      "s\" is its CPU time during a compile. Final returns are a sanity "
      "check only: the runs are short and the two shuffle differently.",
      "",
      "## Details",
      "",
      detail_table(result["configs"]),
      "",
      "## Machine and versions",
      "",
  ]
  lines += [f"- {k}: {v}" for k, v in result["machine"].items()]
  lines += [f"- load average (1/5/15 min) at start: "
            f"{' / '.join(map(str, result['load_start']))}; at end: "
            f"{' / '.join(map(str, result['load_end']))}; 1-min load at the "
            "start of each configuration: " + ", ".join(
                f"{r['name']} {r['load_start'][0]}" for r in result["configs"]
                if "load_start" in r)]
  lines += [f"- {k}: {v}" for k, v in result["versions"].items()]
  if result.get("notes"):
    lines += ["", "## Notes", ""] + [f"- {n}" for n in result["notes"]]
  if chart:
    lines += ["", "## Chart", "", f"![PPO sweep]({chart})"]
  path.write_text("\n".join(lines) + "\n")


def write_chart(path: pathlib.Path, result: dict) -> bool:
  """Env steps/s per configuration (bars, min-max lines, ratio), compile s."""
  try:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.patches  # noqa: PLC0415
    import matplotlib.pyplot as plt  # noqa: PLC0415
    import matplotlib.ticker  # noqa: PLC0415
  except ImportError:
    return False
  records = result["configs"]
  fig, (ax, ax_c) = plt.subplots(
      1, 2, figsize=(11, 4.6), gridspec_kw={"width_ratios": [3, 1.3]})
  width = 0.38
  xs = range(len(records))
  for i, name in enumerate((JR, IDIOM)):
    offset = (i - 0.5) * width
    for x, rec in zip(xs, records):
      m = rec["impls"][name]
      lo, hi = m["env_steps_per_s_min_max"]
      ax.bar(x + offset, m["env_steps_per_s"], width, color=COLOURS[name])
      ax.plot([x + offset] * 2, [lo, hi], color="black", linewidth=0.9)
      ax.text(x + offset, hi * 1.02, f"{m['env_steps_per_s'] / 1e3:,.0f}k",
              ha="center", va="bottom", fontsize=7.5)
      c = m["compile_s"]
      ax_c.bar(x + offset, statistics.median(c), width, color=COLOURS[name])
      ax_c.plot([x + offset] * 2, [min(c), max(c)], color="black",
                linewidth=0.9)
  top = max(rec["impls"][n]["env_steps_per_s_min_max"][1]
            for rec in records for n in (JR, IDIOM))
  for x, rec in zip(xs, records):
    lo, hi = rec["run_ratio_min_max"]
    ax.text(x, top * 1.13, f"run time {rec['run_ratio']:.2f}x\n"
            f"[{lo:.2f}-{hi:.2f}]", ha="center", va="bottom", fontsize=8.5,
            fontweight="bold")
  ax.set_ylim(0, top * 1.38)
  ax.set_xticks(list(xs))
  ax.set_xticklabels([r["label"] for r in records], fontsize=8.5)
  ax.set_ylabel("env steps/s (median run; line: min-max)")
  ax.yaxis.set_major_formatter(
      matplotlib.ticker.FuncFormatter(lambda v, _: f"{v / 1e3:,.0f}k"))
  ax.grid(axis="y", alpha=0.25)
  ax.set_title("PPO CartPole training, env steps/s (higher is better); "
               "above: jrollout / idiom run time", fontsize=9)
  ax_c.set_xticks(list(xs))
  ax_c.set_xticklabels([r["name"] for r in records], fontsize=8)
  ax_c.set_ylabel("compile s (lower + compile)")
  ax_c.grid(axis="y", alpha=0.25)
  ax_c.set_title("compile time (median; line: min-max)", fontsize=9)
  fig.suptitle(
      f"jrollout vs the same-algorithm JAX idiom, "
      f"{result['started'][:10]}: {result['machine_line']}"
      + (" (QUICK: not meaningful)" if result["quick"] else ""), fontsize=10)
  fig.legend(handles=[matplotlib.patches.Patch(color=COLOURS[n], label=n)
                      for n in (JR, IDIOM)],
             loc="lower center", ncol=2, fontsize=8.5, frameon=False)
  fig.tight_layout(rect=(0, 0.05, 1, 1))
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


# ---------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog="python -m benchmarks.scripts.ppo_sweep",
      description=__doc__.split("\n")[0])
  p.add_argument("--rounds", type=int, default=None,
                 help="interleaved run rounds per configuration (default 5, "
                 "--quick 1)")
  p.add_argument("--compiles", type=int, default=None,
                 help="interleaved compiles per implementation and "
                 "configuration (default 2, --quick 1)")
  p.add_argument("--configs", default=None, metavar="NAMES",
                 help="comma-separated subset of "
                 f"{','.join(s.name for s in CONFIGS)} (default all; "
                 f"--quick: {','.join(QUICK_CONFIGS)})")
  p.add_argument("--scale", type=float, default=1.0,
                 help="multiply every configuration's total_steps (to check "
                 "that env steps/s does not depend on the run length)")
  p.add_argument("--quick", action="store_true",
                 help="smoke test: 2 updates per run, 1 round, 1 compile; "
                 "numbers not meaningful")
  p.add_argument("--note", action="append", default=[], metavar="TEXT",
                 help="a line for RESULTS.md's notes (repeatable)")
  p.add_argument("--render", type=pathlib.Path, default=None,
                 metavar="RESULTS_JSON",
                 help="measure nothing: rewrite RESULTS.md and the chart "
                 "from a saved results.json (in its folder unless --out), "
                 "adding the --note lines")
  p.add_argument("--out", type=pathlib.Path, default=None, metavar="DIR",
                 help="output folder (default benchmarks/results/ppo_sweep; "
                 "benchmarks/_quick/ppo_sweep with --quick, "
                 "benchmarks/_partial/ppo_sweep with --configs or --scale)")
  args = p.parse_args(argv)
  names = [s.name for s in CONFIGS]
  if args.configs is not None:
    chosen = [c for c in args.configs.split(",") if c]
    unknown = [c for c in chosen if c not in names]
    if unknown or not chosen:
      p.error(f"--configs: expected names from {names}, got {args.configs!r}")
  if args.rounds is not None and args.rounds < 1:
    p.error(f"--rounds: expected at least 1, got {args.rounds}")
  if args.compiles is not None and args.compiles < 1:
    p.error(f"--compiles: expected at least 1, got {args.compiles}")
  if not args.scale > 0:
    p.error(f"--scale: expected a positive number, got {args.scale}")
  return args


def selected(args) -> list[Sweep]:
  names = (args.configs.split(",") if args.configs
           else QUICK_CONFIGS if args.quick else [s.name for s in CONFIGS])
  out = []
  for sweep in CONFIGS:
    if sweep.name not in names:
      continue
    c = sweep.config
    per_update = c.num_envs * c.num_steps
    total = (2 * per_update if args.quick
             else max(per_update, int(c.total_steps * args.scale)))
    out.append(dataclasses.replace(
        sweep, config=dataclasses.replace(c, total_steps=total)))
  return out


def main(argv=None) -> dict:
  raw_argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(raw_argv)
  if args.render is not None:
    return render(args.render, args.out, args.note)
  rounds = args.rounds or (1 if args.quick else 5)
  compiles = args.compiles or (1 if args.quick else 2)
  sweeps = selected(args)
  out_dir = args.out or (
      HERE / "_quick" / "ppo_sweep" if args.quick
      else HERE / "_partial" / "ppo_sweep" if args.configs or args.scale != 1
      else HERE / "results" / "ppo_sweep")
  out_dir.mkdir(parents=True, exist_ok=True)

  started = datetime.datetime.now().astimezone()
  load_start = _load()
  info = bench_run.machine()
  info = {k: v for k, v in info.items()
          if not k.startswith("load average")}   # (recorded apart)
  vers = versions()
  line = machine_line(info, vers)
  print(f"PPO sweep on {line}; load average {load_start}; {rounds} rounds, "
        f"{compiles} compile(s)", flush=True)
  t0 = time.perf_counter()
  records = []
  for sweep in sweeps:
    c, load = sweep.config, _load()
    print(f"[{sweep.name}] {c.num_envs} envs x {c.num_steps} steps x "
          f"{c.seeds} seed(s), {c.num_updates} updates, "
          f"{env_steps(c):,} env steps per run; load {load}", flush=True)
    t1 = time.perf_counter()
    out = ppo_compare.measure(c, rounds, compiles, impls=IMPLS)
    rec = summarise(sweep, out)
    rec["wall_s"] = time.perf_counter() - t1
    rec["load_start"] = load
    records.append(rec)
    print("  " + "; ".join(
        f"{n}: run {m['run_s_median']:.2f} s, "
        f"{m['env_steps_per_s']:,.0f} steps/s, compile "
        f"{m['compile_s_median']:.1f} s" for n, m in rec["impls"].items())
        + f"; run ratio {rec['run_ratio']:.2f}x ({rec['wall_s']:.0f} s)",
        flush=True)
  result = {
      "command": " ".join(["python -m benchmarks.scripts.ppo_sweep",
                           *raw_argv]),
      "started": started.isoformat(timespec="seconds"),
      "wall_s": time.perf_counter() - t0,
      "quick": args.quick, "rounds": rounds, "compiles": compiles,
      "scale": args.scale, "machine_line": line, "machine": info,
      "versions": vers, "load_start": load_start, "load_end": _load(),
      "configs": records, "notes": args.note,
  }
  write_outputs(out_dir, result)
  print("\n" + summary_table(records))
  print(f"\nload average at end {result['load_end']}; wrote {out_dir} "
        f"({result['wall_s']:.0f} s)", flush=True)
  return result


def write_outputs(out_dir: pathlib.Path, result: dict) -> None:
  """results.json, ppo_sweep.png (if matplotlib imports) and RESULTS.md."""
  out_dir.mkdir(parents=True, exist_ok=True)
  chart = out_dir / "ppo_sweep.png"
  has_chart = write_chart(chart, result)
  (out_dir / "results.json").write_text(json.dumps(result, indent=1) + "\n")
  write_markdown(out_dir / "RESULTS.md", result,
                 chart.name if has_chart else None)


def render(path: pathlib.Path, out_dir: pathlib.Path | None,
           notes: list[str]) -> dict:
  """Rewrite a saved run's outputs from its results.json, adding notes."""
  result = json.loads(path.read_text())
  result["notes"] = list(result.get("notes", [])) + notes
  write_outputs(out_dir or path.parent, result)
  return result


if __name__ == "__main__":
  main()
