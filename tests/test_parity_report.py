"""The GPU parity command's CPU side (deploy/gpu/parity.py, talker_engines.py): its arguments, the
engines of each part, the turn order of the timed rounds, and the report of two parts' runs merged
into vllm-omni-parity.json and its BENCHMARKS.md rows, from engine results as the engines write them."""

from __future__ import annotations

import json
import sys
import time

import pytest

from tests.support.procs import ROOT

sys.path.insert(0, str(ROOT / "deploy" / "gpu"))

import parity  # noqa: E402
import talker_engines  # noqa: E402
from acceptance import Check  # noqa: E402

TALKERS = ["omni-async-off", "shim-async-off", "omni-async-on", "shim-async-on"]


def test_arguments_and_the_engines_of_each_part():
    args = parity.parse_args(["--model", "m"])
    assert (args.part, args.rounds, args.profile_set, args.profile_s) == ("all", 4, "", 4)  # py-spy off by default
    names = {part: [s["name"] for s in parity.engine_specs(parity.parse_args(["--model", "m", "--part", part]))]
             for part in parity.PARTS}
    assert names["talker"] == TALKERS
    assert names["code2wav"] == ["omni-code2wav", "shim-code2wav"]
    assert names["all"] == TALKERS + names["code2wav"]
    for bad in (["--merge", "a.json"], [], ["--model", "m", "--part", "both"], ["--model", "m", "--profile-s", "4.5"]):
        with pytest.raises(SystemExit):
            parity.parse_args(bad)


def test_timed_rounds_go_round_by_round_abba_and_the_profile_pass_comes_after_them(tmp_path):
    sets = parity.bench_sets([8, 16], rounds=2, max_tokens=4)
    job = {"workdir": str(tmp_path), "bench_sets": sets, "engines": ["a", "b"], "profiled": ["b"],
           "profile": {"set": "c8-greedy", "seconds": 6}}
    order = talker_engines.Turns(job).order
    assert order[:10] == ["a|c8-greedy|0", "b|c8-greedy|0", "a|c8-sampled|0", "b|c8-sampled|0",
                          "a|c16-greedy|0", "b|c16-greedy|0", "a|c16-sampled|0", "b|c16-sampled|0",
                          "b|c8-greedy|1", "a|c8-greedy|1"]
    assert order[-2:] == ["a|c16-sampled|1", "b|c8-greedy|profile"] and len(order) == 4 * 4 + 1
    assert "profile" not in "".join(talker_engines.Turns({**job, "profile": None}).order)
    assert not talker_engines.past_deadline({}) and talker_engines.past_deadline({"deadline_unix": time.time() - 1})
    assert not talker_engines.past_deadline({"deadline_unix": time.time() + 60})


def test_every_engine_counts_the_same_turns(tmp_path):
    """The turn file holds an index into the order: engines whose jobs gave them orders of different
    lengths (vllm-omni's engines without the shim's profile turns) would wait out every turn."""
    args = parity.parse_args(["--model", "m", "--part", "talker", "--profile-set", "c8-greedy"])
    specs = parity.engine_specs(args)
    job = {"workdir": str(tmp_path), "bench_sets": parity.bench_sets([8, 64], 2, 4), "engine_overrides": {},
           "engines": [s["name"] for s in specs], "profiled": ["shim-async-off", "shim-async-on"],
           "profile": {"set": "c8-greedy", "seconds": 4}}
    orders = {s["name"]: talker_engines.Turns(parity.engine_job(s, job, "0")).order for s in specs}
    assert len({tuple(o) for o in orders.values()}) == 1
    assert orders["omni-async-off"][-2:] == ["shim-async-off|c8-greedy|profile", "shim-async-on|c8-greedy|profile"]


def test_a_deadline_cuts_the_last_rounds_of_every_set_alike(tmp_path, monkeypatch):
    """bench() of two engines side by side (threads), drive() faked; the deadline passes after the
    engines' second round: every set keeps two rounds, each waited for its turn, none a whole timeout."""
    import threading

    sets = parity.bench_sets([8, 64], rounds=4, max_tokens=4)
    done: list[str] = []

    def drive(engine, add, reqs, temperature=0.0):
        done.append(reqs[0]["rid"])
        time.sleep(0.01)
        return {"decode_s": [0.004], "step_s": [0.01]}

    monkeypatch.setattr(talker_engines, "drive", drive)
    monkeypatch.setattr(talker_engines, "talker_requests", lambda specs, prefix: [{"rid": prefix}])
    rounds_before_deadline = 2
    monkeypatch.setattr(talker_engines, "past_deadline",
                        lambda job: sum(r.endswith("-1-") for r in done) >= 2 * len(sets))
    results = {}

    def engine(name):
        job = {"workdir": str(tmp_path), "bench_sets": sets, "engines": ["a", "b"], "name": name, "turn_wait_s": 20}
        results[name] = talker_engines.bench(None, None, job)

    threads = [threading.Thread(target=engine, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, (bench, cut) in results.items():
        assert {s: len(r) for s, r in bench.items()} == {s["name"]: rounds_before_deadline for s in sets}
        assert cut == (4 - rounds_before_deadline) * len(sets)
        assert all(r["turn_wait_s"] < 10 for rs in bench.values() for r in rs)
    assert done[:4] == ["c8-greedy-0-", "c8-greedy-0-", "c8-sampled-0-", "c8-sampled-0-"]


def talker_result(step_ms: float, rounds: int, shim: bool) -> dict:
    """An engine's result as talker_engines.main writes it: 8 requests' tokens and codes rows (code 0
    of the step before, then the residual codes), timed rounds."""
    tokens = [[3 + i, 4 + i, 5 + i] for i in range(8)]
    codes = [[[t, 1, 2, 3] for t in toks[:-1]] for toks in tokens]
    bench = {s["name"]: [{"decode_s": [step_ms * (1 + 0.05 * r) * 1e-3] * 8} for r in range(rounds)]
             for s in parity.bench_sets([8, 16, 64], rounds, 4)}
    return {"ok": True, "codes": {"tokens": tokens, "codes": codes}, "bench": bench,
            "patches_engine": [] if shim else ["vllm_omni.patch"], "patches_workers": [[]] if shim else None}


def part_report(part: str, commit: str) -> dict:
    """What run_part writes for a part, from engine results (the real comparisons)."""
    c = Check(f"part {part}")
    report = {"part": part, "concurrency": [8, 16, 64], "rounds": 4, "max_tokens": 48, "engines": {}, "codes": {},
              "steps": {}, "code2wav": None, "patches": {}, "profiles": {}, "profile_set": "c8-greedy",
              "versions": {"vllm": "0.26.0", "vllm_omni": "0.26.0"}, "commit": commit, "wall_s": 1.0}
    if part == "talker":
        for mode in ("off", "on"):
            omni, shim = talker_result(4.0, 4, False), talker_result(3.6, 4, True)
            report["codes"][f"shim-async-{mode}"] = parity.compare_codes(omni, shim, f"shim-async-{mode}", c)
            report["steps"][f"shim-async-{mode}"] = parity.ratios(omni, shim)
            report["patches"][f"shim-async-{mode}"] = {"engine": [], "workers": [[]]}
            report["patches"][f"omni-async-{mode}"] = {"engine": ["vllm_omni.patch"], "workers": None}
            report["engines"][f"shim-async-{mode}"] = {"ok": True, "shim_stats": [{"step_end_cpu_us_p50": 470.0}]}
        report["profiles"]["shim-async-off"] = "py-spy samples: 10\n\nphases:\n  5 50.0% link\n\ninclusive:\n  x"
    else:
        wave = [0.0, 0.5, -0.25, 0.125]
        omni = {"ok": True, "waveforms": {f"c2w-{i}-whole": wave for i in range(len(parity.CODE2WAV_REQUESTS))}}
        shim = {"ok": True, "direct": [wave] * len(parity.CODE2WAV_REQUESTS),
                "waveforms": {f"c2w-{i}-{ch['codec_chunk_frames']}": [x + 0.01 for x in wave]
                              for i in range(len(parity.CODE2WAV_REQUESTS)) for ch in parity.CODE2WAV_CHUNKINGS}}
        report["code2wav"] = parity.compare_waves(omni, shim, c)
        report["code2wav_runner"] = {"ok": True, "error": None}
        report["patches"]["shim-code2wav"] = {"engine": [], "workers": [[]]}
    report["check"] = c.report()
    return report


def test_two_parts_merge_into_one_summary_and_its_rows(tmp_path):
    paths = []
    for part in ("talker", "code2wav"):
        path = tmp_path / part / "parity.json"
        path.parent.mkdir()
        path.write_text(json.dumps(part_report(part, "abc123")))
        paths.append(str(path))
    result = tmp_path / "vllm-omni-parity.json"
    parity.main(["--merge", *paths, "--result", str(result)])
    summary = json.loads(result.read_text())
    assert summary["talker_codes_identical"] == "16/16"
    assert summary["code2wav_max_abs_diff"] == pytest.approx(0.01)
    assert summary["vllm_omni_patches_applied"] == []
    assert summary["vllm_omni_patches_found_in_its_own_engines"] == {"omni-async-off": ["vllm_omni.patch"],
                                                                     "omni-async-on": ["vllm_omni.patch"]}
    assert summary["talker_step_ratio"] == {"8": 0.9, "16": 0.9, "64": 0.9}
    spread = summary["talker_step_ratio_spread"]["8"]["async off, greedy"]
    assert spread["rounds"] == 4 and spread["min"] == spread["max"] == spread["median"] == 0.9
    assert spread["ci95"] == [0.9, 0.9] and spread["resolved"] is True
    assert set(summary["async_scheduling"]) == {"off", "on"}
    assert summary["check"]["ok"] and summary["commit"] == "abc123" and summary["versions"]["vllm"] == "0.26.0"
    assert summary["parts"] == "talker+code2wav"
    assert summary["profile"]["phases"]["shim-async-off"].endswith("5 50.0% link")
    rows = result.with_suffix(".rows.md").read_text()
    assert "| off | 8 | 4.30 | 3.87 | **0.90** (0.90; 0.90..0.90) |" in rows  # rounds at 4.0 .. 4.6 ms, pooled
    assert "- talker codes identical: **16/16**" in rows and "patches in the shim's engines: **[]**" in rows
    assert "8: 0.90, 16: 0.90, 64: 0.90" in rows and "commit abc123" in rows and "- check: ok" in rows


def test_a_merge_keeps_each_parts_failures_and_differing_commits(tmp_path):
    talker, code2wav = part_report("talker", "abc123"), part_report("code2wav", "def456")
    code2wav["check"] = {"name": "part code2wav", "ok": False, "figures": {}, "failures": ["shim-code2wav: died"]}
    merged = parity.merge_reports([talker, code2wav])
    assert merged["check"]["ok"] is False and merged["check"]["failures"] == ["shim-code2wav: died"]
    assert merged["commit"] == ["abc123", "def456"]
    rows = parity.benchmark_rows(parity.parity_summary(merged))
    assert "- check: failed: shim-code2wav: died" in rows


def test_a_run_of_both_parts_writes_its_report_with_engines_faked(tmp_path, monkeypatch):
    """run_part as on the GPU host, the engine processes and sidecars replaced by fakes that write
    what the engines write (result, log, py-spy stacks): the report, the summary and the rows."""
    from types import SimpleNamespace

    code2wav = part_report("code2wav", "")
    jobs = {}

    def fake_run(spec, job, work, c, gpus, timeout_s):
        jobs[spec["name"]] = (job, timeout_s)
        shim = spec["kind"] == "shim"
        log = work / f"{spec['name']}.log"
        log.write_text("Using V2 Model Runner\n" + (parity.FULL_GRAPHS + ": 100%\n" if shim else ""))
        if spec["name"] == "shim-async-off":
            (work / "shim-async-off.pyspy.txt").write_text(
                "<module> (a.py:1);execute_model (b.py:2);end_step (c.py:3) 30\n"
                "<module> (a.py:1);execute_model (b.py:2);before_forward (d.py:4) 70\n")
        if spec["script"] == parity.CODE2WAV_ENGINES:
            wave = [0.0, 0.5, -0.25, 0.125]
            res = ({"ok": True, "direct": [wave] * 3,
                    "waveforms": {f"c2w-{i}-{ch['codec_chunk_frames']}": wave for i in range(3)
                                  for ch in parity.CODE2WAV_CHUNKINGS}} if shim else
                   {"ok": True, "waveforms": {f"c2w-{i}-whole": wave for i in range(3)}})
        else:
            res = talker_result(3.0 if shim else 4.0, job["bench_sets"][0]["rounds"], shim)
        if shim:
            res.update(patches_engine=[], patches_workers=[[]])
        return {**res, "log_path": str(log)}

    monkeypatch.setattr(parity, "run", fake_run)
    monkeypatch.setattr(parity, "sidecar", lambda work, name, hooks, gpus: SimpleNamespace(
        endpoint=f"ipc://{work}/{name}.sock", proc=SimpleNamespace(pid=4242), stop=lambda: None))
    out = tmp_path / "work"
    result = tmp_path / "vllm-omni-parity.json"
    parity.main(["--model", "m", "--out", str(out), "--result", str(result), "--deadline-s", "300",
                 "--profile-set", "c8-greedy"])
    job, timeout_s = jobs["shim-async-off"]
    assert job["profiled"] == ["shim-async-off", "shim-async-on"] and job["profile"] == {"set": "c8-greedy",
                                                                                         "seconds": 4}
    assert job["engines"] == TALKERS and timeout_s == 360 and jobs["shim-code2wav"][1] == parity.CODE2WAV_TIMEOUT_S
    assert 290 < job["deadline_unix"] - time.time() <= 300
    report = json.loads((out / "parity.json").read_text())
    assert report["part"] == "all" and report["check"]["ok"], report["check"]
    assert report["versions"]["python"] and "commit" in report
    assert "     30   30.0%  link: end_step (StepEnd)" in report["profiles"]["shim-async-off"]
    assert report["profiles"]["shim-async-on"].startswith("no profile: ")
    summary = json.loads(result.read_text())
    assert summary["talker_codes_identical"] == "16/16" and summary["code2wav_max_abs_diff"] == 0.0
    assert summary["talker_step_ratio"] == {"8": 0.75, "16": 0.75, "64": 0.75}
    merged = parity.merge_reports([report, code2wav])  # a part run again later replaces its engines' figures
    assert merged["code2wav"] == code2wav["code2wav"] and merged["steps"] == report["steps"]


def test_the_qwen3_omni_report_says_where_a_pipeline_failed(tmp_path):
    """A request's traceback when requests failed; a dead engine's log tail when it died in C++ (a CUDA
    device-side assert): the kernel's assertion once, not the abort's C++ frames."""
    import qwen3_omni_parity

    log = tmp_path / "shim.log"
    kernel = "/pytorch/aten/src/ATen/native/cuda/Indexing.cu:1553: indexSelectSmallIndex: block: [0,0,0], "
    lost = "ERROR 12-03 20:48:02 [recovery.py:217] omni-sidecar lost: step 43: CUDA error: device-side assert"
    abort = "terminate called after throwing an instance of 'c10::AcceleratorError'"
    log.write_text("\n".join(
        ["INFO 12-03 20:47:24 [core.py:347] init engine"]
        + [kernel + f"thread: [{i},0,0] Assertion `srcIndex < srcSelectDimSize` failed." for i in range(64)]
        + [lost, abort] + [f"frame #{i}: <unknown function> + 0x5faa0 (0x7f0f31334aa0 in libc10.so)" for i in range(30)]))
    tail = qwen3_omni_parity.log_tail(log)
    assert tail.count("Assertion `srcIndex < srcSelectDimSize` failed") == 1 and "frame #" not in tail
    assert tail.splitlines()[-2:] == [lost, abort]
    assert qwen3_omni_parity.log_tail(tmp_path / "none.log") is None
    frames = "Traceback (most recent call last):\n" + "  File 'x.py', line 1, in f\n" * 200 + "TypeError: bf16"
    found = qwen3_omni_parity.where_it_failed({"errors": {"p0": "thinker: TypeError: bf16"},
                                               "request_tracebacks": {"p0": frames}})
    assert found.endswith("TypeError: bf16") and len(found) == qwen3_omni_parity.REPORT_TRACEBACK_CHARS
    assert qwen3_omni_parity.where_it_failed({"traceback": "died", "request_tracebacks": {"p0": frames}}) == "died"
    assert qwen3_omni_parity.where_it_failed({"errors": {}, "request_tracebacks": {}}) is None


def test_the_qwen3_omni_report_says_where_talker_tokens_and_codes_first_differ_and_how_codes_were_sampled():
    import qwen3_omni_parity

    q = qwen3_omni_parity.NUM_CODE_GROUPS
    codes = [k * 100 + f for k in range(q) for f in range(5)]  # codebook-major: 5 frames
    other = list(codes)
    other[3 * 5 + 2] = other[7 * 5 + 2] = -1  # frame 2, codebooks 3 and 7
    greedy = {"top_k": 1, "top_p": 1e-6, "greedy_in_effect": True}
    omni = {"parity": {"p0": {"thinker_tokens": [1, 2], "talker_tokens": [5, 6, 7], "codes": codes},
                       "p1": {"thinker_tokens": [3], "talker_tokens": [5, 6], "codes": codes}},
            "code_predictor": greedy}
    shim = {"parity": {"p0": {"thinker_tokens": [1, 2], "talker_tokens": [5, 9, 7], "codes": other},
                       "p1": {"thinker_tokens": [3], "talker_tokens": [5, 6], "codes": codes}},
            "code_predictor": {**greedy, "greedy_in_effect": False}}
    args = type("Args", (), {"cpu": False, "eager": False})()
    report = qwen3_omni_parity.summary({"omni": omni, "shim": shim}, ["omni", "shim"], [1], args,
                                       "no torchvision (transformers' Qwen2-VL video processor needs it)")
    assert report["requests"]["text_and_image"] == ("not run: the tiny checkpoint has no multimodal processor files: "
                                                    "no torchvision (transformers' Qwen2-VL video processor needs it)")
    assert report["talker_codes_identical"] == "1/2" and report["talker_tokens_identical"] == "1/2"
    unread = {"step": 1, "omni": "no logprobs: this pipeline's talker returned none",
              "shim": "no logprobs: this pipeline's talker returned none", "same_token_logprob_diff_before": None,
              "reading": "not read: a pipeline's logprobs are missing at this step"}
    assert report["first_divergence"] == {"p0": {"talker_token": 1,
                                                 "code_frame": {"frame": 2, "codebooks": [3, 7], "frames": [5, 5]},
                                                 "talker_logprobs": unread}}
    assert report["code_predictor_sampling"] == {"omni": greedy, "shim": {**greedy, "greedy_in_effect": False}}
    assert report["code_predictor_greedy_in_effect"] is False
    # One side's codes a prefix of the other's: they differ where the shorter ends.
    first_four = [c for k in range(q) for c in codes[k * 5:k * 5 + 4]]
    assert qwen3_omni_parity.code_difference(codes, first_four) == {"frame": 4, "codebooks": [], "frames": [5, 4]}
    assert qwen3_omni_parity.first_difference([1, 2], [1, 2, 3]) == 2 and qwen3_omni_parity.code_difference(codes, None) is None


def test_the_qwen3_omni_report_reads_the_talker_logprobs_where_the_tokens_differ():
    """Each pipeline's two candidates and margin at the first differing talker token; a near tie only
    when the same two tokens swap and each margin is within the pipelines' difference before it."""
    import qwen3_omni_parity

    def rec(tokens, tops):
        return {"talker_tokens": tokens, "talker_logprobs": tops}

    same = [[[5, -0.5], [8, -1.5]], [[6, -0.25], [3, -2.0]]]  # two steps alike but for 0.03 on token 6
    omni = rec([5, 6, 7], same + [[[7, -0.70], [9, -0.72]]])
    swapped = rec([5, 6, 9], [same[0], [[6, -0.28], [3, -2.0]], [[9, -0.70], [7, -0.71]]])
    found = qwen3_omni_parity.talker_margins(omni, swapped, 2)
    assert found["omni"] == {"tokens": [7, 9], "logprobs": [-0.70, -0.72], "margin": pytest.approx(0.02)}
    assert found["shim"]["tokens"] == [9, 7] and found["shim"]["margin"] == pytest.approx(0.01)
    assert found["same_token_logprob_diff_before"] == pytest.approx(0.03)
    assert found["reading"].startswith("near tie")
    wide = rec([5, 6, 9], [same[0], same[1], [[9, -0.1], [7, -2.6]]])  # swapped, margin 2.5 > 0
    assert "beyond" in qwen3_omni_parity.talker_margins(omni, wide, 2)["reading"]
    first = qwen3_omni_parity.talker_margins(rec([7], [[[7, -0.70], [9, -0.72]]]), rec([9], [[[9, -0.70], [7, -0.71]]]), 0)
    assert first["same_token_logprob_diff_before"] is None and "at the first token" in first["reading"]
    other = rec([5, 6, 4], same + [[[4, -0.1], [9, -3.0]]])
    assert qwen3_omni_parity.talker_margins(omni, other, 2)["reading"].startswith("a real difference")
    missing = qwen3_omni_parity.talker_margins(omni, rec([5, 6, 9], None), 2)
    assert missing["shim"].startswith("no logprobs") and missing["reading"].startswith("not read")
    # In the report: under first_divergence, for the differing request only.
    parity = {"omni": {"parity": {"p0": {**omni, "thinker_tokens": [1]}, "p1": {**rec([5], same[:1]), "thinker_tokens": [1]}}},
              "shim": {"parity": {"p0": {**swapped, "thinker_tokens": [1]}, "p1": {**rec([5], same[:1]), "thinker_tokens": [1]}}}}
    report = qwen3_omni_parity.compare(parity["omni"], parity["shim"])
    assert set(report["first_divergence"]) == {"p0"}
    assert report["first_divergence"]["p0"]["talker_logprobs"] == found


def test_the_qwen3_omni_driver_sends_text_and_image_requests_only_where_the_checkpoint_has_its_processor(tmp_path):
    import qwen3_omni_parity

    assert qwen3_omni_parity.processor_missing(str(tmp_path)) == "its builder wrote none"
    stamp = tmp_path / "omni_tiny.json"
    stamp.write_text(json.dumps({"processor": False, "processor_missing": "no torchvision"}))
    assert qwen3_omni_parity.processor_missing(str(tmp_path)) == "no torchvision"
    stamp.write_text(json.dumps({"processor": True, "processor_missing": None}))
    assert qwen3_omni_parity.processor_missing(str(tmp_path)) is None
    assert all(r["image"] for r in qwen3_omni_parity.IMAGE_REQUESTS)
    assert {r["rid"] for r in qwen3_omni_parity.IMAGE_REQUESTS}.isdisjoint(r["rid"] for r in qwen3_omni_parity.REQUESTS)


def test_the_commit_measured_is_the_one_the_command_names(monkeypatch):
    """A device's copy of .git may be older than the tree it was sent: OMNI_COMMIT in the command wins."""
    monkeypatch.setenv("OMNI_COMMIT", "0123abc")
    assert parity.run_commit() == "0123abc"
    monkeypatch.delenv("OMNI_COMMIT")
    assert parity.run_commit() != "0123abc"


def test_the_qwen3_omni_code2wav_budget_holds_every_requests_whole_codes():
    """vllm-omni's code2wav scheduler splits a waiting request's prompt (its Q x frames codes) at the
    step's token budget, chunked prefill off or not, and its model decodes the part it got: the
    budget holds max_num_seqs requests' whole codes in one step."""
    import qwen3_omni_parity

    frames = qwen3_omni_parity.MAX_TOKENS["talker"]
    whole = qwen3_omni_parity.NUM_CODE_GROUPS * frames
    for seqs in (1, 6, 16):
        got = qwen3_omni_parity.limits(seqs)["code2wav"]
        assert got["max_model_len"] >= whole and got["max_num_batched_tokens"] >= seqs * whole
