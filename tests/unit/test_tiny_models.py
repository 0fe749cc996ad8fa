"""omni_tools.tiny_models (with model_cache, tiny_tokenizer, tiny_corpus): building, caching and
loading the tiny models (no server).

Builds only `qwen2-tiny` (a few seconds each); the 0.5B model is never built here.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from omni_tools import model_cache
from omni_tools import tiny_models as tm
from omni_tools.tiny_corpus import tokenizer_corpus
from omni_tools.tiny_tokenizer import ENDOFTEXT, IM_END, SPECIAL_TOKENS, train_tokenizer

TINY = "qwen2-tiny"
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-cache")


@pytest.fixture(scope="session")
def tiny_path(tiny_cache: Path) -> Path:
    return tm.ensure_model(TINY, cache=tiny_cache)


@pytest.fixture(scope="session")
def tokenizer(tiny_path: Path):
    return AutoTokenizer.from_pretrained(tiny_path)


def _stat(path: Path) -> tuple[int, int]:
    st = (path / WEIGHTS).stat()
    return st.st_ino, st.st_mtime_ns


# -- cache location -----------------------------------------------------------


def test_cache_dir_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OMNI_MODEL_CACHE", str(tmp_path / "c"))
    assert model_cache.cache_dir() == tmp_path / "c"


def test_cache_dir_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("OMNI_MODEL_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert model_cache.cache_dir() == tmp_path / ".cache" / "omni-triton" / "models"


def test_ensure_model_uses_env_cache(
    monkeypatch: pytest.MonkeyPatch, tiny_cache: Path, tiny_path: Path
) -> None:
    monkeypatch.setenv("OMNI_MODEL_CACHE", str(tiny_cache))
    assert tm.ensure_model(TINY) == tiny_path


# -- the built model ----------------------------------------------------------


def test_layout(tiny_path: Path) -> None:
    assert tiny_path.name == TINY and tiny_path.is_dir()
    for name in (
        "config.json",
        WEIGHTS,
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        model_cache.MARKER_FILE,
    ):
        assert (tiny_path / name).is_file(), name
    assert not list(tiny_path.parent.glob(f".{TINY}.tmp-*"))


def test_loads_with_from_pretrained(tiny_path: Path, tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    cfg = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert cfg.model_type == "qwen2"
    assert cfg.architectures == ["Qwen2ForCausalLM"]
    assert cfg.hidden_size == 128 and cfg.num_hidden_layers == 2
    assert cfg.num_attention_heads == 2 and cfg.num_key_value_heads in (1, 2)
    assert cfg.head_dim == 64 == cfg.hidden_size // cfg.num_attention_heads
    assert cfg.intermediate_size == 256 and cfg.max_position_embeddings == 4096
    assert not cfg.tie_word_embeddings  # untied head: greedy output varies (see recipe)
    assert cfg.vocab_size % 64 == 0 and len(tokenizer) <= cfg.vocab_size < len(tokenizer) + 64
    assert cfg.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert cfg.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids(IM_END)
    assert (
        cfg.pad_token_id == tokenizer.pad_token_id == tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    )

    ids = tokenizer("The cat reads a book.", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size)
    assert torch.isfinite(logits).all()
    out = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 4


def test_generation_config(tiny_path: Path, tokenizer) -> None:
    gen = GenerationConfig.from_pretrained(tiny_path)
    assert tokenizer.eos_token_id in gen.eos_token_id
    assert gen.pad_token_id == tokenizer.pad_token_id


# -- tokenizer ----------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "The quick brown fox jumps over the lazy dog.\nSecond line\n\n  indented  twice",
        " leading space and trailing space ",
        "tabs\tand\r\nwindows newlines; symbols ~!@#$%^&*()_+{}|:\"<>?`-=[]\\;',./",
        "numbers 0123456789 and 3.14159, code: def f(x):\n    return x + 1\n",
        "".join(chr(c) for c in range(32, 127)),
    ],
)
def test_tokenizer_round_trip(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_tokenizer_specials(tokenizer) -> None:
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    assert tokenizer.eos_token == IM_END
    assert tokenizer.pad_token == ENDOFTEXT
    assert 1900 <= len(tokenizer) <= 2100
    for special in SPECIAL_TOKENS:
        ids = tokenizer.encode(special, add_special_tokens=False)
        assert len(ids) == 1 and tokenizer.decode(ids) == special
    # No BOS/EOS is added to plain prompts (as with Qwen2).
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)
    # Common words are single tokens: the BPE really learned English.
    assert len(tokenizer.encode(" the", add_special_tokens=False)) == 1


def test_chat_template(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hi there"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = tokenizer.apply_chat_template(messages, tokenize=False)
    assert without == text.removesuffix("<|im_start|>assistant\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]
    assert (
        tokenizer.apply_chat_template(parts, tokenize=False)
        == "<|im_start|>user\nHi there<|im_end|>\n"
    )


# -- caching, rebuilds, locking ------------------------------------------------


def test_reuse_force_and_recipe_version(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tm.ensure_model(TINY, cache=tmp_path)
    first = _stat(path)

    assert tm.ensure_model(TINY, cache=tmp_path) == path
    assert _stat(path) == first, "second call must reuse the build"

    assert tm.ensure_model(TINY, cache=tmp_path, force=True) == path
    forced = _stat(path)
    assert forced != first, "force=True must rebuild"

    monkeypatch.setattr(tm, "RECIPE_VERSION", tm.RECIPE_VERSION + 1)
    assert tm.ensure_model(TINY, cache=tmp_path) == path
    assert _stat(path) != forced, "a new recipe version must rebuild"
    assert _stat(path) == _stat(tm.ensure_model(TINY, cache=tmp_path))
    # Only the model and its lock are left in the cache.
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{TINY}.lock", TINY]


def test_same_seed_same_weights(tiny_path: Path, tmp_path: Path) -> None:
    other = tm.ensure_model(TINY, cache=tmp_path)
    a, b = load_file(tiny_path / WEIGHTS), load_file(other / WEIGHTS)
    assert a.keys() == b.keys() and a
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert (tiny_path / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()


def test_tokenizer_training_is_deterministic() -> None:
    assert train_tokenizer().to_str() == train_tokenizer().to_str()
    assert tokenizer_corpus() == tokenizer_corpus()


def test_unknown_name_lists_known() -> None:
    with pytest.raises(ValueError) as err:
        tm.ensure_model("no-such-model")
    message = str(err.value)
    assert "no-such-model" in message
    for name in tm.TINY_MODELS:
        assert name in message


def test_registry() -> None:
    assert {"qwen2-tiny", "qwen2.5-0.5b-random"} <= set(tm.TINY_MODELS)
    assert set(tm.DEFAULT_MODELS) <= set(tm.TINY_MODELS)
    with pytest.raises(ValueError):
        tm.register(TINY)(lambda out: None)


def _fake_model(monkeypatch: pytest.MonkeyPatch, build) -> str:
    name = "fake-model"
    monkeypatch.setitem(tm.TINY_MODELS, name, tm.TinyModel(name, build))
    return name


def test_concurrent_callers_build_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[int] = []

    def build(out: Path) -> None:
        calls.append(1)
        time.sleep(0.3)  # long enough for the other callers to queue on the lock
        (out / "weights.bin").write_bytes(b"x")

    name = _fake_model(monkeypatch, build)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(tm.ensure_model(name, cache=tmp_path)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [tmp_path / name] * 4
    assert (tmp_path / name / "weights.bin").read_bytes() == b"x"


def test_failed_build_leaves_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def build(out: Path) -> None:
        (out / "partial").write_text("half")
        raise RuntimeError("boom")

    name = _fake_model(monkeypatch, build)
    (tmp_path / f".{name}.tmp-stale").mkdir(parents=True)  # left by a killed build
    with pytest.raises(RuntimeError, match="boom"):
        tm.ensure_model(name, cache=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{name}.lock"]


def test_incomplete_dir_is_rebuilt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    name = _fake_model(monkeypatch, lambda out: (out / "ok").write_text("1"))
    (tmp_path / name).mkdir()
    (tmp_path / name / "junk").write_text("no marker")
    path = tm.ensure_model(name, cache=tmp_path)
    assert sorted(p.name for p in path.iterdir()) == [model_cache.MARKER_FILE, "ok"]


# -- CLI ----------------------------------------------------------------------


def test_cli_prints_paths(
    tiny_cache: Path, tiny_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _stat(tiny_path)
    assert tm.main(["--cache", str(tiny_cache), "-q"]) == 0
    assert tm.main(["--cache", str(tiny_cache), "-q", TINY]) == 0
    assert capsys.readouterr().out.splitlines() == [str(tiny_path)] * 2
    assert _stat(tiny_path) == before


def test_cli_unknown_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        tm.main(["--cache", str(tmp_path), "bogus"])
    assert exc.value.code == 2
    assert "qwen2-tiny" in capsys.readouterr().err
