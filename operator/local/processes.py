"""processes: a deployment's replicas as local runtime processes (``specdecode serve …``), kept running.

Linux only: children get SIGTERM when the supervisor dies, even by SIGKILL (``PR_SET_PDEATHSIG``,
set through prctl; it follows the forking thread, so one long-lived thread forks them all), and a
process is recognised by its start time in ``/proc/<pid>/stat``, so a reused pid is never taken for it.

- **replica**: one process, ``start``-ed with its argv, environment additions and port; its stdout
  and stderr go to ``state_dir/logs/{name}-{replica}.log``. It leads its own process group.
- **ready**: its ``GET http://127.0.0.1:{port}/ready`` answers 200 (the runtime: model loaded and
  warmed up, not draining), polled every ``poll_s`` by the monitor thread.
- **exit**: a replica that exits on its own is restarted after a backoff (``Backoff``: 1 s doubling
  to 30 s, counted from 1 again once a run lasted 60 s); the exit code and the last non-empty line
  of that run's log are kept. A **refusal** (``EXIT_INVALID_CONFIG``: the runtime refused its
  configuration in one line) waits the cap: the same argv would be refused again. The runtime's
  other refusal, a model it cannot serve, exits 1 as a crash does, and is backed off as one.
- **stop**: SIGTERM to the replica (the runtime drains: ``/ready`` turns 503, requests in flight
  finish, exit 0), SIGKILL to its process group after ``grace_seconds``. Whenever a replica exits,
  its group is killed, so nothing it spawned outlives it.
- **pid file** ``state_dir/{name}.pids``: the supervisor and its children with their start times;
  ``Supervisor.reap_leftovers`` kills the children a dead supervisor left. A lock on
  ``state_dir/{name}.lock`` keeps a second supervisor of the same name out (``AlreadyRunning``).

No torch: this module only spawns processes and polls HTTP.
"""
from __future__ import annotations

import ctypes
import fcntl
import http.client
import logging
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

log = logging.getLogger(__name__)

EXIT_INVALID_CONFIG = 2  # `specdecode serve` on an invalid configuration (runtime/cli.py), argparse's usage error too
HOST = "127.0.0.1"
LOG_TAIL_BYTES = 8192  # how much of a log's end is read for its last line
PROBE_TIMEOUT_S = 1.0
_PR_SET_PDEATHSIG = 1
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # deployment names and replica ids name files
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # localhost, whatever http_proxy says


class AlreadyRunning(RuntimeError):
    def __init__(self, name: str, pid: int | None):
        super().__init__(f"a supervisor of {name!r} is already running (pid {pid if pid else 'unknown'})")
        self.pid = pid


class PortInUse(RuntimeError):
    def __init__(self, port: int):
        super().__init__(f"port {port} is in use on {HOST}")
        self.port = port


# -- pure parts ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Backoff:
    """The wait before restarting a replica that exited: ``first_s`` doubling to ``cap_s``."""

    first_s: float = 1.0
    cap_s: float = 30.0
    reset_after_s: float = 60.0  # a run that lasted this long starts the count again

    def delay(self, failures: int) -> float:
        """The wait after ``failures`` (≥ 1) exits in a row."""
        return min(self.cap_s, self.first_s * 2.0 ** min(failures - 1, 64))

    def after_exit(self, failures: int, uptime_s: float, exit_code: int | None) -> tuple[int, float]:
        """(exits in a row, the wait) after a run of ``uptime_s`` ended with ``exit_code``."""
        failures = 1 if uptime_s >= self.reset_after_s else failures + 1
        return failures, self.cap_s if exit_code == EXIT_INVALID_CONFIG else self.delay(failures)


def parse_stat(text: str) -> tuple[str, int]:
    """(state, start time in clock ticks after boot) from the text of ``/proc/<pid>/stat``."""
    fields = text.rsplit(")", 1)[1].split()  # the command name, in parentheses, may hold anything
    return fields[0], int(fields[19])  # fields 3 and 22 of proc(5)


def last_line(path: Path, offset: int = 0) -> str | None:
    """The last non-empty line written to ``path`` at or after byte ``offset``; None if there is none."""
    try:
        with open(path, "rb") as f:
            f.seek(max(offset, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            tail = f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None
    lines = [line.strip() for line in tail.splitlines() if line.strip()]  # splitlines: a progress bar's \r too
    return lines[-1] if lines else None


class ProcessId(BaseModel):
    """A process as the pid file records it: its pid cannot be reused under the same start time."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    pid: int
    start_time: int

    @classmethod
    def of(cls, pid: int) -> ProcessId | None:
        stat = _stat(pid)
        return cls(pid=pid, start_time=stat[1]) if stat else None

    def alive(self) -> bool:
        """Still this process, and not a zombie."""
        stat = _stat(self.pid)
        return stat is not None and stat[1] == self.start_time and stat[0] not in ("Z", "X")


class PidFile(BaseModel):
    """``state_dir/{name}.pids``: the supervisor and its children by replica id."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    supervisor: ProcessId
    children: dict[str, ProcessId] = {}


def read_pid_file(path: Path) -> PidFile | None:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        return PidFile.model_validate_json(text)
    except ValidationError as exc:
        said = "; ".join(": ".join(filter(None, (".".join(map(str, e["loc"])), e["msg"]))) for e in exc.errors())
        raise ValueError(f"{path} is not a supervisor's pid file: {said}") from None


def write_pid_file(path: Path, record: PidFile) -> None:
    """Atomically: a reader sees the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(record.model_dump_json(), encoding="utf-8")
    tmp.replace(path)


# -- processes and ports ------------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int] | None:
    try:
        return parse_stat(Path(f"/proc/{pid}/stat").read_text())
    except (FileNotFoundError, ProcessLookupError):
        return None


def free_port() -> int:
    """A port the OS just had free on ``HOST`` (an ephemeral one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def check_port_free(port: int) -> None:
    """``PortInUse`` if something listens on ``port`` (bound as uvicorn binds: SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            raise PortInUse(port) from None


def probe_ready(port: int) -> bool:
    """Whether ``/ready`` on ``port`` answers 200."""
    try:
        with _NO_PROXY.open(f"http://{HOST}:{port}/ready", timeout=PROBE_TIMEOUT_S) as response:
            return response.status == 200
    except (OSError, http.client.HTTPException):  # refused, timed out, 503 (HTTPError), a broken answer
        return False


def _die_with_parent(parent: int) -> Callable[[], None]:
    """The child's ``preexec_fn``: SIGTERM when the thread that forked it ends (its process dying
    included, SIGKILL too). prctl is looked up before the fork."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl: no signal will come
            os._exit(1)

    return preexec


def _spawn(argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as out:
        return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **env}, process_group=0, preexec_fn=_die_with_parent(os.getpid()))


def _exited(proc: subprocess.Popen) -> bool:
    """Whether ``proc`` exited, without reaping it: until it is reaped, its pid (and so its group's
    id) cannot be reused."""
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(proc: subprocess.Popen, deadline: float) -> int:
    """Wait until ``proc`` exits or ``deadline`` (monotonic) passes; kill its group; its exit code."""
    while not _exited(proc) and time.monotonic() < deadline:
        time.sleep(0.02)
    _kill_group(proc.pid)
    return proc.wait()


def _take_lock(path: Path, name: str, pids: Path) -> int:
    """An exclusive lock on ``path`` held until its fd closes (or this process dies)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        record = read_pid_file(pids)
        raise AlreadyRunning(name, record.supervisor.pid if record else None) from None
    return fd


# -- the supervisor -----------------------------------------------------------------------------


class Phase(str, Enum):
    STARTING = "starting"  # running, /ready not yet 200 (loading, or draining)
    READY = "ready"
    BACKING_OFF = "backing-off"  # exited; restarts after backoff_s


@dataclass(frozen=True)
class ReplicaStatus:
    id: str
    port: int
    phase: Phase
    pid: int | None
    started_at: float | None  # wall clock (time.time()) of its process's start
    restarts: int
    last_exit_code: int | None
    last_line: str | None  # the last non-empty line its log got from the run that last exited
    backoff_s: float | None  # the wait before the pending (or the last) restart

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY

    @property
    def refused(self) -> bool:
        """It last exited refusing its configuration (``last_line`` says why)."""
        return self.last_exit_code == EXIT_INVALID_CONFIG


@dataclass
class _Replica:
    id: str
    argv: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    identity: ProcessId | None = None
    log_offset: int = 0  # where the current run's output starts in the log
    started_at: float | None = None
    started_mono: float = 0.0
    ready: bool = False
    restarts: int = 0
    failures: int = 0  # exits in a row
    last_exit_code: int | None = None
    last_line: str | None = None
    backoff_s: float | None = None
    restart_at: float = 0.0  # monotonic
    stopping: bool = False

    def status(self) -> ReplicaStatus:
        phase = Phase.BACKING_OFF if self.proc is None else Phase.READY if self.ready else Phase.STARTING
        return ReplicaStatus(self.id, self.port, phase, self.proc.pid if self.proc else None, self.started_at,
                             self.restarts, self.last_exit_code, self.last_line, self.backoff_s)


class Supervisor:
    """The replica processes of deployment ``name``; state (logs, pid file, lock) in ``state_dir``.
    ``backoff``: the waits before restarts; ``poll_s``: how often each replica's exit and ``/ready``
    are checked. Taking the name reaps what a dead supervisor of it left. Use as a context manager,
    or call ``close``."""

    def __init__(self, state_dir: Path, name: str, backoff: Backoff = Backoff(), poll_s: float = 0.5):
        _check_file_name("deployment name", name)
        self.state_dir, self.name, self.backoff, self.poll_s = Path(state_dir), name, backoff, poll_s
        (self.state_dir / "logs").mkdir(parents=True, exist_ok=True)
        self._pid_path = pid_file_path(self.state_dir, name)
        self._lock_fd = _take_lock(self.state_dir / f"{name}.lock", name, self._pid_path)
        try:
            self.reap_leftovers(self.state_dir, name)
        except ValueError:  # an unreadable pid file: the name stays free
            os.close(self._lock_fd)
            raise
        me = ProcessId.of(os.getpid())
        assert me is not None  # /proc/<own pid> is there
        self._me = me
        self._replicas: dict[str, _Replica] = {}
        self._lock = threading.Lock()
        # PDEATHSIG follows the thread that forked: every child is forked by this one long-lived thread.
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix=f"supervisor-{name}-spawn")
        self._closed = threading.Event()
        self._write_pids()
        self._monitor = threading.Thread(target=self._watch, name=f"supervisor-{name}", daemon=True)
        self._monitor.start()

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log_path(self, replica_id: str) -> Path:
        return self.state_dir / "logs" / f"{self.name}-{replica_id}.log"

    def start(self, replica_id: str, argv: Sequence[str], env: Mapping[str, str], port: int) -> ReplicaStatus:
        """Spawn a replica: ``argv`` with ``env`` added to this process's environment, expected to
        serve on ``port`` (``PortInUse`` if something already listens there)."""
        _check_file_name("replica id", replica_id)
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError(f"the supervisor of {self.name!r} is closed")
            if replica_id in self._replicas:
                raise ValueError(f"replica {replica_id!r} is already started")
            check_port_free(port)
            rep = _Replica(replica_id, list(argv), dict(env), port, self.log_path(replica_id))
            self._launch(rep)
            self._replicas[replica_id] = rep
            self._write_pids()
            return rep.status()

    def replicas(self) -> list[ReplicaStatus]:
        """Every replica, in the order they were started."""
        with self._lock:
            return [rep.status() for rep in self._replicas.values()]

    def stop(self, replica_id: str, grace_seconds: float = 30.0) -> int | None:
        """SIGTERM, up to ``grace_seconds`` to exit, then SIGKILL (its group, always); its exit code
        (None if it had no process: it was backing off, or another stop has it)."""
        return self._stop([replica_id], grace_seconds).get(replica_id)

    def stop_all(self, grace_seconds: float = 30.0) -> dict[str, int]:
        """Every replica, all given the same grace; their exit codes by id."""
        with self._lock:
            ids = list(self._replicas)
        return self._stop(ids, grace_seconds)

    def close(self, grace_seconds: float = 30.0) -> None:
        """Stop every replica, then release the name (pid file removed, lock let go)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._monitor.join()
        self.stop_all(grace_seconds)
        self._spawner.shutdown()
        self._pid_path.unlink(missing_ok=True)
        os.close(self._lock_fd)

    @staticmethod
    def reap_leftovers(state_dir: Path, name: str) -> list[int]:
        """Kill (SIGKILL, by process group) the children of ``name`` a dead supervisor left, each
        only if its pid still belongs to the process recorded; the pids killed."""
        path = pid_file_path(Path(state_dir), name)
        record = read_pid_file(path)
        if record is None or record.supervisor.alive():
            return []
        killed = [child.pid for child in record.children.values() if child.alive()]
        for pid in killed:
            log.warning("killing pid %d, left behind by a supervisor of %r that is gone", pid, name)
            _kill_group(pid)  # it leads its own group
        path.unlink(missing_ok=True)
        return killed

    # -- internals: under self._lock unless said otherwise

    def _launch(self, rep: _Replica) -> None:
        rep.log_offset = rep.log_path.stat().st_size if rep.log_path.exists() else 0
        rep.proc = self._spawner.submit(_spawn, rep.argv, rep.env, rep.log_path).result()
        rep.identity = ProcessId.of(rep.proc.pid)  # its zombie at least is there: not reaped yet
        rep.started_at, rep.started_mono, rep.ready = time.time(), time.monotonic(), False

    def _watch(self) -> None:
        """The monitor thread (no lock held between replicas)."""
        while not self._closed.wait(self.poll_s):
            with self._lock:
                reps = list(self._replicas.values())
            for rep in reps:
                self._tick(rep, probe_ready(rep.port) if rep.proc else False)

    def _tick(self, rep: _Replica, ready: bool) -> None:
        with self._lock:
            if rep.stopping or self._replicas.get(rep.id) is not rep or self._closed.is_set():
                return
            if rep.proc is None:
                if time.monotonic() >= rep.restart_at:
                    self._restart(rep)
            elif _exited(rep.proc):
                code = _reap(rep.proc, deadline=0.0)
                rep.proc = rep.identity = None
                self._write_pids()
                self._back_off(rep, code, last_line(rep.log_path, rep.log_offset))
            else:
                rep.ready = ready

    def _restart(self, rep: _Replica) -> None:
        try:
            check_port_free(rep.port)
            self._launch(rep)
        except (PortInUse, OSError) as exc:  # OSError: its argv no longer runs
            rep.started_mono = time.monotonic()
            self._back_off(rep, None, str(exc))
            return
        rep.restarts += 1
        self._write_pids()

    def _back_off(self, rep: _Replica, exit_code: int | None, line: str | None) -> None:
        uptime = time.monotonic() - rep.started_mono
        rep.failures, rep.backoff_s = self.backoff.after_exit(rep.failures, uptime, exit_code)
        rep.last_exit_code, rep.last_line, rep.ready = exit_code, line, False
        rep.restart_at = time.monotonic() + rep.backoff_s
        log.warning("replica %s of %r: exit code %s (%s); restarting in %.1fs",
                    rep.id, self.name, exit_code, line or "no output", rep.backoff_s)

    def _stop(self, ids: Sequence[str], grace_seconds: float) -> dict[str, int]:
        """(Takes the lock itself.) Terminate the replicas ``ids`` together, then forget them."""
        with self._lock:
            reps = [self._replicas[i] for i in ids if not self._replicas[i].stopping]
            for rep in reps:
                rep.stopping = True
        procs = {rep.id: rep.proc for rep in reps if rep.proc is not None}
        for proc in procs.values():
            os.kill(proc.pid, signal.SIGTERM)  # not Popen.send_signal: it would reap an exited one first
        deadline = time.monotonic() + grace_seconds
        codes = {rid: _reap(proc, deadline) for rid, proc in procs.items()}
        with self._lock:
            for rep in reps:
                del self._replicas[rep.id]
            self._write_pids()
        return codes

    def _write_pids(self) -> None:
        children = {rep.id: rep.identity for rep in self._replicas.values() if rep.identity is not None}
        write_pid_file(self._pid_path, PidFile(supervisor=self._me, children=children))


def pid_file_path(state_dir: Path, name: str) -> Path:
    return state_dir / f"{name}.pids"


def _check_file_name(what: str, value: str) -> None:
    if not _FILE_NAME.fullmatch(value):
        raise ValueError(f"{what} {value!r}: letters, digits, '.', '_' and '-' only, not first")
