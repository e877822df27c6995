"""The model's own vllm-omni hooks, called in the vLLM process in vllm-omni's order.

A model class opts in by carrying vllm-omni's hook attributes (worker_shim/upstream/compat.py,
`MODEL_HOOK_SEAMS`). Per step, before the forward (vllm-omni 0.26 runner `_preprocess`
and `_talker_mtp_forward`): each scheduled request's `preprocess` runs on its rows with
its state as `**info` (decode rows batched through `preprocess_decode_batch` when the
model has it), its returned embeddings replace those rows of the persistent embeds
buffer; decode rows' `mtp_inputs` feed one `talker_mtp` call whose embeddings replace
those rows again and whose codes become the request's output. After the forward
(`_process_additional_information_updates`): `postprocess` per request on its hidden
rows. Updates go to the state mirror (worker_shim/model/state_mirror.py), outputs to the
step's results; both reach the sidecar with the step's StepEnd (docs/ARCHITECTURE.md,
"Model hooks").

A forward that returns a tuple (hidden, extra...) or an object with
`text_hidden_states` / `multimodal_outputs` (vllm-omni's OmniOutput) is unwrapped for
upstream V2, which needs a tensor: the instance's `forward` is wrapped at load (the
class stays upstream's) and the extra tensors become per-request outputs.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from proto.messages import ModelHooks
from worker_shim.upstream.compat import ShimCompatError
from worker_shim.model.mtp_graphs import TalkerMtpGraphs
from worker_shim.model.state_mirror import StateMirror

log = logging.getLogger("vllm.omni_sidecar.shim.bridge")

DEFAULT_MTP_OUTPUT_KEY = ("codes", "audio")  # vllm-omni's default for talker_mtp_output_key
EXTRA_OUTPUT_CATEGORY = "model_output"  # tuple forwards: extra i goes to model_output.i


@dataclass(frozen=True)
class ModelHookSet:
    """What the loaded model carries of vllm-omni's hook API (bound methods or None)."""

    preprocess: Callable[..., Any] | None
    decode_batch: Callable[..., Any] | None
    talker_mtp: Callable[..., Any] | None
    mtp_output_key: tuple[str, str]
    postprocess: Callable[..., Any] | None
    resident_keys: frozenset[tuple[str, str]]
    returns_outputs: bool  # vllm-omni's `have_multimodal_outputs`

    def wire(self) -> ModelHooks:
        return ModelHooks(
            has_preprocess=self.preprocess is not None,
            has_postprocess=self.postprocess is not None,
            batch_decode_preprocess=self.decode_batch is not None,
            mtp_output_key=".".join(self.mtp_output_key) if self.talker_mtp is not None else "",
            resident_keys=sorted(f"{c}.{q}" for c, q in self.resident_keys),
        )


def find_model_hooks(model: Any) -> ModelHookSet | None:
    """The hooks on a loaded model, as vllm-omni's runner finds them; None when it has none."""
    preprocess = model.preprocess if getattr(model, "has_preprocess", False) else None
    postprocess = model.postprocess if getattr(model, "has_postprocess", False) else None
    # talker_mtp and the batched decode preprocess only run inside preprocess's loop.
    talker_mtp = getattr(model, "talker_mtp", None) if preprocess is not None else None
    decode_batch = getattr(model, "preprocess_decode_batch", None) if talker_mtp is not None else None
    returns_outputs = bool(getattr(model, "have_multimodal_outputs", False))
    if preprocess is None and postprocess is None and not returns_outputs:
        return None
    key = getattr(model, "talker_mtp_output_key", DEFAULT_MTP_OUTPUT_KEY)
    if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, str) for k in key)):
        raise TypeError(f"talker_mtp_output_key must be a 2-tuple of str, got {key!r}")
    resident = frozenset(tuple(k) for k in getattr(model, "gpu_resident_buffer_keys", ()) or ())
    return ModelHookSet(preprocess, decode_batch if callable(decode_batch) else None, talker_mtp, key,
                        postprocess, resident, returns_outputs)  # type: ignore[arg-type]


def model_class_has_hooks(vllm_config: Any) -> bool:
    """Before load: does the model's class define vllm-omni hooks? (The persistent embeds buffer
    and its compile-cache key must be decided before vLLM builds the model.)"""
    from vllm.model_executor.model_loader.utils import get_model_architecture

    cls, _ = get_model_architecture(vllm_config.model_config)
    return any(callable(getattr(cls, name, None)) for name in ("preprocess", "postprocess"))


def attach_bridge(model: Any, tp: Any, embeds_setting: str, mtp_kwargs: Mapping[str, Any] | None = None,
                  mtp_graph_sizes: Sequence[int] = ()) -> "ModelBridge | None":
    """After load: the bridge for a model that carries hooks (None for a plain model)."""
    hooks = find_model_hooks(model)
    if hooks is None:
        return None
    if tp is not None:
        raise ShimCompatError("omni-sidecar: models with their own vllm-omni hooks run with tensor "
                              "parallel size 1 only (the state mirror lives on one rank)")
    if embeds_setting == "off":
        raise ShimCompatError("omni-sidecar: this model's preprocess writes input embeddings; "
                              "embeds_buffer=off cannot serve it (use auto or on)")
    log.info("omni-sidecar shim: the model carries vllm-omni hooks %s", hooks.wire())
    return ModelBridge(model, hooks, mtp_kwargs, mtp_graph_sizes)


def talker_mtp_graphed(model: Any) -> bool:
    """Does the model let its talker_mtp replay from a CUDA graph (vllm-omni's `talker_mtp_graph_safe`)?"""
    return bool(getattr(model, "talker_mtp_graph_safe", False)) and callable(getattr(model, "talker_mtp", None))


def unwrap_forward_output(output: Any) -> tuple[Any, dict[str, Any] | None]:
    """(the tensor upstream V2 takes, the extra outputs as a two-level dict or None)."""
    if isinstance(output, torch.Tensor):
        return output, None
    # OmniOutput first: vllm-omni's is a NamedTuple, which the plain-tuple case would misread.
    hidden = getattr(output, "text_hidden_states", None)
    if isinstance(hidden, torch.Tensor):
        extras = getattr(output, "multimodal_outputs", None)
        return hidden, (dict(extras) if isinstance(extras, dict) and extras else None)
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        extras = {str(i): t for i, t in enumerate(output[1:], start=1) if t is not None}
        return output[0], ({EXTRA_OUTPUT_CATEGORY: extras} if extras else None)
    return output, None  # intermediate tensors (pipeline parallel) and the like: upstream's business


@dataclass
class MtpRows:
    """Decode rows for talker_mtp: their requests, batch offsets and inputs (a batch's, or one row)."""

    req_ids: list[str]
    offsets: list[int]
    ids: torch.Tensor  # [k]
    last_hidden: torch.Tensor  # [k, H]
    text_step: torch.Tensor  # [k, H]
    index: torch.Tensor | None = None  # the offsets as an index on the embeds' device, when made already

    @staticmethod
    def joined(parts: list["MtpRows"]) -> "MtpRows":
        return MtpRows([r for p in parts for r in p.req_ids], [o for p in parts for o in p.offsets],
                       torch.cat([p.ids for p in parts]), torch.cat([p.last_hidden for p in parts]),
                       torch.cat([p.text_step for p in parts]))


class ModelBridge:
    """Calls one loaded model's hooks per step and keeps what they read and return."""

    def __init__(self, model: Any, hooks: ModelHookSet, mtp_kwargs: Mapping[str, Any] | None = None,
                 mtp_graph_sizes: Sequence[int] = ()) -> None:
        self.model = model
        self.hooks = hooks
        self.mtp_kwargs = dict(mtp_kwargs or {})  # the shim's `subtalker_sampling` setting
        self.mirror = StateMirror(hooks.resident_keys)
        self.prompt_lens: dict[str, int] = {}
        self.forward_extras: dict[str, Any] | None = None  # the last forward's, until after_forward
        # A forward returned a tuple or an OmniOutput (vLLM's profile and capture runs call it too): FULL
        # CUDA graph replay would lose its outputs, so the runner refuses FULL graphs then (its
        # `omni_refuse_lost_outputs`).
        self.forward_returns_outputs = False
        self.host_us = 0.0  # this step's host time in the hooks so far (the runner reads and resets it)
        # The end of the rows of vLLM's input_ids that preprocess's ids were written into (for the
        # forward, as vllm-omni writes them) and vLLM has not written since (`clear_written_ids`).
        self.ids_written_end = 0
        self.device = next((p.device for p in model.parameters()), None) if hasattr(model, "parameters") else None
        # talker_mtp from CUDA graphs of ours where vllm-omni's runner would replay it from one (the
        # runner passes the sizes: worker_shim/upstream/runner.py); eager otherwise.
        self.mtp_graphs: TalkerMtpGraphs | None = None
        if hooks.talker_mtp is not None and mtp_graph_sizes and getattr(self.device, "type", None) == "cuda":
            self.mtp_graphs = TalkerMtpGraphs(hooks.talker_mtp, self.mtp_kwargs, mtp_graph_sizes, self.device)
        self._wrap_forward()

    @property
    def wire(self) -> ModelHooks:
        return self.hooks.wire()

    def _wrap_forward(self) -> None:
        """The instance's forward returns what V2 needs; extras wait for `after_forward`."""
        inner = self.model.forward

        @functools.wraps(inner)
        def forward(*args: Any, **kwargs: Any) -> Any:
            output = inner(*args, **kwargs)
            hidden, self.forward_extras = unwrap_forward_output(output)
            if hidden is not output:
                self.forward_returns_outputs = True
            return hidden

        self.model.forward = forward

    # -- request lifecycle (from the runner's notes) ------------------------------------

    def note_new(self, req_id: str, prompt_len: int, warmup: bool = False) -> None:
        """`warmup`: one of vLLM's own warm-up requests (worker_shim/upstream/compat.py): no payload, so
        no hooks and no state asked of the sidecar."""
        self.prompt_lens[req_id] = prompt_len
        if warmup:
            self.mirror.fill(req_id, None, served=False)

    def note_finished(self, finished: set[str]) -> None:
        """Preempted requests are not here: vLLM re-adds them and their state goes on."""
        self.mirror.free(finished)
        for req_id in finished:
            self.prompt_lens.pop(req_id, None)

    def apply_appended(self, req_id: str, entries: dict[str, Any]) -> None:
        """A streamed payload for a mirrored request (docs/ARCHITECTURE.md, Streaming payloads)."""
        self.mirror.apply_appended(req_id, entries, self.device)

    def missing_states(self, req_ids: list[str]) -> list[str]:
        return self.mirror.missing(req_ids)

    def fill_states(self, states: dict[str, Any], failed: set[str]) -> None:
        for req_id, state in states.items():
            if req_id not in self.mirror and req_id not in failed:
                self.mirror.fill(req_id, state)
        for req_id in failed:
            if req_id not in self.mirror:
                self.mirror.fill(req_id, None, served=False)

    # -- per step -----------------------------------------------------------------------

    def _info(self, req_id: str, num_computed: int) -> dict[str, Any]:
        """The request's state plus what vllm-omni's runner adds each step (a shallow copy:
        runner keys never enter the state)."""
        prompt_len = self.prompt_lens.get(req_id, 0)
        return {**self.mirror.states[req_id], "request_id": req_id, "_omni_prompt_len": prompt_len,
                "_omni_num_computed_tokens": num_computed, "_omni_is_prefill": num_computed < prompt_len}

    def clear_written_ids(self, input_batch: Any) -> None:
        """Zeroes the rows of this step's padding that still hold ids a preprocess wrote in an earlier
        step. vLLM writes the rows of a step's tokens only; the rows it pads a step to for its CUDA
        graphs keep what they held, and the embeds buffer looks them up with the rest
        (worker_shim/model/embeds.py). A preprocess's ids need not be in the model's table:
        vllm-omni's Qwen3-Omni talker returns the thinker's ids for its prompt rows, an index past
        the talker's codec table (a device-side assert on CUDA). Call it once vLLM has written the
        step's input_ids, before any lookup."""
        end = self.ids_written_end
        start, padded = int(input_batch.num_tokens), int(input_batch.num_tokens_after_padding)
        if end > start:
            input_batch.input_ids[start : min(end, padded)].zero_()
        if end <= padded:  # rows past the padding stay marked until a step reaches them
            self.ids_written_end = 0

    def before_forward(self, input_batch: Any, embeds: torch.Tensor) -> None:
        """preprocess (and talker_mtp) for every request of the step, in batch order."""
        self.forward_extras = None
        hooks = self.hooks
        for req_id in self.mirror.missing(input_batch.req_ids):
            # No sidecar served its state (none connected, or one that keeps no model states):
            # the request runs on plain token embeddings rather than hooks fed a state they lack.
            self.mirror.fill(req_id, None, served=False)
        if hooks.preprocess is None:
            return
        ids = input_batch.input_ids[: int(input_batch.num_tokens)]
        n = len(input_batch.req_ids)
        qsl = input_batch.query_start_loc_np[: n + 1].tolist()  # Python ints: indexed per request
        computed = input_batch.num_computed_tokens_np[:n].tolist()
        decode: list[tuple[str, int, dict[str, Any]]] = []  # (request, row, info) for the batch path
        mtp: list[MtpRows] = []  # the step's decode rows, in batch order, for one talker_mtp call
        for i, req_id in enumerate(input_batch.req_ids):
            if req_id in self.mirror.unserved:
                continue
            s, e = qsl[i], qsl[i + 1]
            info = self._info(req_id, computed[i])
            is_decode = hooks.talker_mtp is not None and e - s == 1 and not info["_omni_is_prefill"]
            if is_decode and hooks.decode_batch is not None:
                decode.append((req_id, s, info))
                continue
            self._flush_decode_batch(decode, ids, embeds, mtp)
            out_ids, out_embeds, update = hooks.preprocess(input_ids=ids[s:e], input_embeds=embeds[s:e], **info)
            update = dict(update or {})
            if is_decode:
                last_hidden, text_step = update.pop("mtp_inputs")
                mtp.append(MtpRows([req_id], [s], out_ids.reshape(-1)[:1], last_hidden.reshape(1, -1),
                                   text_step.reshape(1, -1)))
            self.mirror.merge(req_id, update)
            seg = min(e - s, int(out_embeds.shape[0]))
            embeds[s : s + seg].copy_(out_embeds[:seg])
            if isinstance(out_ids, torch.Tensor) and out_ids.numel() == seg:
                ids[s : s + seg].copy_(out_ids.reshape(-1))
                self.ids_written_end = max(self.ids_written_end, s + seg)
        self._flush_decode_batch(decode, ids, embeds, mtp)
        if mtp:
            self._talker_mtp(mtp, embeds)

    def _flush_decode_batch(self, decode: list[tuple[str, int, dict[str, Any]]], ids: torch.Tensor,
                            embeds: torch.Tensor, mtp: list["MtpRows"]) -> None:
        if not decode:
            return
        offsets = [row for _, row, _ in decode]
        rows = self._row_index(offsets, ids.device)
        out_ids, out_embeds, last_hidden, text_step, updates = self.hooks.decode_batch(  # type: ignore[misc]
            input_ids=ids.index_select(0, rows), req_infos=[info for _, _, info in decode])
        embeds.index_copy_(0, rows.to(embeds.device), out_embeds.to(embeds.dtype))
        out_ids = out_ids.reshape(-1)
        ids.index_copy_(0, rows, out_ids.to(ids.dtype))
        self.ids_written_end = max(self.ids_written_end, max(offsets) + 1)
        req_ids = [req_id for req_id, _, _ in decode]
        mtp.append(MtpRows(req_ids, offsets, out_ids, last_hidden, text_step, rows if rows.device == embeds.device
                           else None))
        for req_id, update in zip(req_ids, updates, strict=True):
            self.mirror.merge(req_id, update)
        decode.clear()

    def _row_index(self, offsets: list[int], device: Any) -> torch.Tensor:
        """Batch rows as an index tensor on `device`, through pinned memory (no blocking copy)."""
        host = torch.tensor(offsets, dtype=torch.long)
        if host.numel() and getattr(device, "type", "cpu") == "cuda":
            return host.pin_memory().to(device, non_blocking=True)
        return host.to(device)

    def _talker_mtp(self, mtp: list["MtpRows"], embeds: torch.Tensor) -> None:
        """One talker_mtp call over the step's decode rows (vllm-omni's `_talker_mtp_forward`)."""
        one = mtp[0] if len(mtp) == 1 else MtpRows.joined(mtp)
        rows = one.index if one.index is not None else self._row_index(one.offsets, embeds.device)
        run = self.mtp_graphs if self.mtp_graphs is not None else functools.partial(self.hooks.talker_mtp,
                                                                                     **self.mtp_kwargs)
        out_embeds, codes = run(one.ids, embeds.index_select(0, rows), one.last_hidden, one.text_step)
        embeds.index_copy_(0, rows, out_embeds.to(embeds.dtype))
        if codes is None:
            return
        cat, qual = self.hooks.mtp_output_key
        # vllm-omni keeps them in state too; one copy for the step (the model's may be a graph's
        # output buffer), each request's row a view of it.
        codes = self.mirror.owned(codes, (cat, qual))
        for k, req_id in enumerate(one.req_ids):
            mine = {cat: {qual: codes[k : k + 1]}}
            self.mirror.merge(req_id, mine, owned=True)
            self.mirror.add_output(req_id, mine)

    def after_forward(self, input_batch: Any, hidden: torch.Tensor | None) -> dict[str, str]:
        """postprocess per request on its hidden rows; the forward's extra outputs per request.

        Returns the requests whose postprocess raised (vllm-omni logs and goes on; here the
        request fails for its clients, the others go on)."""
        extras, self.forward_extras = self.forward_extras, None
        req_ids = input_batch.req_ids
        n = len(req_ids)
        qsl = input_batch.query_start_loc_np[: n + 1].tolist()  # Python ints: indexed per request
        if extras:
            for i, req_id in enumerate(req_ids):
                mine = per_request(extras, i, qsl[i], qsl[i + 1], n, qsl[n])
                if mine:
                    self.mirror.add_output(req_id, mine)
        post = self.hooks.postprocess
        errors: dict[str, str] = {}
        if post is None or hidden is None:
            return errors
        computed = input_batch.num_computed_tokens_np[:n].tolist()
        # One copy of the step's hidden rows for every request's postprocess (the forward's buffer is
        # overwritten by the next step): the rows a request's update keeps are views of it, stored as
        # they are (vllm-omni copies each request's on its own).
        private = hidden[: qsl[n]].detach().clone()
        for i, req_id in enumerate(req_ids):
            if req_id in self.mirror.unserved or req_id not in self.mirror:
                continue
            info = self._info(req_id, computed[i])
            info.pop("hidden_states", None)  # vllm-omni: the positional argument's name
            try:
                update = post(private[qsl[i] : qsl[i + 1]], multimodal_outputs=extras, **info)
            except Exception as exc:
                log.error("model postprocess failed for request %s", req_id, exc_info=True)
                errors[req_id] = f"model postprocess: {exc!r}"
                continue
            self.mirror.merge(req_id, update, private=private)
        return errors

    def take_step(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.mirror.take_step()


def per_request(extras: dict[str, Any], i: int, start: int, end: int, num_reqs: int,
                num_tokens: int) -> dict[str, Any]:
    """Request i's part of batch-level outputs: token-aligned tensors by rows, per-request lists by index."""

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] >= num_tokens:
            return value[start:end]  # token-aligned (padding rows, if any, lie past num_tokens)
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == num_reqs:
            return value[i : i + 1]  # one row per request
        if isinstance(value, (list, tuple)) and len(value) == num_reqs:
            return value[i]
        return None

    mine: dict[str, Any] = {}
    for key, value in extras.items():
        if isinstance(value, dict):
            sub = {q: c for q, v in value.items() if (c := cut(v)) is not None}
            if sub:
                mine[key] = sub
        elif (c := cut(value)) is not None:
            mine[key] = c
    return mine
