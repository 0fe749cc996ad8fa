"""Tiny random-weight models of real architectures, built locally from configs.

Where it runs: in the set-up / user process (`omni-build-tiny`), in the
repository generator (which needs the embedded default's model paths, via
`ensure_model`) and in tests (fixtures). Never inside tritonserver: the
server only reads the directories this module writes.

What it produces: `<cache>/<name>/`, a Hugging Face checkpoint directory
(config.json, model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json, chat template) that loads with
`AutoModelForCausalLM.from_pretrained(path)` / `AutoTokenizer.from_pretrained(path)`
and with vLLM, exactly like a user's real checkpoint. Nothing is downloaded:
the tokenizer is a byte-level BPE trained here on a corpus generated in code,
and the weights are random with a fixed seed, so every build is identical.

The cache is `$OMNI_MODEL_CACHE` or `~/.cache/omni-triton/models`. A model
is built once (into a temporary directory in the cache, then renamed), under
a file lock so concurrent processes never build the same model twice, and
rebuilt when its recipe version changes.

Adding an architecture: write a `_build_<arch>(out: Path) -> None` function
and register it with `@register("<name>")`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # heavy imports stay lazy: the CLI's --help must be instant
    from tokenizers import Tokenizer
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Bump to rebuild every cached model (changes shared by all recipes, e.g. the
# tokenizer or the marker format). Per-model changes bump that model's version.
RECIPE_VERSION = 1
MARKER_FILE = ".omni-tiny-model.json"
DEFAULT_SEED = 0

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
TOKENIZER_VOCAB_SIZE = 2000
CORPUS_SEED = 1234

# ChatML, as Qwen2 chat models use it. Content may be a string or a list of
# OpenAI-style parts (only the text parts are rendered).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- else %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

Builder = Callable[[Path], None]


@dataclass(frozen=True)
class TinyModel:
    """A registered model: how to build it and the version of that recipe."""

    name: str
    build: Builder
    version: int = 1
    description: str = ""


TINY_MODELS: dict[str, TinyModel] = {}
DEFAULT_MODELS = ("qwen2-tiny",)


def register(name: str, *, version: int = 1, description: str = "") -> Callable[[Builder], Builder]:
    """Decorator: add a builder `fn(out_dir)` to TINY_MODELS under `name`."""

    def deco(fn: Builder) -> Builder:
        if name in TINY_MODELS:
            raise ValueError(f"tiny model {name!r} registered twice")
        TINY_MODELS[name] = TinyModel(name, fn, version, description or (fn.__doc__ or "").strip())
        return fn

    return deco


# --------------------------------------------------------------------------
# cache, marker, lock
# --------------------------------------------------------------------------


def cache_dir() -> Path:
    """The model cache: $OMNI_MODEL_CACHE, else ~/.cache/omni-triton/models."""
    env = os.environ.get("OMNI_MODEL_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "omni-triton" / "models"


def _recipe_id(name: str) -> str:
    return f"{RECIPE_VERSION}.{TINY_MODELS[name].version}"


def _is_complete(path: Path, name: str) -> bool:
    try:
        marker = json.loads((path / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("name") == name and marker.get("recipe") == _recipe_id(name)


def _write_marker(path: Path, name: str, seconds: float) -> None:
    marker = {"name": name, "recipe": _recipe_id(name), "build_seconds": round(seconds, 2)}
    (path / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def _file_lock(lock_path: Path):
    """An exclusive lock on lock_path for a with-block (blocks while another process has it)."""
    from filelock import FileLock

    return FileLock(lock_path, mode=0o644)


def _remove_stale_tmp(cache: Path, name: str) -> None:
    """Delete leftovers of interrupted builds (caller holds the model's lock)."""
    for stale in cache.glob(f".{name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in cache.glob(f".{name}.old-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _current_umask() -> int:
    try:  # Linux: read it without the process-wide set-and-restore race
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _make_readable(path: Path) -> None:
    """mkdtemp (and safetensors) create owner-only modes; apply the umask like a plain mkdir."""
    umask = _current_umask()
    path.chmod(0o777 & ~umask)
    for child in path.rglob("*"):
        child.chmod((0o777 if child.is_dir() else 0o666) & ~umask)


def _install(tmp: Path, target: Path) -> None:
    """Move a finished build to target with renames (replacing an old build)."""
    if target.exists():
        old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old-"))
        os.rename(target, old / target.name)
        os.rename(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, target)


def ensure_model(name: str, *, cache: Path | None = None, force: bool = False) -> Path:
    """Build tiny model `name` into `<cache>/<name>/` once and return that path.

    Reuses a complete build of the current recipe; `force=True` rebuilds.
    Safe to call from several processes at once (file lock per model).
    """
    if name not in TINY_MODELS:
        known = ", ".join(sorted(TINY_MODELS))
        raise ValueError(f"unknown tiny model {name!r}; known models: {known}")
    cache = Path(cache) if cache is not None else cache_dir()
    target = cache / name
    if not force and _is_complete(target, name):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache / f".{name}.lock"):
        # Another process may have finished the build while we waited.
        if not force and _is_complete(target, name):
            return target
        _remove_stale_tmp(cache, name)
        tmp = Path(tempfile.mkdtemp(dir=cache, prefix=f".{name}.tmp-"))
        try:
            logger.info("building tiny model %s into %s", name, target)
            start = time.monotonic()
            TINY_MODELS[name].build(tmp)
            elapsed = time.monotonic() - start
            _write_marker(tmp, name, elapsed)
            _make_readable(tmp)
            _install(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("built %s in %.1f s", name, elapsed)
    return target


# --------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------


def _words(text: str) -> list[str]:
    return text.split()


# Word lists for the generated corpus. Verbs are base forms; inflections are
# derived below, so a few hundred lemmas give well over a thousand word types.
_NOUNS = _words("""
time year people way day man woman child world life hand part place case week
company system program question work government number night point home water
room mother area money story fact month lot right study book eye job word
business issue side kind head house service friend father power hour game line
end member law car city community name president team minute idea kid body
information back parent face others level office door health person art war
history party result change morning reason research girl guy moment air teacher
force education foot boy age policy music market sense nation plan college
interest death experience effect class control care field development role effort
rate heart drug show leader light voice wife police mind price report decision
son view relationship town road arm difference value building action model season
society tax director position player record paper space ground form event
official matter center couple site project activity star table need court oil
situation cost industry figure street image phone data picture practice piece
land product doctor wall patient worker news test movie north love support
technology step baby computer type attention film tree source organization hair
window evidence population site garden river mountain island ocean forest desert
village bridge station library kitchen machine engine server network request
response token sentence letter message answer problem solution language animal
bird fish horse apple bread coffee dinner breakfast lunch flower summer winter
spring autumn weather cloud rain snow wind fire stone metal glass paper pencil
camera screen keyboard signal pattern memory process thread queue stream buffer
""")
_VERBS = _words("""
ask build call carry change check clean climb close collect compare count cover
create cross describe design discover dream enjoy explain fill finish follow form
help imagine improve include jump kick laugh learn listen look love measure move
need open order paint pass perform play point prepare print pull push reach
remember repair report rest return save search serve share sort start stay stop
talk test touch train travel try turn use visit wait walk want wash watch work
answer walk plant protect record solve study support trust worry deliver decode
encode generate compute stream render process
""")
_ADJECTIVES = _words("""
good new first last long great little own other old right big high different
small large next early young important few public bad same able free sure
clear full special easy strong certain whole real best late hard major better
economic possible human local social political national similar central happy
red blue green yellow white black dark bright quiet loud warm cold fresh simple
quick slow heavy light deep wide narrow gentle careful busy empty rich poor
ancient modern strange famous useful beautiful wonderful serious tiny random
""")
_ADVERBS = _words("""
quickly slowly carefully quietly happily often never always sometimes usually
rarely really almost already still again together suddenly finally perhaps
clearly easily simply nearly exactly probably certainly gently loudly
""")
_PREPOSITIONS = _words("""
in on at near under over behind beside between through across along around
into from with without during before after above below beyond toward inside
""")
_DETERMINERS = _words("the a this that every each some my your our their his her one another")
_PRONOUNS = _words("i you we they he she it someone nobody everyone")
_CONNECTORS = [
    "however",
    "meanwhile",
    "later",
    "today",
    "yesterday",
    "tomorrow",
    "then",
    "finally",
    "usually",
    "in fact",
    "of course",
    "for example",
    "at first",
    "in general",
    "as a result",
]
_QUESTIONS = [
    "what is the capital of france",
    "how does a computer work",
    "why is the sky blue",
    "can you help me write a poem",
    "where is the nearest station",
    "when does the train leave",
    "who wrote this book",
    "what time is it",
    "how many days are in a year",
    "please summarize the text below",
    "translate this sentence into french",
    "tell me a short story about a robot",
    "explain how rain forms",
    "describe the picture",
    "what did you hear in the audio",
]


def _third_person(verb: str) -> str:
    if verb.endswith(("s", "sh", "ch", "x", "z", "o")):
        return verb + "es"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def _past(verb: str) -> str:
    if verb.endswith("e"):
        return verb + "d"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ied"
    return verb + "ed"


def _gerund(verb: str) -> str:
    if verb.endswith("e") and not verb.endswith("ee"):
        return verb[:-1] + "ing"
    return verb + "ing"


def _plural(noun: str) -> str:
    return _third_person(noun)


def _noun_phrase(rng: random.Random) -> str:
    noun = rng.choice(_NOUNS)
    if rng.random() < 0.3:
        return f"{rng.randint(2, 99)} {_plural(noun)}"
    words = [rng.choice(_DETERMINERS)]
    if rng.random() < 0.5:
        words.append(rng.choice(_ADJECTIVES))
    words.append(noun)
    return " ".join(words)


def _sentence(rng: random.Random) -> str:
    subject_is_pronoun = rng.random() < 0.3
    subject = rng.choice(_PRONOUNS) if subject_is_pronoun else _noun_phrase(rng)
    verb = rng.choice(_VERBS)
    tense = rng.randrange(4)
    if tense == 0:
        verb_form = _past(verb)
    elif tense == 1:
        verb_form = f"will {verb}"
    elif tense == 2:
        verb_form = f"is {_gerund(verb)}"
    else:
        plural = subject_is_pronoun and subject in ("i", "you", "we", "they")
        verb_form = verb if plural else _third_person(verb)
    words = [subject, verb_form, _noun_phrase(rng)]
    if rng.random() < 0.3:
        words.append(rng.choice(_ADVERBS))
    if rng.random() < 0.6:
        words += [rng.choice(_PREPOSITIONS), _noun_phrase(rng)]
    text = " ".join(words)
    if rng.random() < 0.25:
        text = f"{rng.choice(_CONNECTORS)}, {text}"
    text = text.replace("i ", "I ", 1) if text.startswith("i ") else text
    return text[0].upper() + text[1:] + rng.choice(".....!;?")


def _question(rng: random.Random) -> str:
    q = rng.choice(_QUESTIONS)
    return q[0].upper() + q[1:] + rng.choice("??.")


def _code_line(rng: random.Random) -> str:
    var = rng.choice(_NOUNS)
    num = rng.randint(0, 4096)
    return rng.choice(
        [
            f"{var} = {num}",
            f"def {_gerund(rng.choice(_VERBS))}({var}):\n    return {var} + {num}",
            f"for i in range({num}):\n    print(i, {var})",
            f'if {var} > {num}:\n    {var} = "{var}"',
            f'{{"{var}": {num}, "ok": true, "value": {rng.random():.3f}}}',
            f"<{var}>{num}</{var}>",
            f"$ ls -la /home/{var}/{_plural(rng.choice(_NOUNS))}",
        ]
    )


def tokenizer_corpus(n_paragraphs: int = 3000, seed: int = CORPUS_SEED) -> list[str]:
    """Deterministic English-ish training text (prose, questions, chat, code)."""
    rng = random.Random(seed)
    paragraphs: list[str] = []
    for i in range(n_paragraphs):
        kind = i % 4
        if kind == 3:
            paragraphs.append(_code_line(rng))
        elif kind == 2:
            q, a = _question(rng), " ".join(_sentence(rng) for _ in range(2))
            paragraphs.append(f"{IM_START}user\n{q}{IM_END}\n{IM_START}assistant\n{a}{IM_END}")
        else:
            paragraphs.append(" ".join(_sentence(rng) for _ in range(rng.randint(1, 4))))
    # A fixed, printable ASCII line so every punctuation mark is seen.
    paragraphs.append("".join(chr(c) for c in range(32, 127)))
    return paragraphs


def train_tokenizer(
    vocab_size: int = TOKENIZER_VOCAB_SIZE, extra_text: tuple[str, ...] = ()
) -> Tokenizer:
    """Byte-level BPE with the Qwen2 pre-tokenization, trained on tokenizer_corpus().

    `extra_text` is appended to the corpus (e.g. a fixed prompt template
    repeated so its words become single tokens); empty keeps the default build.
    """
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    # The exact pipeline Qwen2Tokenizer rebuilds from vocab/merges on load.
    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_corpus() + list(extra_text), trainer=trainer)
    return tok


def build_tokenizer(
    model_max_length: int, extra_text: tuple[str, ...] = ()
) -> PreTrainedTokenizerBase:
    """The trained BPE wrapped as a Qwen2 chat tokenizer (eos <|im_end|>, pad <|endoftext|>)."""
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    model = json.loads(train_tokenizer(extra_text=extra_text).to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        extra_special_tokens=[IM_START, IM_END],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# --------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    return {
        "bos_token_id": tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        "eos_token_id": tokenizer.convert_tokens_to_ids(IM_END),
        "pad_token_id": tokenizer.convert_tokens_to_ids(ENDOFTEXT),
    }


def _save_causal_lm(
    out: Path,
    config: PreTrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    seed: int = DEFAULT_SEED,
) -> None:
    """Random-init a causal LM from config (fixed seed) and save it with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    ids = _special_ids(tokenizer)
    generation = GenerationConfig(
        bos_token_id=ids["bos_token_id"],
        # Stop on the chat end and on the document end, as Qwen2.5 instruct does.
        eos_token_id=[ids["eos_token_id"], ids["pad_token_id"]],
        pad_token_id=ids["pad_token_id"],
    )
    generation.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model


def _qwen2_config(tokenizer: PreTrainedTokenizerBase, **shape: Any) -> PreTrainedConfig:
    from transformers import Qwen2Config

    rope_theta = float(shape.pop("rope_theta", 10000.0))
    shape.setdefault("vocab_size", _round_up(len(tokenizer), 64))
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    if head_dim * shape["num_attention_heads"] != shape["hidden_size"]:
        raise ValueError("hidden_size must be a multiple of num_attention_heads")
    if shape["vocab_size"] < len(tokenizer):
        raise ValueError("vocab_size smaller than the tokenizer")
    config = Qwen2Config(
        head_dim=head_dim,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        max_window_layers=shape["num_hidden_layers"],
        tie_word_embeddings=shape.pop("tie_word_embeddings", True),
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        dtype="float32",  # vLLM on CPU then loads fp32 (it reads config.dtype)
        **_special_ids(tokenizer),
        **shape,
    )
    config.architectures = ["Qwen2ForCausalLM"]
    return config


@register("qwen2-tiny", version=2, description="Qwen2, hidden 128, 2 layers, head_dim 64")
def _build_qwen2_tiny(out: Path) -> None:
    """Qwen2ForCausalLM, hidden 128, 2 layers, 2 heads of 64, 1 KV head (GQA)."""
    max_len = 4096
    tokenizer = build_tokenizer(max_len)
    config = _qwen2_config(
        tokenizer,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=256,
        max_position_embeddings=max_len,
        # Untied head and a wide init: greedy output varies from token to token
        # instead of echoing the last prompt token, so text comparisons in
        # tests mean something.
        tie_word_embeddings=False,
        initializer_range=0.5,
    )
    _save_causal_lm(out, config, tokenizer)


@register("qwen2.5-0.5b-random", version=1, description="Qwen2.5-0.5B shapes, random weights")
def _build_qwen25_05b_random(out: Path) -> None:
    """Qwen2.5-0.5B shapes (~494M params, ~2 GB fp32), random weights, tiny tokenizer."""
    max_len = 32768
    tokenizer = build_tokenizer(max_len)
    config = _qwen2_config(
        tokenizer,
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        max_position_embeddings=max_len,
        rope_theta=1000000.0,
    )
    _save_causal_lm(out, config, tokenizer)


# --------------------------------------------------------------------------
# omni-chat: the whole Qwen2.5-Omni (thinker, talker, Token2Wav)
# --------------------------------------------------------------------------

OMNI_CODEC_VOCAB = 512


@register("qwen2.5-omni-tiny", version=4,
          description="Qwen2.5-Omni (thinker with vision+audio towers, talker, Token2Wav), hub layout")
def _build_qwen25_omni_tiny(out: Path) -> None:
    """The folder is a whole `Qwen2_5OmniForConditionalGeneration` checkpoint as the hub ships
    one (config.json, model.safetensors with thinker.*/talker.*/token2wav.*, spk_dict.pt,
    tokenizer and processor files): every omni-chat stage reads its part of it.
    token2wav/ is the Token2Wav the builder draws first (also in the audio stage's
    stand-alone layout).
    """
    from omni_tools import tiny_omni, tiny_token2wav

    tiny_token2wav.build_token2wav(out / "token2wav", codec_vocab=OMNI_CODEC_VOCAB)
    tiny_omni.build_omni_checkpoint(out, token2wav_dir=out / "token2wav")


# --------------------------------------------------------------------------
# diffusion pipelines
# --------------------------------------------------------------------------

# QwenImagePipeline wraps every prompt in this template and drops the first
# QWEN_IMAGE_TEMPLATE_DROP hidden states (the system part), counted in tokens
# of the *real* Qwen2.5 tokenizer, where each pre-token of the prefix is one
# token. The tiny tokenizer is trained with the prefix repeated so the same
# holds for it; the builder checks both against the installed diffusers.
QWEN_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
QWEN_IMAGE_TEMPLATE_DROP = 34
QWEN_IMAGE_SCHEDULER = {  # Qwen/Qwen-Image scheduler/scheduler_config.json
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}


def qwen_image_template_prefix_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids of the template part the pipeline drops (everything before the prompt)."""
    return tokenizer(QWEN_IMAGE_TEMPLATE.split("{}")[0])["input_ids"]


def _check_qwen_image_template(pipe: Any) -> None:
    if pipe.prompt_template_encode != QWEN_IMAGE_TEMPLATE:
        raise RuntimeError("diffusers' Qwen-Image prompt template changed; update the recipe")
    drop = pipe.prompt_template_encode_start_idx
    prefix = qwen_image_template_prefix_ids(pipe.tokenizer)
    full = pipe.tokenizer(QWEN_IMAGE_TEMPLATE.format("a red cat"))["input_ids"]
    if len(prefix) != drop or full[:drop] != prefix:
        raise RuntimeError(
            f"tiny tokenizer encodes the template prefix in {len(prefix)} tokens; "
            f"the pipeline drops {drop}"
        )


@register("qwen-image-tiny", version=1, description="Qwen-Image pipeline, random weights, 64x64")
def _build_qwen_image_tiny(out: Path) -> None:
    """diffusers QwenImagePipeline: 2-layer DiT, 4-channel VAE, tiny Qwen2.5-VL encoder."""
    import torch
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    max_len = 1024 + QWEN_IMAGE_TEMPLATE_DROP  # pipeline's tokenizer_max_length + drop
    prefix = QWEN_IMAGE_TEMPLATE.split("{}")[0]
    tokenizer = build_tokenizer(max_len, extra_text=(prefix,) * 200)
    text_hidden = 16
    torch.manual_seed(DEFAULT_SEED)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,  # 4 x VAE z_dim (2x2 latent patches)
        out_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=3,
        joint_attention_dim=text_hidden,
        axes_dims_rope=(8, 4, 4),  # sums to attention_head_dim
    )
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )
    ids = _special_ids(tokenizer)
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": _round_up(len(tokenizer), 64),
            "hidden_size": text_hidden,
            "intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": max_len,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": [1, 1, 2],  # sums to head_dim / 2
            },
            **ids,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": text_hidden,
            "fullatt_block_indexes": [1],
        },
        tie_word_embeddings=False,
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER)
    pipe = QwenImagePipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    _check_qwen_image_template(pipe)
    pipe.save_pretrained(out, safe_serialization=True)


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """omni-build-tiny [NAME ...] [--all] [--cache DIR] [--force]: build and print paths."""
    parser = argparse.ArgumentParser(
        prog="omni-build-tiny",
        description="Build tiny random-weight models (no downloads) and print their paths.",
    )
    parser.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"models to build (default: {', '.join(DEFAULT_MODELS)}); "
        f"known: {', '.join(TINY_MODELS)}",
    )
    parser.add_argument("--all", action="store_true", help="build every known model")
    parser.add_argument(
        "--cache", type=Path, default=None, help=f"cache dir (default: {cache_dir()})"
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("-q", "--quiet", action="store_true", help="only print the paths")
    args = parser.parse_args(argv)

    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    names = list(TINY_MODELS) if args.all else (args.names or list(DEFAULT_MODELS))
    for name in names:
        try:
            path = ensure_model(name, cache=args.cache, force=args.force)
        except ValueError as exc:
            parser.error(str(exc))
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
