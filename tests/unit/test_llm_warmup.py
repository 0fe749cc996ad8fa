"""The LLM stage's warm-up plan: every decode batch size and prompt length it will meet."""
from __future__ import annotations

import pytest

from omni_serve.llm import warmup


def _sizes(batches):
    return [len(b) for b in batches]


def test_decode_batches_cover_every_power_of_two_up_to_max_num_seqs_and_it_too():
    batches = warmup.plan(max_num_seqs=24, max_model_len=1024, max_num_batched_tokens=2048)

    decode = [b for b in batches if b[0].prompt_len == warmup.SHORT_PROMPT]
    assert _sizes(decode) == [1, 2, 4, 8, 16, 24]
    for batch in decode:
        assert all(r.max_tokens == warmup.DECODE_TOKENS for r in batch)
        # greedy and seeded sampling both run at every batch size above one
        if len(batch) > 1:
            assert {r.seeded for r in batch} == {True, False}


def test_prefills_grow_to_one_steps_token_budget_within_the_model_length():
    long_model = warmup.plan(max_num_seqs=4, max_model_len=4096, max_num_batched_tokens=2048)
    short_model = warmup.plan(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=2048)

    lengths = [b[0].prompt_len for b in long_model if len(b) == 1 and b[0].prompt_len > 16]
    assert lengths == [64, 128, 256, 512, 1024, 2048]
    longest = max(r.prompt_len + r.max_tokens for b in short_model for r in b)
    assert longest == 512  # prompt + decode fit the model length


def test_a_tiny_model_length_still_gives_a_valid_plan():
    batches = warmup.plan(max_num_seqs=1, max_model_len=8, max_num_batched_tokens=8)

    assert batches and all(r.prompt_len + r.max_tokens <= 8 and r.prompt_len >= 1
                           for b in batches for r in b)


def test_prompt_ids_stay_below_the_vocabulary_and_differ_per_salt():
    a = warmup.prompt_ids(64, vocab_size=300, salt=1)
    b = warmup.prompt_ids(64, vocab_size=300, salt=2)

    assert len(a) == 64 and max(a + b) < 300 and min(a + b) >= 0
    assert a[:8] != b[:8]  # no shared prefix: the prefix cache cannot serve one from the other


@pytest.mark.parametrize(("raw", "on"), [("", True), ("1", True), ("0", False), ("off", False)])
def test_the_environment_switches_it(raw, on):
    assert warmup.enabled({warmup.ENV: raw}) is on


def test_a_bad_switch_names_the_variable():
    with pytest.raises(ValueError, match=f"{warmup.ENV} must be 0 or 1, got 'maybe'"):
        warmup.enabled({warmup.ENV: "maybe"})
