"""vllm-omni's platform on a CPU host, given through vllm-omni's own extension point.

vllm-omni has no CPU platform: on a host without an accelerator it runs on its
`UnspecifiedOmniPlatform`, whose `supports_torch_inductor` raises, and its Qwen3 code predictors
(the Qwen3-TTS and Qwen3-Omni talkers' `talker_mtp`) ask it before their first decode step.
`vllm_omni.platform_plugins` is vllm-omni's group for out-of-tree platforms (it resolves
`current_omni_platform` from it, in whichever process asks): this module's entry point names
`CpuOmniPlatform` where vLLM runs on its CPU platform and vllm-omni is the shim's stand-in
(worker_shim/omni_models/package.py), and nothing anywhere else (a GPU host keeps vllm-omni's own
choice; a process that imported vllm-omni for real keeps vllm-omni's behaviour).

The entry point has the shim's plugin name, so the documented `VLLM_PLUGINS=omni_sidecar_shim`
lets it in, as it lets in the shim's `vllm.general_plugins` entry.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys

from worker_shim.omni_models.package import is_stand_in
from worker_shim.upstream.compat import VLLM_OMNI_PACKAGE, VLLM_OMNI_UNSPECIFIED_PLATFORM

log = logging.getLogger("vllm.omni_sidecar.shim.omni_models")
CPU_OMNI_PLATFORM = "worker_shim.omni_models.cpu_platform.CpuOmniPlatform"  # vllm-omni resolves "module.Class"


def cpu_omni_platform() -> str | None:
    """`vllm_omni.platform_plugins` entry point: the CPU platform's qualified name, where it applies."""
    if not is_stand_in(sys.modules.get(VLLM_OMNI_PACKAGE)):
        return None
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    try:
        platform_class()
    except (ImportError, AttributeError) as exc:  # vllm-omni's own error would not say where it came from
        log.warning("omni-sidecar: no CPU platform for vllm-omni: %s.%s is not there (%s); its code predictors "
                    "will fail on CPU", *VLLM_OMNI_UNSPECIFIED_PLATFORM, exc)
        return None
    global _told
    if not _told:  # vllm-omni calls this twice while it resolves its platform
        log.info("omni-sidecar: vllm-omni runs on the shim's CPU platform (its code predictors eager)")
        _told = True
    return CPU_OMNI_PLATFORM


_told = False


@functools.cache
def platform_class() -> type:
    """`CpuOmniPlatform`: vllm-omni's unspecified platform (torch device "cpu", no devices) with the answers a
    CPU has. Made on first use: this module imports where vllm-omni is not installed."""
    module, name = VLLM_OMNI_UNSPECIFIED_PLATFORM
    unspecified = getattr(importlib.import_module(module), name)

    class CpuOmniPlatform(unspecified):  # type: ignore[misc, valid-type]  # vllm-omni's class
        @classmethod
        def supports_torch_inductor(cls) -> bool:
            # The code predictors then run eager: compiling them on CPU costs more than a CPU run gains.
            return False

        @classmethod
        def synchronize(cls) -> None:
            """A CPU's work is done when its call returns."""

    CpuOmniPlatform.__module__ = __name__
    return CpuOmniPlatform


def __getattr__(name: str) -> type:
    if name == "CpuOmniPlatform":  # what vllm-omni resolves CPU_OMNI_PLATFORM to
        return platform_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
