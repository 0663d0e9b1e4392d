"""Hot-path timings of one jrollout tree (PYTHONPATH picks the tree), the
rows issue 39 names: writes W1 (update_at_inplace and the writer, from a
Python loop), a jitted scan of update_at (W2), make_batch, an epoch, and
the torch bridge. Names that 0.1 and 0.2 share only.

Prints one JSON line: per row, the median and the minimum seconds per call
over R samples (``row`` and ``row:min``; the minimum is the steadier on a
shared machine).
"""
import json, sys, time
import numpy as np, jax, jax.numpy as jnp
import jrollout as jr
import jrollout.torch as jt
import torch

R = int(sys.argv[1]) if len(sys.argv) > 1 else 9


MINS = {}


def med(fn, n):
  fn()
  out = []
  for _ in range(R):
    t0 = time.perf_counter()
    for _ in range(n):
      fn()
    out.append((time.perf_counter() - t0) / n)
  MINS[len(MINS)] = float(np.min(out))
  return float(np.median(out))


def state(E, T, spec):
  s = jr.init(num_envs=E, num_steps=T)
  for k, sh in spec.items():
    s = jr.register(s, k, sh)
  return s


rows = {}
E, T = 64, 128                               # W1
spec = {"obs": (8,), "r": (), "done": ()}
vals = {k: np.ones((E, *sh), np.float32) for k, sh in spec.items()}
holder = [state(E, T, spec)]
def inplace():
  s = holder[0]
  for t in range(T):
    s = jr.update_at_inplace(s, t, vals)
  holder[0] = s
rows["update_at_inplace_W1_rollout"] = med(inplace, 1)
writer = jr.RolloutWriter(state(E, T, spec))
def write():
  for t in range(T):
    writer.update_at(t, vals)
  jax.block_until_ready(writer.make_batch())
rows["writer_W1_rollout"] = med(write, 1)

E2, T2 = 4096, 32                            # W2
spec2 = {"obs": (16,), "act": (), "r": (), "v": (), "lp": (), "done": ()}
s2 = state(E2, T2, spec2)
xs = {k: jnp.ones((T2, E2, *sh), jnp.float32) for k, sh in spec2.items()}
scan = jax.jit(lambda s, xs: jax.lax.scan(
    lambda s, tx: (jr.update_at(s, tx[0], tx[1]), None), s,
    (jnp.arange(T2), xs))[0])
rows["scan_update_at_W2"] = med(lambda: jax.block_until_ready(scan(s2, xs)), 5)
s2 = jr.update_all(s2, xs)
def mb():
  b, _ = jr.make_batch(s2)
  jax.block_until_ready(b)
rows["make_batch_W2"] = med(mb, 5)
batch, _ = jr.make_batch(s2)
key = jax.random.key(0)
f = lambda c, m: (c + sum(jnp.sum(x) for x in m.values()), None)
ep = jax.jit(lambda k, b: jr.scan_minibatches(f, jnp.float32(0), k, b, 4096)[0])
rows["epoch_W2_B4096"] = med(lambda: ep(key, batch).block_until_ready(), 5)

t = {"obs": torch.ones(1024, 4), "r": torch.ones(1024)}
rows["from_torch_step"] = med(lambda: jax.block_until_ready(jt.from_torch(t)), 200)
x = {"a": jnp.ones((1024, 4))}
rows["to_torch_step"] = med(lambda: jt.to_torch(x), 200)
mins = {f"{k}:min": MINS[i] for i, k in enumerate(rows)}
print(json.dumps({"version": jr.__version__, **rows, **mins}))
