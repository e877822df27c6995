"""Where the sidecar listens by default, and checks on endpoint strings."""

from __future__ import annotations

import os

from proto.settings import ENV_ENDPOINT


def default_endpoint() -> str:
    """`$OMNI_SIDECAR_ENDPOINT`, else a per-user UDS under the runtime dir."""
    env = os.environ.get(ENV_ENDPOINT)
    if env:
        return env
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return f"ipc://{base}/omni-sidecar-{os.getuid()}/sidecar.sock"


def ipc_path(endpoint: str) -> str | None:
    return endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else None


def check_endpoint(endpoint: str, curve_keys: str | None = None) -> None:
    """ipc:// always; tcp:// only with CURVE keys (encryption + client allow-list)."""
    if ipc_path(endpoint) is not None:
        return
    if endpoint.startswith("tcp://"):
        if curve_keys:
            return
        raise ValueError(
            f"endpoint {endpoint!r}: tcp:// is refused without CURVE keys (it would expose the hooks "
            "to the network unauthenticated); give --curve-keys DIR, or use an ipc:// endpoint"
        )
    raise ValueError(f"endpoint {endpoint!r}: use ipc:///path/to/socket (or tcp:// with CURVE keys)")


def pid_namespace() -> str:
    """This process's PID namespace ("pid:[4026531836]"); "" where /proc does not say."""
    import os

    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def process_gone(pid: int, namespace: str) -> bool:
    """True only when `pid` is known dead: same PID namespace as ours, and no such process."""
    import os

    if pid <= 0 or not namespace or namespace != pid_namespace():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive under another uid
    return False
