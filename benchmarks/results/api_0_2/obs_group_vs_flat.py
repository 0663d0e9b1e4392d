"""An observation-group field {policy: [E, 48], critic: [E, 60]} against the
same data as two flat fields, side by side in one process (issue 39).
Prints per row: median seconds per call over R rounds, ratio group / flat."""
import json, sys, time
import numpy as np, jax, jax.numpy as jnp
import jrollout as jr

R = int(sys.argv[1]) if len(sys.argv) > 1 else 11
E, T = 1024, 32
pol = np.ones((E, 48), np.float32); cri = np.ones((E, 60), np.float32)

def flat_state():
  s = jr.init(num_envs=E, num_steps=T)
  s = jr.register(s, "obs_policy", (48,)); s = jr.register(s, "obs_critic", (60,))
  return s
def group_state():
  return jr.register(jr.init(num_envs=E, num_steps=T), "obs",
                     like={"policy": pol, "critic": cri})
flat_step = lambda t: {"obs_policy": pol, "obs_critic": cri}
group_step = lambda t: {"obs": {"policy": pol, "critic": cri}}

def writer_rollout(make, step):
  w = jr.RolloutWriter(make())
  def run():
    for t in range(T):
      w.update_at(t, step(t))
    jax.block_until_ready(w.make_batch())
  return run

def inplace_rollout(make, step):
  holder = [make()]
  def run():
    s = holder[0]
    for t in range(T):
      s = jr.update_at_inplace(s, t, step(t))
    _, s = jr.make_batch(s); holder[0] = s
  return run

def scan_write(make, step):
  xs = jax.tree.map(lambda x: jnp.broadcast_to(x, (T, *x.shape)), step(0))
  f = jax.jit(lambda s, xs: jax.lax.scan(
      lambda s, tx: (jr.update_at(s, tx[0], tx[1]), None), s,
      (jnp.arange(T), xs))[0])
  s0 = make()
  return lambda: jax.block_until_ready(f(s0, xs))

def make_batch(make, step):
  s = jr.update_all(make(), jax.tree.map(
      lambda x: np.broadcast_to(x, (T, *x.shape)).copy(), step(0)))
  return lambda: jax.block_until_ready(jr.make_batch(s)[0])

def epoch(make, step):
  s = jr.update_all(make(), jax.tree.map(
      lambda x: np.broadcast_to(x, (T, *x.shape)).copy(), step(0)))
  b, _ = jr.make_batch(s)
  f = jax.jit(lambda k, b: jr.scan_minibatches(
      lambda c, m: (c + sum(jnp.sum(x) for x in jax.tree.leaves(m)), None),
      jnp.float32(0), k, b, 4096)[0])
  k = jax.random.key(0)
  return lambda: f(k, b).block_until_ready()

out = {}
for name, build in [("writer_rollout", writer_rollout), ("update_at_inplace_rollout", inplace_rollout),
                    ("scan_write", scan_write), ("make_batch", make_batch), ("epoch_B4096", epoch)]:
  runs = {"flat": build(flat_state, flat_step), "group": build(group_state, group_step)}
  for r in runs.values(): r(); r()
  samples = {k: [] for k in runs}
  for i in range(R):
    for k in (("flat", "group") if i % 2 == 0 else ("group", "flat")):
      t0 = time.perf_counter(); runs[k](); samples[k].append(time.perf_counter() - t0)
  fm, gm = np.median(samples["flat"]), np.median(samples["group"])
  out[name] = {"flat_s": fm, "group_s": gm, "group/flat": gm / fm}
print(json.dumps(out))
