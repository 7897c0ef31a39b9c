"""``specdecode train-eagle3`` end to end on a 4-layer tiny llama (train-mtp's prompts and settings,
``test_train_mtp.py``): the trained head beats a random head's held-out position-1 acceptance by
≥ 0.3, measured by the engine; with it the engine keeps greedy output equal to no-spec; the
training-time test's passes are the proposer's chain (its drafts after a draft equal the argmax of
the pass fed that draft); the same seed trains the same head; the folder is speculators' format
with the aux layers and the reduced draft vocabulary; bad aux layers are refused."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from specdecode.runtime.cli import main
from specdecode.runtime.config import LoadConfig
from specdecode.runtime.models.eagle3 import Eagle3Head
from specdecode.runtime.models.eagle3_checkpoint import load_eagle3_head, save_eagle3_head
from specdecode.runtime.models.loader import load_model
from specdecode.runtime.models.model_config import ModelConfig
from specdecode.runtime.training import command, eagle3_head
from test_eagle3_proposer import entering
from test_mtp_heads import drafts_along_generation
from test_train_mtp import (  # noqa: F401 (fixture)
    check_beats_random_on_position_one, check_heldout_greedy_equals_no_spec, prompt_files)

from conftest import copy_hf_folder, random_hf_weights

AUX = (1, 2, 3)
TRAIN_ARGS = ["--num-prompts", "64", "--max-tokens", "24", "--text-tokens", "0", "--epochs", "8", "--lr", "1e-2",
              "--eval-prompts", "16", "--eval-max-tokens", "32"]


@pytest.fixture(scope="module")
def tiny4_dir(tiny_hf_model_dir, tmp_path_factory):
    """The tiny llama with 4 layers (3 distinct aux layers need at least 3)."""
    hf = json.loads((tiny_hf_model_dir / "config.json").read_text()) | {"num_hidden_layers": 4}
    folder = tmp_path_factory.mktemp("tiny4")
    return copy_hf_folder(tiny_hf_model_dir, folder, random_hf_weights(ModelConfig.from_hf(hf), seed=0),
                          num_hidden_layers=4)


@pytest.fixture(scope="module")
def tiny4(tiny4_dir):
    loaded = load_model(LoadConfig(model=tiny4_dir, weight_cache_dir=None))
    return loaded.model, loaded.tokenizer


def train_eagle3(model_dir: str, out, prompt_files, settings: list[str] = TRAIN_ARGS) -> int:
    train, heldout = prompt_files
    return main(["train-eagle3", "--model", model_dir, "--out", str(out), "--prompts", str(train),
                 "--eval-prompts-file", str(heldout), "--aux-layer-ids", ",".join(map(str, AUX)), "--no-weight-cache",
                 *settings])


@pytest.fixture(scope="module")
def trained(tiny4_dir, prompt_files, tmp_path_factory):
    """(head folder, train_report.json) of ``train-eagle3`` run with train-mtp's tiny settings."""
    out = tmp_path_factory.mktemp("trained-eagle3") / "head"
    assert train_eagle3(tiny4_dir, out, prompt_files) == 0
    return out, json.loads((out / "train_report.json").read_text())


def random_head(trained_head: Eagle3Head, folder) -> str:
    """A head of the trained one's shapes and draft vocabulary with random weights."""
    head = Eagle3Head(trained_head.config)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in head.named_parameters():
            param.copy_(torch.ones(param.shape) if name.endswith("norm.weight")
                        else 0.1 * torch.randn(param.shape, generator=gen))
        head.d2t.copy_(trained_head.d2t)
    save_eagle3_head(folder, head, 2)
    return str(folder)


def test_a_trained_head_beats_a_random_head_on_heldout_position_one_by_at_least_0_3(
    trained, tiny4, tiny4_dir, prompt_files, tmp_path
):
    folder, report = trained
    model, tokenizer = tiny4
    random_dir = random_head(load_eagle3_head(folder, model), tmp_path / "random")
    check_beats_random_on_position_one(model, tokenizer, tiny4_dir, prompt_files[1], report,
                                       {"method": "eagle3", "eagle3_path": random_dir})


@pytest.mark.parametrize("verify", ["greedy", "rejection"])
def test_with_a_trained_head_greedy_equals_no_spec(verify, trained, tiny4, prompt_files, make_engine, run_all,
                                                   assert_greedy_match):
    spec = {"method": "eagle3", "num_speculative_tokens": 2, "eagle3_path": str(trained[0]), "verify": verify}
    stats = check_heldout_greedy_equals_no_spec(*tiny4, prompt_files[1], spec, make_engine, run_all,
                                                assert_greedy_match)
    assert stats.spec_decode_num_accepted_tokens > 0


def test_the_training_passes_are_the_proposers_chain(trained, tiny4, prompt_files, make_engine):
    """Every step's drafts (K = 3) equal the argmax of the training-time test's passes over the tokens
    so far followed by the drafts before: pass j at the chain's slot, fed the head's own output."""
    model, tokenizer = tiny4
    k = 3
    engine = make_engine(model, tokenizer, spec={"method": "eagle3", "num_speculative_tokens": k,
                                                 "eagle3_path": str(trained[0]), "verify": "greedy"})
    head = engine.proposer.head
    text = json.loads(prompt_files[1].read_text())[1]
    steps = drafts_along_generation(engine, command._chat_ids(tokenizer, [{"role": "user", "content": text}]), k, 6)
    for tokens, drafts in steps:
        fed = tokens + drafts[: k - 1]
        aux = entering(model, fed, AUX)[None]  # [1, T, 3·H]
        with torch.no_grad():
            outs = eagle3_head.passes(head, model, torch.tensor([fed]), aux, k)
        n = len(tokens)
        logits = [head.draft_logits(out[0, n - 1 + j][None]) for j, out in enumerate(outs)]  # pass j at slot n − 1 + j
        expected = [int(head.target_ids()[row.argmax()]) for row in logits]
        assert drafts == expected
    assert engine.stats().spec_decode_num_accepted_tokens > 0


def test_the_folder_is_speculators_format_with_the_aux_layers_and_a_reduced_draft_vocabulary(trained, tiny4):
    folder, report = trained
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    vocab = tiny4[0].config.vocab_size
    assert config["draft_vocab_size"] == report["draft_vocab_size"] < vocab
    tensors = load_file(str(folder / "model.safetensors"))
    assert "embed_tokens.weight" not in tensors and tensors["lm_head.weight"].shape[0] == report["draft_vocab_size"]
    head = load_eagle3_head(folder, tiny4[0])
    ids = head.target_ids()
    assert bool((ids[1:] > ids[:-1]).all()) and int(tensors["t2d"].sum()) == len(ids)


def test_the_same_seed_trains_the_same_head(tiny4_dir, prompt_files, tmp_path):
    """Two short runs (a few prompts, one epoch) from scratch write the same tensors."""
    short = ["--num-prompts", "8", "--max-tokens", "8", "--text-tokens", "0", "--epochs", "1", "--eval-prompts", "1",
             "--eval-max-tokens", "4"]
    heads = []
    for name in ("first", "second"):
        assert train_eagle3(tiny4_dir, tmp_path / name, prompt_files, short) == 0
        heads.append(load_file(str(tmp_path / name / "model.safetensors")))
    first, second = heads
    assert first.keys() == second.keys() and all(torch.equal(first[name], second[name]) for name in first)


@pytest.mark.parametrize("model, aux, message", [
    ("tiny4", "3,1,2", "--aux-layer-ids 3,1,2: three distinct target layers, ascending"),
    ("tiny4", "1,2,4", "aux layers [1, 2, 4] are not three distinct layers of the target's 4"),
    ("tiny2", None, "aux layers [2, 1, -1] are not three distinct layers of the target's 2: give --aux-layer-ids"),
])
def test_aux_layers_that_do_not_fit_are_refused_with_exit_2_before_generating(
    model, aux, message, tiny4_dir, tiny_hf_model_dir, prompt_files, tmp_path, capsys
):
    folder = {"tiny4": tiny4_dir, "tiny2": str(tiny_hf_model_dir)}[model]
    train, heldout = prompt_files
    args = ["train-eagle3", "--model", folder, "--out", str(tmp_path / "h"), "--prompts", str(train),
            "--eval-prompts-file", str(heldout), "--text-tokens", "0", "--no-weight-cache"] + (
                ["--aux-layer-ids", aux] if aux else [])
    assert main(args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "h").exists()
