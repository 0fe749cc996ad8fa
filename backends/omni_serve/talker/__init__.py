"""The talker stage kind (omni_talker): a model family's speech LM on vLLM."""
