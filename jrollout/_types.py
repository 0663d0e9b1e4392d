"""Type aliases of the annotations."""

from __future__ import annotations

from typing import Any, Literal

import jax

Array = jax.Array
ArrayLike = jax.typing.ArrayLike
PyTree = Any
PRNGKey = jax.Array
AxisName = str | tuple[str, ...]   # a mapped or mesh axis name, or several
Remainder = Literal["error", "drop", "wrap"]
ShardMode = Literal["local", "global"]
Check = Literal["error", "callback", "off"]
AutoresetMode = Literal["next_step", "same_step"]
