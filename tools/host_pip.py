"""Run `docker build` with this host's pip configuration, for builds that install from the
package index the host uses (a mirror, a local wheel directory, a proxy's CA).

    python3 tools/host_pip.py docker build --network host -f deploy/Dockerfile.sidecar ... .

Reads pip's own view of the configuration (`pip config list`: /etc/pip.conf, /etc/xdg/pip,
~/.config/pip, PIP_* variables) and passes it as PIP_* build arguments (the Dockerfiles declare
them as ARGs: build-time only, nothing lands in the image's environment). The build runs on the
host network (`--network host`, added when missing), so:
  - http(s) indexes are passed as they are;
  - local ones (a directory, a file:// index, a constraints file) cannot be seen from inside a
    build, so they are served read-only over http on 127.0.0.1 while the command runs;
  - `cert` becomes /etc/ssl/certs/ca-certificates.crt, the bundle inside the base, which
    deploy/local-base.sh copied from this host.
The port is fixed (OMNI_PIP_PORT, default 38471): build arguments are part of the layer cache
key, so a new port each run would rebuild every pip layer.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from urllib.parse import urlparse

PORT = int(os.environ.get("OMNI_PIP_PORT", "38471"))
IN_IMAGE_CA = "/etc/ssl/certs/ca-certificates.crt"
# pip option -> (build argument, what it holds: index URLs, other locations, or plain values)
OPTIONS = {
    "index-url": ("PIP_INDEX_URL", "index"),
    "extra-index-url": ("PIP_EXTRA_INDEX_URL", "index"),
    "find-links": ("PIP_FIND_LINKS", "location"),
    "constraint": ("PIP_CONSTRAINT", "location"),
    "trusted-host": ("PIP_TRUSTED_HOST", "plain"),
    "default-timeout": ("PIP_DEFAULT_TIMEOUT", "plain"),
}


def host_pip_config() -> dict[str, str]:
    """pip's effective settings here: PIP_* variables win over the config files, as in pip."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                         text=True, check=True).stdout
    files, env = {}, {}
    for line in out.splitlines():
        name, _, value = line.partition("=")
        section, _, key = name.rpartition(".")
        value = value.strip().strip("'\"")
        if section == ":env:":
            env[key] = value
        elif section in ("global", "install"):
            files[key] = value
    return {**files, **env}


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # pip's requests are not worth a line each
        pass


@contextlib.contextmanager
def build_args():
    """Yield ["--build-arg", "PIP_...=...", ...]; local locations are served while inside."""
    cfg = host_pip_config()
    with tempfile.TemporaryDirectory(prefix="omni-pip-") as root:
        served = False

        def localize(item: str, kind: str) -> str:
            nonlocal served
            url = urlparse(item)
            if kind == "plain" or url.scheme not in ("", "file"):
                return item
            path = Path(url.path).resolve()
            if not path.exists():
                return ""  # pip ignores a missing location too
            # A file:// simple index links its files as ../../files/...: serve its parent.
            top = path.parent if kind == "index" and path.name == "simple" else path
            link = Path(root) / top.relative_to("/")
            if not link.exists():
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(top)
            served = True
            return f"http://127.0.0.1:{PORT}{path}" + ("/" if path.is_dir() else "")

        args: list[str] = []
        for key, (arg, kind) in OPTIONS.items():
            if key in cfg:
                value = " ".join(filter(None, (localize(v, kind) for v in cfg[key].split())))
                if value:
                    args += ["--build-arg", f"{arg}={value}"]
        if "cert" in cfg:
            args += ["--build-arg", f"PIP_CERT={IN_IMAGE_CA}"]
        server = None
        if served:
            handler = functools.partial(_Quiet, directory=root)
            server = http.server.ThreadingHTTPServer(("127.0.0.1", PORT), handler)
            threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield args
        finally:
            if server is not None:
                server.shutdown()
                server.server_close()


def with_build_args(cmd: list[str], args: list[str]) -> list[str]:
    """`docker build ...` with the build arguments and --network host right after `build`."""
    i = cmd.index("build") + 1
    extra = list(args) + ([] if "--network" in " ".join(cmd) else ["--network", "host"])
    return cmd[:i] + extra + cmd[i:]


def main(argv: list[str]) -> int:
    if "build" not in argv:
        print(__doc__, file=sys.stderr)
        return 2
    with build_args() as args:
        cmd = with_build_args(argv, args)
        print("+", " ".join(cmd), flush=True)
        env = {**os.environ, "DOCKER_BUILDKIT": os.environ.get("DOCKER_BUILDKIT", "0")}
        return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
