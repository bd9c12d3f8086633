"""Every decision id the code cites resolves where it is read: an id is qualified by its page (`grpo.md D14`,
`t1.md Eq. 1, D10`) or a method's name (`DRACO D9`), or the module's docstring names the page its bare ids belong to
("Decision ids (`Dn`) without a page are docs/methods/<page>.md's"), and that page exists and states the decision."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULES = sorted(p for folder in ("agent_trl", "trainers", "rewards", "envs") for p in (ROOT / folder).rglob("*.py"))
PAGE = r"(?:[a-z0-9_-]+\.md(?:#[\w-]+)?)"
NAME = r"(?:DRACO|TASPO|GiGPO|MPO|T1|PPO|X-Tree|EnvSched|AlignOPSD|Funnel|routing-replay|R3|GRPO)"
ITEM = r"(?:§[\d.]+|Eq\.\s*[\w.-]+|[DC]\d+|I-\d+|\d+(?:-\d+)?)"
QUALIFIED = re.compile(rf"(?:{PAGE}|{NAME})(?:[\s,;]*(?:and\s+)?{ITEM})*[\s,;]*(?:and\s+)?$")
DEFAULT = re.compile(r"Decision ids \(`Dn`\) without a page are docs/methods/([a-z0-9_-]+)\.md's")


def bare_ids(text: str) -> list[str]:
    """The decision ids of `text` that neither a page nor a method's name qualifies (line breaks read as spaces)."""
    found = []
    for m in re.finditer(r"(?<![\w.#/-])D\d+\b", text):
        window = re.sub(r"\s*\n\s*(?:#\s*)?", " ", text[max(0, m.start() - 90) : m.start()])
        if not QUALIFIED.search(window):
            found.append(m.group(0))
    return found


def test_the_reading_of_an_id_is_the_one_intended():
    assert bare_ids("the mask (D12)") == ["D12"]
    assert bare_ids("(grpo.md D12, D14) and (t1.md Eq. 1, D10), DRACO D9") == []
    assert bare_ids("see docs/methods/grpo.md\n    # D15 here") == []


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_bare_decision_ids_have_a_page(path):
    text = path.read_text()
    bare = bare_ids(text)
    if not bare:
        return
    docstring = ast.get_docstring(ast.parse(text)) or ""
    default = DEFAULT.search(docstring)
    assert default, f"{path.name} cites {sorted(set(bare))} without a page and names no default page"
    page = (ROOT / "docs" / "methods" / f"{default.group(1)}.md").read_text()
    stated = set(re.findall(r"\*\*(D\d+)\*\*", page))
    assert set(bare) <= stated, f"{path.name}: {sorted(set(bare) - stated)} are not decisions of {default.group(1)}.md"
