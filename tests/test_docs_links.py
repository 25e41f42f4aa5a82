"""Every relative link in README.md and docs/*.md points to a file that exists.

A link with an anchor (`docs/x.md#a-heading`, or `#a-heading` in the same
page) must also name a heading of that page, by GitHub's rule for heading
anchors. Links to other sites are not checked (the tests reach no network).

The project files, folders and modules that README.md and docs/*.md name in
inline code (`worker/outbox.py`, `step/outer.py`, `paramserver/ops/page/`,
`paramserver.server.step.merge`) must exist too, except in docs/results.md,
whose dated entries name what existed when they were measured.
"""

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of every heading of `page` (repeats get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    """Relative link targets of `page`, outside code blocks."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_there_are_pages_to_check():
    assert (ROOT / "README.md").exists()
    assert len(PAGES) >= 7, [p.name for p in PAGES]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path):
    broken = []
    for target in links(page):
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    assert not broken, f"{page.relative_to(ROOT)} has broken links: " + "; ".join(broken)


# Names in inline code: the project files, folders and modules a page names must exist.
# docs/results.md is a dated log (its entries name what existed when they were measured).
CURRENT_PAGES = [p for p in PAGES if p.name != "results.md"]
CODE_SPAN = re.compile(r"`([^`]+)`")  # a code span may wrap a line
# a path: folders then a file of the project's kinds, or folders only (`paramserver/ops/page/`);
# user files (`cluster.toml`, `runs/x/summary.json`) have other suffixes or a placeholder
PATH_NAME = re.compile(
    r"(?<![\w./<>~$-])((?:[A-Za-z_][\w.-]*/)*[A-Za-z_][\w-]*\.(?:py|md|sh|js|html|css)"
    r"|(?:[A-Za-z_][\w.-]*/)+)(?![\w/<>-])"
)
MODULE_NAME = re.compile(r"(?<![\w.])((?:codec|paramserver|worker|bench)(?:\.[A-Za-z_]\w*)+)")
NOT_PROJECT = {".git", ".venv", "runs", "__pycache__", "node_modules"}


def code_spans(page: Path) -> list[str]:
    """The inline code of `page`, outside fenced blocks, without URLs."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return [re.sub(r"\w+://\S*", "", span) for span in CODE_SPAN.findall(text)]


def project_paths() -> set[str]:
    """Every file ('a/b.py') and folder ('a/b/') of the checkout, relative to its root."""
    out: set[str] = set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in NOT_PROJECT and not d.startswith(".")]
        rel = Path(folder).relative_to(ROOT).as_posix()
        prefix = "" if rel == "." else rel + "/"
        out.update(prefix + d + "/" for d in dirs)
        out.update(prefix + f for f in files)
    return out


def module_file(parts: list[str]) -> Path | None:
    """The source of the dotted module `parts`, or None."""
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def module_problem(dotted: str) -> str | None:
    """Why `dotted` (a module, or a module's name) does not exist, or None when it does.

    A name counts when the module's source mentions it (names built on first use,
    `worker.join`, are in its `__getattr__`).
    """
    parts = dotted.split(".")
    k = len(parts)
    while k and module_file(parts[:k]) is None:
        k -= 1
    if k == len(parts):
        return None
    if k == 0:
        return "no such package"
    name = parts[k]
    if re.search(rf"\b{re.escape(name)}\b", module_file(parts[:k]).read_text(encoding="utf-8")):
        return None
    return f"{'.'.join(parts[:k])} has no module or name {name}"


@pytest.mark.parametrize("page", CURRENT_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_files_and_modules_exist(page: Path):
    paths = project_paths()
    missing = []
    for span in code_spans(page):
        for name in PATH_NAME.findall(span):
            if any(re.search("[A-Z]", part) for part in name.split("/")[:-1]):
                continue  # a placeholder folder (`OUT/islands/ISLAND/`, `shard-N/`)
            # a path from the root, or the tail of one (`step/outer.py` in a list of the shard's)
            if not any(p == name or p.endswith("/" + name) for p in paths):
                missing.append(f"{name}: no such file or folder")
        for dotted in MODULE_NAME.findall(span):
            problem = module_problem(dotted)
            if problem:
                missing.append(f"{dotted}: {problem}")
    assert not missing, f"{page.relative_to(ROOT)} names what does not exist: " + "; ".join(
        sorted(set(missing))
    )
