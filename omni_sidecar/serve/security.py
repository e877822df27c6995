"""Who may talk to the sidecar.

- Unix sockets (the default): the socket is 0600 inside a 0700 directory owned
  by the sidecar's user, and libzmq checks the peer's uid (SO_PEERCRED) against
  an allow-list (the sidecar's own uid plus `--allow-uid`), so a misconfigured
  directory still admits nobody else.
- TCP is refused unless CURVE keys are configured: the server's secret key and
  a directory of authorized client public keys (libzmq's ZAP checks them).
- Nothing on the wire is ever unpickled or evaluated: msgspec schemas only.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import zmq

from omni_sidecar.errors import OmniSidecarError

log = logging.getLogger("omni_sidecar.security")


class SecurityError(OmniSidecarError, RuntimeError):
    pass


def prepare_socket_dir(socket_path: str) -> None:
    directory = os.path.dirname(socket_path) or "."
    os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.stat(directory)
    if st.st_uid != os.getuid():
        raise SecurityError(
            f"socket directory {directory} belongs to uid {st.st_uid}, not to this user "
            f"({os.getuid()}); use a directory of your own, e.g. $XDG_RUNTIME_DIR/omni-sidecar"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise SecurityError(
            f"socket directory {directory} is open to other users (mode {oct(stat.S_IMODE(st.st_mode))}); "
            f"chmod 700 {directory} or use a private directory"
        )


def secure_socket_file(socket_path: str) -> None:
    os.chmod(socket_path, 0o600)


def filter_peers(sock: zmq.Socket, allowed_uids: list[int]) -> bool:
    """Let libzmq refuse ipc peers whose uid is not allowed. False if libzmq cannot."""
    try:
        for uid in sorted({os.getuid(), *allowed_uids}):
            sock.setsockopt(zmq.IPC_FILTER_UID, uid)
    except (zmq.ZMQError, AttributeError) as exc:
        log.warning("peer uid filtering unavailable (%s); relying on the 0600 socket in a 0700 "
                    "directory", exc)
        return False
    return True


class CurveServer:
    """CURVE encryption + client allow-list for tcp:// endpoints.

    `keys_dir` holds `server.key_secret` (zmq.auth.create_certificates format) and
    `authorized/` with the public `*.key` files of allowed clients.
    """

    def __init__(self, ctx: zmq.Context, keys_dir: str) -> None:
        import zmq.auth
        from zmq.auth.thread import ThreadAuthenticator

        keys = Path(keys_dir)
        secret_file = keys / "server.key_secret"
        authorized = keys / "authorized"
        if not secret_file.exists() or not authorized.is_dir():
            raise SecurityError(
                f"CURVE keys dir {keys} needs server.key_secret and authorized/ (client public keys); "
                "make them with `python -c \"import zmq.auth; zmq.auth.create_certificates(DIR, 'server')\"`"
            )
        self.public, self.secret = zmq.auth.load_certificate(str(secret_file))
        self.auth = ThreadAuthenticator(ctx)
        self.auth.start()
        self.auth.configure_curve(domain="*", location=str(authorized))

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def stop(self) -> None:
        self.auth.stop()
