"""A vLLM general plugin: a compiled model saved by an earlier start is loaded, not rebuilt.

Runs in every vLLM process (pyproject.toml registers `register` under
`vllm.general_plugins`); what changes is in the worker, where the model is compiled.

vLLM saves each compiled model (its AOT compile cache, under
VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile) and on the next start with the
same config loads it through `torch.compiler.load_compiled_function`, then calls
`finalize_loading` on the artifact's compiled function. vLLM's own backend hands back an
object with that method; the stock inductor backend the CPU platform compiles with
(CompilationMode.DYNAMO_TRACE_ONCE) hands back a plain function, which has none. vLLM
0.32 calls it anyway, takes the AttributeError for a cache miss ("Compiling model again
due to a load failure ... 'function' object has no attribute 'finalize_loading'"), and
compiles again at every start. That plain function needs no finalizing (it is complete
as loaded), so this plugin gives it a no-op `finalize_loading`; where the artifact has
its own, or a later vLLM checks for it, nothing changes.
"""
from __future__ import annotations

import functools
import logging

# a child of "vllm": vLLM configures that logger in its engine-core and worker processes
log = logging.getLogger("vllm.omni_aot_cache")


def _no_finalizing(vllm_config) -> None:
    """What a stock compiled function needs to finish loading: nothing."""


def finalizable(loaded):
    """`loaded` (what torch.compiler.load_compiled_function returns), its compiled function
    given a no-op `finalize_loading` if it has none; returned as it came."""
    compiled = getattr(getattr(loaded, "_artifacts", None), "compiled_fn", None)
    if compiled is not None and not hasattr(compiled, "finalize_loading"):
        try:
            compiled.finalize_loading = _no_finalizing
        except (AttributeError, TypeError):  # not an object that takes attributes
            pass
    return loaded


def with_finalizable(load):
    """`torch.compiler.load_compiled_function` wrapped by `finalizable` (once)."""
    if getattr(load, "omni_finalizable", False):
        return load

    @functools.wraps(load)
    def load_compiled_function(*args, **kwargs):
        return finalizable(load(*args, **kwargs))

    load_compiled_function.omni_finalizable = True
    return load_compiled_function


def register() -> None:
    """Entry point (vllm.general_plugins): wrap the loader vLLM's decorators call (it looks
    `torch.compiler.load_compiled_function` up at each call)."""
    import torch.compiler

    load = getattr(torch.compiler, "load_compiled_function", None)
    if load is None:  # a torch without AOT compile: vLLM does not use the cache either
        return
    torch.compiler.load_compiled_function = with_finalizable(load)
    log.debug("omni: AOT-compiled models load without vLLM's finalize_loading where they "
              "have none")
