"""`specdecode validate` / `specdecode render`: exit codes, output, and both work without torch."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from specdecode.runtime.cli import build_parser, main
from specdecode.runtime.serve_flags import ArgumentsRefused, serve_parser

REPO = Path(__file__).resolve().parents[1]
GOOD = str(REPO / "examples" / "smollm2-ngram.yaml")
DRAFT = str(REPO / "examples" / "qwen-coder-draft.yaml")
BAD = str(REPO / "examples" / "invalid-mtp.yaml")
VALID = sorted(p for p in (REPO / "examples").glob("*.yaml") if not p.name.startswith("invalid"))


def test_validate_allows_the_examples(capsys):
    assert main(["validate", GOOD]) == 0
    assert capsys.readouterr().out == "allowed: smollm2-ngram\n"
    assert main(["validate", DRAFT]) == 0


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_every_valid_example_validates_and_renders(path, capsys):
    assert main(["validate", str(path)]) == 0
    assert main(["render", str(path)]) == 0
    name = yaml.safe_load(path.read_text())["metadata"]["name"]  # smollm2-suffix.yaml edits smollm2-ngram
    assert capsys.readouterr().out.startswith(f"allowed: {name}\n")


def test_validate_refuses_with_what_to_change(capsys):
    assert main(["validate", BAD]) == 1
    out = capsys.readouterr().out
    assert out.startswith('denied: SpecDecodeDeployment "invalid-mtp" is invalid: spec.parallelism.pipeline: ')
    assert "add the gate 'mtp-pipeline-parallel'" in out  # the gate, named
    assert "spec.speculative.numSpeculativeTokens" in out


def test_validate_json_is_the_admission_response(capsys):
    assert main(["validate", "-o", "json", BAD]) == 1
    (response,) = json.loads(capsys.readouterr().out)
    assert response["allowed"] is False and response["status"]["code"] == 422
    assert response["status"]["message"].startswith('SpecDecodeDeployment "invalid-mtp" is invalid')


def test_validate_warnings_go_to_stderr_and_old_checks_immutability(tmp_path, capsys):
    body = yaml.safe_load(Path(GOOD).read_text())
    body["spec"]["speculative"]["verify"] = "topp"
    new = tmp_path / "new.yaml"
    new.write_text(yaml.safe_dump(body))
    assert main(["validate", str(new)]) == 0
    captured = capsys.readouterr()
    assert captured.out == "allowed: smollm2-ngram\n"
    assert captured.err.startswith("Warning: spec.speculative.verify: 'topp' is lossy")
    body["spec"]["parallelism"] = {"tensor": 2}
    new.write_text(yaml.safe_dump(body))
    assert main(["validate", str(new), "--old", GOOD]) == 1
    assert "spec.parallelism: the parallel group is immutable" in capsys.readouterr().out


def test_validate_old_answers_as_admission_an_update_that_leaves_spec_as_it_was(tmp_path, capsys):
    body = yaml.safe_load(Path(BAD).read_text())
    body["metadata"]["annotations"] = {"specdecode.io/pause": "true"}
    new = tmp_path / "annotated.yaml"
    new.write_text(yaml.safe_dump(body))
    assert main(["validate", str(new), "--old", BAD]) == 0
    captured = capsys.readouterr()
    assert captured.out == "allowed: invalid-mtp\n"
    assert captured.err.startswith('Warning: SpecDecodeDeployment "invalid-mtp" is invalid: ')
    assert captured.err.rstrip().endswith("(allowed: this update leaves spec as it was)")
    assert main(["validate", str(new)]) == 1  # as a create it is refused


def test_the_strict_parser_refuses_abbreviations_and_raises_instead_of_exiting():
    """What admission checks spec.extraArgs with; users' command lines keep argparse's defaults."""
    assert build_parser().parse_args(["serve", "--tensor-parallel", "2"]).tensor_parallel_size == 2
    strict = serve_parser(strict=True)
    assert strict.parse_args(["--tensor-parallel-size", "2"]).tensor_parallel_size == 2
    with pytest.raises(ArgumentsRefused, match="unrecognized arguments: --tensor-parallel 2"):
        strict.parse_args(["--tensor-parallel", "2"])
    assert strict.parse_known_args(["--max-num=4"])[1] == ["--max-num=4"]
    with pytest.raises(ArgumentsRefused, match="argument --block-size: invalid int value: 'big'"):
        strict.parse_args(["--block-size", "big"])
    with pytest.raises(ArgumentsRefused, match="--help prints help instead of running"):
        strict.parse_args(["--help"])


def test_unreadable_files_exit_2(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "missing.yaml")]) == 2
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    assert main(["render", str(tmp_path / "list.yaml")]) == 2
    assert "document 1 is not a mapping" in capsys.readouterr().err


def test_render_prints_the_objects_as_yaml(capsys):
    assert main(["render", GOOD]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs] == ["Deployment", "Service", "PodDisruptionBudget"]
    assert docs[0]["spec"]["replicas"] == 2
    assert main(["render", GOOD, "--replicas", "1"]) == 0
    assert next(yaml.safe_load_all(capsys.readouterr().out))["spec"]["replicas"] == 1


def test_render_refuses_an_invalid_spec(capsys):
    assert main(["render", BAD]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith('denied: SpecDecodeDeployment "invalid-mtp"')


def run_without_torch(body: str) -> subprocess.CompletedProcess:
    """``body`` in a fresh interpreter where any ``import torch`` raises ImportError."""
    script = 'import importlib, pkgutil, sys\nsys.modules["torch"] = None\n' + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)


def test_every_operator_module_imports_without_torch():
    done = run_without_torch(
        """
        import specdecode.operator
        for mod in pkgutil.walk_packages(specdecode.operator.__path__, "specdecode.operator."):
            importlib.import_module(mod.name)
        assert {"specdecode.operator.handlers", "specdecode.operator.local.router"} <= set(sys.modules)
        """
    )
    assert done.returncode == 0, done.stderr


def test_validate_and_render_need_neither_torch_nor_a_kubernetes_client():
    done = run_without_torch(
        f"""
        from specdecode.runtime.cli import main
        assert main(["validate", {GOOD!r}]) == 0
        assert main(["render", {DRAFT!r}]) == 0
        assert main(["validate", {BAD!r}]) == 1
        assert not {{name.split(".")[0] for name in sys.modules if sys.modules[name]}} & {{"torch", "kopf", "kubernetes"}}
        """
    )
    assert done.returncode == 0, done.stderr
    assert "kind: Deployment" in done.stdout and "denied:" in done.stdout
