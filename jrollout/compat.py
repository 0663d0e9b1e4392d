"""Stateful classes with the API of the original PyTorch buffer and dataset.

``ExperienceBuffer`` and ``DictDataset`` keep the method names and call
signatures of the PyTorch design this package replaces, so a training loop can
move to JAX one line at a time. Each method is a thin call of the functional
API (``jr.register``, ``jr.update_at_inplace``, ``jr.update_all``,
``jr.make_batch``, ``jr.minibatch_indices``, ``jr.take``); the objects only
hold the current ``RolloutState`` / data and the shuffle order.

It stands on ``jrollout``'s public functions, the bridge ``jrollout.torch``
and the internals every entry of the functional API shares: the host-loop
seam of ``jrollout._buffer`` (``step_inplace``), the argument checks and cast
rule (``_checks``, ``_casts``) and a checkpoint's strict comparison
(``load_state_dict``).

Inputs may be JAX arrays, numpy arrays or torch tensors. Torch tensors are
recognised without importing torch and converted by ``jrollout.torch``
(imported the first time a tensor is seen), so this module works without
torch installed. Results are JAX arrays (``DictDataset(..., as_torch=True)``
hands minibatches back as torch tensors).

Errors are those of the functional API, with the class method prepended to
the message, e.g. ``ExperienceBuffer.update_data: update_at_inplace: field
'obs' has shape (3,), expected (2, 3) = [E] + (3,)``. A call that raises
leaves the object unchanged.

Dimension letters: T = num_steps, E = num_envs, N = rows of a batch,
B = minibatch size, M = minibatches per epoch.
"""

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
from jrollout import _buffer
from jrollout import _casts
from jrollout import _checks
from jrollout._checkpoint.record import check_matches
from jrollout._types import Array, ArrayLike, PRNGKey, PyTree, Remainder

__all__ = ("DictDataset", "ExperienceBuffer")

_ERRORS = (ValueError, TypeError, KeyError, IndexError)


@contextlib.contextmanager
def _named(fn: str) -> Iterator[None]:
  """Prepends ``"{fn}: "`` to the message of a validation error, same type."""
  try:
    yield
  except _ERRORS as err:
    if (err.args and isinstance(err.args[0], str)
        and not err.args[0].startswith(f"{fn}:")):
      err.args = (f"{fn}: {err.args[0]}",) + err.args[1:]
    raise


@contextlib.contextmanager
def _as(fn: str, inner: str) -> Iterator[None]:
  """Names ``fn`` instead of ``inner`` in a validation error raised by the
  public function ``inner`` (same type), so that a class checked by a
  function reports as the original class did."""
  try:
    yield
  except _ERRORS as err:
    if err.args and isinstance(err.args[0], str) and err.args[0].startswith(
        f"{inner}: "):
      err.args = (f"{fn}: {err.args[0][len(inner) + 2:]}",) + err.args[1:]
    raise


# One minibatch of a dataset whose indices are in [0, N): jr.take traced
# once per layout, so no index is read back to the host.
_take = jax.jit(jr.take)


def _is_tensor(x: Any) -> bool:
  """Whether ``x`` is a torch.Tensor (torch is then loaded: never imported
  here)."""
  return _checks.is_torch(x) and isinstance(x, sys.modules["torch"].Tensor)


def _from_torch(fn: str, key: str, tensor: Any) -> Array:
  """A torch tensor as an independent JAX array (a copy, never a view)."""
  if tensor.requires_grad:
    raise ValueError(
        f"{fn}: key {key!r}: the tensor requires grad; store `.detach()`-ed "
        "tensors (the original ExperienceBuffer refused them too)")
  from jrollout.torch import from_torch  # noqa: PLC0415 - torch is optional
  # copy=True: the tensor may be changed in place after the call (simulators
  # reuse their output tensors) while the write is still queued.
  # allow_downcast: without x64, int64/float64 become int32/float32 (integer
  # range checked), as JAX does for numpy arrays.
  return from_torch(tensor, copy=True, allow_downcast=True)


def _host_copy(fn: str, key: str, value: Any) -> Array:
  """A host value as a new JAX array (later changes to it do not leak in).

  Without x64, JAX stores a 64-bit value in 32 bits: a narrowing cast,
  refused where it would change a value (int64 ``2**40``), as every write
  path of jrollout does.
  """
  src = _checks.dtype_of(value, fn, f"key {key!r}")
  dst = np.dtype(jax.dtypes.canonicalize_dtype(src))
  if src != dst and _casts.narrows(src, dst):
    message = _casts.cast_error(fn, key, value, dst)
    if message is not None:
      raise ValueError(message)
  return jnp.array(value)


def _to_jnp_dtype(dtype: Any) -> Any:
  """A torch dtype (``torch.float32``) as its JAX dtype; others as given."""
  if not _checks.is_torch(dtype):
    return dtype
  from jrollout.torch import jax_dtype  # noqa: PLC0415 - torch is optional
  return jax_dtype(dtype)


# A torch-style device name: "platform" or "platform:index", as torch
# parses it (no sign, no leading zero, ASCII digits).
_DEVICE_NAME = re.compile(r"([a-z_]+)(?::(0|[1-9][0-9]*))?", re.ASCII)


def _resolve_device(fn: str, device: Any) -> jax.Device | None:
  """None, a ``jax.Device``, or a torch-style name such as ``"cpu"``.

  Raises:
    ValueError: a name that does not parse (``"cpu:abc"``), or a device
      JAX does not have.
    TypeError: anything else.
  """
  if device is None or isinstance(device, jax.Device):
    return device
  if _checks.is_torch(device) or isinstance(device, str):
    name = str(device)
    parsed = _DEVICE_NAME.fullmatch(name)
    if parsed is None:
      raise ValueError(
          f"{fn}: `device` {name!r} is not a device name; expected "
          "'platform' or 'platform:index', e.g. 'cpu' or 'cuda:1'")
    platform, index = parsed.groups()
    jax_platform = {"cuda": "gpu"}.get(platform, platform)
    try:
      devices = jax.devices(jax_platform)
    except RuntimeError:
      devices = []
    i = int(index or 0)
    if i < len(devices):
      return devices[i]
    raise ValueError(
        f"{fn}: device {name!r} is not available to JAX (its devices: "
        f"{jax.devices()}); pass device=None to use JAX's default device, or "
        "a jax.Device")
  raise TypeError(f"{fn}: `device` must be None, a str such as 'cpu', a "
                  f"torch.device or a jax.Device, got {type(device).__name__}")


class ExperienceBuffer:
  """The original ``ExperienceBuffer`` API over a ``RolloutState``.

  Storage of key ``k`` is ``[T, E, *shape]``, zero-initialised. Writes
  donate the old state (``jr.update_at_inplace``), so a step costs O(E), not
  O(T * E): arrays taken from the buffer before a write (``buf.obs``,
  ``buf.state``) are deleted by that write; use them at once or copy them.
  Batches returned by ``make_dict`` are independent and stay valid.

  Args:
    num_envs: E, a positive int.
    num_steps: T, a positive int.
    device: where to keep the storage. None (default) leaves placement to
      JAX, which puts arrays on its default device (``jax.devices()[0]``).
      A ``jax.Device``, or a torch-style name (``"cpu"``, ``"cuda:1"``,
      ``torch.device``, with ``cuda`` meaning JAX's ``gpu`` platform), commits
      the storage and every written value to that device.

  Raises:
    ValueError: a size is not positive, ``device`` is a string that is not
      a device name (``"cpu:abc"``), or the device is not one JAX has.
    TypeError: a size is not an int, or ``device`` is of another type.

  Example:
    >>> import numpy as np
    >>> from jrollout.compat import ExperienceBuffer
    >>> buf = ExperienceBuffer(num_envs=2, num_steps=3)
    >>> buf.num_envs, buf.num_steps, buf.device     # None: JAX's default
    (2, 3, None)
    >>> buf.register_key("obs", shape=(4,))
    >>> for t in range(3):
    ...   buf.update_data("obs", t, np.ones((2, 4), np.float32))
    >>> buf.state.data["obs"].shape                 # the RolloutState's [T, E]
    (3, 2, 4)
    >>> buf.make_dict()["obs"].shape                # [E * T, 4]
    (6, 4)
    >>> ExperienceBuffer(2, 3, device="cpu").device  # a torch-style name
    CpuDevice(id=0)
  """

  __slots__ = ("_state", "_device")
  _state: jr.RolloutState
  _device: jax.Device | None

  def __init__(self, num_envs: int, num_steps: int, device: Any = None):
    with _named("ExperienceBuffer"):
      state = jr.init(num_envs, num_steps)
    object.__setattr__(self, "_device",
                       _resolve_device("ExperienceBuffer", device))
    object.__setattr__(self, "_state", state)

  # --- the functional state ------------------------------------------------

  @property
  def state(self) -> jr.RolloutState:
    """The current ``RolloutState`` (replaced, and deleted, by each write)."""
    return self._state

  @property
  def num_envs(self) -> int:
    """E."""
    return self._state.num_envs

  @property
  def num_steps(self) -> int:
    """T."""
    return self._state.num_steps

  @property
  def device(self) -> jax.Device | None:
    """The device the storage is committed to, or None for JAX's default."""
    return self._device

  # --- the original API ----------------------------------------------------

  def register_key(self, key: str, shape: tuple[int, ...] = (),
                   dtype: Any = jnp.float32) -> None:
    """Adds ``key`` with zero storage ``[T, E, *shape]`` (``jr.register``).

    Args:
      key: a new key (a str); registering a key twice is an error.
      shape: the per-env, per-step shape (a tuple, an int or a
        ``torch.Size``), ``()`` for a scalar.
      dtype: a numpy / JAX dtype or a torch dtype (``torch.float32``,
        mapped by name without importing torch). 64-bit dtypes need
        ``jax_enable_x64``.

    Raises:
      ValueError: the key is already registered, or the shape is negative.
      TypeError: the key is not a str or the dtype has no JAX equivalent.

    Example:
      >>> import numpy as np
      >>> from jrollout.compat import ExperienceBuffer
      >>> buf = ExperienceBuffer(num_envs=2, num_steps=3)
      >>> buf.register_key("obs", shape=(4,))
      >>> buf.register_key("done", dtype=np.bool_)
      >>> buf.obs.shape, buf.done.dtype            # zeros, [T, E, *shape]
      ((3, 2, 4), dtype('bool'))
    """
    with _named("ExperienceBuffer.register_key"):
      state = jr.register(self._state, key, shape, _to_jnp_dtype(dtype))
    if self._device is not None:
      state = jax.device_put(state, self._device)
    object.__setattr__(self, "_state", state)

  def update_data(self, key: str, index: int, data: ArrayLike) -> None:
    """Writes step ``index`` of ``key`` in place (``jr.update_at_inplace``).

    Args:
      key: a registered key.
      index: the step t, an int in ``[0, T)``.
      data: ``[E, *shape]``: a JAX or numpy array or a torch tensor (a
        tensor or a numpy array is copied, so changing it later does not
        change the buffer). Safe casts to the registered dtype are applied,
        as by ``jr.update_at``.

    Raises:
      KeyError: ``key`` is not registered.
      ValueError: ``data`` has another shape, or is a tensor requiring grad.
      TypeError: the dtype cannot be cast safely, or ``index`` is not an int.
      IndexError: ``index`` is outside ``[0, T)``.

    Example:
      >>> import numpy as np
      >>> from jrollout.compat import ExperienceBuffer
      >>> buf = ExperienceBuffer(num_envs=2, num_steps=3)
      >>> buf.register_key("r")
      >>> buf.update_data("r", 1, np.array([5.0, 6.0], np.float32))  # [E]
      >>> buf.r.tolist()                           # [T, E]: step 1 written
      [[0.0, 0.0], [5.0, 6.0], [0.0, 0.0]]
    """
    fn = "ExperienceBuffer.update_data"
    with _named(fn):
      values = {key: self._value(fn, key, data, place=False)}
      # Checked, host values copied, then placed on the buffer's device and
      # written in place; the new state is kept before any DonationWarning.
      _buffer.step_inplace("update_at_inplace", self._state, index, values,
                           device=self._device, commit=self._commit)

  def _commit(self, state: jr.RolloutState, done: Any) -> None:
    del done
    object.__setattr__(self, "_state", state)

  def batch_update_data(self, key: str, data: ArrayLike) -> None:
    """Writes the whole rollout of ``key`` (``jr.update_all``).

    Counts as one write of every step of ``key``.

    Args:
      key: a registered key.
      data: ``[T, E, *shape]``, a JAX or numpy array or a torch tensor.

    Raises:
      KeyError, ValueError, TypeError: as for ``update_data``.

    Example:
      >>> import numpy as np, jrollout as jr
      >>> from jrollout.compat import ExperienceBuffer
      >>> buf = ExperienceBuffer(num_envs=2, num_steps=3)
      >>> buf.register_key("r")
      >>> buf.update_data("r", 1, np.zeros(2, np.float32))
      >>> buf.batch_update_data("r", np.ones((3, 2), np.float32))  # [T, E]
      >>> jr.write_counts(buf.state)["r"].per_step.tolist()   # +1 every step
      [1, 2, 1]
    """
    fn = "ExperienceBuffer.batch_update_data"
    with _named(fn):
      values = {key: self._value(fn, key, data)}
      state = jr.update_all(self._state, values)
    object.__setattr__(self, "_state", state)

  def make_dict(self) -> dict[str, Array]:
    """The env-major batch of the rollout (``jr.make_batch``).

    ``batch[k][e * T + t] == storage[k][t, e]``, i.e. the original's
    ``storage.transpose(0, 1).reshape(E * T, *shape)``. Checks that every
    step of every key was written exactly once since the last ``make_dict``
    (exact per-step counts, unlike the original's sum of indices), then
    resets that tracking; the storage keeps its values.

    Returns:
      ``{key: [E * T, *shape]}`` JAX arrays, independent of the buffer.

    Raises:
      IncompleteRolloutError: a key has missing or duplicated steps; the
        message names each such key and its steps. The buffer is unchanged,
        so the missing steps can still be written.

    Example:
      >>> import numpy as np, jrollout as jr
      >>> from jrollout.compat import ExperienceBuffer
      >>> buf = ExperienceBuffer(num_envs=2, num_steps=3)
      >>> buf.register_key("r")
      >>> rewards = np.array([[0, 10], [1, 11], [2, 12]], np.float32)  # [T, E]
      >>> buf.batch_update_data("r", rewards)
      >>> buf.make_dict()["r"].tolist()            # env 0's steps, then env 1's
      [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]
      >>> try:
      ...   buf.make_dict()                        # nothing written since
      ... except jr.IncompleteRolloutError as e:
      ...   print(str(e).splitlines()[-1].strip())
      field 'r': missing steps [0-2]
    """
    with _named("ExperienceBuffer.make_dict"):
      batch, state = jr.make_batch(self._state)
    object.__setattr__(self, "_state", state)
    return batch

  def total_sum(self) -> int:
    """The original's completeness number: written step indices, summed.

    ``sum over keys k, steps t of t * count[k][t]``, where ``count[k][t]`` is
    how many times step ``t`` of ``k`` was written since the last
    ``make_dict`` (``jr.write_counts``); a ``batch_update_data`` adds
    ``T * (T - 1) / 2``. A complete rollout gives
    ``num_keys * T * (T - 1) / 2``, but so do many incomplete ones (step 0
    counts nothing; steps 1 + 2 equal step 3): ``make_dict`` checks the
    counts themselves instead.

    Returns:
      A Python int.

    Example:
      >>> import numpy as np
      >>> from jrollout.compat import ExperienceBuffer
      >>> buf = ExperienceBuffer(num_envs=2, num_steps=3)
      >>> buf.register_key("r")
      >>> buf.update_data("r", 1, np.zeros(2, np.float32))
      >>> buf.update_data("r", 2, np.zeros(2, np.float32))
      >>> buf.total_sum()                          # steps 1 + 2
      3
      >>> buf.total_sum() == 3 * (3 - 1) // 2      # a complete rollout's, too
      True
    """
    steps = np.arange(self.num_steps, dtype=np.int64)
    counts = jax.device_get(jr.write_counts(self._state))
    return int(sum(int(steps @ np.asarray(c.per_step, np.int64))
                   for c in counts.values()))

  # --- checkpoints -----------------------------------------------------------

  def state_dict(self) -> dict[str, Any]:
    """The buffer's contents, as torch's ``Module.state_dict()`` gives them.

    Returns:
      ``{"num_envs": E, "num_steps": T, "data": {key: [T, E, *shape]},
      "counts": [K, T] int32, "out_of_range": [K] int32}``: the fields of
      the ``RolloutState`` (storage, write counts since the last
      ``make_dict``, out-of-range writes), as new JAX arrays that later
      writes do not delete. Save it with ``jr.save_rollout(directory,
      buf.state_dict())`` (orbax) or ``torch.save``; ``load_state_dict``
      takes it back.

    Example:
      >>> import numpy as np
      >>> from jrollout.compat import ExperienceBuffer
      >>> buf = ExperienceBuffer(num_envs=2, num_steps=3)
      >>> buf.register_key("r")
      >>> buf.update_data("r", 0, np.ones(2, np.float32))
      >>> sd = buf.state_dict()
      >>> sorted(sd)
      ['counts', 'data', 'num_envs', 'num_steps', 'out_of_range']
      >>> sd["data"]["r"].shape, sd["counts"].tolist()  # [T, E]; [K, T]
      ((3, 2), [[1, 0, 0]])
    """
    s = self._state
    arrays = {"data": dict(s.data), "counts": s.counts,
              "out_of_range": s.out_of_range}
    return {"num_envs": s.num_envs, "num_steps": s.num_steps,
            **jax.tree_util.tree_map(jnp.copy, arrays)}

  def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
    """Replaces the buffer's contents with a ``state_dict()``'s.

    Strict, as torch's ``load_state_dict``: the buffer must be set up as
    the saved one was (same E and T, the same keys registered with the
    same shapes and dtypes). Everything is checked before anything changes.
    Write counts and out-of-range counters are restored too, so a rollout
    saved half-written is finished as if it had never stopped.

    From a checkpoint: ``jr.save_rollout(directory, buf.state_dict())``,
    then ``buf.load_state_dict(jr.restore_rollout(directory,
    buf.state_dict()))``.

    Args:
      state_dict: a dict like ``state_dict()``'s; its arrays may be JAX or
        numpy arrays or torch tensors (all copied).

    Raises:
      ValueError: an entry is missing or unknown, or the contents do not
        match the buffer: E, T, a key missing or extra, or a key's shape or
        dtype (the message names the key, what the buffer expects and what
        the state_dict holds). The buffer is unchanged.
      TypeError: ``state_dict`` is not a dict, or an entry of a wrong type.

    Example:
      >>> import numpy as np, jrollout as jr
      >>> from jrollout.compat import ExperienceBuffer
      >>> buf = ExperienceBuffer(num_envs=2, num_steps=3)
      >>> buf.register_key("r")
      >>> buf.update_data("r", 0, np.ones(2, np.float32))
      >>> saved = buf.state_dict()                 # half-written: step 0
      >>> buf.update_data("r", 1, np.ones(2, np.float32))
      >>> buf.load_state_dict(saved)
      >>> jr.write_counts(buf.state)["r"].per_step.tolist()   # as saved
      [1, 0, 0]
    """
    fn = "ExperienceBuffer.load_state_dict"
    if not isinstance(state_dict, Mapping):
      raise TypeError(f"{fn}: `state_dict` must be a dict (from state_dict())"
                      f", got {type(state_dict).__name__}")
    fields = ("num_envs", "num_steps", "data", "counts", "out_of_range")
    missing = [name for name in fields if name not in state_dict]
    if missing:
      raise ValueError(f"{fn}: the state_dict has no {missing[0]!r} entry "
                       f"(expected the entries {list(fields)})")
    unknown = [name for name in state_dict if name not in fields]
    if unknown:
      raise ValueError(f"{fn}: unknown entry {unknown[0]!r} in the state_dict "
                       f"(expected the entries {list(fields)})")
    if not isinstance(state_dict["data"], Mapping):
      raise TypeError(f"{fn}: entry 'data' must be a dict {{key: array}}, "
                      f"got {type(state_dict['data']).__name__}")
    sizes = {}
    for name in ("num_envs", "num_steps"):
      try:
        sizes[name] = operator.index(state_dict[name])
      except TypeError:
        raise TypeError(f"{fn}: entry {name!r} must be an int, got "
                        f"{state_dict[name]!r}") from None

    def array(key: str, value: Any) -> Array:
      if _is_tensor(value):
        return _from_torch(fn, key, value)   # range-checked if downcast
      return _host_copy(fn, key, value)

    with _named(fn):
      state = jr.RolloutState(
          data={k: array(k, v) for k, v in state_dict["data"].items()},
          counts=array("counts", state_dict["counts"]),
          out_of_range=array("out_of_range", state_dict["out_of_range"]),
          **sizes)
      check_matches(fn, state, self._state, src="the state_dict",
                    dst="the buffer")
    if self._device is not None:
      state = jax.device_put(state, self._device)
    object.__setattr__(self, "_state", state)

  # --- attribute access to the storage -------------------------------------

  def __getattr__(self, name: str) -> Array:
    # Only called when normal lookup fails: a key's current storage.
    try:
      state = object.__getattribute__(self, "_state")
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
    return sorted(set(super().__dir__()) | set(self._state.names))

  def __repr__(self) -> str:
    keys = ", ".join(
        f"{k!r}: {self._state.spec(k)[0]} {np.dtype(self._state.spec(k)[1])}"
        for k in self._state.names)
    return (f"ExperienceBuffer(num_envs={self.num_envs}, "
            f"num_steps={self.num_steps}, keys={{{keys}}})")

  def _value(self, fn: str, key: Any, data: Any, place: bool = True) -> Any:
    """``data`` for a write of ``key``: a tensor as a JAX copy; with
    ``place``, put on the buffer's device (a host value as a copy)."""
    if key not in self._state.data:
      known = ", ".join(repr(k) for k in self._state.names) or "none"
      raise KeyError(f"{fn}: key {key!r} is not registered (registered: "
                     f"{known}); call register_key({key!r}, shape=..., "
                     "dtype=...) first")
    if _is_tensor(data):
      data = _from_torch(fn, key, data)
    if place and self._device is not None:
      if not isinstance(data, jax.Array):   # may alias a numpy buffer
        data = _host_copy(fn, key, data)
      data = jax.device_put(data, self._device)
    return data


class DictDataset:
  """The original ``DictDataset`` API over ``jr.minibatch_indices``/``jr.take``.

  With ``N = max_k len(tensor_dict[k])`` and ``B = batch_size`` dividing N,
  there are ``M = N // B`` minibatches and ``ds[j] == jr.take(data,
  ds.indices[j])``, i.e. ``{k: v[idx % len(v)]}`` with ``idx`` the rows
  ``j*B:(j+1)*B`` of the current order: shorter arrays wrap around. With
  ``remainder="drop"`` or ``"wrap"`` B need not divide N: ``len()``,
  indexing and iteration follow ``jr.minibatch_indices``' rule for the mode.

  The order starts as the identity. The k-th call of ``shuffle()`` (k = 0,
  1, ..., counting the call made at construction when ``shuffle=True``)
  sets it to ``jr.minibatch_indices(key, N, B, epoch=k)``: epoch k of the
  functional iterator. So calling ``shuffle()`` before each of K epochs
  yields exactly ``jr.minibatches(key, tensor_dict, B, num_epochs=K)``, and
  the same ``key`` always gives the same orders.

  Args:
    batch_size: B, which must divide N.
    tensor_dict: ``{key: [L_k, ...]}`` JAX or numpy arrays or torch tensors
      (converted, as copies, once here); the values may also be pytrees whose
      leaves share ``L_k``.
    shuffle: shuffle once at construction (order 0).
    key: the PRNG key of every order (``jax.random.key``); default
      ``jax.random.key(0)``.
    as_torch: return minibatches as torch tensors (``jrollout.torch.to_torch``).
    remainder: ``"error"`` (default), ``"drop"`` or ``"wrap"``, as for
      ``jr.minibatch_indices``.

  Raises:
    ValueError: an empty dict, a key with no rows or mismatched leading
      shapes, or a batch size that does not divide N (the message names the
      nearest valid ones).
    TypeError: ``tensor_dict`` is not a dict, has a key that is not a str
      (at any depth) or a leaf that is not an array of numbers (a str, a
      numpy array of str or objects), or ``key`` is not a PRNG key.

  Example:
    >>> import numpy as np
    >>> from jrollout.compat import DictDataset
    >>> ds = DictDataset(2, {"x": np.arange(6), "y": np.arange(3)})
    >>> ds.batch_size, ds.num_rows, ds.indices.tolist()   # identity order
    (2, 6, [[0, 1], [2, 3], [4, 5]])
    >>> len(ds), [int(v) for v in ds[-1]["y"]]           # y: rows 4, 5 % 3
    (3, [1, 2])
  """

  def __init__(self, batch_size: int, tensor_dict: Mapping[str, Any],
               shuffle: bool = False, *, key: PRNGKey | None = None,
               as_torch: bool = False, remainder: Remainder = "error"):
    fn = "DictDataset"
    if not isinstance(tensor_dict, Mapping):
      raise TypeError(f"{fn}: `tensor_dict` must be a dict {{key: array}}, "
                      f"got {type(tensor_dict).__name__}")
    if key is None:
      key = jax.random.key(0)
    _checks.check_str_keys(fn, "tensor_dict", tensor_dict)
    _checks.check_arrays(fn, "tensor_dict", tensor_dict, torch=True)
    _checks.check_key(fn, key)
    shuffle = _checks.check_bool(fn, "shuffle", shuffle)
    as_torch = _checks.check_bool(fn, "as_torch", as_torch)
    self._data = {k: self._convert(fn, k, v) for k, v in tensor_dict.items()}
    with _as(fn, "take"):   # the rows, checked as jr.take checks them
      jax.eval_shape(jr.take, self._data, jnp.zeros((0,), jnp.int32))
    num_rows = max(np.shape(jax.tree_util.tree_leaves(v)[0])[0]
                   for v in self._data.values())
    with _as(fn, "minibatch_indices"):
      self._indices = jr.minibatch_indices(key, num_rows, batch_size,
                                           shuffle=False, remainder=remainder)
    self._key, self._num_rows, self._remainder = key, num_rows, remainder
    self._num_orders = 0
    self.as_torch = as_torch
    if shuffle:
      self.shuffle()

  @staticmethod
  def _convert(fn: str, key: str, value: Any) -> PyTree:
    def leaf(x):
      if _is_tensor(x):
        with _named(fn):
          return _from_torch(fn, key, x)
      if isinstance(x, jax.Array):
        return x
      return _host_copy(fn, key, x)
    return jax.tree_util.tree_map(leaf, value, is_leaf=_is_tensor)

  def shuffle(self) -> None:
    """Draws the next order: ``jr.minibatch_indices(key, N, B, epoch=k)``.

    Example:
      >>> import jax, numpy as np, jrollout as jr
      >>> from jrollout.compat import DictDataset
      >>> ds = DictDataset(3, {"x": np.arange(6)}, key=jax.random.key(0))
      >>> ds.shuffle()                             # order 0
      >>> ds.shuffle()                             # order 1
      >>> order = jr.minibatch_indices(jax.random.key(0), 6, 3, epoch=1)
      >>> bool((ds.indices == order).all()), sorted(ds.indices.ravel().tolist())
      (True, [0, 1, 2, 3, 4, 5])
    """
    self._indices = jr.minibatch_indices(
        self._key, self._num_rows, self.batch_size, epoch=self._num_orders,
        remainder=self._remainder)
    self._num_orders += 1

  def num_batches(self) -> int:
    """M: ``N // B`` (``ceil(N / B)`` with ``remainder="wrap"``).

    Example:
      >>> import numpy as np
      >>> from jrollout.compat import DictDataset
      >>> data = {"x": np.arange(10)}              # N = 10, B = 4
      >>> DictDataset(4, data, remainder="drop").num_batches()
      2
      >>> DictDataset(4, data, remainder="wrap").num_batches()
      3
    """
    return self._indices.shape[0]

  def __len__(self) -> int:
    return self.num_batches()

  def __getitem__(self, j: int) -> dict[str, PyTree]:
    """Minibatch ``j`` (negative counts from the end): ``{k: [B, ...]}``."""
    if isinstance(j, (bool, np.bool_)):
      raise TypeError("DictDataset indices must be integers, got bool")
    try:
      i = operator.index(j)
    except TypeError:
      raise TypeError(f"DictDataset indices must be integers, got "
                      f"{type(j).__name__}") from None
    m = len(self)
    if i < 0:
      i += m
    if not 0 <= i < m:
      raise IndexError(f"DictDataset index {j} is out of range for {m} "
                       "minibatches")
    batch = _take(self._data, self._indices[i])
    if self.as_torch:
      from jrollout.torch import to_torch  # noqa: PLC0415 - torch is optional
      batch = to_torch(batch)
    return batch

  def __iter__(self) -> Iterator[dict[str, PyTree]]:
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
  def indices(self) -> Array:
    """The current order as ``[M, B] int32``: row j feeds ``ds[j]``."""
    return self._indices

  def __repr__(self) -> str:
    return (f"DictDataset(batch_size={self.batch_size}, "
            f"keys={sorted(self._data)}, num_rows={self.num_rows}, "
            f"num_batches={len(self)}, orders_drawn={self._num_orders})")
