"""``specdecode up`` end to end: SmolLM2 replicas as real ``specdecode serve`` processes behind the
router, requests through the official ``openai`` client, and rollouts judged on the canary's real
``/metrics`` at one replica and at two: one promoted (its acceptance meets the SLO), one rolled
back (the SLO asks for more than n-gram drafting gets on this traffic) at each. Every request sent
meanwhile gets a complete answer, and stopping leaves no process behind."""
from __future__ import annotations

import io
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from local_process import free_port
from operator_harness import EXAMPLES, wait_for

from specdecode.operator.local import up
from specdecode.operator.local.backend import specdecode_command
from specdecode.operator.local.processes import pid_file_path, read_pid_file
from specdecode.operator.local.store import Store
from specdecode.operator.spec import EquivalenceState, OutputDivergence, SpecDecodeDeploymentStatus

pytestmark = pytest.mark.timeout(600)
REPO = EXAMPLES.parent
NAME = "smollm2-ngram"
# Repetitive prompts: n-gram drafting finds its drafts in them.
PROMPTS = ["def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\ndef fib_memo(n):",
           "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(10):\n",
           "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the"]


# Two short prompts, one a probe, so that a probe stays short.
PROBE = {"prompts": ["Complete the sequence: 2, 4, 8, 16,", "Tell me a story about a dragon."], "maxTokens": 10,
         "promptsPerInterval": 1}
# A revision that changes the prompt a chat request becomes: its outputs differ on any hardware (a
# bfloat16 replica differs only where a CPU's rounding flips a close call, and on some CPUs it does
# not within 10 tokens of these prompts).
FRENCH_TEMPLATE = ("<|im_start|>system\nAnswer only in French, in one word.<|im_end|>\n"
                   "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                   "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                   "{% endif %}")


def deployment(path: Path, *, tokens: int, min_acceptance: float, replicas: int = 1, method: str = "ngram",
               extra_args: tuple[str, ...] = (), probe: bool = False) -> str:
    """The example with second-scale windows: at one replica in one step, with a spare replica for
    the canary (``maxSurge: 1``); at more in the example's steps, the canary taking a stable's place
    (the default ``maxSurge: 0``). ``probe``: the equivalence probe on ``PROBE`` (else off)."""
    body = yaml.safe_load((EXAMPLES / "smollm2-ngram.yaml").read_text())
    spec = body["spec"]
    spec.update(replicas=replicas, extraArgs=list(extra_args),
                speculative={"method": method, "numSpeculativeTokens": tokens, "verify": "rejection"})
    spec["rollout"].update({"maxSurge": 1 if replicas == 1 else 0, "analysis": {
        "interval": "1s", "window": "4s", "minAcceptanceRate": min_acceptance, "failureLimit": 2,
        "inconclusiveLimit": 20, "equivalence": PROBE if probe else {"enabled": False}}})
    if replicas == 1:
        spec["rollout"]["steps"] = [{"weight": 100}]
    path.write_text(yaml.safe_dump(body))
    return str(path)


@dataclass
class Traffic:
    """Completions sent one after another through the router until stopped, counted."""

    client: openai.OpenAI
    answered: int = 0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            prompt = PROMPTS[self.answered % len(PROMPTS)]
            try:
                done = self.client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0)
                assert done.choices[0].finish_reason in ("length", "stop") and done.choices[0].text
                self.answered += 1
            except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
                self.failures.append(repr(exc))


@dataclass
class Up:
    """``up.run`` on a thread of this process, stopped as Ctrl-C stops it."""

    store: Store
    port: int
    stop: up.Stop
    thread: threading.Thread
    exit_codes: list[int]

    def shut(self) -> None:
        self.stop.event.set()
        self.thread.join(120)
        assert self.exit_codes == [0] and not self.thread.is_alive()


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Up]:
    stop, port, served, exit_codes = up.Stop(), free_port(), threading.Event(), []
    first = deployment(tmp_path / "v1.yaml", tokens=4, min_acceptance=0.05)
    log = open(tmp_path / "up.log", "w")
    thread = threading.Thread(target=lambda: exit_codes.append(up.run(
        first, root=tmp_path / "state", port=port, out=log, stop=stop, ready=lambda _: served.set())))
    thread.start()
    assert served.wait(60), (tmp_path / "up.log").read_text()
    running = Up(Store(tmp_path / "state", NAME), port, stop, thread, exit_codes)
    try:
        yield running
    finally:
        if thread.is_alive():
            running.shut()
        log.close()


def roll_out(store: Store, path: str, ended: str) -> SpecDecodeDeploymentStatus:
    """Applies ``path`` and waits for its rollout to end with the Event ``ended`` and for every
    retired replica to be gone: the status then."""
    since = len(store.events()[0])
    up.apply(path, root=store.dir.parent)
    wait_for(lambda: ended in [e["reason"] for e in store.events()[0][since:]], f"the canary {ended}", timeout=300)
    return wait_for(lambda: (s := store.status()).ready_replicas == s.replicas and not s.rollout.retiring and s,
                    "every replica of the stable ready, nothing retiring", timeout=180)


def poor_rolled_back(store: Store, tmp_path: Path, *, tokens: int, replicas: int, stable: str) -> tuple[str, bool]:
    """A canary whose SLO asks for more acceptance than n-gram drafting gets: rolled back, the
    stable kept at ``replicas``; the RolledBack condition's reason, and whether it names the SLO."""
    status = roll_out(store, deployment(tmp_path / f"poor{replicas}.yaml", tokens=tokens, min_acceptance=0.99,
                                        replicas=replicas), "RolledBack")
    assert status.stable_revision == stable and status.rollout.stable_replicas == replicas
    why = next(c for c in status.conditions if c.type.value == "RolledBack")
    return why.reason, "minAcceptanceRate 0.99" in why.message


def test_up_promotes_a_good_canary_and_rolls_back_a_poor_one_losing_no_request(running: Up, tmp_path: Path) -> None:
    """At ``replicas: 1`` (``maxSurge: 1``) then at ``replicas: 2`` (``maxSurge: 0``): a canary whose
    acceptance meets the SLO is promoted, one whose SLO asks for more than n-gram drafting gets is
    rolled back, while requests flow through the router the whole time. At one replica the first
    canary is n-gram → suffix, whose greedy outputs the equivalence probe finds equal to the
    stable's (its control agreeing on CPU), and a replica serving another chat template is rolled back
    on its outputs."""
    store = running.store
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{running.port}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    wait_for(lambda: store.status().ready_replicas == 1, "the stable replica ready", timeout=180)
    second = io.StringIO()
    assert up.run(str(tmp_path / "v1.yaml"), root=store.dir.parent, port=free_port(), out=second,
                  stop=up.Stop()) == up.EXIT_REFUSED
    assert second.getvalue().startswith(f"specdecode up: a supervisor of '{NAME}' is already running (pid ")
    traffic = Traffic(client)
    sender = threading.Thread(target=traffic.run)
    sender.start()
    outcomes = []
    try:
        suffix = roll_out(store, deployment(tmp_path / "suffix.yaml", tokens=4, min_acceptance=0.01, method="suffix",
                                            probe=True), "Promoted")
        probed = suffix.equivalence
        assert probed.revision == suffix.stable_revision and probed.state is EquivalenceState.PROBING
        assert probed.prompts_same + probed.near_ties >= 1 and "differed" not in probed.message
        assert "EquivalenceInconclusive" not in [e["reason"] for e in store.events()[0]]  # the control agreed

        (tmp_path / "french.jinja").write_text(FRENCH_TEMPLATE)
        french = roll_out(store, deployment(tmp_path / "french.yaml", tokens=4, min_acceptance=0.01, method="suffix",
                                            extra_args=("--chat-template", str(tmp_path / "french.jinja")), probe=True),
                          "RolledBack")
        why = next(c for c in french.conditions if c.type.value == "RolledBack")
        assert why.reason == "OutputDiverged" and french.equivalence.state is EquivalenceState.DIVERGED
        assert french.equivalence.last_divergence.prompt in PROBE["prompts"]
        assert french.stable_revision == suffix.stable_revision

        outcomes.append(poor_rolled_back(store, tmp_path, tokens=2, replicas=1, stable=suffix.stable_revision))
        two = roll_out(store, deployment(tmp_path / "two.yaml", tokens=5, min_acceptance=0.01, replicas=2), "Promoted")
        assert two.stable_revision != suffix.stable_revision and two.replicas == two.rollout.stable_replicas == 2
        assert two.acceptance.rate > 0.01
        outcomes.append(poor_rolled_back(store, tmp_path, tokens=6, replicas=2, stable=two.stable_revision))
    finally:
        traffic.stop.set()
        sender.join(120)
    assert outcomes == [("AnalysisFailed", True)] * 2
    assert traffic.failures == [] and traffic.answered > 20

    children = read_pid_file(pid_file_path(store.dir, NAME)).children
    assert children
    running.shut()  # as Ctrl-C: every replica drained and stopped
    assert not any(child.alive() for child in children.values())
    logs = [path.read_text() for path in (store.dir / "logs").iterdir()]
    assert logs and all("drained: shutting down" in log for log in logs)


# -- bad input: one line each, nothing left running ----------------------------------------------


def test_an_invalid_file_is_refused_with_admissions_message_and_starts_nothing(tmp_path: Path) -> None:
    body = yaml.safe_load((EXAMPLES / "smollm2-ngram.yaml").read_text())
    body["spec"]["speculative"]["numSpeculativeTokens"] = 0
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(body))
    out = io.StringIO()
    assert up.run(str(tmp_path / "bad.yaml"), root=tmp_path / "state", port=free_port(), out=out,
                  stop=up.Stop()) == up.EXIT_REFUSED
    assert out.getvalue().startswith("specdecode up: denied: ") and "numSpeculativeTokens" in out.getvalue()
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("field, value, why", [
    ("model", {"uri": "pvc://models/smollm2"}, "spec.model.uri: pvc://models/smollm2"),
    ("parallelism", {"pipeline": 2}, "spec.parallelism: TP1×PP2 spans pods"),
    ("image", "ghcr.io/other/runtime:1", "spec.image: ghcr.io/other/runtime:1"),
    ("speculative", {"method": "mtp", "numSpeculativeTokens": 1, "mtpPath": "pvc://heads/smollm2"},
     "spec.speculative.mtpPath: pvc://heads/smollm2"),
    ("speculative", {"method": "eagle3", "numSpeculativeTokens": 1, "eagle3Path": "hf://org/head"},
     "spec.speculative.eagle3Path: hf://org/head"),
])
def test_what_this_machine_cannot_run_is_refused_naming_the_field(tmp_path: Path, field: str, value: Any,
                                                                   why: str) -> None:
    body = yaml.safe_load((EXAMPLES / "smollm2-ngram.yaml").read_text())
    body["spec"][field] = value
    (tmp_path / "there.yaml").write_text(yaml.safe_dump(body))
    with pytest.raises(up.Refused, match="cannot run here: .*" + re.escape(why)):
        up.admitted(str(tmp_path / "there.yaml"))


def test_a_taken_port_and_a_model_that_does_not_load_are_one_line_errors(tmp_path: Path) -> None:
    good = deployment(tmp_path / "good.yaml", tokens=4, min_acceptance=0.05)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        out = io.StringIO()
        assert up.run(good, root=tmp_path / "state", port=taken.getsockname()[1], out=out,
                      stop=up.Stop()) == up.EXIT_REFUSED
        assert out.getvalue() == f"specdecode up: port {taken.getsockname()[1]} is in use (--port chooses another)\n"

    body = yaml.safe_load(Path(good).read_text())
    body["spec"]["model"]["uri"] = f"file://{tmp_path}/no-such-model"
    (tmp_path / "missing.yaml").write_text(yaml.safe_dump(body))
    out = io.StringIO()
    assert up.run(str(tmp_path / "missing.yaml"), root=tmp_path / "state", port=free_port(), out=out,
                  stop=up.Stop()) == up.EXIT_REFUSED
    last = out.getvalue().strip().splitlines()[-1]
    assert last.startswith("specdecode up: smollm2-ngram: its replicas refuse to start: ") and "no-such-model" in last
    assert running_with(str(tmp_path)) == []


def running_with(text: str) -> list[int]:
    """Processes whose command line mentions ``text``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().decode(errors="replace"):
                found.append(int(cmdline.parent.name))
        except OSError:  # gone meanwhile
            continue
    return found


def test_the_readmes_first_command_detached_serves_and_down_stops_it(tmp_path: Path) -> None:
    """What `make up` runs (read from `make -n`), detached: the example's two replicas serve a
    completion through the router while `--traffic` replays the built-in prompts; a replica killed is
    restarted and reported (a Warning Event); `specdecode down` leaves nothing running."""
    port, state = free_port(), tmp_path / "state"
    up_args = f"--detach --port {port} --state-dir {state} --traffic builtin --rate 1"
    printed = subprocess.run(["make", "--no-print-directory", "-n", "up", f"UP_ARGS={up_args}"],
                             cwd=REPO, capture_output=True, text=True, check=True).stdout
    command = shlex.split(printed.strip().splitlines()[-1])  # --no-print-directory: under `make test` too
    assert command[:3] == [".venv/bin/specdecode", "up", "examples/smollm2-ngram.yaml"]
    started = subprocess.run([*specdecode_command(), *command[1:]], cwd=REPO,
                             capture_output=True, text=True, timeout=300)
    assert started.returncode == 0, started.stderr
    try:
        store = Store(state, NAME)
        wait_for(lambda: store.status().ready_replicas == 2, "both replicas ready", timeout=240)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
        answer = client.chat.completions.create(model=NAME, max_tokens=16,
                                                messages=[{"role": "user", "content": "Say hello."}])
        assert answer.choices[0].message.content
        killed = next(iter(read_pid_file(pid_file_path(store.dir, NAME)).children.values()))
        os.kill(killed.pid, signal.SIGKILL)
        restarted = wait_for(lambda: next((e for e in store.events()[0] if e["reason"] == "ReplicaRestarted"), None),
                             "the killed replica restarted and reported", timeout=60)
        assert restarted["type"] == "Warning" and "exited with code -9" in restarted["message"]
        wait_for(lambda: store.status().ready_replicas == 2, "both replicas ready again", timeout=240)
    finally:
        stopped = subprocess.run([*specdecode_command(), "down", "--state-dir", str(state)],
                                 capture_output=True, text=True, timeout=300)
    assert stopped.stdout.strip() == f"{NAME}: stopped", stopped.stderr
    assert running_with(str(state)) == []
    replayed = re.findall(r"traffic: .*\| answered (\d+) \|", (state / f"up-{port}.log").read_text())
    assert replayed and int(replayed[-1]) > 0  # --traffic: the built-in prompts replayed at the router


def test_commands_on_a_deployment_up_never_ran_say_so_and_create_nothing(tmp_path: Path) -> None:
    root = tmp_path / "state"
    for run in (lambda: up.command(NAME, up.Command.ABORT, root=root), lambda: up.down(NAME, root=root),
                lambda: up.show_status(NAME, root=root),
                lambda: up.apply(deployment(tmp_path / "v.yaml", tokens=4, min_acceptance=0.05), root=root)):
        with pytest.raises(FileNotFoundError, match=f"{NAME}: no such deployment"):
            run()
    assert not root.exists()


def test_status_shows_a_row_per_revision_and_the_equivalence_probe(tmp_path: Path) -> None:
    store = Store(tmp_path, NAME)
    store.apply(yaml.safe_load((EXAMPLES / "smollm2-ngram.yaml").read_text()))
    near_tie = OutputDivergence(prompt="Write a limerick about a cat.", position=4, stable_token=" tail",
                                other_token=" heart", logprob_gap=0.057)
    store.write_status(SpecDecodeDeploymentStatus.model_validate({
        "stableRevision": "5e75eae315", "canaryRevision": "37aeb63f0f", "canaryStep": 0, "replicas": 2,
        "readyReplicas": 2, "rollout": {"phase": "Progressing", "stableReplicas": 1, "canaryReplicas": 1,
                                        "canaryWeight": 50, "message": "Pass: acceptance rate 0.587"},
        "equivalence": {"revision": "37aeb63f0f", "state": "Probing", "promptsSame": 7, "nearTies": 1,
                        "lastDivergence": near_tie.model_dump(by_alias=True), "message": "4 of 4 prompts gave the "
                        "stable's tokens"}}))
    lines = up.show_status(NAME, root=tmp_path).splitlines()
    assert lines[0].split() == ["REVISION", "ROLE", "REPLICAS", "ACCEPT", "MEAN-LEN", "P95-ITL", "REQ/S", "PHASE",
                                "STEP", "WEIGHT"]
    assert lines[1].split() == ["5e75eae315", "stable", "1", "-", "-", "-", "-", "Progressing", "1", "-"]
    assert lines[2].split() == ["37aeb63f0f", "canary", "1", "-", "-", "-", "-", "Progressing", "1", "50"]
    assert lines[3:] == ["ready 2 of 2 replicas; Pass: acceptance rate 0.587",
                         "equivalence of 37aeb63f0f: Probing, 7 prompts same, 1 near-ties; 4 of 4 prompts gave the "
                         "stable's tokens",
                         "last difference: prompt 'Write a limerick about a cat.', token 4: stable ' tail', other ' heart'"]
    shown = json.loads(up.show_status(NAME, root=tmp_path, output="json"))
    assert shown["status"]["equivalence"]["lastDivergence"]["logprobGap"] == 0.057
