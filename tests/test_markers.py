"""Every test that starts `torchrun` carries the `distributed` marker, so `-m "not distributed"` leaves no process
group behind (pyproject.toml lists the marker)."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
LAUNCHERS = ("torchrun", "torch.distributed.run")


def marked(node: ast.FunctionDef, module_marks: set[str]) -> bool:
    names = set(module_marks)
    for deco in node.decorator_list:
        names.add(ast.unparse(deco))
    return any(n.endswith("mark.distributed") for n in names)


def starts_torchrun(node: ast.AST, helpers: set[str]) -> bool:
    """The function's body holds the launcher's name as a command word (`"torchrun"`, `"torch.distributed.run"`) or
    calls a helper of its module that does. Docstrings that mention torchrun in prose do not count."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and sub.value in LAUNCHERS:
            return True
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id in helpers:
            return True
    return False


def unmarked_torchrun_tests(source: str) -> list[str]:
    tree = ast.parse(source)
    module_marks = {
        ast.unparse(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)
    }
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    helpers: set[str] = set()
    changed = True
    while changed:  # helpers that start torchrun, directly or through another helper
        changed = False
        for f in functions:
            if not f.name.startswith("test") and f.name not in helpers and starts_torchrun(f, helpers):
                helpers.add(f.name)
                changed = True
    return [
        f.name
        for f in functions
        if f.name.startswith("test") and starts_torchrun(f, helpers) and not marked(f, module_marks)
    ]


def test_the_check_sees_an_unmarked_torchrun_test():
    source = (
        "import pytest, subprocess\n"
        "def run(n):\n"
        "    return subprocess.run(['torchrun', '--nproc_per_node', str(n)])\n"
        "def test_a():\n"
        "    run(2)\n"
        "@pytest.mark.distributed\n"
        "def test_b():\n"
        "    run(2)\n"
        "def test_c():\n"
        "    assert 1\n"
    )
    assert unmarked_torchrun_tests(source) == ["test_a"]
    assert unmarked_torchrun_tests("import pytest\npytestmark = pytest.mark.distributed\n" + source) == []


def test_every_torchrun_test_is_marked_distributed():
    found = {p.name: hits for p in sorted(TESTS.glob("test_*.py")) if (hits := unmarked_torchrun_tests(p.read_text()))}
    assert found == {}


def test_every_trainer_has_a_two_process_run():
    """Each trainer of `TRAINERS` is run on two processes against one by a distributed test: GRPO, PPO and X-Tree by
    their own, the rest by tests/test_distributed_trainers.py (its `NAMES`)."""
    from trainers import TRAINERS

    own = {"grpo": "test_distributed_grpo.py", "ppo": "test_distributed_ppo.py", "xtree": "test_xtree_trainer.py"}
    for name, test in own.items():
        assert "pytest.mark.distributed" in (TESTS / test).read_text(), name  # the marker of the two-process runs
    tree = ast.parse((TESTS / "test_distributed_trainers.py").read_text())
    names = next(
        ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "NAMES"
    )
    assert set(names) | set(own) == set(TRAINERS)
