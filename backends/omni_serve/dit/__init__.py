"""The omni_dit diffusion stage: config, request parsing and the batched pipeline runner.

Nothing here imports Triton; the stage's `model.py` adapter wires it to the stub.
"""
