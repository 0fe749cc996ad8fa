"""An omni checkpoint folder as the hub ships it, checked and put into a preset.

Runs in the `omni-gen-repo` process (`--model DIR`). What flows through it:
the folder's config.json (its model family, omni_serve.families, says what
each stage role reads of the folder), weight index and file names (no
tensor is read), and the preset's spec data, whose stages that read the
preset's checkpoint are pointed at the folder.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omni_serve import families
from omni_serve.families import checkpoint_tensors

# Speech needs both: a preset keeps them together or leaves both out.
SPEECH_ROLES = ("talker", "audio_decoder")
# the stage roles that read a part of the checkpoint folder, in the order problems name them
PARTS_ORDER = ("thinker", "image_encoder", "audio_encoder", "talker", "audio_decoder")


def problems(folder: Path, roles: list[str]) -> list[str]:
    """What keeps `folder` from serving `roles` (thinker, image_encoder, audio_encoder, audio_decoder)."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        return [f"{folder}: no config.json (not a checkpoint folder)"]
    config = json.loads(config_path.read_text())
    try:
        family = families.for_config(config)
    except ValueError as e:
        return [f"{folder}: {e}"]
    found = []
    names = set(checkpoint_tensors.tensor_files(folder))
    if not names:
        return [f"{folder}: no safetensors weights"]
    for role in roles:
        prefix, files = family.parts[role]
        if not any(name.startswith(prefix) for name in names):
            found.append(f"{folder}: no {prefix}* weights, which the {role} stage needs")
        found.extend(f"{folder}: no {name}, which the {role} stage needs"
                     for name in files if not (folder / name).is_file())
    return found


def _family(folder: Path) -> families.Family | None:
    """The model family of the checkpoint in `folder`; None when it has none we serve
    (`problems` says why)."""
    try:
        return families.for_checkpoint(str(folder))
    except ValueError:
        return None


def point_preset_at(data: dict[str, Any], folder: Path) -> tuple[dict[str, Any], list[str]]:
    """The preset's spec data with its checkpoint replaced by `folder`, and the problems.

    Stages that read the preset's own checkpoint (the thinker's `model`) read
    `folder`; stages that read other parts of the preset's tiny model are left
    out with their orchestrator roles. A folder without the speech parts (no
    talker.* or token2wav.* weights, no spk_dict.pt, e.g. a thinker-only
    export) serves text: the talker and audio decoder are left out together
    and a request for audio out fails clearly ("no talker"). So are the stages
    the folder's family does without: the encoder of a modality its thinker takes
    raw (`Family.raw_media`), the speech stages of a family with no speech feed. A
    thinker that takes video raw gets one video a prompt where the preset allows none.
    """
    stages = data["stages"]
    orchestrators = [n for n, s in stages.items() if s["backend"] == "omni_orchestrator"]
    roles = stages[orchestrators[0]]["engine_args"]["stages"] if orchestrators else {}
    thinker = roles.get("thinker") if roles else next(
        (n for n, s in stages.items() if s["backend"] == "omni_llm"), None)
    if isinstance(thinker, list):
        thinker = thinker[0]
    if thinker is None:
        return data, ["the preset has no thinker (omni_llm) stage to point at a checkpoint"]
    own = stages[thinker]["model"]
    dropped = [n for n, s in stages.items()
               if isinstance(s.get("model"), str) and s["model"] != own
               and s["model"].startswith(own.rstrip("/") + "/")]
    speech = [roles.get(role) for role in SPEECH_ROLES if isinstance(roles.get(role), str)]
    speech_roles = [role for role in SPEECH_ROLES if roles.get(role) in stages]
    family = _family(folder)
    if family is not None:  # what the folder's family serves without a stage of its own
        dropped += [roles[f"{kind}_encoder"] for kind in family.raw_media
                    if isinstance(roles.get(f"{kind}_encoder"), str)]
        if family.speech is None:
            dropped += speech  # a family with text out only (so far)
        limits = stages[thinker].get("engine_args", {}).get("limit_mm_per_prompt")
        if "video" in family.raw_media and isinstance(limits, dict) and limits.get("video") == 0:
            limits["video"] = 1  # its thinker takes a request's video (the preset's has none)
    if speech_roles and not set(speech) <= set(dropped) and problems(
            folder, speech_roles) and not problems(folder, ["thinker"]):
        dropped += speech  # no speech parts in this folder: serve text
    if any(name in dropped for name in speech):
        dropped += [name for name in speech if name not in dropped and name in stages]
    for name, stage in stages.items():
        if stage.get("model") == own:
            stage["model"] = str(folder)
    for name in dropped:
        del stages[name]
    for orch in orchestrators:
        engine_roles = stages[orch]["engine_args"]["stages"]
        for role, target in list(engine_roles.items()):
            if target in dropped:
                del engine_roles[role]
    used = [role for role in PARTS_ORDER
            if role == "thinker" or roles.get(role) in stages]
    return data, problems(folder, used)


# The voices of a checkpoint: Qwen2.5-Omni's pickled dict (name -> conditioning),
# the audio stage's own index (omni_tools.tiny_token2wav.write_speakers), or a talker
# that speaks them itself (Qwen3-Omni: config.json talker_config.speaker_id).
SPEAKER_DICT = "spk_dict.pt"
SPEAKER_INDEX = "speakers.json"


def voices(folder: Path) -> list[str] | None:
    """The voice names of the checkpoint in `folder`; None when it has no voice file.

    Raises:
        ValueError: a voice file is there but unreadable or not name-keyed.
    """
    path = folder / SPEAKER_DICT
    if path.is_file():
        import torch

        try:
            voices = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(f"{path}: cannot be read ({e})") from e
        if not isinstance(voices, dict) or not all(isinstance(k, str) for k in voices):
            raise ValueError(f"{path}: expected a dict keyed by voice name")
        return list(voices)
    path = folder / SPEAKER_INDEX
    if path.is_file():
        try:
            names = json.loads(path.read_text(encoding="utf-8")).get("speakers")
        except (ValueError, AttributeError) as e:
            raise ValueError(f"{path}: not a JSON object ({e})") from e
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f'{path}: expected a "speakers" list of names')
        return names
    return _config_speakers(folder)


def _config_speakers(folder: Path) -> list[str] | None:
    """The talker's speakers in config.json (`talker_config.speaker_id`: name -> codec id)."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    speakers = (config.get("talker_config") or {}).get("speaker_id") if isinstance(config, dict) else None
    if not isinstance(speakers, dict) or not speakers:
        return None
    return [str(name) for name in speakers]
