"""The repository installs as a package (`pip install -e .`): pyproject.toml lists every top-level package and the
same runtime pins as requirements.txt, and a wheel built from a copy of the sources holds every module."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEV = ("nbclient", "nbformat", "ipykernel", "pytest", "ruff")  # the notebooks and the tests; not the library
PACKAGES = ("agent_trl", "envs", "rewards", "trainers")  # the top-level folders the wheel is built from


def pins() -> list[str]:
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_pyproject_pins_equal_requirements():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == [p for p in pins() if not p.startswith(DEV)]
    assert project["optional-dependencies"]["dev"] == [p for p in pins() if p.startswith(DEV)]


def test_every_top_level_package_is_listed():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    tops = [p.parent.name for p in ROOT.glob("*/__init__.py")]  # and their subpackages (envs.adapters)
    found = sorted(".".join(p.parent.relative_to(ROOT).parts) for t in tops for p in (ROOT / t).rglob("__init__.py"))
    assert sorted(setuptools["packages"]) == found and setuptools["py-modules"] == ["train"]


def test_wheel_holds_every_module(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "train.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."]
    subprocess.run(cmd, cwd=src, check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("agent_trl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {"train.py"} | {str(p.relative_to(ROOT)) for d in PACKAGES for p in (ROOT / d).rglob("*.py")}
    assert expected <= names, sorted(expected - names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "agent-trl-train = train:cli" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_readme_library_example_runs(tmp_path, monkeypatch):
    """The README's Python example, executed as written except for sizes: a 1-step SFT build of the tiny default and
    one RL step instead of ten (the full build takes minutes)."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## As a library") :]
    code = section[section.index("```python\n") + len("```python\n") :]
    code = code[: code.index("```")]
    assert 'tiny_model("tiny:shop")' in code and "max_steps=10" in code
    code = code.replace('tiny_model("tiny:shop")', 'tiny_model("tiny:shop", sft_steps=1, num_demos=32)')
    code = code.replace("max_steps=10", "max_steps=1")
    monkeypatch.setenv("AGENT_TRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.state.global_step == 1
    assert any("env/success" in row for row in trainer.state.log_history)
