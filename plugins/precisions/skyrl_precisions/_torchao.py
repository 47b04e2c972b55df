"""torchao only where a precision quantizes (no torch import here).

Our own code imports torchao lazily, inside the quantized formats (``_formats``:
mxfp8, int4). transformers, however, imports it at ``import
transformers.modeling_utils`` whenever it is installed (its torchao quantizer:
``transformers/quantizers/quantizer_torchao.py``, behind ``is_torchao_available()``).
That import prints torchao's "Failed to load ... .so" notices (CUDA kernels on a
CPU machine) and torch's pytree deprecation warnings for torchao's enums
(``KernelPreference``, ``ScaleCalculationMode``), for a job that never uses torchao.

:func:`hide_from_transformers` settles transformers' cached availability check as
"not installed" for this process, before transformers' models are imported, without
importing torch or torchao; a plain ``import torchao`` still works afterwards (the
quantized formats are unaffected). The ``bf16`` precision calls it when a job that
uses it starts.
"""

from __future__ import annotations

import sys


def hide_from_transformers() -> bool:
    """Make transformers' ``is_torchao_available()`` answer False for this process.
    Returns whether it now does (False where torchao is imported already, or
    transformers has no such check)."""
    if "torchao" in sys.modules:  # someone imported it already: nothing to avoid
        return False
    try:
        from transformers.utils import import_utils
    except ImportError:  # no transformers: nobody to import torchao behind our back
        return False
    check = getattr(import_utils, "is_torchao_available", None)
    if check is None or not hasattr(check, "cache_info"):  # not the cached check this module knows
        return False
    sys.modules["torchao"] = None  # type: ignore[assignment]  # importlib.util.find_spec answers None
    try:
        return not check()  # computed now and cached (functools.lru_cache) for the process
    finally:
        del sys.modules["torchao"]
