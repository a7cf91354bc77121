"""Every file path and every `§` the documentation and the code's docstrings and comments cite exists.

Scanned: README.md and every `*.md` under docs/ (their text and their relative links, anchors included),
and in every project `*.py` its comments and docstrings (any other string literal only for the docs it
names, such as an error message pointing at a page). A path is a repo-relative one (`moevement/strategy.py`,
`docs/design/README.md`, optionally `:<line>` or `::<name>`) or a shorter one the docs use beside it
(`storage/commit_file.py`), which must name a file under the citing file's folders or one of the project's
packages. A `§N` right after a Markdown path (`docs/<page>.md §4`) must be a numbered heading of that file; a
quoted heading after it (`docs/<page>.md, "Heading"`) must be a heading of it; a link's `#anchor` must be
the anchor of one of its headings. A `§` not attached to a path is a paper's section and is not checked.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from functools import cache
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("models", "parallelisms", "moevement", "baselines", "simulator", "trainer", "eval", "benchmarks", "tests")
EXTENSIONS = "py|md|toml|json|jsonl|yaml|txt|sh|cfg"
# A path: folders then a file with a known extension, not part of a longer path, a URL or a placeholder.
PATH = re.compile(
    rf"(?<![\w./<>$~-])((?:[\w.-]+/)*[\w-][\w.-]*\.(?:{EXTENSIONS}))(?![\w/<>-])"
    r"(?:(?P<line>:\d+(?:-\d+)?)|::(?P<name>\w+))?"
)
# What may follow a Markdown path: a section number or a quoted heading (comment markers between).
AFTER_DOC = re.compile(r"\s*(?:#\s*)?(?:,\s*)?(?:§\s*(?P<section>\d+(?:\.\d+)*)|\"(?P<heading>[^\"\n]+)\")")
# "`<module>.py`: `name()`", the way the docs name a function or a constant of a module.
NAMED = re.compile(r"`?:\s+`(?:[A-Za-z_]\w*\.)*(?P<name>[A-Za-z_]\w*)(?:\([^)`]*\))?`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


@cache
def tracked_files() -> tuple[str, ...]:
    """The repository's files (git's index, so build outputs and the virtual environment never count)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True)
    return tuple(sorted(p for p in listed.stdout.splitlines() if (ROOT / p).exists()))


def headings(markdown: str) -> list[str]:
    """A Markdown file's headings as written (fenced code left out)."""
    text = re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)
    return [m.group(1) for m in HEADING.finditer(text)]


def titles_of(markdown: str) -> list[str]:
    """What a quoted citation may name: a heading, or a bold run-in title (`**Title.** text`)."""
    bold = re.findall(r"^\s*(?:[-*]\s+|\d+\.\s+)?\*\*([^*\n]+?)\.?\*\*", markdown, re.M)
    return [plain(h) for h in headings(markdown)] + bold


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def plain(heading: str) -> str:
    return heading.replace("`", "").replace("*", "")


class Listing(NamedTuple):
    """A tree's files, their folders and its top-level names."""

    files: frozenset[str]
    folders: frozenset[str]
    top: frozenset[str]

    @classmethod
    def of(cls, files) -> Listing:
        files = frozenset(files)
        folders = frozenset(str(parent) for f in files for parent in Path(f).parents)
        return cls(files, folders, frozenset(f.split("/")[0] for f in files))


@cache
def repo_listing() -> Listing:
    return Listing.of(tracked_files())


def listing(root: Path) -> Listing:
    """The repository's listing, or a scratch tree's as it is now."""
    return repo_listing() if root == ROOT else Listing.of(str(p.relative_to(root)) for p in root.rglob("*"))


def resolve(path: str, citing: str, root: Path) -> str | None:
    """The repo-relative file or folder `path` names, cited from `citing` (repo-relative), or None.

    A path is taken as written, then under the citing file's folders, then under a project package; a path
    that starts with no top-level name (`storage/snapshot.py`, `verdict.py`) may name any file it ends."""
    tree = listing(root)
    path = path.removeprefix("./").rstrip("/")
    candidates = [path]
    folder = Path(citing).parent
    while folder != Path("."):
        candidates.append(str(folder / path))
        folder = folder.parent
    candidates += [f"{package}/{path}" for package in PACKAGES]
    found = next((c for c in candidates if c in tree.files or c in tree.folders), None)
    if found is None and path.split("/")[0] not in tree.top:
        found = next((f for f in sorted(tree.files) if f.endswith("/" + path)), None)
    return found


def cited_in_repo(path: str, root: Path) -> bool:
    """Whether `path` claims to be a file of the repository: a module (`*.py`) that is not an installed
    package's, or any file under a top-level folder of the repository. Not: paths outside it (`../shared`),
    files a run writes (`meta.json`, `outputs/...`), another package's sources (`torch/_ops.py`)."""
    first = path.split("/")[0]
    if path.startswith("../") or first in {"torch", "transformers", "lm_eval", "datasets", "numpy"}:
        return False
    if "/" in path and first in listing(root).top:
        return True
    return path.endswith(".py") or ("/" in path and path.endswith(".md"))


def check_target(target: str, line: str | None, name: str | None, root: Path) -> str | None:
    """Why `target`'s `:line` or `::name` does not exist, or None."""
    text = (root / target).read_text(errors="replace")
    if line:
        last = int(line[1:].split("-")[-1])
        if last > text.count("\n") + 1:
            return f"{target} has {text.count(chr(10)) + 1} lines, not {last}"
    if name and not re.search(
        rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b|^\s*{name}\s*[:=]|^\s*self\.{name}\s*[:=]", text, re.M
    ):
        return f"{target} defines no {name}"
    return None


def check_section(target: str, after: str, root: Path) -> str | None:
    """Why the `§N` or quoted heading right after a cited Markdown file is not in it, or None."""
    found = AFTER_DOC.match(after)
    if not found or not (found["section"] or found["heading"]):
        return None
    titles = titles_of((root / target).read_text())
    if found["section"]:
        number = found["section"]
        if not any(re.match(rf"{re.escape(number)}\.?(\s|$)", t) for t in titles):
            return f"{target} has no section §{number}"
        return None
    quoted = found["heading"]
    if quoted.endswith((".", ",")):
        quoted = quoted[:-1]
    wanted = plain(quoted).lower()
    if not any(t.lower() == wanted or t.lower().startswith((wanted + " ", wanted + ":")) for t in titles):
        return f'{target} has no heading "{quoted}"'
    return None


def check_text(text: str, citing: str, root: Path = ROOT, docs_only: bool = False) -> list[str]:
    """Every broken citation in `text` (from file `citing`), one message each."""
    problems = []
    for found in PATH.finditer(text):
        path = found.group(1)
        if docs_only and not (path.startswith("docs/") or path == "README.md"):
            continue
        if not cited_in_repo(path, root):
            continue
        target = resolve(path, citing, root)
        if target is None:
            problems.append(f"{citing}: {path} does not exist")
            continue
        if not (root / target).is_file():
            continue
        named = NAMED.match(text, found.end())
        name = found["name"] or (named["name"] if named and target.endswith(".py") else None)
        why = check_target(target, found["line"], name, root)
        if why is None and target.endswith(".md"):
            why = check_section(target, text[found.end() : found.end() + 200], root)
        if why:
            problems.append(f"{citing}: {why}")
    return problems


def check_links(markdown: str, citing: str, root: Path = ROOT) -> list[str]:
    """Every relative link of a Markdown file whose file or anchor does not exist."""
    problems = []
    for found in LINK.finditer(markdown):
        link = found.group(1)
        if re.match(r"[a-z]+:", link):
            continue
        path, _, fragment = link.partition("#")
        target = str(Path(citing).parent / path) if path else citing
        target = str(Path(target)).replace("\\", "/")
        parts: list[str] = []
        for part in target.split("/"):
            if part == "..":
                parts = parts[:-1]
            elif part != ".":
                parts.append(part)
        target = "/".join(parts)
        if not (root / target).exists():
            problems.append(f"{citing}: link {link}: {target} does not exist")
        elif fragment and target.endswith(".md"):
            anchors = {anchor(h) for h in headings((root / target).read_text())}
            if fragment not in anchors:
                problems.append(f"{citing}: link {link}: {target} has no heading #{fragment}")
    return problems


def python_citations(source: str) -> tuple[list[str], list[str]]:
    """A module's comments and docstrings, and its other string literals."""
    texts, others = [], []
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                texts.append(doc)
                docstrings.add(doc)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            texts.append(token.string)
        elif token.type == tokenize.STRING:
            try:
                value = ast.literal_eval(token.string)
            except (ValueError, SyntaxError):
                continue
            if isinstance(value, str) and value not in docstrings:
                others.append(value)
    # Comments continue on the next line: join them so that a path and its § may sit on two lines.
    return ["\n".join(texts)], others


def problems_in(relative: str, root: Path = ROOT) -> list[str]:
    """Every broken citation of one file."""
    text = (root / relative).read_text()
    if relative.endswith(".md"):
        return check_text(text, relative, root) + check_links(text, relative, root)
    texts, others = python_citations(text)
    if relative == "tests/test_doc_references.py":
        others = []  # its own wrong citations, on purpose
    found = [p for t in texts for p in check_text(t, relative, root)]
    return found + [p for t in others for p in check_text(t, relative, root, docs_only=True)]


def cited_files() -> list[str]:
    """README.md, docs' Markdown, and every project Python file."""
    return [
        p
        for p in tracked_files()
        if p == "README.md" or (p.startswith("docs/") and p.endswith(".md")) or p.endswith(".py")
    ]


def test_every_cited_path_and_section_exists():
    problems = [p for relative in cited_files() for p in problems_in(relative)]
    assert not problems, "\n".join(problems)


def test_a_wrong_citation_is_found(tmp_path):
    """The checker fails on each kind of wrong citation, in Markdown and in a docstring or a comment."""
    (tmp_path / "docs" / "design").mkdir(parents=True)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "docs" / "design" / "page.md").write_text("# Page\n\n## 2. Second\n\n### A heading\n")
    (tmp_path / "pkg" / "mod.py").write_text("def f():\n    pass\n")
    good = 'docs/design/page.md §2, docs/design/page.md "A heading", pkg/mod.py:2, pkg/mod.py::f'
    assert check_text(good, "README.md", tmp_path) == []
    wrong = {
        "docs/design/gone.md": "docs/design/gone.md does not exist",
        "docs/design/page.md §4": "docs/design/page.md has no section §4",
        'docs/design/page.md, "No such heading"': 'docs/design/page.md has no heading "No such heading"',
        "pkg/mod.py:9": "pkg/mod.py has 3 lines, not 9",
        "pkg/mod.py::g": "pkg/mod.py defines no g",
        "pkg/other.py": "pkg/other.py does not exist",
    }
    for citation, why in wrong.items():
        assert check_text(f"see {citation}.", "README.md", tmp_path) == [f"README.md: {why}"], citation
    (tmp_path / "docs" / "x.md").write_text(
        "[ok](design/page.md#2-second) [bad](design/page.md#3-third) [gone](design/none.md)\n"
    )
    assert problems_in("docs/x.md", tmp_path) == [
        "docs/x.md: design/none.md does not exist",
        "docs/x.md: link design/page.md#3-third: docs/design/page.md has no heading #3-third",
        "docs/x.md: link design/none.md: docs/design/none.md does not exist",
    ]
    (tmp_path / "pkg" / "cites.py").write_text(
        '"""Module (docs/design/page.md\n§5)."""\n\n# see pkg/mod.py::g\nERROR = "see docs/design/old.md"\n'
        'PATH = "pkg/not_a_citation.py"\n'
    )
    assert problems_in("pkg/cites.py", tmp_path) == [
        "pkg/cites.py: docs/design/page.md has no section §5",
        "pkg/cites.py: pkg/mod.py defines no g",
        "pkg/cites.py: docs/design/old.md does not exist",
    ]
