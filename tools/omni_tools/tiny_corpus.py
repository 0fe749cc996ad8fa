"""The synthetic English-ish text the tiny tokenizer is trained on, generated in code.

Where it runs: in whichever process trains the tiny tokenizer
(omni_tools.tiny_tokenizer): the set-up / user process (`omni-build-tiny`),
the repository generator and tests. Never inside tritonserver.

What flows through it: a paragraph count and a seed in, a list of
paragraphs out (`tokenizer_corpus`): prose built from word lists with
derived inflections, chat turns in ChatML (`IM_START` / `IM_END`, the
markers the tokenizer makes special tokens), short code snippets, and one
line of every printable ASCII character. Nothing is downloaded, and the
same seed gives the same text, so every tokenizer trained on it is the same.
"""

from __future__ import annotations

import random

# ChatML's turn markers, as Qwen2 chat models write them; the chat paragraphs use them.
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
CORPUS_SEED = 1234


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
