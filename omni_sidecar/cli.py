"""`omni-sidecar`: run the hook daemon next to vLLM and ask it how it is doing."""

from __future__ import annotations

import argparse
import json
import logging
import sys

import msgspec

from omni_sidecar import __version__
from proto.endpoint import default_endpoint, ipc_path

LOG_TAIL_CHARS = 3000  # of a failed successor's log, shown by `upgrade`
UPGRADE_POLL_S = 0.05  # `upgrade` asks who answers at the usual address this often

_EPILOG = """\
How it fits together:
  1. omni-sidecar serve --hooks capture            # start the sidecar (this process)
  2. vllm serve MODEL --worker-cls worker_shim.Worker   # vLLM with the shim worker
     (same OMNI_SIDECAR_ENDPOINT in both, or the default endpoint)
  3. omni-sidecar status                            # steps served, latency, sessions

The shim waits up to OMNI_SIDECAR_CONNECT_TIMEOUT seconds (default 30) for the
sidecar at start-up, then fails with a clear error.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omni-sidecar",
        description="Hosts omni / TTS hook logic in a process next to a vLLM engine "
        "whose workers run the omni-sidecar shim.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"omni-sidecar {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    ep_help = f"ZeroMQ ipc:// endpoint (default: $OMNI_SIDECAR_ENDPOINT or {default_endpoint()})"

    s = sub.add_parser(
        "serve", help="run the sidecar daemon",
        description="Run the sidecar daemon. Settings: flags > OMNI_SIDECAR_* env vars > TOML file "
        "(--config / $OMNI_SIDECAR_CONFIG) > defaults. SIGTERM drains (new shims refused, exits once "
        "connected ones go quiet); SIGHUP re-reads the config (log level/format, keep_finished); "
        "SIGINT stops at once.",
    )
    s.add_argument("--config", default=None, help="TOML file with the same keys as the flags")
    _add_settings(s)
    s.add_argument("--takeover", action="store_true",
                   help="hot upgrade: take state and shims over from the sidecar running at --endpoint, "
                   "which then drains and exits (vLLM keeps running)")
    s.add_argument("--takeover-if-running", action="store_true",
                   help="take over if a sidecar is serving at --endpoint, else just serve "
                   "(what a container or unit that replaces itself wants)")
    s.add_argument("--takeover-timeout", type=float, default=60.0,
                   help="give up (and leave the old sidecar serving) after this many seconds (default 60)")

    st = sub.add_parser("status", help="print a running sidecar's status as JSON")
    st.add_argument("--endpoint", default=None, help=ep_help)
    st.add_argument("--timeout", type=float, default=5.0, help="seconds to wait (default 5)")

    u = sub.add_parser(
        "upgrade", help="hot-upgrade the running sidecar to new hook code (serve --takeover, detached)",
        description="Starts `omni-sidecar serve --takeover` with the given options in the background "
        "(forked by the warm spare when the running sidecar has one: `serve --warm-spare`), waits until it has taken over the running sidecar's state and shims, and reports the result. "
        "If the new hook set cannot take the old one's state, nothing switches.",
    )
    u.add_argument("--endpoint", default=None, help=ep_help)
    u.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the switch (default 60)")
    u.add_argument("--cold", action="store_true",
                   help="start the new sidecar as a fresh process even if a warm spare runs (`serve --warm-spare`), "
                   "e.g. after upgrading torch")
    u.add_argument("--log", default=None, help="log file for the new sidecar, appended to (default: a new file next to the socket, <socket>.<time>-<pid>.log)")
    u.add_argument("serve_args", nargs=argparse.REMAINDER,
                   help="options for the new sidecar, e.g. --hooks my.hooks:New --hook-option k=v")

    b = sub.add_parser(
        "bench", help="run the benchmark suite (source checkout; same as `make bench`)",
        description="Runs `python -m bench` from the source checkout: exchange latency vs raw pyzmq, "
        "decode throughput vs plain vLLM V2, arena handoff cost, cold start. Writes BENCHMARKS.md.",
    )
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed to python -m bench")

    o = sub.add_parser("outputs", help="print a request's outputs (names, shapes, dtypes)")
    o.add_argument("req_id", help="vLLM request id")
    o.add_argument("--endpoint", default=None, help=ep_help)
    o.add_argument("--pop", action="store_true", help="remove them from the sidecar")

    a = sub.add_parser("append", help="append entries to a running request (streaming payloads)")
    a.add_argument("req_id", help="vLLM request id (yours or vLLM's)")
    a.add_argument("payload_file", help="vllm-omni additional_information as msgpack bytes ('-': stdin)")
    a.add_argument("--endpoint", default=None, help=ep_help)
    return p


def _add_settings(parser: argparse.ArgumentParser) -> None:
    """One flag per ServeConfig field: help and default come from omni_sidecar/serve/config.py.

    Flags default to None ("not given"), so the environment and the TOML file can set them.
    """
    from omni_sidecar.serve.config import settings

    for field, flag, default, text, choices in settings():
        kwargs: dict = {"dest": field, "default": None, "choices": choices}
        if isinstance(default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif field == "hook_options":
            kwargs.update(action="append", default=[], metavar="KEY=VALUE", dest="hook_option")
        elif field == "allow_uids":
            kwargs.update(action="append", type=int)
        elif isinstance(default, (int, float)):
            kwargs["type"] = type(default)
        if default not in ("", msgspec.NODEFAULT) and field != "hook_options":
            text = f"{text} (default {default})"
        parser.add_argument(flag, help=text, **kwargs)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    endpoint = getattr(args, "endpoint", None) or default_endpoint()
    if args.command == "serve":
        return _serve(args)
    if args.command == "bench":
        return _bench(args.bench_args)
    if args.command == "upgrade":
        return _upgrade(args, endpoint)
    from omni_sidecar.client import AppendRefused, RequestFailed, SidecarClient, SidecarUnavailable

    try:
        with SidecarClient(endpoint, timeout_s=getattr(args, "timeout", 5.0)) as client:
            if args.command == "status":
                print(json.dumps(msgspec.to_builtins(client.status()), indent=2))
                return 0
            if args.command == "append":
                path = args.payload_file
                payload = sys.stdin.buffer.read() if path == "-" else open(path, "rb").read()
                print(f"appended to {args.req_id}: steps after {client.append(args.req_id, payload)} see it")
                return 0
            outs = client.outputs(args.req_id, pop=args.pop)
    except RequestFailed as exc:
        print(f"omni-sidecar: request {exc.req_id} failed: {exc.message}", file=sys.stderr)
        return 2
    except (SidecarUnavailable, AppendRefused, OSError) as exc:  # OSError: the payload file
        print(f"omni-sidecar: {exc}", file=sys.stderr)
        return 2
    if outs is None:
        print(f"omni-sidecar: no request {args.req_id!r} is known to the sidecar at {endpoint} "
              "(never seen, or its outputs were already taken or evicted)", file=sys.stderr)
        return 2
    for name, value in outs.items():
        shown = f"shape={list(value.shape)} dtype={value.dtype}" if hasattr(value, "shape") else repr(value)
        print(f"{name}: {shown}")
    return 0


def _bench(bench_args: list[str]) -> int:
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if not (root / "bench" / "__main__.py").exists():
        print("omni-sidecar bench needs a source checkout (the bench/ folder next to omni_sidecar/)",
              file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, "-m", "bench", *bench_args], cwd=root)


def _serve(args: argparse.Namespace) -> int:
    import os
    from omni_sidecar.client import answers
    from omni_sidecar.serve.config import RELOADABLE, ConfigError, ServeConfig, load_config
    from omni_sidecar.hook_api.loader import HookLoadError, load_hooks, parse_options
    from omni_sidecar.serve.logs import configure_logging
    from omni_sidecar.serve.security import SecurityError
    from omni_sidecar.serve.server import SidecarServer

    try:
        cli = {k: getattr(args, k) for k in ServeConfig.__struct_fields__ if k != "hook_options"}
        cli["hook_options"] = parse_options(args.hook_option)
        config = load_config(dict(cli), args.config)
        configure_logging(config.log_level, config.log_format)
        if config.torch_threads:
            import torch

            torch.set_num_threads(config.torch_threads)
        hooks = load_hooks(config.hooks, config.hook_options)
        server = SidecarServer(config, hooks)
        if args.takeover_if_running and not args.takeover:
            args.takeover = answers(config.endpoint, timeout_s=0.5)
        if args.takeover:
            if ipc_path(config.endpoint) is None:
                raise ValueError("--takeover works on ipc:// endpoints")
            server.endpoint = f"{config.endpoint}.next-{os.getpid()}"  # bind beside the running one
        server.bind()
        if args.takeover:
            server.start_takeover(config.endpoint, args.takeover_timeout)
        if config.warm_spare:
            from omni_sidecar.upgrade.spare import ensure_spare

            ensure_spare(config.endpoint)
    except (HookLoadError, ConfigError, ValueError, SecurityError) as exc:
        print(f"omni-sidecar: {exc}", file=sys.stderr)
        return 2

    def reload() -> None:
        nonlocal config
        try:
            new = load_config(dict(cli), args.config)
        except ConfigError as exc:
            logging.getLogger("omni_sidecar").error("SIGHUP: kept the old config: %s", exc)
            return
        changed = {k: getattr(new, k) for k in RELOADABLE if getattr(new, k) != getattr(config, k)}
        configure_logging(new.log_level, new.log_format)
        server.finished.capacity = new.keep_finished
        server.drain_timeout_s = new.drain_timeout_s
        config = new
        logging.getLogger("omni_sidecar").info(
            "SIGHUP: config reloaded; changed %s (endpoint and hooks change only with a restart "
            "or an upgrade)", changed or "nothing",
        )

    server.on_reload = reload
    server.serve_forever()
    return 2 if server.takeover.failed else 0


def _upgrade(args: argparse.Namespace, endpoint: str) -> int:
    import os
    import subprocess
    import time

    from omni_sidecar.client import SidecarClient, SidecarUnavailable
    from omni_sidecar.upgrade.spare import exited, fork_sidecar

    try:
        with SidecarClient(endpoint, timeout_s=3) as client:
            old_pid = client.status().pid
    except SidecarUnavailable as exc:
        print(f"omni-sidecar upgrade: {exc}", file=sys.stderr)
        return 2
    extra = [a for a in args.serve_args if a != "--"]
    # Each sidecar process gets its own log, appended to: a later upgrade never truncates
    # the file the running sidecar still writes to.
    log_path = args.log or f"{ipc_path(endpoint) or 'omni-sidecar'}.{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}.log"
    serve = ["serve", "--endpoint", endpoint, "--takeover", "--takeover-timeout", str(args.timeout), *extra]
    t0 = time.monotonic()
    pid = None if args.cold else fork_sidecar(endpoint, serve, log_path)
    started = "forked by the warm spare" if pid is not None else "cold start"
    if pid is None:
        with open(log_path, "a") as log_file:
            cold = subprocess.Popen([sys.executable, "-m", "omni_sidecar.cli", *serve], stdout=log_file,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        pid = cold.pid
    while time.monotonic() - t0 < args.timeout + 5:
        if exited(pid):
            tail = open(log_path).read()[-LOG_TAIL_CHARS:] if os.path.exists(log_path) else "(none written)"
            print(f"omni-sidecar upgrade: the new sidecar exited; the old one keeps serving. Its log "
                  f"({log_path}):\n{tail}", file=sys.stderr)
            return 2
        try:
            with SidecarClient(endpoint, timeout_s=UPGRADE_POLL_S * 5) as client:
                status = client.status()  # the new one answers only once it owns the state
            if status.pid == pid:
                took = time.monotonic() - t0
                # uptime counts from the new sidecar's set-up: before it, Python, torch and the hooks loaded.
                print(f"omni-sidecar upgrade: pid {old_pid} -> {pid} ({status.hook_set}) in {took:.2f} s "
                      f"({started} {took - status.uptime_s:.2f} s, then takeover {status.uptime_s:.2f} s); "
                      f"sessions {len(status.sessions)}; log {log_path}")
                return 0
        except SidecarUnavailable:
            pass
        time.sleep(UPGRADE_POLL_S)
    print("omni-sidecar upgrade: no switch within the timeout", file=sys.stderr)
    os.killpg(pid, 15)
    return 2


if __name__ == "__main__":
    sys.exit(main())
