"""The documentation a cloner reads: every relative link in README.md and docs/ leads to a
file of the checkout (runs in the pytest process; reads markdown only)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "docker" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(page: Path) -> list[str]:
    return [target for target in LINK.findall(page.read_text())
            if "://" not in target and not target.startswith(("#", "mailto:"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_into_the_checkout(page):
    for target in relative_links(page):
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.is_relative_to(ROOT) and path.exists(), f"{page.name}: dead link {target}"


def test_the_readme_links_the_architecture():
    assert "docs/architecture.md" in relative_links(ROOT / "README.md")
