"""Command line: ``python -m benchmarks [--quick] [--only NAME] [--rounds R]``.

``--baseline REV`` runs the baseline switch (``benchmarks/baseline.py``)
instead of the suites.

Runs the registered measurements (``benchmarks/suites``), prints the tables
and writes ``RESULTS.md`` and ``results.png`` to the output folder.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import importlib.metadata
import os
import pathlib
import platform
import subprocess
import sys
import time

from benchmarks import baseline
from benchmarks import harness as h
from benchmarks import suites as suites_registry

HERE = pathlib.Path(__file__).resolve().parent
KIND_COLOURS = {
    "jrollout": "#1f77b4",
    "torch": "#d62728",
    "jax-idiom": "#2ca02c",
    "numpy": "#7f7f7f",
    "flashbax": "#9467bd",
    "reference": "#ff7f0e",
}


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog="python -m benchmarks",
      description="jrollout benchmarks: side-by-side, interleaved rounds.")
  p.add_argument("--quick", action="store_true",
                 help="small workloads, 2 rounds, numbers not meaningful; "
                 "writes to benchmarks/_quick unless --out")
  p.add_argument("--smoke", action="store_true",
                 help="one tiny case of every suite (each suite's SMOKE "
                 "measurement), --quick sizes, 1 round: checks that every "
                 "suite still runs")
  p.add_argument("--only", action="append", default=[], metavar="NAME",
                 help="run only matching measurements: a suite name, an "
                 "exact name, a name prefix or a glob (repeatable, or "
                 "comma-separated); the suites left out of the default run "
                 f"({', '.join(suites_registry.EXTRA)}) run only when named")
  p.add_argument("--rounds", type=int, default=None, metavar="R",
                 help="interleaved rounds per measurement (default 10, "
                 "--quick 2, --smoke 1)")
  p.add_argument("--out", type=pathlib.Path, default=None, metavar="DIR",
                 help="where RESULTS.md and results.png go (default "
                 "benchmarks/results/suite; benchmarks/_partial with --only)")
  p.add_argument("--torch-threads", type=int, default=1, metavar="N",
                 help="torch.set_num_threads(N) (default 1: on a shared "
                 "2-core machine torch's OpenMP copies are 10-100x slower and "
                 "bimodal whenever another process holds a core; 0 keeps "
                 "torch's default)")
  p.add_argument("--list", action="store_true",
                 help="list the measurements and exit")
  p.add_argument("--baseline", default=None, metavar="REV",
                 help="instead of the suites: the hot-path rows of git "
                 "revision REV and of this checkout, interleaved in one "
                 "process, a table of HEAD / REV ratios and baseline.json "
                 "(benchmarks/baseline.py; default 5 rounds)")
  return p.parse_args(argv)


def select(measurements, patterns, default_suites=None):
  """The measurements ``--only`` names, in run order.

  A pattern equal to a suite's name selects that suite; any other pattern
  selects the measurements whose name equals it, starts with it or matches
  it as a glob. Without patterns: the suites in ``default_suites`` (all of
  them if None).
  """
  pats = [p for arg in patterns for p in arg.split(",") if p]
  if not pats:
    return [m for m in measurements
            if default_suites is None or m.suite in default_suites]
  suite_names = {m.suite for m in measurements}
  out = []
  for m in measurements:
    for p in pats:
      if (m.suite == p if p in suite_names else
          m.name == p or m.name.startswith(p) or fnmatch.fnmatch(m.name, p)):
        out.append(m)
        break
  return out


# ---------------------------------------------------------------- environment

def _read(path: str) -> str:
  try:
    return pathlib.Path(path).read_text()
  except OSError:
    return ""


def machine() -> dict[str, str]:
  """Machine description without psutil: platform, /proc/cpuinfo, meminfo."""
  info = {"platform": platform.platform(),
          "python": sys.version.split()[0]}
  cpu = next((line.split(":", 1)[1].strip()
              for line in _read("/proc/cpuinfo").splitlines()
              if line.startswith("model name")), platform.processor() or "?")
  info["cpu"] = cpu
  info["cpu count"] = str(os.cpu_count())
  if hasattr(os, "sched_getaffinity"):
    info["cpus usable"] = str(len(os.sched_getaffinity(0)))
  for line in _read("/proc/meminfo").splitlines():
    if line.startswith("MemTotal:"):
      kb = int(line.split()[1])
      info["memory"] = f"{kb / 2**20:.1f} GiB"
  if hasattr(os, "getloadavg"):
    info["load average at start (1/5/15 min)"] = " / ".join(
        f"{x:.2f}" for x in os.getloadavg())
  return info


def versions(dists=("jax", "jaxlib", "torch", "numpy", "flax", "flashbax",
                     "matplotlib"), watched=("jrollout",),
             torch_threads: bool = True) -> dict[str, str]:
  """Package versions, jrollout's git revision and the JAX devices.

  ``watched``: paths whose uncommitted changes are named next to the
  revision; ``torch_threads``: report torch's intra-op threads (imports
  torch).
  """
  out = {}
  for dist in dists:
    try:
      out[dist] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      out[dist] = "not installed"
  import jrollout  # noqa: PLC0415
  out["jrollout"] = jrollout.__version__
  try:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                         capture_output=True, text=True, check=True,
                         timeout=10).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *watched],
                           cwd=HERE.parent, capture_output=True, text=True,
                           timeout=10).stdout.split("\n")
    modified = [line[3:] for line in dirty if line.strip()]
    out["jrollout"] += (f" (git {rev}" + (f", modified: {', '.join(modified)}"
                                          if modified else "") + ")")
  except (OSError, subprocess.SubprocessError):
    out["jrollout"] += " (not a git checkout)"
  import jax  # noqa: PLC0415
  out["jax devices"] = ", ".join(str(d) for d in jax.devices())
  if torch_threads:
    import torch  # noqa: PLC0415
    out["torch threads"] = str(torch.get_num_threads())
  out["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") or "(unset)"
  return out


# ---------------------------------------------------------------- reports

def tables(results) -> tuple[list[list[str]], list[list[str]]]:
  impl_rows, target_rows = [], []
  for r in results:
    impl_rows += h.impl_rows(r)
    target_rows += h.target_rows(r)
  return impl_rows, target_rows


def notes(results) -> list[str]:
  import torch  # noqa: PLC0415
  out = [f"torch ran with {torch.get_num_threads()} intra-op thread(s) "
         "(`--torch-threads`, default 1; see benchmarks/README.md for why) "
         "and OMP_WAIT_POLICY="
         f"{os.environ.get('OMP_WAIT_POLICY', 'not set')} "
         "(`share_cpu_with_torch()`, as in examples/torch_simulator; no "
         "effect with one thread). JAX kept its defaults (asynchronous CPU "
         "dispatch)."]
  for r in results:
    m = r.measurement
    if r.skipped:
      out.append(f"`{m.name}` skipped: {r.skipped}")
    if r.error:
      out.append(f"`{m.name}` FAILED: {r.error}")
  try:
    import flashbax  # noqa: F401, PLC0415
  except ImportError:
    out.append("flashbax is not installed (optional `bench` extra): its "
               "trajectory buffer is left out of the write measurements.")
  return out


def write_markdown(path: pathlib.Path, results, config: h.Config, info, vers,
                   started: datetime.datetime, wall_s: float, load_end: str,
                   chart_name: str | None, argv: list[str], *,
                   command: str = "python -m benchmarks",
                   planned: int | None = None) -> None:
  """RESULTS.md; ``planned``: how many measurements the run was to make
  (a shorter ``results`` says where it stopped)."""
  impl_rows, target_rows = tables(results)
  work = [row for r in results for row in h.work_rows(r, config)]
  lines = [
      "# jrollout benchmarks",
      "",
      f"Generated by `{command} {' '.join(argv)}".rstrip() + "` on "
      f"{started.isoformat(timespec='seconds')} ({wall_s:.0f} s)."
      + (" **Quick mode: small workloads, numbers not meaningful.**"
         if config.quick else ""),
      "",
      "## Method",
      "",
      "Each measurement runs a set of implementations of the same work in one "
      "process. Each has an untimed setup and a `run()` that blocks until its "
      "work is done (`jax.block_until_ready` on JAX outputs; torch on the CPU "
      "is synchronous). The first call of each is timed separately (\"first "
      "call\": includes tracing and compilation for JAX), and its output is "
      "checked, once and untimed, to equal the other implementations' (exact "
      "equality: the data are small integers in float32, so every sum is "
      "exact). Then come "
      f"{config.rounds} rounds (fewer where a measurement caps them); each "
      "round "
      "runs every implementation once, in an order rotated by one each round. "
      "A sample repeats `run()` back to back until it lasts about "
      f"{config.min_sample_s * 1e3:g} ms (column \"calls/sample\") and is "
      "divided by that count. Reported: median, min and max over rounds; "
      "\"CPU/wall\" is the process's CPU time (all threads) over wall time, "
      "summed over the samples: above 1, the run kept more than one core "
      "busy; "
      "\"vs baseline\" is the ratio of medians to the measurement's baseline. "
      "Targets are the issues' \"at most\" ratios (jrollout / baseline) and "
      "are checked on the ratio of medians; the median and range of the "
      "per-round ratios are shown too. The machine is shared with other "
      "jobs, so single rounds are noisy; the interleaving spreads that noise "
      "over all implementations alike.",
      "",
      "## Machine",
      "",
  ]
  lines += [f"- {k}: {v}" for k, v in info.items()]
  lines += [f"- load average at end (1/5/15 min): {load_end}", "",
            "## Versions", ""]
  lines += [f"- {k}: {v}" for k, v in vers.items()]
  if planned is not None and len(results) < planned:
    lines += ["", f"**Stopped after {len(results)} of {planned} "
              "measurements.**"]
  lines += ["", "## Targets", "", h.md_table(h.TARGET_HEADER, target_rows),
            "", "## All timings", "", h.md_table(h.IMPL_HEADER, impl_rows),
            ""]
  if work:
    lines += ["## Throughput", "", h.md_table(h.WORK_HEADER, work), ""]
  lines += ["## Measurements", ""]
  for r in results:
    m = r.measurement
    status = ("skipped" if r.skipped else "FAILED" if r.error
              else f"{r.rounds} rounds, {r.wall_s:.1f} s")
    compared = (f"; results compared: {', '.join(r.compared)}"
                if len(r.compared) > 1 else "")
    lines.append(f"- `{m.name}` ({m.suite}): {m.description} "
                 f"[{status}{compared}]")
  extra = notes(results)
  if extra:
    lines += ["", "## Notes", ""] + [f"- {n}" for n in extra]
  if chart_name:
    lines += ["", "## Chart", "", f"![time per implementation]({chart_name})"]
  path.write_text("\n".join(lines) + "\n")


def write_chart(path: pathlib.Path, results, title: str) -> bool:
  """Horizontal grouped bars (one group per measurement), log time axis."""
  try:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.patches import Patch  # noqa: PLC0415
  except ImportError:
    return False
  rows = []  # (label, median, min, max, kind) or (header, None...)
  for r in results:
    if not r.impls:
      continue
    rows.append((r.measurement.name, None, None, None, None))
    for i in r.impls:
      rows.append((i.name, i.median, i.min, i.max, i.kind))
  if not rows:
    return False
  fig_h = 1.2 + 0.19 * len(rows)
  fig, ax = plt.subplots(figsize=(11, fig_h))
  ys = list(range(len(rows)))[::-1]
  for y, (_label, med, lo, hi, kind) in zip(ys, rows):
    if med is None:
      continue
    ax.barh(y, med, color=KIND_COLOURS.get(kind, "#bcbd22"), height=0.75)
    ax.plot([lo, hi], [y, y], color="black", linewidth=0.8)
    ax.text(hi * 1.08, y, h.fmt_time(med), va="center", fontsize=6)
  ax.set_yticks(ys)
  ax.set_yticklabels([r[0] for r in rows], fontsize=6.5)
  for tick, row in zip(ax.get_yticklabels(), rows):
    if row[1] is None:
      tick.set_fontweight("bold")
      tick.set_fontsize(7.5)
  ax.set_xscale("log")
  ax.set_xlabel("time per call (median over rounds; line: min-max), log scale")
  ax.set_ylim(-1, len(rows))
  ax.grid(axis="x", which="both", alpha=0.25)
  ax.set_title(title, fontsize=9, pad=24)
  ax.legend(handles=[Patch(color=c, label=k) for k, c in KIND_COLOURS.items()],
            loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=6,
            fontsize=7, frameon=False)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


# ---------------------------------------------------------------- main

def run(measurements, config: h.Config, out: pathlib.Path, *,
        argv: list[str], command: str = "python -m benchmarks",
        label: str = "", info_extra: dict[str, str] | None = None) -> int:
  """Runs ``measurements`` with the harness and writes the reports.

  RESULTS.md is rewritten after every measurement, so a run stopped by a
  time limit (SIGINT: ``timeout -s INT``) keeps what it measured; the chart
  is drawn at the end. Returns the exit status: 1 if a measurement failed
  (an exception or a result mismatch), 2 if the run was interrupted, 0
  otherwise (a MISS is a finding, not a failure).
  """
  out.mkdir(parents=True, exist_ok=True)
  started = datetime.datetime.now().astimezone()
  info = {**machine(), **(info_extra or {})}
  vers = versions()
  print(f"{command}: {len(measurements)} measurements, {config.rounds} "
        f"rounds{' (quick)' if config.quick else ''}"
        + (f", {label}" if label else ""), flush=True)
  t0 = time.perf_counter()
  results = []

  def write(chart: bool) -> None:
    load_end = (" / ".join(f"{x:.2f}" for x in os.getloadavg())
                if hasattr(os, "getloadavg") else "?")
    title = (f"jrollout benchmarks, {started.date()}, {info.get('cpu', '?')} "
             f"x{info.get('cpus usable', info.get('cpu count'))}"
             + (f", {label}" if label else "")
             + f", jax {vers.get('jax')}, torch {vers.get('torch')}"
             + (" (QUICK: not meaningful)" if config.quick else ""))
    has_chart = chart and write_chart(out / "results.png", results, title)
    write_markdown(out / "RESULTS.md", results, config, info, vers, started,
                   time.perf_counter() - t0, load_end,
                   "results.png" if has_chart else None, argv,
                   command=command, planned=len(measurements))

  interrupted = False
  try:
    for m in measurements:
      print(f"[{m.suite}] {m.name}: {m.description}", flush=True)
      res = h.run_measurement(m, config, log=lambda s: print(s, flush=True))
      if res.impls:
        print("  " + "; ".join(f"{i.name} {h.fmt_time(i.median)}"
                               for i in res.impls), flush=True)
      print(f"  ({res.wall_s:.1f} s)", flush=True)
      results.append(res)
      write(chart=False)
  except KeyboardInterrupt:
    interrupted = True
    print(f"interrupted after {len(results)} of {len(measurements)} "
          "measurements", flush=True)
  wall = time.perf_counter() - t0
  impl_rows, target_rows = tables(results)
  work = [row for r in results for row in h.work_rows(r, config)]
  print()
  print(h.text_table(h.IMPL_HEADER, impl_rows))
  print()
  print(h.text_table(h.TARGET_HEADER, target_rows))
  if work:
    print()
    print(h.text_table(h.WORK_HEADER, work))
  for n in notes(results):
    print("note:", n)
  write(chart=True)
  print(f"\nwrote {out / 'RESULTS.md'} ({wall:.0f} s)", flush=True)
  failed = [r.measurement.name for r in results if r.error]
  if failed:
    print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1
  return 2 if interrupted else 0


def main(argv=None) -> int:
  raw_argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(raw_argv)
  # torch and JAX take turns in this process: torch's OpenMP workers (with
  # --torch-threads > 1) sleep between ops, as in examples/torch_simulator
  # (a value in the environment is kept). With one thread there are no
  # workers and this changes nothing. Too late if torch is already loaded
  # (main called in-process): the notes then report the variable as is.
  if "torch" not in sys.modules:
    from jrollout.torch import share_cpu_with_torch  # noqa: PLC0415
    share_cpu_with_torch()
  if args.torch_threads > 0:
    import torch  # noqa: PLC0415
    torch.set_num_threads(args.torch_threads)
  if args.baseline is not None:
    return baseline.compare(
        args.baseline, rounds=args.rounds or 5, quick=args.quick,
        out=args.out or HERE / ("_quick" if args.quick else "_partial"))
  every = suites_registry.load(suites_registry.SUITES
                               + suites_registry.EXTRA)
  if args.smoke:
    measurements = suites_registry.smoke_cases(every)
    measurements = select(measurements, args.only)
  else:
    measurements = select(every, args.only, suites_registry.SUITES)
  if args.list:
    for m in measurements:
      extra = (" (run only when named)"
               if m.suite in suites_registry.EXTRA else "")
      print(f"{m.name:28s} [{m.suite}] {m.description}{extra}")
    return 0
  if not measurements:
    print(f"no measurement matches {args.only}", file=sys.stderr)
    return 2
  quick = args.quick or args.smoke
  rounds = args.rounds if args.rounds is not None else (
      1 if args.smoke else 2 if quick else 10)
  config = h.Config(rounds=rounds, quick=quick,
                    min_sample_s=0.002 if quick else 0.02,
                    max_reps=(1 if args.smoke else 20) if quick else 200)
  # Only a full, non-quick run replaces the saved results by default.
  out = args.out if args.out is not None else (
      HERE / "_quick" if quick else HERE / "_partial" if args.only
      else HERE / "results" / "suite")
  return run(measurements, config, out, argv=raw_argv)
