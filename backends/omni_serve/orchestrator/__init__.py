"""Orchestrator (omni_orchestrator): runs one pipeline's stage graph per request."""
