"""The examples' command line: ``Config``, ``parse_config`` and the
persistent compilation cache that ``--compile-cache`` turns on."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

import jax

COMPILE_CACHE_ENV = "JROLLOUT_COMPILE_CACHE"

# Compilations shorter than this are not written to the cache. JAX's own
# default, 1 s, leaves out the examples' smaller jits; any threshold makes
# what is cached depend on how busy the machine was, 0 caches every program.
CACHE_MIN_COMPILE_S = 0.0


def default_compile_cache() -> str:
  """``--compile-cache``'s default: ``$JROLLOUT_COMPILE_CACHE`` if set (an
  empty value turns the cache off), else ``~/.cache/jrollout/jax``."""
  return os.environ.get(
      COMPILE_CACHE_ENV,
      os.path.join(os.path.expanduser("~"), ".cache", "jrollout", "jax"))


@dataclasses.dataclass(frozen=True)
class Config:
  """PPO hyperparameters; every field is a command-line flag.

  The defaults are the CartPole agent's. An example subclasses this class,
  declaring only its new fields and the defaults it changes.
  """
  num_envs: int = 8
  num_steps: int = 128
  total_steps: int = 1_000_000
  num_epochs: int = 4
  num_minibatches: int = 4
  lr: float = 2.5e-4
  anneal_lr: bool = True
  gamma: float = 0.99
  gae_lambda: float = 0.95
  clip_eps: float = 0.2
  ent_coef: float = 0.01
  vf_coef: float = 0.5
  max_grad_norm: float = 0.5
  hidden: int = 64
  seeds: int = 4              # vmapped training runs (``training.train``)
  seed: int = 0
  chunks: int = 10            # host round-trips for progress printing
  mask_velocity: bool = False  # CartPole: hide the velocities (a POMDP)
  out: str = "runs/ppo"
  # JAX's persistent compilation cache ("": off, --no-compile-cache);
  # see use_compile_cache
  compile_cache: str = dataclasses.field(default_factory=default_compile_cache)

  @property
  def num_updates(self) -> int:
    return self.total_steps // (self.num_envs * self.num_steps)

  @property
  def batch_size(self) -> int:
    """B, the rows of a minibatch: ``E * T // num_minibatches``."""
    return self.num_envs * self.num_steps // self.num_minibatches


def parse_config(argv=None, cls=Config, doc=None, choices=None):
  """A ``cls`` instance from command-line flags, one per dataclass field.

  ``doc`` is the calling example's docstring (its first line describes the
  command); ``choices`` maps a field name to its allowed values (argparse
  checks them). ``--compile-cache DIR`` (``Config.compile_cache``) also has
  ``--no-compile-cache``, which sets it to ``""`` (no cache).
  """
  parser = argparse.ArgumentParser(
      description=(doc or __doc__).split("\n")[0])
  for field in dataclasses.fields(cls):
    flag = "--" + field.name.replace("_", "-")
    default = (field.default_factory()
               if field.default is dataclasses.MISSING else field.default)
    if field.type in ("bool", bool):
      parser.add_argument(flag, action=argparse.BooleanOptionalAction,
                          default=default)
    else:
      typ = {"int": int, "float": float, "str": str}[str(field.type)]
      parser.add_argument(flag, type=typ, default=default,
                          choices=(choices or {}).get(field.name))
  if any(f.name == "compile_cache" for f in dataclasses.fields(cls)):
    parser.add_argument("--no-compile-cache", dest="compile_cache",
                        action="store_const", const="",
                        help="no persistent compilation cache")
  return cls(**vars(parser.parse_args(argv)))


# Flags that change where a run writes, never what it computes.
HOST_ONLY = ("out", "checkpoint_dir", "checkpoint_every", "compile_cache")


def settings(config: Any, ignored: tuple[str, ...] = HOST_ONLY
             ) -> dict[str, Any]:
  """``config``'s fields as a dict, less ``ignored`` (by default those
  that cannot change what a run computes)."""
  return {k: v for k, v in dataclasses.asdict(config).items()
          if k not in ignored}


def use_compile_cache(config: Config) -> str | None:
  """Turns on JAX's persistent compilation cache in
  ``config.compile_cache`` (nothing if it is ``""``); returns the absolute
  directory, or None.

  Every compilation (``CACHE_MIN_COMPILE_S``) is written there, keyed by
  the program, the JAX/XLA versions, the flags and the devices; a later run
  (another process) that compiles the same program loads the executable
  instead: the same executables, so the same results. Call it before
  the first compilation: each example's ``main`` does, right after parsing
  its flags. It sets JAX's global config (the jrollout library never does).
  The directory grows with every new program (JAX evicts nothing by
  default); delete it to clear the cache.
  """
  if not config.compile_cache:
    return None
  path = os.path.abspath(os.path.expanduser(config.compile_cache))
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    CACHE_MIN_COMPILE_S)
  return path
