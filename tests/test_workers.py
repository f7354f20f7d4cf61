"""faces.workers' engine: a worker killed from outside is named by the item it held, the map ends
at once and leaves no process; closing it stops busy workers; many threads map at once and leave
the environment as it was; a TMPDIR that cannot hold the forkserver's socket and a read-only /tmp
fall back with one line; the count is capped at the cores; Ctrl-C in a tool is one line; a script
without a main guard is told of it. Kept light at the top (no torch): the forkserver's workers
import this module."""

import functools
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import pytest

import shardface.faces.workers
from shardface.faces.workers import WorkerDied, default_workers, map_photos

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLEEP_S = 60  # a worker on a "long" item: the tests end long before, or they hang


def needs_two_cores():
    if default_workers() < 2:
        pytest.skip("two cores are needed for two worker processes")


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, ended but not yet collected by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _note_pid_then(item: int, folder: str, long: tuple[int, ...]) -> int:
    """Writes this worker's pid to folder/<item>; sleeps on the `long` items."""
    with open(os.path.join(folder, f"{item}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(folder, f"{item}.tmp"), os.path.join(folder, str(item)))
    if item in long:
        time.sleep(SLEEP_S)
    return item


def _pid_of(folder, item: int) -> int:
    path = os.path.join(folder, str(item))
    while not os.path.exists(path):
        time.sleep(0.01)
    return int(open(path).read())


def test_a_worker_killed_from_outside_is_named_by_its_item_not_by_the_other_workers(tmp_path):
    """Items 2 and 3 are held by the two workers when 3's is killed (as the out-of-memory killer
    does): the map ends at once naming 3, though the worker on 2, earlier in the order, was then
    terminated too; no worker is left."""
    needs_two_cores()
    pids = str(tmp_path)
    killer = subprocess.Popen(
        ["sh", "-c", f"while [ ! -s {pids}/3 ]; do sleep 0.01; done; kill -KILL $(cat {pids}/3)"]
    )
    got = []
    try:
        with pytest.raises(
            WorkerDied,
            match=r"^item 3: the worker process on this item died \(killed by a signal: the "
            r"out-of-memory killer sends SIGKILL\)$",
        ):
            for r in map_photos(
                functools.partial(_note_pid_then, folder=pids, long=(2, 3)),
                range(8),
                workers=2,
                what="item",
                name=lambda i: f"item {i}",
            ):
                got.append(r)
    finally:
        killer.kill()
        killer.wait()
    assert got == [0, 1]
    assert not any(_alive(_pid_of(pids, i)) for i in (2, 3))


def test_closing_the_map_stops_workers_busy_on_items_nobody_takes(tmp_path):
    needs_two_cores()
    pids = str(tmp_path)
    results = map_photos(functools.partial(_note_pid_then, folder=pids, long=(1, 2)), range(6), workers=2)
    assert next(results) == 0
    busy = [_pid_of(pids, 1), _pid_of(pids, 2)]
    results.close()  # returns once they are joined, not after their SLEEP_S
    assert not any(_alive(pid) for pid in busy)


class _TwoPartError(Exception):
    def __init__(self, photo, why):
        super().__init__(f"{photo}: {why}")  # rebuilt from its args by pickle: fails


def _fail_unpicklably(item):
    raise _TwoPartError(item, "refused")


def test_an_error_that_does_not_pickle_arrives_with_its_type_and_message():
    with pytest.raises(Exception):
        pickle.loads(pickle.dumps(_TwoPartError("a", "b")))
    with pytest.raises(RuntimeError, match=r"^_TwoPartError: p/0\.jpg: refused$"):
        list(map_photos(_fail_unpicklably, ["p/0.jpg", "p/1.jpg"], workers=2))


_SETUPS = []


def _set_up():
    _SETUPS.append(os.getpid())


def _setups_here(item):
    return os.getpid(), list(_SETUPS)


def test_setup_runs_once_in_each_worker_before_its_first_item():
    needs_two_cores()
    for pid, setups in map_photos(_setups_here, range(12), workers=2, setup=_set_up):
        assert setups == [pid]  # this worker's own, once
    assert _SETUPS == []  # not here


def test_the_worker_count_is_capped_at_the_cores_and_the_cap_said_once(caplog):
    cores = default_workers()
    shardface.faces.workers._say_once.cache_clear()  # said anew in this test
    most = 0
    with caplog.at_level(logging.WARNING, logger="shardface"):
        for _ in range(2):
            for _ in map_photos(abs, range(-40, 0), workers=cores + 2):
                most = max(most, len(multiprocessing.active_children()))
    assert 0 < most <= cores or cores == 1
    said = [r.getMessage() for r in caplog.records if "worker processes asked for" in r.getMessage()]
    assert said == [
        f"{cores + 2} worker processes asked for; this process may use {cores} cores: {cores} started"
    ]


def _parent_pid(item):
    return os.getppid()


def _run(script: str, env=None) -> subprocess.CompletedProcess:
    """`python -c script` in a fresh process, from the repository."""
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _photo_faces(photos: list[str], out: list, i: int) -> None:
    from shardface.faces.stream import stream

    out[i] = [[f.box for f in photo.faces] for photo in stream(photos, workers=2)]


def test_twelve_threads_each_streaming_photos_with_two_workers_all_succeed_alike_and_leave_pythonpath(
    tmp_path, monkeypatch
):
    """Nothing of this process changes around the workers' start: no thread sees another's
    environment, and the user's PYTHONPATH stays theirs."""
    needs_two_cores()
    import threading

    photos = [os.path.join(_faces(tmp_path, 3), f"h{i:02d}.png") for i in range(3)]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([REPO, "/the/users/own"]))
    before = dict(os.environ)
    alone = [None]
    _photo_faces(photos, alone, 0)
    assert all(alone[0]), "a face in each photo"
    got = [None] * 12
    errors = []

    def run(i):
        try:
            _photo_faces(photos, got, i)
        except BaseException as exc:  # every failure counts
            errors.append(repr(exc))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert got == alone * 12
    assert dict(os.environ) == before


THREADED_MAP = """
import threading
from shardface.faces.workers import map_photos
if __name__ == "__main__":
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()
    print(list(map_photos(abs, range(-5, 0), workers=2)))
"""


def test_a_tmpdir_of_76_bytes_too_long_for_the_forkservers_socket_falls_back_in_one_line(tmp_path_factory):
    """The socket is TMPDIR/pymp-<8>/listener-<8>: 32 bytes more than TMPDIR, 107 at most."""
    needs_two_cores()
    base = str(tmp_path_factory.getbasetemp())
    deep = os.path.join(base, "t" * (76 - len(base) - 1))
    os.makedirs(deep, exist_ok=True)
    assert len(deep) == 76
    done = _run(THREADED_MAP, env={"TMPDIR": deep})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[5, 4, 3, 2, 1]\n"
    [line] = done.stderr.splitlines()
    assert line.startswith("worker processes are spawned") and "AF_UNIX path too long" in line


def test_no_writable_temporary_directory_falls_back_in_one_line(tmp_path):
    """TMPDIR missing, /tmp and /var/tmp mounted read-only in a mount namespace of their own, the
    working directory /proc: tempfile finds nowhere to write."""
    needs_two_cores()
    hidden = [
        p
        for p in (REPO, sys.prefix, sys.executable)
        if os.path.realpath(p).startswith(("/tmp/", "/var/tmp/"))
    ]
    if hidden:  # the read-only mounts over /tmp and /var/tmp would hide them from the child
        pytest.skip(f"the repository or its python lies under /tmp or /var/tmp ({hidden[0]})")
    mounts = ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o ro tmpfs /tmp"]
    if shutil.which("unshare") is None or subprocess.run(mounts, capture_output=True).returncode != 0:
        pytest.skip("needs unshare -m and mount (root in a mount namespace)")
    done = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            "mount -t tmpfs -o ro tmpfs /tmp && mount -t tmpfs -o ro tmpfs "
            f'/var/tmp && cd /proc && exec {sys.executable} -c "$SCRIPT"',
        ],
        env={**os.environ, "PYTHONPATH": REPO, "TMPDIR": str(tmp_path / "missing"), "SCRIPT": THREADED_MAP},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[5, 4, 3, 2, 1]\n"
    [line] = done.stderr.splitlines()
    assert line.startswith("worker processes are spawned") and line.endswith(
        "no writable temporary directory"
    )


def _faces(root, count: int) -> str:
    """`count` photos of a face (scikit-image's astronaut, turned a little) in the folder `root`."""
    from PIL import Image
    from skimage import data

    head = Image.fromarray(data.astronaut()).crop((120, 20, 320, 240))
    for i in range(count):
        head.rotate(i % 7, fillcolor=(90, 90, 90)).save(root / f"h{i:02d}.png")
    return str(root)


@pytest.fixture(scope="module")
def many_photos(tmp_path_factory) -> str:
    """Seconds of work for scripts.align."""
    return _faces(tmp_path_factory.mktemp("many"), 80)


def test_worker_counts_below_one_are_refused_and_1000_capped_at_the_photos_and_the_cores(
    tmp_path, monkeypatch, capsys
):
    from shardface.scripts.align import main as align_tool

    os.makedirs(tmp_path / "photos")
    src, dst = _faces(tmp_path / "photos", 3), str(tmp_path / "crops")
    for bad in ("0", "-1"):
        assert align_tool([src, dst, "--workers", bad]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"error: --workers {bad}: at least 1 (1 runs in this process)"
        ]
    started, real = [], shardface.faces.workers._pooled
    monkeypatch.setattr(
        shardface.faces.workers,
        "_pooled",
        lambda fn, items, workers, *args: started.append(workers) or real(fn, items, workers, *args),
    )
    assert align_tool([src, dst, "--workers", "1000"]) == 0
    assert started == ([min(3, default_workers())] if default_workers() > 1 else [])
    assert len(os.listdir(dst)) == 4  # three crops and the report


def _group(pgid: int) -> list[int]:
    """The live processes of process group `pgid`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(pid))
    return found


def test_ctrl_c_during_a_worker_run_is_one_line_and_leaves_no_process_and_no_output(many_photos, tmp_path):
    needs_two_cores()
    dst = tmp_path / "crops"
    # the tool starts with Ctrl-C's default disposition, as from a shell, whatever this process's is
    # (a SIGINT ignored here would be inherited: the tool could not be stopped, and the test would
    # be of this process's state, not of the tool)
    tool = subprocess.Popen(
        [sys.executable, "-m", "scripts.align", many_photos, str(dst), "--workers", "2"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    said = b""
    try:
        while b"aligning" not in said:  # the bar is drawn: the workers start, or run
            chunk = os.read(tool.stderr.fileno(), 4096)
            assert chunk, said.decode()
            said += chunk
        os.killpg(tool.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group
        out, err = tool.communicate(timeout=60)
    finally:  # where it failed: nothing of it left for the rest of the run
        if tool.poll() is None:
            os.killpg(tool.pid, signal.SIGKILL)
            tool.wait()
    said = (said + err).decode()
    assert tool.returncode == -signal.SIGINT, said  # it dies of the signal, as Python does
    assert "Traceback" not in said and "KeyboardInterrupt" not in said
    assert said.splitlines()[-1] == "SIGINT received: stopped; outputs are published whole or not at all"
    for _ in range(100):
        if not _group(tool.pid):
            break
        time.sleep(0.05)
    assert _group(tool.pid) == []
    assert os.listdir(tmp_path) == []


ORPHANED = """
import functools, sys
from shardface.faces.workers import map_photos
from tests.test_workers import _note_pid_then
if __name__ == "__main__":
    for _ in map_photos(functools.partial(_note_pid_then, folder=sys.argv[1], long=(0, 1, 2, 3)), range(8), workers=2):
        pass
"""


def test_workers_end_with_a_parent_killed_by_sigkill(tmp_path):
    """The out-of-memory killer may choose the parent: its workers, busy or idle, do not stay."""
    needs_two_cores()
    parent = subprocess.Popen(
        [sys.executable, "-c", ORPHANED, str(tmp_path)], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}
    )
    workers = [_pid_of(tmp_path, 0), _pid_of(tmp_path, 1)]
    parent.kill()
    parent.wait(10)
    try:
        for _ in range(100):
            if not any(_alive(pid) for pid in workers):
                break
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in workers)
    finally:  # where it failed: not left for the rest of the run
        for pid in filter(_alive, workers):
            os.kill(pid, signal.SIGKILL)


UNGUARDED = """
import operator, sys
sys.path.insert(0, sys.argv[1])
from shardface.faces.workers import map_photos
print(list(map_photos(operator.neg, [1, 2, 3, 4], workers=2)))
"""


def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path):
    """A worker imports the program's main module, as in every multiprocessing program: a
    script that starts workers from its top level would start more from each worker, which Python
    refuses. The error the script gets names the guard."""
    needs_two_cores()
    script = tmp_path / "mine.py"
    script.write_text(UNGUARDED)
    out = subprocess.run([sys.executable, str(script), REPO], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert out.stderr.splitlines()[-1].startswith(
        "shardface.faces.workers.WorkerDied: a worker process ended"
    )
    assert 'if __name__ == "__main__":' in out.stderr.splitlines()[-1]
