"""The hot paths of three jrollout trees side by side in ONE process.

Processes on the shared 2-core machine differ by up to 2x from one another
(the same tree, the same script), so ratios between versions measured in
separate processes cannot resolve a few percent. Here each tree is copied
with its package renamed (``jrollout`` -> ``jrollout_<tag>`` in every
import) and all are imported at once; each row's callables for the trees
are timed in rotating order, round after round, so every tree sees the
same machine. Prints one JSON line: per row and tree, the median and the
minimum seconds per call over R rounds.

    python benchmarks/results/api_0_2/ab_in_one_process.py R TAG=TREE ...
"""
import json, pathlib, re, shutil, sys, tempfile, time
import numpy as np, jax, jax.numpy as jnp
import torch

R = int(sys.argv[1])
TREES = dict(a.split("=", 1) for a in sys.argv[2:])
tmp = pathlib.Path(tempfile.mkdtemp())
mods = {}
for tag, tree in TREES.items():
  dst = tmp / f"jrollout_{tag}"
  shutil.copytree(pathlib.Path(tree) / "jrollout", dst)
  for f in dst.rglob("*.py"):
    f.write_text(re.sub(r"\bjrollout\b", f"jrollout_{tag}", f.read_text()))
sys.path.insert(0, str(tmp))
import importlib
for tag in TREES:
  jr = importlib.import_module(f"jrollout_{tag}")
  mods[tag] = (jr, importlib.import_module(f"jrollout_{tag}.torch"))


def rows_of(jr, jt):
  def state(E, T, spec):
    s = jr.init(num_envs=E, num_steps=T)
    for k, sh in spec.items():
      s = jr.register(s, k, sh)
    return s
  out = {}
  E, T = 64, 128                                     # W1
  spec = {"obs": (8,), "r": (), "done": ()}
  vals = {k: np.ones((E, *sh), np.float32) for k, sh in spec.items()}
  holder = [state(E, T, spec)]
  def inplace():
    s = holder[0]
    for t in range(T):
      s = jr.update_at_inplace(s, t, vals)
    holder[0] = s
  out["update_at_inplace_W1_rollout"] = (inplace, 1)
  writer = jr.RolloutWriter(state(E, T, spec))
  def write():
    for t in range(T):
      writer.update_at(t, vals)
    jax.block_until_ready(writer.make_batch())
  out["writer_W1_rollout"] = (write, 1)
  E2, T2 = 4096, 32                                  # W2
  spec2 = {"obs": (16,), "act": (), "r": (), "v": (), "lp": (), "done": ()}
  s2 = state(E2, T2, spec2)
  xs = {k: jnp.ones((T2, E2, *sh), jnp.float32) for k, sh in spec2.items()}
  scan = jax.jit(lambda s, xs: jax.lax.scan(
      lambda s, tx: (jr.update_at(s, tx[0], tx[1]), None), s,
      (jnp.arange(T2), xs))[0])
  out["scan_update_at_W2"] = (lambda: jax.block_until_ready(scan(s2, xs)), 5)
  s2 = jr.update_all(s2, xs)
  out["make_batch_W2"] = (
      lambda: jax.block_until_ready(jr.make_batch(s2)[0]), 5)
  batch, _ = jr.make_batch(s2)
  key = jax.random.key(0)
  f = lambda c, m: (c + sum(jnp.sum(x) for x in m.values()), None)
  ep = jax.jit(lambda k, b: jr.scan_minibatches(f, jnp.float32(0), k, b,
                                                4096)[0])
  out["epoch_W2_B4096"] = (lambda: ep(key, batch).block_until_ready(), 5)
  t = {"obs": torch.ones(1024, 4), "r": torch.ones(1024)}
  out["from_torch_step"] = (
      lambda: jax.block_until_ready(jt.from_torch(t)), 200)
  x = {"a": jnp.ones((1024, 4))}
  out["to_torch_step"] = (lambda: jt.to_torch(x), 200)
  return out


built = {tag: rows_of(*m) for tag, m in mods.items()}
tags = list(TREES)
result = {}
for row in built[tags[0]]:
  samples = {tag: [] for tag in tags}
  for tag in tags:             # warm up (compiles)
    fn, n = built[tag][row]
    fn(); fn()
  for r in range(R):
    for tag in tags[r % len(tags):] + tags[:r % len(tags)]:
      fn, n = built[tag][row]
      t0 = time.perf_counter()
      for _ in range(n):
        fn()
      samples[tag].append((time.perf_counter() - t0) / n)
  result[row] = {tag: {"median": float(np.median(s)), "min": float(np.min(s))}
                 for tag, s in samples.items()}
print(json.dumps(result))
