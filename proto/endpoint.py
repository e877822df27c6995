"""Where the sidecar listens by default, and checks on endpoint strings."""

from __future__ import annotations

import os

ENV_ENDPOINT = "OMNI_SIDECAR_ENDPOINT"


def default_endpoint() -> str:
    """`$OMNI_SIDECAR_ENDPOINT`, else a per-user UDS under the runtime dir."""
    env = os.environ.get(ENV_ENDPOINT)
    if env:
        return env
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return f"ipc://{base}/omni-sidecar-{os.getuid()}/sidecar.sock"


def ipc_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None


def check_endpoint(endpoint: str) -> None:
    """Only UDS endpoints for now: TCP needs CURVE keys, which land with issue #5."""
    if ipc_path(endpoint) is None:
        raise ValueError(
            f"endpoint {endpoint!r} is not ipc://; only Unix-socket endpoints are allowed "
            "(tcp:// would expose hooks to the network without authentication)"
        )
