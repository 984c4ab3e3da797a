"""Every relative link in the project's Markdown (README.md, docs/, the packages' READMEs) reaches a file that exists
and, where it names an anchor (`docs/benchmarks.md#suffix-decoding`), a heading of that file.

Anchors are GitHub's: the heading's text lowercased, characters other than letters, digits, spaces, hyphens and
underscores dropped, spaces turned into hyphens, and `-1`, `-2`, ... appended to repeats. Links to web addresses
are not followed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("launcher", "server", "router", "kernels", "proto", "benchmark", "scripts", "integration-tests")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def markdown_files() -> list[Path]:
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    for package in PACKAGES:
        files += sorted(p for p in (REPO / package).rglob("*.md") if "node_modules" not in p.parts)
    return [f for f in files if f.is_file()]


def outside_code(text: str) -> str:
    """The text without its fenced code blocks (a heading-like `# comment` in a shell block is not a heading)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return "\n".join(lines)


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file."""
    seen: dict[str, int] = {}
    out = set()
    for line in outside_code(path.read_text()).splitlines():
        if not re.match(r"#{1,6} ", line):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_reach_a_file_and_a_heading(path: Path) -> None:
    broken = []
    for target in LINK.findall(outside_code(path.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with that anchor in {linked.relative_to(REPO)}")
    assert broken == [], f"broken links in {path.relative_to(REPO)}"
