"""Misuse of the public API with torch (issue #32): torch tensors and dtypes
where arrays and dtypes are expected, and the torch bridge's own flags and
errors. The promises, and the checks shared with the cases without torch,
are ``test_misuse.py``'s (helpers in ``tests/_misuse.py``).
"""

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jrollout as jr
from tests._misuse import assert_writer_applies_only_good_writes
from tests._misuse import assert_writes_refused_with_the_fix
from tests._misuse import call_named
from tests._misuse import E
from tests._misuse import NOT_BOOLS
from tests._misuse import T
from tests._misuse import WRITER_VALUES

torch = pytest.importorskip("torch")
from jrollout.torch import from_torch  # noqa: E402
from jrollout.torch import to_torch  # noqa: E402


@pytest.mark.parametrize("entry", ["update_at", "writer", "update_all"])
def test_torch_tensors_are_refused_with_the_fix(entry):
  assert_writes_refused_with_the_fix(entry, lambda lead: [
      (torch.ones(lead), r"torch.Tensor.*t\.numpy\(\).*from_torch")])


FLAG_CALLS = {
    "from_torch": lambda v: from_torch(torch.ones(2), copy=v),
    "to_torch": lambda v: to_torch(jnp.ones(2), copy=v),
}


@settings(max_examples=25)
@given(fn=st.sampled_from(sorted(FLAG_CALLS)),
       flag=st.sampled_from(NOT_BOOLS))
def test_flags_of_the_bridge_are_bools(fn, flag):
  _, err = call_named(fn, lambda: FLAG_CALLS[fn](flag))
  assert isinstance(err, (TypeError, ValueError)), err


@settings(max_examples=15)
@given(ops=st.lists(st.tuples(st.integers(-1, T), st.sampled_from(
    [*WRITER_VALUES, "torch"])), max_size=12),
       flush_every=st.integers(1, 4))
def test_writer_failures_with_torch_tensors_leave_the_queue_as_it_was(
    ops, flush_every):
  assert_writer_applies_only_good_writes(
      ops, flush_every, {**WRITER_VALUES, "torch": torch.ones(E)},
      refused={"shape", "torch"})


def test_torch_bridge_misuse_names_the_function():
  with pytest.raises(TypeError, match=r"^to_torch: leaf \['k'\] has dtype "
                     r"key<fry>.*key_data"):
    to_torch({"k": jax.random.key(0)})
  with pytest.raises(TypeError, match=r"^from_torch: leaf \(the tree "
                     r"itself\) is on the meta device"):
    from_torch(torch.empty(2, device="meta"))


NAMED_ERRORS = [
    ("take", TypeError, lambda: jr.take({"x": torch.ones(4)}, np.arange(2))),
    ("minibatch_indices", TypeError, lambda: jr.minibatch_indices(
        torch.ones(2), 4, 2)),
    ("shard_rows", TypeError, lambda: jr.shard_rows(
        {"x": torch.ones(8)}, jax.make_mesh((jax.device_count(),), ("d",)))),
    ("register", TypeError, lambda: jr.register(jr.init(E, T), "x",
                                                dtype=torch.float32)),
    ("init_running_stats", TypeError,
     lambda: jr.init_running_stats(dtype=torch.ones(2))),
]


@pytest.mark.parametrize("fn, exc, call", NAMED_ERRORS,
                         ids=[f"{fn}-{i}" for i, (fn, _, _) in
                              enumerate(NAMED_ERRORS)])
def test_torch_arguments_now_name_the_function(fn, exc, call):
  _, err = call_named(fn, call)
  assert isinstance(err, exc), err
