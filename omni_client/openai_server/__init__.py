"""omni-openai: the OpenAI-compatible HTTP frontend (FastAPI) over omni_client."""
