"""What a run reports: progress lines, episodic returns, learning curves
(PNG), ``summary.json`` and the hash of the final parameters."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import jax
import numpy as np


def print_progress(done_updates: int, num_updates: int, steps_per_update: int,
                   metrics, seeds: int, seconds: float) -> None:
  """One line after a chunk of seed-vmapped updates: the env steps so far,
  the mean return over the chunk's episodes (mean, min and max over
  seeds) and the env steps per second over all seeds. ``metrics``: the
  chunk's ``{"episode_return_sum", "episodes": [seeds, updates]}``."""
  size = metrics["episodes"].shape[1]
  count = metrics["episodes"].sum(1)
  ret = metrics["episode_return_sum"].sum(1)[count > 0] / count[count > 0]
  rate = seeds * size * steps_per_update / seconds
  shown = (f"mean {ret.mean():6.1f} [min {ret.min():6.1f}, max "
           f"{ret.max():6.1f}]" if ret.size else "none (no episode ended)")
  if 0 < ret.size < count.size:
    shown += f" of {ret.size} seeds"
  print(f"update {done_updates:5d}/{num_updates}  env steps "
        f"{done_updates * steps_per_update:>9,d}/seed  return "
        f"{shown}  {rate:,.0f} steps/s", flush=True)


def episode_returns(metrics, window: int = 1) -> np.ndarray:
  """``[seeds, updates]`` mean episodic return, pooled over the ``window``
  updates up to each one: NaN where no episode ended in the window (no
  return to show; ``save_curve`` leaves those updates out)."""
  s, n = metrics["episode_return_sum"], metrics["episodes"].astype(np.float64)
  if window > 1:
    kernel = np.ones(window)
    s = np.stack([np.convolve(r, kernel)[:r.size] for r in s])
    n = np.stack([np.convolve(r, kernel)[:r.size] for r in n])
  return np.where(n > 0, s / np.maximum(n, 1), np.nan)


def final_returns(metrics, frac: float = 0.1) -> np.ndarray:
  """Per seed: mean return of the episodes that ended in the last ``frac``
  of the updates, NaN where none ended (no data, not a return of 0)."""
  s, n = metrics["episode_return_sum"], metrics["episodes"]
  last = max(1, int(round(s.shape[1] * frac)))
  count = n[:, -last:].sum(1)
  return np.where(count > 0, s[:, -last:].sum(1) / np.maximum(count, 1),
                  np.nan)


def or_none(values) -> list[float | None]:
  """``values`` as floats for ``summary.json``, None where NaN (null)."""
  return [None if np.isnan(v) else float(v) for v in np.ravel(values)]


def show(values, fmt: str = ".1f") -> str:
  """A number, or ``[a, b, ...]`` for several, as a progress line or table
  shows them: ``none`` for NaN or None (no data)."""
  def one(v):
    return "none" if v is None or np.isnan(v) else format(v, fmt)
  if np.ndim(values) == 0:
    return one(values)
  return "[" + ", ".join(one(v) for v in np.ravel(values)) + "]"


def save_curve(curves: dict[str, np.ndarray], steps_per_update: int,
               path: str, title: str, *, goal: float | None = None,
               legend: str = "upper left") -> None:
  """Mean return vs env steps with the seeds' min-max band, one line each
  (``[seeds, updates]`` curves; updates where a seed has NaN are left out),
  and a dashed line at ``goal`` if given."""
  import matplotlib  # noqa: PLC0415 - optional dependency, plots only
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415 - after use("Agg")
  fig, ax = plt.subplots(figsize=(7, 4))
  for label, ret in curves.items():
    x = np.arange(1, ret.shape[1] + 1) * steps_per_update
    ok = ~np.isnan(ret).any(0)
    ax.plot(x[ok], ret[:, ok].mean(0),
            label=f"{label} (mean of {ret.shape[0]} seeds)")
    ax.fill_between(x[ok], ret[:, ok].min(0), ret[:, ok].max(0), alpha=0.25)
  if goal is not None:
    ax.axhline(goal, color="gray", ls="--", lw=1, label=f"goal: {goal:g}")
  ax.set_xlabel("env steps per seed")
  ax.set_ylabel("episodic return")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(loc=legend)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write_summary(out: str, summary: dict[str, Any]) -> str:
  """Writes ``summary`` to ``out``/summary.json (creating ``out``); returns
  the path."""
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, "summary.json")
  with open(path, "w") as f:
    json.dump(summary, f, indent=2)
  return path


def params_sha256(params) -> str:
  """SHA-256 of the parameters' bytes (leaves in tree order): equal
  hashes mean bit-identical parameters."""
  digest = hashlib.sha256()
  for leaf in jax.tree_util.tree_leaves(params):
    digest.update(np.ascontiguousarray(jax.device_get(leaf)).tobytes())
  return digest.hexdigest()
