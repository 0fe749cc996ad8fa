"""Load and soak of a running omni server: mixed requests, exact stream accounting, RSS.

Runs in the caller's process (the `omni-soak` command, or a test). Modules: `mix`
(the kinds of request and their tensors), `ledger` (per-stream accounting:
completed, errored, lost, duplicated), `memory` (RSS of the server's processes over
time, growth, plot), `runner` (the worker threads), `cli` (the command line).
"""
from .ledger import Ledger, StreamRecord
from .runner import SoakConfig, SoakResult, run_soak

__all__ = ["Ledger", "SoakConfig", "SoakResult", "StreamRecord", "run_soak"]
