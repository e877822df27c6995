"""The one base of every error the omni_sidecar package raises."""

from __future__ import annotations


class OmniSidecarError(Exception):
    """Raised by omni_sidecar (configuration, security, hook loading, clients, hook failures)."""
