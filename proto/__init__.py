"""Wire schema shared by the vLLM-side shim and the omni sidecar.

Imports msgspec and the standard library only: both peers depend on it, and
the sidecar must stay free of vLLM and torch version skew.
"""

from proto.version import PROTOCOL_MAJOR, PROTOCOL_MINOR, PROTOCOL_VERSION

__all__ = ["PROTOCOL_MAJOR", "PROTOCOL_MINOR", "PROTOCOL_VERSION"]
