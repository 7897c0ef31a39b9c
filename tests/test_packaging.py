"""Packaging: the built wheel carries every module (subpackages included) and the package data, and they
import and read from it; the torch-free parts import with torch made unimportable."""
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCE_DIRS = {"runtime": "specdecode/runtime", "kernels": "specdecode/kernels", "operator": "specdecode/operator",
               "bench": "specdecode/bench"}


def source_modules() -> set[str]:
    mods = set()
    for folder, pkg in SOURCE_DIRS.items():
        for path in (REPO / folder).rglob("*.py"):
            mods.add(f"{pkg}/{path.relative_to(REPO / folder).as_posix()}")
    return mods


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-P", "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO)],
        check=True,
        cwd=out,
        timeout=300,
    )
    return next(out.glob("specdecode-*.whl"))


def test_wheel_contains_every_module(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = source_modules() - names
    assert not missing, f"the wheel silently drops {sorted(missing)}: list their packages in pyproject.toml"


def test_wheel_contains_the_package_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    data = {f"specdecode/bench/{p.relative_to(REPO / 'bench').as_posix()}" for p in (REPO / "bench" / "data").iterdir()}
    assert data and data <= names, f"the wheel drops {sorted(data - names)}: list them in pyproject.toml package-data"


def test_every_module_imports_from_the_wheel(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-P", "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        timeout=300,
    )
    modules = sorted(m[:-3].replace("/", ".").removesuffix(".__init__") for m in source_modules())
    script = textwrap.dedent(
        f"""
        import importlib, sys
        sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
        sys.path.insert(0, {str(target)!r})
        for name in {modules!r}:
            if name.endswith("__main__"):
                continue
            mod = importlib.import_module(name)
            assert mod.__file__.startswith({str(target)!r}), (name, mod.__file__)
        from specdecode.bench.grammar import load_requests  # its package data
        assert load_requests()
        print("imported", len({modules!r}))
        """
    )
    done = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr


def test_torch_free_parts_import_without_torch():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        import specdecode.runtime.config, specdecode.runtime.cli, specdecode.runtime.serve_flags, specdecode.operator
        import specdecode.runtime.prompt_sets
        from specdecode.runtime.cli import main
        try:
            main(["--help"])
        except SystemExit as exc:
            assert exc.code == 0
        """
    )
    done = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_serving_and_the_test_helpers_load_nothing_of_bench():
    """Every runtime module, `specdecode serve --help` and the test helpers (tests/*.py but the
    test files) import with ``specdecode.bench`` and what only it needs (matplotlib,
    transformers) unimportable."""
    runtime = sorted(m[:-3].replace("/", ".").removesuffix(".__init__") for m in source_modules()
                     if m.startswith("specdecode/runtime/"))
    helpers = sorted(p.stem for p in (REPO / "tests").glob("*.py") if not p.stem.startswith("test_"))
    script = textwrap.dedent(
        f"""
        import importlib, sys
        class BenchOnly:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("matplotlib", "transformers") or name.startswith("specdecode.bench"):
                    raise ImportError("serving must not import " + name)
        sys.meta_path.insert(0, BenchOnly())
        sys.path.insert(0, {str(REPO / "tests")!r})
        for name in {runtime + helpers!r}:
            importlib.import_module(name)
        from specdecode.runtime.cli import main
        try:
            main(["serve", "--help"])
        except SystemExit as exc:
            assert exc.code == 0
        """
    )
    done = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
