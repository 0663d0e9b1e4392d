"""The original design in plain torch: ExperienceBuffer and DictDataset.

Written from the design description (not copied): storage is a dict of
``(T, E, *shape)`` tensors written in place one step at a time, the batch is
``transpose(0, 1).reshape(E * T, ...)`` of every key, and the dataset walks
a ``np.random.permutation(N)`` in a Python loop, gathering ``v[idx % len(v)]``
per key with ``index_select``. Everything runs on the tensors' device (the
CPU, or a GPU for the GPU check); ``gae`` is the usual reverse loop over T.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch


class ExperienceBuffer:
  """``storage[key]`` is a ``(T, E, *shape)`` tensor, written in place."""

  def __init__(self, num_envs: int, num_steps: int, device: str = "cpu"):
    self.num_envs = num_envs
    self.num_steps = num_steps
    self.device = device
    self.storage: dict[str, torch.Tensor] = {}

  def register_key(self, key: str, shape: tuple[int, ...] = (),
                   dtype: torch.dtype = torch.float32) -> None:
    self.storage[key] = torch.zeros((self.num_steps, self.num_envs, *shape),
                                    dtype=dtype, device=self.device)

  def update_data(self, key: str, idx, data: torch.Tensor) -> None:
    self.storage[key][idx] = data

  def make_dict(self) -> dict[str, torch.Tensor]:
    """``{key: (E * T, *shape)}``, row ``e * T + t`` = step t of env e."""
    n = self.num_envs * self.num_steps
    return {k: v.transpose(0, 1).reshape(n, *v.shape[2:])
            for k, v in self.storage.items()}


class DictDataset:
  """Shuffled minibatches of a dict of tensors with modulo wrap."""

  def __init__(self, data: dict[str, torch.Tensor], batch_size: int,
               shuffle: bool = True):
    self.data = data
    self.batch_size = batch_size
    self.shuffle = shuffle
    self.num_rows = max(len(v) for v in data.values())
    assert self.num_rows % batch_size == 0

  def __len__(self) -> int:
    return self.num_rows // self.batch_size

  def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
    device = next(iter(self.data.values())).device
    if self.shuffle:
      order = torch.from_numpy(np.random.permutation(self.num_rows))
    else:
      order = torch.arange(self.num_rows)
    order = order.to(device)
    b = self.batch_size
    for j in range(len(self)):
      idx = order[j * b:(j + 1) * b]
      yield {k: v.index_select(0, idx % len(v)) for k, v in self.data.items()}


def buffer_from(num_envs: int, num_steps: int,
                shapes: dict[str, tuple[int, ...]],
                device: str = "cpu") -> ExperienceBuffer:
  buf = ExperienceBuffer(num_envs, num_steps, device)
  for k, s in shapes.items():
    buf.register_key(k, s)
  return buf


def epoch_sums(data: dict[str, torch.Tensor],
               batch_size: int) -> dict[str, torch.Tensor]:
  """One shuffled epoch, summing every minibatch of every key (axis 0)."""
  sums = {k: torch.zeros(v.shape[1:], dtype=v.dtype, device=v.device)
          for k, v in data.items()}
  for mb in DictDataset(data, batch_size):
    for k, v in mb.items():
      sums[k] += v.sum(0)
  return sums


def gae(rewards: torch.Tensor, values: torch.Tensor, last_value: torch.Tensor,
        terminated: torch.Tensor, truncated: torch.Tensor,
        final_values: torch.Tensor, gamma: float, gae_lambda: float):
  """GAE as torch PPO code writes it: a reverse Python loop over ``[T, E]``.

  Same rule as ``jr.gae``: a termination does not bootstrap; a truncation
  bootstraps from ``final_values`` (the value of the true final
  observation); either ends the advantage trace. Returns
  ``(advantages, targets)``, both ``[T, E]``.
  """
  advantages = torch.zeros_like(rewards)
  last_adv = torch.zeros_like(last_value)
  next_value = last_value
  for t in reversed(range(rewards.shape[0])):
    term = terminated[t].to(rewards.dtype)
    done = torch.maximum(term, truncated[t].to(rewards.dtype))
    next_value = torch.where(truncated[t], final_values[t], next_value)
    delta = rewards[t] + gamma * next_value * (1.0 - term) - values[t]
    last_adv = delta + gamma * gae_lambda * (1.0 - done) * last_adv
    advantages[t] = last_adv
    next_value = values[t]
  return advantages, advantages + values
