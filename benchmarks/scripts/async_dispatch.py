"""Does a jitted rollout loop dispatch asynchronously? check=True vs False.

``finish_rollout``'s traced write check is a host callback (called only on
failure). Its presence alone changes how JAX runs the program: through the
Python dispatch path and, on XLA:CPU, synchronously, so the call returns
only when the work is done. This prints, for the same loop with the check
on and off, the median time until the call returns and until its result is
ready.

    python -m benchmarks.scripts.async_dispatch
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

import jrollout as jr

T, E, UPDATES = 128, 64, 20


def make(check: bool):
  state = jr.register(jr.init(E, T), "obs", (4,))

  def update(state, _):
    def write(state, t):
      obs = jnp.sin(t + jnp.arange(E * 4, dtype=jnp.float32)).reshape(E, 4)
      return jr.update_at(state, t, {"obs": obs}), None
    state, _ = jax.lax.scan(write, state, jnp.arange(T))
    total = state.data["obs"].sum()
    return jr.finish_rollout(state, check=check), total

  return jax.jit(lambda s: jax.lax.scan(update, s, None, UPDATES)), state


def main() -> None:
  print(f"{UPDATES} rollouts of T={T}, E={E} per call; medians of 9 calls")
  for check in (True, False):
    fn, state = make(check)
    jax.block_until_ready(fn(state))
    returned, ready = [], []
    for _ in range(9):
      t0 = time.perf_counter()
      out = fn(state)
      t1 = time.perf_counter()
      jax.block_until_ready(out)
      returned.append(t1 - t0)
      ready.append(time.perf_counter() - t0)
    print(f"check={check!s:5}: call returns after "
          f"{statistics.median(returned) * 1e3:7.2f} ms, result ready after "
          f"{statistics.median(ready) * 1e3:7.2f} ms")


if __name__ == "__main__":
  main()
