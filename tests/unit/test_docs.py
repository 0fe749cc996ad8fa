"""The documentation a cloner reads: every relative link in README.md and docs/ leads to a
file of the checkout, and docs/glossary.md names every tensor of the stage contracts (runs in
the pytest process; reads markdown and the contract module)."""
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


# --- the glossary: one name per concept, which the contract follows ---------------------

GLOSSARY = ROOT / "docs" / "glossary.md"
NAME = re.compile(r"`([a-z_][a-z0-9_]*)`")


def _contract_tensors() -> set[str]:
    from omni_serve import contract

    stage_contracts = [v for v in vars(contract).values() if isinstance(v, contract.StageContract)]
    return {t.name for c in stage_contracts for t in (*c.inputs, *c.outputs)}


def _glossary_rows() -> list[list[str]]:
    rows = [line.strip().strip("|").split(" | ") for line in GLOSSARY.read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| concept ")]
    assert rows and all(len(r) == 8 for r in rows), "the glossary table has 8 columns a row"
    return rows


def test_the_readme_and_the_architecture_link_the_glossary():
    assert "docs/glossary.md" in relative_links(ROOT / "README.md")
    assert "glossary.md" in relative_links(ROOT / "docs" / "architecture.md")


def test_every_tensor_of_the_contracts_is_named_in_the_glossary():
    named = set(NAME.findall(GLOSSARY.read_text()))
    missing = sorted(_contract_tensors() - named)
    assert not missing, f"docs/glossary.md does not name the tensors {missing}: add them"


def test_no_old_name_of_the_glossary_is_still_a_tensor_or_a_stage_setting():
    from omni_tools.spec import STAGE_CONFIGS, stage_config_class

    settings = {key for backend in STAGE_CONFIGS
                for key in stage_config_class(backend).model_fields}
    removed = {key for backend in STAGE_CONFIGS
               for key in getattr(stage_config_class(backend), "REMOVED_SETTINGS", {})}
    for row in _glossary_rows():
        concept, old = row[0], set(NAME.findall(row[-1]))
        assert not old & _contract_tensors(), f"{concept}: {old & _contract_tensors()} still a tensor"
        assert not old & settings, f"{concept}: {old & settings} still a stage setting"
    # an old spec key is refused, naming its new one
    assert {"speakers", "default_speaker"} <= removed


def test_the_voice_has_one_name_in_the_contract():
    from omni_serve.contract import AUDIO, OMNI, TALKER

    assert OMNI.VOICE == TALKER.VOICE == AUDIO.VOICE == "voice"
    assert OMNI.CODEC_IDS == TALKER.CODEC_IDS == AUDIO.CODEC_IDS == "codec_ids"
