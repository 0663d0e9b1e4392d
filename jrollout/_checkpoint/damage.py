"""How a restore finds a damaged checkpoint: ``CorruptCheckpointError``.

Before anything is read, ``metadata`` reads the ``_METADATA`` file and
``check_files`` checks the recorded metadata and index files and that every
data file the OCDBT index refers to is long enough for the bytes it places
there; a read that still fails in TensorStore is named by its leaf
(``read_failure``). ``Damage`` collects the problems of one checkpoint; the
checksums of the leaves are ``checksums``'s.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import contextlib
import gc
import json
import re
import sys
from typing import Any
import zlib

from etils import epath  # type: ignore[import-untyped]

import tensorstore as ts

from jrollout._checkpoint.errors import first_line
from jrollout._checkpoint.record import key_of
from jrollout._checkpoint.record import Leaf


class CorruptCheckpointError(ValueError):
  """A checkpoint damaged after it was written; nothing was restored.

  Raised by ``jr.restore_rollout`` (and ``jr.RolloutRestore`` in an
  ``ocp.CheckpointManager``) when a leaf's bytes differ from the checksum
  recorded when it was saved, a file of the checkpoint is missing or has
  another size than it was written with, a metadata file differs from what
  was written, or a leaf cannot be read. The message names the directory
  and, one line each, the damaged leaves (the key of a RolloutState and its
  pytree path) or files, and what is wrong with them.

  Example:
    >>> import glob, os, tempfile, jrollout as jr
    >>> state = jr.register(jr.init(num_envs=2, num_steps=3), "obs", (512,))
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> jr.save_rollout(path, state)
    >>> files = glob.glob(f"{path}/ocdbt.process_0/d/*")
    >>> with open(max(files, key=os.path.getsize), "r+b") as f:  # the arrays
    ...   blob = bytearray(f.read()); blob[len(blob) // 2] ^= 0xFF  # 1 byte
    ...   _ = f.seek(0); _ = f.write(blob)
    >>> try:
    ...   jr.restore_rollout(path, state)
    ... except jr.CorruptCheckpointError as e:
    ...   print(e)
    restore_rollout: damaged checkpoint ...ckpt; nothing was restored
      field 'obs' of the rollout (leaf .data['obs']): checksum mismatch: its
      bytes have CRC-32 0x..., the save recorded 0x...

  Attributes:
    directory: the checkpoint's directory (in a CheckpointManager: the
      item's directory inside the step's).
    leaves: the pytree paths (``jax.tree_util.keystr``) of the damaged
      leaves; empty when the damage is to metadata, which every leaf needs.
    problems: one line per problem found.
  """

  def __init__(self, fn: str, directory: str, leaves: Sequence[str],
               problems: Sequence[str]):
    self.fn, self.directory = fn, directory
    self.leaves, self.problems = tuple(leaves), tuple(problems)
    shown = list(self.problems[:4])
    if len(self.problems) > 4:
      shown.append(f"... and {len(self.problems) - 4} more")
    super().__init__(
        f"{fn}: damaged checkpoint {directory}; nothing was restored\n  "
        + "\n  ".join(shown))

  def __reduce__(self):
    return type(self), (self.fn, self.directory, self.leaves, self.problems)


class Damage:
  """The problems found in one checkpoint."""

  def __init__(self, fn: str, directory: Any, rollouts: dict[str, Any]):
    self.fn, self.directory, self.rollouts = fn, str(directory), rollouts
    self.leaves: list[str] = []
    self.problems: list[str] = []

  def name(self, leaf: str) -> str:
    key = key_of(leaf, self.rollouts)
    return f"{key} (leaf {leaf})" if key else f"leaf {leaf}"

  def add(self, problem: str, leaves: Sequence[str] = ()) -> None:
    if leaves:
      problem = ", ".join(self.name(x) for x in leaves) + ": " + problem
    self.leaves.extend(x for x in leaves if x not in self.leaves)
    self.problems.append(problem)

  def error(self) -> CorruptCheckpointError:
    return CorruptCheckpointError(self.fn, self.directory, self.leaves,
                                  self.problems)

  def raise_any(self) -> None:
    """Raises the problems found so far, if any."""
    if self.problems:
      raise self.error()


def metadata(fn: str, directory: Any) -> Any:
  """The custom metadata of a checkpoint, read from its _METADATA file
  (not through orbax, which would open the arrays' index too);
  CorruptCheckpointError if that file is missing or unreadable."""
  damage = Damage(fn, directory, {})
  path = epath.Path(directory) / "_METADATA"
  if not path.exists():
    damage.add("its metadata file _METADATA is missing")
    raise damage.error()
  try:
    meta = json.loads(path.read_text())
    if not isinstance(meta, dict):
      raise TypeError(f"it holds a {type(meta).__name__}, not an object")
    return meta.get("custom_metadata")
  except (ValueError, TypeError, OSError) as e:
    damage.add(f"its metadata file _METADATA cannot be read "
               f"({type(e).__name__}: {first_line(e)})")
    raise damage.error() from None


def _changed(path: Any, size: int, crc: int | None) -> str | None:
  """What differs in a file from what the save wrote, or None."""
  if not path.exists():
    return f"is missing (the save wrote {size} bytes)"
  got = path.stat().length
  if got != size:
    return (f"is {got} bytes, {'shorter' if got < size else 'longer'} than "
            f"the {size} bytes the save wrote")
  if crc is not None:
    now = zlib.crc32(path.read_bytes())
    if now != crc:
      return (f"differs from what the save wrote (CRC-32 {now:#010x}, "
              f"recorded {crc:#010x})")
  return None


_VALUE = re.compile(r"value:([^:]*):([^:]*):(\d+):(\d+)")


def _index_refs(directory: Any, damage: Damage
                ) -> list[tuple[str, str, int]]:
  """``[(key, file, end of its bytes)]`` of every value the checkpoint's
  OCDBT index places in a data file. A problem is added to ``damage`` if
  TensorStore cannot read the index; ``[]`` if there is no OCDBT index or
  its dump has a form this code does not know."""
  if not (directory / "manifest.ocdbt").exists():
    if (directory / "d").exists():
      damage.add("index file manifest.ocdbt is missing")
    return []
  url = str(directory).rstrip("/") + "/"
  if "://" not in url:
    url = "file://" + url
  refs = []
  try:
    base = ts.KvStore.open(url).result()
    manifest = ts.ocdbt.dump(base).result()
    nodes = [manifest["versions"][-1]["root"]["location"]]
    while nodes:
      node = ts.ocdbt.dump(base, nodes.pop()).result()
      for entry in node["entries"]:
        for field in entry.values():
          if isinstance(field, str) and field.startswith("btreenode::"):
            nodes.append(field)
        found = _VALUE.fullmatch(str(entry.get("indirect_value", "")))
        if found is not None:
          key = entry["key"]
          refs.append((key.decode() if isinstance(key, bytes) else str(key),
                       found.group(1) + found.group(2),
                       int(found.group(3)) + int(found.group(4))))
  except ValueError as e:   # TensorStore's errors: "DATA_LOSS: ..."
    if re.match(r"[A-Z_]+: ", str(e)):
      damage.add(f"its index (manifest.ocdbt, d/) cannot be read "
                 f"({first_line(e)})")
    return []
  except (KeyError, IndexError, TypeError, AttributeError):
    return []   # a dump of another form: leave the checks to the read
  return refs


def _check_recorded_crcs(directory: Any, records: list[dict[str, Any]],
                         written: dict[str, int], damage: Damage) -> None:
  """The size and CRC-32 of the recorded metadata and index files."""
  for record in records:
    for name, crc in record["crcs"].items():
      kind = ("index" if name == "manifest.ocdbt" or name.startswith("d/")
              else "metadata")
      why = _changed(directory / name, written[name], crc)
      if why:
        damage.add(f"{kind} file {name} {why}")


def _lost_bytes(directory: Any, meta: dict[str, Any],
                refs: list[tuple[str, str, int]]
                ) -> tuple[dict[str, int | None], dict[str, tuple[int, set]]]:
  """``(sizes, lost)``: the size of each data file the index refers to
  (None: missing), and ``{file: (bytes needed, leaves)}`` of those missing
  or too short for the bytes the index places in them."""
  by_key = {".".join(leaf["names"]): path
            for path, leaf in meta["leaves"].items()}
  sizes: dict[str, int | None] = {}
  lost: dict[str, tuple[int, set[str]]] = {}
  for key, file, end in refs:
    if file not in sizes:
      sizes[file] = ((directory / file).stat().length
                     if (directory / file).exists() else None)
    size = sizes[file]
    if size is None or size < end:
      need, leaves = lost.get(file, (0, set()))
      leaves.add(by_key.get(key.rsplit("/", 1)[0], f"(key {key})"))
      lost[file] = (max(need, end), leaves)
  return sizes, lost


def _add_lost(sizes: dict[str, int | None], lost: dict[str, tuple[int, set]],
              written: dict[str, int], damage: Damage) -> None:
  """Adds the files ``_lost_bytes`` found, with the leaves they hold."""
  for file, (need, leaves) in lost.items():
    size, saved = sizes[file], written.get(file)
    if size is None:
      why = "is missing" + (f" (the save wrote {saved} bytes)" if saved
                            else "")
    else:
      why = (f"is {size} bytes, shorter than the "
             + (f"{saved} bytes the save wrote" if saved else
                f"{need} bytes its index refers to"))
    damage.add(f"file {file} {why}", sorted(leaves))


def check_files(fn: str, directory: Any, meta: dict[str, Any],
                records: list[dict[str, Any]] | None) -> None:
  """Checks, before anything is read, the files a restore will read.

  With ``records`` (verify; ``checksums.records``): the size and CRC-32
  of the metadata and index files. Always: that every file the OCDBT index
  refers to is there and long enough for the bytes it places in it (the
  leaves whose bytes are lost are named). With ``records``: that every
  data file has the size it was written with. Raises CorruptCheckpointError
  listing the problems.
  """
  directory = epath.Path(directory)
  damage = Damage(fn, directory, meta["rollouts"])
  records = records or []
  written = {name: size for record in records
             for name, size in record["files"].items()}
  _check_recorded_crcs(directory, records, written, damage)
  damage.raise_any()
  refs = _index_refs(directory, damage)
  damage.raise_any()
  sizes, lost = _lost_bytes(directory, meta, refs)
  _add_lost(sizes, lost, written, damage)
  for name, size in written.items():   # damage where no leaf's bytes are
    if name not in lost and not any(name in r["crcs"] for r in records):
      why = _changed(directory / name, size, None)
      if why:
        damage.add(f"file {name} {why}")
  damage.raise_any()


_TS_ERROR = re.compile(r'([A-Z_]+): Error reading "([^"]*)" in OCDBT '
                       r"database at [^:]*: (.*)")


def read_failure(error: BaseException, stored: list[Leaf]
                 ) -> tuple[str | None, str] | None:
  """``(leaf path or None, what went wrong)`` of a failed read of the
  arrays, or None if ``error`` is not TensorStore failing to read."""
  by_key = {".".join(x.names): x.path for x in stored}
  seen: set[int] = set()
  chain: BaseException | None = error
  while chain is not None and id(chain) not in seen:
    seen.add(id(chain))
    match = _TS_ERROR.match(str(chain))
    if match:
      code, key, why = match.groups()
      leaf = by_key.get(key.rsplit("/", 1)[0])
      return leaf, f"cannot be read ({code}: {why.split(chr(10))[0]})"
    chain = chain.__cause__ or chain.__context__
  text = str(error)
  if "Encountered error while reading array" in text or re.match(
      r"[A-Z_]+: ", text):
    key = re.search(r"'path': '([^']*)/'", text)
    leaf = by_key.get(key.group(1)) if key else None
    return leaf, f"cannot be read ({first_line(error)})"
  return None


@contextlib.contextmanager
def quiet_abandoned_reads() -> Iterator[None]:
  """Silences orbax's reads abandoned after one failed.

  When one array cannot be read, orbax's event loop is closed with the
  other reads pending; each then raises, when it is garbage collected, an
  ``Exception`` holding TensorStore's driver spec, which Python prints as
  "Exception ignored in: <coroutine ...>". Those (and only those) are
  dropped here, and collected before this returns.
  """
  previous = sys.unraisablehook

  def hook(unraisable: Any) -> None:
    if not str(unraisable.exc_value).startswith(
        "Encountered error while reading array index"):
      previous(unraisable)

  sys.unraisablehook = hook
  try:
    yield
  except BaseException:
    gc.collect()
    raise
  finally:
    sys.unraisablehook = previous
