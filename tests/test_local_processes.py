"""The local process supervisor (``specdecode up``'s replicas): a stand-in replica (a small
http.server script) for start, readiness, stop, crashes, refusals, leftovers and the name lock; the
real runtime once, for its /ready and its SIGTERM drain. Every wait is bounded."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from local_process import running

from specdecode.operator.local.processes import (
    EXIT_INVALID_CONFIG,
    AlreadyRunning,
    Backoff,
    Phase,
    PidFile,
    PortInUse,
    ProcessId,
    ReplicaStatus,
    Supervisor,
    free_port,
    last_line,
    parse_stat,
    pid_file_path,
    read_pid_file,
    write_pid_file,
)

REFUSAL = "specdecode serve: invalid configuration: block_size: Input should be greater than or equal to 1"
# A replica stand-in: /ready (200 after FAKE_READY_AFTER s) and /health; SIGTERM: stop serving, exit 0.
# FAKE_CRASH_AFTER: exit 3 after that long; FAKE_REFUSE: exit 2 at once with a one-line refusal;
# FAKE_IGNORE_TERM: SIGTERM does nothing; FAKE_CHILD: spawn a sleeper (in its group), its pid in that file.
REPLICA = textwrap.dedent(f"""
    import os, signal, subprocess, sys, threading, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    env = os.environ
    if env.get("FAKE_REFUSE"):
        print("loading", flush=True)
        print({REFUSAL!r}, file=sys.stderr)
        sys.exit(2)
    start, draining = time.monotonic(), threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            ready = time.monotonic() - start >= float(env.get("FAKE_READY_AFTER", "0")) and not draining.is_set()
            self.send_response(200 if self.path == "/health" or (self.path == "/ready" and ready) else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    def crash():
        time.sleep(float(env["FAKE_CRASH_AFTER"]))
        print("crash: boom", file=sys.stderr, flush=True)
        os._exit(3)

    def drain(signum, frame):
        draining.set()
        threading.Thread(target=server.shutdown).start()

    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Handler)
    signal.signal(signal.SIGTERM, signal.SIG_IGN if env.get("FAKE_IGNORE_TERM") else drain)
    if "FAKE_CRASH_AFTER" in env:
        threading.Thread(target=crash, daemon=True).start()
    if "FAKE_CHILD" in env:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open(env["FAKE_CHILD"], "w").write(str(child.pid))
    server.serve_forever(poll_interval=0.05)
    print("drained", file=sys.stderr)
""")
FAST = Backoff(first_s=0.05, cap_s=60.0, reset_after_s=60.0)


@pytest.fixture
def replica(tmp_path) -> Callable[[int], list[str]]:
    script = tmp_path / "replica.py"
    script.write_text(REPLICA)
    return lambda port: [sys.executable, str(script), "--port", str(port)]


@pytest.fixture
def supervisor(tmp_path) -> Iterator[Supervisor]:
    with Supervisor(tmp_path / "state", "dep", backoff=FAST, poll_s=0.05) as sup:
        yield sup


def wait_for(sup: Supervisor, replica_id: str, condition: Callable[[ReplicaStatus], bool],
             timeout: float = 30.0) -> ReplicaStatus:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        (status,) = [r for r in sup.replicas() if r.id == replica_id]
        if condition(status):
            return status
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s; last status {status}, log:\n"
                         f"{sup.log_path(replica_id).read_text()[-2000:]}")


def wait_gone(pid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while running(pid):
        assert time.monotonic() < deadline, f"pid {pid} still running after {timeout}s"
        time.sleep(0.02)


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], process_group=0)


# -- pure parts ---------------------------------------------------------------------------------


def test_backoff_doubles_to_the_cap_and_starts_again_after_a_long_run():
    policy = Backoff()
    assert [policy.delay(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 30, 30, 30]
    assert policy.delay(10_000) == 30
    assert policy.after_exit(failures=0, uptime_s=0.5, exit_code=1) == (1, 1)
    assert policy.after_exit(failures=3, uptime_s=59.0, exit_code=-9) == (4, 8)
    assert policy.after_exit(failures=7, uptime_s=60.0, exit_code=1) == (1, 1)  # it stayed up: reset


def test_a_refusal_waits_the_cap_from_the_first_exit():
    policy = Backoff()
    assert policy.after_exit(failures=0, uptime_s=0.1, exit_code=EXIT_INVALID_CONFIG) == (1, 30)
    assert policy.after_exit(failures=0, uptime_s=600, exit_code=EXIT_INVALID_CONFIG) == (1, 30)


def test_parse_stat_reads_state_and_start_time_past_any_command_name():
    fields = " ".join(["S", *map(str, range(4, 22)), "987654", "0"])  # field 22 = start time
    assert parse_stat(f"42 (a) b (c) {fields}") == ("S", 987654)
    state, start = parse_stat(Path("/proc/self/stat").read_text())
    assert state == "R" and start > 0


def test_last_line_is_the_last_non_empty_line_after_the_offset(tmp_path):
    log = tmp_path / "r.log"
    assert last_line(log) is None
    log.write_bytes(b"first run\r\nits last line\n\nloading 10%\rloading 100%\r\n  \n")
    assert last_line(log) == "loading 100%"
    offset = log.stat().st_size
    assert last_line(log, offset) is None  # the new run wrote nothing yet
    with open(log, "ab") as f:
        f.write(b"specdecode serve: cannot start: \xff model")
    assert last_line(log, offset) == "specdecode serve: cannot start: \ufffd model"
    log.write_text("x" * 20_000 + "\nthe end\n")
    assert last_line(log) == "the end"


def test_pid_file_round_trips_and_refuses_what_it_does_not_know(tmp_path):
    path = tmp_path / "dep.pids"
    assert read_pid_file(path) is None
    record = PidFile(supervisor=ProcessId(pid=10, start_time=5), children={"r0": ProcessId(pid=11, start_time=6)})
    write_pid_file(path, record)
    assert read_pid_file(path) == record and list(tmp_path.iterdir()) == [path]
    path.write_text('{"supervisor": {"pid": 10, "start_time": 5}, "kids": {}}')
    with pytest.raises(ValueError, match="dep.pids is not a supervisor's pid file.*kids"):
        read_pid_file(path)
    with pytest.raises(ValueError, match="dep.pids is not"):
        Supervisor(tmp_path, "dep")
    Supervisor(tmp_path, "dep2").close()  # the refused one did not keep a lock
    path.unlink()
    Supervisor(tmp_path, "dep").close()


# -- the supervisor, with the stand-in replica ---------------------------------------------------


def test_start_then_ready_and_stop_drains_with_sigterm(supervisor, replica):
    port = free_port()
    started = supervisor.start("r0", replica(port), {"FAKE_READY_AFTER": "0.3"}, port)
    assert started.phase is Phase.STARTING and started.pid and started.started_at and started.restarts == 0
    ready = wait_for(supervisor, "r0", lambda r: r.ready)
    assert (ready.pid, ready.port, ready.last_exit_code) == (started.pid, port, None)
    assert supervisor.stop("r0", grace_seconds=30) == 0  # the SIGTERM handler finished: exit 0
    assert supervisor.replicas() == [] and not running(started.pid)
    assert last_line(supervisor.log_path("r0")) == "drained"
    assert read_pid_file(pid_file_path(supervisor.state_dir, "dep")).children == {}


def test_stop_all_kills_a_replica_that_ignores_sigterm_and_what_a_replica_left(supervisor, replica, tmp_path):
    ports, child_pid = [free_port(), free_port()], tmp_path / "child.pid"
    supervisor.start("r0", replica(ports[0]), {"FAKE_IGNORE_TERM": "1"}, ports[0])
    supervisor.start("r1", replica(ports[1]), {"FAKE_CHILD": str(child_pid)}, ports[1])
    for replica_id in ("r0", "r1"):
        wait_for(supervisor, replica_id, lambda r: r.ready)
    assert supervisor.stop_all(grace_seconds=0.3) == {"r0": -signal.SIGKILL, "r1": 0}
    wait_gone(int(child_pid.read_text()))  # r1 exited 0 leaving its child: its group was killed


def test_a_replica_outlives_the_thread_that_started_it(supervisor, replica):
    """PDEATHSIG fires when the forking thread ends: the supervisor forks from a thread of its own."""
    port = free_port()
    starter = threading.Thread(target=supervisor.start, args=("r0", replica(port), {}, port))
    starter.start()
    starter.join()
    status = wait_for(supervisor, "r0", lambda r: r.ready)
    assert (status.restarts, status.last_exit_code) == (0, None)


def test_a_crashing_replica_is_restarted_with_backoff_and_its_exits_recorded(supervisor, replica):
    port = free_port()
    first = supervisor.start("r0", replica(port), {"FAKE_CRASH_AFTER": "0.1"}, port)
    status = wait_for(supervisor, "r0", lambda r: r.restarts >= 2 and r.phase is Phase.BACKING_OFF)
    assert (status.last_exit_code, status.last_line, status.pid) == (3, "crash: boom", None)
    # exits in a row = restarts + 1: each run was short, so the wait doubled each time
    assert status.backoff_s == FAST.delay(status.restarts + 1) and not status.refused
    rerun = wait_for(supervisor, "r0", lambda r: r.pid is not None)
    assert rerun.pid != first.pid and rerun.started_at > first.started_at


def test_a_refusing_replica_waits_the_cap_before_trying_again(supervisor, replica):
    port = free_port()
    supervisor.start("r0", replica(port), {"FAKE_REFUSE": "1"}, port)
    status = wait_for(supervisor, "r0", lambda r: r.phase is Phase.BACKING_OFF)
    assert status.refused and status.last_exit_code == EXIT_INVALID_CONFIG and status.last_line == REFUSAL
    assert status.backoff_s == FAST.cap_s and status.restarts == 0  # not 0.05 s: no tight loop
    assert supervisor.stop("r0") is None  # nothing was running


def test_a_port_in_use_is_refused_by_name(supervisor, replica):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUse, match=f"port {port} is in use"):
            supervisor.start("r0", replica(port), {}, port)
    assert supervisor.replicas() == []


def test_a_second_supervisor_of_the_same_name_is_refused_naming_the_first(tmp_path):
    state = tmp_path / "state"
    with Supervisor(state, "dep"):
        with pytest.raises(AlreadyRunning, match=f"'dep' is already running \\(pid {os.getpid()}\\)"):
            Supervisor(state, "dep")
        Supervisor(state, "other").close()  # another name is free
    Supervisor(state, "dep").close()  # the name is free again


def test_stale_pid_file_children_are_reaped_but_a_reused_pid_is_not(tmp_path):
    victim, bystander = sleeper(), sleeper()
    try:
        me = ProcessId.of(os.getpid())
        gone = ProcessId(pid=me.pid, start_time=me.start_time - 1)  # our pid, another start: a reused pid
        reused = ProcessId(pid=bystander.pid, start_time=ProcessId.of(bystander.pid).start_time - 1)
        path = pid_file_path(tmp_path, "dep")
        write_pid_file(path, PidFile(supervisor=gone, children={"r0": ProcessId.of(victim.pid), "r1": reused}))
        assert Supervisor.reap_leftovers(tmp_path, "dep") == [victim.pid]
        assert victim.wait(timeout=30) == -signal.SIGKILL and bystander.poll() is None
        assert not path.exists()
    finally:
        for proc in (victim, bystander):
            proc.kill()
            proc.wait(timeout=30)


def test_a_pid_file_of_a_live_supervisor_is_left_alone(supervisor, replica):
    port = free_port()
    pid = supervisor.start("r0", replica(port), {}, port).pid
    assert Supervisor.reap_leftovers(supervisor.state_dir, "dep") == [] and running(pid)
    children = read_pid_file(pid_file_path(supervisor.state_dir, "dep")).children
    assert children == {"r0": ProcessId.of(pid)}


def test_children_die_with_a_supervisor_killed_by_sigkill(tmp_path, replica):
    """PDEATHSIG: the replicas get SIGTERM when their supervisor dies, even by SIGKILL."""
    state, ports = tmp_path / "state", [free_port(), free_port()]
    script = textwrap.dedent(f"""
        import json, sys, time
        from specdecode.operator.local.processes import Supervisor
        sup = Supervisor({str(state)!r}, "dep", poll_s=0.05)
        for i, (port, argv) in enumerate({[(p, replica(p)) for p in ports]!r}):
            sup.start(f"r{{i}}", argv, {{}}, port)
        deadline = time.monotonic() + 30
        while not all(r.ready for r in sup.replicas()):
            assert time.monotonic() < deadline, sup.replicas()
            time.sleep(0.02)
        print(json.dumps([r.pid for r in sup.replicas()]), flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-P", "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(proc.stdout.readline() or "null")
        assert pids and all(map(running, pids))
    finally:
        proc.kill()
        proc.wait(timeout=30)
    for pid in pids:
        wait_gone(pid)
    assert Supervisor.reap_leftovers(state, "dep") == []  # nothing left to kill, the stale file goes
    assert not pid_file_path(state, "dep").exists()

