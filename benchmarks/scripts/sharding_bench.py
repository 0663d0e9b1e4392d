"""Sharded minibatching: bytes moved between devices, and 1 vs 8 device time.

    python -m benchmarks.scripts.sharding_bench          # from the repo root
    python -m benchmarks.scripts.sharding_bench --quick  # smaller, fewer rounds

1. Bytes moved per epoch, read from the compiled HLO (SPMD-partitioned, one
   device's program): every collective op, its operand size per device
   (the issue's measure: "sum operand sizes of collectives"), times how often
   it runs per epoch (while-loop trip counts from XLA's
   ``known_trip_count``). Also shown: the bytes each device *receives* under
   the usual algorithms (all-gather: (G-1) x operand; ring all-reduce:
   2 (G-1)/G x operand; all-to-all and reduce-scatter: (G-1)/G x operand;
   collective-permute: operand). Rows:
   - ``minibatching only``: ``fn`` uses the minibatch but runs no collective,
     so what is left is jrollout's own data movement;
   - ``PPO-like epoch``: ``fn`` takes an MLP gradient step and averages it
     across devices (``pmean`` of the loss): the all-reduce is the user's;
   - ``reference``: the single-device ``jr.scan_minibatches`` under ``jit`` on
     the same sharded inputs, partitioned by XLA on its own (not a jrollout
     sharded mode; shown for comparison).
2. Epoch time on 1 and on 8 fake CPU devices with the same per-device work
   (each device: n rows, minibatches of b rows). The 8 fake devices share this
   machine's CPU cores, so the ratio measures the overhead of running 8
   programs and their collectives on shared cores, NOT a speed-up (on 8 real
   accelerators the ideal is 1.0x).

XLA_FLAGS is set for 8 host devices before JAX is imported.
"""

from __future__ import annotations

import os
import sys

if "jax" not in sys.modules:
  _flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (
        _flags + " --xla_force_host_platform_device_count=8").strip()

# JAX may start only after XLA_FLAGS is set: the imports come here.
import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jrollout as jr  # noqa: E402

AXIS = "envs"
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all",
               "collective-permute", "reduce-scatter")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
                "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
                "f64": 8, "c64": 8, "c128": 16}


# ------------------------------------------------------------- HLO reading


def _type_bytes(text: str) -> int:
  """Bytes of an HLO type, e.g. ``f32[4,16]{1,0}`` or a tuple of them."""
  total = 0
  for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", text):
    if dtype in _DTYPE_BYTES:
      total += _DTYPE_BYTES[dtype] * int(np.prod(
          [int(d) for d in dims.split(",") if d] or [1]))
  return total


def _group_size(line: str, default: int) -> int:
  m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
  if m:
    return len(m.group(1).split(","))
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)   # iota form
  if m:
    return int(m.group(2))
  return default


@dataclasses.dataclass
class Collective:
  kind: str
  operand_bytes: int     # per device, per execution
  group: int
  executions: int        # per call of the compiled function

  @property
  def received_bytes(self) -> float:
    """Bytes one device receives per execution, usual algorithms."""
    g, b = self.group, self.operand_bytes
    return {"all-gather": (g - 1) * b, "all-reduce": 2 * (g - 1) / g * b,
            "all-to-all": (g - 1) / g * b, "reduce-scatter": (g - 1) / g * b,
            "collective-permute": b}[self.kind]


def collectives(hlo: str, num_devices: int) -> list[Collective]:
  """Every collective of a compiled HLO module with its executions per call.

  Executions multiply the trip counts of the while loops around the op;
  a loop without a ``known_trip_count`` counts once (reported as such).
  """
  comps: dict[str, list[str]] = {}
  entry, current = None, None
  for line in hlo.splitlines():
    head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head and not line.startswith(" "):
      current = head.group(2)
      comps[current] = []
      if head.group(1):
        entry = current
      continue
    if current is not None and line.startswith(" "):
      comps[current].append(line)
  calls: dict[str, list[tuple[str, int]]] = {c: [] for c in comps}
  for comp, lines in comps.items():
    for line in lines:
      trip = 1
      if " while(" in line:
        m = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
        trip = int(m.group(1)) if m else 1
        for attr in ("body", "condition"):
          m = re.search(attr + r"=%?([\w.\-]+)", line)
          if m:
            calls[comp].append((m.group(1), trip))
        continue
      for attr in ("to_apply", "calls"):
        for m in re.finditer(attr + r"=%?([\w.\-]+)", line):
          calls[comp].append((m.group(1), 1))
      m = re.search(r"branch_computations=\{([^}]*)\}", line)
      if m:
        for name in re.findall(r"%?([\w.\-]+)", m.group(1)):
          calls[comp].append((name, 1))
  mult: dict[str, int] = {}

  def visit(comp: str, times: int) -> None:
    mult[comp] = mult.get(comp, 0) + times
    for callee, trip in calls.get(comp, ()):
      if callee in comps:
        visit(callee, times * trip)

  visit(entry, 1)
  found = []
  pattern = re.compile(r"=\s*(.+?)\s+(" + "|".join(COLLECTIVES) +
                       r")(-start)?\(")
  for comp, lines in comps.items():
    for line in lines:
      m = pattern.search(line)
      if not m or comp not in mult:
        continue
      kind, result = m.group(2), _type_bytes(m.group(1))
      group = _group_size(line, num_devices)
      operand = {"all-gather": result // group,
                 "reduce-scatter": result * group}.get(kind, result)
      found.append(Collective(kind, operand, group, mult[comp]))
  return found


def summarize(found: list[Collective]) -> dict[str, dict[str, float]]:
  out: dict[str, dict[str, float]] = {}
  for c in found:
    row = out.setdefault(c.kind, {"ops": 0, "executions": 0,
                                  "operand_bytes": 0, "received_bytes": 0})
    row["ops"] += 1
    row["executions"] += c.executions
    row["operand_bytes"] += c.operand_bytes * c.executions
    row["received_bytes"] += c.received_bytes * c.executions
  return out


# ------------------------------------------------------------- workload


@dataclasses.dataclass(frozen=True)
class Work:
  """A PPO-like rollout: per device ``envs_per_device`` envs x T steps."""
  num_steps: int = 128
  envs_per_device: int = 16
  obs_dim: int = 16
  hidden: int = 64
  minibatches: int = 8

  def batch_size(self, devices: int) -> int:
    return self.num_steps * self.envs_per_device * devices // self.minibatches


def make_state(work: Work, devices: int, seed: int = 0) -> jr.RolloutState:
  """A complete rollout of E = envs_per_device * devices envs (unsharded)."""
  num_envs = work.envs_per_device * devices
  rng = np.random.default_rng(seed)
  state = jr.init(num_envs, work.num_steps)
  shape = (work.num_steps, num_envs)
  values = {"obs": rng.standard_normal((*shape, work.obs_dim)),
            "action": rng.integers(0, 2, shape),
            "logp": rng.standard_normal(shape),
            "value": rng.standard_normal(shape),
            "advantage": rng.standard_normal(shape),
            "target": rng.standard_normal(shape)}
  for key, v in values.items():
    dtype = jnp.int32 if key == "action" else jnp.float32
    state = jr.register(state, key, v.shape[2:], dtype)
  return jr.update_all(state, {k: v.astype(np.int32 if k == "action"
                                            else np.float32)
                               for k, v in values.items()})


def row_bytes(state: jr.RolloutState) -> int:
  return sum(int(np.prod(v.shape[2:], dtype=np.int64)) * v.dtype.itemsize
             for v in state.data.values())


def init_params(work: Work, key):
  k1, k2 = jax.random.split(key)
  return {"w1": jax.random.normal(k1, (work.obs_dim, work.hidden)) * 0.1,
          "b1": jnp.zeros(work.hidden),
          "w2": jax.random.normal(k2, (work.hidden, 2)) * 0.1,
          "b2": jnp.zeros(2)}


def _loss(params, mb):
  """A small actor-style loss using every key of the batch."""
  h = jnp.tanh(mb["obs"] @ params["w1"] + params["b1"])
  logits = h @ params["w2"] + params["b2"]
  logp = jnp.take_along_axis(jax.nn.log_softmax(logits),
                             mb["action"][:, None], -1)[:, 0]
  ratio = jnp.exp(logp - mb["logp"])
  value = logits[:, 0]
  return (-(ratio * mb["advantage"]).mean() +
          0.5 * ((value - mb["target"]) ** 2).mean() +
          0.01 * (value - mb["value"]).mean())


def sgd_step_sharded(params, mb):
  loss, grads = jax.value_and_grad(
      lambda p: jax.lax.pmean(_loss(p, mb), AXIS))(params)
  return jax.tree_util.tree_map(lambda p, g: p - 1e-3 * g, params, grads), loss


def sgd_step_single(params, mb):
  loss, grads = jax.value_and_grad(_loss)(params, mb)
  return jax.tree_util.tree_map(lambda p, g: p - 1e-3 * g, params, grads), loss


def touch_step(carry, mb):
  """Uses every key, no collective: leaves only the minibatching's traffic."""
  return carry, sum(jnp.sum(v.astype(jnp.float32)) for v in mb.values())


def mesh_of(devices: int):
  return jax.make_mesh((devices,), (AXIS,), axis_types=(AxisType.Auto,),
                       devices=jax.devices()[:devices])


def epoch_fn(work: Work, devices: int, mode: str, step):
  mesh = mesh_of(devices)
  size = work.batch_size(devices)

  def epoch(params, key, state):
    if mode == "reference":
      return jr.scan_minibatches(step, params, key, state, size)
    return jr.scan_minibatches_sharded(step, params, key, state, size,
                                       mesh=mesh, axis=AXIS, mode=mode)
  return jax.jit(epoch), mesh


# ------------------------------------------------------------- measurements


def bytes_moved(work: Work, devices: int) -> list[dict]:
  state = make_state(work, devices)
  batch_bytes = row_bytes(state) * state.num_envs * state.num_steps
  params = init_params(work, jax.random.key(0))
  param_bytes = sum(x.size * x.dtype.itemsize
                    for x in jax.tree_util.tree_leaves(params))
  rows = []
  cases = [("minibatching only", "local", touch_step),
           ("minibatching only", "global", touch_step),
           ("PPO-like epoch", "local", sgd_step_sharded),
           ("PPO-like epoch", "global", sgd_step_sharded),
           ("reference: jr.scan_minibatches on sharded inputs (XLA "
            "partitions it alone)", "reference", sgd_step_single)]
  for what, mode, step in cases:
    fn, mesh = epoch_fn(work, devices, mode, step)
    sharded = jr.shard(state, mesh, AXIS)
    carry = jnp.float32(0) if step is touch_step else params
    hlo = fn.lower(carry, jax.random.key(1), sharded).compile().as_text()
    found = collectives(hlo, devices)
    rows.append({"case": what, "mode": mode, "devices": devices,
                 "batch_bytes": batch_bytes, "param_bytes": param_bytes,
                 "minibatches": work.minibatches,
                 "collectives": summarize(found)})
  return rows


def _time_once(fn, args) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t0


def epoch_times(work: Work, rounds: int) -> list[dict]:
  """Same per-device work (n rows, b-row minibatches) on 1 and 8 devices."""
  params = init_params(work, jax.random.key(0))
  cases = [("PPO-like", "jr.scan_minibatches (no mesh)", 1, "reference",
            sgd_step_single),
           ("PPO-like", "scan_minibatches_sharded", 1, "local",
            sgd_step_sharded),
           ("PPO-like", "scan_minibatches_sharded", 8, "local",
            sgd_step_sharded),
           ("PPO-like", "scan_minibatches_sharded", 8, "global",
            sgd_step_sharded),
           ("minibatching only", "scan_minibatches_sharded", 1, "local",
            touch_step),
           ("minibatching only", "scan_minibatches_sharded", 8, "local",
            touch_step),
           ("minibatching only", "scan_minibatches_sharded", 8, "global",
            touch_step)]
  prepared = []
  for _group, _what, devices, mode, step in cases:
    fn, mesh = epoch_fn(work, devices, mode, step)
    state = make_state(work, devices)
    if mode != "reference":
      state = jr.shard(state, mesh, AXIS)
    carry = jnp.float32(0) if step is touch_step else params
    prepared.append((fn, (carry, jax.random.key(1), state)))
  for fn, args in prepared:   # compile and warm up
    for _ in range(2):
      _time_once(fn, args)
  samples = [[] for _ in prepared]
  for _ in range(rounds):   # interleaved rounds: drift hits every case alike
    for i, (fn, args) in enumerate(prepared):
      samples[i].append(_time_once(fn, args))
  medians = [statistics.median(x) for x in samples]
  rows = []
  for (group, what, devices, mode, _), times, med in zip(cases, samples,
                                                         medians):
    # The ratio is to the same group's local mode on 1 device.
    base = next(m for c, m in zip(cases, medians)
                if c[0] == group and c[2] == 1 and c[3] == "local")
    rows.append({"case": f"{group}: {what}", "devices": devices,
                 "mode": mode,
                 "rows_per_device": work.num_steps * work.envs_per_device,
                 "rows_per_device_minibatch": work.batch_size(devices) //
                 devices,
                 "median_ms": med * 1e3, "min_ms": min(times) * 1e3,
                 "max_ms": max(times) * 1e3,
                 "vs_local_1_device": med / base})
  return rows


def _kb(x: float) -> str:
  return f"{x / 1024:,.1f} KiB"


def report(moved: list[dict], times: list[dict], work: Work) -> str:
  lines = []
  first = moved[0]
  d = first["devices"]
  lines.append(
      f"## Bytes moved between devices per epoch ({d} devices; batch "
      f"{_kb(first['batch_bytes'])} = E {work.envs_per_device * d} x T "
      f"{work.num_steps} rows; M = {first['minibatches']} minibatches; "
      f"gradient {_kb(first['param_bytes'])})\n")
  lines.append("| case | mode | collectives (ops x executions/epoch) | sum of "
               "operand bytes / device | bytes received / device |")
  lines.append("| --- | --- | --- | --- | --- |")
  for row in moved:
    colls = row["collectives"]
    desc = ", ".join(f"{k} {v['ops']}x{v['executions'] // max(v['ops'], 1)}"
                     for k, v in sorted(colls.items())) or "none"
    operand = sum(v["operand_bytes"] for v in colls.values())
    received = sum(v["received_bytes"] for v in colls.values())
    lines.append(f"| {row['case']} | {row['mode']} | {desc} | "
                 f"{_kb(operand)} | {_kb(received)} |")
  lines.append("")
  lines.append("## Epoch time, same per-device work (fake CPU devices: "
               "overhead, not speed-up)\n")
  lines.append("| case | devices | mode | rows / device | minibatch rows / "
               "device | median ms | min-max ms | vs local on 1 device |")
  lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
  for row in times:
    lines.append(f"| {row['case']} | {row['devices']} | {row['mode']} | "
                 f"{row['rows_per_device']} | "
                 f"{row['rows_per_device_minibatch']} | "
                 f"{row['median_ms']:.2f} | {row['min_ms']:.2f}-"
                 f"{row['max_ms']:.2f} | {row['vs_local_1_device']:.2f}x |")
  lines.append("")
  lines.append(
      f"Machine: {platform.machine()}, {os.cpu_count()} CPU core(s) visible, "
      f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform}"
      " device(s). The 8 fake devices share those cores, so 8 devices doing "
      "8x the total work take longer than 1: that is the cost of 8 programs "
      "on shared cores plus the collectives, not a measure of scaling.")
  return "\n".join(lines)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="a smaller workload and 3 rounds (smoke test)")
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--json", help="also write the results here")
  args = parser.parse_args(argv)
  if jax.device_count() < 8:
    raise SystemExit(f"needs 8 devices, found {jax.device_count()}; run as "
                     "a fresh process so that XLA_FLAGS takes effect")
  work = Work(num_steps=32, envs_per_device=4) if args.quick else Work()
  rounds = 3 if args.quick else args.rounds
  moved = bytes_moved(work, 8)
  times = epoch_times(work, rounds)
  print(report(moved, times, work))
  result = {"work": dataclasses.asdict(work), "bytes_moved": moved,
            "epoch_times": times, "cpu_count": os.cpu_count(),
            "jax": jax.__version__}
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=2)
  return result


if __name__ == "__main__":
  main()
