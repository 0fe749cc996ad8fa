"""Session fixtures of the unit tests: the tiny Qwen2.5-Omni checkpoints, each built once.

Where it runs: in the pytest process (CPU, no server). Several test modules
(the encoder stage, the audio stage, tiny_omni's own tests) read the same
tiny checkpoints; building them once per session instead of once per module
saves the repeated builds.

What flows through it: folder paths, nothing else. `tiny_thinker` is a
`Qwen2_5OmniThinkerForConditionalGeneration` checkpoint
(tiny_omni.build_omni_thinker); `tiny_token2wav_dir` a stand-alone Token2Wav
with its voices (tiny_token2wav.build_token2wav); `tiny_omni_checkpoint` the
whole `Qwen2_5OmniForConditionalGeneration` in the hub layout, built from that
Token2Wav, which lies beside it (`tiny_omni_checkpoint.parent / "token2wav"`).
The folders are shared by every test of the session: read them, never write
into them; a test that needs a changed checkpoint copies it under its own
tmp_path first.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_tools.tiny_omni import build_omni_checkpoint, build_omni_thinker
from omni_tools.tiny_token2wav import build_token2wav


@pytest.fixture(scope="session")
def tiny_thinker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2.5-Omni thinker checkpoint (read-only: shared by the session)."""
    out = tmp_path_factory.mktemp("omni") / "thinker"
    build_omni_thinker(out)
    return out


@pytest.fixture(scope="session")
def tiny_token2wav_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny stand-alone Token2Wav and its voices (read-only: shared by the session)."""
    out = tmp_path_factory.mktemp("omni-full") / "token2wav"
    build_token2wav(out)
    return out


@pytest.fixture(scope="session")
def tiny_omni_checkpoint(tiny_token2wav_dir: Path) -> Path:
    """The whole tiny Qwen2.5-Omni in the hub layout, its Token2Wav beside it (read-only)."""
    out = tiny_token2wav_dir.parent / "omni"
    build_omni_checkpoint(out, token2wav_dir=tiny_token2wav_dir)
    return out
