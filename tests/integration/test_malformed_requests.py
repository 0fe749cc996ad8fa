"""Malformed requests to every model of every preset, against the real servers (hypothesis).

For each preset's session server, the models come from its repository index and their
inputs from their served configs (tests/integration/malformed.py finds each one's recipe),
so a new model or input is covered, or reported as not covered, without editing this
file. Every malformed request (wrong datatypes and shapes, missing and unknown inputs,
and per input: random bytes as media, huge and negative numbers, NaN/inf, non-UTF-8
strings, oversized strings and arrays, bad JSON) must get INVALID_ARG naming the
offending input, and the valid request sent right after it must succeed with a real
result: on the same stream for a decoupled model, at the same time (so that the two can
share a batch) for a batched one. Examples are derandomized: every run sends the same.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from tritonclient.utils import triton_to_np_dtype

from .malformed import (
    WIRE_TYPES,
    Attack,
    Caller,
    Catalog,
    InputSpec,
    Recipe,
    T,
    discover,
    error_code,
    names_field,
    served_models,
)

pytestmark = pytest.mark.integration

PRESETS = {"text-chat": "text_chat_server", "text-to-image": "text_to_image_server",
           "omni-chat": "omni_chat_server"}


def examples(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    print_blob=False,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


class Served:
    def __init__(self, preset: str, server, caller: Caller, catalog: Catalog):
        self.preset, self.server, self.caller, self.catalog = preset, server, caller, catalog


@pytest.fixture(scope="module", params=list(PRESETS))
def served(request):
    server = request.getfixturevalue(PRESETS[request.param])
    caller = Caller(server.grpc_url, server.http_url)
    catalog = discover(caller, served_models(server.grpc_url))
    try:
        yield Served(request.param, server, caller, catalog)
    finally:
        for recipe in catalog.recipes.values():
            if recipe.after is not None:
                recipe.after()
        caller.close()


# --- sending and judging --------------------------------------------------------------

def refused_then_served(served: Served, recipe: Recipe, attack: Attack, protocol: str) -> None:
    """`attack` gets INVALID_ARG naming its input; the valid request with it is served."""
    model = recipe.model
    note(f"{model.name} ({recipe.role}) over {protocol}: {attack.what}; inputs "
         + ", ".join(f"{n} {t.datatype}{list(t.array.shape)}" for n, t in attack.request.items()))
    if model.decoupled:
        bad = served.caller.stream(model, attack.request, attack.parameters)
        good = served.caller.stream(model, recipe.valid())
    else:
        bad, good = served.caller.infer_all(model, [attack.request, recipe.valid()], protocol,
                                            recipe.outputs)
    assert bad.error is not None, f"{model.name} accepted {attack.what}: {bad.outputs}"[:2000]
    message = bad.error.message()
    assert error_code(bad.error) == "INVALID_ARG", f"{model.name}, {attack.what}: {message}"
    assert any(names_field(message, f) for f in attack.fields), (
        f"{model.name}, {attack.what}: the error does not name {' or '.join(attack.fields)}: "
        f"{message}")
    recipe.check(good)


def check_property(served: Served, strategy_of, n: int) -> None:
    """Run `n` examples of `strategy_of(recipe)` (None: nothing to send) per model."""
    assert served.catalog.recipes, "no model to test"
    for recipe in served.catalog.recipes.values():
        strategy = strategy_of(recipe)
        if strategy is None:
            continue
        protocols = st.just("grpc") if recipe.model.decoupled else st.sampled_from(["http", "grpc"])

        @examples(n)
        @given(attack=strategy, protocol=protocols)
        def prop(attack, protocol):
            refused_then_served(served, recipe, attack, protocol)

        prop()
    assert_all_serving(served)


def assert_all_serving(served: Served) -> None:
    """The server process lives and every model of its index is READY and answers."""
    assert served.server.proc.poll() is None, f"tritonserver died: {served.server.log_tail()}"
    states = {m["name"]: m.get("state") for m in served.caller.grpc.get_model_repository_index(
        as_json=True)["models"]}
    assert set(states.values()) == {"READY"}, states
    for recipe in served.catalog.recipes.values():
        model = recipe.model
        if model.decoupled:
            recipe.check(served.caller.stream(model, recipe.valid()))
        else:
            (outcome,) = served.caller.infer_all(model, [recipe.valid()], "http", recipe.outputs)
            recipe.check(outcome)


# --- malformations every input has, from the config -------------------------------------

def _filler(shape: tuple[int, ...], datatype: str) -> np.ndarray:
    if datatype == "BYTES":
        return np.full(shape, b"1", dtype=np.object_)
    return np.ones(shape, dtype=triton_to_np_dtype(datatype))


def _item_shape(recipe: Recipe, spec: InputSpec) -> tuple[int, ...]:
    valid = recipe.valid().get(spec.name)
    return valid.array.shape if valid is not None else tuple(1 if d < 0 else d for d in spec.dims)


def _inputs(recipe: Recipe) -> st.SearchStrategy[InputSpec]:
    return st.sampled_from([recipe.model.inputs[n] for n in sorted(recipe.model.inputs)])


def wrong_datatypes(recipe: Recipe) -> st.SearchStrategy[Attack]:
    def attack(spec: InputSpec, datatype: str) -> Attack:
        value = T(_filler(_item_shape(recipe, spec), datatype), datatype)
        return recipe.attack(spec.name, value, f"{spec.name} as {datatype}, not {spec.datatype}")

    return _inputs(recipe).flatmap(lambda spec: st.sampled_from(
        [t for t in WIRE_TYPES if t != spec.datatype]).map(lambda dt: attack(spec, dt)))


def wrong_shapes(recipe: Recipe) -> st.SearchStrategy[Attack]:
    """Another rank, another size of a fixed dim, or (batching models) another batch size
    than the other inputs'."""
    model = recipe.model

    def shapes(spec: InputSpec) -> st.SearchStrategy[tuple[tuple[int, ...], bool]]:
        item = _item_shape(recipe, spec)
        options = [st.integers(1, 3).map(lambda k: (item + (1,) * k, False))]
        if item:
            options.append(st.just((item[:-1], False)))
        fixed = [i for i, d in enumerate(spec.dims) if d > 0]
        if fixed:
            options.append(st.tuples(st.sampled_from(fixed), st.integers(0, 9)).filter(
                lambda ik: ik[1] != spec.dims[ik[0]]).map(
                lambda ik: (item[:ik[0]] + (ik[1],) + item[ik[0] + 1:], False)))
        if model.batched and len(recipe.valid()) > 1:
            options.append(st.integers(2, model.max_batch_size).map(lambda b: ((b, *item), True)))
        return st.one_of(*options)

    def attack(spec: InputSpec, shape: tuple[int, ...], full: bool) -> Attack:
        value = T(_filler(shape, spec.datatype), spec.datatype, full=full)
        what = f"{spec.name} of {'batch ' if full else ''}shape {list(shape)}, dims {list(spec.dims)}"
        # inputs of different batch sizes: which one is wrong is a matter of view, and Triton
        # names the one it finds disagreeing with the first
        others = tuple(recipe.valid()) if full else ()
        return recipe.attack(spec.name, value, what, others)

    return _inputs(recipe).flatmap(
        lambda spec: shapes(spec).map(lambda sf: attack(spec, *sf)))


def missing_or_unknown(recipe: Recipe) -> st.SearchStrategy[Attack]:
    model = recipe.model
    required = sorted({n for n, s in model.inputs.items() if not s.optional} | set(recipe.required))
    unknown = st.tuples(st.from_regex(r"[a-z][a-z0-9_]{0,24}", fullmatch=True).filter(
        lambda n: n not in model.inputs), st.sampled_from(WIRE_TYPES)).map(
        lambda nd: recipe.attack(nd[0], T(_filler((1,), nd[1]), nd[1]), f"unknown input {nd[0]}"))
    if not required:
        return unknown
    return st.one_of(unknown, st.sampled_from(required).map(
        lambda n: recipe.attack(n, None, f"without {n}")))


def malformed_values(recipe: Recipe) -> st.SearchStrategy[Attack] | None:
    strategies = [s for s in recipe.values.values() if s is not None]
    return st.one_of(*strategies) if strategies else None


# --- the tests ---------------------------------------------------------------------------

def test_every_model_and_every_input_has_malformed_requests(served):
    catalog = served.catalog
    assert not catalog.uncovered, f"{served.preset}: models not covered: {catalog.uncovered}"
    assert {m.name for m in catalog.models} == set(catalog.recipes)
    for name, recipe in catalog.recipes.items():
        missing = sorted(set(recipe.model.inputs) - set(recipe.values))
        assert not missing, (f"{served.preset}: inputs of {name} ({recipe.role}) without "
                             f"malformed values in tests/integration/malformed.py: {missing}")
        extra = sorted(set(recipe.values) - set(recipe.model.inputs) - {"parameters"})
        assert not extra, f"{name}: malformed values for inputs it does not have: {extra}"
    assert_all_serving(served)


def test_wrong_datatypes_are_refused_naming_the_input(served):
    check_property(served, wrong_datatypes, 8)


def test_wrong_shapes_are_refused_naming_the_input(served):
    check_property(served, wrong_shapes, 8)


def test_missing_required_and_unknown_inputs_are_refused_naming_them(served):
    check_property(served, missing_or_unknown, 6)


def test_malformed_values_are_refused_naming_the_input(served):
    check_property(served, malformed_values, 40)

