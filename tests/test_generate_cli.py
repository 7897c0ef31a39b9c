"""``specdecode generate`` with ``--speculative-config`` and a constraint (``--json-schema``,
``--regex``, ``--choice``), run in-process on the tiny sharp model: the completion belongs to the
constraint's language, greedy speculation leaves it unchanged, and the acceptance block after it
adds up; bad constraints exit 2 with a reason (malformed JSON before any model loads)."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from specdecode.runtime.cli import main

# compact JSON (no free whitespace: a random model would otherwise emit it until max_tokens)
SCHEMA = {"type": "object", "additionalProperties": False, "x-guidance": {"whitespace_flexible": False},
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["x", "yy"]},
                         "ok": {"type": "boolean"}},
          "required": ["n", "tag", "ok"]}
# n-gram drafts find the output's shapes in the prompt
PROMPT = '{"n":44,"tag":"x","ok":true} {"n":4,"tag":"yy","ok":false} {"n":44,"tag":"x","ok":true} {"n":4'
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4}'
BLOCK_NAMES = ["drafts scored (steps)", "draft tokens", "accepted tokens", "acceptance rate", "accepted per position"]


def generate(capsys, model_dir, *flags: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``specdecode generate`` on ``model_dir``, greedy."""
    code = main(["generate", "--model", str(model_dir), "--no-weight-cache", "--prompt", PROMPT, "--max-tokens", "40",
                 *flags])
    out, err = capsys.readouterr()
    return code, out, err


def acceptance(block: str) -> dict[str, str]:
    lines = [line.split(":", 1) for line in block.strip().splitlines()]
    assert [name for name, _ in lines] == BLOCK_NAMES
    return {name: value.strip() for name, value in lines}


def test_json_schema_with_ngram_is_valid_unchanged_and_reports_acceptance(sharp_target_dir, tmp_path, capsys):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    code, out, _ = generate(capsys, sharp_target_dir, "--speculative-config", NGRAM, "--json-schema", f"@{schema_file}")
    assert code == 0
    text, block = out.split("\n\n")
    jsonschema.validate(json.loads(text), SCHEMA)
    counts = acceptance(block)
    steps, drafted, accepted = (int(counts[name]) for name in BLOCK_NAMES[:3])
    per_position = [int(n) for n in counts["accepted per position"].split()]
    assert 0 < steps <= drafted <= 4 * steps and accepted <= drafted
    assert counts["acceptance rate"] == f"{accepted / drafted:.2f}"
    assert sum(per_position) == accepted and len(per_position) <= 4
    assert per_position == sorted(per_position, reverse=True)  # position i+1 accepted only after position i

    code, plain, _ = generate(capsys, sharp_target_dir, "--speculative-config", '{"grammar_drafts": false}',
                              "--json-schema", json.dumps(SCHEMA))
    assert code == 0 and plain == text + "\n"  # greedy: the same text; nothing drafted, no block


@pytest.mark.parametrize(("flag", "value", "belongs"), [
    ("--regex", r"[a-z]{2,6}( [a-z]{2,6}){1,3}\.", lambda text: re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){1,3}\.", text)),
    ("--choice", '["alpha", "beta", "gamma"]', lambda text: text in ("alpha", "beta", "gamma")),
])
def test_regex_and_choice_constrain_the_output(sharp_target_dir, capsys, flag, value, belongs):
    code, out, _ = generate(capsys, sharp_target_dir, "--speculative-config", NGRAM, flag, value)
    assert code == 0
    text, block = out.split("\n\n")
    assert belongs(text), text
    assert acceptance(block)["drafts scored (steps)"].isdigit()


def test_bad_constraints_exit_2_with_the_reason(sharp_target_dir, tmp_path, capsys):
    missing = tmp_path / "no-model"  # malformed JSON is refused before the model would load
    for flag, value, said in [("--json-schema", "{bad", "--json-schema is not JSON"),
                              ("--choice", "[alpha]", "--choice is not JSON"),
                              ("--json-schema", f"@{tmp_path / 'absent.json'}", "absent.json")]:
        code, _, err = generate(capsys, missing, flag, value)
        assert code == 2 and said in err, err
    code, out, err = generate(capsys, sharp_target_dir, "--json-schema", '{"type": "objectx"}')
    assert code == 2 and "objectx" in err and out == ""
    code, _, err = generate(capsys, missing, "--speculative-config", '{"method": "ngramm"}')
    assert code == 2 and "invalid configuration" in err
