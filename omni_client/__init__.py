"""omni_client: the Python SDK for omni pipelines served by Triton.

    from omni_client import OmniClient

    with OmniClient("localhost:8001") as client:
        print(client.generate("Hello", max_tokens=16).text)
"""
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
from omni_client.types import Completion, TextDelta

__all__ = [
    "BadRequestError",
    "CancelledError",
    "ClientFactory",
    "Completion",
    "OmniClient",
    "OmniClientError",
    "RequestTimeoutError",
    "ServerError",
    "TextDelta",
    "UnavailableError",
    "from_triton",
]
