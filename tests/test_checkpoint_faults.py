"""Faults during a save lose no checkpoint (issue 40).

Each fault is injected into a save running in a process forked from one
worker (``python -m tests.test_checkpoint_faults worker``, started once
per module): the worker imports JAX and jrollout but never starts JAX's
backend, so a fork of it is safe and starts a save in milliseconds. The
worker takes one JSON command per line on stdin and answers one JSON line:
a save killed (SIGKILL) just before its k-th file operation or after a
delay, a save under a file-size limit or as another user, two saves at
once. Every test then restores the path in this process and compares it,
bit for bit, with the old or the new item, and saves and restores again.

``python -m tests.test_checkpoint_faults example N LIMIT ARGS...`` runs
``examples.ppo_cartpole`` with ARGS, with a file-size limit of LIMIT bytes
set (a disk that filled up) before its N-th checkpoint save.
"""

from __future__ import annotations

import base64
import errno
import json
import os
import pathlib
import pickle
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

import jrollout as jr
from jrollout._checkpoint import swap as checkpoint_swap
from tests._helpers import child_env
from tests._helpers import ROOT

SHAPE = (64, 256, 128)   # obs of 8 MiB float32: a save takes ~0.2 s here


def item(name: str) -> dict:
  """The saved pytrees: ``old``, ``new``, ``a``, ``b`` (8 MiB each), and
  ``later`` (small)."""
  seed = sum(map(ord, name))
  rng = np.random.default_rng(seed)
  if name == "later":
    return {"x": rng.standard_normal(16, dtype=np.float32)}
  return {"obs": rng.standard_normal(SHAPE, dtype=np.float32),
          "done": rng.random(SHAPE[:2]) < 0.5,
          "step": np.int64(seed)}


# ------------------------------------------------------------- the worker


class _Tracer:
  """In a forked child: announces each file operation of a save on
  ``out`` (one line) and waits for a byte on ``go`` before doing it."""

  def __init__(self, out: int, go: int):
    self.out, self.go = out, go

  def step(self, what: str) -> None:
    os.write(self.out, (what.replace("\n", " ") + "\n").encode())
    if os.read(self.go, 1) != b"g":
      os._exit(3)

  def wrap(self, owner, name, label):
    original = getattr(owner, name)

    def traced(*args, **kwargs):
      shown = " ".join(os.path.basename(str(a)) for a in args[:2]
                       if isinstance(a, (str, os.PathLike)))
      self.step(f"{label} {shown}".strip())
      return original(*args, **kwargs)

    setattr(owner, name, traced)


def _trace(out: int, go: int) -> None:
  tracer = _Tracer(out, go)
  tracer.wrap(checkpoint_swap, "recover", "locked")
  tracer.wrap(checkpoint_swap, "sync_tree", "sync")
  tracer.wrap(checkpoint_swap, "exchange", "exchange")
  tracer.wrap(os, "rename", "rename")
  tracer.wrap(os, "unlink", "unlink")
  tracer.wrap(os, "rmdir", "rmdir")


def _report(error: BaseException | None, log: str) -> dict:
  out = {"ok": error is None, "log": log}
  if error is not None:
    out["error"] = base64.b64encode(pickle.dumps(error)).decode()
  return out


def _child(command: dict, out: int | None = None, go: int | None = None,
           wait: int | None = None) -> None:
  """Runs one save in a forked child; writes its report to ``out``'s
  peer... (see ``_fork``). Never returns."""
  code = 0
  try:
    if command.get("fsize"):
      resource.setrlimit(resource.RLIMIT_FSIZE,
                         (command["fsize"], resource.RLIM_INFINITY))
    if command.get("user"):
      os.setgid(65534)
      os.setuid(65534)
    if go is not None and out is not None:
      _trace(out, go)
    if command.get("fallback"):   # after _trace: not traced
      checkpoint_swap.exchange = lambda a, b: False
    if wait is not None:
      os.read(wait, 1)   # a start signal shared with another child
    error = None
    try:
      jr.save_rollout(command["path"], item(command["item"]),
                      overwrite=command.get("overwrite", True))
    except Exception as e:   # reported to the test
      error = e
    resource.setrlimit(resource.RLIMIT_FSIZE,
                       (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    sys.stderr.flush()
    with open(command["log"], encoding="utf-8", errors="replace") as f:
      log = f.read()
    with open(command["result"], "w") as f:
      json.dump(_report(error, log), f)
  except BaseException:   # noqa: BLE001 (reported through the exit code)
    code = 4
  os._exit(code)


def _fork(command: dict, **pipes) -> int:
  pid = os.fork()
  if pid == 0:
    log = os.open(command["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    _child(command, **pipes)
  return pid


def _result(command: dict, status: int) -> dict:
  if os.WIFSIGNALED(status):
    return {"killed": os.WTERMSIG(status)}
  if not os.path.exists(command["result"]):
    with open(command["log"], encoding="utf-8", errors="replace") as f:
      return {"crashed": os.WEXITSTATUS(status), "log": f.read()}
  with open(command["result"]) as f:
    return json.load(f)


def _save(command: dict) -> dict:
  pid = _fork(command)
  return _result(command, os.waitpid(pid, 0)[1])


def _kill_at(command: dict) -> dict:
  """Kills the save just before its ``at``-th traced operation (0-based);
  returns the operations it announced and its result if it finished."""
  out_r, out_w = os.pipe()
  go_r, go_w = os.pipe()
  pid = _fork(command, out=out_w, go=go_r)
  os.close(out_w)
  os.close(go_r)
  events: list[str] = []
  with os.fdopen(out_r) as lines:
    for line in lines:
      events.append(line.rstrip("\n"))
      if len(events) - 1 == command["at"]:
        os.kill(pid, signal.SIGKILL)
        break
      os.write(go_w, b"g")
  os.close(go_w)
  return {"events": events, **_result(command, os.waitpid(pid, 0)[1])}


def _kill_after(command: dict) -> dict:
  pid = _fork(command)
  time.sleep(command["delay"])
  os.kill(pid, signal.SIGKILL)
  return _result(command, os.waitpid(pid, 0)[1])


def _race(command: dict) -> dict:
  """Two saves started at the same moment; with ``hold``, the first holds
  the lock (stopped right after taking it) while the second runs."""
  first, second = command["first"], command["second"]
  if command.get("hold"):
    out_r, out_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = _fork(first, out=out_w, go=go_r)
    os.close(out_w)
    os.close(go_r)
    lines = os.fdopen(out_r)
    events = [lines.readline().rstrip("\n")]   # "locked": it holds the lock
    other = _save(second)
    while True:   # let the first one go on to its end
      os.write(go_w, b"g")
      line = lines.readline()
      if not line:
        break
      events.append(line.rstrip("\n"))
    lines.close()
    os.close(go_w)
    return {"first": _result(first, os.waitpid(pid, 0)[1]),
            "second": other, "events": events}
  start_r, start_w = os.pipe()
  pids = [_fork(c, wait=start_r) for c in (first, second)]
  os.close(start_r)
  os.write(start_w, b"gg")
  os.close(start_w)
  return {"first": _result(first, os.waitpid(pids[0], 0)[1]),
          "second": _result(second, os.waitpid(pids[1], 0)[1])}


def worker() -> None:
  ops = {"save": _save, "kill_at": _kill_at, "kill_after": _kill_after,
         "race": _race}
  print("ready", flush=True)
  for line in sys.stdin:
    command = json.loads(line)
    print(json.dumps(ops[command.pop("op")](command)), flush=True)


def example(argv) -> None:
  """ppo_cartpole with a file-size limit from its N-th save on."""
  from examples import ppo_cartpole  # noqa: PLC0415 (gymnax is optional)
  from jrollout._checkpoint import api  # noqa: PLC0415
  at, limit, calls = int(argv[0]), int(argv[1]), []
  handler = api.RolloutCheckpointHandler
  original = handler.async_save

  async def async_save(self, directory, *args, **kwargs):
    calls.append(directory)
    if len(calls) == 2 * at - 1:   # two RolloutSave items per checkpoint
      print(f"disk full from save {at}", flush=True)
      resource.setrlimit(resource.RLIMIT_FSIZE,
                         (limit, resource.RLIM_INFINITY))
    return await original(self, directory, *args, **kwargs)

  handler.async_save = async_save
  ppo_cartpole.main(argv[2:])


# ----------------------------------------------------------- test helpers


class Worker:
  def __init__(self, log_dir):
    self.log = open(os.path.join(log_dir, "worker.log"), "w")  # noqa: SIM115
    env = child_env()
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "tests.test_checkpoint_faults", "worker"],
        cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=self.log, text=True)
    assert self.proc.stdout.readline() == "ready\n"
    self.count = 0

  def __call__(self, op: str, tmp, **command) -> dict:
    self.count += 1
    for name in ("log", "result"):
      command[name] = str(tmp / f"{op}{self.count}.{name}")
    for sub in ("first", "second"):
      if sub in command:
        for name in ("log", "result"):
          command[sub][name] = str(tmp / f"{op}{self.count}{sub}.{name}")
    self.proc.stdin.write(json.dumps({"op": op, **command}) + "\n")
    self.proc.stdin.flush()
    answer = self.proc.stdout.readline()
    assert answer, "the worker died"
    return json.loads(answer)

  def close(self):
    self.proc.stdin.close()
    self.proc.wait(timeout=60)
    self.proc.stdout.close()
    self.log.close()


@pytest.fixture(scope="module")
def fork(tmp_path_factory):
  """Runs a save in a process forked from the worker (``Worker``)."""
  w = Worker(tmp_path_factory.mktemp("worker"))
  yield w
  w.close()


@pytest.fixture(scope="module")
def template(tmp_path_factory):
  """A checkpoint of ``item("old")``, copied by ``_old_at``."""
  path = tmp_path_factory.mktemp("template") / "ckpt"
  jr.save_rollout(path, item("old"))
  return path


def _old_at(template, where):
  where.mkdir(parents=True, exist_ok=True)
  shutil.copytree(template, where / "ckpt")
  return where / "ckpt"


def _error(result: dict) -> BaseException:
  assert not result["ok"], result
  return pickle.loads(base64.b64decode(result["error"]))


def _assert_holds(path, name: str) -> None:
  """``path`` restores ``item(name)``, bit for bit."""
  got = jr.restore_rollout(path)
  want = item(name)
  assert sorted(got) == sorted(want)
  for key, value in want.items():
    assert got[key].dtype == np.asarray(value).dtype, key
    np.testing.assert_array_equal(got[key], value, err_msg=key)


def _which(path) -> str:
  got = jr.restore_rollout(path)
  for name in ("old", "new", "a", "b"):
    if np.array_equal(got["obs"], item(name)["obs"]):
      _assert_holds(path, name)
      return name
  raise AssertionError(f"{path} holds neither item")


def _saves_again(path) -> None:
  """A later save into ``path`` and its restore work, and leave nothing
  beside it."""
  jr.save_rollout(path, item("later"), overwrite=True)
  _assert_holds(path, "later")
  assert sorted(os.listdir(path.parent)) == [path.name]


def _clean(path) -> None:
  assert sorted(os.listdir(path.parent)) == [path.name], (
      sorted(os.listdir(path.parent)))


# ------------------------------------------------------------------ kills


def _committed(events: list[str], at: int) -> bool:
  """Whether the swap had put the new checkpoint in place before the
  kill: an exchange, or the rename of ckpt.jrollout-new to ckpt, ran."""
  return any(e.startswith("exchange") or e == "rename ckpt.jrollout-new ckpt"
             for e in events[:at])


@pytest.mark.parametrize("fallback", [False, True],
                         ids=["exchange", "rename-aside"])
def test_a_kill_at_every_file_operation_of_an_overwrite(fork, template,
                                                        tmp_path, fallback):
  """SIGKILL just before each file operation of ``save_rollout(path, new,
  overwrite=True)`` (the lock, orbax's rename of its temporary directory,
  the sync, the exchange or the two renames, the deletion of the old
  checkpoint's files at its start, middle and end, the lock's): ``path``
  restores the old checkpoint until the new one took its place and the
  new one after, bit for bit; a later save cleans up and works. With the
  fallback (no exchange), a kill between the renames leaves no ``path``,
  and the old checkpoint is read from beside it."""
  if not fallback and not checkpoint_swap.exchange(
      str(tmp_path), str(tmp_path)):
    pytest.skip("renameat2(RENAME_EXCHANGE) is not supported here")
  whole = fork("kill_at", tmp_path,
               path=str(_old_at(template, tmp_path / "a")), item="new",
               at=10**6, fallback=fallback)
  assert whole["ok"], whole
  events = whole["events"]
  assert events[0] == "locked ckpt"
  assert sum(_committed(events, i + 1) != _committed(events, i)
             for i in range(len(events))) == 1, events
  between = [i for i, e in enumerate(events)
             if e == "rename ckpt.jrollout-new ckpt"]
  # Every operation but the deletions of the old checkpoint's files, of
  # which the first, the middle one and the last.
  removal = [i for i, e in enumerate(events)
             if e.startswith(("unlink", "rmdir"))]
  picks = sorted({i for i in range(len(events)) if i not in removal} | {
      removal[0], removal[len(removal) // 2], removal[-1]})
  seen = set()
  for at in picks:
    path = _old_at(template, tmp_path / f"k{at}")
    got = fork("kill_at", tmp_path, path=str(path), item="new", at=at,
               fallback=fallback)
    assert got.get("killed") == signal.SIGKILL, got
    assert got["events"] == events[:at + 1]
    want = "new" if _committed(events, at) else "old"
    if fallback and at in between:   # old renamed aside, new not yet in
      assert not path.exists()
      assert (path.parent / "ckpt.jrollout-old").is_dir()
    _assert_holds(path, want)
    seen.add(want)
    _saves_again(path)
  assert seen == {"old", "new"}


def test_a_kill_at_any_moment_of_an_overwrite(fork, template, tmp_path):
  """SIGKILL at 26 moments of the overwrite, every 5 ms over its first
  100 ms, then to 300 ms: ``path`` restores the old or the new checkpoint
  bit for bit, and a later save cleans up and works."""
  delays = [i / 200 for i in range(21)] + [0.13, 0.16, 0.2, 0.25, 0.3]
  found = []
  for i, delay in enumerate(delays):
    path = _old_at(template, tmp_path / f"d{i}")
    got = fork("kill_after", tmp_path, path=str(path), item="new",
               delay=delay)
    assert got.get("killed") == signal.SIGKILL or got.get("ok"), got
    found.append(_which(path))
    _saves_again(path)
  assert found[0] == "old"
  assert set(found) <= {"old", "new"}


# ------------------------------------------------------------ full disks


def _assert_save_error(error, path, code, outcome="the checkpoint there is "
                       "unchanged"):
  assert isinstance(error, jr.CheckpointSaveError), repr(error)
  assert isinstance(error, OSError) and error.errno == code
  assert error.filename == str(path)
  message = str(error)
  assert message.startswith(f"save_rollout: cannot save {path}: ")
  assert message.endswith(f" ({errno.errorcode[code]}); {outcome}")
  assert len(message.splitlines()) == 1 and len(message) < 400, message
  assert "TensorStore" not in message and "OCDBT" not in message


@pytest.mark.parametrize("limit", [1, 100, 4096, 65536, 1 << 20, 6 << 20,
                                   8 << 20])
def test_a_file_size_limit_fails_the_save_and_keeps_the_old_one(
    fork, template, tmp_path, limit):
  """RLIMIT_FSIZE in the saving process (writes fail with EFBIG, as with
  ENOSPC on a full disk) from the lock file's first bytes to the data
  file's last: CheckpointSaveError (EFBIG) naming save_rollout, the path
  and the cause in one line, nothing printed by orbax, the old checkpoint
  restores bit for bit, nothing is left beside it, a later save works."""
  path = _old_at(template, tmp_path / "a")
  got = fork("save", tmp_path, path=str(path), item="new", fsize=limit)
  _assert_save_error(_error(got), path, errno.EFBIG)
  assert "Traceback" not in got["log"] and "ERROR" not in got["log"], (
      got["log"])
  _assert_holds(path, "old")
  _clean(path)
  _saves_again(path)


def test_a_failed_first_save_leaves_nothing(fork, tmp_path):
  path = tmp_path / "a" / "ckpt"
  got = fork("save", tmp_path, path=str(path), item="new", fsize=1 << 20)
  _assert_save_error(_error(got), path, errno.EFBIG,
                     "nothing was written there")
  assert os.listdir(path.parent) == []
  with pytest.raises(FileNotFoundError, match=r"does not exist$"):
    jr.restore_rollout(path)
  jr.save_rollout(path, item("new"))
  _assert_holds(path, "new")


@pytest.fixture
def small_fs(tmp_path):
  """A tmpfs mounted at ``tmp_path/fs`` (root with CAP_SYS_ADMIN only)."""
  where = tmp_path / "fs"
  where.mkdir()
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m",
                            "tmpfs", str(where)], capture_output=True)
  if mounted.returncode:
    pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
  try:
    yield where
  finally:
    subprocess.run(["umount", "-l", str(where)], check=True)


def _remount(where, options):
  subprocess.run(["mount", "-o", f"remount,{options}", str(where)],
                 check=True, capture_output=True)


def _used(where) -> int:
  stat = os.statvfs(where)
  return (stat.f_blocks - stat.f_bfree) * stat.f_frsize


def test_a_full_disk_at_every_stage_keeps_the_old_one(fork, small_fs):
  """A real ENOSPC: a tmpfs just large enough for the old checkpoint and
  a part of the new one, from its first page to its last file (page by
  page at the end). Each save fails with CheckpointSaveError (ENOSPC),
  the old checkpoint restores bit for bit and nothing is left; with room
  for both, the save completes."""
  page = os.sysconf("SC_PAGE_SIZE")
  path = small_fs / "ckpt"
  jr.save_rollout(path, item("old"))
  old = _used(small_fs)
  sizes = [old + page, old + 4 * page, old + (1 << 20), old + (6 << 20)]
  sizes += [2 * old - k * page for k in range(8, 0, -1)]
  failed = []
  for size in sizes:
    _remount(small_fs, f"size={size}")
    got = fork("save", small_fs.parent, path=str(path), item="new")
    if got["ok"]:
      break
    _assert_save_error(_error(got), path, errno.ENOSPC)
    _assert_holds(path, "old")
    _clean(path)
    failed.append(size)
  assert len(failed) >= len(sizes) - 3, (failed, sizes)
  _remount(small_fs, "size=64m")
  got = fork("save", small_fs.parent, path=str(path), item="new")
  assert got["ok"], got
  _assert_holds(path, "new")
  _clean(path)


def test_a_read_only_file_system(fork, small_fs):
  path = small_fs / "ckpt"
  jr.save_rollout(path, item("old"))
  _remount(small_fs, "ro")
  got = fork("save", small_fs.parent, path=str(path), item="new")
  _assert_save_error(_error(got), path, errno.EROFS)
  _assert_holds(path, "old")
  _remount(small_fs, "rw")
  _clean(path)
  _saves_again(path)


def test_permission_denied(fork, tmp_path):
  """A save into a directory its process may not write: as the unprivileged
  user nobody when this runs as root (root may write anywhere), else into
  a directory made read-only (mode 0555). CheckpointSaveError (EACCES)
  naming the lock file, and the old checkpoint is kept."""
  as_root = os.geteuid() == 0
  root = tempfile.mkdtemp(dir="/tmp")
  parent = os.path.join(root, "runs")
  try:
    os.chmod(root, 0o755)
    os.mkdir(parent, 0o755)
    path = os.path.join(parent, "ckpt")
    jr.save_rollout(path, item("old"))
    out = pathlib.Path(root) / "out"   # for the worker's files
    out.mkdir()
    out.chmod(0o777)
    if not as_root:
      os.chmod(parent, 0o555)
    got = fork("save", out, path=path, item="new", user=as_root)
    _assert_save_error(_error(got), path, errno.EACCES)
    assert str(_error(got)).startswith(
        f"save_rollout: cannot save {path}: Permission denied: "
        f"{path}.jrollout-lock (EACCES)")
    _assert_holds(path, "old")
    assert sorted(os.listdir(parent)) == ["ckpt"]
  finally:
    os.chmod(parent, 0o755)
    shutil.rmtree(root)
  del tmp_path


def test_missing_parents_are_created_and_a_file_parent_refused(tmp_path):
  path = tmp_path / "a" / "b" / "ckpt"
  jr.save_rollout(path, item("new"))
  _assert_holds(path, "new")
  (tmp_path / "file").write_text("x")
  with pytest.raises(ValueError, match="cannot be created: .*file is a file"):
    jr.save_rollout(tmp_path / "file" / "ckpt", item("new"))
  assert (tmp_path / "file").read_text() == "x"


# ------------------------------------------------------------ two writers


def test_a_second_save_while_one_holds_the_lock_fails_at_once(
    fork, template, tmp_path):
  """A save holds ``path``'s lock (stopped right after taking it) while a
  second one starts: the second fails with CheckpointSaveError (EBUSY)
  naming the first's process, the first completes, and ``path`` holds
  its item whole."""
  path = _old_at(template, tmp_path / "a")
  got = fork("race", tmp_path, hold=True,
             first={"path": str(path), "item": "a"},
             second={"path": str(path), "item": "b"})
  assert got["events"][0] == "locked ckpt"
  error = _error(got["second"])
  _assert_save_error(error, path, errno.EBUSY)
  assert re.search(r"another save into it is running \(process \d+ on .* "
                   rf"holds {re.escape(str(path))}\.jrollout-lock\)",
                   str(error)), str(error)
  assert got["first"]["ok"], got
  _assert_holds(path, "a")
  _clean(path)


def test_two_saves_at_once_one_wins_whole(fork, template, tmp_path):
  """Two processes save different items into the same path at the same
  moment, three times: each save completes or fails with EBUSY, at least
  one completes, and the path holds the item of one that completed, bit
  for bit, never a mix."""
  for i in range(3):
    path = _old_at(template, tmp_path / f"r{i}")
    got = fork("race", tmp_path, first={"path": str(path), "item": "a"},
               second={"path": str(path), "item": "b"})
    won = [name for name, side in (("a", "first"), ("b", "second"))
           if got[side]["ok"]]
    for side in ("first", "second"):
      if not got[side]["ok"]:
        _assert_save_error(_error(got[side]), path, errno.EBUSY)
    assert won, got
    assert _which(path) in won
    _clean(path)


def test_one_process_s_failed_write_fails_the_save_on_both(tmp_path):
  """Two jax.distributed processes overwrite a sharded checkpoint; process
  1 cannot write (a 1 KiB file-size limit). Both raise
  CheckpointSaveError at once (process 0's names process 1 and its cause)
  instead of waiting for it at a barrier, the path still holds the old
  checkpoint, nothing is left beside it, and the next save works."""
  from tests._helpers import run_workers  # noqa: PLC0415
  run_workers(["tests.test_checkpoint_faults", "two_savers"],
              lambda i: [str(tmp_path)], timeout=240, log_dir=tmp_path)
  path = tmp_path / "c" / "ckpt"
  for i in range(2):
    got = json.loads((tmp_path / f"out{i}.json").read_text())
    cause = ("process 1 failed: " if i == 0 else "") + "File too large"
    assert got["failed"] == {
        "type": "CheckpointSaveError", "errno": errno.EFBIG,
        "message": f"save_rollout: cannot save {path}: {cause} (EFBIG); the "
                   "checkpoint there is unchanged"}, got
    assert got["after_failure"] == "old"
    assert got["beside"] == ["ckpt"]
    assert got["after_retry"] == "new"


# ------------------------------------------------------- misuse of a save


def test_leaves_and_keys_that_cannot_be_saved_are_named(tmp_path):
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  cases = [
      ({"a": {"b": np.array(["x", "y"])}}, TypeError,
       r"save_rollout: leaf \['a'\]\['b'\] is an array of dtype <U1"),
      ({"a": np.array([object()], dtype=object)}, TypeError,
       r"leaf \['a'\] is an array of dtype object"),
      ({"a": "text"}, TypeError, r"leaf \['a'\] is a str"),
      ({"a": {0: np.ones(2), "b": np.ones(2)}}, TypeError,
       r"save_rollout: the dict at \['a'\] has the key 0 \(of type int\)"),
      ({1.5: np.ones(2)}, TypeError, r"the dict at the tree's root has the "
       r"key 1\.5"),
  ]
  for tree, kind, match in cases:
    with pytest.raises(kind, match=match):
      jr.save_rollout(tmp_path / "ckpt", tree)
    assert os.listdir(tmp_path) == []
  state = jr.register(jr.init(2, 3), "obs", (4,))
  jax.jit(lambda s: s, donate_argnums=0)(state)   # consumes state
  with pytest.raises(ValueError, match=(
      r"save_rollout: field 'obs' of the rollout at \['runner'\] \(leaf "
      r"\['runner'\]\.data\['obs'\]\) is a deleted array: .*donated")):
    jr.save_rollout(tmp_path / "ckpt", {"runner": state, "x": jnp.ones(2)})
  writer = jr.RolloutWriter(jr.register(jr.init(2, 3), "obs", (4,)))
  early = writer.state
  writer.update_at(0, {"obs": np.ones((2, 4), np.float32)})
  writer.flush()   # consumes `early`
  with pytest.raises(ValueError, match=r"field 'obs' of the rollout at "
                     r"\['s'\] \(leaf \['s'\]\.data\['obs'\]\) is a deleted"):
    jr.save_rollout(tmp_path / "ckpt", {"s": early})
  assert os.listdir(tmp_path) == []
  jr.save_rollout(tmp_path / "ckpt", writer)   # the writer itself: fine
  restored = jr.restore_rollout(tmp_path / "ckpt", writer.state)
  np.testing.assert_array_equal(restored.data["obs"][0], 1)


# -------------------------------------------------------- the PPO example

EXAMPLE_ARGS = ["--total-steps", "2048", "--num-envs", "4", "--num-steps",
                "64", "--num-minibatches", "2", "--seeds", "2", "--chunks",
                "8", "--checkpoint-every", "2"]   # 8 updates, saves at 2,4,..


def _example(*args, out, worker=()):
  command = (["-m", "tests.test_checkpoint_faults", "example", *worker]
             if worker else ["-m", "examples.ppo_cartpole"])
  return subprocess.run([sys.executable, *command, *args, "--out", str(out)],
                        cwd=ROOT, capture_output=True, text=True, timeout=900)


_UNRETRIEVED = """
import asyncio, gc, json, sys
from jrollout._checkpoint import errors
source_file, message = json.loads(sys.argv[1])
errors.quiet_failed_writes()
space = {"asyncio": asyncio, "message": message}
exec(compile("async def write():\\n"
             "  await asyncio.sleep(0)\\n"
             "  raise ValueError(message)\\n", source_file, "exec"), space)

async def save():
  tasks = [asyncio.create_task(space["write"]()) for _ in range(2)]
  await tasks[0]

try:
  asyncio.run(save())
except ValueError:
  print("the caller got it")
gc.collect()
"""


def _unretrieved_task_logs(source_file: str, message: str) -> str:
  """What a fresh process, after ``quiet_failed_writes``, prints on stderr
  for two tasks that raise ``ValueError(message)`` from code compiled as
  ``source_file`` at once, of which only the first is awaited (as orbax's
  writes of one save are, when the disk fills up)."""
  done = subprocess.run(
      [sys.executable, "-c", _UNRETRIEVED, json.dumps([source_file, message])],
      capture_output=True, text=True, env=child_env(), timeout=120,
      check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout == "the caller got it\n"
  return done.stderr


def test_sibling_writes_of_a_failed_save_are_not_logged_again():
  """orbax writes a checkpoint's files as asyncio tasks: when the disk
  fills up, the first failure reaches the caller and the others' are
  "never retrieved", which asyncio logs with a
  traceback when the tasks are collected, possibly after the example has
  printed its one-line error (CI saw that line pushed off the end). Those
  logs are dropped for orbax's writes that failed for an OS reason, and
  kept for anything else."""
  full = ("OUT_OF_RANGE: Error writing \"x/0.0\" in OCDBT database: Failed "
          "to write 137865 bytes to file 4: File too large "
          "[os_error_code='27']")
  orbax_file = "/site-packages/orbax/checkpoint/serialization.py"
  assert _unretrieved_task_logs(orbax_file, full) == ""
  # Not orbax's, or no error of the operating system: still logged.
  for where, message in [("/home/user/mine.py", full),
                         (orbax_file, "a bug in the writer")]:
    logged = _unretrieved_task_logs(where, message)
    assert "Task exception was never retrieved" in logged, logged
    assert message in logged, logged


@pytest.mark.slow
def test_the_example_stops_on_a_full_disk_and_resumes_after(tmp_path):
  """ppo_cartpole with --checkpoint-dir, its files limited to 4 KiB from
  its third checkpoint (update 6) on: it stops with one line on stderr
  naming the directory, the update and the cause, exits with status 1,
  and keeps the checkpoints of updates 2 and 4. The same command, with
  room again, resumes from update 4 and ends with the parameters (SHA-256)
  and returns of a run never interrupted."""
  pytest.importorskip("gymnax")
  pytest.importorskip("optax")
  ckpt = tmp_path / "ckpt"
  args = [*EXAMPLE_ARGS, "--checkpoint-dir", str(ckpt)]
  plain = _example(*EXAMPLE_ARGS, out=tmp_path / "plain")
  assert plain.returncode == 0, plain.stderr[-3000:]
  full = _example(*args, out=tmp_path / "full", worker=("3", "4096"))
  assert full.returncode == 1, full.stdout[-2000:] + full.stderr[-3000:]
  assert "disk full from save 3" in full.stdout
  last = full.stderr.strip().splitlines()[-1]
  assert last == (
      f"--checkpoint-dir {ckpt}: saving the checkpoint at update 6 failed: "
      "File too large (EFBIG); the last complete checkpoint (update 4) is "
      "kept: fix the cause (free space) and rerun the same command to "
      "resume from it"), full.stderr[-3000:]
  assert "Traceback" not in full.stderr and "ERROR" not in full.stderr
  assert not (tmp_path / "full" / "summary.json").exists()
  assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == [
      "2", "4"]
  resumed = _example(*args, out=tmp_path / "resumed")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"resumed from {ckpt} at update 4" in resumed.stdout
  want = json.loads((tmp_path / "plain" / "summary.json").read_text())
  got = json.loads((tmp_path / "resumed" / "summary.json").read_text())
  assert got["params_sha256"] == want["params_sha256"]
  assert got["final_returns"] == want["final_returns"]
  assert sorted(p.name for p in ckpt.iterdir()) == ["4", "6", "8"]


SHARDED_ARGS = ["--total-steps", "4096", "--num-envs", "16", "--num-steps",
                "32", "--num-minibatches", "2", "--num-epochs", "2",
                "--chunks", "8", "--checkpoint-every", "2"]   # 8 updates


def _two_processes(args, out, fault=()):
  """``ppo_sharded --distributed`` (through ``sharded`` with ``fault``) in
  2 processes started directly, as on two machines: not through
  launch_local, which stops the others when one fails. Returns each
  one's ``(status, stdout, stderr)``."""
  from examples import launch_local  # noqa: PLC0415
  module = "tests.test_checkpoint_faults" if fault else "examples.ppo_sharded"
  head = ["sharded", *fault] if fault else []
  env = child_env()
  commands = launch_local.commands(
      module, [*head, *args, "--out", str(out)], 2,
      f"localhost:{launch_local.free_port()}")
  os.makedirs(out, exist_ok=True)
  logs = [(open(os.path.join(out, f"{i}.stdout"), "w+"),  # noqa: SIM115
           open(os.path.join(out, f"{i}.stderr"), "w+"))  # noqa: SIM115
          for i in range(2)]
  procs = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=o, stderr=e,
                            text=True) for c, (o, e) in zip(commands, logs)]
  try:
    codes = [p.wait(timeout=600) for p in procs]
  finally:
    for p in procs:
      p.kill()
      p.wait()
  found = []
  for code, files in zip(codes, logs):
    texts = []
    for f in files:
      f.seek(0)
      texts.append(f.read())
      f.close()
    found.append((code, *texts))
  return found


@pytest.mark.slow
def test_one_process_s_failed_save_fails_the_distributed_run(tmp_path):
  """ppo_sharded --distributed on 2 processes, process 1's files limited
  to 1 KiB from its third checkpoint (update 6) on: both processes stop on
  their own with the one-line message (process 0's names process 1 and
  its cause) and status 1; update 6 is never counted, the latest
  checkpoint is update 4. The same command resumes from it on both and
  ends with the parameters of an uninterrupted 2-process run, bit for
  bit."""
  pytest.importorskip("gymnax")
  pytest.importorskip("optax")
  ckpt = tmp_path / "ckpt"
  args = [*SHARDED_ARGS, "--checkpoint-dir", str(ckpt)]
  plain = _two_processes(SHARDED_ARGS, tmp_path / "plain")
  assert [code for code, _, _ in plain] == [0, 0], plain[0][2][-3000:]
  failed = _two_processes(args, tmp_path / "failed", fault=("1", "3", "1024"))
  kept = ("; the last complete checkpoint (update 4) is kept: fix the cause "
          "(free space) and rerun the same command to resume from it")
  head = f"--checkpoint-dir {ckpt}: saving the checkpoint at update 6 failed: "
  for i, (code, out, err) in enumerate(failed):
    assert code == 1, out[-2000:] + err[-3000:]
    cause = ("process 1 failed: " if i == 0 else "") + "File too large (EFBIG)"
    assert head + cause + kept in err.splitlines(), err[-3000:]
    assert "Traceback" not in err
  assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == [
      "2", "4"]
  resumed = _two_processes(args, tmp_path / "resumed")
  assert [code for code, _, _ in resumed] == [0, 0], resumed[0][2][-3000:]
  assert f"resumed from {ckpt} at update 4" in resumed[0][1]
  want = json.loads((tmp_path / "plain" / "summary.json").read_text())
  got = json.loads((tmp_path / "resumed" / "summary.json").read_text())
  assert got["resumed_at"] == 4
  assert got["params_sha256"] == want["params_sha256"]
  assert got["returns"] == want["returns"]


def two_savers(argv) -> None:
  """One of two ``jax.distributed`` processes (``_helpers.start_worker``):
  saves ``old`` (a rollout sharded over both) to ``DIR/c/ckpt``, then
  ``new`` over it with
  process 1's files limited to 1 KiB, then ``new`` again without; writes
  what each save raised, and what ``path`` held after each, to
  ``DIR/out{PROCESS_ID}.json``."""
  from tests import _checkpoint_worker as states  # noqa: PLC0415
  from tests import _helpers  # noqa: PLC0415
  jax, jr_, mesh, (directory,) = _helpers.start_worker(argv)
  import jax.numpy as jnp  # noqa: PLC0415
  path = os.path.join(directory, "c", "ckpt")
  old = jr_.shard(states.fresh(jr_), mesh)
  new = states.write(jax, jr_, jr_.shard(states.fresh(jr_), mesh))
  jr_.save_rollout(path, old)

  def held() -> str:
    got = jr_.restore_rollout(path, jr_.shard(states.fresh(jr_), mesh))
    same = jax.jit(lambda a, b: jnp.array_equal(a.data["obs"],
                                                b.data["obs"]))
    return "new" if bool(same(got, new)) else (
        "old" if bool(same(got, old)) else "neither")

  report = {}
  if jax.process_index() == 1:
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
  try:
    jr_.save_rollout(path, new, overwrite=True)
    report["failed"] = None
  except Exception as e:  # noqa: BLE001 (reported)
    report["failed"] = {"type": type(e).__name__, "message": str(e),
                        "errno": getattr(e, "errno", None)}
  resource.setrlimit(resource.RLIMIT_FSIZE,
                     (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
  report["after_failure"] = held()
  report["beside"] = sorted(os.listdir(os.path.dirname(path)))
  from jax.experimental import multihost_utils  # noqa: PLC0415
  multihost_utils.sync_global_devices("listed")   # before the next save
  jr_.save_rollout(path, new, overwrite=True)
  report["after_retry"] = held()
  with open(os.path.join(directory, f"out{jax.process_index()}.json"),
            "w") as f:
    json.dump(report, f)
  jax.distributed.shutdown()


def sharded(argv) -> None:
  """One process of ppo_sharded --distributed; process FAIL's files are
  limited to LIMIT bytes from its AT-th checkpoint save on."""
  from examples import ppo_sharded  # noqa: PLC0415 (gymnax is optional)
  from jrollout._checkpoint import api  # noqa: PLC0415
  fail, at, limit, args = int(argv[0]), int(argv[1]), int(argv[2]), argv[3:]
  if int(args[args.index("--process-id") + 1]) == fail:
    handler = api.RolloutCheckpointHandler
    original, calls = handler.async_save, []

    async def async_save(self, directory, *args, **kwargs):
      calls.append(directory)
      if len(calls) == 2 * at - 1:   # two RolloutSave items per checkpoint
        resource.setrlimit(resource.RLIMIT_FSIZE,
                           (limit, resource.RLIM_INFINITY))
      return await original(self, directory, *args, **kwargs)

    handler.async_save = async_save
  ppo_sharded.main(args)


if __name__ == "__main__":
  {"worker": lambda argv: worker(), "example": example,
   "sharded": sharded, "two_savers": two_savers}[sys.argv[1]](sys.argv[2:])
