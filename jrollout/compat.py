"""The original PyTorch ``ExperienceBuffer`` and ``DictDataset`` over the
public API, method for method: inputs may be JAX or numpy arrays or torch
tensors (``jrollout.torch``, imported only when a tensor is seen); errors
are the functional API's, the method named first, and leave the object as
it was."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
import contextlib
import operator
import re
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jrollout as jr
from jrollout import _casts
from jrollout import _checks
from jrollout._checkpoint import check_matches

__all__ = ("DictDataset", "ExperienceBuffer")

# A torch-style device name: "platform" or "platform:index".
_DEVICE_NAME = re.compile(r"([a-z_]+)(?::(0|[1-9][0-9]*))?", re.ASCII)
# One minibatch of a dataset: jr.take traced once per layout.
_take = jax.jit(jr.take)


@contextlib.contextmanager
def _named(fn: str, inner: str = "") -> Iterator[None]:
  """Names `fn` first in a validation error's message (instead of the
  prefix `inner`, such as ``"take: "``)."""
  try:
    yield
  except (ValueError, TypeError, KeyError, IndexError) as err:
    message = err.args[0] if err.args else None
    if isinstance(message, str) and not message.startswith(f"{fn}:"):
      err.args = (f"{fn}: {message.removeprefix(inner)}", *err.args[1:])
    raise


def _is_tensor(x: Any) -> bool:
  """Whether `x` is a torch.Tensor (never imports torch)."""
  return _checks.is_torch(x) and isinstance(x, sys.modules["torch"].Tensor)


def _as_jax(fn: str, key: str, value: Any) -> Any:
  """`value` as a JAX array of its own (a JAX array as it is); a 64-bit
  value without x64 is refused where 32 bits change it, as in every write."""
  if isinstance(value, jax.Array):
    return value
  if _is_tensor(value):
    if value.requires_grad:
      raise ValueError(f"{fn}: key {key!r}: the tensor requires grad; store "
                       "`.detach()`-ed tensors (as the original did)")
    from jrollout.torch import from_torch  # noqa: PLC0415 - torch is optional
    return from_torch(value, copy=True, allow_downcast=True)
  src = _checks.dtype_of(value, fn, f"key {key!r}")
  dst = np.dtype(jax.dtypes.canonicalize_dtype(src))
  if src != dst:   # a 64-bit value without x64
    _casts.check_narrowing(fn, key, value, dst)
  return jnp.array(value)


def _resolve_device(fn: str, device: Any) -> jax.Device | None:
  """None, a ``jax.Device``, or a torch-style name (``"cuda:1"``; cuda is
  JAX's gpu platform) as the JAX device."""
  if device is None or isinstance(device, jax.Device):
    return device
  if not (_checks.is_torch(device) or isinstance(device, str)):
    raise TypeError(f"{fn}: `device` must be None, a str such as 'cpu', a "
                    "torch.device or a jax.Device, got "
                    f"{type(device).__name__}")
  name = str(device)
  parsed = _DEVICE_NAME.fullmatch(name)
  with contextlib.suppress(RuntimeError, IndexError):   # no such device
    if parsed is not None:
      platform = {"cuda": "gpu"}.get(parsed[1], parsed[1])
      return jax.devices(platform)[int(parsed[2] or 0)]
  raise ValueError(f"{fn}: device {name!r} is not available to JAX (its "
                   f"devices: {jax.devices()}); expected 'platform' or "
                   "'platform:index' (e.g. 'cpu' or 'cuda:1'), None or a "
                   "jax.Device")


class ExperienceBuffer:
  """The original ``ExperienceBuffer`` API over a ``RolloutState``.

  Storage of key ``k`` is ``[T, E, *shape]``, zero-initialised. A step's
  write donates the old state (a ``jr.RolloutWriter``): O(E), and arrays
  read before it (``buf.obs``, ``buf.state``) are deleted by it.

  Args:
    num_envs: E, a positive int.
    num_steps: T, a positive int.
    device: where the storage and the writes are committed: None (JAX's
      default device), a ``jax.Device`` or a torch-style name (``"cpu"``,
      ``"cuda:1"``, a ``torch.device``).

  Raises:
    ValueError, TypeError: a bad size or device, or one JAX does not have.

  Example:
    >>> import numpy as np
    >>> from jrollout.compat import ExperienceBuffer
    >>> buf = ExperienceBuffer(num_envs=2, num_steps=3, device="cpu")
    >>> buf.register_key("r")
    >>> buf.update_data("r", 1, np.array([5.0, 6.0], np.float32))   # [E]
    >>> buf.r.tolist()                                   # [T, E]
    [[0.0, 0.0], [5.0, 6.0], [0.0, 0.0]]
    >>> saved = buf.state_dict()                         # step 1 written
    >>> buf.batch_update_data("r", np.array([[0, 10], [1, 11], [2, 12]]))
    >>> buf.total_sum()                                  # steps 1, 0 + 1 + 2
    4
    >>> buf.load_state_dict(saved)                       # back to step 1
    >>> buf.update_data("r", 0, np.zeros(2, np.float32))
    >>> buf.update_data("r", 2, np.zeros(2, np.float32))
    >>> buf.make_dict()["r"].tolist()                    # [E * T]: env-major
    [0.0, 5.0, 0.0, 0.0, 6.0, 0.0]
  """

  __slots__ = ("_writer", "_device")
  _writer: jr.RolloutWriter
  _device: jax.Device | None

  def __init__(self, num_envs: int, num_steps: int, device: Any = None):
    with _named("ExperienceBuffer"):
      state = jr.init(num_envs, num_steps)
    device = _resolve_device("ExperienceBuffer", device)
    object.__setattr__(self, "_device", device)
    self._set(state)

  def _set(self, state: jr.RolloutState) -> None:
    """Makes `state` the buffer's, committed to its device if it has one."""
    if self._device is not None:
      state = jax.device_put(state, self._device)
    object.__setattr__(self, "_writer", jr.RolloutWriter(state, flush_every=1))

  @property
  def state(self) -> jr.RolloutState:
    """The current ``RolloutState`` (deleted by the next ``update_data``)."""
    return self._writer.state

  @property
  def num_envs(self) -> int:
    """E."""
    return self._writer.state.num_envs

  @property
  def num_steps(self) -> int:
    """T."""
    return self._writer.state.num_steps

  @property
  def device(self) -> jax.Device | None:
    """The device the storage is committed to, or None for JAX's default."""
    return self._device

  def register_key(self, key: str, shape: tuple[int, ...] = (),
                   dtype: Any = jnp.float32) -> None:
    """Adds ``key`` with zero storage ``[T, E, *shape]`` (``jr.register``).

    ``shape``: a tuple, an int or a ``torch.Size``; ``dtype``: a numpy,
    JAX or torch dtype (64-bit ones need ``jax_enable_x64``).

    Raises:
      ValueError: the key is registered already, or the shape is negative.
      TypeError: the key is not a str or the dtype has no JAX equivalent.
    """
    with _named("ExperienceBuffer.register_key"):
      if _checks.is_torch(dtype):   # torch.float32: JAX's float32
        dtype = jnp.dtype(str(dtype).removeprefix("torch."))
      state = jr.register(self.state, key, shape, dtype)
    self._set(state)

  def update_data(self, key: str, index: int, data: Any) -> None:
    """Writes step ``index`` of ``key`` in place: ``data`` is ``[E, *shape]``,
    a JAX or numpy array or a torch tensor (copied), cast as by
    ``jr.update_at``.

    Raises:
      KeyError: ``key`` is not registered.
      ValueError: another shape, a value the cast would change, or a
        tensor that requires grad.
      TypeError: a dtype that cannot be cast safely, ``index`` not an int.
      IndexError: ``index`` outside ``[0, T)``.
    """
    fn = "ExperienceBuffer.update_data"
    with _named(fn, "RolloutWriter.update_at: "):
      value = self._value(fn, key, data, host=True)
      self._writer.update_at(index, {key: value})

  def batch_update_data(self, key: str, data: Any) -> None:
    """Writes the rollout ``[T, E, *shape]`` of ``key`` (``jr.update_all``):
    one more write of each step; errors as for ``update_data``."""
    fn = "ExperienceBuffer.batch_update_data"
    with _named(fn):
      state = jr.update_all(self.state, {key: self._value(fn, key, data)})
    self._set(state)

  def make_dict(self) -> dict[str, Any]:
    """The env-major batch ``{key: [E * T, *shape]}`` (``jr.make_batch``).

    ``batch[k][e * T + t] == storage[k][t, e]``, in new arrays, once every
    step of every key was written exactly once since the last ``make_dict``
    (exact counts); then that tracking is reset, the storage kept.

    Raises:
      IncompleteRolloutError: a key has missing or duplicated steps (the
        message names each); nothing changes.
    """
    with _named("ExperienceBuffer.make_dict"):
      batch, state = jr.make_batch(self.state)
    self._set(state)
    return batch

  def total_sum(self) -> int:
    """The original's completeness number: ``sum over keys k, steps t of t *
    count[k][t]`` since the last ``make_dict`` (which checks the counts
    themselves: many incomplete rollouts give a complete one's sum)."""
    counts = np.asarray(self.state.counts, np.int64)   # [K, T]
    return int((counts @ np.arange(self.num_steps, dtype=np.int64)).sum())

  def state_dict(self) -> dict[str, Any]:
    """The buffer's contents, as torch's ``Module.state_dict()`` gives them:
    ``{"num_envs": E, "num_steps": T, "data": {key: [T, E, *shape]},
    "counts": [K, T] int32, "out_of_range": [K] int32}``, new arrays that
    later writes do not delete (``jr.save_rollout`` or ``torch.save`` it).
    """
    s = self.state
    arrays = {"data": dict(s.data), "counts": s.counts,
              "out_of_range": s.out_of_range}
    return {"num_envs": s.num_envs, "num_steps": s.num_steps,
            **jax.tree_util.tree_map(jnp.copy, arrays)}

  def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
    """Replaces the contents (write counts too) with a ``state_dict()``'s.

    Strict: E, T and the keys' shapes and dtypes must be the buffer's. The
    arrays may be JAX or numpy arrays or torch tensors (all copied).

    Raises:
      ValueError: an entry missing or unknown, or contents that do not
        match (naming what differs); nothing changes.
      TypeError: not a dict, or an entry of a wrong type.
    """
    fn = "ExperienceBuffer.load_state_dict"
    if not isinstance(state_dict, Mapping):
      raise TypeError(f"{fn}: `state_dict` must be a dict (from state_dict())"
                      f", got {type(state_dict).__name__}")
    fields = ("num_envs", "num_steps", "data", "counts", "out_of_range")
    for name in [*fields, *state_dict]:
      if name not in state_dict or name not in fields:
        raise ValueError(
            f"{fn}: " + (f"the state_dict has no {name!r} entry"
                         if name in fields else f"unknown entry {name!r} in "
                         f"the state_dict") + f" (expected {list(fields)})")
    if not isinstance(state_dict["data"], Mapping):
      raise TypeError(f"{fn}: entry 'data' must be a dict {{key: array}}, "
                      f"got {type(state_dict['data']).__name__}")
    try:
      sizes = {n: operator.index(state_dict[n]) for n in fields[:2]}
    except TypeError:
      raise TypeError(f"{fn}: entries 'num_envs' and 'num_steps' must be "
                      f"ints, got {state_dict['num_envs']!r} and "
                      f"{state_dict['num_steps']!r}") from None
    with _named(fn):
      state = jr.RolloutState(
          data={k: _as_jax(fn, k, v) for k, v in state_dict["data"].items()},
          counts=_as_jax(fn, "counts", state_dict["counts"]),
          out_of_range=_as_jax(fn, "out_of_range",
                               state_dict["out_of_range"]), **sizes)
      check_matches(fn, state, self.state, src="the state_dict",
                    dst="the buffer")
    self._set(state)

  def __getattr__(self, name: str) -> Any:
    # Only called when normal lookup fails: a key's current storage.
    try:
      state = object.__getattribute__(self, "_writer").state
    except AttributeError:
      raise AttributeError(name) from None
    if name in state.data:
      return state.data[name]
    known = ", ".join(repr(k) for k in state.names) or "none"
    raise AttributeError(
        f"ExperienceBuffer has no attribute or registered key {name!r} "
        f"(registered keys: {known})")

  def __setattr__(self, name: str, value: Any) -> None:
    raise AttributeError(
        f"ExperienceBuffer: cannot set attribute {name!r}; write storage "
        "with update_data(key, index, data) or batch_update_data(key, data)")

  def __dir__(self) -> list[str]:
    return sorted(set(super().__dir__()) | set(self.state.names))

  def __repr__(self) -> str:
    s = self.state
    keys = ", ".join(f"{k!r}: {s.spec(k)[0]} {np.dtype(s.spec(k)[1])}"
                     for k in s.names)
    return (f"ExperienceBuffer(num_envs={s.num_envs}, "
            f"num_steps={s.num_steps}, keys={{{keys}}})")

  def _value(self, fn: str, key: Any, data: Any, host: bool = False) -> Any:
    """`data` for a write of `key`: a tensor as a JAX copy, on the buffer's
    device (a host value too, unless `host`: the writer stages it)."""
    if key not in self.state.data:
      known = ", ".join(repr(k) for k in self.state.names) or "none"
      raise KeyError(f"{fn}: key {key!r} is not registered (registered: "
                     f"{known}); call register_key({key!r}, shape=..., "
                     "dtype=...) first")
    if _is_tensor(data):
      data = _as_jax(fn, key, data)
    if self._device is not None and (isinstance(data, jax.Array) or not host):
      data = jax.device_put(_as_jax(fn, key, data), self._device)
    return data


class DictDataset:
  """The original ``DictDataset`` API over ``jr.minibatch_indices``/``jr.take``.

  With ``N = max_k len(tensor_dict[k])``, ``B = batch_size`` and ``M = N //
  B``, ``ds[j] == jr.take(data, ds.indices[j])``: ``{k: v[idx % len(v)]}``
  for rows ``idx`` of the current order. The order starts as the identity;
  the k-th ``shuffle()`` (with ``shuffle=True`` one is at construction)
  sets it to ``jr.minibatch_indices(key, N, B, epoch=k)``: shuffling before
  each of K epochs yields ``jr.minibatches(key, data, B, num_epochs=K)``.

  Args:
    batch_size: B, dividing N unless ``remainder`` is "drop" or "wrap".
    tensor_dict: ``{key: [L_k, ...]}`` arrays or tensors (copied), or
      pytrees whose leaves share ``L_k``.
    shuffle: shuffle once at construction (order 0).
    key: the PRNG key of every order; default ``jax.random.key(0)``.
    as_torch: hand minibatches back as torch tensors.

  Raises:
    ValueError: an empty dict, a key with no rows, a B not dividing N.
    TypeError: not a dict of str keys and arrays, or ``key`` not a PRNG key.

  Example:
    >>> import jax, numpy as np, jrollout as jr
    >>> from jrollout.compat import DictDataset
    >>> ds = DictDataset(2, {"x": np.arange(6), "y": np.arange(3)})
    >>> ds.indices.tolist(), [int(v) for v in ds[-1]["y"]]   # rows 4, 5 % 3
    ([[0, 1], [2, 3], [4, 5]], [1, 2])
    >>> ds.num_rows, ds.batch_size, ds.num_batches()
    (6, 2, 3)
    >>> ds.shuffle()                                         # order 0
    >>> (ds.indices == jr.minibatch_indices(jax.random.key(0), 6, 2)).all()
    Array(True, dtype=bool)
  """

  def __init__(self, batch_size: int, tensor_dict: Mapping[str, Any],
               shuffle: bool = False, *, key: Any = None,
               as_torch: bool = False, remainder: Any = "error"):
    fn = "DictDataset"
    if not isinstance(tensor_dict, Mapping):
      raise TypeError(f"{fn}: `tensor_dict` must be a dict {{key: array}}, "
                      f"got {type(tensor_dict).__name__}")
    key = jax.random.key(0) if key is None else key
    _checks.check_str_keys(fn, "tensor_dict", tensor_dict)
    _checks.check_arrays(fn, "tensor_dict", tensor_dict, torch=True)
    _checks.check_key(fn, key)
    shuffle = _checks.check_bool(fn, "shuffle", shuffle)
    self.as_torch = _checks.check_bool(fn, "as_torch", as_torch)
    with _named(fn):
      self._data = {k: jax.tree_util.tree_map(
          lambda x, k=k: _as_jax(fn, k, x), v, is_leaf=_is_tensor)
                    for k, v in tensor_dict.items()}
    with _named(fn, "take: "):   # the rows, checked as jr.take checks them
      jax.eval_shape(jr.take, self._data, jnp.zeros((0,), jnp.int32))
    self._num_rows = max(np.shape(jax.tree_util.tree_leaves(v)[0])[0]
                         for v in self._data.values())
    with _named(fn, "minibatch_indices: "):
      self._indices = jr.minibatch_indices(key, self._num_rows, batch_size,
                                           shuffle=False, remainder=remainder)
    self._key, self._remainder, self._num_orders = key, remainder, 0
    if shuffle:
      self.shuffle()

  def shuffle(self) -> None:
    """Draws the next order: ``jr.minibatch_indices(key, N, B, epoch=k)``."""
    self._indices = jr.minibatch_indices(
        self._key, self._num_rows, self.batch_size, epoch=self._num_orders,
        remainder=self._remainder)
    self._num_orders += 1

  def num_batches(self) -> int:
    """M: ``N // B`` (``ceil(N / B)`` with ``remainder="wrap"``)."""
    return self._indices.shape[0]

  def __len__(self) -> int:
    return self.num_batches()

  def __getitem__(self, j: int) -> dict[str, Any]:
    """Minibatch ``j`` (negative counts from the end): ``{k: [B, ...]}``."""
    if isinstance(j, (bool, np.bool_)) or not hasattr(j, "__index__"):
      raise TypeError("DictDataset indices must be integers, got "
                      f"{type(j).__name__}")
    i = operator.index(j)
    m = len(self)
    if not -m <= i < m:
      raise IndexError(f"DictDataset index {j} is out of range for {m} "
                       "minibatches")
    batch = _take(self._data, self._indices[i % m])
    if self.as_torch:
      from jrollout.torch import to_torch  # noqa: PLC0415 - torch is optional
      batch = to_torch(batch)
    return batch

  def __iter__(self) -> Iterator[dict[str, Any]]:
    return (self[j] for j in range(len(self)))

  @property
  def batch_size(self) -> int:
    """B."""
    return self._indices.shape[1]

  @property
  def num_rows(self) -> int:
    """N, the longest key's length."""
    return self._num_rows

  @property
  def indices(self) -> jax.Array:
    """The current order as ``[M, B] int32``: row j feeds ``ds[j]``."""
    return self._indices

  def __repr__(self) -> str:
    return (f"DictDataset(batch_size={self.batch_size}, "
            f"keys={sorted(self._data)}, num_rows={self.num_rows}, "
            f"num_batches={len(self)}, orders_drawn={self._num_orders})")
