"""Faults during a save lose no checkpoint: SIGKILL, full disks, file-size
limits, read-only file systems, another user, two saves at once, each hitting
a save forked from one worker (``python -m tests.test_checkpoint_faults
worker``: JAX imported, its backend never started, so a fork is safe); the
PPO example resumes after them."""

from __future__ import annotations

import base64
import errno
import fcntl
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


def _trace(out: int, go: int) -> None:
  """In a forked child: announces each file operation of a save on ``out``
  (one line) and waits for a byte on ``go`` before doing it."""
  def wrap(owner, name, label):
    original = getattr(owner, name)

    def traced(*args, **kwargs):
      shown = " ".join(os.path.basename(str(a)) for a in args[:2]
                       if isinstance(a, (str, os.PathLike)))
      os.write(out, (f"{label} {shown}".strip() + "\n").encode())
      if os.read(go, 1) != b"g":
        os._exit(3)
      return original(*args, **kwargs)

    setattr(owner, name, traced)
  wrap(fcntl, "flock", "lock")
  for name in ("rename", "replace", "unlink", "rmdir"):
    wrap(os, name, name)


def _child(command: dict, out: int | None = None, go: int | None = None,
           wait: int | None = None) -> None:
  """Runs one save in a forked child (its report to ``command["result"]``);
  never returns."""
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
    if wait is not None:
      os.read(wait, 1)   # a start signal shared with another child
    error = None
    try:
      jr.save_rollout(command["path"], item(command["item"]))
    except Exception as e:   # reported to the test
      error = e
    resource.setrlimit(resource.RLIMIT_FSIZE,
                       (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    sys.stderr.flush()
    with open(command["log"], encoding="utf-8", errors="replace") as f:
      log = f.read()
    report = {"ok": error is None, "log": log}
    if error is not None:
      report["error"] = base64.b64encode(pickle.dumps(error)).decode()
    with open(command["result"], "w") as f:
      json.dump(report, f)
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
  """A save; SIGKILLed after ``command["delay"]`` seconds if given."""
  pid = _fork(command)
  if "delay" in command:
    time.sleep(command["delay"])
    os.kill(pid, signal.SIGKILL)
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
    events = [lines.readline().rstrip("\n")]   # "lock", about to take it
    os.write(go_w, b"g")
    events.append(lines.readline().rstrip("\n"))   # it holds the lock
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
  ops = {"save": _save, "kill_at": _kill_at, "race": _race}
  print("ready", flush=True)
  for line in sys.stdin:
    command = json.loads(line)
    print(json.dumps(ops[command.pop("op")](command)), flush=True)


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
  """A later save into ``path`` works and leaves only its step (the
  temporary directories of killed saves are gone)."""
  step = jr.save_rollout(path, item("later"))
  _assert_holds(path, "later")
  _clean(path, step)


def _clean(path, step=None) -> None:
  """``path`` holds one step (``step`` if given) and the lock file."""
  names = sorted(os.listdir(path))
  assert len(names) == 2 and names[1] == "jrollout.lock", names
  assert step is None or names[0] == str(step), names


# ------------------------------------------------------------------ kills


def _committed(events: list[str]) -> bool:
  """Whether orbax had renamed the new step into place: a rename whose
  target is a step number."""
  return any(re.fullmatch(r"(rename|replace) \S+ \d+", e) for e in events)


def test_a_kill_at_every_file_operation_of_a_save(fork, template, tmp_path):
  """SIGKILL before each file operation (of the old step's deletion: the
  first, middle and last): old until the rename of the new step, then new."""
  whole = fork("kill_at", tmp_path,
               path=str(_old_at(template, tmp_path / "a")), item="new",
               at=10**6)
  assert whole["ok"], whole
  events = whole["events"]
  assert events[0].startswith("lock"), events
  assert _committed(events), events
  removal = [i for i, e in enumerate(events)
             if e.startswith(("unlink", "rmdir"))]
  assert removal, events
  picks = sorted({i for i in range(len(events)) if i not in removal} | {
      removal[0], removal[len(removal) // 2], removal[-1]})
  seen = set()
  for at in picks:
    path = _old_at(template, tmp_path / f"k{at}")
    got = fork("kill_at", tmp_path, path=str(path), item="new", at=at)
    assert got.get("killed") == signal.SIGKILL, got
    assert got["events"] == events[:at + 1]
    want = "new" if _committed(events[:at]) else "old"
    _assert_holds(path, want)
    seen.add(want)
    _saves_again(path)
  assert seen == {"old", "new"}


def test_a_kill_at_any_moment_of_a_save(fork, template, tmp_path):
  """SIGKILL at 12 moments over a save's first 300 ms: old or new, whole."""
  delays = [i / 100 for i in range(10)] + [0.2, 0.3]
  found = []
  for i, delay in enumerate(delays):
    path = _old_at(template, tmp_path / f"d{i}")
    got = fork("save", tmp_path, path=str(path), item="new", delay=delay)
    assert got.get("killed") == signal.SIGKILL or got.get("ok"), got
    found.append(_which(path))
    _saves_again(path)
  assert found[0] == "old"
  assert set(found) <= {"old", "new"}


# ------------------------------------------------------------ full disks


def _assert_save_error(error, path, code=None):
  assert isinstance(error, jr.CheckpointSaveError), repr(error)
  assert isinstance(error, OSError) and error.filename == str(path)
  if code is not None:
    assert error.errno == code, error
  message = str(error)
  assert message.startswith(f"save_rollout: cannot save {path}: "), message
  assert message.endswith("; the last complete checkpoint there is kept")
  assert len(message.splitlines()) == 1 and len(message) < 1000, message


@pytest.mark.parametrize("limit, old", [
    (1, True), (65536, True), (1 << 20, True), (8 << 20, True),
    (1 << 20, False)], ids=["1", "64k", "1M", "8M", "first-save"])
def test_a_file_size_limit_fails_the_save_and_keeps_the_old_one(
    fork, template, tmp_path, limit, old):
  """RLIMIT_FSIZE (EFBIG, as a full disk) from the first bytes to the data
  file's last: CheckpointSaveError, the old checkpoint kept (a failed first
  save leaves none); a retry works."""
  path = _old_at(template, tmp_path / "a") if old else tmp_path / "a" / "ckpt"
  got = fork("save", tmp_path, path=str(path), item="new", fsize=limit)
  _assert_save_error(_error(got), path)
  if old:
    _assert_holds(path, "old")
  else:
    with pytest.raises(ValueError, match="holds no complete checkpoint$"):
      jr.restore_rollout(path)
  _saves_again(path)


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


def test_a_full_or_read_only_disk_keeps_the_old_one(fork, small_fs):
  """A tmpfs with room for the old checkpoint and a part of the new one:
  CheckpointSaveError, the old one kept; with room for both, it saves.
  Remounted read-only: EROFS, the checkpoint kept."""
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
    _assert_save_error(_error(got), path)
    _assert_holds(path, "old")
    failed.append(size)
  assert len(failed) >= len(sizes) - 3, (failed, sizes)
  _remount(small_fs, "size=64m")
  got = fork("save", small_fs.parent, path=str(path), item="new")
  assert got["ok"], got
  _assert_holds(path, "new")
  _remount(small_fs, "ro")
  got = fork("save", small_fs.parent, path=str(path), item="old")
  _assert_save_error(_error(got), path, errno.EROFS)
  _assert_holds(path, "new")
  _remount(small_fs, "rw")
  _saves_again(path)


def test_permission_denied(fork):
  """As user nobody (when root), else into a mode-0555 directory:
  CheckpointSaveError (EACCES), the old checkpoint kept."""
  as_root = os.geteuid() == 0
  root = tempfile.mkdtemp(dir="/tmp")
  path = os.path.join(root, "ckpt")
  try:
    os.chmod(root, 0o755)
    jr.save_rollout(path, item("old"))
    out = pathlib.Path(root) / "out"   # for the worker's files
    out.mkdir()
    out.chmod(0o777)
    if not as_root:
      os.chmod(path, 0o555)
    got = fork("save", out, path=path, item="new", user=as_root)
    _assert_save_error(_error(got), path, errno.EACCES)
    _assert_holds(path, "old")
  finally:
    os.chmod(path, 0o755)
    shutil.rmtree(root)


# ------------------------------------------------------------ two writers


def test_a_second_save_while_one_runs_fails_at_once(fork, template,
                                                    tmp_path):
  """A second save while one holds the lock fails (EBUSY); the first
  completes whole."""
  path = _old_at(template, tmp_path / "a")
  got = fork("race", tmp_path, hold=True,
             first={"path": str(path), "item": "a"},
             second={"path": str(path), "item": "b"})
  assert got["events"][0].startswith("lock"), got["events"]
  error = _error(got["second"])
  _assert_save_error(error, path, errno.EBUSY)
  assert "another save into it is running (it holds jrollout.lock)" in str(
      error)
  assert got["first"]["ok"], got
  _assert_holds(path, "a")
  _clean(path)


def test_two_saves_at_once_one_wins_whole(fork, template, tmp_path):
  """Two saves at the same moment, three times: each completes or fails
  with EBUSY, and the path holds a completed one's item, never a mix."""
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


# -------------------------------------------------------- the PPO example

EXAMPLE_ARGS = ["--total-steps", "8192", "--num-envs", "4", "--num-steps",
                "64", "--num-minibatches", "2", "--seeds", "2", "--chunks",
                "16", "--checkpoint-every", "2"]   # 32 updates, 16 chunks


@pytest.fixture(scope="module")
def example(tmp_path_factory):
  """``(run, summary)``: ``run(args, out, ...)`` runs ppo_cartpole (see
  ``_run``); ``summary`` is an uninterrupted run's summary.json."""
  pytest.importorskip("gymnax")
  pytest.importorskip("optax")
  # The runs share a compile cache: the first compiles, the others load its
  # executables (the same bits either way).
  where = tmp_path_factory.mktemp("example")
  cache = ["--compile-cache", str(where / "compiled")]

  def run(args, out, **kwargs):
    return _run([*args, *cache], out, **kwargs)
  run(EXAMPLE_ARGS, where / "plain")
  return run, json.loads((where / "plain" / "summary.json").read_text())


def _run(args, out, kill_after=None, kill_on=None, worker=(), status=0):
  """Runs the example (through ``tests._checkpoint_worker example
  *worker`` if given); SIGKILLs it after ``kill_after`` progress lines or
  at the line starting with ``kill_on``, else expects exit ``status``.
  Returns its output lines (stdout and stderr)."""
  command = (["-m", "tests._checkpoint_worker", "example", *worker] if worker
             else ["-m", "examples.ppo_cartpole"])
  lines, progress = [], 0
  with subprocess.Popen(
      [sys.executable, *command, *args, "--out", str(out)], cwd=ROOT,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
    try:
      for line in proc.stdout:
        lines.append(line)
        progress += line.startswith("update ")
        if (kill_after is not None and progress == kill_after) or (
            kill_on is not None and line.startswith(kill_on)):
          os.kill(proc.pid, signal.SIGKILL)
          break
    finally:
      proc.kill()
    code = proc.wait()
  killed = kill_after is not None or kill_on is not None
  assert code == (-signal.SIGKILL if killed else status), "".join(lines[-30:])
  return lines


def _assert_same_run(out, summary):
  got = json.loads((out / "summary.json").read_text())
  assert got["params_sha256"] == summary["params_sha256"]
  assert got["final_returns"] == summary["final_returns"]


@pytest.mark.slow
@pytest.mark.xdist_group("example_faults")   # one worker runs `example`
def test_the_example_stops_on_a_full_disk_and_resumes_after(example,
                                                            tmp_path):
  """Files limited to 4 KiB from the third save (update 6): one last line
  naming the cause, status 1, updates 2 and 4 kept; the rerun resumes from
  4 and ends as an uninterrupted run."""
  run, summary = example
  ckpt = tmp_path / "ckpt"
  args = [*EXAMPLE_ARGS, "--checkpoint-dir", str(ckpt)]
  full = run(args, tmp_path / "full", worker=("full", "3", "4096"),
             status=1)
  assert "disk full from save 3\n" in full
  last = full[-1].strip()
  assert last.startswith(
      f"--checkpoint-dir {ckpt}: saving the checkpoint at update 6 failed: "
      ), last
  assert last.endswith(
      "; the last complete checkpoint (update 4) is kept: fix the cause "
      "(free space) and rerun the same command to resume from it"), last
  assert not (tmp_path / "full" / "summary.json").exists()
  assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == [
      "2", "4"]
  resumed = run(args, tmp_path / "resumed")
  assert f"resumed from {ckpt} at update 4\n" in resumed
  _assert_same_run(tmp_path / "resumed", summary)
  assert sorted(p.name for p in ckpt.iterdir()) == ["28", "30", "32"]


def _resumed_at(lines):
  starts = [int(line.split()[-1]) for line in lines
            if line.startswith("resumed from")]
  assert len(starts) == 1, "".join(lines)
  return starts[0]


@pytest.mark.slow
@pytest.mark.xdist_group("example_faults")
def test_the_example_killed_three_times_ends_as_an_uninterrupted_run(
    example, tmp_path):
  """Killed twice, then in a save, then damaged: each rerun resumes from
  the latest complete checkpoint and ends as an uninterrupted run; other
  settings are refused."""
  run, summary = example
  ckpt = tmp_path / "ckpt"
  args = [*EXAMPLE_ARGS, "--checkpoint-dir", str(ckpt)]
  first = run(args, tmp_path / "out", kill_after=3)
  assert not any(line.startswith("resumed") for line in first)
  second = run(args, tmp_path / "out", kill_after=3)
  start = _resumed_at(second)
  assert 0 < start < 32
  complete = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
  # The third run hangs in its first save, which never completes.
  third = run(args, tmp_path / "out", kill_on="hanging in save",
              worker=("hang", "1"))
  resumed = _resumed_at(third)
  assert resumed >= start
  partial = [p.name for p in ckpt.iterdir() if ".orbax-checkpoint-tmp" in
             p.name]
  assert partial, sorted(p.name for p in ckpt.iterdir())
  done = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
  assert done and done[-1] >= complete[-1]
  last = run(args, tmp_path / "out")
  assert _resumed_at(last) == done[-1] < 32
  _assert_same_run(tmp_path / "out", summary)
  # A finished run's rerun restores the final checkpoint and says the same.
  again = run(args, tmp_path / "again")
  assert _resumed_at(again) == 32
  _assert_same_run(tmp_path / "again", summary)
  # Other settings are refused by name, and so is --checkpoint-every 0.
  other = run([*args, "--lr", "0.001"], tmp_path / "other", status=1)
  assert re.search(r"other settings.*'lr': \(0\.00025, 0\.001\)",
                   "".join(other)), "".join(other[-5:])
  zero = run([*args, "--checkpoint-every", "0"], tmp_path / "zero", status=1)
  assert "--checkpoint-every must be a positive" in "".join(zero)
  # The latest checkpoint's bytes flipped, the next one's data deleted.
  assert sorted(int(p.name) for p in ckpt.iterdir()) == [28, 30, 32]
  largest = max((p for p in (ckpt / "32").rglob("*") if p.is_file()),
                key=lambda p: p.stat().st_size)
  data = bytearray(largest.read_bytes())
  middle = len(data) // 2
  data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])
  largest.write_bytes(bytes(data))
  deleted = max((p for p in (ckpt / "30" / "runner").rglob("*")
                 if p.is_file()), key=lambda p: p.stat().st_size)
  deleted.unlink()
  damaged = run(args, tmp_path / "damaged")
  text = "".join(damaged)
  assert re.search(
      rf"--checkpoint-dir {ckpt}: the checkpoint at update 32 is damaged: "
      r"(leaf|key) .*: checksum mismatch.*; moved it to "
      rf"{ckpt / '32.damaged'}, trying the one before", text), text
  assert re.search(
      r"the checkpoint at update 30 is damaged: leaf .* cannot be read \(.*"
      rf"; moved it to {ckpt / '30.damaged'}", text), text
  assert "TensorStore" not in text
  assert _resumed_at(damaged) == 28
  assert (ckpt / "32.damaged").is_dir() and (ckpt / "30.damaged").is_dir()
  _assert_same_run(tmp_path / "damaged", summary)
  assert sorted(p.name for p in ckpt.iterdir()) == [
      "28", "30", "30.damaged", "32", "32.damaged"]



if __name__ == "__main__":   # python -m tests.test_checkpoint_faults worker
  worker()
