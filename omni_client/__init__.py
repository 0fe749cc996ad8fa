"""omni_client: the Python SDK for omni pipelines served by Triton.

    from omni_client import OmniClient

    with OmniClient("localhost:8001") as client:
        reply = client.chat("Describe this picture", image="cat.png", modalities=["text", "audio"])
        print(reply.text)
        reply.save_audio("reply.wav")

`AsyncOmniClient` has the same calls for asyncio.
"""
from omni_client._calls import ModelInfo
from omni_client.aio import AsyncOmniClient
from omni_client.client import ClientFactory, OmniClient
from omni_client.errors import (
    BadRequestError,
    CancelledError,
    OmniClientError,
    RequestTimeoutError,
    ServerError,
    UnavailableError,
    from_triton,
)
from omni_client.types import (
    AudioChunk,
    ChatResult,
    CodecIds,
    Completion,
    Event,
    Final,
    ImageOutput,
    SpeechResult,
    TextDelta,
    Usage,
)

__all__ = [
    "AsyncOmniClient",
    "AudioChunk",
    "BadRequestError",
    "CancelledError",
    "ChatResult",
    "ClientFactory",
    "CodecIds",
    "Completion",
    "Event",
    "Final",
    "ImageOutput",
    "ModelInfo",
    "OmniClient",
    "OmniClientError",
    "RequestTimeoutError",
    "ServerError",
    "SpeechResult",
    "TextDelta",
    "Usage",
    "UnavailableError",
    "from_triton",
]
