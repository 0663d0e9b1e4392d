"""One process of the two-process ``jax.distributed`` test (test_sharding.py).

``python -m tests._multihost_worker PROCESS_ID NUM_PROCESSES PORT OUT.json``
(from the repository root) starts JAX with 4 fake CPU devices, joins the
others through ``jax.distributed.initialize`` (CPU collectives over gloo;
``tests._helpers.start_worker``, shared with ``_checkpoint_worker``) and
runs ``compute`` on a mesh over every process's devices. ``compute`` is also
run in-process on 8 devices by the test, which compares the two.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from tests import _helpers   # imports no JAX: start_worker sets XLA_FLAGS

T, E, B = 4, 16, 16


def compute(jax, jr, mesh) -> dict:
  """A rollout written under jit, its write check, and two epochs per mode."""
  jnp = jax.numpy
  rng = np.random.default_rng(0)
  obs = rng.standard_normal((T, E, 3)).astype(np.float32)
  target = rng.standard_normal((T, E)).astype(np.float32)
  state = jr.register(jr.register(jr.init(E, T), "obs", (3,)), "target")
  state = jr.shard(state, mesh)   # the same zeros on every process

  def fill(state):
    def body(s, t):
      return jr.update_at(s, t, {"obs": jnp.asarray(obs)[t],
                                 "target": jnp.asarray(target)[t]}), None
    return jax.lax.scan(body, state, jnp.arange(T))[0]

  state = jax.jit(fill)(state)
  state = jr.finish_rollout(state)   # the write check, on replicated counts

  def sgd(w, mb):
    def loss_fn(w):
      err = mb["obs"] @ w - mb["target"]
      return jax.lax.pmean(jnp.mean(err ** 2), "envs")
    loss, grads = jax.value_and_grad(loss_fn)(w)
    return w - 0.1 * grads, loss

  out = {"spec": str(state.data["obs"].sharding.spec)}
  for mode in ("local", "global"):
    w, losses = jax.jit(lambda w, k, s, mode=mode: jr.scan_minibatches(
        sgd, w, k, s, B, mesh=mesh, mode=mode, num_epochs=2))(
            jnp.zeros(3, jnp.float32), jax.random.key(0), state)
    # Replicated values are readable on every process; losses [D, ...] are
    # equal across devices (pmean), so device 0's row stands for all.
    out[mode] = {"w": np.asarray(w).tolist(),
                 "loss": np.asarray(losses.addressable_shards[0].data)[0]
                 .tolist()}
  return out


def main(argv) -> None:
  jax, jr, mesh, (path,) = _helpers.start_worker(argv)
  result = compute(jax, jr, mesh)
  result["process_count"] = jax.process_count()
  result["device_count"] = jax.device_count()
  with open(path, "w") as f:
    json.dump(result, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv[1:])
