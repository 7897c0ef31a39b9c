"""Tokenizers rebuilt from GGUF metadata (SmolLM2 and tiny files) and read from HF folders give
transformers' ids, decodes and rendered chat templates exactly."""
import pytest
from transformers import AutoTokenizer

from specdecode.runtime.models.gguf_loader import open_gguf
from specdecode.runtime.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    " leading space, trailing space ",
    "Unicode: naïve café, Ünïcödé, ß, ĳ, Ελληνικά, русский, עברית, العربية",
    "Emoji 🤗🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵 and skin tones 👍🏽",
    "CJK: 你好，世界！日本語のテキスト。한국어 텍스트",
    "whitespace   runs\t\ttabs    and\u00a0nbsp  \u3000ideographic",
    "newlines\n\n\nand\r\nwindows\rmac\n \n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|im_end|>glued<|im_start|>",
    "code:\n    def f(x):\n        return x**2  # 12345678901234567890\n",
    "contractions: I'm, you're, they've, we'll, it's, DON'T",
    "combining: e\u0301 a\u0300 \u212b",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there! 🤗"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?\n\nExplain."}],
]


@pytest.fixture(scope="session")
def smollm2_gguf_tokenizer(smollm2_gguf):
    return Tokenizer.from_gguf_metadata(open_gguf(smollm2_gguf).tokenizer)


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_gguf):
    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


def assert_same_tokenizer(ours: Tokenizer, theirs, texts=TEXTS) -> None:
    for text in texts:
        for special in (True, False):
            want = theirs(text, add_special_tokens=special)["input_ids"]
            assert ours.encode(text, add_special_tokens=special) == want, (text, special)
        ids = ours.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text


def assert_same_chat(ours: Tokenizer, theirs) -> None:
    for messages in CONVERSATIONS:
        for gen in (True, False):
            want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == want


def test_smollm2_ids_and_decode_match_transformers(smollm2_gguf_tokenizer, smollm2_hf_tokenizer):
    assert_same_tokenizer(smollm2_gguf_tokenizer, smollm2_hf_tokenizer)


def test_smollm2_chat_template_matches_transformers(smollm2_gguf_tokenizer, smollm2_hf_tokenizer):
    assert_same_chat(smollm2_gguf_tokenizer, smollm2_hf_tokenizer)
    rendered = smollm2_gguf_tokenizer.apply_chat_template(CONVERSATIONS[0])
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")


def test_smollm2_special_tokens(smollm2_gguf_tokenizer, smollm2_hf_tokenizer):
    tok = smollm2_gguf_tokenizer
    assert tok.eos_token_ids == {smollm2_hf_tokenizer.eos_token_id} == {2}
    assert tok.bos_token_id == 1 and tok.vocab_size == len(smollm2_hf_tokenizer) == 49152
    assert tok.all_special_ids == {i for i, t in smollm2_hf_tokenizer.added_tokens_decoder.items() if t.special}
    assert tok.id_to_token(1) == "<|im_start|>" and tok.encode("<|im_end|>") == [2]


def test_decode_round_trips(smollm2_gguf_tokenizer):
    for text in TEXTS:
        assert smollm2_gguf_tokenizer.decode(smollm2_gguf_tokenizer.encode(text), skip_special_tokens=False) == text
    ids = smollm2_gguf_tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert smollm2_gguf_tokenizer.decode(ids) == "user\nhi"


def test_saved_folder_reloads_identically(smollm2_gguf_tokenizer, tmp_path):
    """What the weight cache stores (HF folder files) gives back the same tokenizer."""
    smollm2_gguf_tokenizer.save(tmp_path)
    again = Tokenizer.from_hf_folder(tmp_path)
    for text in TEXTS:
        assert again.encode(text) == smollm2_gguf_tokenizer.encode(text)
    assert again.eos_token_ids == smollm2_gguf_tokenizer.eos_token_ids
    assert again.bos_token_id == smollm2_gguf_tokenizer.bos_token_id
    assert again.all_special_ids == smollm2_gguf_tokenizer.all_special_ids
    assert again.apply_chat_template(CONVERSATIONS[1]) == smollm2_gguf_tokenizer.apply_chat_template(CONVERSATIONS[1])


@pytest.mark.parametrize("arch,add_bos", [("qwen2", False), ("llama", True)])
def test_tiny_gguf_tokenizer_matches_transformers(arch, add_bos, tmp_path, write_tiny_gguf):
    """qwen2's split regex (digits one by one, …), and a BOS-adding file."""
    path = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(path, arch, ("Q8_0",), add_bos=add_bos)
    ours = Tokenizer.from_gguf_metadata(open_gguf(path).tokenizer)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert_same_tokenizer(ours, theirs)
    assert_same_chat(ours, theirs)
    assert (ours.encode("hi")[0] == 1) is add_bos


def test_hf_folder_tokenizer_matches_transformers(tiny_hf_model_dir):
    ours = Tokenizer.from_hf_folder(tiny_hf_model_dir)
    theirs = AutoTokenizer.from_pretrained(str(tiny_hf_model_dir))
    assert_same_tokenizer(ours, theirs)
    assert_same_chat(ours, theirs)
    assert ours.eos_token_ids == {theirs.convert_tokens_to_ids("<|im_end|>")}


def test_template_kwargs_override_and_missing_template(tiny_hf_model_dir, tmp_path):
    tok = Tokenizer.from_hf_folder(tiny_hf_model_dir)
    custom = tmp_path / "t.jinja"
    custom.write_text("{% for m in messages %}[{{ m.role }}|{{ m.content | tojson }}]{% endfor %}"
                      "{% if flavour %}{{ flavour }}{% endif %}{{ eos_token }}")
    out = tok.with_chat_template_file(custom).apply_chat_template([{"role": "user", "content": "a<b>"}], flavour="x")
    assert out == '[user|"a<b>"]x<|im_end|>'
    with pytest.raises(ValueError, match="no chat template"):
        tok.with_chat_template("").apply_chat_template([{"role": "user", "content": "hi"}])
    raising = tok.with_chat_template("{{ raise_exception('only user turns') }}")
    with pytest.raises(Exception, match="only user turns"):
        raising.apply_chat_template([{"role": "system", "content": "x"}])
