import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# What V2 needs on this CPU-only machine (the Makefile exports the same).
for key, value in {
    "TRITON_INTERPRET": "1",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_USE_V2_MODEL_RUNNER": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(key, value)

# vLLM leaves files in the temporary directory (its IPC sockets, VLLM_RPC_BASE_PATH; its multiprocess
# executor's file-store rendezvous, vllm_dist_*), and an engine the suite kills on purpose cannot remove
# its own. So what the suite starts (engines, sidecars, servers: TMPDIR) and vLLM's sockets in this
# process too get a directory of the session's own, removed at its end; this process's own temporary
# files stay in the temporary directory, where the leftover check looks.
# Pytest's workers (pytest-xdist: `make test` runs two) inherit the directory and keep the temporary
# directory of the process that started them, as that one does.
if "OMNI_TEST_TMPDIR" not in os.environ:
    tempfile.tempdir = tempfile.gettempdir()
    session_tmp = tempfile.mkdtemp(prefix="omni-test-")
    atexit.register(shutil.rmtree, session_tmp, True)
    os.environ["OMNI_TEST_OWN_TMPDIR"] = tempfile.tempdir
    os.environ["OMNI_TEST_TMPDIR"] = os.environ["TMPDIR"] = session_tmp
    os.environ.setdefault("VLLM_RPC_BASE_PATH", session_tmp)
elif "OMNI_TEST_OWN_TMPDIR" in os.environ:
    tempfile.tempdir = os.environ["OMNI_TEST_OWN_TMPDIR"]


LEFTOVERS = pytest.StashKey["LeftoverCheck"]()
ENGINE_JOBS = pytest.StashKey[int]()


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")  # a pytest-xdist worker: its controller owns the check


def pytest_configure(config: pytest.Config) -> None:
    """The leftover check starts before any test (and before pytest-xdist starts its workers, which
    then carry the session's marker: what they start is the session's too)."""
    if _is_worker(config):
        return
    from tests.support.leftovers import LeftoverCheck

    narrowed = {}  # the leftover check's own test narrows what its inner sessions count
    if "OMNI_LEFTOVER_SHM_PREFIXES" in os.environ:
        narrowed["shm_prefixes"] = tuple(filter(None, os.environ["OMNI_LEFTOVER_SHM_PREFIXES"].split(",")))
    if "OMNI_LEFTOVER_ORPHAN_NAMES" in os.environ:
        narrowed["orphan_names"] = tuple(filter(None, os.environ["OMNI_LEFTOVER_ORPHAN_NAMES"].split(",")))
    check = config.stash[LEFTOVERS] = LeftoverCheck(**narrowed)
    check.start()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Fails the run if a process the session started is alive, or a /dev/shm file or a socket file
    it made remains: looked at once every test, fixture and worker has finished (session fixtures,
    sidecars and engines among them, have stopped), listing each process and file."""
    check = session.config.stash.get(LEFTOVERS, None)
    if check is None:
        return
    left = check.finish(float(os.environ.get("OMNI_LEFTOVER_GRACE_S", "15")))  # a shorter one: test_leftover_check.py
    if left:
        if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED  # an interrupt or error keeps its own status
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = (f"leftover check: the test session left these behind (stop what you start; "
                   f"shut vLLM engines down before exiting):\n{left}")
        if reporter is not None:
            reporter.write_sep("=", "leftover check failed", red=True, bold=True)
            reporter.write_line(message, red=True, bold=True)
        else:
            print(message, file=sys.stderr)


@pytest.fixture(scope="session", autouse=True)
def engine_forks(tmp_path_factory, request):
    """Engine jobs of this session (of this worker) fork from one Python with vLLM imported
    (tests/support/engine_forks.py), started at the first job; the session's report says how many ran."""
    from tests.support import procs
    from tests.support.engine_forks import EngineForks

    forks = procs.ENGINE_FORKS = EngineForks(tmp_path_factory.mktemp("engine-forks"))
    yield forks
    procs.ENGINE_FORKS = None
    forks.stop()
    config = request.config
    if _is_worker(config):
        config.workeroutput["engine_jobs"] = forks.jobs  # to the controller: pytest_testnodedown
    else:
        config.stash[ENGINE_JOBS] = forks.jobs


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # pytest-xdist's hook: a worker finished
    config, output = node.config, getattr(node, "workeroutput", {})  # none from a worker that crashed
    config.stash[ENGINE_JOBS] = config.stash.get(ENGINE_JOBS, 0) + output.get("engine_jobs", 0)


def pytest_terminal_summary(terminalreporter, config):
    if ENGINE_JOBS in config.stash:
        terminalreporter.write_line(f"engine jobs run by run_engine: {config.stash[ENGINE_JOBS]}")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from tests.tiny_models.llama import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture
def endpoint(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("sock")
    return f"ipc://{d}/sidecar.sock"


HIDDEN = 128
EMBEDS_LENS = [5, 40, 100]  # 100 > max_num_batched_tokens=64: chunked prefill crosses overlay rows


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="session")
def kwargs_model(tiny_model, e2e_dir) -> str:
    """The tiny model's weights under tests/support/kwargs_model.py's architecture, whose forward
    takes the extra kwargs and logs what it got for each batch row."""
    import json
    import shutil

    path = e2e_dir / "kwargs-model"
    path.mkdir(exist_ok=True)
    for f in os.listdir(tiny_model):
        if f != "config.json":
            shutil.copy(os.path.join(tiny_model, f), path / f)
    config = json.loads(open(os.path.join(tiny_model, "config.json")).read())
    config["architectures"] = ["OmniKwargsLlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="session")
def embeds_case(tiny_model, e2e_dir):
    """Prompt embeddings E and the tokens plain vLLM V2 gives for `prompt_embeds=E`."""
    from tests.support.procs import run_engine, write_embeds

    from worker_shim.upstream.compat import v2_takes_prompt_embeds, vllm_version

    files = write_embeds(e2e_dir, EMBEDS_LENS, HIDDEN)
    # Before vLLM 0.29 only the V1 runner takes prompt_embeds: the reference runs there.
    runner_env = {} if v2_takes_prompt_embeds(vllm_version()) else {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    ref = run_engine(
        {"model": tiny_model, "max_tokens": 16, "prompts": [{"embeds_file": f} for f in files],
         "llm_kwargs": {"enable_prefix_caching": False, "enable_prompt_embeds": True}, "env": runner_env},
        e2e_dir, "plain-embeds",
    )
    assert ref["ok"], ref.get("traceback")
    return {"files": files, "tokens": ref["tokens"]}
