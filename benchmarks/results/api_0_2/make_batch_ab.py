import time, numpy as np, jax, jax.numpy as jnp, jrollout as jr
E2, T2 = 4096, 32
s2 = jr.init(num_envs=E2, num_steps=T2)
for k, sh in {"obs": (16,), "act": (), "r": (), "v": (), "lp": (), "done": ()}.items():
  s2 = jr.register(s2, k, sh)
s2 = jr.update_all(s2, {k: jnp.ones(v.shape, v.dtype) for k, v in s2.data.items()})
for _ in range(5): jax.block_until_ready(jr.make_batch(s2)[0])
ts = []
for _ in range(40):
  t0 = time.perf_counter(); jax.block_until_ready(jr.make_batch(s2)[0]); ts.append(time.perf_counter() - t0)
print(jr.__version__, round(float(np.median(ts))*1e6), round(float(np.percentile(ts, 25))*1e6))
