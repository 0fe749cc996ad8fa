"""omni_serve/llm/aot_cache.py: a compiled model vLLM saved loads on the next start even
where its compiled function is a plain one (no `finalize_loading`)."""
from __future__ import annotations

from types import SimpleNamespace

from omni_serve.llm import aot_cache


def _loaded(compiled):
    return SimpleNamespace(_artifacts=SimpleNamespace(compiled_fn=compiled))


def test_a_plain_compiled_function_gets_a_finalize_that_does_nothing():
    def compiled(*args):
        return "out"

    loaded = aot_cache.finalizable(_loaded(compiled))
    assert loaded._artifacts.compiled_fn is compiled
    assert compiled.finalize_loading(object()) is None  # what vLLM 0.32 calls on load
    assert compiled("x") == "out"


def test_an_artifact_with_its_own_finalize_keeps_it():
    calls = []
    own = SimpleNamespace(finalize_loading=lambda cfg: calls.append(cfg))
    aot_cache.finalizable(_loaded(own))._artifacts.compiled_fn.finalize_loading("cfg")
    assert calls == ["cfg"]


def test_anything_else_passes_through_untouched():
    for loaded in (None, object(), SimpleNamespace(_artifacts=None), _loaded(None), _loaded(3)):
        assert aot_cache.finalizable(loaded) is loaded


def test_the_loader_is_wrapped_once_and_passes_its_arguments_on():
    seen = []

    def load(f, f_globals=None):
        seen.append((f, f_globals))
        return _loaded(lambda: None)

    wrapped = aot_cache.with_finalizable(load)
    assert aot_cache.with_finalizable(wrapped) is wrapped
    loaded = wrapped("file", f_globals={"g": 1})
    assert seen == [("file", {"g": 1})]
    assert loaded._artifacts.compiled_fn.finalize_loading(None) is None
