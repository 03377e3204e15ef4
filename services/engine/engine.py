"""The engine: requests in, per-step outputs out. Single-threaded; see async_engine for asyncio.

Disaggregation hooks (decode-first hand-off)::

    decode engine                              prefill engine
    reserve(id, prompt) -> block ids   --->    add_request(id, prompt, prefill_only=True)
                                               step() ... outputs carry block_ids and
                                               num_computed_tokens as chunks finish;
                                               the last one has the first token
    <KV written into the reserved blocks by kvtransfer>
    start_decode(id, first_token)      <---    release(id)  (blocks go back, stay cached)
    step() ... decodes as usual

Ownership: reserved blocks belong to the decode engine from ``reserve`` until
the request finishes, ``release`` or ``abort``; a prefill-only request's blocks
are held after it finishes until the caller calls ``release`` (or ``abort``).
"""

from __future__ import annotations

import contextlib

import torch

from kernels.ops import select_ops
from services.config import EngineConfig
from services.engine.block_hash import hash_block, request_namespace
from services.engine.block_pool import BlockPool, KVEvent
from services.engine.choices import decoded_choices, fork_choices, fork_decoded, forking_rows, release_forks
from services.engine.cuda_graph import capture_decode_graphs
from services.engine.grammar import GrammarCompiler
from services.engine.grammar_masks import StructuredDecoding
from services.engine.kv_cache import KVCacheSpec, allocate_kv_cache, dtype_from_name
from services.engine.kv_manager import KVManager
from services.engine.loader import load_model
from services.engine.lora_slots import LoRASlots
from services.engine.model_source import resolve_model
from services.engine.outputs import RequestOutput, TokenLogprobs
from services.engine.request import Request, Status
from services.engine.runner import ModelRunner
from services.engine.sampler import Sampler, VerifiedOutput
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler, SchedulerConfig
from services.engine.speculator import Speculator
from services.engine.spill_tier import SpillTier
from services.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from services.errors import CapacityError, InvalidRequestError
from services.phases import phase, profiler_range, profiler_recording
from services.profiling import request_traces

_CPU_KV_BYTES = 2 << 30


def _forward_kind(scheduled) -> str:
    """The phase name of a forward pass: all single-token rows (decodes, draft verification),
    all prompt chunks, or both in one batch."""
    decodes = sum(1 for s in scheduled if s.num_new_tokens == 1 or s.spec_token_ids)
    if decodes == len(scheduled):
        return "forward_decode"
    return "forward_prefill" if decodes == 0 else "forward_mixed"


class Engine:
    def __init__(self, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.source = resolve_model(config.model)
        self.model_name = self.source.name
        mcfg = self.model_config = self.source.config
        self.tokenizer = Tokenizer(self.source.tokenizer_dir) if self.source.tokenizer_dir else None
        self.eos_token_ids = tuple(mcfg.eos_token_ids) or (
            (self.tokenizer.eos_token_id,) if self.tokenizer and self.tokenizer.eos_token_id is not None else ()
        )
        kv_dtype = "int8" if config.kv_cache_dtype == "int8" else config.dtype
        self.kv_spec = KVCacheSpec(mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim, config.block_size, kv_dtype)
        # prefix-cache namespace: blocks are only shared between identical models and layouts
        # (quantized weights compute other KV values than the model's own)
        self.namespace = f"{self.model_name}|{config.dtype}|bs{config.block_size}" + "".join(
            f"|{tag}" for tag in (config.quantization, "kv-int8" if kv_dtype == "int8" else None) if tag)

        dtype = dtype_from_name(config.dtype)
        max_len = min(mcfg.max_position_embeddings, config.max_model_len or mcfg.max_position_embeddings)
        self.model = load_model(self.source, select_ops(config.device, config.kernels), dtype, config.device,
                                max_positions=max_len, seed=config.seed, quantization=config.quantization)
        num_blocks = self.kv_spec.num_blocks_for_budget(self._kv_budget())
        self.kv_cache = allocate_kv_cache(self.kv_spec, num_blocks, config.device)
        self.block_pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching,
                                    spill=self._spill_tier())
        self.max_model_len = min(max_len, self.block_pool.num_usable * config.block_size)

        self.kv = KVManager(self.block_pool, self.namespace)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs, config.long_prefill_chunk,
                            watermark_blocks=max(1, self.block_pool.num_usable // 100)),
            self.kv,
        )
        self.runner = ModelRunner(self.model, self.kv_cache, config.block_size, config.device)
        self.kv.copy_blocks = self.runner.copy_blocks  # a repeated prompt's last block (KVManager._copy_tail)
        self.loras = LoRASlots(self.model, config.max_loras, config.max_lora_rank, self.model.ops.lora, dtype,
                               config.device, config.lora_dtype)
        for name, path in config.loras.items():
            self.loras.register(name, path)
        self.runner.lora_slots = self.loras
        # adapters at start: their steps get graphs too (cuda_graph.py)
        self.runner.cuda_graphs = capture_decode_graphs(config, self.model, self.kv_cache, self.max_model_len,
                                                        self.loras if config.loras else None)
        self._lora_waiting: list[Request] = []  # admitted, waiting for a free adapter slot
        self.sampler = Sampler()
        # Speculative decoding (prompt lookup): decoding requests verify draft tokens each step
        self.speculator = Speculator(config.speculative, self.max_model_len) if config.speculative else None
        self._structured: StructuredDecoding | None = None  # built at the first structured request
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._pending: list[RequestOutput] = []  # produced outside step() (abort, start_decode)
        self.prompt_tokens_computed = 0  # prompt positions run through the model, since start

    def describe(self) -> str:
        """What runs, in a few words: dtype, device, quantization, KV dtype, CPU kernel level."""
        from kernels import native

        parts = [self.config.dtype, self.config.device]
        if self.config.quantization:
            parts.append(f"{self.config.quantization} weights")
        if self.kv_spec.dtype == "int8":
            parts.append("int8 KV")
        spill = self.block_pool.spill
        if spill is not None:
            store = spill.storage
            parts.append(f"KV spill tier {spill.num_slots} blocks ({store.dtype_name}, {store.where})")
        if self.config.device == "cpu":
            parts.append(f"CPU kernels {native.level() or 'off (torch)'}")
        return ", ".join(parts)

    def _spill_tier(self) -> SpillTier | None:
        """The second KV tier (``--kv-spill-gb``), over this engine's cache; None when off."""
        c = self.config
        if not c.kv_spill_bytes:
            return None
        from services.engine.kv_spill import SpillStore

        store = SpillStore(self.kv_spec, self.kv_cache, c.kv_spill_bytes, c.kv_spill_dtype, c.kv_spill_dir)
        return SpillTier(store, c.block_size)

    def _kv_budget(self) -> int:
        if self.config.kv_cache_bytes is not None:
            return self.config.kv_cache_bytes
        if self.config.device.startswith("cuda"):
            free, _ = torch.cuda.mem_get_info(torch.device(self.config.device))
            return int(free * 0.85)
        return _CPU_KV_BYTES

    # ---- admission ------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError for a request this engine cannot serve. No side effects."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {n} tokens, but this model's context is {self.max_model_len} tokens "
                "(including at least one generated token); shorten the prompt",
                param="prompt",
            )
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad!r} is outside the vocabulary [0, {vocab})", param="prompt")
        bad = next((t for t in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"logit_bias names token id {bad}, outside the vocabulary [0, {vocab})",
                                      param="logit_bias")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none", param="stop")
        if params.structured is not None and self.tokenizer is None:
            raise InvalidRequestError("structured output needs a tokenizer; this model has none",
                                      param="response_format")
        if params.lora is not None and params.lora not in self.loras.known:
            raise InvalidRequestError(f"unknown LoRA adapter {params.lora!r}; this worker serves "
                                      f"{self.loras.names() or 'none'}", param="model")

    @property
    def structured(self) -> StructuredDecoding:
        if self._structured is None:
            compiler = GrammarCompiler(self.tokenizer.backend.to_str(), self.model_config.vocab_size,
                                       self.eos_token_ids)
            self._structured = StructuredDecoding(compiler, max_model_len=self.max_model_len)
        return self._structured

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, prefill_only: bool = False) -> None:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        self.validate(prompt_token_ids, params)
        req = Request(request_id, list(prompt_token_ids), params, priority=priority, prefill_only=prefill_only,
                      eos_token_ids=self.eos_token_ids)
        self._track(req)
        if params.lora is not None and not self._acquire_lora(req):
            self._lora_waiting.append(req)  # every adapter slot is pinned: admitted once one frees
            return
        self.scheduler.add(req)

    def add_choices(self, request_ids: list[str], prompt_token_ids: list[int], params: list[SamplingParams],
                    priority: int = 0, prefill_only: bool = False) -> None:
        """``n`` choices of one prompt, one request id and sampling params each (choice i seeded seed + i by
        the caller, as the gateway does): the prompt is computed once, by choice 0, and the others fork off
        it (shared full blocks, a copy of the partial one; services/engine/choices.py). Structured output
        and LoRA choices run as ordinary requests instead (sharing full blocks through the prefix cache).
        ``prefill_only``: choice 0 computes the prompt and holds its blocks as a prefill-only request does;
        every choice's output is its first token (``prefilled``), for ``start_decode(..., choices=)``."""
        if len(request_ids) != len(params) or not request_ids:
            raise ValueError("add_choices needs one request id per sampling params, at least one")
        for rid in request_ids:
            if rid in self.requests or request_ids.count(rid) > 1:
                raise InvalidRequestError(f"request id {rid!r} is already in use", param="request_id")
        for p in params:
            self.validate(prompt_token_ids, p)
        if any(p.structured is not None or p.lora is not None for p in params):
            if prefill_only:
                raise InvalidRequestError("n > 1 with structured output or a LoRA adapter runs as one request "
                                          "per choice", param="n")
            for rid, p in zip(request_ids, params):
                self.add_request(rid, prompt_token_ids, p, priority)
            return
        reqs = [Request(rid, list(prompt_token_ids), p, priority=priority, eos_token_ids=self.eos_token_ids,
                        prefill_only=prefill_only) for rid, p in zip(request_ids, params)]
        for req in reqs:
            self._track(req)
        reqs[0].forks = reqs[1:]
        self.scheduler.add(reqs[0])

    def _acquire_lora(self, req: Request) -> bool:
        """Pin the request's adapter slot (loading it on demand) and set the namespace its blocks
        hash in; False while every slot is pinned by other adapters' requests."""
        try:
            slot = self.loras.acquire(req.params.lora)
        except Exception:
            self._finish(req, "abort")
            raise
        if slot is None:
            return False
        req.lora_slot = slot
        req.namespace = request_namespace(self.namespace, req.params.lora)
        return True

    def _admit_lora_waiting(self) -> None:
        still = []
        for req in self._lora_waiting:
            if req.is_finished:
                continue
            try:
                acquired = self._acquire_lora(req)
            except InvalidRequestError:  # the adapter no longer loads: the request ends
                self._pending.append(self._output(req, [], None))
                continue
            if acquired:
                self.scheduler.add(req)
            else:
                still.append(req)
        self._lora_waiting = still

    # ---- LoRA adapters --------------------------------------------------
    def register_lora(self, name: str, path: str) -> None:
        """Know an adapter from now on (config checked now; tensors read when a request needs them)."""
        self.loras.register(name, path)

    def unregister_lora(self, name: str) -> bool:
        return self.loras.unregister(name)

    def lora_names(self) -> list[str]:
        """Every adapter this engine serves."""
        return self.loras.names()

    def loaded_loras(self) -> list[str]:
        """The adapters in slots now (a request for one starts without reading it from disk)."""
        return list(self.loras.loaded)

    def _track(self, req: Request) -> None:
        if req.params.structured is not None:
            self.structured.add(req)  # raises InvalidRequestError before anything is held
        self.requests[req.request_id] = req
        if self.tokenizer is not None and not req.prefill_only:
            self._detok[req.request_id] = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, req.params.stop, req.params.skip_special_tokens
            )

    # ---- disaggregation -------------------------------------------------
    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                priority: int = 0) -> list[int]:
        """Decode side: hold blocks for a prompt whose KV another engine will write."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        self.validate(prompt_token_ids, params)
        req = Request(request_id, list(prompt_token_ids), params, priority=priority,
                      eos_token_ids=self.eos_token_ids)
        if params.structured is not None:
            self.structured.compiler.compile(params.structured)  # an invalid spec holds no blocks
        if params.lora is not None:
            slot = self.loras.acquire(params.lora)
            if slot is None:
                raise CapacityError(f"every one of the {self.loras.max_loras} LoRA slots is in use by another "
                                    "adapter's requests")
            req.lora_slot, req.namespace = slot, request_namespace(self.namespace, params.lora)
        if not self.kv.allocate(req, req.num_tokens):
            self._release_lora(req)
            raise CapacityError(
                f"no room for {self.kv.blocks_needed(req.num_tokens)} KV blocks "
                f"({self.block_pool.num_free} free of {self.block_pool.num_usable})"
            )
        req.status = Status.RESERVED
        try:
            self._track(req)
        except InvalidRequestError:
            self.kv.free(req)
            self._release_lora(req)
            raise
        return list(req.block_ids)

    def start_decode(self, request_id: str, first_token_id: int, first_logprobs: TokenLogprobs | None = None,
                     choices: list[tuple[str, SamplingParams, int, TokenLogprobs | None]] = ()) -> None:
        """Decode side: the reserved blocks now hold the prompt's KV; continue from ``first_token_id``.

        ``first_logprobs``: what the prefill side's sampler reported for that token (when the request
        asked for logprobs), so the first token's output carries them like every other token's.
        ``choices``: the request's other choices (id, params, first token and logprobs from the prefill
        worker's ``add_choices(prefill_only=True)``), forked off the KV received once (choices.py).
        """
        req = self.requests.get(request_id)
        if req is None or req.status is not Status.RESERVED:
            raise InvalidRequestError(f"request {request_id!r} has no reservation", param="request_id")
        children = decoded_choices(self, req, choices)  # validated and tracked before anything changes
        for r in (req, *(c for c, _, _ in children)):  # their first tokens were drawn on the prefill worker
            self.sampler.skip_draw(r, self.model_config.vocab_size, self.runner.device)
        req.num_computed_tokens = req.num_tokens
        self.kv.cache_computed_blocks(req)
        fork_decoded(self, req, children, self._pending)  # before the parent's first token may finish it
        out = self._append_tokens(req, [first_token_id], [first_logprobs])
        if not req.is_finished:
            self.scheduler.add_running(req)
        self._pending.append(out)

    # ---- peer fetch (services/peer_fetch.py) ------------------------------
    def held_prefix_blocks(self, token_ids: list[int]) -> int:
        """Leading full blocks of ``token_ids`` this engine holds, in its pool or its spill tier (by
        hash; the prefill that sends them checks the tokens as every hit does). Mutates nothing."""
        bs, pool = self.config.block_size, self.block_pool
        n, parent = 0, None
        while (n + 1) * bs <= len(token_ids):
            h = hash_block(parent, token_ids[n * bs:(n + 1) * bs], self.namespace)
            if h not in pool.cached and (pool.spill is None or h not in pool.spill):
                break
            n, parent = n + 1, h
        return n

    def adopt_fetched(self, request_id: str) -> int:
        """Puller side of a peer fetch: the reservation's blocks now hold its prompt's KV (whole
        blocks, received and checksummed). Hash them from this engine's own copy of the tokens into
        the prefix cache, then free them (cached, so the request that follows hits them). Returns
        the blocks cached."""
        req = self.requests.get(request_id)
        if req is None or req.status is not Status.RESERVED:
            raise InvalidRequestError(f"request {request_id!r} has no reservation", param="request_id")
        req.num_computed_tokens = req.num_tokens
        self.kv.cache_computed_blocks(req)
        cached = req.num_cached_blocks
        self._finish(req, "fetched")
        return cached

    def release(self, request_id: str) -> None:
        """Give back the blocks of a finished prefill-only request or an unused reservation."""
        req = self.requests.get(request_id)
        if req is None:
            return
        if req.status not in (Status.PREFILLED, Status.RESERVED):
            raise InvalidRequestError(f"request {request_id!r} is {req.status.value}; abort it instead")
        self._finish(req, req.finish_reason or "abort")

    # ---- running --------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._finish(req, "abort")
        self._pending.append(self._output(req, [], None))
        return True

    def take_pending_outputs(self) -> list[RequestOutput]:
        """Outputs queued outside step() (start_decode's first token, aborts), without stepping."""
        outputs, self._pending = self._pending, []
        return outputs

    def step_outputs_discard(self) -> None:
        """Drop outputs queued outside step() (after the caller reported the requests itself)."""
        self._pending.clear()

    def has_unfinished(self) -> bool:
        return bool(self._pending) or self.scheduler.has_work() or bool(self._lora_waiting)

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if self._lora_waiting:
            self._admit_lora_waiting()
        with phase("schedule"):
            if self.speculator is not None:  # constrained requests get no drafts (grammar_masks.py)
                self.speculator.propose([r for r in self.scheduler.running if r.params.structured is None])
            sched = self.scheduler.schedule()
        if not sched:
            if self.kv.num_restoring:  # only restores to wait for: sleep on them, not spin
                self.kv.wait_restores(0.005)
            return outputs
        kind = _forward_kind(sched.scheduled)
        # the grammar masks of this step's constrained rows are computed while the forward runs
        masks_job = self._structured.begin([s.request for s in sched.scheduled if s.samples]) \
            if self._structured is not None and self._structured.active else None
        # while a profile records, the step's work is one range naming its requests' trace ids, so a request's
        # ops can be found in a batched step (profiling/request_traces.py); nothing is built otherwise
        named = profiler_range(request_traces.range_name(kind, (s.request.request_id for s in sched.scheduled))) \
            if profiler_recording() else contextlib.nullcontext()
        with named:
            with phase(kind):
                sampled, logits = self.runner.execute(sched)
            drafts = {s.request.request_id: s.spec_token_ids for s in sched.scheduled if s.spec_token_ids}
            forking = forking_rows(sampled, logits, drafts) if any(r.forks for r in sampled) else {}
            with phase("sample"):
                result = self._sample(sampled, logits, drafts, masks_job)
            with phase("postprocess"):
                self._postprocess(sched, sampled, result, drafts, outputs, forking)
        return outputs

    def _sample(self, sampled: list[Request], logits, drafts: dict[str, list[int]],
                masks_job=None) -> VerifiedOutput | None:
        """Sample the rows that sample; a request with drafts gets them verified."""
        if not sampled:
            return None
        blocked = None
        if masks_job is not None:  # waiting for the masks counts as sampling (phases tile the step)
            blocked = self._structured.masks(masks_job, sampled, logits.shape[-1], logits.device)
        if drafts:
            # constrained rows have no drafts, so each still owns one row when others verify
            if blocked is not None:
                rows = [i for i, r in enumerate(sampled) for _ in range(len(drafts.get(r.request_id, ())) + 1)]
                blocked = blocked[rows]
            args = (logits, sampled, [drafts.get(r.request_id, ()) for r in sampled])
            return self.sampler.verify(*args) if blocked is None else self.sampler.verify(*args, blocked)
        one = self.sampler(logits, sampled) if blocked is None else self.sampler(logits, sampled, blocked)
        return VerifiedOutput([[t] for t in one.token_ids], [[lp] for lp in one.logprobs])

    def _postprocess(self, sched, sampled: list[Request], result: VerifiedOutput | None,
                     drafts: dict[str, list[int]], outputs: list[RequestOutput],
                     forking: dict | None = None) -> None:
        """Mark the step's tokens computed, append sampled ones, finish requests, build outputs (detokenizing).
        ``forking``: logits rows of requests whose waiting choices fork off them now (choices.py)."""
        for s in sched.scheduled:
            if not s.spec_token_ids:  # a verifying request's count grows by its accepted drafts, below
                req = s.request
                self.prompt_tokens_computed += min(s.num_new_tokens, max(0, req.num_prompt_tokens
                                                                         - req.num_computed_tokens))
                req.num_computed_tokens += s.num_new_tokens
                self.kv.cache_computed_blocks(req)
        for rid, row in (forking or {}).items():  # before the parent's first token (which may finish it)
            fork_choices(self, self.requests[rid], row, outputs)
        sampled_ids = {r.request_id for r in sampled}
        for s in sched.scheduled:  # prefill-only progress, for transfers that overlap compute
            req = s.request
            if req.prefill_only and req.request_id not in sampled_ids:
                outputs.append(self._output(req, [], None))
        for i, req in enumerate(sampled):
            tokens, logprobs = result.token_ids[i], result.logprobs[i]
            if req.prefill_only:
                req.append_output(tokens[0])
                req.status, req.finish_reason = Status.PREFILLED, "prefilled"
                self.scheduler.remove(req)
                self.sampler.forget(req.request_id)
                out = self._output(req, tokens, logprobs)
                out.finished, out.finish_reason = True, "prefilled"
                outputs.append(out)
                continue
            draft = drafts.get(req.request_id)
            if draft is not None:
                # KV now holds the last token and the accepted drafts; slots past them hold
                # rejected drafts, which the next step overwrites and nothing ever hashes
                req.num_computed_tokens += len(tokens)
            outputs.append(self._append_tokens(req, tokens, logprobs))
            if draft is not None:
                self.speculator.record(req, len(draft), len(tokens) - 1)

    def _append_tokens(self, req: Request, tokens: list[int],
                       logprobs: list[TokenLogprobs | None]) -> RequestOutput:
        """Append a step's tokens (one, or accepted drafts and one more) up to the first that
        finishes the request; the rest are dropped."""
        p = req.params
        detok = self._detok.get(req.request_id)
        reason = None
        n = 0
        for token in tokens:
            req.append_output(token)
            if self._structured is not None:
                self._structured.accept(req, token)
            n += 1
            if (token in p.stop_token_ids) or (not p.ignore_eos and token in req.eos_token_ids):
                reason = "stop"
            elif detok is not None and detok.add(token):
                reason = "stop"
            elif p.max_tokens is not None and req.num_output_tokens >= p.max_tokens:
                reason = "length"
            elif req.num_tokens >= self.max_model_len:
                reason = "length"
            if reason:
                break
        if n > 1:  # accepted drafts completed blocks: publish them (before a finish frees them)
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
            self.kv.cache_computed_blocks(req)
        if reason:
            self._finish(req, reason)
        return self._output(req, tokens[:n], logprobs[:n])

    def _release_lora(self, req: Request) -> None:
        if req.lora_slot >= 0:
            self.loras.release(req.lora_slot)
            req.lora_slot = -1

    def _finish(self, req: Request, reason: str) -> None:
        if req.forks:
            release_forks(self, req)
        self.scheduler.remove(req)
        self.kv.free(req)
        self._release_lora(req)
        req.status, req.finish_reason = Status.FINISHED, reason
        self.requests.pop(req.request_id, None)
        self.sampler.forget(req.request_id)
        if self._structured is not None:
            self._structured.forget(req.request_id)
        if self.speculator is not None:
            self.speculator.forget(req.request_id)

    def _output(self, req: Request, tokens: list[int],
                logprobs: list[TokenLogprobs | None] | None) -> RequestOutput:
        finished = req.is_finished
        detok = self._detok.get(req.request_id)
        text = detok.delta(final=finished) if detok is not None else ""
        if finished:
            self._detok.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=tokens,
            new_text=text,
            finished=finished,
            finish_reason=req.finish_reason if finished else None,
            logprobs=logprobs if logprobs and any(lp is not None for lp in logprobs) else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_prefix_hit_tokens,
            num_computed_tokens=req.num_computed_tokens,
            block_ids=list(req.block_ids) if req.prefill_only else None,
        )

    # ---- introspection --------------------------------------------------
    def take_kv_events(self) -> list[KVEvent]:
        return self.block_pool.take_events()

    def has_kv_events(self) -> bool:
        """Whether there are events to take; callable from any thread (BlockPool.has_events)."""
        return self.block_pool.has_events()

    def cached_block_hashes(self) -> list[int]:
        """Every block hash the prefix cache holds now (a KV-event resync after lost events)."""
        return list(self.block_pool.cached)

    def spilled_block_hashes(self) -> list[int]:
        """Every block hash the spill tier holds now (the resync's second part)."""
        spill = self.block_pool.spill
        return spill.hashes() if spill is not None else []

    def stats(self) -> dict[str, float]:
        pool = self.block_pool
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting + len(self._lora_waiting),
            "kv_blocks_total": pool.num_usable,
            "kv_blocks_used": pool.num_used,
            "prefix_cache_queries": pool.prefix_queries,
            "prefix_cache_hits": pool.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens_computed": self.prompt_tokens_computed,  # prefix hits and forked choices not counted
            "queued_prefill_tokens": self.scheduler.queued_prefill_tokens,
            **(self.speculator.stats() if self.speculator else Speculator.no_stats()),
            **self._spill_stats(),
        }

    def _spill_stats(self) -> dict[str, float]:
        spill = self.block_pool.spill
        if spill is None:
            return {}
        s, block = spill.stats, spill.storage.slot_bytes
        return {
            "kv_spill_blocks_total": spill.num_slots,
            "kv_spill_blocks_used": len(spill) + spill.num_pinned,
            "kv_spill_blocks": s.spilled_blocks,
            "kv_spill_dropped_blocks": s.dropped_blocks,
            "kv_spill_hit_blocks": s.hit_blocks,
            "kv_restored_blocks": s.restored_blocks,
            "kv_spill_bytes": s.spilled_blocks * block,
            "kv_restored_bytes": s.restored_blocks * block,
            "kv_spill_seconds": s.spill_seconds,
            "kv_restore_seconds": s.restore_seconds,
        }
