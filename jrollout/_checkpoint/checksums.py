"""CRC-32 checksums of a checkpoint: recorded by a save, verified by a restore.

Each process records the CRC-32 of every shard it writes and the size of
every file of its store (``write_record``), process 0 those of the merged
index (``write_index``), in ``RECORD_DIR/`` of the item's directory. A
restore reads them (``records``), has the files they describe checked
before reading (``damage.check_files``), and checks the CRC-32 of each
recorded shard it holds whole before it returns anything (``verify``).
"""

from __future__ import annotations

from collections.abc import Sequence
import concurrent.futures
import json
import os
from typing import Any
import warnings
import zlib

from etils import epath  # type: ignore[import-untyped]

import jax
import numpy as np

from jrollout._checkpoint.damage import Damage
from jrollout._checkpoint.errors import first_line
from jrollout._checkpoint.record import Leaf

RECORD_DIR = "jrollout_checksums"
_INDEX = "index.json"
ALGORITHM = "crc32"
_Region = tuple[tuple[int, int], ...]

# ------------------------------------------------------------ the CRC-32

_BLOCK = 1 << 22                          # bytes per CRC-32 task, at least
_WORKERS = min(8, os.cpu_count() or 1)    # CRC-32 threads (zlib frees the GIL)
_POLY = 0xEDB88320                        # CRC-32's polynomial, reflected


def _multmodp(a: int, b: int) -> int:
  """``a * b`` modulo CRC-32's polynomial (zlib's multmodp)."""
  m, p = 1 << 31, 0
  while True:
    if a & m:
      p ^= b
      if a & (m - 1) == 0:
        return p
    m >>= 1
    b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]           # x^(2^k) modulo the polynomial, k = 0..31
for _ in range(31):
  _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def _crc_combine(crc1: int, crc2: int, len2: int) -> int:
  """The CRC-32 of ``A + B`` from those of ``A`` and ``B`` (``len2``
  bytes): zlib's crc32_combine."""
  p, k = 1 << 31, 3        # x^0; x^(8 * len2) by squares of x^(2^3)
  while len2:
    if len2 & 1:
      p = _multmodp(_X2N[k & 31], p)
    len2 >>= 1
    k += 1
  return _multmodp(p, crc1) ^ crc2


def crcs(arrays: Sequence[Any]) -> list[int]:
  """The CRC-32 of each array's bytes in C order. Large arrays are cut in
  blocks checksummed by ``_WORKERS`` threads, and the blocks' CRC-32s
  combined."""
  views = [np.ascontiguousarray(a).reshape(-1).view(np.uint8)
           for a in arrays]
  total = sum(v.size for v in views)
  if _WORKERS < 2 or total < 2 * _BLOCK:
    return [zlib.crc32(v.data) for v in views]
  block = max(_BLOCK, -(-total // (2 * _WORKERS)))
  with concurrent.futures.ThreadPoolExecutor(_WORKERS) as pool:
    parts = [[(pool.submit(zlib.crc32, v[i:i + block].data),
               min(block, v.size - i)) for i in range(0, v.size, block)]
             for v in views]
    out = []
    for blocks in parts:
      crc = 0
      for future, size in blocks:
        crc = _crc_combine(crc, future.result(), size)
      out.append(crc)
  return out


def in_background(fn: Any, *args: Any) -> Any:
  """Starts ``fn(*args)`` in a thread; returns a function that waits for
  it and returns its result (or raises its exception)."""
  pool = concurrent.futures.ThreadPoolExecutor(1)
  future = pool.submit(fn, *args)
  pool.shutdown(wait=False)
  return future.result


# ----------------------------------------------------- shards of a leaf


def _region(index: tuple[slice, ...], shape: tuple[int, ...]) -> _Region:
  """A shard's index as ``((start, stop), ...)`` for every axis."""
  index = tuple(index) + (slice(None),) * (len(shape) - len(index))
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _show(region: _Region) -> str:
  return "[" + ", ".join(f"{a}:{b}" for a, b in region) + "]"


def _raw(value: Any) -> Any:
  """A leaf's bytes as an array: the key data of PRNG keys."""
  if isinstance(value, jax.Array) and jax.dtypes.issubdtype(
      value.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(value)
  return value


def _saved_shards(value: Any) -> list[tuple[_Region, Any]]:
  """The ``(region, host array)`` pieces of a leaf that this process saves."""
  value = _raw(value)
  if isinstance(value, jax.Array):
    shards = [s for s in value.addressable_shards if s.replica_id == 0]
    hosts = jax.device_get([s.data for s in shards])
    return [(_region(s.index, value.shape), h) for s, h in zip(shards, hosts)]
  if jax.process_index() != 0:   # orbax saves NumPy leaves from process 0
    return []
  value = np.asarray(value)
  return [(_region((), value.shape), value)]


def checksums(leaves: list[Leaf]) -> dict[str, list[list[Any]]]:
  """``{path: [[region, crc], ...]}`` of the stored leaves' saved shards."""
  shards = [(leaf.path, region, host) for leaf in leaves
            if 0 not in leaf.shape
            for region, host in _saved_shards(leaf.value)]
  out: dict[str, list[list[Any]]] = {}
  for (path, region, _), crc in zip(shards, crcs([x[2] for x in shards])):
    out.setdefault(path, []).append([[list(r) for r in region], crc])
  return out


# ------------------------------------------------------ the record files


def _files(directory: Any, names: list[str], everything: str | None = None
           ) -> tuple[dict[str, int], dict[str, int]]:
  """``({file: size}, {file: crc})``: sizes of the files below
  ``everything``, sizes and CRC-32 of the files ``names`` (those present)."""
  sizes, found_crcs = {}, {}
  if everything is not None and (directory / everything).exists():
    for root, _, found in (directory / everything).walk():
      for name in found:
        path = epath.Path(root) / name
        sizes[str(path.relative_to(directory))] = path.stat().length
  for name in names:
    if (directory / name).exists():
      content = (directory / name).read_bytes()
      sizes[name], found_crcs[name] = len(content), zlib.crc32(content)
  return sizes, found_crcs


def _write_json(directory: Any, name: str, record: dict[str, Any]) -> None:
  (directory / RECORD_DIR).mkdir(parents=True, exist_ok=True)
  (directory / RECORD_DIR / name).write_text(json.dumps(record))


def write_record(directory: Any, leaf_crcs: dict[str, Any]) -> None:
  """Writes ``RECORD_DIR/process_<i>.json`` into ``directory``.

  Once orbax has written this process's arrays: the CRC-32 (zlib) of each
  shard it wrote (``leaf_crcs``, from ``checksums``: its addressable shards
  of replica 0; NumPy leaves and Python scalars from process 0, whole),
  keyed by the shard's region of the leaf (of the key data for PRNG keys);
  the size of every file of its OCDBT store; size and CRC-32 of the orbax
  metadata files it wrote (``_METADATA``, ``_sharding``,
  ``array_metadatas/process_<i>``).
  """
  directory = epath.Path(directory)
  process = jax.process_index()
  metadata = [f"array_metadatas/process_{process}"]
  if process == 0:
    metadata += ["_METADATA", "_sharding"]
  sizes, file_crcs = _files(directory, metadata, f"ocdbt.process_{process}")
  _write_json(directory, f"process_{process}.json", {
      "algorithm": ALGORITHM, "process": process, "leaves": leaf_crcs,
      "files": sizes, "crcs": file_crcs})


def write_index(directory: Any) -> None:
  """Writes ``RECORD_DIR/index.json``: size and CRC-32 of the merged index
  (``manifest.ocdbt``, ``d/*``). By process 0 once orbax has merged the
  processes' stores (``finalize``, before the checkpoint is renamed into
  place)."""
  directory = epath.Path(directory)
  names = ["manifest.ocdbt"]
  if (directory / "d").exists():
    names += [f"d/{path.name}" for path in sorted((directory / "d").iterdir())]
  sizes, file_crcs = _files(directory, names)
  _write_json(directory, _INDEX, {"algorithm": ALGORITHM, "leaves": {},
                                  "files": sizes, "crcs": file_crcs})


def _read_record(directory: Any, where: str) -> dict[str, Any]:
  """One record file, checked for the fields a restore reads."""
  record = json.loads((directory / where).read_text())
  if record["algorithm"] != ALGORITHM:
    raise ValueError(f"unknown algorithm {record['algorithm']!r}")
  for field in ("leaves", "files", "crcs"):
    if not isinstance(record[field], dict):
      raise TypeError(f"{field} is a {type(record[field]).__name__}")
  return record


def records(fn: str, directory: Any, meta: dict[str, Any]
            ) -> list[dict[str, Any]] | None:
  """The records of every process that saved, and of the index; None (and
  a warning) for a checkpoint written before jrollout recorded them."""
  info = meta.get("checksums")
  damage = Damage(fn, directory, meta["rollouts"])
  if meta["version"] >= 2 and not isinstance(info, dict):
    damage.add("its metadata file _METADATA has no checksums entry")
    raise damage.error()
  if info is None:
    warnings.warn(
        f"{fn}: checkpoint {directory} was written by an older jrollout, "
        "without checksums: it is restored unverified (save it again to "
        "record them)", UserWarning, stacklevel=4)
    return None
  directory = epath.Path(directory)
  found = []
  names = [f"process_{i}.json" for i in range(info["processes"])]
  for name in [*names, _INDEX]:
    where = f"{RECORD_DIR}/{name}"
    try:
      found.append(_read_record(directory, where))
    except FileNotFoundError:
      damage.add(f"its checksum record {where} is missing")
    except (ValueError, KeyError, TypeError, OSError) as e:
      damage.add(f"its checksum record {where} cannot be read "
                 f"({type(e).__name__}: {first_line(e)})")
  damage.raise_any()
  return found


# ------------------------------------------------- verifying what is read


def _pieces(value: Any) -> dict[_Region, Any]:
  """This process's restored pieces of a leaf, by region."""
  value = _raw(value)
  if isinstance(value, jax.Array):
    shards: dict[_Region, Any] = {}
    for shard in value.addressable_shards:
      shards.setdefault(_region(shard.index, value.shape), shard.data)
    hosts = jax.device_get(list(shards.values()))
    return dict(zip(shards, hosts))
  value = np.asarray(value)
  return {_region((), value.shape): value}


def _assemble(region: _Region, pieces: dict[_Region, Any]
              ) -> tuple[np.ndarray | None, bool]:
  """``region`` copied out of ``pieces``: ``(array, True)``; ``(None,
  partly)`` when the pieces do not cover it (``partly``: some of it)."""
  if region in pieces:
    return pieces[region], True
  out, covered = None, 0
  for where, piece in pieces.items():
    lo = [max(a, c) for (a, _), (c, _) in zip(region, where)]
    hi = [min(b, d) for (_, b), (_, d) in zip(region, where)]
    if any(a >= b for a, b in zip(lo, hi)):
      continue
    if out is None:
      out = np.empty([b - a for a, b in region], piece.dtype)
    src = tuple(slice(a - c, b - c) for a, b, (c, _) in zip(lo, hi, where))
    dst = tuple(slice(a - c, b - c) for a, b, (c, _) in zip(lo, hi, region))
    out[dst] = piece[src]
    covered += int(np.prod([b - a for a, b in zip(lo, hi)]))
  if out is not None and covered == out.size:
    return out, True
  return None, out is not None


def verify(leaves: list[Leaf], values: list[Any],
           found: list[dict[str, Any]], damage: Damage) -> list[str]:
  """Checks every recorded shard (of the records ``found``) this process
  holds whole; adds the mismatches to ``damage``. Returns the leaves with
  shards split between processes (not verified here)."""
  split: list[str] = []
  checks = []    # (leaf, region, its bytes here, recorded crc, whole leaf)
  for leaf, value in zip(leaves, values):
    chunks = [chunk for record in found
              for chunk in record["leaves"].get(leaf.path, [])]
    if not chunks:
      continue
    pieces = _pieces(value)
    for region_list, crc in chunks:
      region = tuple((int(a), int(b)) for a, b in region_list)
      array, partly = _assemble(region, pieces)
      if array is not None:
        checks.append((leaf, region, array, crc,
                       array.shape == np.shape(_raw(value))))
      elif partly and leaf.path not in split:
        split.append(leaf.path)
  for (leaf, region, _, crc, whole), got in zip(
      checks, crcs([x[2] for x in checks])):
    if got != crc and leaf.path not in damage.leaves:
      where = "" if whole else f" in shard {_show(region)}"
      damage.add(f"checksum mismatch{where}: its bytes have CRC-32 "
                 f"{got:#010x}, the save recorded {crc:#010x}", [leaf.path])
  return split
