"""The documentation site (mkdocs.yml over docs/) builds with `mkdocs build --strict`, as .ci/run builds it, and a
broken link fails that build: a missing page, a missing anchor, a missing repository file. docs/hooks.py turns only
links to repository files that exist into their paths."""

import shutil
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="the docs extra (pip install -e '.[docs]'); .ci/run installs it")
from mkdocs.commands.build import build  # noqa: E402
from mkdocs.config import load_config  # noqa: E402
from mkdocs.exceptions import Abort  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BROKEN = ("no-such-page.md", "methods/grpo.md#no-such-anchor", "../bench/results/no_such_bench/table.md")


def build_site(config_file: Path, site_dir: Path) -> None:
    build(load_config(str(config_file), strict=True, site_dir=str(site_dir)))


def test_site_builds_strictly(tmp_path):
    build_site(ROOT / "mkdocs.yml", tmp_path)
    assert (tmp_path / "configuration" / "index.html").exists() and not (tmp_path / "hooks.py").exists()
    # a link to a repository file is shown as its path (docs/environments.md cites bench/results/)
    assert "<code>bench/results/" in (tmp_path / "environments" / "index.html").read_text()


def test_a_broken_link_fails_the_build(tmp_path, caplog):
    """A copy of the repository (its files linked, docs/ and mkdocs.yml copied) whose home page gains three broken
    links: each is reported and the strict build aborts."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in ("docs", "mkdocs.yml", "site"):
            (repo / entry.name).symlink_to(entry)
    shutil.copytree(ROOT / "docs", repo / "docs")
    shutil.copy(ROOT / "mkdocs.yml", repo / "mkdocs.yml")
    index = repo / "docs" / "index.md"
    index.write_text(index.read_text() + "".join(f"\n[broken]({link})\n" for link in BROKEN))
    with pytest.raises(Abort, match="warnings in strict mode"):
        build_site(repo / "mkdocs.yml", tmp_path / "site")
    reported = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(reported) == len(BROKEN), reported  # the copy's other links all still resolve
    for link in BROKEN:
        assert any(f"link '{link}'" in message for message in reported), (link, reported)
