"""The tiny models' tokenizer: a byte-level BPE trained here, wrapped as a Qwen2 chat tokenizer.

Where it runs: in the process building a tiny model (omni_tools.tiny_models,
tiny_omni): the set-up / user process (`omni-build-tiny`), the repository
generator and tests. Never inside tritonserver: the server loads the
tokenizer files a build saved.

What flows through it: the corpus of omni_tools.tiny_corpus goes in,
`train_tokenizer` gives a `tokenizers.Tokenizer` with Qwen2's
pre-tokenization and the special tokens `<|endoftext|>`, `<|im_start|>`,
`<|im_end|>` (ids 0, 1, 2), and `build_tokenizer` wraps it as a
`Qwen2Tokenizer` with the ChatML chat template (eos `<|im_end|>`, pad
`<|endoftext|>`). Training is deterministic: every build gets the same
vocabulary.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from omni_tools.tiny_corpus import IM_END, IM_START, tokenizer_corpus

if TYPE_CHECKING:  # heavy imports stay lazy: the CLI's --help must be instant
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

# <|im_start|> and <|im_end|> come from the corpus, whose chat turns they mark.
ENDOFTEXT = "<|endoftext|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
TOKENIZER_VOCAB_SIZE = 2000

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
    model_max_length: int,
    extra_text: tuple[str, ...] = (),
    *,
    extra_special_tokens: list[str] | dict[str, str] | None = None,
    chat_template: str = CHAT_TEMPLATE,
) -> PreTrainedTokenizerBase:
    """The trained BPE wrapped as a Qwen2 chat tokenizer (eos <|im_end|>, pad <|endoftext|>).

    `extra_special_tokens` is passed to Qwen2Tokenizer as is: a list of
    tokens, or attribute -> token (e.g. tiny_omni's `image_token`); None is
    `[<|im_start|>, <|im_end|>]`. `chat_template` replaces the ChatML one.
    """
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    if extra_special_tokens is None:
        extra_special_tokens = [IM_START, IM_END]
    model = json.loads(train_tokenizer(extra_text=extra_text).to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        extra_special_tokens=extra_special_tokens,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def special_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    """The model config's bos / eos / pad ids for `tokenizer` (<|endoftext|>, <|im_end|>, <|endoftext|>)."""
    return {
        "bos_token_id": tokenizer.convert_tokens_to_ids(ENDOFTEXT),
        "eos_token_id": tokenizer.convert_tokens_to_ids(IM_END),
        "pad_token_id": tokenizer.convert_tokens_to_ids(ENDOFTEXT),
    }


def padded_vocab_size(tokenizer: PreTrainedTokenizerBase, multiple: int = 64) -> int:
    """A model's vocabulary size for `tokenizer`: its length rounded up to `multiple`."""
    return -(-len(tokenizer) // multiple) * multiple
