"""DLPack bridges between JAX and PyTorch pytrees, and the CPU setting for
running both in one process.

``to_torch`` and ``from_torch`` convert every array (tensor) leaf of a
pytree, keeping shapes, dtypes, devices and the tree structure. Memory is
shared whenever the layout allows it, whatever the size (``copy=True``
always copies, ``copy=False`` raises where a copy would be needed), and
every copy is reported: by ``to_torch_copied`` / ``from_torch_copied``, and
as one DEBUG record per copied leaf on the ``jrollout.torch`` logger. torch
is an optional extra (``pip install "jrollout[torch]"``), imported at the
first bridge call rather than with this module, so ``share_cpu_with_torch``
can run before it. Behaviour and costs: ``docs/guides/torch.md``.
"""

from __future__ import annotations

import functools
import logging
import operator
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from jrollout import _checks

if TYPE_CHECKING:
  import torch

__all__ = ("exported_views_alive", "from_torch", "from_torch_copied",
           "jax_dtype", "share_cpu_with_torch", "to_tensordict", "to_torch",
           "to_torch_copied")

PyTree = Any

logger = logging.getLogger("jrollout.torch")


@functools.cache
def _load_torch() -> None:
  """Imports torch into this module's ``torch`` at the first bridge call
  (importing ``jrollout.torch`` does not, so that ``share_cpu_with_torch``
  can run first)."""
  global torch
  try:
    import torch  # noqa: PLC0415 - an optional extra, loaded on first use
  except ImportError as err:
    raise ImportError(
        "jrollout.torch needs PyTorch, an optional extra: install it with "
        '`pip install "jrollout[torch]"`.') from err


@functools.cache
def _downcasts() -> dict[torch.dtype, torch.dtype]:
  """torch dtypes that JAX truncates to 32 bits when jax_enable_x64 is off."""
  pairs = [(torch.int64, torch.int32), (torch.float64, torch.float32),
           (torch.complex128, torch.complex64),
           (getattr(torch, "uint64", None), getattr(torch, "uint32", None))]
  return {wide: narrow for wide, narrow in pairs
          if wide is not None and narrow is not None}


@functools.cache
def _fast_dtypes() -> frozenset[torch.dtype]:
  """The dtypes from_torch's fast paths take (no cast, and numpy can hold
  them); everything else goes the general way."""
  return frozenset({torch.float16, torch.float32, torch.int8, torch.int16,
                    torch.int32, torch.uint8, torch.bool})


_COPY_TRUE = ("copy=True",)


# --- Before torch loads ------------------------------------------------------


def share_cpu_with_torch() -> str:
  """Lets torch's CPU threads yield the cores to JAX between torch ops.

  Sets ``OMP_WAIT_POLICY=PASSIVE`` in this process's environment, so that
  torch's OpenMP threads sleep as soon as an op ends instead of spinning on
  the cores the next JAX call needs. Call it before the first ``import
  torch`` (OpenMP reads the setting once, when torch loads), where a torch
  simulator on the CPU and a JAX learner take turns; not where torch alone
  does heavy CPU work op after op. A value already in the environment is the
  user's choice and is kept. Measurements: ``docs/guides/torch.md``, "JAX
  and torch on one CPU".

  Returns:
    The ``OMP_WAIT_POLICY`` in effect for torch, in upper case.

  Raises:
    RuntimeError: torch is already imported and ``OMP_WAIT_POLICY`` is not
      set (OpenMP has read it).

  Example:
    >>> import os, unittest.mock
    >>> from jrollout.torch import share_cpu_with_torch
    >>> launcher = {"OMP_WAIT_POLICY": "passive"}
    >>> with unittest.mock.patch.dict(os.environ, launcher):
    ...   share_cpu_with_torch()        # a launcher's value is kept
    'PASSIVE'
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


# --- Exports that JAX must not donate ---------------------------------------


class _Exports:
  """Weak references to the torch storages ``to_torch`` shared, by pointer.

  torch keeps one Python object per live storage, shared by all its views,
  so a weak reference to it is alive exactly while some view is. Entries
  drop themselves when their storage dies. One instance serves the process,
  as the JAX buffers it speaks of do.
  """

  __slots__ = ("_refs",)

  def __init__(self) -> None:
    self._refs: dict[int, list[weakref.ref]] = {}

  def add(self, ptr: int, tensor: torch.Tensor) -> None:
    def drop(ref, ptr=ptr):
      refs = self._refs.get(ptr, [])
      if ref in refs:
        refs.remove(ref)
      if not refs:
        self._refs.pop(ptr, None)

    self._refs.setdefault(ptr, []).append(
        weakref.ref(tensor.untyped_storage(), drop))

  def alive(self, ptr: int) -> bool:
    return any(ref() is not None for ref in self._refs.get(ptr, ()))


_EXPORTED = _Exports()


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

  Example:
    >>> import jax.numpy as jnp
    >>> from jrollout.torch import to_torch, exported_views_alive
    >>> x = jnp.zeros(4)
    >>> t = to_torch(x)
    >>> exported_views_alive(x)     # JAX would not donate x now
    True
    >>> del t
    >>> exported_views_alive(x)
    False
  """
  if not isinstance(arr, jax.Array) or arr.is_deleted():
    return False
  return any(_EXPORTED.alive(arr.addressable_data(i).unsafe_buffer_pointer())
             for i in range(len(arr.addressable_shards)))


# --- What both directions share ----------------------------------------------
#
# How a call runs: it walks the leaves once. For each leaf one function
# decides (_plan_import for a tensor, with the one fast-path predicate _fast;
# _export_source for an array): the fast path, a copy with its reasons, or an
# error. _transfer then moves the leaf (the DLPack step both directions
# share), and _finish logs the copies of a call that succeeded and rebuilds
# the tree. copy=False is enforced in one place, _copy_needed.


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


# Leaves that pass through a conversion unchanged; any other leaf (an object
# JAX does not flatten: an unknown container, a string) is refused, never
# passed through.
_PLAIN = (type(None), bool, int, float, complex, str, bytes, np.ndarray,
          np.generic)
_KNOWN = ("a torch.Tensor, a jax.Array, a numpy array, a number, a string or "
          "None, in "
          "dicts, lists, tuples, NamedTuples, registered dataclasses or "
          "TensorDicts")


def _refuse_leaf(fn: str, tree: PyTree, index: int, leaf: Any) -> None:
  """Raises for a leaf that neither converts nor passes through."""
  if isinstance(leaf, _PLAIN):
    return
  what = type(leaf)
  raise TypeError(f"{fn}: leaf {_LeafPath(tree, index)} is a "
                  f"{what.__module__}.{what.__qualname__}, which the bridge "
                  f"does not know; expected {_KNOWN}")


def _tensordict_base() -> Any:
  """tensordict's base class if tensordict is imported, else None (a value
  cannot be a TensorDict before its module is loaded, so it is never
  imported here)."""
  module = sys.modules.get("tensordict")
  return getattr(module, "TensorDictBase", None) if module else None


def _expand_tensordicts(fn: str, tree: PyTree, base: Any, batch_size: Any
                        ) -> PyTree:
  """`tree` with every TensorDict (an instance of `base`) replaced by the
  nested dict of its tensors (the same tensors, no copy), each TensorDict's
  batch size checked against `batch_size` (None: not checked)."""
  want = None if batch_size is None else tuple(batch_size)
  stored = sys.modules["tensordict"].TensorDict   # imported: base is set

  def expand(path: Any, td: Any) -> Any:
    if not isinstance(td, base):
      return td
    where = jax.tree_util.keystr(path) or "(the tree itself)"
    if not isinstance(td, stored):
      raise TypeError(
          f"{fn}: leaf {where} is a {type(td).__name__}, whose tensors are "
          "not stored as they are read; expected a TensorDict (call "
          "`.contiguous()` first, which copies)")
    if want is not None and tuple(td.batch_size) != want:
      raise ValueError(
          f"{fn}: TensorDict {where} has batch size {tuple(td.batch_size)}; "
          f"expected batch_size={want}")
    return td.to_dict()

  return jax.tree_util.tree_map_with_path(
      expand, tree, is_leaf=lambda x: isinstance(x, base))


def _copy_needed(fn: str, path: Any, copy: bool | None, why: str,
                 fix: str = "") -> None:
  """Where a leaf needs a copy: raises if ``copy=False``, else returns.

  The one place ``copy=False`` is enforced, in both directions; `why` says
  what needs the copy, `fix` what the caller can do instead.
  """
  if copy is False:
    raise ValueError(f"{fn}: leaf {path} {why}, but copy=False."
                     + (f" {fix}" if fix else ""))


class _Way(NamedTuple):
  """One direction of the bridge, as :func:`_transfer` needs it."""
  fn: str                             # the public function, for messages
  verb: str                           # "import" or "export"
  bool_dtype: Any                     # bool in the source's dtype system
  convert: Callable[[Any], Any]       # shares the source's memory if it can
  via_uint8: Callable[[Any], Any]     # a bool source, through a uint8 copy
  copier: str                         # who copies behind our back
  data_ptr: Callable[[Any], int]      # where the converted leaf's data is


def _transfer(way: _Way, path: Any, x: Any, ptr: int | None,
              copy: bool | None, reasons: Sequence[str]
              ) -> tuple[Any, Sequence[str]]:
  """``(converted, reasons)``: `x` moved by `way`, with why it was copied.

  The step both directions share once a leaf is decided: a DLPack that
  cannot carry bool gets a uint8 copy, and a copy made on the way (JAX's
  of a misaligned CPU buffer) is caught by comparing data pointers with
  `ptr`, the source's (None: empty, or known to be shared); both raise
  with ``copy=False``. `reasons` are the copies made before.
  """
  try:
    y = way.convert(x)
  except (BufferError, TypeError, RuntimeError) as err:
    if x.dtype != way.bool_dtype:
      raise TypeError(
          f"{way.fn}: leaf {path} with dtype {x.dtype} on {x.device} cannot "
          f"be {way.verb}ed through DLPack: {err}") from err
    _copy_needed(way.fn, path, copy, f"is bool, which this DLPack cannot "
                 f"{way.verb}; it needs a copy through uint8")
    return way.via_uint8(x), [*reasons, f"bool {way.verb}ed through uint8"]
  if ptr is not None and not reasons and way.data_ptr(y) != ptr:
    _copy_needed(way.fn, path, copy, "could not be shared without a copy")
    return y, [f"{way.copier} copied on {way.verb} (data_ptr % 64 = "
               f"{ptr % 64})"]
  return y, reasons


def _flatten(tree: PyTree, leaf_type: type) -> tuple[list[Any], Any]:
  """``(leaves, treedef)`` of `tree`; a bare `leaf_type` leaf skips
  flattening and gets treedef None, which ``_finish`` reads as bare."""
  if isinstance(tree, leaf_type):
    return [tree], None
  return jax.tree_util.tree_flatten(tree)


def _finish(fn: str, tree: PyTree, treedef: Any, out: list, copied: list,
            reports: list, flags: bool) -> PyTree:
  """Logs each copy of `reports` (``(index, reasons)``) and rebuilds the
  tree (``treedef`` None: a bare leaf), with the copied flags if `flags`.
  """
  if reports and logger.isEnabledFor(logging.DEBUG):
    for i, reasons in sorted(reports, key=lambda report: report[0]):
      for reason in reasons:
        logger.debug("%s: leaf %s was copied (%s)", fn, _LeafPath(tree, i),
                     reason)
  if treedef is None:
    return (out[0], copied[0]) if flags else out[0]
  result = jax.tree_util.tree_unflatten(treedef, out)
  if flags:
    return result, jax.tree_util.tree_unflatten(treedef, copied)
  return result


# --- JAX -> torch -------------------------------------------------------------


@functools.cache
def _readonly_warning_spent() -> bool:
  """Has torch give, silenced, its once-a-process read-only array warning.

  numpy's views of JAX buffers are read-only, and ``torch.from_numpy`` warns
  about that the first time only; a shared tensor must not be written in
  place anyway (see :func:`to_torch`), so the one warning is spent here and
  every export stays silent, with warnings as errors too.
  """
  readonly = np.zeros(1)
  readonly.flags.writeable = False
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="The given NumPy array is not "
                            "writable")
    torch.from_numpy(readonly)
  return True


def _cpu_view(src: jax.Array) -> torch.Tensor | None:
  """A torch view of a CPU array through numpy, or None where numpy can't.

  ``torch.from_numpy(np.asarray(src))`` shares the buffer like DLPack, keeps
  it alive the same way (and blocks its donation the same way), and costs a
  quarter of ``torch.from_dlpack(src)``, most of whose time is JAX's Python
  ``__dlpack__``. The caller checks that memory is shared. Dtypes numpy
  lacks (bfloat16) return None.
  """
  if src.dtype.kind not in "biuf":
    return None   # ml_dtypes' bfloat16, float8 ... (kind "V"), complex
  _readonly_warning_spent()
  return torch.from_numpy(np.asarray(src))


def _export(src: jax.Array) -> torch.Tensor:
  """A tensor sharing `src`: numpy's view on the CPU, else DLPack."""
  if src.platform() == "cpu":
    tensor = _cpu_view(src)
    if tensor is not None:
      return tensor
  return torch.from_dlpack(src)


@functools.cache
def _to() -> _Way:
  """The JAX -> torch direction."""
  return _Way("to_torch", "export", np.dtype(bool), _export,
              lambda src: torch.from_dlpack(src.astype(jnp.uint8)).view(
                  torch.bool), "DLPack", torch.Tensor.data_ptr)


def _export_source(path: Any, arr: Any) -> jax.Array:
  """to_torch's decision for one array leaf: what to export, or raise.

  Returns `arr`, or the first shard of a fully replicated array.
  """
  if isinstance(arr, jax.core.Tracer):   # before: tracers are jax.Arrays
    raise TypeError(f"to_torch: leaf {path} is a tracer {arr}; expected a "
                    "concrete jax.Array. Call to_torch outside jax.jit.")
  if not isinstance(arr.dtype, np.dtype):   # an extended dtype: keys
    raise TypeError(
        f"to_torch: leaf {path} has dtype {arr.dtype}, which torch has no "
        "equivalent of (a typed PRNG key array?); export its raw data with "
        "jax.random.key_data(key) and rebuild the key with "
        "jax.random.wrap_key_data(data)")
  if arr.is_deleted():
    raise ValueError(f"to_torch: leaf {path} is a deleted (donated?) array.")
  sharding = arr.sharding
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return arr   # the common case, without building the device set
  devices = len(sharding.device_set)
  if devices == 1:
    return arr
  if not arr.is_fully_replicated:
    raise ValueError(
        f"to_torch: leaf {path} of shape {arr.shape} is sharded over "
        f"{devices} devices ({arr.sharding}); expected a single-device or "
        "fully replicated array. Gather it first with jax.device_put(x, "
        "device), or export x.addressable_shards one by one.")
  return arr.addressable_data(0)


def _array_to_tensor(path: Any, arr: Any, copy: bool | None
                     ) -> tuple[torch.Tensor, Sequence[str]]:
  """Exports one array leaf: ``(tensor, reasons it was copied)``."""
  src = _export_source(path, arr)
  src.block_until_ready()
  ptr = src.unsafe_buffer_pointer() if src.size else None
  tensor, reasons = _transfer(_to(), path, src, ptr, copy, ())
  if copy and not reasons:
    return tensor.clone(), _COPY_TRUE
  if not reasons and ptr is not None:
    _EXPORTED.add(ptr, tensor)
  return tensor, reasons


def to_torch(tree: PyTree, *, copy: bool | None = None) -> PyTree:
  """Converts every ``jax.Array`` leaf of `tree` to a ``torch.Tensor``.

  Shapes, dtypes, devices and the tree structure are preserved; other leaves
  (None, numbers, strings, numpy arrays, tensors) pass through unchanged;
  any other leaf is an error. A shared tensor aliases JAX memory: do not
  write to it in place, and while it lives JAX does not donate the array
  (``donate_argnums`` is skipped silently; :func:`exported_views_alive`).
  On a GPU the call waits for the array, and torch passes its current
  stream through DLPack.

  Args:
    tree: a pytree whose array leaves are concrete ``jax.Array`` of any shape
      ``[*s]``, on one device or fully replicated.
    copy: as for :func:`from_torch`: None shares memory where possible, True
      returns tensors of their own, False raises where the export would copy
      (a bool array through a DLPack without bool).

  Returns:
    The pytree of ``[*s]`` tensors (:func:`to_torch_copied` also says which
    leaves were copied).

  Raises:
    TypeError: a leaf is a tracer (called inside ``jax.jit``), a typed PRNG
      key (export ``jax.random.key_data(key)``), or its dtype cannot go
      through DLPack; a flag that is not a bool.
    ValueError: a leaf is sharded over several devices, deleted, or needs a
      copy while ``copy=False``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jrollout.torch import to_torch
    >>> out = to_torch({"obs": jnp.ones((2, 3)), "step": 5})
    >>> out["obs"].shape, out["obs"].dtype, out["step"]
    (torch.Size([2, 3]), torch.float32, 5)
  """
  return _to_torch("to_torch", tree, copy, False)


def to_torch_copied(tree: PyTree, *, copy: bool | None = None
                    ) -> tuple[PyTree, PyTree]:
  """:func:`to_torch`, and which leaves it copied.

  Returns:
    ``(tensors, copied)``: ``copied`` has the structure of `tree` with a
    bool per leaf, True where the tensor has memory of its own.

  Example:
    >>> import jax.numpy as jnp
    >>> from jrollout.torch import to_torch_copied
    >>> to_torch_copied(jnp.arange(3))          # shared, not copied
    (tensor([0, 1, 2], dtype=torch.int32), False)
  """
  return _to_torch("to_torch_copied", tree, copy, True)


def _to_torch(fn: str, tree: PyTree, copy: bool | None,
              flags: bool) -> Any:
  """``to_torch``'s body; with ``flags``, ``(tensors, copied)``."""
  _load_torch()
  if not (copy is None or copy is True or copy is False):
    copy = _checks.check_bool(fn, "copy", copy, none=True)
  leaves, treedef = _flatten(tree, jax.Array)
  out, copied, reports = list(leaves), [False] * len(leaves), []
  for i, leaf in enumerate(leaves):
    if isinstance(leaf, jax.Array):   # tracers too: _export_source refuses
      out[i], reasons = _array_to_tensor(_LeafPath(tree, i), leaf, copy)
      if reasons:
        copied[i] = True
        reports.append((i, reasons))
    elif not isinstance(leaf, torch.Tensor):
      _refuse_leaf(fn, tree, i, leaf)
  return _finish(fn, tree, treedef, out, copied, reports, flags)


# --- torch -> JAX -------------------------------------------------------------


def _fast(t: torch.Tensor, copy: bool | None
          ) -> np.ndarray | torch.Tensor | None:
  """The fast-path predicate of from_torch: what the fast path moves, or None.

  Only tensors of the ``_fast_dtypes()`` (no cast, and numpy holds them) skip
  ``_prepare``. With ``copy=True``: the tensor's numpy view, for the call's
  one jitted copy (``Tensor.numpy()`` itself refuses another device,
  ``requires_grad``, a sparse, nested or meta tensor and the negative bit).
  Otherwise: the tensor itself where JAX shares it as it is (on the CPU,
  dense, 64-byte aligned, without grad or the negative bit).
  """
  if t.dtype not in _fast_dtypes():
    return None
  if copy:
    try:
      return t.numpy()
    except (RuntimeError, TypeError):
      return None
  if (t.is_cpu and not t.requires_grad and t.layout == torch.strided
      and not t.is_neg() and not t.is_nested and t.is_contiguous()
      and t.data_ptr() % 64 == 0):
    return t
  return None


@functools.cache
def _copy_fn() -> Callable[[list], list]:
  """One jitted ``jnp.copy`` per array, pinned to the first CPU device."""
  cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  return jax.jit(lambda xs: [jnp.copy(x) for x in xs], in_shardings=cpu,
                 out_shardings=cpu)


def _copy_views(views: list) -> list:
  """Independent JAX copies of numpy arrays, with one jitted dispatch.

  The outputs are new XLA buffers, waited for, so the memory behind `views`
  may change as soon as this returns. One dispatch for all leaves costs less
  than a DLPack import of one (``benchmarks/suites/hostloop.py``).
  """
  arrays = _copy_fn()(views)
  for arr in arrays:   # cheaper than jax.block_until_ready(arrays)
    arr.block_until_ready()
  return arrays


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


@functools.cache
def _jax_has_platform(platform: str) -> bool:
  try:
    return bool(jax.devices(platform))
  except RuntimeError:
    return False


def _check_importable(path: Any, t: torch.Tensor, detach: bool) -> None:
  """Refuses tensors JAX cannot take as they are, naming the fix."""
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
  if t.requires_grad and not detach:
    raise ValueError(f"from_torch: leaf {path} requires grad; call "
                     "`.detach()` on it first or pass detach=True.")


def _check_cast_range(path: Any, t: torch.Tensor, narrow: torch.dtype
                      ) -> None:
  """Refuses a downcast that would change a value (rounding aside)."""
  if not t.numel():
    return
  if not narrow.is_floating_point and not narrow.is_complex:
    info = torch.iinfo(narrow)
    lo, hi = int(t.min()), int(t.max())
    if lo < info.min or hi > info.max:
      raise ValueError(
          f"from_torch: leaf {path} has {t.dtype} values in [{lo}, {hi}], "
          f"outside the {narrow} range [{info.min}, {info.max}]; enable "
          "jax_enable_x64 to import it.")
    return
  parts = torch.view_as_real(t) if t.is_complex() else t
  finite = parts[torch.isfinite(parts)]   # finite values must stay finite
  big = float(finite.abs().max()) if finite.numel() else 0.0
  if big >= _checks.overflow_threshold(np.float32):   # float32, complex64
    raise ValueError(
        f"from_torch: leaf {path} has finite {t.dtype} values of "
        f"magnitude up to {big:.6g}, beyond the largest {narrow} "
        f"({torch.finfo(narrow).max:.6g}); the cast would make them inf. "
        "Enable jax_enable_x64 to import it, or scale it first.")


def _downcast(path: Any, t: torch.Tensor, copy: bool | None,
              allow_downcast: bool, reasons: list) -> torch.Tensor:
  """`t` in the dtype JAX keeps it in: 64-bit to 32-bit without x64."""
  narrow = _downcasts().get(t.dtype)
  if narrow is None or _checks.x64_enabled():
    return t
  if not allow_downcast:
    raise TypeError(
        f"from_torch: leaf {path} has dtype {t.dtype}, but jax_enable_x64 "
        f"is disabled and JAX would silently truncate it to {narrow}. Pass "
        "allow_downcast=True to cast it explicitly, or enable 64-bit JAX "
        "with jax.config.update('jax_enable_x64', True).")
  _copy_needed("from_torch", path, copy,
               f"needs a cast from {t.dtype} to {narrow} (a copy)")
  _check_cast_range(path, t, narrow)
  reasons.append(f"cast {t.dtype} to {narrow}")
  return t.to(narrow)


def _prepare(path: Any, t: torch.Tensor, copy: bool | None, detach: bool,
             allow_downcast: bool) -> tuple[torch.Tensor, list]:
  """from_torch's general path: ``(tensor JAX can import, reasons)``.

  Each reason names a copy made on the way: a move to a device JAX sees, a
  cast, a resolved negative or conjugate bit, a dense layout. Raises where
  the tensor cannot be imported, or needs a copy while ``copy=False``.
  """
  fn, reasons = "from_torch", []
  _check_importable(path, t, detach)
  t = t.detach() if t.requires_grad else t
  if t.device.type == "cuda" and _jax_has_platform("cuda"):
    torch.cuda.current_stream(t.device).synchronize()
  elif t.device.type != "cpu":
    _copy_needed(fn, path, copy, f"is on {t.device}, which JAX cannot see; "
                 "moving it to the CPU needs a copy")
    reasons.append(f"moved from {t.device} to cpu")
    t = t.cpu()
  t = _downcast(path, t, copy, allow_downcast, reasons)
  if t.is_neg() or t.is_conj():   # lazy views that DLPack cannot carry
    _copy_needed(fn, path, copy, "has its negative or conjugate bit set; "
                 "resolving it is a copy", "Pass copy=None, or call "
                 "`.resolve_neg().resolve_conj()` first.")
    t = t.resolve_neg().resolve_conj()
    reasons.append("negative/conjugate bit resolved")
  if not _is_compact(t):
    _copy_needed(fn, path, copy, f"of shape {tuple(t.shape)} has strides "
                 f"{t.stride()} with gaps or broadcasting; JAX only imports "
                 "dense (possibly permuted) layouts, so it needs a copy",
                 "Call `.contiguous()` or pass copy=None.")
    reasons.append(f"strides {t.stride()} made contiguous")
    t = t.contiguous()
  if not reasons and t.is_cpu and t.numel() and t.data_ptr() % 64:
    _copy_needed(fn, path, copy, f"has data_ptr % 64 = {t.data_ptr() % 64}; "
                 "XLA:CPU needs 64-byte aligned buffers, so JAX would copy "
                 "it", "Pass copy=None, or `.clone()` the tensor.")
  return t, reasons


def _plan_import(tree: PyTree, i: int, t: torch.Tensor, copy: bool | None,
                 detach: bool, allow_downcast: bool) -> tuple[Any, Any]:
  """from_torch's decision for leaf `i`: ``(source, reasons)``.

  A numpy view joins the call's one jitted copy; a tensor goes through
  DLPack, shared unless `reasons` say why it is a copy (None: the fast
  path, shared for sure). Raises for a tensor JAX cannot take, or a copy
  while ``copy=False``.
  """
  fast = _fast(t, copy)
  if fast is not None:
    return fast, (_COPY_TRUE if copy else None)
  t, reasons = _prepare(_LeafPath(tree, i), t, copy, detach, allow_downcast)
  if reasons or not copy:
    return t, reasons
  fast = _fast(t, copy)   # e.g. detached: now fast
  return (t.clone() if fast is None else fast), _COPY_TRUE


@functools.cache
def _from() -> _Way:
  """The torch -> JAX direction."""
  return _Way("from_torch", "import", torch.bool,
              lambda t: jax.dlpack.from_dlpack(t),   # found at each call
              lambda t: jax.dlpack.from_dlpack(t.view(torch.uint8)) != 0,
              "JAX", operator.methodcaller("unsafe_buffer_pointer"))


def _import_leaves(tree: PyTree, leaves: list, copy: bool | None,
                   detach: bool, allow_downcast: bool
                   ) -> tuple[list, list, list]:
  """``(out, copied, reports)`` for `leaves`, walked once.

  Each tensor is decided (``_plan_import``) and then imported through
  DLPack, or joins the views that one jitted dispatch copies at the end.
  """
  out, copied = list(leaves), [False] * len(leaves)
  reports: list = []
  batch, views = [], []
  for i, leaf in enumerate(leaves):
    if not isinstance(leaf, torch.Tensor):
      if not isinstance(leaf, jax.Array):
        _refuse_leaf("from_torch", tree, i, leaf)
      continue
    source, reasons = _plan_import(tree, i, leaf, copy, detach,
                                   allow_downcast)
    if isinstance(source, np.ndarray):
      batch.append(i)
      views.append(source)
      continue
    # reasons None: the fast path, shared for sure (no pointer check)
    ptr = None if reasons is None or not source.numel() else source.data_ptr()
    out[i], reasons = _transfer(_from(), _LeafPath(tree, i), source, ptr,
                                copy, reasons or ())
    if reasons:
      copied[i] = True
      reports.append((i, reasons))
  if views:
    arrays = _copy_views(views)
    if len(arrays) == len(leaves):   # the host loop's call: all copied
      out, copied = arrays, [True] * len(arrays)
    else:
      for i, arr in zip(batch, arrays):
        out[i] = arr
        copied[i] = True
    if logger.isEnabledFor(logging.DEBUG):
      reports += [(i, _COPY_TRUE) for i in batch]
  return out, copied, reports


def from_torch(tree: PyTree, *, copy: bool | None = None, detach: bool = False,
               allow_downcast: bool = False,
               batch_size: Sequence[int] | None = None) -> PyTree:
  """Converts every ``torch.Tensor`` leaf of `tree` to a ``jax.Array``.

  Shapes, values and the tree structure are preserved; a ``TensorDict``
  (tensordict's, anywhere in the tree) becomes the nested dict of its
  entries, converted the same way, sharing memory as plain tensors do.
  Arrays, numbers, strings and None pass through unchanged; any other leaf
  (an unknown container, say) is an error, never passed through. A shared
  array aliases torch memory: writing the tensor in place afterwards changes
  the JAX array, so pass ``copy=True`` if the tensor will be reused. int64
  -> int32 casts raise on out-of-range values; float64 -> float32 casts
  round like ``Tensor.to`` and raise on finite values that would become inf
  (the rule of every write of jrollout). Permuted (transposed) tensors are
  shared, keeping their layout; gaps or broadcast strides need a copy. On a
  GPU, torch's current stream is synchronized before JAX imports a tensor.

  Args:
    tree: a pytree whose tensor leaves have any shape ``[*s]``.
    copy: None shares memory where possible, True always returns independent
      memory, False raises where a copy would be needed (gaps in the strides,
      misaligned data, a dtype cast, another device).
    detach: if True, detach tensors that require grad instead of raising.
    allow_downcast: if True and ``jax_enable_x64`` is off, cast 64-bit
      tensors to 32 bits (a copy) instead of raising.
    batch_size: if given, the batch size every ``TensorDict`` in `tree` must
      have (IsaacLab's observation groups: ``(E,)``).

  Returns:
    The pytree of ``[*s]`` arrays, TensorDicts as nested dicts
    (:func:`from_torch_copied` also says which leaves were copied).

  Raises:
    TypeError: a 64-bit tensor while x64 is off and ``allow_downcast`` is
      False, a dtype DLPack cannot carry, a tensor without dense data
      (meta, sparse, quantized or nested: the message names the fix), a
      leaf the bridge does not know (an object of an unknown type, such as a
      container JAX does not flatten, or a lazy stack of TensorDicts), or
      a flag that is not a bool (``copy`` may be None).
    ValueError: a TensorDict whose batch size is not `batch_size`, a
      tensor requires grad without ``detach=True``, a downcast
      would change a value (an integer out of the 32-bit range, a finite
      float64 beyond float32's range), or a copy is needed while
      ``copy=False``.

  Example:
    >>> import torch
    >>> from jrollout.torch import from_torch
    >>> x = from_torch({"obs": torch.zeros(2, 3)})
    >>> x["obs"].shape, x["obs"].dtype
    ((2, 3), dtype('float32'))
    >>> from_torch(torch.arange(3), allow_downcast=True)   # int64: a copy
    Array([0, 1, 2], dtype=int32)
  """
  return _from_torch("from_torch", tree, copy, detach, allow_downcast,
                     batch_size, False)


def from_torch_copied(tree: PyTree, *, copy: bool | None = None,
                      detach: bool = False, allow_downcast: bool = False,
                      batch_size: Sequence[int] | None = None
                      ) -> tuple[PyTree, PyTree]:
  """:func:`from_torch`, and which leaves it copied.

  Returns:
    ``(arrays, copied)``: ``copied`` has the structure of the arrays with a
    bool per leaf, True where the array has memory of its own.

  Example:
    >>> import torch
    >>> from jrollout.torch import from_torch_copied
    >>> x, copied = from_torch_copied({"obs": torch.zeros(2, 3)})
    >>> x["obs"].shape, copied                       # memory shared
    ((2, 3), {'obs': False})
  """
  return _from_torch("from_torch_copied", tree, copy, detach,
                     allow_downcast, batch_size, True)


def _from_torch(fn: str, tree: PyTree, copy: Any, detach: Any,
                allow_downcast: Any, batch_size: Any, flags: bool) -> Any:
  """``from_torch``'s body; with ``flags``, ``(arrays, copied)``."""
  _load_torch()
  if not (copy is None or copy is True or copy is False) or (
      type(detach) is not bool or type(allow_downcast) is not bool):
    copy = _checks.check_bool(fn, "copy", copy, none=True)
    detach = _checks.check_bool(fn, "detach", detach)
    allow_downcast = _checks.check_bool(fn, "allow_downcast", allow_downcast)
  if batch_size is not None and not (
      isinstance(batch_size, Sequence)
      and all(type(n) is int and n >= 0 for n in batch_size)):
    raise TypeError(f"{fn}: `batch_size` must be a sequence of "
                    f"non-negative ints or None, got {batch_size!r}")
  # torch.Tensor is not a pytree node, so tensors are leaves without an
  # is_leaf callback (which would cost a Python call per node). A
  # TensorDict is a leaf too (JAX does not flatten it): expanded, and the
  # tree flattened again, only when there is one.
  leaves, treedef = _flatten(tree, torch.Tensor)
  tensordict_base = _tensordict_base()
  if tensordict_base is not None and any(
      isinstance(leaf, tensordict_base) for leaf in leaves):
    tree = _expand_tensordicts(fn, tree, tensordict_base, batch_size)
    leaves, treedef = _flatten(tree, torch.Tensor)
  out, copied, reports = _import_leaves(tree, leaves, copy, detach,
                                        allow_downcast)
  return _finish(fn, tree, treedef, out, copied, reports, flags)


def jax_dtype(dtype: torch.dtype) -> np.dtype:
  """The JAX dtype of a torch dtype, the one the bridge converts it to.

  Raises:
    TypeError: a torch dtype JAX has no equivalent of (``torch.qint8``).

  Example:
    >>> import torch
    >>> from jrollout.torch import jax_dtype
    >>> jax_dtype(torch.bfloat16)
    dtype(bfloat16)
  """
  name = str(dtype).rsplit(".", 1)[-1]
  try:
    return jnp.dtype(name)
  except TypeError:
    raise TypeError(f"`dtype` {dtype} has no JAX equivalent") from None


def to_tensordict(tree: PyTree, batch_size: Sequence[int], *,
                  copy: bool | None = None) -> Any:
  """A ``TensorDict`` of the ``jax.Array`` leaves of `tree`, as
  :func:`to_torch` converts them.

  Nested dicts become nested TensorDicts; the fields of a NamedTuple or a
  registered dataclass and the items of a list or tuple become entries
  named by field or index (``"0"``, ``"1"``, ...). tensordict is an optional
  extra (``pip install "jrollout[tensordict]"``), imported by this call.

  Args:
    tree: a pytree of concrete arrays ``[*batch_size, ...]``.
    batch_size: the TensorDict's batch size, e.g. ``(E,)``: every leaf's
      leading dimensions.
    copy: as for :func:`to_torch`.

  Returns:
    A ``tensordict.TensorDict`` whose tensors share the arrays' memory where
    :func:`to_torch` shares it.

  Raises:
    ImportError: tensordict is not installed.
    TypeError: a leaf is not an array (see :func:`to_torch`).
    ValueError: a leaf's leading dimensions are not `batch_size`; see
      :func:`to_torch` for the rest.

  Example:
    >>> import jax.numpy as jnp
    >>> from jrollout.torch import to_tensordict
    >>> td = to_tensordict({"policy": jnp.zeros((4, 48)),
    ...                     "critic": jnp.zeros((4, 60))}, batch_size=(4,))
    >>> td.batch_size, td["critic"].shape
    (torch.Size([4]), torch.Size([4, 60]))
  """
  try:
    import tensordict  # noqa: PLC0415  (an optional extra, used here only)
  except ImportError as err:
    raise ImportError(
        "to_tensordict needs tensordict, an optional extra: install it with "
        '`pip install "jrollout[tensordict]"`.') from err
  want = tuple(batch_size)
  tensors = to_torch(tree, copy=copy)
  nested: dict[str, Any] = {}
  flat, _ = jax.tree_util.tree_flatten_with_path(tensors)
  for path, leaf in flat:
    names = [_entry_name(k) for k in path] or ["_"]
    where = jax.tree_util.keystr(path) or "(the tree itself)"
    if not isinstance(leaf, torch.Tensor):
      raise TypeError(f"to_tensordict: leaf {where} is a "
                      f"{type(leaf).__name__}; expected a jax.Array")
    if tuple(leaf.shape[:len(want)]) != want:
      raise ValueError(
          f"to_tensordict: leaf {where} has shape {tuple(leaf.shape)}; "
          f"expected leading dimensions batch_size={want}")
    node = nested
    for name in names[:-1]:
      node = node.setdefault(name, {})
    node[names[-1]] = leaf
  return tensordict.TensorDict(nested, batch_size=want)


def _entry_name(key: Any) -> str:
  """A TensorDict entry name for one step of a key path."""
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)
