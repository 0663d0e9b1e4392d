"""Which directories ``save_rollout`` may write or replace, and which
``restore_rollout`` may read: refused before orbax is called, with a
message naming what the path is.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from jrollout._checkpoint.damage import CorruptCheckpointError
from jrollout._checkpoint.record import FORMAT
from jrollout._checkpoint.record import listing
from jrollout._checkpoint.checksums import RECORD_DIR

TMP = ".orbax-checkpoint-tmp"   # in the names of orbax's unfinished saves
# Beside a checkpoint ``path``, while ``save_rollout`` replaces it
# (``swap``): its lock file, the new checkpoint being written,
# and the old one between the two renames of the fallback.
LOCK = ".jrollout-lock"
NEW = ".jrollout-new"
OLD = ".jrollout-old"


def path(fn: str, directory: Any) -> str:
  """``directory`` as an absolute path; ValueError if it is ``""``."""
  try:
    found = os.fspath(directory)
  except TypeError:
    raise TypeError(f"{fn}: directory must be a str or os.PathLike, got "
                    f"{type(directory).__name__}") from None
  if isinstance(found, bytes):
    found = os.fsdecode(found)
  if not found:
    raise ValueError(f"{fn}: directory is '' (empty): give the checkpoint's "
                     "own directory, e.g. 'runs/ckpt'")
  return os.path.abspath(found)


# What orbax writes into a checkpoint directory, as (file names, {directory
# name: what it holds}), names as regular expressions.
_Layout = tuple[tuple[str, ...], dict[str, Any]]
_DATA: _Layout = (("[0-9a-f]+",), {})
_LAYOUT: _Layout = (
    ("_METADATA", "_CHECKPOINT_METADATA", "_sharding", "manifest.ocdbt",
     "commit_success.txt"),
    {"d": _DATA, "array_metadatas": ((r"process_\d+",), {}),
     r"ocdbt\.process_\d+": (("manifest.ocdbt",), {"d": _DATA}),
     RECORD_DIR: ((r"process_\d+\.json", r"index\.json"), {})})


def _foreign(where: str, layout: _Layout = _LAYOUT, rel: str = ""
             ) -> list[str]:
  """The entries below the directory ``where`` that no checkpoint holds
  (relative paths; a foreign directory is not listed further)."""
  files, dirs = layout
  foreign = []
  for name in sorted(os.listdir(where)):
    full, inside = os.path.join(where, name), os.path.join(rel, name)
    if os.path.islink(full):
      foreign.append(inside)
    elif os.path.isdir(full):
      sub = next((v for k, v in dirs.items() if re.fullmatch(k, name)), None)
      if sub is None:
        foreign.append(inside)
      else:
        foreign.extend(_foreign(full, sub, inside))
    elif not any(re.fullmatch(k, name) for k in files):
      foreign.append(inside)
  return foreign


def _refuse(fn: str, where: str, why: str) -> ValueError:
  return ValueError(
      f"{fn}: directory {where} {why}; overwrite=True only replaces a "
      "checkpoint written by jrollout, so nothing was deleted")


def _check_not_special(fn: str, where: str) -> None:
  """Refuses ``/``, the home directory, and the current directory or one
  above it."""
  real = os.path.realpath(where)
  cwd = os.path.realpath(os.getcwd())
  home = os.path.realpath(os.path.expanduser("~"))
  if real == os.path.dirname(real):
    raise _refuse(fn, where, "is the filesystem root")
  if real == home:
    raise _refuse(fn, where, "is the home directory")
  if real == cwd:
    raise _refuse(fn, where, "is the current directory")
  if cwd.startswith(real.rstrip(os.sep) + os.sep):
    raise _refuse(fn, where, f"holds the current directory ({cwd})")


def _replaceable(fn: str, where: str) -> None:
  """Refuses to let ``overwrite`` delete ``where`` unless it is a jrollout
  checkpoint (or an empty directory): ValueError saying why."""
  _check_not_special(fn, where)
  if os.path.islink(where):
    raise _refuse(fn, where, f"is a symbolic link (to {os.readlink(where)})")
  if not os.path.isdir(where):
    raise _refuse(fn, where, "is a file, not a checkpoint directory")
  if not os.listdir(where):
    return   # an empty directory: nothing to lose
  foreign = _foreign(where)
  if foreign:
    raise _refuse(fn, where, f"is not a jrollout checkpoint: it holds "
                  f"{listing(foreign, 4)}, which a checkpoint does not")
  meta = os.path.join(where, "_METADATA")
  try:
    with open(meta, encoding="utf-8") as f:
      custom = json.load(f).get("custom_metadata")
  except (OSError, ValueError, AttributeError) as e:
    raise _refuse(fn, where, f"is not a readable jrollout checkpoint (its "
                  f"_METADATA: {type(e).__name__}: {e}); delete it yourself "
                  "if it is a damaged one") from None
  if not (isinstance(custom, dict) and custom.get("format") == FORMAT):
    raise _refuse(fn, where, "is an orbax checkpoint not written by jrollout")


def check_destination(fn: str, where: str, overwrite: bool) -> None:
  """Refuses a save into ``where`` (absolute) that would lose anything:
  an existing path unless ``overwrite`` and a jrollout checkpoint (or an
  empty directory), a path below a file."""
  if os.path.lexists(where):
    if not overwrite:
      raise ValueError(f"{fn}: directory {where} already exists; choose a "
                       "new directory, or pass overwrite=True to replace the "
                       "checkpoint there")
    _replaceable(fn, where)
    return
  check_parent(fn, where)


def check_parent(fn: str, where: str) -> None:
  """Refuses a path below a file (its missing parents are created)."""
  parent = os.path.dirname(where)
  while not os.path.lexists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise ValueError(f"{fn}: directory {where} cannot be created: {parent} "
                     "is a file")


def leftovers(where: str) -> list[str]:
  """The names (sorted) that interrupted saves into ``where`` left beside
  it: the new checkpoint and orbax's temporary directories (also those of
  an earlier jrollout, which wrote into ``where`` + TMP)."""
  parent = os.path.dirname(where)
  if not os.path.isdir(parent):
    return []
  base = re.escape(os.path.basename(where))
  found = re.compile(rf"{base}({re.escape(NEW)}({re.escape(TMP)}.*)?|"
                     rf"{re.escape(TMP)}.*)")
  return sorted(name for name in os.listdir(parent) if found.fullmatch(name))


def incomplete(fn: str, where: str) -> str:
  """The message for an interrupted save's directory."""
  return (f"{fn}: directory {where} is an incomplete checkpoint: the save "
          "writing it was interrupted; restore an earlier checkpoint")


def check_restorable(fn: str, where: str) -> None:
  """Refuses what is no checkpoint directory, naming what it is."""
  if not os.path.exists(where):
    partial = leftovers(where)
    raise FileNotFoundError(
        f"{fn}: directory {where} does not exist" + (
            f" (a save into it was interrupted and left {partial[-1]})"
            if partial else ""))
  if not os.path.isdir(where):
    raise ValueError(f"{fn}: directory {where} is a file, not a checkpoint "
                     "directory")
  if TMP in os.path.basename(where) or os.path.basename(where).endswith(
      NEW):
    raise ValueError(incomplete(fn, where))
  if not os.path.exists(os.path.join(where, "_METADATA")):
    names = sorted(os.listdir(where))
    ours = [name for name in names if name not in _foreign(where)]
    if ours:
      raise CorruptCheckpointError(fn, where, (), [
          f"its metadata file _METADATA is missing (it holds "
          f"{listing(names, 4)})"])
    raise ValueError(
        f"{fn}: directory {where} is not a checkpoint: it has no _METADATA "
        f"file ({'it holds ' + listing(names, 4) if names else 'it is empty'}"
        ")")
