"""Citations in code, tests, configs and docs resolve to the method pages in docs/methods/.

A citation is a page name followed by labels: `mpo.md Eq. 7`, `t1.md D10`, `draco.md §4.6`, `conventions.md C4`,
`credit-interface.md Eq. I-2, G4`. Each label must be defined on its page: an equation as `(Eq. N)`, a decision,
convention or guarantee as `**DN**` / `**CN**` / `**GN**` / `**PN**`, a section as a heading `## N.` / `### N.M`.
"""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ROOT / "docs" / "methods"

LABEL = r"(?:Eq\.\s?(?:I-)?\d+(?:[-–]\d+)?|[DCGP]\d+|§\d+(?:\.\d+)?(?:[-–]\d+(?:\.\d+)?)?)"
CITATION = re.compile(
    rf"\b(grpo|ppo|t1|mpo|draco|gigpo|taspo|alignopsd|beta-opsd|funnel|envsched|xtree|routing-replay|credit-interface|teacher-pass|conventions)\.md`?"
    rf"((?:\s*(?:,|and|or)?\s*{LABEL}(?:\s+items?\s+\d+(?:[-–]\d+)?(?:,\s*\d+(?:[-–]\d+)?)*)?)*)"
)


def tracked_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.yaml"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / f for f in out if not f.startswith("bench/results/")]


def expand(label: str) -> list[str]:
    """`Eq. 6-8` -> anchors for 6, 7, 8; `§4.5-4.7` -> 4.5 and 4.7; `D4` -> D4."""
    label = label.replace("–", "-")
    if label.startswith("Eq."):
        body = label[3:].strip()
        prefix = "I-" if body.startswith("I-") else ""
        body = body.removeprefix("I-")
        lo, _, hi = body.partition("-")
        return [f"Eq. {prefix}{n}" for n in range(int(lo), int(hi or lo) + 1)]
    if label.startswith("§"):
        return ["§" + part for part in label[1:].split("-")]
    return [label]


def defined(page_text: str, anchor: str) -> bool:
    if anchor.startswith("Eq. "):
        return f"({anchor})" in page_text
    if anchor.startswith("§"):
        number = re.escape(anchor[1:])
        return re.search(rf"^#+ {number}[. ]", page_text, flags=re.M) is not None
    return f"**{anchor}**" in page_text


def citations() -> list[tuple[str, str, str]]:
    found = []
    for path in tracked_files():
        text = path.read_text(encoding="utf-8")
        for m in CITATION.finditer(text):
            for label in re.findall(LABEL, m.group(2)):
                page = "conventions.md" if label.startswith("C") else f"{m.group(1)}.md"  # C-labels live there
                for anchor in expand(label):
                    found.append((str(path.relative_to(ROOT)), page, anchor))
    return found


OUTSIDE = re.compile("spec" + "s/|CLARIFI" + "CATIONS|\\.\\./shared")  # split: this file must not match itself


def test_no_citation_points_outside_the_repository():
    bad = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in tracked_files()
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert bad == []


def test_the_method_pages_exist():
    names = {p.name for p in PAGES.glob("*.md")}
    cited = {page for _, page, _ in citations()}
    assert cited <= names, f"cited pages missing from docs/methods/: {sorted(cited - names)}"


@pytest.mark.parametrize("page", sorted({page for _, page, _ in citations()}))
def test_every_cited_label_is_defined_on_its_page(page):
    path = PAGES / page
    if not path.exists():
        pytest.fail(f"docs/methods/{page} does not exist")
    text = path.read_text(encoding="utf-8")
    missing = sorted(
        {f"{anchor} (cited in {src})" for src, p, anchor in citations() if p == page and not defined(text, anchor)}
    )
    assert missing == [], f"docs/methods/{page} lacks: " + "; ".join(missing)


def test_the_citation_parser_on_literal_text():
    text = "see mpo.md Eq. 6-8 and D9; t1.md §4.6, D14 and credit-interface.md Eq. I-2, G4 (conventions.md C4)"
    labels = [(m.group(1), re.findall(LABEL, m.group(2))) for m in CITATION.finditer(text)]
    assert labels == [
        ("mpo", ["Eq. 6-8", "D9"]),
        ("t1", ["§4.6", "D14"]),
        ("credit-interface", ["Eq. I-2", "G4"]),
        ("conventions", ["C4"]),
    ]
    assert expand("Eq. 6-8") == ["Eq. 6", "Eq. 7", "Eq. 8"]
    assert expand("§4.5-4.7") == ["§4.5", "§4.7"]
    assert defined("## 4. Equations\n### 4.6 Audit\n", "§4.6") and not defined("## 4. Eq\n", "§4.6")
    assert defined("x = y (Eq. 3)", "Eq. 3") and not defined("x = y (Eq. 31)", "Eq. 3")
