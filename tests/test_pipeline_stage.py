"""Pipeline stages of the decoder: the contiguous layer split (uneven allowed, more stages than
layers refused naming the numbers), each stage holding only its own weights and KV pools, and the
stages' forwards chained equal to the whole model's."""
from __future__ import annotations

import pytest
import torch

from specdecode.runtime.config import LoadConfig
from specdecode.runtime.engine.model_runner import ModelRunner, Span, build_attention_batch
from specdecode.runtime.models.loader import load_model
from specdecode.runtime.models.pipeline_stage import PipelineStage


@pytest.mark.parametrize("num_layers, size, expected", [
    (30, 4, [8, 8, 7, 7]), (5, 2, [3, 2]), (2, 2, [1, 1]), (7, 1, [7]), (9, 9, [1] * 9),
])
def test_layers_split_contiguously_and_the_last_stage_never_takes_an_extra_layer(num_layers, size, expected):
    ranges = [PipelineStage(rank, size).layers(num_layers) for rank in range(size)]
    assert [len(r) for r in ranges] == expected
    assert [i for r in ranges for i in r] == list(range(num_layers))


def test_more_stages_than_layers_are_refused_naming_the_numbers(tiny_hf_model_dir):
    with pytest.raises(ValueError, match=r"pipeline_parallel_size 3 exceeds the model's 2 decoder layers"):
        load_model(LoadConfig(model=str(tiny_hf_model_dir), weight_cache_dir=None), stage=PipelineStage(0, 3))


def test_each_stage_holds_only_its_weights_and_kv_pools(smollm2, cache_dir):
    """SmolLM2 (30 layers, tied embeddings) in 4 stages: layers 8/8/7/7 named from 0 on each stage,
    the embedding on the first stage and, tied to the LM head, on the last; the final norm on the
    last only; every tensor equal to the whole model's; one KV pool pair per local layer."""
    full = dict(smollm2.model.named_parameters())
    starts = [0, 8, 16, 23]
    embed, norm = "model.embed_tokens.weight", "model.norm.weight"
    expected_others = [{embed}, set(), set(), {embed, norm}]
    for rank in range(4):
        stage = PipelineStage(rank, 4)
        model = load_model(LoadConfig(model="smollm2-135m", weight_cache_dir=cache_dir), stage=stage).model
        names = dict(model.named_parameters())
        layers = sorted({int(n.split(".")[2]) for n in names if n.startswith("model.layers.")})
        assert layers == list(range(len(stage.layers(30))))
        others = {n for n in names if not n.startswith("model.layers.")}
        assert others == expected_others[rank]
        for name, tensor in names.items():
            if name.startswith("model.layers."):
                index = int(name.split(".")[2])
                name = name.replace(f"model.layers.{index}.", f"model.layers.{starts[rank] + index}.", 1)
            assert torch.equal(tensor, full[name]), name
        runner = ModelRunner(model, num_blocks=2, block_size=16, device=torch.device("cpu"), dtype=torch.float32)
        assert len(runner.kv_pools) == model.num_local_layers == len(stage.layers(30))


def test_stage_forwards_chained_equal_the_whole_model(tiny_hf_model_dir, tiny):
    """The tiny llama (2 layers, separate LM head) in 2 stages: stage 0 embeds and runs layer 0,
    stage 1 runs layer 1 on its hidden states and owns the norm and LM head; hidden states and
    logits equal the whole model's."""
    whole, tokenizer = tiny
    ids = torch.tensor(tokenizer.encode("The quick brown fox jumps over the lazy dog"))
    batch = build_attention_batch([Span([0, 1], 0, len(ids))], 16, 2, torch.device("cpu"))

    def forward(model, inputs):
        runner = ModelRunner(model, num_blocks=2, block_size=16, device=torch.device("cpu"), dtype=torch.float32)
        with torch.inference_mode():
            return model(inputs, runner.kv_pools, batch)

    first, last = (load_model(LoadConfig(model=str(tiny_hf_model_dir), weight_cache_dir=None),
                              stage=PipelineStage(rank, 2)).model for rank in range(2))
    assert first.lm_head is None and not hasattr(first.model, "norm") and not hasattr(last.model, "embed_tokens")
    hidden = forward(last, forward(first, ids))
    expected = forward(whole, ids)
    torch.testing.assert_close(hidden, expected, rtol=0, atol=0)
    torch.testing.assert_close(last.compute_logits(hidden), whole.compute_logits(expected), rtol=0, atol=0)
