"""The README's "Canary rollouts" walkthrough, run end to end ``--runs`` times with the commands a
user types: ``specdecode up`` (detached) on examples/smollm2-ngram.yaml; ``specdecode traffic``
with chat prompts (builtin); ``specdecode apply examples/smollm2-suffix.yaml`` → rolled back; the
traffic switched to a coding agent's file rewrites (examples/traffic/agent-edits.jsonl) and, once
the rolled-back replica is gone, ``specdecode retry`` → promoted; ``specdecode down``. Prints a table of each run's outcomes, writes them as JSON.

    .venv/bin/python scripts/rollout_examples.py --runs 3 --out rollout-examples.json

Each run takes a fresh state directory and port; a run that reaches neither outcome within
``--timeout`` seconds is recorded as ``timeout``. Nothing here decides an outcome: the rollout
does, from the canary's measured acceptance rate.
"""
from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from specdecode.operator.local.store import Store

REPO = Path(__file__).resolve().parent.parent
SPECDECODE = str(REPO / ".venv" / "bin" / "specdecode")
NAME = "smollm2-ngram"
BASE, CHANGE = "examples/smollm2-ngram.yaml", "examples/smollm2-suffix.yaml"
CHAT, AGENT = "builtin", "examples/traffic/agent-edits.jsonl"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args: str, state: Path) -> str:
    return subprocess.run([SPECDECODE, *args, "--state-dir", str(state)], cwd=REPO, check=True,
                          capture_output=True, text=True, timeout=300).stdout


def status(state: Path) -> dict[str, Any]:
    return json.loads(cli("status", NAME, "-o", "json", state=state))


def start_traffic(port: int, prompts: str) -> subprocess.Popen:
    return subprocess.Popen([SPECDECODE, "traffic", f"http://127.0.0.1:{port}/v1", prompts, "--rate", "1",
                             "--report-every", "0", "-o", "json"], cwd=REPO, stdout=subprocess.PIPE, text=True)


def stop_traffic(replay: subprocess.Popen) -> dict[str, Any]:
    replay.send_signal(signal.SIGTERM)
    out, _ = replay.communicate(timeout=120)
    return json.loads(out)


def outcome(state: Path, since: int, timeout: float) -> dict[str, Any]:
    """Waits for the rollout begun after byte ``since`` of the event log to end: Promoted or RolledBack."""
    deadline, canary = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        seen = status(state)
        canary = next((row for row in seen["rows"] if row["role"] == "canary" and row["acceptanceRate"] is not None),
                      canary)
        events = Store(state, NAME).events(since)[0]
        ended = next((e for e in events if e["reason"] in ("Promoted", "RolledBack")), None)
        if ended is not None:
            return {"outcome": ended["reason"], "message": ended["message"], "acceptanceRate": canary.get("acceptanceRate"),
                    "meanAcceptanceLength": canary.get("meanAcceptanceLength")}
        time.sleep(2)
    return {"outcome": "timeout", "message": "", "acceptanceRate": canary.get("acceptanceRate"),
            "meanAcceptanceLength": canary.get("meanAcceptanceLength")}


def log_end(state: Path) -> int:
    """Where the event log ends now (``Store.events``' offset)."""
    return Store(state, NAME).events()[1]


def one_run(timeout: float) -> dict[str, Any]:
    state, port = Path(tempfile.mkdtemp(prefix="rollout-examples-")), free_port()
    started = time.monotonic()
    cli("up", BASE, "--detach", "--port", str(port), state=state)
    run: dict[str, Any] = {"stateDir": str(state)}
    try:
        while status(state)["readyReplicas"] < 2:
            time.sleep(2)
        replay = start_traffic(port, CHAT)
        since = log_end(state)
        cli("apply", CHANGE, state=state)
        run["chat"] = outcome(state, since, timeout)
        run["chat"]["traffic"] = stop_traffic(replay)
        replay = start_traffic(port, AGENT)
        while any(row["role"] == "retiring" for row in status(state)["rows"]):  # the rolled-back replica still drains
            time.sleep(2)
        since = log_end(state)
        cli("retry", NAME, state=state)
        run["agent"] = outcome(state, since, timeout)
        run["agent"]["traffic"] = stop_traffic(replay)
    finally:
        cli("down", NAME, state=state)
    run["seconds"] = round(time.monotonic() - started)
    return run


def table(runs: list[dict[str, Any]]) -> str:
    def part(p: dict[str, Any]) -> str:
        t = p["traffic"]
        rate = "-" if p["acceptanceRate"] is None else f"{p['acceptanceRate']:.2f}"
        return f"{p['outcome']:10} {rate:>6} {t['answered']:>4} {sum(t['errors'].values()):>4}"

    head = f"{'RUN':3} {'CHAT: OUTCOME':10} {'ACCEPT':>6} {'OK':>4} {'ERR':>4}   {'AGENT: OUTCOME':10} {'ACCEPT':>6} {'OK':>4} {'ERR':>4}  SECONDS"
    return "\n".join([head] + [f"{i + 1:<3} {part(r['chat'])}   {part(r['agent'])}  {r['seconds']}" for i, r in enumerate(runs)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds each rollout may take")
    parser.add_argument("--out", default="rollout-examples.json")
    args = parser.parse_args()
    runs = []
    for _ in range(args.runs):
        runs.append(one_run(args.timeout))
        print(table(runs).splitlines()[-1], flush=True)
    print(table(runs))
    Path(args.out).write_text(json.dumps({"base": BASE, "change": CHANGE, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
