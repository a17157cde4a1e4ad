"""The documents a user reads first: every relative link and anchor in README.md and docs/*.md
resolves, and CHANGELOG.md keeps the Keep a Changelog form (one section per release, each heading
once, one line per change)."""

from __future__ import annotations

import re

from conftest import ROOT

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_every_relative_link_and_anchor_resolves() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links in code blocks are code
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto: not checked offline
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_changelog_is_in_keep_a_changelog_form() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[([^\]]+)\]", text, flags=re.M)
    assert releases[0] == "Unreleased" and "0.1.0" in releases and len(releases) == len(set(releases))
    for body in re.split(r"^## ", text, flags=re.M)[1:]:
        headings = re.findall(r"^### (.+)$", body, flags=re.M)
        assert len(headings) == len(set(headings)), headings  # each heading once per release
        assert set(headings) <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}, headings
    lines = text.splitlines()
    continued = [line for line in lines if line.startswith("  ") and line.strip()]
    assert not continued, continued[:3]  # one line per change


def test_every_route_in_the_readme_points_to_an_example_a_test_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    examples = sorted(set(re.findall(r"examples/(\w+\.py)", readme)))
    assert len(examples) >= 6, examples  # Lightning, plain, Accelerate, Trainer, Fabric, zero-code
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    for name in examples:
        assert (ROOT / "examples" / name).is_file(), name
        assert f'"{name}"' in tests or f"'{name}'" in tests or f"/{name}" in tests, f"no test runs examples/{name}"
    assert "bash scripts/test.sh" in readme  # CI's .ci/run calls it
