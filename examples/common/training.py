"""The compiled training loop of the in-JAX examples: a rollout's env steps
in one ``lax.scan``, and a host loop over jitted, seed-vmapped chunks of
updates that reports the rollout check and saves checkpoints."""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np

import jrollout as jr
from examples.common import reporting
from examples.common.cli import Config


def collect(env_step, runner, num_steps: int):
  """Runs ``env_step((runner, done_return, done_count), t)`` for ``t = 0
  .. T-1`` in a ``lax.scan`` (the step writes step ``t`` of the rollout).

  Returns ``(runner, episodes)`` with ``episodes`` the sum of the
  undiscounted returns of the episodes that ended, ``episode_return_sum``,
  and their number, ``episodes``.
  """
  (runner, done_return, done_count), _ = jax.lax.scan(
      env_step, (runner, jnp.float32(0), jnp.int32(0)),
      jnp.arange(num_steps))
  return runner, {"episode_return_sum": done_return, "episodes": done_count}


def raise_if_incomplete(err: checkify.Error, first_update: int,
                        num_updates: int) -> None:
  """Raises if an update of a chunk closed an incomplete rollout.

  ``err`` is the error value of the chunk's ``checkify.checkify``: the
  library's write check (``jr.finish_rollout``'s default under ``jit``)
  reported it without a host callback, so every call dispatched
  asynchronously.
  """
  message = err.get()
  if message:
    raise jr.IncompleteRolloutError(
        f"train: updates {first_update}-{first_update + num_updates - 1}: "
        f"{message}")


def make_chunk(config: Config, update_fn, num_updates: int, *,
               checked: bool = True):
  """A jitted, seed-vmapped function running ``num_updates`` updates.

  ``checked``: wrapped in ``checkify`` (returns ``(err, (runner,
  metrics))``). Unchecked (``(runner, metrics)``), each update returns
  ``jr.is_complete`` as ``metrics["rollout_complete"]`` instead: ``checkify``
  refuses ``vmap`` of a batched ``while_loop``, which
  ``jr.scan_minibatches``' shuffle has when N = E * T is not a power of two.
  """
  del config

  def chunk(runner):
    return jax.lax.scan(lambda r, _: update_fn(r), runner, None,
                        length=num_updates)

  if not checked:
    return jax.jit(jax.vmap(chunk), donate_argnums=0)
  # checkify turns the write checks of jr.finish_rollout into an error value
  # returned next to the outputs: (err, (runner, metrics)).
  return jax.jit(checkify.checkify(jax.vmap(chunk),
                                   errors=checkify.user_checks),
                 donate_argnums=0)


def train(config: Config, make_train_fn: Callable[[Config], tuple[Any, Any]],
          verbose: bool = True, checkpoint: Any = None, *,
          checked: bool = True) -> dict[str, Any]:
  """Trains ``config.seeds`` seeds at once; returns per-update metrics.

  Args:
    config: the run's settings (``seeds``, ``seed``, ``chunks`` and the
      sizes are read here).
    make_train_fn: ``make_train_fn(config) -> (init_fn, update_fn)`` with
      ``init_fn(key) -> runner`` and ``update_fn(runner) -> (runner,
      metrics)``, both pure and vmappable; ``metrics`` holds
      ``episode_return_sum`` and ``episodes``; ``update_fn`` closes each
      rollout with ``jr.finish_rollout``, whose check is reported here.
    verbose: print one progress line per chunk.
    checkpoint: None, or what saves and resumes the run
      (``checkpoints.RunCheckpoint``): ``checkpoint.resume(runner)`` returns
      ``(runner, history, done_updates)`` to go on from (the fresh runner,
      ``[]`` and 0 if there is nothing to resume); ``checkpoint.save(
      done_updates, runner, history)`` is called after every chunk and
      ``checkpoint.close()`` at the end.
    checked: the chunks' write checks through ``checkify`` (see
      ``make_chunk``); False: ``update_fn``'s ``metrics`` hold
      ``rollout_complete`` (``jr.is_complete`` before closing), tested here.

  Returns:
    ``{"metrics": {name: [seeds, updates]}, "runner": the final runner,
    "compile_s", "run_s", "init_s", "wall_s"}``.

  Raises:
    ValueError: if ``total_steps`` is less than one rollout.
    jr.IncompleteRolloutError: if an update closed an incomplete rollout.
    checkpoints.CheckpointFailed: if a checkpoint could not be saved (its
      message names the directory, the update and the cause); the run
      stops there.
  """
  init_fn, update_fn = make_train_fn(config)
  num_updates = config.num_updates
  if num_updates < 1:
    raise ValueError(f"--total-steps {config.total_steps} is less than one "
                     f"rollout ({config.num_envs * config.num_steps} steps)")
  # Equal chunks compile once: the divisor of num_updates nearest the ask.
  target = num_updates / max(1, config.chunks)
  size = min((d for d in range(1, num_updates + 1) if num_updates % d == 0),
             key=lambda d: abs(d - target))
  sizes = [size] * (num_updates // size)
  keys = jax.random.split(jax.random.key(config.seed), config.seeds)
  t0 = time.perf_counter()
  # lax.map, not vmap: a jitted vmap of the GRU's orthogonal initialisers
  # (batched QR) hung on XLA:CPU with jax 0.10.2 in our runs.
  init = jax.jit(lambda ks: jax.lax.map(init_fn, ks)).lower(keys).compile()
  runner = jax.block_until_ready(init(keys))
  init_s = time.perf_counter() - t0
  steps_per_update = config.num_envs * config.num_steps
  history: list[dict[str, np.ndarray]] = []
  compile_s, run_s, done_updates = 0.0, 0.0, 0
  if checkpoint is not None:
    runner, history, done_updates = checkpoint.resume(runner)
  compiled = {}
  t_start = time.perf_counter()
  remaining = sizes[done_updates // size:]   # all of them unless resumed
  for size in remaining:
    if size not in compiled:
      t0 = time.perf_counter()
      fn = make_chunk(config, update_fn, size, checked=checked)
      compiled[size] = fn.lower(runner).compile()
      compile_s += time.perf_counter() - t0
    t0 = time.perf_counter()
    if checked:
      err, (runner, metrics) = compiled[size](runner)
    else:
      runner, metrics = compiled[size](runner)
    metrics = jax.device_get(metrics)
    dt = time.perf_counter() - t0
    run_s += dt
    if checked:
      raise_if_incomplete(err, done_updates, size)
    elif not metrics["rollout_complete"].all():
      raise jr.IncompleteRolloutError(
          f"train: updates {done_updates}-{done_updates + size - 1}: an "
          "update closed a rollout with a step not written exactly once")
    history.append(metrics)
    done_updates += size
    if checkpoint is not None:
      checkpoint.save(done_updates, runner, history)
    if verbose:
      reporting.print_progress(done_updates, num_updates, steps_per_update,
                               metrics, config.seeds, dt)
  if checkpoint is not None:
    checkpoint.close()
  metrics = {k: np.concatenate([h[k] for h in history], axis=1)
             for k in history[0]}
  return {"metrics": metrics, "runner": runner, "compile_s": compile_s,
          "run_s": run_s,
          "init_s": init_s,
          "wall_s": time.perf_counter() - t_start}
