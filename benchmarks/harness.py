"""The timing method, written once: interleaved rounds, medians, targets.

A ``Measurement`` is a set of named implementations (``Impl``) of the same
work. For each one the harness

1. calls ``setup()`` (untimed), which returns ``run``; ``run()`` does the
   work once and returns only when it is done (JAX implementations call
   ``jax.block_until_ready`` on their outputs; torch on the CPU is
   synchronous);
2. times a first call (reported as "first call": for JAX this includes
   tracing and compilation);
3. turns the first call's output into a comparable value with ``Impl.check``
   and asserts, once and untimed, that every implementation that has one
   computes the same result;
4. calibrates how many back-to-back calls make one sample (at least
   ``Config.min_sample_s`` long, so that microsecond calls are not lost in
   timer noise); a sample's time is divided by that count.

Then come ``Config.rounds`` rounds; each round runs every implementation once,
in an order rotated by one each round, so that slow drifts of a shared
machine (other processes, thermal state) hit every implementation alike.
The report gives per implementation the median, min and max over rounds, the
ratio of medians to the measurement's baseline and, for each target, the
ratio of medians, the median (min-max) of the per-round ratios and
PASS/MISS.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
import gc
import math
import resource
import statistics
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class Skip(Exception):
  """Raised by ``Measurement.build`` (or an impl's setup) to skip, with why."""


@dataclasses.dataclass(frozen=True)
class Config:
  """Run options shared by every measurement.

  Attributes:
    rounds: R, the number of interleaved rounds.
    quick: smoke-test mode: small workloads, few rounds, numbers not
      meaningful.
    min_sample_s: a sample repeats ``run()`` until it lasts about this long.
    max_reps: at most this many calls per sample.
    torch_device: where the torch implementations put their tensors
      ("cpu", or "cuda" for the GPU run: ``benchmarks/gpu/bench.py``).
      Rows that only make sense on the host (numpy bounds and copies, the
      CPU write path's diagnoses) are left out when it is not "cpu".
  """
  rounds: int = 10
  quick: bool = False
  min_sample_s: float = 0.02
  max_reps: int = 200
  torch_device: str = "cpu"

  @property
  def on_host(self) -> bool:
    """True when torch runs on the CPU: host-only rows are built."""
    return self.torch_device == "cpu"


@dataclasses.dataclass
class Impl:
  """One implementation of a measurement's work.

  Attributes:
    name: unique within the measurement; targets refer to it.
    setup: untimed; returns ``run``, a no-argument callable that does the
      work once, blocks until it is done and returns its output.
    kind: the family, used for the chart's colours: "jrollout", "torch",
      "jax-idiom", "numpy", "flashbax" or "reference".
    check: maps the first call's output to a host value (nested dicts of
      numpy arrays or scalars) compared across implementations; None to
      take no part in the comparison.
    reps: fixed calls per sample (None: calibrated).
    timed: False for a reference result that only takes part in the
      comparison (e.g. sums computed by a numpy model); it is not reported.
  """
  name: str
  setup: Callable[[], Callable[[], Any]]
  kind: str = "reference"
  check: Callable[[Any], Any] | None = None
  reps: int | None = None
  timed: bool = True


@dataclasses.dataclass(frozen=True)
class Target:
  """``subject / baseline <= limit``, or ``subject <= limit`` seconds.

  Attributes:
    subject: the implementation under test.
    baseline: the implementation it is compared with; None for an absolute
      limit in seconds on the subject's median.
    limit: the largest passing ratio (or seconds).
    label: where the target comes from / what it means.
    optional: the target is dropped, not an error, when ``build`` did not
      return one of its implementations (a host-only row on a GPU run).
  """
  subject: str
  baseline: str | None
  limit: float
  label: str = ""
  optional: bool = False


@dataclasses.dataclass
class Measurement:
  """A named comparison.

  Attributes:
    name: unique, used by ``--only``.
    description: one line for the report.
    build: ``build(config) -> list[Impl]``; may raise ``Skip``. Large
      inputs should be created here or in ``setup`` so that they live only
      while the measurement runs.
    baseline: the implementation the "x baseline" column divides by.
    targets: the checked ratios.
    rtol, atol: tolerances of the result comparison (default: exact).
    max_rounds: cap on ``Config.rounds`` (for slow measurements such as
      compilation).
    work: ``work(config)``, the units of work one call does (e.g. env steps
      of a training run); the report then gives units per second.
    work_unit: what ``work`` counts, e.g. "env steps".
    suite: filled in by the registry (the module it comes from).
  """
  name: str
  description: str
  build: Callable[[Config], list[Impl]]
  baseline: str | None = None
  targets: Sequence[Target] = ()
  rtol: float = 0.0
  atol: float = 0.0
  max_rounds: int | None = None
  work: Callable[[Config], float] | None = None
  work_unit: str = ""
  suite: str = ""


@dataclasses.dataclass
class ImplResult:
  name: str
  kind: str
  first_s: float
  samples: list[float]
  reps: int
  cpu_samples: list[float] = dataclasses.field(default_factory=list)

  @property
  def cpu_per_wall(self) -> float | None:
    """Process CPU seconds (all threads) per wall second over the samples.

    Above 1: the run kept more than one core busy (a thread pool at work,
    or spinning); the sample loop itself is one thread.
    """
    if not self.cpu_samples or not sum(self.samples):
      return None
    return sum(self.cpu_samples) / sum(self.samples)

  @property
  def median(self) -> float:
    return statistics.median(self.samples)

  @property
  def min(self) -> float:
    return min(self.samples)

  @property
  def max(self) -> float:
    return max(self.samples)


@dataclasses.dataclass
class TargetResult:
  target: Target
  value: float                 # ratio of medians, or seconds
  round_ratios: list[float]    # empty for absolute targets

  @property
  def passed(self) -> bool:
    return self.value <= self.target.limit


@dataclasses.dataclass
class MeasurementResult:
  measurement: Measurement
  impls: list[ImplResult] = dataclasses.field(default_factory=list)
  targets: list[TargetResult] = dataclasses.field(default_factory=list)
  compared: list[str] = dataclasses.field(default_factory=list)
  skipped: str | None = None
  error: str | None = None
  rounds: int = 0
  wall_s: float = 0.0

  def impl(self, name: str) -> ImplResult:
    for r in self.impls:
      if r.name == name:
        return r
    raise KeyError(name)


def cpu_seconds(who: int = resource.RUSAGE_SELF) -> float:
  """User + system CPU time of this process (or ``RUSAGE_CHILDREN``), s."""
  usage = resource.getrusage(who)
  return usage.ru_utime + usage.ru_stime


def to_host(tree: Any) -> Any:
  """A host copy of a result pytree (jax arrays, torch tensors, numpy).

  JAX arrays are copied on the device first: ``np.asarray`` of a CPU array
  is a zero-copy view, and a live view would stop the array from being
  donated later (a donating write would then copy its storage).
  """
  def leaf(x):
    if isinstance(x, jax.Array):
      return np.array(jnp.array(x, copy=True))
    if type(x).__module__.startswith("torch"):
      return x.detach().cpu().numpy().copy()
    return np.array(x, copy=True)
  return jax.tree_util.tree_map(leaf, tree)


def assert_same(name: str, ref_name: str, got: Any, want: Any, rtol: float,
                atol: float, path: str = "") -> None:
  """Asserts two host results are equal (dicts compared key by key)."""
  if isinstance(want, dict):
    if not isinstance(got, dict) or sorted(got) != sorted(want):
      have = sorted(got) if isinstance(got, dict) else type(got).__name__
      raise AssertionError(
          f"{name} vs {ref_name}{path}: keys {have} != {sorted(want)}")
    for k in want:
      assert_same(name, ref_name, got[k], want[k], rtol, atol, f"{path}[{k!r}]")
    return
  got, want = np.asarray(got), np.asarray(want)
  if got.shape != want.shape:
    raise AssertionError(f"{name} vs {ref_name}{path}: shape {got.shape} != "
                         f"{want.shape}")
  np.testing.assert_allclose(got, want, rtol=rtol, atol=atol,
                             err_msg=f"{name} vs {ref_name}{path}")


def timed(run: Callable[[], Any], reps: int) -> float:
  """Wall seconds per call of ``run`` over ``reps`` back-to-back calls."""
  return _timed_cpu(run, reps)[0]


def _timed_cpu(run: Callable[[], Any], reps: int) -> tuple[float, float]:
  """Seconds per call: ``(wall, process CPU time of all threads)``."""
  gc_was = gc.isenabled()
  gc.disable()
  try:
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(reps):
      run()
    t1, c1 = time.perf_counter(), time.process_time()
    return (t1 - t0) / reps, (c1 - c0) / reps
  finally:
    if gc_was:
      gc.enable()


def run_measurement(m: Measurement, config: Config,
                    log: Callable[[str], None] = print) -> MeasurementResult:
  """Runs one measurement (see the module docstring for the method)."""
  result = MeasurementResult(m)
  t_start = time.perf_counter()
  try:
    _run(m, config, result)
  except Skip as e:
    result.skipped = str(e)
    log(f"  skipped: {e}")
  except Exception as e:  # noqa: BLE001 - reported, the suite goes on.
    result.error = f"{type(e).__name__}: {e}"
    log(f"  ERROR: {result.error}")
    log(traceback.format_exc())
  result.wall_s = time.perf_counter() - t_start
  gc.collect()
  return result


def calibrate(run: Callable[[], Any], min_sample_s: float,
              max_reps: int) -> int:
  """Calls per sample so that a sample lasts about ``min_sample_s``.

  A few single calls (also more warm-up); the fastest sets the count.
  """
  t = timed(run, 1)
  for _ in range(2):
    if t * 3 > min_sample_s:
      break
    t = min(t, timed(run, 1))
  return max(1, min(max_reps, math.ceil(min_sample_s / max(t, 1e-9))))


def _targets(m: Measurement, names: list[str]) -> list[Target]:
  """``m``'s targets whose implementations were built; unknown names fail."""
  if len(set(names)) != len(names):
    raise ValueError(f"{m.name}: duplicate implementation names {names}")
  targets = []
  for t in m.targets:
    missing = [n for n in (t.subject, t.baseline)
               if n is not None and n not in names]
    if missing and not t.optional:
      raise ValueError(f"{m.name}: target names unknown impl {missing[0]!r}")
    if not missing:
      targets.append(t)
  return targets


def _first_calls(m: Measurement, impls: list[Impl],
                 result: MeasurementResult) -> tuple[dict, dict]:
  """Sets up every impl, times its first call and compares the results.

  Returns ``(runs, first-call seconds)`` of the timed implementations.
  """
  runs, firsts = {}, {}
  ref_name, ref_value = None, None
  for impl in impls:
    run = impl.setup()
    t0 = time.perf_counter()
    out = run()
    firsts[impl.name] = time.perf_counter() - t0
    if impl.check is not None:
      value = to_host(impl.check(out))
      if ref_name is None:
        ref_name, ref_value = impl.name, value
      else:
        assert_same(impl.name, ref_name, value, ref_value, m.rtol, m.atol)
      result.compared.append(impl.name)
    del out
    if impl.timed:
      runs[impl.name] = run
  return runs, firsts


def _run(m: Measurement, config: Config, result: MeasurementResult) -> None:
  impls = m.build(config)
  targets = _targets(m, [i.name for i in impls])
  runs, firsts = _first_calls(m, impls, result)
  impls = [i for i in impls if i.timed]
  names = [i.name for i in impls]
  gc.collect()
  reps = {i.name: i.reps if i.reps is not None else
          calibrate(runs[i.name], config.min_sample_s, config.max_reps)
          for i in impls}

  rounds = config.rounds
  if m.max_rounds is not None:  # slow measurements: capped, 1 in quick mode
    rounds = 1 if config.quick else min(rounds, m.max_rounds)
  rounds = max(1, rounds)
  samples = {n: [] for n in names}
  cpu = {n: [] for n in names}
  for r in range(rounds):
    k = r % len(names)
    for name in names[k:] + names[:k]:
      wall_s, cpu_s = _timed_cpu(runs[name], reps[name])
      samples[name].append(wall_s)
      cpu[name].append(cpu_s)
  result.rounds = rounds
  for impl in impls:
    result.impls.append(ImplResult(impl.name, impl.kind, firsts[impl.name],
                                   samples[impl.name], reps[impl.name],
                                   cpu[impl.name]))
  for t in targets:
    subj = result.impl(t.subject)
    if t.baseline is None:
      result.targets.append(TargetResult(t, subj.median, []))
    else:
      base = result.impl(t.baseline)
      ratios = [a / b for a, b in zip(subj.samples, base.samples)]
      result.targets.append(TargetResult(t, subj.median / base.median, ratios))


# ---------------------------------------------------------------- formatting

def fmt_time(s: float) -> str:
  """Seconds with 3 significant digits and a unit."""
  if s != s:  # NaN
    return "-"
  for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)):
    if s >= scale or unit == "ns":
      return f"{s / scale:.3g} {unit}"
  return f"{s:g} s"


def fmt_ratio(x: float) -> str:
  return f"{x:.3g}x" if x < 100 else f"{x:.0f}x"


def impl_rows(res: MeasurementResult) -> list[list[str]]:
  """Rows of the per-implementation table."""
  rows = []
  m = res.measurement
  base = None
  if m.baseline is not None and res.impls:
    try:
      base = res.impl(m.baseline).median
    except KeyError:
      base = None
  for r in res.impls:
    ratio = "" if base is None else fmt_ratio(r.median / base)
    if m.baseline == r.name:
      ratio = "baseline"
    cpu = r.cpu_per_wall
    rows.append([m.name, r.name, fmt_time(r.first_s), fmt_time(r.median),
                 fmt_time(r.min), fmt_time(r.max), ratio, str(r.reps),
                 "" if cpu is None else f"{cpu:.2f}"])
  return rows


IMPL_HEADER = ["measurement", "implementation", "first call", "median", "min",
               "max", "vs baseline", "calls/sample", "CPU/wall"]
TARGET_HEADER = ["measurement", "check", "value", "per-round ratio median "
                 "[min-max]", "target", "result"]


def target_rows(res: MeasurementResult) -> list[list[str]]:
  rows = []
  for t in res.targets:
    tg = t.target
    if tg.baseline is None:
      check = f"{tg.subject} (seconds)"
      value = fmt_time(t.value)
      per_round = ""
      target = f"<= {fmt_time(tg.limit)}"
    else:
      check = f"{tg.subject} / {tg.baseline}"
      value = fmt_ratio(t.value)
      rr = t.round_ratios
      per_round = (f"{fmt_ratio(statistics.median(rr))} "
                   f"[{fmt_ratio(min(rr))}-{fmt_ratio(max(rr))}]")
      target = f"<= {tg.limit:g}x"
    if tg.label:
      target += f" ({tg.label})"
    rows.append([res.measurement.name, check, value, per_round, target,
                 "PASS" if t.passed else "MISS"])
  return rows


WORK_HEADER = ["measurement", "implementation", "work per call", "median",
               "per second"]


def work_rows(res: MeasurementResult, config: Config) -> list[list[str]]:
  """Rows of the throughput table: work per call over the median time."""
  m = res.measurement
  if m.work is None or not res.impls:
    return []
  n = m.work(config)
  return [[m.name, r.name, f"{n:,.0f} {m.work_unit}", fmt_time(r.median),
           f"{n / r.median:,.0f} {m.work_unit}/s"] for r in res.impls]


def text_table(header: list[str], rows: list[list[str]]) -> str:
  """A plain fixed-width table for stdout."""
  widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
  def line(cells):
    return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))
  out = [line(header), line(["-" * w for w in widths])]
  out += [line(r) for r in rows]
  return "\n".join(out)


def md_table(header: list[str], rows: list[list[str]]) -> str:
  """A GitHub markdown table."""
  def esc(c):
    return str(c).replace("|", "\\|")
  out = ["| " + " | ".join(header) + " |",
         "|" + "|".join("---" for _ in header) + "|"]
  out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
  return "\n".join(out)
