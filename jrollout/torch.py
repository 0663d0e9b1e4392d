"""DLPack bridges between JAX and PyTorch pytrees.

``to_torch`` and ``from_torch`` convert every array (tensor) leaf of a
pytree, sharing memory wherever the layout allows; every copy is reported
(the ``*_copied`` variants, DEBUG records on the ``jrollout.torch`` logger).
torch is an optional extra (``pip install "jrollout[torch]"``), imported at
the first bridge call.
"""

from __future__ import annotations

from collections.abc import Sequence
import functools
import logging
import os
import sys
from typing import Any, TYPE_CHECKING
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from jrollout import _checks

if TYPE_CHECKING:
  import torch

__all__ = ("exported_views_alive", "from_torch", "from_torch_copied",
           "share_cpu_with_torch", "to_torch", "to_torch_copied")

PyTree = Any
logger = logging.getLogger("jrollout.torch")

_COPY_TRUE = ("copy=True",)
_DLPACK_ERRORS = (BufferError, TypeError, RuntimeError)
# Leaves that pass through unchanged; any other non-array leaf is refused.
_PLAIN = (type(None), bool, int, float, complex, str, bytes, np.ndarray,
          np.generic)
# The data pointer of each storage to_torch shared, while a view lives.
_EXPORTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NARROW: dict = {}   # set by _load_torch, as torch is
_FAST: frozenset = frozenset()
_copy_jit: Any = None


@functools.cache
def _load_torch() -> None:
  """Imports torch into this module at the first bridge call."""
  global torch, _FAST, _NARROW, _copy_jit
  try:
    import torch  # noqa: PLC0415 - an optional extra, loaded on first use
  except ImportError as err:
    raise ImportError(
        "jrollout.torch needs PyTorch, an optional extra: install it with "
        '`pip install "jrollout[torch]"`.') from err
  # The zero-copy fast path's dtypes; the 64-bit ones JAX keeps in 32 bits.
  _FAST = frozenset({torch.float16, torch.float32, torch.int8, torch.int16,
                     torch.int32, torch.uint8, torch.bool})
  _NARROW = {torch.int64: torch.int32, torch.float64: torch.float32,
             torch.complex128: torch.complex64, torch.uint64: torch.uint32}
  cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  _copy_jit = jax.jit(lambda xs: [jnp.copy(x) for x in xs],
                      in_shardings=cpu, out_shardings=cpu)
  # torch warns once a process about read-only numpy arrays (views of JAX
  # buffers): spent here, silenced, so every export stays silent.
  readonly = np.zeros(1)
  readonly.flags.writeable = False
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="The given NumPy array")
    torch.from_numpy(readonly)


def share_cpu_with_torch() -> str:
  """Sets ``OMP_WAIT_POLICY=PASSIVE`` unless set, before ``import torch``:
  torch's CPU threads then sleep between ops instead of spinning on the
  cores JAX needs next. Returns the policy in effect, in upper case; a
  RuntimeError if torch is imported already and the variable is not set.

  Example:
    >>> import os, unittest.mock
    >>> from jrollout.torch import share_cpu_with_torch
    >>> with unittest.mock.patch.dict(os.environ, {"OMP_WAIT_POLICY": "x"}):
    ...   share_cpu_with_torch()        # a launcher's value is kept
    'X'
  """
  current = os.environ.get("OMP_WAIT_POLICY", "").strip()
  if current:
    return current.upper()
  if "torch" in sys.modules:
    raise RuntimeError(
        "share_cpu_with_torch: torch is already imported, and its OpenMP "
        "threads read OMP_WAIT_POLICY (not set: spin after each op) when it "
        "loaded; expected a call before the first `import torch`, or a "
        "process started with OMP_WAIT_POLICY=PASSIVE")
  os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
  return "PASSIVE"


def exported_views_alive(arr: jax.Array) -> bool:
  """Whether a tensor made by :func:`to_torch` (or a view of it) still
  shares a buffer of `arr`; while one does, JAX skips donating `arr`.

  Example:
    >>> import jax.numpy as jnp
    >>> from jrollout.torch import to_torch, exported_views_alive
    >>> x = jnp.zeros(4)
    >>> t = to_torch(x)
    >>> exported_views_alive(x), exported_views_alive(jnp.ones(4))
    (True, False)
  """
  if not isinstance(arr, jax.Array) or arr.is_deleted():
    return False
  shared = set(_EXPORTED.values())
  return any(shard.data.unsafe_buffer_pointer() in shared
             for shard in arr.addressable_shards)


class _Path(tuple):
  """``(tree, i)``: leaf i of tree, its keystr built only when printed."""

  def __str__(self) -> str:
    flat, _ = jax.tree_util.tree_flatten_with_path(self[0])
    return jax.tree_util.keystr(flat[self[1]][0]) or "(the tree itself)"


def _copied(path: Any, copy: bool | None, reasons: list, why: str) -> None:
  """Records why a leaf is copied; raises instead if ``copy=False``."""
  if copy is False:
    raise ValueError(f"from_torch: leaf {path} needs a copy ({why}), but "
                     "copy=False")
  reasons.append(why)


def _dlpack(fn: str, path: Any, x: Any, convert: Any) -> Any:
  """``convert(x)``, a DLPack transfer; its failure a TypeError naming `x`."""
  try:
    return convert(x)
  except _DLPACK_ERRORS as err:
    raise TypeError(f"{fn}: leaf {path} with dtype {x.dtype} on {x.device} "
                    f"cannot go through DLPack: {err}") from err


def _convert(fn: str, tree: PyTree, leaf_type: type, other_type: type,
             convert: Any) -> tuple[PyTree, Any]:
  """``(tree, copied flags)``: `leaf_type` leaves through ``convert(path,
  leaf) -> (new, reasons)`` (numpy views: one jitted copy), others kept."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  out, copied, reports = list(leaves), [False] * len(leaves), []
  views = {}   # leaf index: a numpy view, copied by one jitted call
  for i, leaf in enumerate(leaves):
    if isinstance(leaf, leaf_type):
      out[i], reasons = convert(_Path((tree, i)), leaf)
      copied[i] = bool(reasons)
      reports += [(i, why) for why in reasons]
      if isinstance(out[i], np.ndarray):
        views[i] = out[i]
    elif not isinstance(leaf, (other_type, *_PLAIN)):
      what = type(leaf)
      raise TypeError(
          f"{fn.removesuffix('_copied')}: leaf {_Path((tree, i))} is a "
          f"{what.__module__}.{what.__qualname__}, which the bridge does "
          "not know; expected a tensor, an array, a number, a string or "
          "None, in dicts, lists, tuples or registered pytree nodes")
  if views:   # waited for: the tensors may change once this returns
    for i, arr in zip(views, _copy_jit(list(views.values()))):
      out[i] = arr.block_until_ready()
  if reports and logger.isEnabledFor(logging.DEBUG):
    for i, why in reports:
      logger.debug("%s: leaf %s was copied (%s)", fn, _Path((tree, i)), why)
  unflatten = functools.partial(jax.tree_util.tree_unflatten, treedef)
  return unflatten(out), lambda: unflatten(copied)


def _export(path: Any, arr: jax.Array, copy: bool | None
            ) -> tuple[torch.Tensor, Sequence[str]]:
  """One array as ``(tensor, reasons it was copied)``."""
  if isinstance(arr, jax.core.Tracer):
    raise TypeError(f"to_torch: leaf {path} is a tracer {arr}; expected a "
                    "concrete jax.Array. Call to_torch outside jax.jit.")
  if not isinstance(arr.dtype, np.dtype):
    raise TypeError(
        f"to_torch: leaf {path} has dtype {arr.dtype} (a typed PRNG key?), "
        "which torch has no equivalent of; export jax.random.key_data(key)")
  if arr.is_deleted():
    raise ValueError(f"to_torch: leaf {path} is a deleted (donated?) array.")
  if not isinstance(arr.sharding, jax.sharding.SingleDeviceSharding):
    devices = len(arr.sharding.device_set)
    if devices > 1 and not arr.is_fully_replicated:
      raise ValueError(
          f"to_torch: leaf {path} of shape {arr.shape} is sharded over "
          f"{devices} devices ({arr.sharding}); expected one device or a "
          "replicated array (jax.device_put(x, device), or each shard)")
    arr = arr.addressable_data(0)
  arr.block_until_ready()
  if arr.dtype.kind in "biuf" and arr.platform() == "cpu":
    # numpy's view costs a quarter of torch.from_dlpack (bridge_to_torch)
    tensor = torch.from_numpy(np.asarray(arr))
  else:
    tensor = _dlpack("to_torch", path, arr, torch.from_dlpack)
  if copy:
    return tensor.clone(), _COPY_TRUE
  if arr.size:
    _EXPORTED[tensor.untyped_storage()] = arr.unsafe_buffer_pointer()
  return tensor, ()


def to_torch(tree: PyTree, *, copy: bool | None = None) -> PyTree:
  """Converts every ``jax.Array`` leaf ``[*s]`` of `tree` to a tensor ``[*s]``.

  Arrays must be concrete, on one device or fully replicated; None, numbers,
  strings, numpy arrays and tensors pass through. The tensors share the
  arrays' memory (do not write to them in place) unless ``copy=True``.

  Raises:
    TypeError: a tracer (inside ``jax.jit``), a PRNG key array, a dtype
      DLPack cannot carry, an unknown leaf, a ``copy`` not None or a bool.
    ValueError: a sharded or deleted leaf.

  Example:
    >>> import jax.numpy as jnp
    >>> from jrollout.torch import to_torch
    >>> out = to_torch({"obs": jnp.ones((2, 3)), "step": 5})
    >>> out["obs"].shape, out["obs"].dtype, out["step"]
    (torch.Size([2, 3]), torch.float32, 5)
  """
  return _to_torch("to_torch", tree, copy)[0]


def to_torch_copied(tree: PyTree, *, copy: bool | None = None
                    ) -> tuple[PyTree, PyTree]:
  """:func:`to_torch`, and ``copied``: True per leaf with its own memory.

  Example:
    >>> import jax.numpy as jnp, jrollout.torch as jt
    >>> jt.to_torch_copied(jnp.arange(3))          # shared, not copied
    (tensor([0, 1, 2], dtype=torch.int32), False)
  """
  tensors, copied = _to_torch("to_torch_copied", tree, copy)
  return tensors, copied()


def _to_torch(fn: str, tree: PyTree, copy: Any) -> tuple[PyTree, Any]:
  _load_torch()
  copy = _checks.check_bool(fn, "copy", copy, none=True)
  return _convert(fn, tree, jax.Array, torch.Tensor,
                  lambda path, arr: _export(path, arr, copy))


def _refuse(path: Any, t: torch.Tensor, detach: bool) -> None:
  """Refuses a tensor JAX cannot take as it is, naming the fix."""
  for refused, why in [
      (t.is_nested, "is a nested (ragged) tensor; JAX arrays are rectangular:"
       " import `t.unbind()` or `t.to_padded_tensor(0.0)`"),
      (t.layout != torch.strided, f"has layout {t.layout}; only dense "
       "(strided) tensors can be imported: call `.to_dense()` first"),
      (t.is_meta, "is on the meta device and holds no data; materialise it "
       "first (e.g. `torch.empty_like(t, device='cpu')`)"),
      (t.is_quantized, f"is quantized ({t.dtype}); call `.dequantize()` "
       "first")]:
    if refused:
      raise TypeError(f"from_torch: leaf {path} {why}")
  if t.requires_grad and not detach:
    raise ValueError(f"from_torch: leaf {path} requires grad; call "
                     "`.detach()` on it first or pass detach=True.")


def _downcast(path: Any, t: torch.Tensor, narrow: torch.dtype) -> Any:
  """`t` cast to `narrow`; refused where the cast changes a value."""
  out = t.to(narrow)
  if not t.numel():
    return out
  if not (narrow.is_floating_point or narrow.is_complex):
    info, lo, hi = torch.iinfo(narrow), int(t.min()), int(t.max())
    if lo < info.min or hi > info.max:
      raise ValueError(f"from_torch: leaf {path} has {t.dtype} values in "
                       f"[{lo}, {hi}], outside the {narrow} range "
                       f"[{info.min}, {info.max}]; enable x64 to import it")
  elif bool((torch.isinf(out) & torch.isfinite(t)).any()):
    big = float(t[torch.isfinite(t)].abs().max())
    raise ValueError(
        f"from_torch: leaf {path} has finite {t.dtype} values of magnitude "
        f"up to {big:.6g}, beyond the largest {narrow} "
        f"({torch.finfo(narrow).max:.6g}); the cast would make them inf. "
        "Enable jax_enable_x64 to import it, or scale it first.")
  return out


def _import(path: Any, t: torch.Tensor, copy: bool | None, detach: bool,
            allow_downcast: bool) -> tuple[Any, Sequence[str]]:
  """One tensor as ``(array, reasons it was copied)``; with copy=True a
  32-bit one numpy can view is that view, for the one jitted copy."""
  if copy and t.dtype not in _NARROW:
    try:   # refuses another device, grad, sparse, nested, meta, neg bit
      return t.numpy(), _COPY_TRUE
    except (RuntimeError, TypeError):
      pass
  # A view as it is, without the checks below (row from_torch_step).
  elif (t.dtype in _FAST and t.is_cpu and not t.requires_grad
        and t.layout == torch.strided and not t.is_neg()
        and not t.is_nested and t.is_contiguous() and t.data_ptr() % 64 == 0):
    return _dlpack("from_torch", path, t, jax.dlpack.from_dlpack), ()
  _refuse(path, t, detach)
  t = t.detach() if t.requires_grad else t
  reasons: list[str] = []
  if t.is_cuda and jax.default_backend() == "gpu":
    torch.cuda.current_stream(t.device).synchronize()
  elif not t.is_cpu:
    _copied(path, copy, reasons, f"on {t.device}, which JAX cannot see")
    t = t.cpu()
  narrow = _NARROW.get(t.dtype)
  if narrow is not None and not _checks.x64_enabled():
    if not allow_downcast:
      raise TypeError(
          f"from_torch: leaf {path} has dtype {t.dtype}, but jax_enable_x64 "
          f"is off and JAX would silently truncate it to {narrow}: pass "
          "allow_downcast=True to cast it explicitly, or enable x64")
    _copied(path, copy, reasons, f"cast {t.dtype} to {narrow}")
    t = _downcast(path, t, narrow)
  if t.is_neg() or t.is_conj():   # lazy views that DLPack cannot carry
    _copied(path, copy, reasons, "its negative or conjugate bit resolved")
    t = t.resolve_neg().resolve_conj()
  # Dense, possibly permuted: contiguous once the dims are sorted by stride.
  if t.numel() and not t.is_contiguous():
    order = sorted(range(t.dim()), key=t.stride, reverse=True)
    if not t.permute(order).is_contiguous():
      _copied(path, copy, reasons, f"strides {t.stride()} of shape "
              f"{tuple(t.shape)}, with gaps or broadcasting, made dense")
      t = t.contiguous()
  if copy and not reasons:
    t, reasons = t.clone(), [*_COPY_TRUE]
  arr = _dlpack("from_torch", path, t, jax.dlpack.from_dlpack)
  if not reasons and t.numel() and arr.unsafe_buffer_pointer() != t.data_ptr():
    _copied(path, copy, reasons, f"data_ptr % 64 = {t.data_ptr() % 64}: "
            "XLA:CPU copies buffers not 64-byte aligned")
  return arr, reasons


def from_torch(tree: PyTree, *, copy: bool | None = None, detach: bool = False,
               allow_downcast: bool = False,
               batch_size: Sequence[int] | None = None) -> PyTree:
  """Converts every tensor leaf ``[*s]`` of `tree` to a ``jax.Array`` ``[*s]``.

  A ``TensorDict`` becomes the nested dict of its entries (of `batch_size`
  if given); arrays, numbers, strings and None pass through. The arrays
  share the tensors' memory (``copy=True`` copies; ``copy=False`` raises
  where a copy is needed: gappy strides, misalignment, a cast, a device).
  ``detach`` detaches tensors that require grad; ``allow_downcast`` casts
  64-bit tensors to 32 bits without x64. A GPU stream is synchronized.

  Raises:
    TypeError: a 64-bit tensor without x64 or ``allow_downcast``, a tensor
      without dense data (meta, sparse, quantized, nested), an unknown
      leaf, a flag that is not a bool.
    ValueError: a TensorDict of another batch size, a tensor requiring grad
      without ``detach``, a cast changing a value, a copy with copy=False.

  Example:
    >>> import torch
    >>> from jrollout.torch import from_torch
    >>> from_torch(torch.arange(3), allow_downcast=True)   # int64: a copy
    Array([0, 1, 2], dtype=int32)
  """
  return _from_torch("from_torch", tree, copy, detach, allow_downcast,
                     batch_size)[0]


def from_torch_copied(tree: PyTree, *, copy: bool | None = None,
                      detach: bool = False, allow_downcast: bool = False,
                      batch_size: Sequence[int] | None = None
                      ) -> tuple[PyTree, PyTree]:
  """:func:`from_torch`, and ``copied``: True per leaf with its own memory.

  Example:
    >>> import torch, jrollout.torch as jt
    >>> x, copied = jt.from_torch_copied({"obs": torch.zeros(2, 3)})
    >>> copied                                        # memory shared
    {'obs': False}
  """
  arrays, copied = _from_torch("from_torch_copied", tree, copy, detach,
                               allow_downcast, batch_size)
  return arrays, copied()


def _from_torch(fn: str, tree: PyTree, copy: Any, detach: Any,
                allow_downcast: Any, batch_size: Any
                ) -> tuple[PyTree, Any]:
  _load_torch()
  copy = _checks.check_bool(fn, "copy", copy, none=True)
  detach = _checks.check_bool(fn, "detach", detach)
  allow_downcast = _checks.check_bool(fn, "allow_downcast", allow_downcast)
  if batch_size is not None:
    if not (isinstance(batch_size, Sequence)
            and all(type(n) is int and n >= 0 for n in batch_size)):
      raise TypeError(f"{fn}: `batch_size` must be a sequence of "
                      f"non-negative ints or None, got {batch_size!r}")
    batch_size = tuple(batch_size)
  # A TensorDict is a leaf to JAX: expanded to the nested dict of its
  # tensors (the bridge never imports tensordict: none before it is).
  base: Any = getattr(sys.modules.get("tensordict"), "TensorDictBase", None)

  def expand(path: Any, td: Any) -> Any:
    if not isinstance(td, base):
      return td
    where = jax.tree_util.keystr(path) or "(the tree itself)"
    if not isinstance(td, sys.modules["tensordict"].TensorDict):
      raise TypeError(
          f"{fn}: leaf {where} is a {type(td).__name__}, whose tensors are "
          "not stored as they are read; expected a TensorDict (call "
          "`.contiguous()` first, which copies)")
    if batch_size is not None and tuple(td.batch_size) != batch_size:
      raise ValueError(
          f"{fn}: TensorDict {where} has batch size {tuple(td.batch_size)}; "
          f"expected batch_size={batch_size}")
    return td.to_dict()

  if base is not None:
    tree = jax.tree_util.tree_map_with_path(
        expand, tree, is_leaf=lambda x: isinstance(x, base))
  return _convert(fn, tree, torch.Tensor, jax.Array,
                  lambda path, t: _import(path, t, copy, detach,
                                          allow_downcast))

