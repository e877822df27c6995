"""`make demo`: a three-stage speech pipeline on upstream vLLM V2 with omni sidecars.

thinker (tiny Qwen2-VL, text + an image, M-RoPE; `--hooks omni-thinker`) -> talker (tiny
Qwen3-TTS-shaped talker carrying vllm-omni's model hooks, code predictor; `--hooks
omni-talker`) -> code2wav (tiny codec decoder, generation only; `--hooks omni-code2wav`).
The three stages run at once, each in its own process with its own engine and sidecar, and
stream into each other through the sidecars (examples/pipeline/__init__.py says how).
Prints each request's time to first audio and each stage's step latency, and writes a WAV
per request. All weights are random with a fixed seed, built on first use: the words and
the audio are noise; the plumbing is real.

Options: --by-hand then runs the talker and code2wav stages again one after the other (each
takes the previous stage's whole output) and checks the codes and audio equal the streamed run's; --out DIR keeps
the WAVs and logs there; --requests N; --thinker-delay-ms makes the thinker slower than its talker
(as real ones are: the talker then waits for its rows); --cuda runs on a GPU, bf16, thinker and
talker with CUDA graphs (code2wav eager: its forward decodes per request in Python, which a graph
replay skips).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.pipeline import STAGES  # noqa: E402

PROMPTS = ["the quick brown fox", "a sidecar hosts the omni hooks", "every step they exchange small messages",
           "thinker talker code to wave"]
SIZES = {"thinker_max_tokens": 10, "talker_max_tokens": 17, "chunk_frames": 4, "left_context": 8,
         "batched_tokens": 16}
STAGE_TIMEOUT_S = 900


def build_models(cache: Path) -> dict[str, str]:
    from tests.tiny_models.code2wav import build_tiny_code2wav
    from tests.tiny_models.talker import build_tiny_talker
    from tests.tiny_models.vl import VLLM_ARCH, build_tiny_vl

    return {"thinker": str(build_tiny_vl(cache / "tiny-vl-thinker", architecture=VLLM_ARCH)),
            "talker": str(build_tiny_talker(cache / "tiny-qwen3-tts-talker", seed=1)),
            "code2wav": str(build_tiny_code2wav(cache / "tiny-code2wav"))}


class Sidecars:
    """One `omni-sidecar serve` per stage, stopped (and waited for) on exit."""

    def __init__(self, run_dir: Path, chunk_frames: int, left_context: int) -> None:
        from omni_sidecar.client import SidecarUnavailable, wait_ready

        sockets = run_dir / "sockets"  # the sidecars accept only a directory no one else can enter
        sockets.mkdir(mode=0o700, exist_ok=True)
        sockets.chmod(0o700)
        self.endpoints = {s: f"ipc://{sockets}/{s}.sock" for s in STAGES}
        from tests.tiny_models.code2wav import CODE2WAV_CONFIG

        options = {"code2wav": [f"chunk_frames={chunk_frames}", f"left_context={left_context}",
                                f"codebook_size={CODE2WAV_CONFIG['codebook_size']}"]}
        self.procs = []
        for stage in STAGES:
            cmd = [sys.executable, "-m", "omni_sidecar.cli", "serve", "--endpoint", self.endpoints[stage],
                   "--hooks", f"omni-{stage}"]
            for option in options.get(stage, []):
                cmd += ["--hook-option", option]
            log = open(run_dir / f"{stage}-sidecar.log", "w")
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
        for stage, proc in zip(STAGES, self.procs):
            try:
                wait_ready(self.endpoints[stage], 90, proc)
            except SidecarUnavailable as exc:
                self.close()
                raise SystemExit(f"the {stage} sidecar did not start: {exc} (see {run_dir}/{stage}-sidecar.log)")

    def close(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_stages(config: dict, stages: tuple[str, ...]) -> dict[str, dict]:
    """Start `stages` (each its own process), start them together once every engine is up, and
    return their results."""
    run_dir = Path(config["run_dir"])
    (run_dir / "go").unlink(missing_ok=True)
    config_path = run_dir / f"config.{config['mode']}.json"
    config_path.write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = {}
    for stage in stages:
        (run_dir / f"{stage}.ready").unlink(missing_ok=True)
        log = open(run_dir / f"{stage}.{config['mode']}.log", "w")
        procs[stage] = subprocess.Popen([sys.executable, "-m", "examples.pipeline.stage", stage, str(config_path)],
                                        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + STAGE_TIMEOUT_S
        while not all((run_dir / f"{s}.ready").exists() for s in stages):
            for stage, proc in procs.items():
                if proc.poll() is not None and not (run_dir / f"{stage}.ready").exists():
                    raise SystemExit(f"the {stage} stage exited while starting (see {run_dir}/{stage}.{config['mode']}.log)")
            if time.monotonic() > deadline:
                raise SystemExit(f"the stages did not start within {STAGE_TIMEOUT_S}s (logs in {run_dir})")
            time.sleep(0.05)
        # Written aside and renamed: a stage polling for "go" must never read it half written.
        (run_dir / "go.tmp").write_text(repr(time.time()))
        (run_dir / "go.tmp").replace(run_dir / "go")
        while any(proc.poll() is None for proc in procs.values()):
            failed = [s for s, proc in procs.items() if proc.poll() not in (None, 0)]
            if failed:  # the others would wait for its outputs for ever
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"the stages did not finish within {STAGE_TIMEOUT_S}s (logs in {run_dir}):\n"
                                 + "\n".join(_tail(run_dir / f"{s}.{config['mode']}.log") for s in stages))
            time.sleep(0.1)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = {}
    for stage in stages:
        path = run_dir / f"{stage}.{config['mode']}.json"
        results[stage] = json.loads(path.read_text()) if path.exists() else {"error": "stopped with no result"}
    # The stage that failed first says why; the ones stopped after it have no result.
    for stage in sorted(stages, key=lambda s: "no result" in results[s].get("error", "")):
        if "error" in results[stage]:
            log = run_dir / f"{stage}.{config['mode']}.log"
            raise SystemExit(f"the {stage} stage failed: {results[stage]['error']}\n{_tail(log)}")
    return results


BY_HAND = "-by-hand"  # request id suffix: the sidecars keep the streamed run's outputs under the plain ids


def _tail(log: Path, lines: int = 12) -> str:
    """The end of a stage's log (its own event lines and errors, not vLLM's start-up chatter)."""
    text = log.read_text(errors="replace").splitlines() if log.exists() else []
    keep = [line for line in text if line.startswith("[") and "s]" in line or "Error" in line]
    return f"--- {log.name}\n" + "\n".join((keep or text)[-lines:])


def by_hand(config: dict) -> dict[str, dict]:
    """The talker and code2wav stages again, one after the other: the talker takes each thinker
    request's whole output (the streamed run's thinker, finished), the code2wav each talker
    request's whole codes once the talker has finished them all. Results under the plain ids."""
    requests = [{**r, "id": r["id"] + BY_HAND, "thinker_id": r["id"]} for r in config["requests"]]
    results = run_stages({**config, "mode": "by-hand", "requests": requests}, ("talker", "code2wav"))
    for result in results.values():
        for key in ("codes", "audio", "first_audio_s", "added_s", "finished_s", "appends", "whole_at_add"):
            if key in result:
                result[key] = {k.removesuffix(BY_HAND): v for k, v in result[key].items()}
    return results


def report(config: dict, results: dict[str, dict]) -> None:
    audio = results["code2wav"]
    print(f"== {len(config['requests'])} requests through thinker -> talker -> code2wav, streaming "
          f"({audio['wall_s']:.2f} s from start to the last audio)")
    for req in config["requests"]:
        rid = req["id"]
        thinker = results["thinker"]["requests"][rid]
        wave = audio["audio"][rid]
        seconds = len(wave["waveform"]) / wave["sr"] if wave["sr"] else 0.0
        print(f"   [{rid}] image + {req['text']!r}: thinker {thinker['prompt_len']} prompt rows -> "
              f"{len(thinker['token_ids'])} tokens; talker {len(results['talker']['codes'][rid])} codec frames; "
              f"{rid}.stream.wav {seconds:.2f} s @ {wave['sr']} Hz; time to first audio "
              f"{audio['first_audio_s'][rid] * 1e3:.0f} ms")
    print("   per-stage step latency (engine step wall time; shim: StepEnd cost, blocking round trips):")
    for stage in STAGES:
        steps, shim = results[stage]["steps"], results[stage]["shim"]
        print(f"     {stage:9s} {steps['steps']:3d} steps, p50 {steps['p50_ms']:.1f} ms, p90 {steps['p90_ms']:.1f} ms; "
              f"StepEnd p50 {shim.get('post_us_p50', 0):.0f} us, {shim.get('blocking_exchanges', 0)} blocking "
              f"(p50 {shim.get('exchange_us_p50', 0):.0f} us)")


def compare(streamed: dict[str, dict], hand: dict[str, dict], atol: float = 1e-5) -> float:
    """Worst waveform difference streamed vs by hand; raises if codes or audio differ."""
    worst = 0.0
    for rid, wave in streamed["code2wav"]["audio"].items():
        if streamed["talker"]["codes"][rid] != hand["talker"]["codes"][rid]:
            raise SystemExit(f"[{rid}] the talker's codes differ between the streamed run and the one by hand")
        a, b = wave["waveform"], hand["code2wav"]["audio"][rid]["waveform"]
        if len(a) != len(b):
            raise SystemExit(f"[{rid}] {len(a)} samples streamed, {len(b)} by hand")
        worst = max([worst] + [abs(x - y) for x, y in zip(a, b)])
    if worst > atol:
        raise SystemExit(f"the streamed audio differs from the audio by hand by up to {worst:.3g} (> {atol})")
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3, help="how many requests (each an image + a text)")
    parser.add_argument("--by-hand", action="store_true", help="also run the stages one after another and compare")
    parser.add_argument("--out", type=Path, help="keep WAVs, results and logs here (default: a temporary directory)")
    parser.add_argument("--cuda", action="store_true", help="run on the GPU with CUDA graphs")
    parser.add_argument("--thinker-delay-ms", type=float, default=0.0,
                        help="sleep before each thinker step: a thinker much slower than its talker, as real "
                             "ones are (the talker then waits for its rows)")
    args = parser.parse_args()
    if args.requests < 1:
        parser.error("--requests must be at least 1")
    run_dir = args.out or Path(tempfile.mkdtemp(prefix="omni-demo-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    run_dir = run_dir.resolve()
    requests = [{"id": f"r{i}", "text": PROMPTS[i % len(PROMPTS)], "image_seed": i} for i in range(args.requests)]
    print(f"== building the tiny models (cached under .cache/) and starting three sidecars; run in {run_dir}")
    models = build_models(ROOT / ".cache")
    sidecars = Sidecars(run_dir, SIZES["chunk_frames"], SIZES["left_context"])
    try:
        config = {"run_dir": str(run_dir), "mode": "stream", "models": models, "endpoints": sidecars.endpoints,
                  "requests": requests, "cuda": args.cuda, "thinker_delay_s": args.thinker_delay_ms / 1e3, **SIZES}
        print("== starting the three stages (one vLLM V2 engine + shim each), then streaming")
        streamed = run_stages(config, STAGES)
        report(config, streamed)
        if args.by_hand:
            hand = by_hand(config)
            worst = compare(streamed, hand)
            print(f"== by hand (each stage given the previous one's whole output): same codes, audio equal "
                  f"(max |diff| {worst:.2g})")
        (run_dir / "demo.json").write_text(json.dumps({"stream": streamed, **({"by_hand": hand} if args.by_hand else {})}))
    finally:
        sidecars.close()
    print(f"== done: WAVs in {run_dir}")


if __name__ == "__main__":
    main()
