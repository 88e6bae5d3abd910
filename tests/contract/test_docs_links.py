"""The documentation's relative links resolve: every Markdown link or image in README.md,
CHANGELOG.md and docs/*.md that points inside the repository names a file that exists, and an
`#anchor` into a Markdown file names one of its headings (GitHub's slugs). The README stays a
front door: under 15,000 characters.

Pure Python and fast: no Markdown library, only what GitHub's renderer does for these files.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])
README_MAX_CHARS = 15_000

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
# [text](target) and ![alt](target); the text may hold inline code but no nested brackets
LINK = re.compile(r"!?\[(?P<text>[^\[\]]*)\]\((?P<target>[^()\s]*(?:\([^()\s]*\)[^()\s]*)*)"
                  r"(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(?P<title>.+?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) for every line outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def github_slug(title: str) -> str:
    """The anchor GitHub gives a heading: the rendered text, lower-cased, punctuation dropped
    (letters, digits, '_', '-' and spaces kept), spaces turned into '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link counts as its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def heading_slugs(path: Path) -> set[str]:
    """Every anchor of a Markdown file; a repeated heading gets -1, -2, ... as on GitHub."""
    slugs: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match["title"])
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        slugs.add(slug if count == 0 else f"{slug}-{count}")
    return slugs


def markdown_links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link and image outside code."""
    links = []
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            links.append((number, match["target"].strip("<>")))
    return links


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Each relative link of `path` whose file or heading does not exist: 'line: target (why)'."""
    broken = []
    for number, target in markdown_links(path):
        if not target or SCHEME.match(target):
            continue  # external (https:, mailto:): not checked offline
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        shown = linked.relative_to(root) if linked.is_relative_to(root) else linked
        if not linked.exists():
            broken.append(f"{number}: {target} (no such file {shown})")
        elif anchor and linked.suffix == ".md" and anchor not in heading_slugs(linked):
            broken.append(f"{number}: {target} (no heading #{anchor} in {shown})")
    return broken


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert path.exists(), f"{path.relative_to(ROOT)} is missing"
    broken = broken_links(path)
    assert not broken, f"broken links in {path.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_the_docs_link_to_each_other():
    """The pages are found from the README: each docs page is linked from it."""
    readme_targets = {target.partition("#")[0] for _, target in markdown_links(ROOT / "README.md")}
    for page in (ROOT / "docs").glob("*.md"):
        assert f"docs/{page.name}" in readme_targets, f"README.md does not link docs/{page.name}"


def test_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text) < README_MAX_CHARS, (
        f"README.md has {len(text)} characters; move detail into docs/ (limit {README_MAX_CHARS})")


@pytest.mark.parametrize("title, slug", [
    ("Quick start", "quick-start"),
    ("The engine pod: `quire engine`", "the-engine-pod-quire-engine"),
    ("`max_tokens` (vLLM-compatible)", "max_tokens-vllm-compatible"),
    ("Quire engines on vLLM's KV-event wire", "quire-engines-on-vllms-kv-event-wire"),
    ("Python API, in vLLM's shape", "python-api-in-vllms-shape"),
    ("See [the router](router.md) first", "see-the-router-first"),
])
def test_github_slug(title, slug):
    assert github_slug(title) == slug


def test_a_broken_link_is_found(tmp_path):
    """The checker itself: a missing file and a missing heading are both reported."""
    (tmp_path / "other.md").write_text("# Present heading\n\ntext\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#present-heading) [gone](missing.md) [bad](other.md#absent)\n"
                    "`[in code](nowhere.md)` [web](https://example.com/x)\n"
                    "```\n[fenced](nowhere.md)\n```\n", encoding="utf-8")
    assert broken_links(page, root=tmp_path.resolve()) == [
        "1: missing.md (no such file missing.md)",
        "1: other.md#absent (no heading #absent in other.md)"]
