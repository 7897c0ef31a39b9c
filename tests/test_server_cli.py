"""The ``specdecode`` CLI: flags → config, ``--help`` without torch, ``generate``, and ``serve`` as a
real subprocess drained by SIGTERM without losing the request in flight."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
from local_process import free_port, wait_ready

from specdecode.runtime.cli import main
from specdecode.runtime.serve_flags import engine_config, serve_parser
from specdecode.runtime.server.serve import refusal_line

TIMEOUT = httpx.Timeout(120.0, connect=10.0)


def test_serve_flags_build_the_configs():
    args = serve_parser().parse_args([
        "--model", "/m", "--host", "0.0.0.0", "--port", "9000", "--served-model-name", "mine",
        "--max-model-len", "1024", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
        "--kv-cache-blocks", "100", "--block-size", "32", "--no-prefix-caching", "--max-waiting-requests", "3",
        "--api-key", "k", "--chat-template", "/t.jinja", "--device", "cpu", "--dtype", "bfloat16",
        "--no-weight-cache", "--load-format", "dummy",
    ])
    cfg = engine_config(args)
    assert (cfg.load.model, cfg.load.device.value, cfg.load.dtype.value) == ("/m", "cpu", "bfloat16")
    assert cfg.load.load_format.value == "dummy"
    assert cfg.load.weight_cache_dir is None and cfg.load.chat_template == "/t.jinja"
    assert (cfg.cache.num_blocks, cfg.cache.block_size, cfg.cache.enable_prefix_caching) == (100, 32, False)
    s = cfg.scheduler
    assert (s.max_model_len, s.max_num_seqs, s.max_num_batched_tokens, s.max_waiting_requests) == (1024, 4, 256, 3)
    assert (args.host, args.port, args.served_model_name, args.api_key) == ("0.0.0.0", 9000, "mine", "k")

    defaults = engine_config(serve_parser().parse_args(["--kv-cache-memory-gib", "0.5"]))
    assert defaults.load.model == "smollm2-135m" and defaults.cache.memory_gib == 0.5
    assert defaults.cache.enable_prefix_caching and defaults.load.weight_cache_dir is not None


def test_help_needs_no_torch(tmp_path):
    blocker = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "fastapi", "uvicorn", "transformers"):
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        from specdecode.runtime.cli import main
        main(sys.argv[1:])
    """)
    for argv in (["--help"], ["serve", "--help"], ["generate", "--help"]):
        r = subprocess.run([sys.executable, "-P", "-c", blocker, *argv], capture_output=True, text=True,
                           timeout=60, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert "usage: specdecode" in r.stdout


def test_generate_prints_the_completion(tiny_hf_model_dir, capsys):
    argv = ["generate", "--model", str(tiny_hf_model_dir), "--no-weight-cache", "--prompt", "hello", "--chat",
            "--max-tokens", "5"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0
    assert capsys.readouterr().out == first  # greedy by default


def test_sigterm_drains_the_request_in_flight_then_exits_0(tiny_hf_model_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-P", "-m", "specdecode.runtime.cli", "serve", "--model", str(tiny_hf_model_dir),
           "--no-weight-cache", "--port", str(port), "--kv-cache-blocks", "64", "--log-level", "info"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
                                env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    try:
        wait_ready(proc, url, log)
        body = {"prompt": "hello", "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while httpx.get(url + "/ready", timeout=5).status_code != 503:
                assert time.monotonic() < deadline, "/ready did not turn 503 after SIGTERM"
                time.sleep(0.01)
            refused = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=TIMEOUT)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "overloaded"
            rest = [line[len("data: "):] for line in lines if line.startswith("data: ")]
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert rest[-1] == "[DONE]"
    usage = json.loads(rest[-2])["usage"]
    assert usage["completion_tokens"] == 300
    chunks = [json.loads(first[len("data: "):])] + [json.loads(x) for x in rest[:-2]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "drained" in log.read_text()


@pytest.mark.parametrize(("argv", "said"), [
    (["serve", "--port", "70000"], "port: Input should be less than or equal to 65535"),
    (["serve", "--block-size", "0"], "block_size: Input should be greater than or equal to 1"),
    (["serve", "--speculative-config", '{"method":"draft"}'], "method 'draft' needs draft_model"),
])
def test_invalid_serve_flags_exit_2_with_one_line_also_in_the_termination_message(argv, said, tmp_path, capsys):
    message = tmp_path / "termination-log"
    assert main([*argv, "--termination-message-path", str(message)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("specdecode serve: invalid configuration: ") and said in line
    assert message.read_text() == line + "\n"


def test_a_model_that_cannot_be_served_is_refused_in_one_line_and_in_the_termination_message(tmp_path):
    """What the operator reads into the SpecDecodeDeployment's status (Degraded, RuntimeRefused)."""
    message = tmp_path / "termination-log"
    cmd = [sys.executable, "-P", "-m", "specdecode.runtime.cli", "serve", "--model", str(tmp_path / "nonexistent"),
           "--termination-message-path", str(message)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()  # no traceback
    assert line.startswith("specdecode serve: cannot start: model ") and "nonexistent" in line
    assert message.read_text() == line + "\n"


def test_a_refusal_is_written_only_where_a_folder_exists(tmp_path, capsys):
    missing = tmp_path / "no-such-folder" / "termination-log"
    assert main(["serve", "--model", str(tmp_path / "nonexistent"), "--termination-message-path", str(missing)]) == 1
    assert "cannot start" in capsys.readouterr().err and not missing.parent.exists()
    assert refusal_line(KeyError("model.norm.weight")) == "specdecode serve: cannot start: KeyError: 'model.norm.weight'"
    assert refusal_line(ValueError("no MTP layers\n in config.json")) == (
        "specdecode serve: cannot start: no MTP layers in config.json")
