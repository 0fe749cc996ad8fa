"""omni_client: session id and history tensors of an omni request."""
from __future__ import annotations

import json

import pytest

from omni_client import BadRequestError
from omni_client._pipeline_io import omni_inputs
from omni_serve.contract import OMNI


def _by_name(inputs):
    return {t.name(): t for t in inputs}


def test_session_and_history_become_their_tensors():
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    inputs = _by_name(omni_inputs("and then?", session_id="s-1", history=turns))
    assert inputs[OMNI.SESSION_ID].datatype() == "BYTES" and inputs[OMNI.SESSION_ID].shape() == [1]
    assert inputs[OMNI.HISTORY].shape() == [1]
    # the serialized BYTES tensor (length prefix + the JSON) tritonclient will send
    assert inputs[OMNI.HISTORY]._raw_content.endswith(json.dumps(turns).encode())


def test_no_session_no_history_no_tensors():
    inputs = _by_name(omni_inputs("hi"))
    assert OMNI.SESSION_ID not in inputs and OMNI.HISTORY not in inputs


@pytest.mark.parametrize("history", ["user: hi", [("user", "hi")]])
def test_history_must_be_a_list_of_turn_mappings(history):
    with pytest.raises(BadRequestError, match="history must be a list"):
        omni_inputs("hi", history=history)
