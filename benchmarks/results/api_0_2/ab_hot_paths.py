"""Hot-path timings of one jrollout tree (PYTHONPATH picks the tree).

Prints one JSON line: median seconds per call of each row over R samples.
Rows use only names that 0.1 and 0.2 share.
"""
import json, sys, time
import numpy as np, jax, jax.numpy as jnp
import jrollout as jr
import jrollout.torch as jt
import torch

R = int(sys.argv[1]) if len(sys.argv) > 1 else 15

def med(fn, n):
  fn()
  out = []
  for _ in range(R):
    t0 = time.perf_counter()
    for _ in range(n):
      fn()
    out.append((time.perf_counter() - t0) / n)
  return float(np.median(out))

rows = {}
# W1 step loop: update_at_inplace, E=64, T=128, 3 keys
E, T = 64, 128
spec = {"obs": (8,), "r": (), "done": ()}
def fresh():
  s = jr.init(num_envs=E, num_steps=T)
  for k, sh in spec.items():
    s = jr.register(s, k, sh)
  return s
vals = {k: np.ones((E, *sh), np.float32) for k, sh in spec.items()}
holder = [fresh()]
def loop():
  s = holder[0]
  for t in range(T):
    s = jr.update_at_inplace(s, t, vals)
  holder[0] = s
rows["update_at_inplace_W1_rollout"] = med(loop, 1)
# make_batch W2: E=4096, T=32
E2, T2 = 4096, 32
s2 = jr.init(num_envs=E2, num_steps=T2)
for k, sh in {"obs": (16,), "act": (), "r": (), "v": (), "lp": (), "done": ()}.items():
  s2 = jr.register(s2, k, sh)
s2 = jr.update_all(s2, {k: jnp.ones(v.shape, v.dtype) for k, v in s2.data.items()})
def mb():
  b, _ = jr.make_batch(s2)
  jax.block_until_ready(b)
rows["make_batch_W2"] = med(mb, 5)
batch, _ = jr.make_batch(s2)
key = jax.random.key(0)
f = lambda c, m: (c + sum(jnp.sum(x) for x in m.values()), None)
ep = jax.jit(lambda k, b: jr.scan_minibatches(f, jnp.float32(0), k, b, 4096)[0])
rows["epoch_W2_B4096"] = med(lambda: ep(key, batch).block_until_ready(), 5)
# bridge, small step dict
t = {"obs": torch.ones(1024, 4), "r": torch.ones(1024)}
rows["from_torch_step"] = med(lambda: jax.block_until_ready(jt.from_torch(t)), 200)
x = {"a": jnp.ones((1024, 4))}
rows["to_torch_step"] = med(lambda: jt.to_torch(x), 200)
print(json.dumps({"version": jr.__version__, **rows}))
