"""The baseline switch: the hot paths of a git revision and of the checkout.

``python -m benchmarks --baseline REV`` extracts ``jrollout/`` of REV with
``git archive`` into a temporary folder, renames the package there to
``jrollout_base`` (in every import) and imports it beside the checkout's
``jrollout``, uncommitted edits included. Each hot-path row is built once
per tree through ``Api``, which picks the API that tree has, so a 0.x
revision and the 1.0 tree run the same work. Then, row by row, the two
trees are timed alternately, R interleaved rounds in an order rotated each
round, so that both see the same machine; separate processes on a shared
machine differ by more than the few percent this is meant to resolve. The
outputs of the two trees must be equal, and the compile rows time a fresh
trace, lowering and XLA compile apart from the run rows. The table gives
the medians and HEAD / REV; the same goes to ``baseline.json``.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import importlib
import io
import json
import pathlib
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness as h
from benchmarks import workloads

ROOT = pathlib.Path(__file__).resolve().parent.parent
BASE_PACKAGE = "jrollout_base"
TREES = ("HEAD", "REV")


@dataclasses.dataclass
class Row:
  """One hot path of one tree.

  Attributes:
    name: the row's name, shared by the two trees.
    run: does the work once and blocks until it is done; returns the output.
    check: maps ``run``'s output to host values that must be equal across
      the two trees (None: not compared).
    reps: calls per sample; None: calibrated (a compile needs one).
  """
  name: str
  run: Callable[[], Any]
  check: Callable[[Any], Any] | None = None
  reps: int | None = None


class Api:
  """The calls the rows make, on whichever API a jrollout tree has.

  ``jr`` is the package (``jrollout`` or ``jrollout_base``), ``jt`` its
  torch bridge or None without torch.
  """

  def __init__(self, jr: types.ModuleType, jt: types.ModuleType | None):
    self.jr, self.jt = jr, jt

  def empty(self, w: workloads.Workload) -> Any:
    state = self.jr.init(num_envs=w.num_envs, num_steps=w.num_steps)
    for key, shape in w.shapes.items():
      state = self.jr.register(state, key, shape=shape)
    return state

  def full(self, w: workloads.Workload, data: dict[str, np.ndarray]) -> Any:
    """A complete state holding ``data`` ``{key: [T, E, *shape]}``."""
    values = {k: jnp.asarray(v) for k, v in data.items()}
    if hasattr(self.jr, "update_all"):
      return jax.block_until_ready(self.jr.update_all(self.empty(w), values))
    return jax.block_until_ready(self.scan_write(self.empty(w), values))

  def scan_write(self, state: Any, data: dict[str, jax.Array]) -> Any:
    """``update_at`` of every step inside one ``lax.scan``."""
    steps = jnp.arange(next(iter(data.values())).shape[0])

    def body(s, step_and_values):
      step, values = step_and_values
      return self.jr.update_at(s, step, values), None
    return jax.lax.scan(body, state, (steps, data))[0]

  def make_batch(self, state: Any) -> dict[str, jax.Array]:
    out = self.jr.make_batch(state)
    return out[0] if isinstance(out, tuple) else out

  def writer_batch(self, writer: Any) -> dict[str, jax.Array]:
    if hasattr(writer, "make_batch"):
      return writer.make_batch()
    return self.make_batch(writer.state)

  def epoch(self, body: Callable, carry: Any, key: jax.Array, batch: Any,
            batch_size: int) -> Any:
    return self.jr.scan_minibatches(body, carry, key, batch, batch_size)[0]


def _sum_body(carry, minibatch):
  return {k: carry[k] + jnp.sum(v, axis=0) for k, v in minibatch.items()}, None


def writer_rollout(api: Api, quick: bool) -> Row:
  """W1 from a Python loop: ``RolloutWriter.update_at`` per step, the batch."""
  del quick
  w = workloads.W1
  steps = workloads.step_pool(w, 4)
  writer = api.jr.RolloutWriter(api.empty(w))

  def run():
    for t in range(w.num_steps):
      writer.update_at(t, steps[t % len(steps)])
    return jax.block_until_ready(api.writer_batch(writer))
  return Row("writer_W1_rollout", run, lambda batch: batch)


def _scan_inputs(api: Api, quick: bool) -> tuple[Any, dict[str, jax.Array]]:
  w = workloads.get("W2", quick)
  data = {k: jnp.asarray(v) for k, v in workloads.rollout(w).items()}
  return jax.block_until_ready(api.empty(w)), data


def scan_write(api: Api, quick: bool) -> Row:
  """W2: ``update_at`` of every step inside a jitted ``lax.scan``."""
  empty, data = _scan_inputs(api, quick)
  jitted = jax.jit(api.scan_write)
  return Row("scan_update_at_W2",
             lambda: jax.block_until_ready(jitted(empty, data)),
             api.make_batch)


def scan_write_compile(api: Api, quick: bool) -> Row:
  """The scan write's trace, lowering and compile, a fresh function each."""
  empty, data = _scan_inputs(api, quick)
  return Row("compile_scan_update_at_W2",
             lambda: jax.jit(lambda s, d: api.scan_write(s, d))
             .lower(empty, data).compile(), reps=1)


def make_batch(api: Api, quick: bool) -> Row:
  """W2: ``make_batch`` of a complete state, eager."""
  w = workloads.get("W2", quick)
  full = api.full(w, workloads.rollout(w))
  return Row("make_batch_W2",
             lambda: jax.block_until_ready(api.make_batch(full)),
             lambda batch: batch)


def _epoch_inputs(api: Api, quick: bool):
  w = workloads.get("W2", quick)
  size = workloads.batch_size("W2", 4096, quick)
  batch = jax.block_until_ready(
      api.make_batch(api.full(w, workloads.rollout(w))))
  zeros = {k: jnp.zeros(v.shape[1:], v.dtype) for k, v in batch.items()}

  def epoch(key, batch):
    return api.epoch(_sum_body, zeros, key, batch, size)
  return epoch, jax.random.key(0), batch


def epoch(api: Api, quick: bool) -> Row:
  """W2, B=4096: one shuffled epoch of ``scan_minibatches``, body sums."""
  fn, key, batch = _epoch_inputs(api, quick)
  jitted = jax.jit(fn)
  return Row("epoch_W2_B4096",
             lambda: jax.block_until_ready(jitted(key, batch)),
             lambda sums: sums)


def epoch_compile(api: Api, quick: bool) -> Row:
  """The epoch's trace, lowering and compile, a fresh function each."""
  fn, key, batch = _epoch_inputs(api, quick)
  return Row("compile_epoch_W2_B4096",
             lambda: jax.jit(lambda k, b: fn(k, b)).lower(key, batch)
             .compile(), reps=1)


def from_torch(api: Api, quick: bool) -> Row:
  """A host-loop step's tensors to JAX: ``from_torch`` of 1024 rows."""
  del quick
  if api.jt is None:
    raise h.Skip("torch is not installed")
  import torch  # noqa: PLC0415 - the optional torch extra
  tensors = {"obs": torch.ones(1024, 64), "reward": torch.ones(1024)}
  return Row("from_torch_step",
             lambda: jax.block_until_ready(api.jt.from_torch(tensors)),
             lambda arrays: arrays)


def to_torch(api: Api, quick: bool) -> Row:
  """A batch of 1024 rows to torch: ``to_torch``."""
  del quick
  if api.jt is None:
    raise h.Skip("torch is not installed")
  arrays = {"obs": jnp.ones((1024, 64)), "reward": jnp.ones(1024)}
  return Row("to_torch_step", lambda: api.jt.to_torch(arrays),
             lambda tensors: tensors)


# The hot-path rows in run order: ``build(api, quick) -> Row``.
ROWS = (writer_rollout, scan_write, scan_write_compile, make_batch, epoch,
        epoch_compile, from_torch, to_torch)


def _git(*args: str) -> bytes:
  return subprocess.run(["git", *args], cwd=ROOT, capture_output=True,
                        check=True, timeout=120).stdout


def resolve(rev: str) -> str:
  """The full commit hash of ``rev``; ValueError naming it if unknown."""
  try:
    return _git("rev-parse", "--verify", "--quiet",
                f"{rev}^{{commit}}").decode().strip()
  except subprocess.CalledProcessError:
    raise ValueError(f"--baseline: {rev!r} is not a commit of this "
                     "repository (expected a hash, tag or branch that "
                     "`git rev-parse` knows)") from None


def import_revision(commit: str, folder: pathlib.Path) -> types.ModuleType:
  """Imports ``jrollout/`` of ``commit`` as ``jrollout_base``."""
  archive = _git("archive", "--format=tar", commit, "jrollout")
  with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
    tar.extractall(folder, filter="data")
  package = folder / BASE_PACKAGE
  (folder / "jrollout").rename(package)
  for path in package.rglob("*.py"):
    path.write_text(re.sub(r"\bjrollout\b", BASE_PACKAGE, path.read_text()))
  sys.path.insert(0, str(folder))
  return importlib.import_module(BASE_PACKAGE)


def _bridge(package: str) -> types.ModuleType | None:
  try:
    return importlib.import_module(f"{package}.torch")
  except ImportError:
    return None


def measure(pair: dict[str, Row], rounds: int, min_sample_s: float
            ) -> dict[str, Any]:
  """Times one row of both trees in ``rounds`` interleaved rounds.

  Returns ``{"HEAD": {...}, "REV": {...}, "ratio": HEAD / REV medians,
  "round_ratios": [...]}``; raises AssertionError if the outputs differ.
  """
  first, values = {}, {}
  for tree, row in pair.items():
    t0 = time.perf_counter()
    value = row.run()
    first[tree] = time.perf_counter() - t0
    if row.check is not None:
      values[tree] = h.to_host(row.check(value))
  if values:
    h.assert_same("HEAD", "REV", values["HEAD"], values["REV"], 0.0, 0.0)
  reps = {tree: row.reps or h.calibrate(row.run, min_sample_s, 200)
          for tree, row in pair.items()}
  samples = {tree: [] for tree in pair}
  for r in range(rounds):
    order = TREES[r % 2:] + TREES[:r % 2]
    for tree in order:
      samples[tree].append(h.timed(pair[tree].run, reps[tree]))
  out: dict[str, Any] = {
      tree: {"median_s": statistics.median(s), "min_s": min(s),
             "max_s": max(s), "first_call_s": first[tree],
             "calls_per_sample": reps[tree], "samples_s": s}
      for tree, s in samples.items()}
  out["ratio"] = out["HEAD"]["median_s"] / out["REV"]["median_s"]
  out["round_ratios"] = [a / b for a, b in zip(samples["HEAD"],
                                               samples["REV"])]
  return out


def table(result: dict[str, Any]) -> list[list[str]]:
  rows_out = []
  for name, r in result["rows"].items():
    if "error" in r:
      rows_out.append([name, "-", "-", "-", "-", "FAILED: " + r["error"]])
      continue
    rr = r["round_ratios"]
    rows_out.append([name, h.fmt_time(r["HEAD"]["median_s"]),
                     h.fmt_time(r["REV"]["median_s"]),
                     f"{r['ratio']:.3f}",
                     f"{min(rr):.3f}-{max(rr):.3f}", ""])
  return rows_out


HEADER = ["row", "HEAD median", "REV median", "HEAD / REV",
          "per-round ratios", "note"]


def compare(rev: str, *, rounds: int = 5, quick: bool = False,
            out: pathlib.Path | None = None) -> int:
  """Runs the hot-path rows of ``rev`` and of the checkout side by side.

  Prints the table, writes ``out / "baseline.json"`` and returns the exit
  status: 1 if a row failed on either tree or their outputs differed.
  """
  commit = resolve(rev)
  import jrollout  # noqa: PLC0415 - the checkout's tree, imported by name

  from benchmarks import run  # noqa: PLC0415 - run imports this module
  result: dict[str, Any] = {
      "rev": rev, "rev_commit": commit, "head": head_label(),
      "rounds": rounds, "quick": quick, "machine": run.machine(),
      "versions": run.versions(torch_threads=False), "rows": {}}
  with tempfile.TemporaryDirectory(prefix="jrollout_base_") as folder:
    base = import_revision(commit, pathlib.Path(folder))
    apis = {"HEAD": Api(jrollout, _bridge("jrollout")),
            "REV": Api(base, _bridge(BASE_PACKAGE))}
    for build in ROWS:
      print(f"{build.__name__} ...", flush=True)
      pair = None
      try:
        pair = {tree: build(api, quick) for tree, api in apis.items()}
        name = pair["HEAD"].name
        result["rows"][name] = measure(pair, rounds,
                                       0.002 if quick else 0.02)
      except h.Skip as e:
        print(f"  skipped: {e}")
      except Exception as e:  # noqa: BLE001 - reported, the rows go on.
        result["rows"][build.__name__] = {"error": f"{type(e).__name__}: {e}"}
      del pair
  print()
  print(f"HEAD = {result['head']}, REV = {rev} ({commit[:10]}): medians of "
        f"{rounds} interleaved rounds"
        + (" (QUICK: not meaningful)" if quick else ""))
  print(h.text_table(HEADER, table(result)))
  if out is not None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "baseline.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {out / 'baseline.json'}")
  return 1 if any("error" in r for r in result["rows"].values()) else 0


def head_label() -> str:
  """The checkout's commit, and whether ``jrollout/`` has local edits."""
  head = _git("rev-parse", "--short", "HEAD").decode().strip()
  dirty = _git("status", "--porcelain", "--", "jrollout").decode().strip()
  return head + (" with uncommitted edits to jrollout/" if dirty else "")
