"""Compiled programs kept on disk between runs: ``compile`` loads a jitted
function's executable saved by an earlier run of the same program instead
of tracing, lowering and compiling it again.

JAX's persistent compilation cache (``cli.use_compile_cache``) skips only
XLA's compile: every run still traces and lowers the program to find its
cache key, seconds for a PPO update. Here the key is computed without
tracing, from what decides the program: a ``tag`` naming it, the run's
settings, the arguments' shapes, dtypes and shardings, the source of
``jrollout/`` and ``examples/``, every installed distribution's version,
``XLA_FLAGS`` and JAX's flags, and the devices. A saved executable
(``jax.experimental.serialize_executable``) is loaded when all of these
match; anything else compiles, then saves. A file that cannot be read or
loaded is compiled over; a program that cannot be serialised, or that
runs on several devices (whose order the file would have to keep), is
compiled every time. Files are written whole (a temporary file renamed),
so runs in parallel never see half of one.

The files are pickles that JAX loads as machine code: keep the directory
your own (it is under ``--compile-cache``, default
``~/.cache/jrollout/jax``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import io
import json
import os
import pathlib
import pickle
import re
import tempfile
import time
from typing import Any

import jax
from jax.experimental import serialize_executable
import jax.numpy as jnp
import numpy as np

import jrollout as jr

SUBDIR = "executables"
LOADED = "/jrollout/examples/executable_loaded"
SAVED = "/jrollout/examples/executable_saved"
_SOURCES = (pathlib.Path(jr.__file__).parent,
            pathlib.Path(__file__).resolve().parent.parent)
_FLAGS = ("jax_enable_x64", "jax_default_matmul_precision",
          "jax_numpy_dtype_promotion", "jax_numpy_rank_promotion",
          "jax_default_prng_impl", "jax_threefry_partitionable")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")   # differs from run to run
_environment: str | None = None   # the part of every key that a run fixes


def _fixed_part() -> str:
  """The key's part fixed for this process: sources, versions, flags,
  devices."""
  global _environment
  if _environment is None:
    digest = hashlib.sha256()
    for root in _SOURCES:
      for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    versions = sorted({(d.metadata["Name"] or "", d.version)
                       for d in importlib.metadata.distributions()})
    _environment = json.dumps({
        "sources": digest.hexdigest(), "versions": versions,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "flags": {f: str(getattr(jax.config, f, None)) for f in _FLAGS},
        "devices": [str(d.device_kind) for d in jax.devices()],
        "processes": jax.process_count()})
  return _environment


def key(tag: str, settings: Any, args: tuple) -> str:
  """The file name of ``tag``'s executable for ``settings`` (anything
  ``json``-serialisable) and the arguments ``args`` (their structure,
  shapes, dtypes and shardings; not their values)."""
  leaves, treedef = jax.tree.flatten(args)
  avals = [(type(x).__name__, np.shape(x), str(jnp.result_type(x)),
            str(getattr(x, "sharding", "")), getattr(x, "weak_type", False))
           for x in leaves]
  text = json.dumps([tag, settings, _ADDRESS.sub("", str(treedef)),
                     repr(avals), _fixed_part()], sort_keys=True,
                    default=str)
  return f"{tag}-{hashlib.sha256(text.encode()).hexdigest()[:32]}.pkl"


def compile(fn: Any, *args: Any, tag: str, settings: Any,   # noqa: A001
            directory: str | None) -> tuple[Any, bool]:
  """``(fn.lower(*args).compile(), loaded)``: the executable saved in
  ``directory`` under ``key(tag, settings, args)`` if there is one
  (``loaded`` True), else compiled now and saved there. ``fn`` is a
  ``jax.jit`` function; ``directory`` None compiles without saving.

  Each load records the JAX monitoring event ``LOADED`` and each save
  ``SAVED`` (``jax.monitoring.register_event_listener`` sees them).
  """
  if not directory:
    return fn.lower(*args).compile(), False
  path = os.path.join(directory, SUBDIR, key(tag, settings, args))
  try:
    with open(path, "rb") as f:
      payload, in_tree, out_tree, device_id = _Unpickler(f, args).load()
    device = {d.id: d for d in jax.devices()}[device_id]
    compiled = serialize_executable.deserialize_and_load(
        payload, in_tree, out_tree, execution_devices=[device])
  except Exception:   # noqa: BLE001 - missing, stale or damaged: compile
    pass
  else:
    jax.monitoring.record_event(LOADED)
    return compiled, True
  compiled = fn.lower(*args).compile()
  devices = {d for s in jax.tree.leaves((compiled.input_shardings,
                                         compiled.output_shardings))
             for d in s.device_set}
  if len(devices) != 1:   # a device order to keep: not saved
    return compiled, False
  try:
    with io.BytesIO() as f:
      _Pickler(f, args).dump((*serialize_executable.serialize(compiled),
                              devices.pop().id))
      saved = f.getvalue()
  except Exception:   # noqa: BLE001 - XLA cannot serialise it, or its
    return compiled, False   # outputs hold static data not in its inputs
  temporary = None
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    remove_stale_temporaries(os.path.dirname(path))
    with tempfile.NamedTemporaryFile(dir=os.path.dirname(path), delete=False,
                                     suffix=".tmp") as f:
      temporary = f.name
      f.write(saved)
    os.replace(temporary, path)
  except OSError:   # a full disk or no permission: run without saving
    if temporary is not None:
      with contextlib.suppress(OSError):
        os.unlink(temporary)
  else:
    jax.monitoring.record_event(SAVED)
  return compiled, False


STALE_S = 600   # a temporary file older than this was left by a killed save


def remove_stale_temporaries(directory: str) -> None:
  """Deletes the ``*.tmp`` files a killed save left in ``directory``: those
  not modified for ``STALE_S`` seconds (a save writes its file in well under
  a second, so another process's save in flight is never one of them)."""
  now = time.time()
  with contextlib.suppress(OSError), os.scandir(directory) as entries:
    for entry in entries:
      if entry.name.endswith(".tmp"):
        with contextlib.suppress(OSError):
          if now - entry.stat().st_mtime > STALE_S:
            os.unlink(entry.path)


def _statics(args: tuple) -> list[Any]:
  """The objects in the static data of ``args``' pytree nodes (a
  ``TrainState``'s ``apply_fn`` and ``tx``, say), in traversal order."""
  found: list[Any] = []

  def collect(data: Any) -> None:
    if type(data) in (tuple, list):   # a NamedTuple is kept whole
      for item in data:
        collect(item)
    elif type(data) is dict:
      for item in data.values():
        collect(item)
    elif not isinstance(data, (str, bytes, int, float, complex, type(None))):
      found.append(data)

  def walk(node: Any) -> None:
    data = node.node_data()
    if data is not None:
      collect(data[1])
    for child in node.children():
      walk(child)

  walk(jax.tree.structure((args, {})))
  return found


class _Pickler(pickle.Pickler):
  """Pickles an executable's pytree structures with the static data of its
  arguments' nodes (functions, optimisers: often not picklable) as
  references to the same objects in the next run's arguments, and JAX's
  tracebacks as None; static data of the outputs that is not in the inputs
  makes pickling fail (the program is then compiled every time)."""

  def __init__(self, file: Any, args: tuple):
    super().__init__(file)
    self._index = {id(x): i for i, x in enumerate(_statics(args))}

  def persistent_id(self, obj: Any) -> Any:
    if _is_traceback(obj):   # where a checkify check was traced: not kept
      return ("traceback",)
    i = self._index.get(id(obj))
    return None if i is None else ("static", i)


class _Unpickler(pickle.Unpickler):
  """Reads what ``_Pickler`` wrote, with this run's arguments' objects."""

  def __init__(self, file: Any, args: tuple):
    super().__init__(file)
    self._statics = _statics(args)

  def persistent_load(self, pid: Any) -> Any:
    return None if pid[0] == "traceback" else self._statics[pid[1]]


def _is_traceback(obj: Any) -> bool:
  """Whether ``obj`` is JAX's record of a Python traceback (in a checkify
  error's static data: ``Error.get`` does not read it, ``throw`` does)."""
  kind = type(obj)
  return kind.__name__ == "Traceback" and kind.__module__.startswith("jax")
