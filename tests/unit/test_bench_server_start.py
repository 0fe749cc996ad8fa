"""omni-bench server-start: how its sides are named and set."""
from __future__ import annotations

import argparse

import pytest

from omni_tools.bench.server_start import DEFAULT_SIDES, parse_side


def test_a_side_is_a_name_and_its_environment():
    assert parse_side("spawned:OMNI_VLLM_ENGINE_FORK=0") == (
        "spawned", {"OMNI_VLLM_ENGINE_FORK": "0"})
    assert parse_side("forked:") == ("forked", {})
    assert parse_side("both:A=1,B=x=y") == ("both", {"A": "1", "B": "x=y"})
    assert [parse_side(s)[0] for s in DEFAULT_SIDES] == ["spawned", "forked"]


@pytest.mark.parametrize("text", [":A=1", "x:A", "x:=1"])
def test_a_malformed_side_is_refused_naming_it(text):
    with pytest.raises(argparse.ArgumentTypeError, match="--side"):
        parse_side(text)
