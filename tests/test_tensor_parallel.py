"""Tensor parallelism: greedy output equal to TP=1 (tiny llama at TP=2, SmolLM2 at TP=3, with and
without n-gram speculation, with MTP and EAGLE-3 heads on rank 0), config and flag validation, the
operator's rendered arguments parsed by the runtime's own parser, and ``serve
--tensor-parallel-size 2`` as a real process tree.

Every multi-process run is a subprocess in its own session with a hard deadline: on any failure
the whole process group (rank 0 and the workers it spawned) is killed.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
from local_process import (
    descendants, free_port, is_worker, kill_group, run_group, running, start_serve, wait_ready,
)
import torch
from pydantic import ValidationError

from specdecode.operator.render import render
from specdecode.operator.resolve import resolve
from specdecode.runtime.cli import build_parser
from specdecode.runtime.config import CacheConfig, EngineConfig, LoadConfig, ParallelConfig, SpeculativeConfig
from specdecode.runtime.engine.model_runner import ModelRunner, Span, build_attention_batch
from specdecode.runtime.engine.sequence import SamplingParams
from specdecode.runtime.models.loader import load_model
from specdecode.runtime.models.tensor_parallel import TensorParallel
from specdecode.runtime.parallel.group import _wait_for_every_rank, connect_store, host_store
from specdecode.runtime.parallel.heartbeat import Beats
from specdecode.runtime.serve_flags import engine_config

MAX_TOKENS = 16
TP2, PP2 = ("--tensor-parallel-size", "2"), ("--pipeline-parallel-size", "2")
# Rank 0 in a subprocess: per config, one group; in it, an engine with speculation (n-gram, or
# heads) runs every prompt twice in one batch, once with speculation capped to 0 for the request
# (plain decoding) and once with it on; prints per config the token ids, the speculation counters
# and, for a head on aux states, the ones it observed after the first step (the prompts' prefill).
DRIVER = textwrap.dedent("""
    import json, sys
    from specdecode.runtime.config import EngineConfig
    from specdecode.runtime.engine.async_engine import AsyncEngine
    from specdecode.runtime.engine.sequence import SamplingParams

    def run(engine, prompts):
        out, observed = {}, []
        if engine.proposer is not None and engine.proposer.aux_layer_ids:
            observe = engine.proposer.observe
            engine.proposer.observe = lambda scheduled, states: (
                observed.append(states.tolist()) if not observed else None, observe(scheduled, states))
        for name, k in (("plain", 0), ("spec", None)):
            params = SamplingParams(max_tokens=%d, temperature=0.0, ignore_eos=True, num_speculative_tokens=k)
            for i, prompt in enumerate(prompts):
                engine.add_request(f"{name}/{i}", prompt, params)
                out[f"{name}/{i}"] = []
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id] += [t for d in o.deltas for t in d.token_ids]
        result = {name: [out[f"{name}/{i}"] for i in range(len(prompts))] for name in ("plain", "spec")}
        result["draft_tokens"], result["accepted_tokens"] = engine.spec.num_draft_tokens, engine.spec.num_accepted_tokens
        result["first_observed_aux"] = observed[0] if observed else None
        return result

    prompts = json.loads(sys.argv[2])
    for raw in json.loads(sys.argv[1]):
        async_engine = AsyncEngine.from_config(EngineConfig.model_validate_json(raw))
        try:
            result = run(async_engine.engine, prompts)
        finally:
            async_engine.shutdown()
        print("RESULT " + json.dumps(result), flush=True)
""" % MAX_TOKENS)


def _tp_outputs(cfgs: list[EngineConfig], prompts: list[list[int]], cwd: Path, deadline_s: float) -> list[dict]:
    """The driver's result per config, in order (one subprocess: the groups one after another)."""
    done = run_group([sys.executable, "-P", "-c", DRIVER, json.dumps([cfg.model_dump_json() for cfg in cfgs]),
                      json.dumps(prompts)], deadline_s, cwd)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line.removeprefix("RESULT ")) for line in done.stdout.splitlines() if line.startswith("RESULT ")]


def _tp_config(model: str, size: int, cache_dir: Path | None, **spec) -> EngineConfig:
    return EngineConfig(
        load=LoadConfig(model=model, weight_cache_dir=cache_dir, device="cpu", dtype="float32"),
        cache=CacheConfig(num_blocks=128, block_size=16),
        speculative=SpeculativeConfig(**({"method": "ngram", "num_speculative_tokens": 4, "verify": "greedy"} | spec)),
        parallel=ParallelConfig(tensor_parallel_size=size, rendezvous_timeout_s=60, collective_timeout_s=60),
    )


def _check_against_tp1(loaded, prompts, make_engine, run_all, assert_greedy_match, got: dict) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs here: 2 OpenMP threads on 2 busy cores measured 10-20× slower
    try:
        expected = run_all(make_engine(loaded.model, loaded.tokenizer), prompts, params)
    finally:
        torch.set_num_threads(threads)
    for name in ("plain", "spec"):
        for prompt, want, actual in zip(prompts, expected, got[name]):
            assert_greedy_match(loaded.model, prompt, want, actual)
    assert got["draft_tokens"] > 0  # the speculative pass really drafted


@pytest.mark.timeout(60)
def test_tp2_tiny_llama_greedy_equals_tp1(tiny_hf_model_dir, tmp_path, make_engine, run_all, assert_greedy_match):
    loaded = load_model(LoadConfig(model=str(tiny_hf_model_dir), weight_cache_dir=None))
    texts = ["Hello world! The quick", "def add(a, b):\n    return", "The capital of France is Paris. The capital"]
    prompts = [loaded.tokenizer.encode(t) for t in texts]
    (got,) = _tp_outputs([_tp_config(str(tiny_hf_model_dir), 2, None)], prompts, tmp_path, deadline_s=50)
    _check_against_tp1(loaded, prompts, make_engine, run_all, assert_greedy_match, got)


@pytest.mark.timeout(90)
def test_tp2_with_mtp_and_eagle3_heads_greedy_equals_tp1(tiny, tiny_hf_model_dir, sharp3_target_dir, sharp3_eagle3_dir,
                                                         tmp_path, make_engine, run_all, assert_greedy_match,
                                                         write_random_mtp_head):
    """Heads under tensor parallelism: rank 0 holds the whole head and drafts from what its forward
    returns after each layer's all-reduce, the other rank only runs its shard — an MTP head on the
    tiny llama's hidden states, an EAGLE-3 head on the aux states of a 3-layer target (the residual
    streams entering layers 0, 1 and 2: after the prefill, the whole model's)."""
    mtp = write_random_mtp_head(tiny[0], tmp_path / "mtp")
    texts = ["Hello world! The quick", "def add(a, b):\n    return", "The capital of France is Paris. The capital"]
    prompts = [tiny[1].encode(t) for t in texts]
    heads = {tiny_hf_model_dir: dict(method="mtp", mtp_path=mtp),
             sharp3_target_dir: dict(method="eagle3", eagle3_path=sharp3_eagle3_dir)}
    cfgs = [_tp_config(str(model), 2, None, num_speculative_tokens=3, **spec) for model, spec in heads.items()]
    for model, got in zip(heads, _tp_outputs(cfgs, prompts, tmp_path, deadline_s=80), strict=True):
        loaded = load_model(LoadConfig(model=str(model), weight_cache_dir=None))
        _check_against_tp1(loaded, prompts, make_engine, run_all, assert_greedy_match, got)
    whole = ModelRunner(loaded.model, num_blocks=2, block_size=16, device=torch.device("cpu"), dtype=torch.float32)
    whole.aux_layers = (0, 1, 2)
    batch = build_attention_batch([Span([0, 1], 0, len(prompts[0]))], 16, 2, torch.device("cpu"))
    with torch.inference_mode():
        expected = whole.forward_aux(torch.tensor(prompts[0]), batch)[1]  # [T, 3·hidden]
    observed = torch.tensor(got["first_observed_aux"])[: len(prompts[0])]  # the first prompt's rows come first
    torch.testing.assert_close(observed, expected, atol=1e-4, rtol=1e-4)  # the shards' partial sums, added in
    # another order than the whole model's dot products


@pytest.mark.timeout(90)
def test_tp3_smollm2_greedy_equals_tp1(smollm2, smol_rep, cache_dir, tmp_path, make_engine, run_all,
                                       assert_greedy_match):
    """SmolLM2 has 9 attention heads and 3 KV heads: 3 ranks of 3 heads and 1 KV head each."""
    prompts = smol_rep[:3]
    (got,) = _tp_outputs([_tp_config("smollm2-135m", 3, cache_dir)], prompts, tmp_path, deadline_s=80)
    _check_against_tp1(smollm2, prompts, make_engine, run_all, assert_greedy_match, got)
    assert got["accepted_tokens"] > 0  # verification accepted drafts: multi-position steps ran sharded


# -- validation ---------------------------------------------------------------------------------


def test_heads_that_do_not_split_are_refused_naming_the_numbers(smollm2, tiny_hf_model_dir):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 .* attention heads \(9\), KV heads \(3\)"):
        TensorParallel(0, 2).check(smollm2.config)
    TensorParallel(0, 3).check(smollm2.config)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 .* attention heads \(4\), KV heads \(2\)"):
        load_model(LoadConfig(model=str(tiny_hf_model_dir), weight_cache_dir=None), TensorParallel(0, 3))


def test_shards_cut_heads_and_intermediate_and_fuse_per_rank(tiny_hf_model_dir):
    full = load_model(LoadConfig(model=str(tiny_hf_model_dir), weight_cache_dir=None)).model
    c = full.config  # 4 heads, 2 KV heads, head_dim 16, intermediate 128
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for rank in (0, 1):
        shard = load_model(LoadConfig(model=str(tiny_hf_model_dir), weight_cache_dir=None), TensorParallel(rank, 2))
        attn, mlp = shard.model.model.layers[0].self_attn, shard.model.model.layers[0].mlp
        whole_attn, whole_mlp = full.model.layers[0].self_attn, full.model.layers[0].mlp
        wq, wk, wv = whole_attn.qkv_proj.weight.split([q, kv, kv])
        rows = lambda w: w.chunk(2)[rank]  # noqa: E731
        assert (attn.num_heads, attn.num_kv_heads, shard.model.num_local_kv_heads) == (2, 1, 1)
        assert attn.qkv_proj.weight.equal(torch.cat([rows(wq), rows(wk), rows(wv)]))
        assert attn.o_proj.weight.equal(whole_attn.o_proj.weight.chunk(2, dim=1)[rank])
        gate, up = whole_mlp.gate_up_proj.weight.split(c.intermediate_size)
        assert mlp.gate_up_proj.weight.equal(torch.cat([rows(gate), rows(up)]))
        assert mlp.down_proj.weight.equal(whole_mlp.down_proj.weight.chunk(2, dim=1)[rank])
        assert shard.model.lm_head.weight.equal(full.lm_head.weight)  # replicated


@pytest.mark.parametrize("fields, message", [
    (dict(tensor_parallel_size=0), "greater than or equal to 1"),
    (dict(tensor_parallel_size=3, num_nodes=2, master_port=29500), r"multiple of the number of pods NNODES \(2\)"),
    (dict(tensor_parallel_size=4, num_nodes=2, node_rank=2, master_port=29500), r"NODE_RANK \(2\) must be below"),
    (dict(tensor_parallel_size=4, num_nodes=2, master_port=29500), "needs MASTER_ADDR and MASTER_PORT"),
])
def test_parallel_config_is_validated(fields, message):
    with pytest.raises(ValidationError, match=message):
        ParallelConfig(**fields)


def test_tensor_parallel_flag_and_env():
    parser = build_parser()
    assert engine_config(parser.parse_args(["serve"]), {}).parallel == ParallelConfig()
    cfg = engine_config(parser.parse_args(["serve", "--tensor-parallel-size", "4"]), {}).parallel
    assert (cfg.tensor_parallel_size, cfg.num_nodes, list(cfg.local_ranks)) == (4, 1, [0, 1, 2, 3])
    env = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "leader.llm.svc", "MASTER_PORT": "29500"}
    cfg = engine_config(parser.parse_args(["generate", "--prompt", "x", "--tensor-parallel-size", "4"]), env).parallel
    assert (cfg.ranks_per_node, list(cfg.local_ranks), cfg.master_addr, cfg.master_port) == (2, [2, 3],
                                                                                             "leader.llm.svc", 29500)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--tensor-parallel-size", "two"])


# -- the operator/runtime contract --------------------------------------------------------------


def _rendered_container(**spec) -> dict:
    body = {"model": {"uri": "smollm2-135m"}, "image": "specdecode/runtime:test", **spec}
    answer = resolve({"apiVersion": "specdecode.io/v1alpha1", "kind": "SpecDecodeDeployment",
                      "metadata": {"name": "demo", "namespace": "llm"}, "spec": body})
    assert answer.allowed, answer.message
    workload = next(o for o in render(answer.resolved) if o["kind"] in ("Deployment", "StatefulSet"))
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def test_rendered_tensor_parallel_args_parse_with_the_serve_parser():
    container = _rendered_container(parallelism={"tensor": 2})
    args = build_parser().parse_args(container["args"])
    assert args.command == "serve"
    assert engine_config(args, {}).parallel.tensor_parallel_size == 2


def test_rendered_multi_pod_group_env_builds_the_rank_layout():
    container = _rendered_container(parallelism={"tensor": 4}, resources={"gpusPerPod": 2})
    args = build_parser().parse_args(container["args"])
    env = {e["name"]: e.get("value", "1") for e in container["env"]}  # NODE_RANK comes from the pod's index: say 1
    cfg = engine_config(args, env).parallel
    assert (cfg.tensor_parallel_size, cfg.num_nodes, cfg.node_rank, list(cfg.local_ranks)) == (4, 2, 1, [2, 3])
    assert cfg.master_port == 29500 and cfg.master_addr.startswith("demo-")


# -- serve as a process tree --------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_serve_tp2_answers_then_sigterm_leaves_no_process_behind(tiny_hf_model_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    proc = start_serve(tiny_hf_model_dir, port, log, *TP2)
    try:
        wait_ready(proc, url, log, timeout=40)
        spawned = descendants(proc.pid)
        assert any(is_worker(pid) for pid in spawned), "rank 0 spawned no worker"
        body = {"prompt": "Hello world", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(url + "/v1/completions", json=body, timeout=30).json()
        assert answer["usage"]["completion_tokens"] == 8 and answer["choices"][0]["text"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()[-4000:]
        deadline = time.monotonic() + 10
        while any(running(pid) for pid in spawned):
            assert time.monotonic() < deadline, f"left behind: {[p for p in spawned if running(p)]}"
            time.sleep(0.1)
    finally:
        kill_group(proc)


@pytest.mark.timeout(60)
def test_serve_tp2_health_fails_then_exits_non_zero_when_a_worker_dies(tiny_hf_model_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    proc = start_serve(tiny_hf_model_dir, port, log, *TP2)
    try:
        wait_ready(proc, url, log, timeout=40)
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        (worker,) = [pid for pid in descendants(proc.pid) if is_worker(pid)]  # rank 1
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/health stayed 200 after the worker died"
            time.sleep(0.1)
        failed = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert failed.status_code >= 500  # refused fast instead of hanging
        assert proc.wait(timeout=30) != 0, log.read_text()[-4000:]  # exits by itself: the kubelet restarts the pod
    finally:
        kill_group(proc)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout", [TP2, PP2], ids=["TP2", "PP2"])
def test_two_pods_node_0_serves_and_node_1_runs_its_rank_behind_probes(tiny_hf_model_dir, tmp_path, layout):
    """The multi-pod layout the operator renders, as two local processes: NNODES=2, one rank each
    (under PP2 node 1 is the last stage: it verifies)."""
    group = {"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ports, logs = [free_port(), free_port()], [tmp_path / "node0.log", tmp_path / "node1.log"]
    node1 = start_serve(tiny_hf_model_dir, ports[1], logs[1], *layout, env={**group, "NODE_RANK": "1"})
    node0 = start_serve(tiny_hf_model_dir, ports[0], logs[0], *layout, env={**group, "NODE_RANK": "0"})
    url0, url1 = (f"http://127.0.0.1:{p}" for p in ports)
    try:
        wait_ready(node1, url1, logs[1], timeout=40)
        wait_ready(node0, url0, logs[0], timeout=40)
        assert httpx.get(url1 + "/health", timeout=5).status_code == 200
        assert httpx.post(url1 + "/v1/completions", json={"prompt": "x"}, timeout=5).status_code == 501  # no API
        spawned = descendants(node1.pid)
        body = {"prompt": "Hello world", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        assert httpx.post(url0 + "/v1/completions", json=body, timeout=30).json()["usage"]["completion_tokens"] == 8
        node0.send_signal(signal.SIGTERM)
        assert node0.wait(timeout=30) == 0, logs[0].read_text()[-4000:]
        assert node1.wait(timeout=30) == 0, logs[1].read_text()[-4000:]  # its rank was told to stop
        assert not any(running(pid) for pid in spawned if is_worker(pid))
    finally:
        kill_group(node0)
        kill_group(node1)


def test_a_rank_whose_counter_stops_moving_is_lost_after_the_timeout_and_not_before():
    beats = Beats([1, 2], timeout_s=3.0, now=0.0)
    assert beats.observe({1: 0, 2: 0}, now=3.0) == []  # no beat yet, but not past the timeout
    assert beats.observe({1: 1, 2: 0}, now=3.5) == [2]
    assert beats.observe({1: 1, 2: 1}, now=6.0) == []  # rank 1 moved at 3.5; rank 2 is back
    assert beats.observe({1: 1, 2: 2}, now=6.6) == [1]


def test_a_rank_that_starts_again_while_its_group_stands_is_refused_at_the_rendezvous():
    cfg = ParallelConfig(tensor_parallel_size=2, rendezvous_timeout_s=5)
    store = host_store(cfg)
    worker = connect_store(cfg, "127.0.0.1", store.port)
    worker.set("loaded/1", "1")  # rank 1 loaded and joined the first time
    _wait_for_every_rank(store, cfg, 0, lambda: True)
    with pytest.raises(RuntimeError, match="has formed already, without this rank"):
        _wait_for_every_rank(worker, cfg, 1, lambda: True)  # rank 1 again, its leader never restarted


@pytest.mark.timeout(90)
def test_two_pods_leader_fails_requests_and_turns_not_ready_when_a_worker_rank_stops_beating(tiny_hf_model_dir,
                                                                                            tmp_path):
    """TP2 as two "pods": node 1's rank hangs mid-generation (SIGSTOP: no connection closes, as when a
    node is lost). Rank 0 sees no heartbeat for 2 s: the stream in flight ends with an error saying so,
    ``/ready`` turns 503 long before the 60 s collective timeout, and the leader exits non-zero (a
    torch group cannot take the rank back); the rank, let go again, finds its leader gone and exits
    non-zero too, so both pods restart and re-form the group."""
    group = {"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    flags = (*TP2, "--group-heartbeat-timeout", "2", "--collective-timeout", "60")
    ports, logs = [free_port(), free_port()], [tmp_path / "node0.log", tmp_path / "node1.log"]
    node1 = start_serve(tiny_hf_model_dir, ports[1], logs[1], *flags, env={**group, "NODE_RANK": "1"})
    node0 = start_serve(tiny_hf_model_dir, ports[0], logs[0], *flags, env={**group, "NODE_RANK": "0"})
    url = f"http://127.0.0.1:{ports[0]}"
    try:
        wait_ready(node0, url, logs[0], timeout=40)
        (rank1,) = [pid for pid in descendants(node1.pid) if is_worker(pid)]
        lines: list[str] = []
        streamed = threading.Event()

        def generate() -> None:
            body = {"prompt": "Hello world", "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as answer:
                for line in answer.iter_lines():
                    if line:
                        lines.append(line)
                        streamed.set()

        client = threading.Thread(target=generate, daemon=True)
        client.start()
        assert streamed.wait(30), "no token streamed"
        os.kill(rank1, signal.SIGSTOP)
        stopped = time.monotonic()
        while httpx.get(url + "/ready", timeout=5).status_code != 503:
            assert time.monotonic() - stopped < 30, "/ready stayed 200 with a rank of the group hung"
            time.sleep(0.1)
        client.join(30)
        assert not client.is_alive(), "the stream in flight did not end"
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert "no heartbeat for 2s" in error["message"] and lines[-1] == "data: [DONE]", lines[-4:]
        assert node0.wait(timeout=30) != 0, logs[0].read_text()[-4000:]
        os.kill(rank1, signal.SIGCONT)
        assert node1.wait(timeout=30) != 0, logs[1].read_text()[-4000:]
    finally:
        kill_group(node0)
        kill_group(node1)
