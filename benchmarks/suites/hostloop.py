"""Host-side vector envs (issue 18): the bridge at small sizes, the host loop.

Bridge (``bridge_small_*``): ``jrollout.torch.from_torch`` next to the
fastest known path with the same semantics, at the sizes a host loop moves
per step (1024x4 ... 4096x512 float32, and a 4-leaf step dict):

- a view: ``jax.dlpack.from_dlpack(t)``, the raw import;
- a copy: ``jnp.array(t.numpy(), copy=True)``, ``t.clone()`` imported, and
  one jitted ``jnp.copy`` of the tree of numpy views (``tree_map`` of
  ``t.numpy()``, the jitted call flattening and rebuilding the tree in
  C++): from_torch's own method with a tree in and a tree out, the same
  semantics without its checks.

Targets: from_torch within 1.1x of each (issue 18). One more row, the same
jitted copy of a prebuilt list of the leaves' views, returning a list, has
no target: it skips the tree a caller hands in and gets back, so it is not
the same semantics, but it is the floor of the copy itself: compare the two
medians in the table.

Host loop (``hostloop_envpool_E*``): one rollout of T steps of EnvPool
CartPole-v1 with the jitted policy of ``examples/ppo_envpool.py``, written
by the example's own ``collect`` (a ``jr.RolloutWriter``; with
``wait=False``: its flushes are not waited for, as in a loop that does not
time its parts), next to ``numpy_collect``: the same env, policy and
per-step transfers, the steps stored into preallocated numpy ``[T, E]``
arrays and moved into JAX once per rollout. Target: the example's loop
is not slower (issue 18: its env steps per second >= the numpy loop's).
Both loops record per-part seconds (env | bridge | policy | buffer write)
in ``HostLoop.timings``; the breakdown measured from them is in
docs/performance.md ("Host loops").
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness as h

SIZES = ((1024, 4), (1024, 64), (4096, 4), (4096, 64), (4096, 512))
VIEW, FT_VIEW = "from_dlpack view", "from_torch view"
NP_COPY, CLONE, FT_COPY = ("jnp.array(t.numpy(), copy=True)",
                           "clone + from_dlpack", "from_torch copy=True")
JIT_COPY = "jitted jnp.copy of the tree of t.numpy()"
JIT_LIST = "jitted jnp.copy of a leaf list (floor)"


def _step_dict(num_envs: int):
  import torch  # noqa: PLC0415 (the bench extra)
  return {"obs": torch.randn(num_envs, 4),
          "reward": torch.ones(num_envs),
          "terminated": torch.rand(num_envs) < 0.1,
          "truncated": torch.rand(num_envs) < 0.1}


def _bridge_build(make):
  def build(config: h.Config):
    del config
    import torch  # noqa: PLC0415 (the bench extra)
    from jrollout.torch import from_torch  # noqa: PLC0415 (needs torch)
    torch.manual_seed(0)
    tree = make()
    leaves = jax.tree_util.tree_leaves(tree)
    tmap = jax.tree_util.tree_map

    def ready(x):
      return jax.block_until_ready(x)

    # from_torch's copy without its checks: one jitted copy of the tree of
    # numpy views, and the same without the tree (a list in, a list out).
    jit_copy = jax.jit(lambda t: tmap(jnp.copy, t))
    jit_list = jax.jit(lambda xs: [jnp.copy(x) for x in xs])

    def shares(out, want: bool):
      for t, a in zip(leaves, jax.tree_util.tree_leaves(out)):
        assert (a.unsafe_buffer_pointer() == t.data_ptr()) == want

    def impl(name, fn, kind, view):
      def setup():
        shares(fn(), view)
        return lambda: ready(fn())
      return h.Impl(name, setup, kind,
                    check=lambda out: {
                        str(i): np.asarray(x) for i, x in
                        enumerate(jax.tree_util.tree_leaves(out))})

    return [
        impl(VIEW, lambda: tmap(jax.dlpack.from_dlpack, tree), "jax-idiom",
             True),
        impl(FT_VIEW, lambda: from_torch(tree), "jrollout", True),
        impl(NP_COPY, lambda: tmap(
            lambda t: jnp.array(t.numpy(), copy=True), tree), "numpy", False),
        impl(CLONE, lambda: tmap(
            lambda t: jax.dlpack.from_dlpack(t.clone()), tree), "torch",
             False),
        impl(JIT_COPY, lambda: jit_copy(tmap(lambda t: t.numpy(), tree)),
             "jax-idiom", False),
        impl(JIT_LIST, lambda: jit_list([t.numpy() for t in leaves]),
             "jax-idiom", False),
        impl(FT_COPY, lambda: from_torch(tree, copy=True), "jrollout",
             False),
    ]
  return build


def _bridge(name: str, what: str, make) -> h.Measurement:
  return h.Measurement(
      name=name, description=f"torch -> JAX of {what}: view and copy paths",
      build=_bridge_build(make), baseline=VIEW,
      targets=[
          h.Target(FT_VIEW, VIEW, 1.1, "issue 18: view within 1.1x of raw"),
          h.Target(FT_COPY, NP_COPY, 1.1,
                   "issue 18: copy within 1.1x of the fastest copy"),
          h.Target(FT_COPY, CLONE, 1.1,
                   "issue 18: copy within 1.1x of the fastest copy"),
          h.Target(FT_COPY, JIT_COPY, 1.1,
                   "issue 18: copy within 1.1x of the fastest copy"),
      ])


def _tensor(shape):
  def make():
    import torch  # noqa: PLC0415 (the bench extra)
    return torch.randn(*shape)
  return make


# --- the host loop ------------------------------------------------------------


# Host arrays into JAX: a jitted identity moves a whole dict in one dispatch
# (its outputs are new buffers; JAX only reads numpy arguments during the
# call), much cheaper than jax.device_put of the same dict.
_to_jax = jax.jit(lambda tree: tree)


def numpy_collect(env, obs, buffers, params, key, learner, episodes,
                  timings):
  """``ppo_envpool.collect``'s work with a numpy ``[T, E]`` buffer.

  The same env and jitted policy (which reads the numpy observations); the
  policy's outputs go to numpy every step and are stored with numpy
  assignment, with the env's outputs, and the whole rollout goes into JAX
  at the end with one jitted identity (counted as bridge).
  Returns ``(obs, data, key, done)`` with ``data`` ``{key: [T, E, ...]}``
  JAX arrays.
  """
  num_steps = buffers["obs"].shape[0]
  done = None
  for t in range(num_steps):
    t1 = time.perf_counter()
    action, logp, value, key = jax.block_until_ready(
        learner.act(params, obs, key))
    t2 = time.perf_counter()
    action_np = np.asarray(action)
    logp_np, value_np = np.asarray(logp), np.asarray(value)
    t3 = time.perf_counter()
    next_obs, reward, terminated, truncated, _ = env.step(action_np)
    done = terminated | truncated
    episodes.add(reward, done)
    t4 = time.perf_counter()
    buffers["obs"][t] = obs
    buffers["action"][t] = action_np
    buffers["logp"][t] = logp_np
    buffers["value"][t] = value_np
    buffers["reward"][t] = reward
    buffers["terminated"][t] = terminated
    buffers["truncated"][t] = truncated
    t5 = time.perf_counter()
    obs = next_obs
    timings["bridge"] += t3 - t2
    timings["policy"] += t2 - t1
    timings["env"] += t4 - t3
    timings["buffer"] += t5 - t4
  t0 = time.perf_counter()
  data = jax.block_until_ready(_to_jax(buffers))
  timings["bridge"] += time.perf_counter() - t0
  return obs, data, key, done


def numpy_buffers(num_envs: int, num_steps: int) -> dict[str, np.ndarray]:
  """The numpy loop's ``[T, E, ...]`` arrays (the example's env keys)."""
  shapes = {"obs": ((4,), np.float32), "action": ((), np.int32),
            "logp": ((), np.float32), "value": ((), np.float32),
            "reward": ((), np.float32), "terminated": ((), np.bool_),
            "truncated": ((), np.bool_)}
  return {k: np.zeros((num_steps, num_envs, *s), d)
          for k, (s, d) in shapes.items()}


class HostLoop:
  """One env, policy and rollout of each kind, for both loops.

  ``run("jrollout")`` / ``run("numpy")`` collects one rollout of T steps
  and adds its per-part seconds to ``timings[kind]``.
  """

  def __init__(self, num_envs: int, num_steps: int, backend="envpool",
               seed=0, wait: bool = True):
    from examples import ppo_envpool as pe  # noqa: PLC0415 (envpool extra)
    self.pe = pe
    self.config = pe.Config(num_envs=num_envs, num_steps=num_steps,
                            backend=backend)
    self.learner = pe.Learner(self.config)
    train_state, self.rollout = self.learner.init(jax.random.key(seed))
    self.params = train_state.params
    self.env, self.obs = pe.make_env(self.config, seed)
    self.key = jax.random.key(seed + 1)
    self.episodes = pe.Episodes(num_envs)
    self.buffers = numpy_buffers(num_envs, num_steps)
    self.timings = {k: dict.fromkeys(pe.PARTS, 0.0)
                    for k in ("jrollout", "numpy")}
    self.steps = {"jrollout": 0, "numpy": 0}
    self.wait = wait   # collect's `wait`: False leaves the flushes async

  def run(self, kind: str):
    if kind == "jrollout":
      self.obs, self.rollout, self.key, _ = self.pe.collect(
          self.env, self.obs, self.rollout, self.params, self.key,
          self.learner, self.episodes, self.timings[kind], self.wait)
      out = self.rollout
    else:
      self.obs, out, self.key, _ = numpy_collect(
          self.env, self.obs, self.buffers, self.params, self.key,
          self.learner, self.episodes, self.timings[kind])
    self.steps[kind] += self.config.num_steps
    return out

  def close(self):
    self.env.close()


def _hostloop_build(num_envs: int, num_steps: int):
  def build(config: h.Config):
    try:
      import envpool  # noqa: F401, PLC0415 (the envpool extra)
    except ImportError as err:
      raise h.Skip("needs the envpool extra") from err
    # The writer's flushes run while the loop goes on, as in any loop that
    # does not time its parts (wait=True would charge each part its work).
    loop = HostLoop(num_envs // 8 if config.quick else num_envs, num_steps,
                    wait=False)

    def impl(kind, name, family):
      def setup():
        loop.run(kind)   # compiles the writer's flushes and the policy
        return lambda: loop.run(kind)
      return h.Impl(name, setup, family)

    return [impl("jrollout", "RolloutWriter loop (ppo_envpool.collect)",
                 "jrollout"),
            impl("numpy", "numpy [T, E] buffer loop", "numpy")]
  return build


def _hostloop(num_envs: int, num_steps: int = 32) -> h.Measurement:
  return h.Measurement(
      name=f"hostloop_envpool_E{num_envs}",
      description=(f"a rollout of {num_steps} steps of {num_envs} EnvPool "
                   "CartPole envs, policy jitted, written by the writer or "
                   "into numpy"),
      build=_hostloop_build(num_envs, num_steps),
      baseline="numpy [T, E] buffer loop",
      targets=[h.Target("RolloutWriter loop (ppo_envpool.collect)",
                        "numpy [T, E] buffer loop", 1.0,
                        "issue 18: env steps/s >= the numpy loop's")])


MEASUREMENTS = [
    *[_bridge(f"bridge_small_{r}x{c}", f"one [{r}, {c}] float32 tensor",
              _tensor((r, c))) for r, c in SIZES],
    _bridge("bridge_small_step_dict", "a step dict: obs [1024, 4] f32, "
            "reward [1024] f32, terminated/truncated [1024] bool",
            lambda: _step_dict(1024)),
    _hostloop(1024),
    _hostloop(4096),
]
SMOKE = "hostloop_envpool_E1024"
