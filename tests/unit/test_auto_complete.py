"""auto_complete_config: a bare config.pbtxt of each stage backend is completed from its
contract, and a generated one is left as it is. Runs Triton's own ModelConfig class (the
Python backend's triton_python_backend_utils.py, installed by set-up)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from google.protobuf import json_format

from omni_serve.contract import CONTRACTS, DEFAULT_MAX_BATCH_SIZE
from omni_serve.tritonio import auto_complete
from omni_tools import gen_repo, spec

PB_UTILS = (Path(__file__).resolve().parents[2] / ".venv" / "triton" / "backends" / "python"
            / "triton_python_backend_utils.py")


@pytest.fixture(scope="module")
def model_config_class():
    loaded = importlib.util.spec_from_file_location("triton_pb_utils_for_test", PB_UTILS)
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module.ModelConfig


def _bare(backend: str) -> dict:  # what Triton hands over for `backend: "<backend>"` alone
    return {"name": "m", "backend": backend, "max_batch_size": 0, "input": [], "output": []}


@pytest.mark.parametrize("backend", sorted(CONTRACTS))
def test_a_bare_config_gets_the_contract(model_config_class, backend):
    contract = CONTRACTS[backend]
    done = auto_complete(model_config_class(json.dumps(_bare(backend))), contract).as_dict()
    assert [t["name"] for t in done["input"]] == [t.name for t in contract.inputs]
    assert [t["name"] for t in done["output"]] == [t.name for t in contract.outputs]
    optional = {t["name"] for t in done["input"] if t.get("optional")}
    assert optional == {t.name for t in contract.inputs if t.optional}
    assert done.get("model_transaction_policy", {}).get("decoupled", False) is contract.decoupled
    if contract.batching == "engine":
        assert done["max_batch_size"] == 0 and "dynamic_batching" not in done
    else:
        assert done["max_batch_size"] == DEFAULT_MAX_BATCH_SIZE and "dynamic_batching" in done


@pytest.mark.parametrize("preset", ["omni-chat", "text-to-image"])
def test_a_generated_config_is_left_as_it_is(model_config_class, preset):
    plans = gen_repo.plan(spec.load_preset(preset), resolve_models=False)
    for plan in plans:
        generated = json_format.MessageToDict(plan.config, preserving_proto_field_name=True)
        generated.setdefault("max_batch_size", 0)
        before = json.loads(json.dumps(generated))
        done = auto_complete(model_config_class(json.dumps(generated)),
                             CONTRACTS[generated["backend"]]).as_dict()
        for key in ("input", "output", "max_batch_size", "dynamic_batching"):
            assert done.get(key) == before.get(key), (plan.name, key)


def test_a_config_naming_an_input_keeps_its_own_entry(model_config_class):
    config = _bare("omni_llm")
    config["input"] = [{"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]}]
    done = auto_complete(model_config_class(json.dumps(config)), CONTRACTS["omni_llm"]).as_dict()
    assert [t["name"] for t in done["input"]].count("text_input") == 1
    assert done["input"][0] == config["input"][0]
