"""Modality encoders (omni_encoder): media bytes -> embeddings for the LLM prompt."""
