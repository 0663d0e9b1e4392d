"""DLPack bridges between JAX and PyTorch pytrees.

This is the only module of ``jrollout`` that imports torch, an optional extra
(``pip install "jrollout[torch]"``). Both directions go through the
``__dlpack__`` protocol (or, on the CPU, numpy's zero-copy views where they
are cheaper) and share memory whenever the layout allows it; every
copy is reported, either through ``return_copied=True`` or as one DEBUG record
per copied leaf on the ``jrollout.torch`` logger. Shapes are always preserved.

Behaviour checked with jax 0.10.2 and torch 2.13 on CPU:

* ``jax.dlpack.from_dlpack(t, copy=True)`` still shares torch's memory, and
  so does ``jax.device_put(t.numpy())`` on the CPU (even with
  ``may_alias=False``). ``from_torch(copy=True)`` copies CPU
  tensors with one jitted ``jnp.copy`` of all their numpy views (one
  dispatch for the whole tree, waited for), ``t.clone()`` elsewhere. On the
  CPU that copy costs less than a DLPack import of one tensor at the sizes
  a host loop moves per step (``benchmarks/suites/hostloop.py``).
* ``copy=None`` never copies a tensor that can be shared, however small,
  although the copy is cheaper: a caller may rely on the aliasing, and
  whether memory is shared must not depend on the size. Pass ``copy=True``
  for the fast copy.
* ``to_torch`` of a CPU array shares it through ``np.asarray`` and
  ``torch.from_numpy``, not DLPack: the same sharing and lifetime (and the
  same block on donation), at about a quarter of the cost of JAX's Python
  ``__dlpack__``. Other devices, and dtypes numpy lacks, use DLPack.
* Permuted (transposed) torch tensors import without a copy: the JAX array
  keeps the permuted layout (see ``arr.format.layout``). Tensors with gaps or
  broadcast strides (``t[:, ::2]``) are rejected by JAX, so they are made
  contiguous here (a copy).
* XLA:CPU needs 64-byte aligned buffers; JAX silently copies anything else.
  That copy is detected by comparing data pointers.
* ``bool`` goes through DLPack both ways without a copy.
* A JAX buffer viewed by a live torch tensor is not donated:
  ``jax.jit(f, donate_argnums=0)(x)`` leaves ``x.is_deleted()`` False, without
  a warning. :func:`exported_views_alive` tells whether that can happen.

GPU: ``to_torch`` waits for the array (``block_until_ready``) and torch passes
its current stream through ``__dlpack__``; ``from_torch`` synchronizes torch's
current stream of the tensor's device before JAX imports it (JAX also passes
its own stream). Arrays stay on the same device in both directions.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jrollout import _checks

try:
  import torch
except ImportError as _err:  # pragma: no cover - exercised without torch only.
  raise ImportError(
      "jrollout.torch needs PyTorch, an optional extra: install it with "
      '`pip install "jrollout[torch]"`.'
  ) from _err

PyTree = Any

logger = logging.getLogger("jrollout.torch")

# torch dtypes that JAX truncates to 32 bits when jax_enable_x64 is disabled.
_DOWNCAST = {
    torch.int64: torch.int32,
    torch.float64: torch.float32,
    torch.complex128: torch.complex64,
}
if hasattr(torch, "uint64"):
  _DOWNCAST[torch.uint64] = torch.uint32

# The fast paths of from_torch take tensors of these dtypes only (no cast,
# and numpy can hold them); everything else goes the general way.
_FAST_DTYPES = frozenset({
    torch.float16, torch.float32, torch.int8, torch.int16, torch.int32,
    torch.uint8, torch.bool})

# Buffer pointer -> weak references to the torch storages exported from it.
_EXPORTS: dict[int, list[weakref.ref]] = {}


def _register_export(ptr: int, tensor: torch.Tensor) -> None:
  def drop(ref, ptr=ptr):
    refs = _EXPORTS.get(ptr, [])
    if ref in refs:
      refs.remove(ref)
    if not refs:
      _EXPORTS.pop(ptr, None)

  # torch keeps one Python object per live storage, shared by all its views.
  _EXPORTS.setdefault(ptr, []).append(
      weakref.ref(tensor.untyped_storage(), drop))


def exported_views_alive(arr: jax.Array) -> bool:
  """Tells whether a torch tensor made by :func:`to_torch` still views `arr`.

  Views derived from such a tensor (slices, reshapes) count too, since they
  keep its storage alive. Tensors made by calling ``torch.from_dlpack``
  directly are not tracked. While this returns True, JAX will not donate
  `arr` (``donate_argnums`` is silently skipped) and the memory stays shared.

  Args:
    arr: a JAX array of any shape.

  Returns:
    True if at least one tracked torch storage shares a buffer of `arr`.
  """
  if not isinstance(arr, jax.Array) or arr.is_deleted():
    return False
  for i in range(len(arr.addressable_shards)):
    refs = _EXPORTS.get(arr.addressable_data(i).unsafe_buffer_pointer(), [])
    if any(ref() is not None for ref in refs):
      return True
  return False


def _report(fn: str, path: Any, reason: str) -> None:
  logger.debug("%s: leaf %s was copied (%s)", fn, path, reason)


def _array_to_tensor(path: Any, arr: jax.Array, copy: bool | None):
  """Exports one JAX array; returns (tensor, copied)."""
  if arr.is_deleted():
    raise ValueError(f"to_torch: leaf {path} is a deleted (donated?) array.")
  src = arr
  if len(arr.sharding.device_set) > 1:
    if not arr.is_fully_replicated:
      raise ValueError(
          f"to_torch: leaf {path} of shape {arr.shape} is sharded over "
          f"{len(arr.sharding.device_set)} devices ({arr.sharding}); expected "
          "a single-device or fully replicated array. Gather it first with "
          "jax.device_put(x, device), or export x.addressable_shards one by "
          "one.")
    src = arr.addressable_data(0)
  src.block_until_ready()
  reason = None
  try:
    tensor = None
    if copy is not True and src.platform() == "cpu":
      tensor = _cpu_view(src)
    if tensor is None:
      tensor = torch.from_dlpack(src)
  except (BufferError, TypeError, RuntimeError) as err:
    if src.dtype != jnp.bool_:
      raise TypeError(
          f"to_torch: leaf {path} with dtype {src.dtype} on {src.device} "
          f"cannot be exported through DLPack: {err}") from err
    if copy is False:
      raise ValueError(
          f"to_torch: leaf {path} is bool, which this DLPack cannot export; "
          "it needs a copy through uint8, but copy=False.") from err
    tensor = torch.from_dlpack(src.astype(jnp.uint8)).view(torch.bool)
    reason = "bool exported through a uint8 copy"
  if copy and reason is None:
    tensor = tensor.clone()
    reason = "copy=True"
  ptr = src.unsafe_buffer_pointer() if src.size else None
  if reason is None and ptr is not None and tensor.data_ptr() != ptr:
    reason = "DLPack copied on export"
    if copy is False:
      raise ValueError(f"to_torch: leaf {path} could not be shared without a "
                       "copy, but copy=False.")
  if reason is not None:
    _report("to_torch", path, reason)
    return tensor, True
  if ptr is not None:
    _register_export(ptr, tensor)
  return tensor, False


_QUIET = False   # torch's read-only warning seen (it warns once a process)


def _cpu_view(src: jax.Array):
  """A torch view of a CPU array through numpy, or None where numpy can't.

  ``torch.from_numpy(np.asarray(src))`` shares the buffer like DLPack, keeps
  it alive the same way (and blocks its donation the same way), and costs a
  quarter of ``torch.from_dlpack(src)``, most of whose time is JAX's Python
  ``__dlpack__``. numpy marks the view read-only, which torch warns about
  once a process: that one warning is silenced, since a shared tensor must
  not be written in place anyway (see :func:`to_torch`). The caller checks
  that memory is shared. Dtypes numpy lacks (bfloat16) return None.
  """
  global _QUIET
  if src.dtype.kind not in "biuf":
    return None   # ml_dtypes' bfloat16, float8 ... (kind "V"), complex
  view = np.asarray(src)
  if _QUIET:
    return torch.from_numpy(view)
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="The given NumPy array is not "
                            "writable")
    tensor = torch.from_numpy(view)
  _QUIET = True
  return tensor


def to_torch(tree: PyTree, *, copy: bool | None = None,
             return_copied: bool = False) -> PyTree:
  """Converts every ``jax.Array`` leaf of `tree` to a ``torch.Tensor``.

  Shapes, dtypes, devices and the tree structure are preserved; other leaves
  (None, Python scalars, numpy arrays) pass through unchanged. A shared
  tensor aliases JAX memory: do not write to it in place.

  Args:
    tree: a pytree whose array leaves are concrete ``jax.Array`` of any shape
      ``[*s]``, on one device or fully replicated.
    copy: None shares memory where possible, True always returns independent
      memory, False raises where a copy would be needed.
    return_copied: if True, also return a pytree of bools, True where the
      leaf was copied.

  Returns:
    The pytree of ``[*s]`` tensors, or ``(tensors, copied)`` when
    `return_copied` is True.

  Raises:
    TypeError: a leaf is a tracer (called inside ``jax.jit``), a typed PRNG
      key (export ``jax.random.key_data(key)``), or its dtype cannot go
      through DLPack; a flag that is not a bool.
    ValueError: a leaf is sharded over several devices, deleted, or needs a
      copy while ``copy=False``.
  """
  if not (copy is None or copy is True or copy is False) or (
      type(return_copied) is not bool):
    _flag_error("to_torch", copy=copy, return_copied=return_copied)
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  out, copied = list(leaves), [False] * len(leaves)
  for i, leaf in enumerate(leaves):
    if isinstance(leaf, jax.core.Tracer):   # before: tracers are jax.Arrays
      raise TypeError(f"to_torch: leaf {_LeafPath(tree, i)} is a tracer "
                      f"{leaf}; expected a concrete jax.Array. Call to_torch "
                      "outside jax.jit.")
    if isinstance(leaf, jax.Array):
      if not isinstance(leaf.dtype, np.dtype):   # an extended dtype: keys
        raise TypeError(
            f"to_torch: leaf {_LeafPath(tree, i)} has dtype {leaf.dtype}, "
            "which torch has no equivalent of (a typed PRNG key array?); "
            "export its raw data with jax.random.key_data(key) and rebuild "
            "the key with jax.random.wrap_key_data(data)")
      out[i], copied[i] = _array_to_tensor(_LeafPath(tree, i), leaf, copy)
  return _rebuild(treedef, out, copied, return_copied)


def _flag_error(fn: str, **flags: Any) -> None:
  """Raises for the first flag that is not a bool (``copy`` may be None)."""
  for name, value in flags.items():
    if not (type(value) is bool or (name == "copy" and value is None)):
      allowed = "None, True or False" if name == "copy" else "True or False"
      raise TypeError(f"{fn}: `{name}` must be {allowed}, got "
                      f"{type(value).__name__} {value!r}")


class _LeafPath:
  """Leaf ``index`` of `tree`, formatted as its ``keystr`` when printed.

  Paths only name leaves in errors and copy reports, and building them
  (``tree_flatten_with_path`` and ``keystr``) would cost more than a CPU
  export itself, so they are built only when formatted.
  """

  __slots__ = ("_tree", "_index")

  def __init__(self, tree: PyTree, index: int):
    self._tree, self._index = tree, index

  def __str__(self) -> str:
    key_path, _ = jax.tree_util.tree_flatten_with_path(self._tree)[0][
        self._index]
    return jax.tree_util.keystr(key_path) or "(the tree itself)"


def _rebuild(treedef, out: list, copied: list, return_copied: bool):
  """The converted tree (``treedef`` None: a bare leaf), with the copied
  flags when `return_copied`."""
  if treedef is None:
    return (out[0], copied[0]) if return_copied else out[0]
  result = jax.tree_util.tree_unflatten(treedef, out)
  if return_copied:
    return result, jax.tree_util.tree_unflatten(treedef, copied)
  return result


def _is_compact(t: torch.Tensor) -> bool:
  """Whether the strides are a permutation of a dense row-major layout."""
  if t.numel() == 0:
    return True
  expected = 1
  for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape)
                             if n != 1):
    if stride != expected:
      return False
    expected *= size
  return True


def _jax_has_platform(platform: str) -> bool:
  try:
    return bool(jax.devices(platform))
  except RuntimeError:
    return False


def _import(path, t, copy):
  try:
    return jax.dlpack.from_dlpack(t, copy=False if copy is False else None)
  except ValueError as err:  # JAX: "not aligned to 64 bytes ... copy=False".
    if "aligned" not in str(err):
      raise
    raise ValueError(
        f"from_torch: leaf {path} has data_ptr % 64 = {t.data_ptr() % 64}; "
        f"JAX needs a copy ({err}) but copy=False. Pass copy=None, or "
        "`.clone()` the tensor.") from err


def _is_tensor(x) -> bool:
  return isinstance(x, torch.Tensor)


def _fast(t, copy) -> bool:
  """Whether ``t`` takes a fast path of ``from_torch``.

  A CPU tensor of a ``_FAST_DTYPES`` dtype that does not require grad:
  copied by ``_copy_to_jax`` (``copy=True``), or, when dense and 64-byte
  aligned, shared through DLPack. Anything else goes the general way
  (``_tensor_to_array``), which decides and explains.
  """
  if (not t.is_cpu or t.requires_grad or t.dtype not in _FAST_DTYPES
      or t.layout != torch.strided or t.is_neg() or t.is_nested):
    return False
  return bool(copy) or (t.is_contiguous() and t.data_ptr() % 64 == 0)


_COPY_FN = None


def _copy_views(views: list) -> list:
  """Independent JAX copies of numpy arrays, with one jitted dispatch.

  One jitted ``jnp.copy`` per array, pinned to the CPU device; the outputs
  are new XLA buffers, waited for, so the memory behind `views` may change
  as soon as this returns. One dispatch for all leaves costs less than a
  DLPack import of one (``benchmarks/suites/hostloop.py``).
  """
  global _COPY_FN
  if _COPY_FN is None:
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    _COPY_FN = jax.jit(lambda xs: [jnp.copy(x) for x in xs],
                       in_shardings=cpu, out_shardings=cpu)
  arrays = _COPY_FN(views)
  for arr in arrays:   # cheaper than jax.block_until_ready(arrays)
    arr.block_until_ready()
  return arrays


def _copy_to_jax(tensors: list) -> list:
  """Independent JAX copies of CPU tensors of the ``_FAST_DTYPES``."""
  return _copy_views([t.numpy() for t in tensors])


def _copy_all(leaves: list) -> list | None:
  """Copies of `leaves` if all are CPU tensors of the fast dtypes, else None.

  ``Tensor.numpy()`` itself refuses what the fast copy cannot take (another
  device, ``requires_grad``, a sparse layout, the negative bit); the dtype
  test refuses what numpy takes but JAX would change (64-bit dtypes) or
  numpy lacks (bfloat16). None sends the call to the general path, which
  copies, casts or raises with a message.
  """
  try:
    views = [t.numpy() for t in leaves
             if isinstance(t, torch.Tensor) and t.dtype in _FAST_DTYPES]
  except (RuntimeError, TypeError):
    return None
  if not views or len(views) != len(leaves):
    return None
  return _copy_views(views)


def _check_importable(path, t) -> None:
  """Refuses tensors that hold no dense data JAX could take, naming the fix.
  """
  if t.is_nested:
    raise TypeError(
        f"from_torch: leaf {path} is a nested (ragged) tensor; JAX arrays are "
        "rectangular: import its parts (`t.unbind()`) or a padded copy "
        "(`t.to_padded_tensor(0.0)`)")
  if t.layout != torch.strided:
    raise TypeError(
        f"from_torch: leaf {path} has layout {t.layout}; only dense "
        "(strided) tensors can be imported: call `.to_dense()` first")
  if t.is_meta:
    raise TypeError(
        f"from_torch: leaf {path} is on the meta device and holds no data; "
        "materialise it first (e.g. `torch.empty_like(t, device='cpu')`)")
  if t.is_quantized:
    raise TypeError(
        f"from_torch: leaf {path} is quantized ({t.dtype}); call "
        "`.dequantize()` first")


def _tensor_to_array(path, t, copy, detach, allow_downcast):
  """Imports one torch tensor; returns (array, copied)."""
  _check_importable(path, t)
  reasons = []
  if t.requires_grad:
    if not detach:
      raise ValueError(f"from_torch: leaf {path} requires grad; call "
                       "`.detach()` on it first or pass detach=True.")
    t = t.detach()
  if t.device.type == "cuda" and _jax_has_platform("cuda"):
    torch.cuda.current_stream(t.device).synchronize()
  elif t.device.type != "cpu":
    if copy is False:
      raise ValueError(f"from_torch: leaf {path} is on {t.device}, which JAX "
                       "cannot see; moving it to the CPU needs a copy, but "
                       "copy=False.")
    reasons.append(f"moved from {t.device} to cpu")
    t = t.cpu()
  narrow = _DOWNCAST.get(t.dtype)
  if narrow is not None and not _checks.x64_enabled():
    if not allow_downcast:
      raise TypeError(
          f"from_torch: leaf {path} has dtype {t.dtype}, but jax_enable_x64 "
          f"is disabled and JAX would silently truncate it to {narrow}. Pass "
          "allow_downcast=True to cast it explicitly, or enable 64-bit JAX "
          "with jax.config.update('jax_enable_x64', True).")
    if copy is False:
      raise ValueError(f"from_torch: leaf {path} needs a cast from {t.dtype} "
                       f"to {narrow} (a copy), but copy=False.")
    if not narrow.is_floating_point and not narrow.is_complex and t.numel():
      info = torch.iinfo(narrow)
      lo, hi = int(t.min()), int(t.max())
      if lo < info.min or hi > info.max:
        raise ValueError(
            f"from_torch: leaf {path} has {t.dtype} values in [{lo}, {hi}], "
            f"outside the {narrow} range [{info.min}, {info.max}]; enable "
            "jax_enable_x64 to import it.")
    elif t.numel():   # a float cast: finite values must stay finite
      parts = torch.view_as_real(t) if t.is_complex() else t
      finite = parts[torch.isfinite(parts)]
      big = float(finite.abs().max()) if finite.numel() else 0.0
      if big >= _checks.overflow_threshold(np.float32):   # float32, complex64
        raise ValueError(
            f"from_torch: leaf {path} has finite {t.dtype} values of "
            f"magnitude up to {big:.6g}, beyond the largest {narrow} "
            f"({torch.finfo(narrow).max:.6g}); the cast would make them inf. "
            "Enable jax_enable_x64 to import it, or scale it first.")
    reasons.append(f"cast {t.dtype} to {narrow}")
    t = t.to(narrow)
  if t.is_neg() or t.is_conj():   # lazy views that DLPack cannot carry
    if copy is False:
      raise ValueError(f"from_torch: leaf {path} has its negative or "
                       "conjugate bit set; resolving it is a copy, but "
                       "copy=False. Pass copy=None, or call "
                       "`.resolve_neg().resolve_conj()` first.")
    t = t.resolve_neg().resolve_conj()
    reasons.append("negative/conjugate bit resolved")
  if not _is_compact(t):
    if copy is False:
      raise ValueError(
          f"from_torch: leaf {path} of shape {tuple(t.shape)} has strides "
          f"{t.stride()} with gaps or broadcasting; JAX only imports dense "
          "(possibly permuted) layouts, so it needs a copy, but copy=False. "
          "Call `.contiguous()` or pass copy=None.")
    t = t.contiguous()
    reasons.append(f"strides {t.stride()} made contiguous")
  if copy and not reasons:
    reasons.append("copy=True")
    if t.is_cpu and t.dtype in _FAST_DTYPES:   # e.g. with detach=True
      _report("from_torch", path, reasons[0])
      return _copy_to_jax([t])[0], True
    t = t.clone()
  try:
    arr = _import(path, t, copy)
  except (BufferError, TypeError, RuntimeError) as err:
    if t.dtype != torch.bool:
      raise TypeError(f"from_torch: leaf {path} with dtype {t.dtype} cannot "
                      f"be imported through DLPack: {err}") from err
    if copy is False:
      raise ValueError(
          f"from_torch: leaf {path} is bool, which this DLPack cannot "
          "import; it needs a copy, but copy=False.") from err
    arr = _import(path, t.view(torch.uint8), copy) != 0
    reasons.append("bool imported through uint8")
  ptr = t.data_ptr()
  if not reasons and t.numel() and arr.unsafe_buffer_pointer() != ptr:
    reasons.append(f"JAX copied on import (data_ptr % 64 = {ptr % 64})")
    if copy is False:  # Safety net: JAX should have raised already.
      raise ValueError(
          f"from_torch: leaf {path} needed a copy, but copy=False.")
  for reason in reasons:
    _report("from_torch", path, reason)
  return arr, bool(reasons)


def from_torch(tree: PyTree, *, copy: bool | None = None, detach: bool = False,
               allow_downcast: bool = False,
               return_copied: bool = False) -> PyTree:
  """Converts every ``torch.Tensor`` leaf of `tree` to a ``jax.Array``.

  Shapes, values and the tree structure are preserved; other leaves pass
  through unchanged. A shared array aliases torch memory: writing the tensor
  in place afterwards changes the JAX array, so pass ``copy=True`` if the
  tensor will be reused. int64 -> int32 casts raise on out-of-range values;
  float64 -> float32 casts round like ``Tensor.to`` and raise on finite
  values that would become inf (the rule of every write of jrollout).

  Args:
    tree: a pytree whose tensor leaves have any shape ``[*s]``.
    copy: None shares memory where possible, True always returns independent
      memory, False raises where a copy would be needed (gaps in the strides,
      misaligned data, a dtype cast, another device).
    detach: if True, detach tensors that require grad instead of raising.
    allow_downcast: if True and ``jax_enable_x64`` is off, cast 64-bit
      tensors to 32 bits (a copy) instead of raising.
    return_copied: if True, also return a pytree of bools, True where the
      leaf was copied.

  Returns:
    The pytree of ``[*s]`` arrays, or ``(arrays, copied)`` when
    `return_copied` is True.

  Raises:
    TypeError: a 64-bit tensor while x64 is off and ``allow_downcast`` is
      False, a dtype DLPack cannot carry, a tensor without dense data
      (meta, sparse, quantized or nested: the message names the fix), or
      a flag that is not a bool (``copy`` may be None).
    ValueError: a tensor requires grad without ``detach=True``, a downcast
      would change a value (an integer out of the 32-bit range, a finite
      float64 beyond float32's range), or a copy is needed while
      ``copy=False``.
  """
  if not (copy is None or copy is True or copy is False) or (
      type(detach) is not bool or type(allow_downcast) is not bool
      or type(return_copied) is not bool):
    _flag_error("from_torch", copy=copy, detach=detach,
                allow_downcast=allow_downcast, return_copied=return_copied)
  if _is_tensor(tree):
    leaves, treedef = [tree], None
  else:
    # torch.Tensor is not a pytree node, so tensors are leaves without an
    # is_leaf callback (which would cost a Python call per node).
    leaves, treedef = jax.tree_util.tree_flatten(tree)
  # The common host-loop call first: every leaf a CPU tensor, copied. Its
  # Python work is kept to a minimum, since on a busy host loop each line
  # next to a dispatch costs several times its isolated time.
  arrays = _copy_all(leaves) if copy else None
  if arrays is not None:
    out, copied = arrays, [True] * len(arrays)
    if logger.isEnabledFor(logging.DEBUG):
      for i in range(len(leaves)):
        _report("from_torch", _LeafPath(tree, i), "copy=True")
  else:
    out, copied = _convert(tree, leaves, copy, detach, allow_downcast)
  return _rebuild(treedef, out, copied, return_copied)


def _convert(tree, leaves, copy, detach, allow_downcast):
  """``(out, copied)`` lists for `leaves`: the fast paths, then the rest.

  Fast copies share one dispatch; leaves are named (``_LeafPath``) only in
  errors and copy reports.
  """
  out, copied = list(leaves), [False] * len(leaves)
  fast_copies, slow = [], []
  for i, leaf in enumerate(leaves):
    if not _is_tensor(leaf):
      continue
    if not _fast(leaf, copy):
      slow.append(i)
    elif copy:
      fast_copies.append(i)
    else:
      try:
        out[i] = jax.dlpack.from_dlpack(leaf)
      except (BufferError, TypeError, RuntimeError):
        slow.append(i)   # e.g. a DLPack without bool: the general fallback
  if fast_copies:
    arrays = _copy_to_jax([leaves[i] for i in fast_copies])
    for i, arr in zip(fast_copies, arrays):
      out[i], copied[i] = arr, True
  for i in fast_copies:
    _report("from_torch", _LeafPath(tree, i), "copy=True")
  for i in slow:
    out[i], copied[i] = _tensor_to_array(_LeafPath(tree, i), leaves[i], copy,
                                         detach, allow_downcast)
  return out, copied
