"""`omni-serve`: start a speech pipeline from a config and serve it over HTTP.

    omni-serve --pipeline deploy/speech/tiny.toml --port 8000    # = make serve
    omni-serve --pipeline qwen3-tts --model Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice   # a CUDA host, vllm-omni beside
    curl -s localhost:8000/v1/audio/speech -H 'Content-Type: application/json' \\
         -d '{"input": "hello", "voice": "default"}' -o hello.wav
    omni-serve --pipeline deploy/speech/tiny-thinker.toml        # thinker -> talker -> code2wav: chat too
    curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "hello"}], "modalities": ["text", "audio"]}'

Endpoints: POST /v1/audio/speech (OpenAI's speech API with vllm-omni's fields: model, input,
voice, language, instructions, response_format wav|pcm|flac|mp3|opus, stream, stream_format
sse|audio, max_new_tokens, seed; a Qwen3-TTS Base checkpoint's voice cloning: ref_audio, a data:,
http(s) or allowed file:// URL, with ref_text or x_vector_only_mode; a speaker_embedding; or an
uploaded voice named); POST /v1/audio/speech/batch (vllm-omni's: items spoken at once, each a
base64 answer or its error); POST /v1/audio/voices (a Base checkpoint's voice upload: multipart
audio_sample or speaker_embedding, name, consent, ref_text), DELETE /v1/audio/voices/NAME; WS /v1/audio/speech/stream (vllm-omni's streaming-input
protocol: session.config, input.text, input.done, session.close); with a thinker stage, POST /v1/chat/completions
(vllm-omni's chat answer: messages, modalities text|audio, voice or audio.voice, audio.format,
sampling fields or vllm-omni's sampling_params_list, stream; the thinker's text and its speech); a
pipeline without a thinker answers chat with a 404, as vLLM answers it for a model that cannot
chat; GET /v1/models, /v1/audio/voices, /health, /metrics. README.md, "Speech server", has each
field.

The tiny models' classes live under the repository's tests/: run it from the repository root
with PYTHONPATH=. (their checkpoints are built under .cache/ on the first start).
Arguments follow vLLM's conventions (`--host`, `--port`, `--uvicorn-log-level`; dashes or
underscores; `VLLM_LOGGING_LEVEL` for the log level). Each stage of the config runs its own
upstream AsyncLLM (V2, the shim as its worker) with its own sidecar, started here unless the
config attaches to one already running.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import tempfile
from pathlib import Path

from worker_shim.plugin import REGISTER_ENV


MAX_SOCKET_PATH = 107  # a Unix socket's address (sun_path) less its terminating NUL
UUID_CHARS = 36  # vLLM names each IPC socket by a uuid4


def parser():
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from omni_serve.speech import voices

    p = FlexibleArgumentParser(prog="omni-serve", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pipeline", required=True,
                   help="a built-in pipeline's name (qwen3-tts: a Qwen3-TTS CustomVoice, VoiceDesign or Base checkpoint "
                        "with vllm-omni's own classes, on a CUDA host) or a pipeline's TOML file "
                        "(deploy/speech/tiny.toml: the tiny CPU models, talker -> code2wav; "
                        "deploy/speech/tiny-thinker.toml: thinker -> talker -> code2wav; omni_serve/config.py "
                        "lists every key)")
    p.add_argument("--model", default=None,
                   help="run every stage on this checkpoint (a Hugging Face id or a directory) instead of the "
                        "pipeline's, served under its name (e.g. --pipeline qwen3-tts --model "
                        "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice)")
    p.add_argument("--served-model-name", default=None,
                   help="the name /v1/models lists and requests give (default: the pipeline's, or --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--run-dir", default=None, help="where the sidecars' sockets and logs go (default: a new "
                                                  "private temporary directory, removed on exit)")
    p.add_argument("--codes-log", default=None, metavar="FILE",
                   help="append each request's codec codes (the talker's frames), once served whole, to FILE as a "
                        "JSON line (omni_serve/speech/codes_log.py): for checking them against another server")
    p.add_argument("--allowed-local-media-path", default="", metavar="DIR",
                   help="as vLLM's: a Base request's ref_audio may be a file:// URL of a file under DIR (default: "
                        "none; only data: and http(s) URLs)")
    p.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="as vLLM's: a Base request's http(s) ref_audio is fetched only from these hosts, redirects "
                        "too (default: any host; set it on a server others can reach)")
    p.add_argument("--voice-dir", default=None, metavar="DIR",
                   help="where voices uploaded for cloning (POST /v1/audio/voices, a Base checkpoint) are kept, one "
                        f"file each as vllm-omni keeps them (default: ${voices.DIR_ENV}, else {voices.DEFAULT_DIR}, "
                        f"vllm-omni's; made on the first upload; ${voices.LIMIT_ENV} voices at most, "
                        f"{voices.DEFAULT_LIMIT} by default)")
    p.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="as vLLM's: every /v1 route needs 'Authorization: Bearer KEY' (any of them), else a 401; "
                        "/health and /metrics stay open (default: $VLLM_API_KEY, else no key)")
    p.add_argument("--shutdown-timeout", type=int, default=0, metavar="SECONDS",
                   help="as vLLM's: on SIGTERM or SIGINT no new connection is taken and the requests in flight have "
                        "this long to finish; those still running then end with a 503 (default 0: at once)")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical", "trace"], help="uvicorn's log level")
    return p


def api_keys(given: list[str] | None) -> list[str]:
    """The keys a /v1 request may give: --api-key's, else VLLM_API_KEY's (as `vllm serve` takes them)."""
    return [key for key in (given or [os.environ.get("VLLM_API_KEY", "")]) if key]


SHIM_PLUGIN = "omni_sidecar_shim"  # the shim's entry points' name (vLLM's and vllm-omni's groups)


def plugin_defaults() -> str | None:
    """Where vllm-omni is installed and VLLM_PLUGINS is unset, vLLM would load vllm-omni's entry point, and
    its patches, in every process (and the shim would refuse to start): the shim's plugins alone, as a
    user of the shim sets it. A VLLM_PLUGINS the user set stays. Returns what it set, if anything."""
    from worker_shim.omni_models.package import installed_folder
    from worker_shim.upstream.compat import VLLM_PLUGINS_ENV

    if VLLM_PLUGINS_ENV in os.environ or installed_folder() is None:
        return None
    os.environ[VLLM_PLUGINS_ENV] = SHIM_PLUGIN
    return SHIM_PLUGIN


def cpu_host_defaults() -> None:
    """What V2 needs on a host without CUDA (docs/ARCHITECTURE.md, "Running V2 on a CPU host"); a
    CUDA host gets nothing set."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def vllm_logging() -> None:
    """vLLM's logger set up in this process, as its own CLI does: newer vLLMs do it from the parsed
    arguments (VLLM_LOGGING_LEVEL and the rest from the environment), older ones on import."""
    from vllm import logger as vllm_logger

    configure = getattr(vllm_logger, "configure_logging_from_args", None)
    if configure is not None:
        configure(argparse.Namespace())


def main(argv: list[str] | None = None) -> int:
    # vLLM's parser lists only option groups on a bare --help; ours are few: show them all.
    argv = ["--help=all" if arg in ("-h", "--help") else arg for arg in (sys.argv[1:] if argv is None else argv)]
    args = parser().parse_args(argv)
    vllm_logging()
    from omni_serve.config import ConfigError, load_config, with_model

    try:
        config = load_config(args.pipeline)
    except ConfigError as exc:
        print(f"omni-serve: {exc}", file=sys.stderr)
        return 2
    if args.model:
        config = with_model(config, args.model, args.served_model_name)
    elif args.served_model_name:
        config = dataclasses.replace(config, served_model_name=args.served_model_name)
    # The shim's vLLM plugin calls these in every vLLM process, this one included.
    os.environ[REGISTER_ENV] = ",".join(config.register)
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    if plugin_defaults():
        print(f"omni-serve: vllm-omni is installed: VLLM_PLUGINS={SHIM_PLUGIN} (its own entry point would patch "
              "vLLM in every process; set VLLM_PLUGINS to choose otherwise)", file=sys.stderr)
    cpu_host_defaults()

    import shutil

    import uvicorn

    from omni_serve.api.server import SHUTDOWN_ANSWER_S, DrainingServer, SpeechServer, build_app
    from omni_serve.speech.reference import References
    from omni_serve.stages.sidecars import socket_dir

    if args.shutdown_timeout < 0:
        print("omni-serve: --shutdown-timeout is 0 or more seconds", file=sys.stderr)
        return 2
    local_root = Path(args.allowed_local_media_path) if args.allowed_local_media_path else None
    if local_root is not None and not local_root.is_dir():
        print(f"omni-serve: --allowed-local-media-path {local_root} is not a directory", file=sys.stderr)
        return 2
    references = References(local_root, tuple(args.allowed_media_domains or ()))
    own_dir = args.run_dir is None
    run_dir = socket_dir(Path(tempfile.mkdtemp(prefix="omni-serve-")) if own_dir else Path(args.run_dir).resolve())
    rpc_dir = vllm_rpc_dir()
    try:
        try:
            server = SpeechServer(config, run_dir, Path(args.codes_log) if args.codes_log else None, references,
                                  Path(args.voice_dir).expanduser() if args.voice_dir else None)
        except ConfigError as exc:  # a speech prompt that reads its model found it unservable
            print(f"omni-serve: {exc}", file=sys.stderr)
            return 2
        http = uvicorn.Config(build_app(server, api_keys(args.api_key)), host=args.host, port=args.port,
                              log_level=args.uvicorn_log_level,
                              timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_ANSWER_S)
        # uvicorn raises the signal it stopped on again once it has shut down: a SIGTERM then ends the
        # process here, through the clean-up below, as a SIGINT does.
        signal.signal(signal.SIGTERM, _stopped)
        try:
            DrainingServer(http, server.drain, args.shutdown_timeout).run()
        except KeyboardInterrupt:
            pass
    finally:
        if own_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
        if rpc_dir is not None:
            shutil.rmtree(rpc_dir, ignore_errors=True)
    return 0



def vllm_rpc_dir() -> str | None:
    """A directory of this server's for vLLM's IPC sockets (vLLM makes them in $VLLM_RPC_BASE_PATH, by default
    the temporary directory, and leaves them there), to remove on exit; None where the operator chose one.
    Under /tmp when $TMPDIR would make a socket's path longer than a Unix socket's address takes."""
    if os.environ.get("VLLM_RPC_BASE_PATH"):
        return None
    path = tempfile.mkdtemp(prefix="omni-serve-vllm-")
    if len(path) + len("/") + UUID_CHARS > MAX_SOCKET_PATH:
        os.rmdir(path)
        path = tempfile.mkdtemp(prefix="omni-serve-vllm-", dir="/tmp")
    os.environ["VLLM_RPC_BASE_PATH"] = path
    return path


def _stopped(signum: int, frame: object) -> None:
    raise SystemExit(0)  # a stop asked for and done: a success, as uvicorn.run's SIGINT


if __name__ == "__main__":
    sys.exit(main())
