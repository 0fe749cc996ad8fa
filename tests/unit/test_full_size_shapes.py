"""Full-size shape tests: our served model classes against the real checkpoints' configs (CPU, no weights).

Where it runs: in the pytest process, on the meta device (no memory, no weight files, seconds).
What flows through it: the hub's config.json values of each family we serve, kept in full_configs/
(its README.md names the source of every figure), and the checkpoint's tensor names and shapes as
the reference implementation (transformers / diffusers) builds them from that config.

Each Qwen2.5-Omni stage's model is built the way the stage builds it (vLLM's registry and engine
config for the thinker and talker engines; the encoder and audio runners' own loaders for the vision
tower and Token2Wav, fed through a stand-in for safetensors) and loaded with the reference's
(name, meta tensor) pairs. `LoadTrace` follows every checkpoint tensor through the loader into the
served model. A test fails when a loader puts a tensor into a slot of another shape, reads only part
of it (vLLM's loaders cut an oversized tensor to its slot without a word), rejects a name, leaves part
of a served parameter unwritten, or when a stage does not read exactly its part (READS) and a
checkpoint tensor is read by no stage without a reason in UNREAD. The tiny goldens cannot see this
class of bug (issue 26: the 7B talker's head_dim 128 is not hidden_size / heads).

The DiT stage serves diffusers' own classes (DiffusionPipeline.from_pretrained), so for Qwen-Image
the served classes are the reference: the test builds them at full size from the hub's configs and
checks that the components fit each other and the stage's defaults.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

CONFIGS = Path(__file__).parent / "full_configs"
OMNI = ["qwen2_5_omni_3b", "qwen2_5_omni_7b"]
# The checkpoint tensors each Qwen2.5-Omni stage reads: every tensor under these names, nothing else.
READS = {
    "thinker": ("thinker.",),  # vLLM's thinker: text model, audio tower and vision tower
    "talker": ("talker.", "thinker.model.embed_tokens.weight"),  # + the text-eos/pad rows it feeds
    "encoder": ("thinker.visual.",),  # the image encoder stage's vision tower
    "audio": ("token2wav.",),  # Token2Wav: the codec DiT and BigVGAN
}
# Tensors a stage reads only in part, by design.
READ_IN_PART = {"talker": ("thinker.model.embed_tokens.weight",)}  # its text-eos and text-pad rows
# Checkpoint tensors that no stage reads, with the reason. Empty: every part of the checkpoint is served.
UNREAD: dict[str, str] = {}


def hub_config(name: str) -> dict:
    """A config file of full_configs/ as the hub ships it (the `_source` notes removed)."""
    def strip(node):
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k != "_source"}
        return node
    return strip(json.loads((CONFIGS / name).read_text()))


# --- following checkpoint tensors through a loader ---------------------------------------------


class LoadTrace(TorchFunctionMode):
    """Follows checkpoint tensors through a loader into the model it loads.

    A checkpoint tensor's data may pass through views, row picks and casts before it lands: every
    result of an op on a traced tensor is traced to the same checkpoint tensors. A write is a `copy_`
    or `__setitem__` whose source is traced, recorded as (checkpoint names, target storage, slot
    shape, source shape); the slot is the written part of the target.
    """

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.tensors = tensors
        self.origin = {id(t): frozenset([name]) for name, t in tensors.items()}
        self.alive = list(tensors.values())  # ids stay unique while the tensors live
        self.writes: list[tuple[frozenset[str], int, tuple[int, ...], tuple[int, ...]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("copy_", "__setitem__"):
            slot, src = (args[0], args[1]) if name == "copy_" else (args[0][args[1]], args[2])
            if id(src) in self.origin:
                self.writes.append((self.origin[id(src)], slot.untyped_storage()._cdata,
                                    tuple(slot.shape), tuple(src.shape)))
                if slot.shape != src.shape:
                    return args[0]  # reported by problems(); the load goes on to find the others
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        sources = [self.origin[id(t)] for t in tree_flatten((args, kwargs))[0] if id(t) in self.origin]
        if sources:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.origin[id(t)] = frozenset().union(*sources)
                    self.alive.append(t)
        return out

    def read(self) -> set[str]:
        return set().union(*(w[0] for w in self.writes))

    def problems(self, model: torch.nn.Module, partial: tuple[str, ...] = ()) -> list[str]:
        """What does not fit: a slot of another shape, a checkpoint tensor read only in part (a loader
        that cuts an oversized tensor to its slot; `partial` names the ones read in part by design),
        a served parameter left (partly) unwritten."""
        owners: dict[int, str] = {}
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
            owners.setdefault(t.untyped_storage()._cdata, name)
        found, written, consumed = [], dict.fromkeys(owners.values(), 0), dict.fromkeys(self.read(), 0)
        for ckpts, storage, slot, shape in self.writes:
            owner = owners.get(storage, "a tensor outside the model")
            names = ", ".join(sorted(ckpts))
            if slot != shape:
                found.append(f"{names} {list(shape)} is read into {owner} (slot {list(slot)})")
            if len(ckpts) > 1:
                found.append(f"{names} are merged before they land in {owner}: not followed")
            written[owner] = written.get(owner, 0) + math.prod(slot)
            for ckpt in ckpts:
                consumed[ckpt] += math.prod(shape)
        for ckpt, count in sorted(consumed.items()):
            full = self.tensors[ckpt]
            if count < full.numel() and ckpt not in partial:
                found.append(f"{ckpt} {list(full.shape)}: the loader reads {count} of its "
                             f"{full.numel()} values")
        for name, p in model.named_parameters():
            if written[name] != p.numel():
                found.append(f"{name} {list(p.shape)}: the checkpoint writes {written[name]} of its "
                             f"{p.numel()} values")
        return found


def checkpoint_tensors(model) -> dict[str, torch.Tensor]:
    """What the reference's save_pretrained writes: its state dict without the tied copies."""
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    return {name: t for name, t in model.state_dict().items() if name not in tied}


class FakeSafetensors:
    """`safetensors.safe_open` over the reference's meta tensors (for the runners' own readers)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def __call__(self, path, framework="pt", device="cpu"):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def keys(self):
        return list(self.tensors)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]


# --- Qwen2.5-Omni: the checkpoint and the reference ----------------------------------------------


class Omni:
    """One Qwen2.5-Omni size: its checkpoint folder (config, index, voices) and reference tensors."""

    def __init__(self, name: str, folder: Path):
        from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

        self.name, self.folder = name, folder
        self.raw = hub_config(f"{name}.json")
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(self.raw))
        with torch.device("meta"):
            reference = Qwen2_5OmniForConditionalGeneration._from_config(Qwen2_5OmniConfig(**self.raw))
        self.tensors = checkpoint_tensors(reference)
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": dict.fromkeys(self.tensors, "model.safetensors")}))
        dit = self.raw["token2wav_config"]["dit_config"]
        torch.save({"Chelsie": {"cond": torch.zeros(1, dit["enc_emb_dim"]),
                                "ref_mel": torch.zeros(1, 30, dit["mel_dim"]), "bos_token": 151870}},
                   folder / "spk_dict.pt")


@pytest.fixture(scope="module")
def omni(tmp_path_factory: pytest.TempPathFactory):
    made: dict[str, Omni] = {}

    def get(name: str) -> Omni:
        if name not in made:
            made[name] = Omni(name, tmp_path_factory.mktemp("full-size") / name)
        return made[name]
    return get


# --- the vLLM engines (thinker, talker) ----------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_world():
    """vLLM's distributed state for one CPU process (gloo), as its model code expects; torn down after."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    from omni_serve.llm import vllm_models

    vllm_models.register()  # what our vllm.general_plugins entry does in every vLLM process
    if ps.model_parallel_is_initialized():
        yield
        return
    with set_current_vllm_config(VllmConfig()):
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                        distributed_init_method="tcp://127.0.0.1:0")
        ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


def load_vllm_model(engine_args: dict, tensors: dict[str, torch.Tensor]) -> tuple[torch.nn.Module, LoadTrace]:
    """The model vLLM builds for these engine arguments, on meta, loaded with `tensors` through its loader."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model

    vllm_config = VllmConfig(model_config=EngineArgs(**engine_args).create_model_config())
    with set_current_vllm_config(vllm_config), torch.device("meta"):
        model = initialize_model(vllm_config)
    trace = LoadTrace(tensors)
    with set_current_vllm_config(vllm_config), trace:
        loaded = model.load_weights(iter(tensors.items()))
    unloaded = sorted(set(dict(model.named_parameters())) - set(loaded))
    assert not unloaded, f"vLLM would not start: weights not initialized from checkpoint: {unloaded[:5]}"
    return model, trace


def thinker_stage(omni: Omni, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.nn.Module, LoadTrace]:
    from omni_serve.families.qwen2_5_omni.thinker import OmniThinker

    model, trace = load_vllm_model({"model": str(omni.folder), "skip_tokenizer_init": True}, omni.tensors)
    assert type(model) is OmniThinker, f"vLLM built {type(model).__name__} for {omni.raw['architectures']}"
    return model, trace


def talker_stage(omni: Omni, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.nn.Module, LoadTrace]:
    from omni_serve.families.qwen2_5_omni import talker_prompt as talker
    from omni_serve.families.qwen2_5_omni.talker_model import OmniTalker

    model, trace = load_vllm_model(talker.engine_args({"model": str(omni.folder)}), omni.tensors)
    assert type(model) is OmniTalker
    return model, trace


# --- the encoder and audio runners ---------------------------------------------------------------


def encoder_stage(omni: Omni, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.nn.Module, LoadTrace]:
    """The image encoder's vision tower, loaded by the family's encoders.py from the checkpoint folder."""
    from omni_serve.encoder.config import EncoderStageConfig
    from omni_serve.families.qwen2_5_omni import encoders

    monkeypatch.setattr("safetensors.safe_open", FakeSafetensors(omni.tensors))
    # the runner moves the tower to cfg.device; "meta" keeps it weightless (not a value users may set)
    cfg = EncoderStageConfig.model_construct(model=str(omni.folder), modality="image", dtype="float32",
                                             device="meta")
    trace = LoadTrace(omni.tensors)
    with torch.device("meta"), trace:
        tower = encoders.load_vision_tower(cfg, encoders.load_thinker_config(omni.folder))
    return tower, trace


def audio_stage(omni: Omni, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.nn.Module, LoadTrace]:
    """Token2Wav, loaded by the family's token2wav.py from the checkpoint folder."""
    from omni_serve.families.qwen2_5_omni import token2wav

    monkeypatch.setattr("safetensors.safe_open", FakeSafetensors(omni.tensors))
    trace = LoadTrace(omni.tensors)
    with torch.device("meta"), trace:
        model, *_ = token2wav.load_token2wav(omni.folder, "cpu")
    return model, trace


STAGES = {"thinker": thinker_stage, "talker": talker_stage, "encoder": encoder_stage, "audio": audio_stage}


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", OMNI)
def test_each_stage_loads_the_checkpoint_tensors_it_reads_into_slots_of_their_shape(
        name, stage, omni, vllm_world, monkeypatch):
    model = omni(name)
    served, trace = STAGES[stage](model, monkeypatch)
    problems = trace.problems(served, partial=READ_IN_PART.get(stage, ()))
    expected = {n for n in model.tensors if n.startswith(READS[stage])}
    if missing := sorted(expected - trace.read()):
        problems.append(f"reads none of {len(missing)} tensors it serves: {missing[:5]}")
    if extra := sorted(trace.read() - expected):
        problems.append(f"reads {len(extra)} tensors of other stages: {extra[:5]}")
    assert not problems, f"{name} {stage}:\n  " + "\n  ".join(problems[:20])


@pytest.mark.parametrize("name", OMNI)
def test_every_checkpoint_tensor_is_read_by_some_stage(name, omni):
    prefixes = tuple(p for stage in READS.values() for p in stage)
    unread = sorted(n for n in omni(name).tensors if not n.startswith(prefixes) and n not in UNREAD)
    assert not unread, f"{len(unread)} checkpoint tensors no stage reads: {unread[:10]}"


# --- Qwen-Image: the DiT stage's pipeline components ---------------------------------------------


def qwen_image_components() -> dict[str, torch.nn.Module]:
    """The components the DiT stage's DiffusionPipeline loads, by model_index.json's classes, on meta."""
    import importlib

    index = hub_config("qwen_image/model_index.json")
    built = {}
    for part in ("transformer", "vae", "text_encoder"):
        library, class_name = index[part]
        cls = getattr(importlib.import_module(library), class_name)
        config = hub_config(f"qwen_image/{part}.json")
        with torch.device("meta"):
            if library == "diffusers":
                built[part] = cls.from_config(config)
            else:
                built[part] = cls._from_config(cls.config_class(**config))
    return built


def test_qwen_image_components_are_the_pipelines_and_fit_each_other_at_full_size():
    from diffusers import QwenImagePipeline

    index, declared = hub_config("qwen_image/model_index.json"), QwenImagePipeline.__init__.__annotations__
    assert index["_class_name"] == QwenImagePipeline.__name__
    assert {part: index[part][1] for part in declared if part != "return"} == {
        part: getattr(cls, "__name__", cls) for part, cls in declared.items() if part != "return"}
    parts = qwen_image_components()
    transformer, vae, text = parts["transformer"], parts["vae"], parts["text_encoder"]
    patch = transformer.config.patch_size
    latent = vae.config.z_dim * patch * patch  # packed 2x2 latent patches
    text_width = text.config.get_text_config().hidden_size
    assert transformer.txt_in.in_features == text_width, "the text encoder's rows feed txt_in"
    assert transformer.img_in.in_features == latent, "VAE latents, packed, feed img_in"
    assert transformer.proj_out.out_features == latent, "proj_out predicts packed latents"
    assert len(vae.config.latents_mean) == len(vae.config.latents_std) == vae.config.z_dim
    head = transformer.config.attention_head_dim
    assert sum(transformer.config.axes_dims_rope) == head, "the rope axes cover the head"
    from omni_serve.dit.config import DitStageConfig

    vae_scale = 2 ** len(vae.config.temperal_downsample)
    assert DitStageConfig.model_fields["side_multiple"].default % (vae_scale * 2) == 0
