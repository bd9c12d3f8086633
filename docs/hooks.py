"""mkdocs hook: links from a page to repository files outside docs/.

The pages link to the files they cite (`[table](../bench/results/quickstart_kl/table.md)`, `../../trainers/base.py`);
those files are not part of the site. A relative link whose target lies outside docs/ *and exists in the repository*
becomes its repository path as code text (`` `bench/results/quickstart_kl/table.md` ``): the site has no forge URL to
link to, and a reader of the site has the repository. A target that does not exist is left as written, so
`mkdocs build --strict` fails on it, as it does on a missing page or anchor inside docs/.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# [text](target) or [text](target#anchor), target relative (not a URL, not a bare #anchor, not absolute)
LINK = re.compile(r"\[([^\]]*)\]\((?![a-z]+:|#|/)([^)\s#]+)(#[^)\s]*)?\)")


def repository_path(target: str, page_path: Path, docs_dir: Path, root: Path) -> str | None:
    """`target` as a path relative to `root` when it points outside `docs_dir` to an existing file or folder, else
    None (a page inside docs/ that mkdocs checks itself, or a broken link that mkdocs reports)."""
    resolved = Path(os.path.normpath(page_path.parent / target))  # not .resolve(): a symlinked copy stays inside root
    if resolved.is_relative_to(docs_dir) or not resolved.is_relative_to(root) or not resolved.exists():
        return None
    return resolved.relative_to(root).as_posix() + ("/" if resolved.is_dir() else "")


def on_page_markdown(markdown: str, page, config, files) -> str:
    docs_dir = Path(config["docs_dir"])  # absolute, as mkdocs makes it
    root = Path(config["config_file_path"]).parent  # the repository: mkdocs.yml sits at its root

    def rewrite(m: re.Match) -> str:
        text, target = m.group(1), m.group(2)  # an anchor into a repository file (group 3) has no code form
        path = repository_path(target, Path(page.file.abs_src_path), docs_dir, root)
        if path is None:
            return m.group(0)
        # the text alone when it already names the path (`[bench/results/x/](../bench/results/x/table.md)`)
        named = text.strip("`").rstrip("/")
        return f"`{path}`" if path == named or path.startswith(named + "/") else f"{text} (`{path}`)"

    return LINK.sub(rewrite, markdown)
