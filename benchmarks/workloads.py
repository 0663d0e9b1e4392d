"""The workloads of the issues, and deterministic data for them.

W1: 64 envs x 128 steps, obs (64,), actions (8,) and four float32 scalars.
W2: 4096 envs x 32 steps, obs (128,), actions (32,) and the same scalars.
GPU: 4096 envs x 64 steps, obs (512,), actions (32,) and the same scalars,
a rollout sized for a GPU (574 MB; used by ``benchmarks/gpu``).
The ``expert_obs`` variant adds ``expert_obs (128,)`` with N/4 rows to a
minibatch workload (read with modulo wrap).

Data are small integers (0..7) stored as float32, so that every sum the
benchmarks compute is exact in float32 whatever the summation order: the
implementations' results can then be compared for equality.

``--quick`` shrinks W2 and GPU (256 envs) and the batch sizes with them; the
quick numbers only smoke-test the code paths.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import jrollout as jr

SCALARS = ("logp", "value", "reward", "done")


@dataclasses.dataclass(frozen=True)
class Workload:
  """A rollout shape: E envs, T steps, ``{key: per-step shape}``."""
  name: str
  num_envs: int
  num_steps: int
  shapes: dict[str, tuple[int, ...]]

  @property
  def num_rows(self) -> int:
    """N = E * T."""
    return self.num_envs * self.num_steps

  @property
  def nbytes(self) -> int:
    """Bytes of one rollout (float32)."""
    return 4 * self.num_rows * sum(int(np.prod(s)) for s in
                                   self.shapes.values())

  def label(self) -> str:
    return f"{self.name} (E={self.num_envs}, T={self.num_steps})"


def _keys(obs: int, act: int) -> dict[str, tuple[int, ...]]:
  return {"obs": (obs,), "actions": (act,), **{k: () for k in SCALARS}}


W1 = Workload("W1", 64, 128, _keys(64, 8))
W2 = Workload("W2", 4096, 32, _keys(128, 32))
GPU = Workload("GPU", 4096, 64, _keys(512, 32))
WORKLOADS = {w.name: w for w in (W1, W2, GPU)}
EXPERT_SHAPE = (128,)
QUICK_DIVISOR = 16  # W2's envs and batch sizes are divided by this in --quick


def get(name: str, quick: bool) -> Workload:
  """W1, W2 or GPU, shrunk in quick mode (W2 and GPU)."""
  w = WORKLOADS[name]
  if quick and w.name != "W1":
    w = dataclasses.replace(w, num_envs=w.num_envs // QUICK_DIVISOR)
  return w


def batch_size(name: str, b: int, quick: bool) -> int:
  """The issue's minibatch size B for workload ``name``, shrunk with it."""
  return b // QUICK_DIVISOR if quick and name != "W1" else b


def with_envs(w: Workload, num_envs: int, num_steps: int) -> Workload:
  return dataclasses.replace(w, num_envs=num_envs, num_steps=num_steps)


def _ints(rng: np.random.Generator, shape) -> np.ndarray:
  return rng.integers(0, 8, size=shape).astype(np.float32)


def step_pool(w: Workload, size: int,
              seed: int = 0) -> list[dict[str, np.ndarray]]:
  """``size`` distinct one-step value dicts ``{key: [E, *shape]}``."""
  rng = np.random.default_rng(seed)
  return [{k: _ints(rng, (w.num_envs, *s)) for k, s in w.shapes.items()}
          for _ in range(size)]


def rollout(w: Workload, seed: int = 0) -> dict[str, np.ndarray]:
  """A whole rollout ``{key: [T, E, *shape]}``."""
  rng = np.random.default_rng(seed)
  return {k: _ints(rng, (w.num_steps, w.num_envs, *s))
          for k, s in w.shapes.items()}


def flat_batch(w: Workload, seed: int = 0,
               expert: bool = False) -> dict[str, np.ndarray]:
  """An env-major batch ``{key: [N, *shape]}`` (+ expert_obs [N/4, 128])."""
  rng = np.random.default_rng(seed)
  batch = {k: _ints(rng, (w.num_rows, *s)) for k, s in w.shapes.items()}
  if expert:
    batch["expert_obs"] = _ints(rng, (w.num_rows // 4, *EXPERT_SHAPE))
  return batch


def env_major(data: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """numpy ``[T, E, *s] -> [E*T, *s]`` (the make_batch order)."""
  return {k: np.ascontiguousarray(v.swapaxes(0, 1)).reshape(-1, *v.shape[2:])
          for k, v in data.items()}


def empty_state(w: Workload) -> jr.RolloutState:
  """A RolloutState with W's keys registered (zeros, no writes)."""
  state = jr.init(num_envs=w.num_envs, num_steps=w.num_steps)
  for k, s in w.shapes.items():
    state = jr.register(state, k, shape=s)
  return state


def full_state(w: Workload, data: dict[str, np.ndarray]) -> jr.RolloutState:
  """A complete RolloutState holding ``data`` ``{key: [T, E, *shape]}``."""
  state = jr.update_all(empty_state(w), {k: jnp.asarray(v)
                                         for k, v in data.items()})
  return jax.block_until_ready(state)


def sums_of(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """numpy model of one epoch's sums: every row of every key once, wrapped.

  With N = the longest key's rows, a key of L rows is read N / L times.
  """
  n = max(len(v) for v in batch.values())
  return {k: v.sum(axis=0, dtype=np.float64).astype(np.float32) * (n // len(v))
          for k, v in batch.items()}
