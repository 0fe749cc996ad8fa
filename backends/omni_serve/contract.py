"""Tensor contracts of every stage: the one place tensor names, dtypes and shapes live.

Imported by the repository generator (config.pbtxt inputs/outputs), by the
Triton adapters in backends/*/model.py and by omni_client. Nothing here
imports tritonserver or torch; the types the contracts are written in,
`TensorSpec` and `StageContract`, are omni_serve.tensor_spec's.
"""
from __future__ import annotations

from omni_serve.tensor_spec import StageContract, TensorSpec

# What a Triton-batched stage gets where its spec (or a bare config.pbtxt) says nothing.
DEFAULT_MAX_BATCH_SIZE = 8
DEFAULT_MAX_QUEUE_DELAY_US = 2000


# --- LLM core (omni_llm) -------------------------------------------------------
# A superset of Triton's vllm_backend interface, so its clients work unchanged.

class LLM:
    TEXT_INPUT = "text_input"
    STREAM = "stream"
    SAMPLING_PARAMETERS = "sampling_parameters"
    EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"
    RETURN_FINISH_REASON = "return_finish_reason"
    RETURN_NUM_INPUT_TOKENS = "return_num_input_tokens"
    RETURN_NUM_OUTPUT_TOKENS = "return_num_output_tokens"
    RETURN_CUMULATIVE_LOGPROB = "return_cumulative_logprob"
    RETURN_LOGPROBS = "return_logprobs"
    IMAGE = "image"
    EMBEDDING_REQUEST = "embedding_request"
    # Omni extras.
    AUDIO = "audio"
    VIDEO = "video"
    USE_AUDIO_IN_VIDEO = "use_audio_in_video"
    PROMPT_TOKEN_IDS = "prompt_token_ids"
    MESSAGES = "messages"
    IMAGE_EMBEDS = "image_embeds"
    IMAGE_GRID_THW = "image_grid_thw"
    AUDIO_FEATURES = "audio_features"
    AUDIO_FEATURE_LENGTHS = "audio_feature_lengths"
    RETURN_TOKEN_IDS = "return_token_ids"
    RETURN_HIDDEN_STATES = "return_hidden_states"
    HIDDEN_STATES_IN_SHM = "hidden_states_in_shm"
    RETURN_INPUT_TOKEN_IDS = "return_input_token_ids"

    TEXT_OUTPUT = "text_output"
    FINISH_REASON = "finish_reason"
    NUM_INPUT_TOKENS = "num_input_tokens"
    NUM_OUTPUT_TOKENS = "num_output_tokens"
    CUMULATIVE_LOGPROB = "cumulative_logprob"
    LOGPROBS = "logprobs"
    TOKEN_IDS = "token_ids"
    INPUT_EMBEDS = "input_embeds"
    HIDDEN_STATES = "hidden_states"
    HIDDEN_STATES_FILE = "hidden_states_file"
    HIDDEN_STATES_ROWS = "hidden_states_rows"
    INPUT_TOKEN_IDS = "input_token_ids"

    # Boolean request flags that may also arrive as request parameters.
    FLAGS = (STREAM, EXCLUDE_INPUT_IN_OUTPUT, RETURN_FINISH_REASON,
             RETURN_NUM_INPUT_TOKENS, RETURN_NUM_OUTPUT_TOKENS, RETURN_CUMULATIVE_LOGPROB,
             RETURN_LOGPROBS, RETURN_TOKEN_IDS,
             RETURN_HIDDEN_STATES, HIDDEN_STATES_IN_SHM, RETURN_INPUT_TOKEN_IDS)
    # Request parameter of a control request: abort the live request whose
    # Triton request id is its value: a gRPC cancel racing a request's
    # completion can abort Triton 2.51 (upstream #7368), so the orchestrator
    # asks the stage directly.
    ABORT_PARAMETER = "omni_abort"
    # Sampling-parameter key (tensor JSON or request parameter) naming the LoRA adapter
    # of one request, one of the model's multi_lora.json names (as in vllm_backend).
    LORA_NAME = "lora_name"


# A vllm_backend model repository, served unchanged by omni_llm: engine arguments in
# <model>/<version>/model.json, LoRA adapters {name: path} in multi_lora.json beside it,
# and the config.pbtxt parameters it reads ("true" turns them on).
VLLM_ENGINE_ARGS_FILE = "model.json"
MULTI_LORA_FILE = "multi_lora.json"
REPORT_CUSTOM_METRICS = "REPORT_CUSTOM_METRICS"
ENABLE_VLLM_HEALTH_CHECK = "ENABLE_VLLM_HEALTH_CHECK"


# Placeholder tokens of multimodal prompts (the omni thinkers' chat templates' names): a
# prompt has one per image (audio clip); the engine expands it to one token per embedding row.
IMAGE_PLACEHOLDER = "<|IMAGE|>"
AUDIO_PLACEHOLDER = "<|AUDIO|>"


LLM_CONTRACT = StageContract(
    backend="omni_llm",
    decoupled=True,
    batching="engine",
    inputs=(
        TensorSpec(LLM.TEXT_INPUT, "TYPE_STRING", (1,), optional=True,
                   doc="prompt text (required unless prompt_token_ids or messages is sent)"),
        TensorSpec(LLM.STREAM, "TYPE_BOOL", (1,), optional=True,
                   doc="send deltas as they are generated (default false: one response)"),
        TensorSpec(LLM.SAMPLING_PARAMETERS, "TYPE_STRING", (1,), optional=True,
                   doc="JSON object of vLLM SamplingParams fields"),
        TensorSpec(LLM.EXCLUDE_INPUT_IN_OUTPUT, "TYPE_BOOL", (1,), optional=True,
                   doc="non-streaming only: omit the prompt from text_output (default false, "
                       "as in vllm_backend)"),
        TensorSpec(LLM.RETURN_FINISH_REASON, "TYPE_BOOL", (1,), optional=True),
        TensorSpec(LLM.RETURN_NUM_INPUT_TOKENS, "TYPE_BOOL", (1,), optional=True),
        TensorSpec(LLM.RETURN_NUM_OUTPUT_TOKENS, "TYPE_BOOL", (1,), optional=True),
        TensorSpec(LLM.RETURN_CUMULATIVE_LOGPROB, "TYPE_BOOL", (1,), optional=True),
        TensorSpec(LLM.RETURN_LOGPROBS, "TYPE_BOOL", (1,), optional=True,
                   doc="logprobs of the tokens of each response, as JSON (sampling parameter "
                       "logprobs sets how many alternatives; without it the JSON is null)"),
        TensorSpec(LLM.IMAGE, "TYPE_STRING", (-1,), optional=True,
                   doc="vision models on vLLM's own processor: base64-encoded images of "
                       "text_input, one per element (as vllm_backend takes them)"),
        TensorSpec(LLM.AUDIO, "TYPE_STRING", (-1,), optional=True,
                   doc="audio models on vLLM's own processor: the sound files (WAV, FLAC, "
                       "OGG, MP3) of text_input, one per element, decoded to mono at the "
                       "model's feature rate"),
        TensorSpec(LLM.VIDEO, "TYPE_STRING", (-1,), optional=True,
                   doc="video models on vLLM's own processor: the video files (MP4, MOV, MKV, "
                       "WebM, AVI) of text_input, one per element; their frames are sampled as "
                       "the model family's processor samples them, without their sound"),
        TensorSpec(LLM.USE_AUDIO_IN_VIDEO, "TYPE_BOOL", (1,), optional=True,
                   doc="with video: true hears each video's soundtrack interleaved with its "
                       "frames in time (vLLM's mm_processor_kwargs use_audio_in_video); "
                       "default: without it"),
        TensorSpec(LLM.EMBEDDING_REQUEST, "TYPE_STRING", (1,), optional=True,
                   doc="pooling models: JSON {\"input\": text or token ids, \"pooling_params\": "
                       "{\"dimensions\": [n]}}; text_output is the embedding as a JSON list"),
        TensorSpec(LLM.PROMPT_TOKEN_IDS, "TYPE_INT64", (-1,), optional=True,
                   doc="the prompt as token ids instead of text_input"),
        TensorSpec(LLM.MESSAGES, "TYPE_STRING", (1,), optional=True,
                   doc="instead of text_input: a chat, a JSON array of OpenAI messages "
                       "(text content), rendered by the checkpoint's chat template as "
                       "vLLM's OpenAI server does"),
        TensorSpec(LLM.IMAGE_EMBEDS, "TYPE_FP32", (-1, -1), optional=True,
                   doc="multimodal thinkers: the vision tower's rows (tokens x hidden) of every "
                       "image of text_input, in order; one <|IMAGE|> placeholder per image"),
        TensorSpec(LLM.IMAGE_GRID_THW, "TYPE_INT64", (-1, 3), optional=True,
                   doc="with image_embeds: each image's (t, h, w) patch grid before merging"),
        TensorSpec(LLM.AUDIO_FEATURES, "TYPE_FP32", (-1, -1), optional=True,
                   doc="multimodal thinkers: log-mel features (mel bins x frames) of every "
                       "audio clip of text_input, concatenated; one <|AUDIO|> per clip"),
        TensorSpec(LLM.AUDIO_FEATURE_LENGTHS, "TYPE_INT64", (-1,), optional=True,
                   doc="with audio_features: each clip's number of frames"),
        TensorSpec(LLM.RETURN_TOKEN_IDS, "TYPE_BOOL", (1,), optional=True,
                   doc="also return the generated token ids (deltas when streaming)"),
        TensorSpec(LLM.RETURN_HIDDEN_STATES, "TYPE_BOOL", (1,), optional=True,
                   doc="also return input_embeds and hidden_states: one row per prompt "
                       "position, then one per generated token fed back (the last token is "
                       "never fed: prompt + n - 1 rows in all), new rows with each response"),
        TensorSpec(LLM.HIDDEN_STATES_IN_SHM, "TYPE_BOOL", (1,), optional=True,
                   doc="with return_hidden_states, for a caller on this host: the rows stay in "
                       "a /dev/shm file the caller reads and then deletes; responses carry "
                       "hidden_states_file and hidden_states_rows instead of the tensors"),
        TensorSpec(LLM.RETURN_INPUT_TOKEN_IDS, "TYPE_BOOL", (1,), optional=True,
                   doc="also return input_token_ids (with the first response)"),
    ),
    outputs=(
        TensorSpec(LLM.TEXT_OUTPUT, "TYPE_STRING", (-1,)),
        TensorSpec(LLM.FINISH_REASON, "TYPE_STRING", (-1,)),
        TensorSpec(LLM.NUM_INPUT_TOKENS, "TYPE_UINT32", (-1,)),
        TensorSpec(LLM.NUM_OUTPUT_TOKENS, "TYPE_UINT32", (-1,),
                   doc="tokens this response adds (streaming: since the previous response)"),
        TensorSpec(LLM.CUMULATIVE_LOGPROB, "TYPE_FP32", (-1,),
                   doc="the reply's cumulative logprob so far (NaN unless the sampling "
                       "parameter logprobs is set, as vLLM computes it only then)"),
        TensorSpec(LLM.LOGPROBS, "TYPE_STRING", (-1,),
                   doc="JSON: per new token {token id: {logprob, rank, decoded_token}}"),
        TensorSpec(LLM.TOKEN_IDS, "TYPE_INT64", (-1,)),
        TensorSpec(LLM.INPUT_EMBEDS, "TYPE_FP32", (-1, -1),
                   doc="with return_hidden_states: each row's input embedding (rows x hidden; "
                       "a media position's row is the media embedding)"),
        TensorSpec(LLM.HIDDEN_STATES, "TYPE_FP32", (-1, -1),
                   doc="with return_hidden_states: each row's final hidden state (after the "
                       "last norm; transformers' hidden_states[-1])"),
        TensorSpec(LLM.HIDDEN_STATES_FILE, "TYPE_STRING", (1,),
                   doc="with hidden_states_in_shm: the file of float32 rows [input embedding | "
                       "hidden state], row r at byte r * width * 4"),
        TensorSpec(LLM.HIDDEN_STATES_ROWS, "TYPE_INT64", (3,),
                   doc="with hidden_states_in_shm: first row, rows this response adds, row "
                       "width in floats (2 x hidden); the rows are in the file when it arrives"),
        TensorSpec(LLM.INPUT_TOKEN_IDS, "TYPE_INT64", (-1,),
                   doc="with return_input_token_ids: the prompt's token ids as the engine saw "
                       "them (media placeholders expanded to one per row)"),
    ),
)

# --- Talker (omni_talker) ---------------------------------------------------------
# The model family's speech LM on vLLM: reads what a thinker stage on this host
# handed over and streams codec codes, one frame of `groups` codes per step.

class TALKER:
    THINKER_HIDDEN_STATES_FILE = "thinker_hidden_states_file"
    PROMPT_TOKEN_IDS = "prompt_token_ids"
    IMAGE_GRID_THW = "image_grid_thw"
    AUDIO_FEATURE_LENGTHS = "audio_feature_lengths"
    VIDEO_GRID_THW = "video_grid_thw"
    VIDEO_SECOND_PER_GRID = "video_second_per_grid"
    USE_AUDIO_IN_VIDEO = "use_audio_in_video"
    VOICE = "voice"
    SAMPLING_PARAMETERS = "sampling_parameters"

    CODEC_IDS = "codec_ids"
    FINISH_REASON = "finish_reason"

    ABORT_PARAMETER = LLM.ABORT_PARAMETER


TALKER_CONTRACT = StageContract(
    backend="omni_talker",
    decoupled=True,
    batching="engine",
    inputs=(
        # These two are required of every generation request (the stage says which is
        # missing, INVALID_ARG); optional to Triton so that a control request (the
        # omni_abort parameter, no tensors) reaches the stage, as on omni_llm.
        TensorSpec(TALKER.THINKER_HIDDEN_STATES_FILE, "TYPE_STRING", (1,), optional=True,
                   doc="required: the hidden_states_file a thinker stage on this host handed "
                       "over (hidden_states_in_shm); its rows are read as the thinker writes them"),
        TensorSpec(TALKER.PROMPT_TOKEN_IDS, "TYPE_INT64", (-1,), optional=True,
                   doc="required: the thinker's input_token_ids (its prompt as its engine saw it)"),
        TensorSpec(TALKER.IMAGE_GRID_THW, "TYPE_INT64", (-1, 3), optional=True,
                   doc="each image's (t, h, w) patch grid of the thinker's prompt"),
        TensorSpec(TALKER.AUDIO_FEATURE_LENGTHS, "TYPE_INT64", (-1,), optional=True,
                   doc="each audio clip's number of feature frames of the thinker's prompt"),
        TensorSpec(TALKER.VIDEO_GRID_THW, "TYPE_INT64", (-1, 3), optional=True,
                   doc="each video's (t, h, w) patch grid of the thinker's prompt"),
        TensorSpec(TALKER.VIDEO_SECOND_PER_GRID, "TYPE_FP32", (-1,), optional=True,
                   doc="with video_grid_thw: the seconds each video's temporal grid step "
                       "stands for (its M-RoPE times)"),
        TensorSpec(TALKER.USE_AUDIO_IN_VIDEO, "TYPE_BOOL", (1,), optional=True,
                   doc="with video_grid_thw: the thinker heard each video's soundtrack "
                       "(audio_feature_lengths holds its frames, after any audio clip's)"),
        TensorSpec(TALKER.VOICE, "TYPE_STRING", (1,), optional=True,
                   doc="a voice of the checkpoint (default: its first)"),
        TensorSpec(TALKER.SAMPLING_PARAMETERS, "TYPE_STRING", (1,), optional=True,
                   doc="JSON object of vLLM SamplingParams fields over the checkpoint's "
                       "talker defaults"),
    ),
    outputs=(
        TensorSpec(TALKER.CODEC_IDS, "TYPE_INT64", (-1, -1),
                   doc="the new codec codes, [frames, groups] (groups: the family's "
                       "codebooks, its speech feed's codec_groups)"),
        TensorSpec(TALKER.FINISH_REASON, "TYPE_STRING", (1,),
                   doc="on the last response: stop, length or abort"),
    ),
)

# --- Diffusion generator (omni_dit) --------------------------------------------------
# Triton's dynamic batcher groups requests; dims exclude the batch dimension.

class DIT:
    PROMPT = "prompt"
    NEGATIVE_PROMPT = "negative_prompt"
    HEIGHT = "height"
    WIDTH = "width"
    NUM_INFERENCE_STEPS = "num_inference_steps"
    GUIDANCE_SCALE = "guidance_scale"
    SEED = "seed"
    STEP_CACHE = "step_cache"

    IMAGE = "image"
    IMAGE_RAW = "image_raw"


DIT_CONTRACT = StageContract(
    backend="omni_dit",
    batching="triton",
    checkpoint_marker="model_index.json",  # a diffusers pipeline folder
    inputs=(
        TensorSpec(DIT.PROMPT, "TYPE_STRING", (1,), doc="text prompt"),
        TensorSpec(DIT.NEGATIVE_PROMPT, "TYPE_STRING", (1,), optional=True),
        TensorSpec(DIT.HEIGHT, "TYPE_INT32", (1,), optional=True, doc="pixels (default: spec)"),
        TensorSpec(DIT.WIDTH, "TYPE_INT32", (1,), optional=True, doc="pixels (default: spec)"),
        TensorSpec(DIT.NUM_INFERENCE_STEPS, "TYPE_INT32", (1,), optional=True),
        TensorSpec(DIT.GUIDANCE_SCALE, "TYPE_FP32", (1,), optional=True,
                   doc="true classifier-free guidance scale (needs negative_prompt to matter)"),
        TensorSpec(DIT.SEED, "TYPE_INT64", (1,), optional=True,
                   doc="per-request seed: same image alone or batched"),
        TensorSpec(DIT.STEP_CACHE, "TYPE_BOOL", (1,), optional=True,
                   doc="first-block step cache on/off (default: the stage's `cache`)"),
    ),
    outputs=(
        TensorSpec(DIT.IMAGE, "TYPE_STRING", (1,), doc="PNG bytes"),
        TensorSpec(DIT.IMAGE_RAW, "TYPE_UINT8", (-1, -1, 3), doc="H x W x RGB, when requested"),
    ),
)

# --- Modality encoders (omni_encoder) -------------------------------------------------
# One Triton model per modality (image_encoder, audio_encoder); Triton's dynamic
# batcher groups requests and the encoder tower runs them in one forward.

class ENCODER:
    MEDIA = "media"

    EMBEDDINGS = "embeddings"
    GRID_THW = "grid_thw"
    FEATURES = "features"


ENCODER_CONTRACT = StageContract(
    backend="omni_encoder",
    batching="triton",
    inputs=(
        TensorSpec(ENCODER.MEDIA, "TYPE_STRING", (1,),
                   doc="encoded media: an image file (PNG, JPEG, WebP, ...) for the image "
                       "encoder, a WAV/FLAC/OGG file for the audio encoder"),
    ),
    outputs=(
        TensorSpec(ENCODER.EMBEDDINGS, "TYPE_FP32", (-1, -1),
                   doc="image encoder: the vision tower's rows (tokens x hidden), one per "
                       "image token of the thinker's prompt"),
        TensorSpec(ENCODER.GRID_THW, "TYPE_INT64", (3,),
                   doc="image encoder: the (t, h, w) patch grid before merging"),
        TensorSpec(ENCODER.FEATURES, "TYPE_FP32", (-1, -1),
                   doc="audio encoder: log-mel features (mel bins x frames) for the thinker, "
                       "whose engine runs the audio tower"),
    ),
)

# --- Audio generator (omni_audio) ------------------------------------------------------
# Codec ids -> waveform, one chunk per request. Stateless: a request carries
# `context_tokens` codes of left context (already voiced), the chunk's codes and
# `lookahead_tokens` codes of right context (voiced by the next chunk), so
# chunks of different streams batch together.

class AUDIO:
    CODEC_IDS = "codec_ids"
    CONTEXT_TOKENS = "context_tokens"
    LOOKAHEAD_TOKENS = "lookahead_tokens"
    CODE_OFFSET = "code_offset"
    VOICE = "voice"
    SEED = "seed"

    AUDIO_CHUNK = "audio_chunk"
    SAMPLE_RATE = "sample_rate"


AUDIO_CONTRACT = StageContract(
    backend="omni_audio",
    batching="triton",
    inputs=(
        TensorSpec(AUDIO.CODEC_IDS, "TYPE_INT64", (-1, -1), ragged=True,
                   doc="codec codes, [frames, groups] (groups: the family's codebooks): "
                       "left-context frames, the frames of this chunk, right-context frames"),
        TensorSpec(AUDIO.CONTEXT_TOKENS, "TYPE_INT32", (1,), optional=True,
                   doc="how many leading frames are context only (default 0)"),
        TensorSpec(AUDIO.LOOKAHEAD_TOKENS, "TYPE_INT32", (1,), optional=True,
                   doc="how many trailing frames are right context only (default 0)"),
        TensorSpec(AUDIO.CODE_OFFSET, "TYPE_INT64", (1,), optional=True,
                   doc="stream position of the first frame sent: with one seed per stream, a "
                       "sampling decoder's chunk then starts from the noise the whole utterance "
                       "would (default 0)"),
        TensorSpec(AUDIO.VOICE, "TYPE_STRING", (1,), optional=True,
                   doc="voice name (default: the stage's default_voice; a decoder without "
                       "voices takes none)"),
        TensorSpec(AUDIO.SEED, "TYPE_INT64", (1,), optional=True,
                   doc="seed of a sampling decoder's noise (same audio alone or batched)"),
    ),
    outputs=(
        TensorSpec(AUDIO.AUDIO_CHUNK, "TYPE_FP32", (-1,), doc="mono PCM in [-1, 1]"),
        TensorSpec(AUDIO.SAMPLE_RATE, "TYPE_INT32", (1,)),
    ),
)

# --- Orchestrator (omni_orchestrator) --------------------------------------------------
# The entry model of a multi-stage pipeline: decoupled, one request at a time
# (it fans out to the stages itself); every response carries what is new.

class OMNI:
    TEXT_INPUT = "text_input"
    IMAGE = "image"
    AUDIO = "audio"
    VIDEO = "video"
    USE_AUDIO_IN_VIDEO = "use_audio_in_video"
    MODALITIES = "modalities"
    SAMPLING_PARAMETERS = "sampling_parameters"
    VOICE = "voice"
    SEED = "seed"
    TASK = "task"
    SESSION_ID = "session_id"
    HISTORY = "history"
    TALKER_SAMPLING_PARAMETERS = "talker_sampling_parameters"
    STREAM_AUDIO = "stream_audio"
    RETURN_CODEC_IDS = "return_codec_ids"
    RETURN_TIMELINE = "return_timeline"

    TEXT_OUTPUT = "text_output"
    AUDIO_CHUNK = "audio_chunk"
    SAMPLE_RATE = "sample_rate"
    IMAGE_OUTPUT = "image"
    CODEC_IDS = "codec_ids"
    FINISH_REASON = "finish_reason"
    METRICS = "metrics"

    MODALITY_NAMES = ("text", "audio", "image")
    TASKS = ("chat", "speech")


OMNI_CONTRACT = StageContract(
    backend="omni_orchestrator",
    decoupled=True,
    batching="engine",
    checkpoint_marker="",  # no checkpoint: it only calls the other stages
    inputs=(
        TensorSpec(OMNI.TEXT_INPUT, "TYPE_STRING", (1,), doc="the user's message"),
        TensorSpec(OMNI.IMAGE, "TYPE_STRING", (1,), optional=True,
                   doc="an image file's bytes (PNG, JPEG, WebP, ...)"),
        TensorSpec(OMNI.AUDIO, "TYPE_STRING", (1,), optional=True,
                   doc="an audio file's bytes (WAV, FLAC, OGG)"),
        TensorSpec(OMNI.VIDEO, "TYPE_STRING", (1,), optional=True,
                   doc="a video file's bytes (MP4, MOV, MKV, WebM, AVI); its frames, without "
                       "its sound unless use_audio_in_video, for a thinker that takes video"),
        TensorSpec(OMNI.USE_AUDIO_IN_VIDEO, "TYPE_BOOL", (1,), optional=True,
                   doc="with video: true hears the clip's soundtrack interleaved with its "
                       "frames in time (default: the checkpoint processor's default)"),
        TensorSpec(OMNI.MODALITIES, "TYPE_STRING", (-1,), optional=True,
                   doc='outputs wanted, any of "text", "audio", "image" (default: text)'),
        TensorSpec(OMNI.SAMPLING_PARAMETERS, "TYPE_STRING", (1,), optional=True,
                   doc="JSON object of vLLM SamplingParams fields for the thinker"),
        TensorSpec(OMNI.VOICE, "TYPE_STRING", (1,), optional=True,
                   doc="voice of the speech output (default: the audio stage's)"),
        TensorSpec(OMNI.SEED, "TYPE_INT64", (1,), optional=True,
                   doc="seed of the audio and image generators"),
        TensorSpec(OMNI.TASK, "TYPE_STRING", (1,), optional=True,
                   doc='"chat" (default): answer text_input; "speech": read text_input aloud '
                       "(the talker voices it; no thinker)"),
        TensorSpec(OMNI.SESSION_ID, "TYPE_STRING", (1,), optional=True,
                   doc="conversation id: every request of a session goes to the same thinker "
                       "engine (rendezvous hashing), so its prefix cache holds the conversation; "
                       "without one, the least busy engine"),
        TensorSpec(OMNI.HISTORY, "TYPE_STRING", (1,), optional=True,
                   doc='JSON array of the earlier turns, [{"role": "user"|"assistant", '
                       '"content": "..."}, ...], rendered before text_input in the chat template'),
        TensorSpec(OMNI.TALKER_SAMPLING_PARAMETERS, "TYPE_STRING", (1,), optional=True,
                   doc="JSON object of the talker's sampling: temperature (0 = greedy), top_k, "
                       "top_p, repetition_penalty, max_tokens; absent keys keep the checkpoint's "
                       "defaults (the talker's seed is the seed input)"),
        TensorSpec(OMNI.STREAM_AUDIO, "TYPE_BOOL", (1,), optional=True,
                   doc="true (default): audio in chunks as it is made; false: the whole "
                       "utterance decoded at once, sent as one audio_chunk"),
        TensorSpec(OMNI.RETURN_CODEC_IDS, "TYPE_BOOL", (1,), optional=True,
                   doc="also return the talker's codec ids (codec_ids); needs audio output"),
        TensorSpec(OMNI.RETURN_TIMELINE, "TYPE_BOOL", (1,), optional=True,
                   doc="add this request's timeline to metrics: seconds from its start at "
                       "which each stage call was sent and answered first and last, and the "
                       "orchestrator's own steps"),
    ),
    outputs=(
        TensorSpec(OMNI.TEXT_OUTPUT, "TYPE_STRING", (1,), doc="the new text (a delta)"),
        TensorSpec(OMNI.AUDIO_CHUNK, "TYPE_FP32", (-1,), doc="the next mono PCM chunk"),
        TensorSpec(OMNI.SAMPLE_RATE, "TYPE_INT32", (1,), doc="of audio_chunk"),
        TensorSpec(OMNI.IMAGE_OUTPUT, "TYPE_STRING", (1,), doc="PNG bytes of the generated image"),
        TensorSpec(OMNI.CODEC_IDS, "TYPE_INT64", (-1, -1),
                   doc="with return_codec_ids: the talker's next codec ids, [frames, groups] "
                       "(0-based codes as the audio decoder reads them, one per codebook; "
                       "groups: the family's codebooks), in order"),
        TensorSpec(OMNI.FINISH_REASON, "TYPE_STRING", (1,),
                   doc="on the last response: the thinker's finish reason"),
        TensorSpec(OMNI.METRICS, "TYPE_STRING", (1,),
                   doc="on the last response: JSON of this request's timings"),
    ),
)

CONTRACTS: dict[str, StageContract] = {
    c.backend: c for c in (LLM_CONTRACT, TALKER_CONTRACT, DIT_CONTRACT, ENCODER_CONTRACT,
                           AUDIO_CONTRACT, OMNI_CONTRACT)}

# config.pbtxt parameter that marks a model clients should not offer on its own
# (value "false"; e.g. a talker LLM, whose "text" is codec tokens).
ENTRY_PARAMETER = "omni.entry"

# The per-stage JSON file the generator writes next to config.pbtxt.
ENGINE_ARGS_FILE = "engine.json"
# omni_llm's and omni_talker's engine.json key for the spec's `queue.max_queue_size`: requests that may wait
# beyond the engine's max_num_seqs running ones; one more is rejected at once, UNAVAILABLE.
MAX_QUEUED_ARG = "max_queued_requests"
# config.pbtxt parameters `env.<NAME>` set <NAME> in the stage's stub process.
ENV_PARAMETER_PREFIX = "env."
