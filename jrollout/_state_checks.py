"""The check that a state is one live ``RolloutState``.

Static (trace time): the type, and that it is not a stack of states made
with ``jax.vmap``; eagerly: that no buffer was deleted by a call that
donated it.
"""

from __future__ import annotations

from typing import Any

import jax

from jrollout._state import RolloutState


def deleted(x: Any) -> bool:
  """Whether ``x`` is a concrete JAX array whose buffers were deleted."""
  return isinstance(x, jax.Array) and not isinstance(
      x, jax.core.Tracer) and x.is_deleted()


def consumed_keys(state: RolloutState) -> list[str]:
  """The parts of ``state`` whose buffers were deleted (donated)."""
  parts = {**state.data, "counts": state.counts,
           "out_of_range": state.out_of_range}
  return [name for name, value in parts.items()
          if any(deleted(x) for x in jax.tree_util.tree_leaves(value))]


def check_state(fn: str, state: Any, name: str = "state") -> RolloutState:
  """One live ``RolloutState``: a TypeError for another type, a ValueError
  for a stack of states (at trace time) or a consumed one (eagerly)."""
  if not isinstance(state, RolloutState):
    raise TypeError(
        f"{fn}: `{name}` must be a RolloutState, got "
        f"{type(state).__name__} (make one with jr.init and jr.register)")
  counts = state.counts
  if getattr(counts, "ndim", 2) != 2 or (counts is None and any(
      tuple(v.shape[:2]) != (state.num_steps, state.num_envs)
      for v in jax.tree_util.tree_leaves(state.data))):
    one = "take one state out of the stack: jax.tree.map(lambda x: x[i], s)"
    if fn.isidentifier() and fn.islower():   # a function of jr
      how = (f"call {fn} under jax.vmap, which passes it one state at a "
             f"time (jax.vmap(jr.{fn})(states, ...)), or {one}")
    else:   # a writer or buffer object holds one state
      how = one
    if counts is None:
      shapes = jax.tree_util.tree_map(lambda v: tuple(v.shape), state.data)
      what = (f"its storage has shapes {shapes}, not [T, E, ...] with "
              f"[T, E] = [{state.num_steps}, {state.num_envs}]")
    else:
      what = (f"its write counts have shape {tuple(counts.shape)}, one "
              f"state's are [K, T] = {tuple(counts.shape[-2:])}; leading axes "
              f"{tuple(counts.shape[:-2])}")
    raise ValueError(f"{fn}: `{name}` is a stack of states ({what}), e.g. "
                     f"made with jax.vmap; {how}")
  if not isinstance(counts, jax.core.Tracer):
    parts = consumed_keys(state)
    if parts:
      raise ValueError(
          f"{fn}: `{name}` was consumed: the buffers of {parts} were deleted "
          "when a call donated them (a jr.RolloutWriter or ExperienceBuffer "
          "consumes the state it is given, and a writer consumes each state "
          "read from it at its next flush). Use the state that call holds "
          "now (`writer.state`), not the one passed in or read before")
  return state
