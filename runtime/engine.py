"""The engine: requests in, streamed outputs back, one scheduler iteration per ``step()``.

A step runs one target forward over the scheduled mix of prefill chunks, decode tokens and draft tokens; samples
or verifies where a request reached its last known token; rolls rejected drafts back (the request's cached length
simply stops before them and the pages past it are released); then lets the drafter catch up on the kept
positions and propose the next drafts. Everything that needs state across steps (tokens, cache coverage, pages,
random stream, drafts) lives on the request, so preemption and recompute are ordinary scheduling.
"""

from __future__ import annotations

import itertools
import logging
import math
import numbers
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from m3export.config import M3Config
from m3export.errors import MediaError
from m3export.model.batch import Segment, build_batch

from .acceptance import Row, RowResult, decide, emitted
from .backends import Backend, create_backend
from .block_manager import BlockManager
from .detokenizer import IncrementalDetokenizer
from .device_drafts import fill_tokens
from .drafter import Drafter, DraftJob, MTPDrafter
from .media import MediaCache, MediaItem, attach_media
from .outputs import Deferred, RequestOutput
from .params import SamplingParams
from .request import Request
from .sampling import PositionalRandom
from .scheduler import ScheduledRequest, Scheduler
from .stats import EngineStats
from .tokenizer import TextTokenizer, find_tokenizer

log = logging.getLogger("m3export.runtime")

DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_PAGE_SIZE = 16


def checkpoint_dtype(device, dtype: torch.dtype | None) -> torch.dtype | None:
    """The model dtype a checkpoint or preset is loaded in: ``dtype`` when given; else bfloat16 on a GPU (vLLM's
    ``auto`` for a 16-bit model: M3 ships bf16 weights beside its MXFP8 experts, and float32 copies would double
    their bytes and run the kernels on fp32 activations; a `mini` MXFP8 checkpoint took 14.9 GB on the H200 in
    float32 against its 9.8 GB of safetensors), None (the loader's float32) on the CPU, where the reference ops
    run."""
    if dtype is not None or torch.device(device).type == "cpu":
        return dtype
    return torch.bfloat16


def default_page_size(cfg: M3Config) -> int:
    """16 tokens, or for a model with sparse layers the largest page of at most 16 tokens that divides the index
    block (16 for M3's blocks of 128; 4 for the tiny preset's blocks of 4)."""
    if not cfg.has_sparse_layers:
        return DEFAULT_PAGE_SIZE
    return math.gcd(DEFAULT_PAGE_SIZE, cfg.index_block_size)


def _check_page_against_index_block(cfg: M3Config, page_size: int) -> None:
    """Sparse layers read whole index blocks through the page table; with pages equal to the block, or dividing
    it, every block is whole pages of one sequence. Other sizes still compute the same results (the ops and
    kernels accept any page size), so the engine runs, and says so."""
    block = cfg.index_block_size
    if cfg.has_sparse_layers and block % page_size:
        log.warning("page_size %d with index blocks of %d tokens: pages should equal the index block or divide "
                    "it (e.g. %d), so that every block the sparse attention reads is whole pages; running anyway",
                    page_size, block, default_page_size(cfg))


def _pool_geometry(backend: Backend, page_size: int | None, num_pages: int | None, max_model_len: int | None,
                   kv_cache_bytes: int | None) -> tuple[int, int, int]:
    """Fill in (page_size, num_pages, max_model_len) and check that one longest sequence fits the pool, which is
    what guarantees that preemption can always make progress."""
    cfg = backend.config
    page_size = page_size or backend.required_page_size or default_page_size(cfg)
    if backend.required_page_size and page_size != backend.required_page_size:
        raise ValueError(f"page_size {page_size}: this {backend.name} backend was built for pages of "
                         f"{backend.required_page_size} tokens")
    _check_page_against_index_block(cfg, page_size)
    if kv_cache_bytes is not None:
        if num_pages is not None:
            raise ValueError("give num_pages or kv_cache_bytes, not both")
        num_pages = kv_cache_bytes // backend.page_bytes(page_size)
        if num_pages < 1:
            raise ValueError(f"kv_cache_bytes={kv_cache_bytes} holds no page of {page_size} tokens "
                             f"({backend.page_bytes(page_size)} bytes across all pools)")
    if max_model_len is None:
        limit = num_pages * page_size if num_pages else DEFAULT_MAX_MODEL_LEN
        max_model_len = min(cfg.max_position_embeddings, limit)
    if not 1 < max_model_len <= cfg.max_position_embeddings:
        raise ValueError(f"max_model_len must be in [2, {cfg.max_position_embeddings}] (the model's position "
                         f"limit), got {max_model_len}")
    pages_per_seq = -(-max_model_len // page_size)
    num_pages = num_pages or 4 * pages_per_seq
    if num_pages < pages_per_seq:
        raise ValueError(f"num_pages={num_pages} of {page_size} tokens cannot hold one sequence of "
                         f"max_model_len={max_model_len}: raise num_pages or lower max_model_len")
    return page_size, num_pages, max_model_len


class Engine:
    def __init__(self, backend: Backend, tokenizer: TextTokenizer | None = None, *, page_size: int | None = None,
                 num_pages: int | None = None, max_model_len: int | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int | None = None, num_speculative_tokens: int = 0,
                 drafter: Drafter | None = None,
                 enable_prefix_caching: bool = True, seed: int = 0, kv_cache_bytes: int | None = None):
        """Pool size: ``num_pages``, or as many pages as ``kv_cache_bytes`` holds (every pool counted: main K/V,
        index keys, MTP modules), or by default four sequences of ``max_model_len``. ``max_model_len`` defaults
        to what the pool holds (min(4096, the model's position limit) when neither is given).
        ``max_num_batched_tokens`` (tokens per step) defaults to the backend's
        (``Backend.default_max_num_batched_tokens``: 512, and with the torch backend's kernels on a GPU
        ``scheduler.default_token_budget``: 8192 on an H100 / H200, 2048 on smaller GPUs). ``drafter``
        replaces the MTP drafter (tests, other draft models) when ``num_speculative_tokens`` > 0."""
        cfg: M3Config = backend.config
        self.backend = backend
        self.config = cfg
        self.tokenizer = tokenizer
        page_size, num_pages, max_model_len = _pool_geometry(backend, page_size, num_pages, max_model_len,
                                                             kv_cache_bytes)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = backend.default_max_num_batched_tokens
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        self.max_model_len = max_model_len
        self.page_size = page_size

        if num_speculative_tokens and drafter is None and backend.num_mtp_modules == 0:
            log.warning("speculative decoding requested (%d tokens) but the model has no MTP weights: "
                        "running without speculation", num_speculative_tokens)
            num_speculative_tokens = 0
        self.num_speculative_tokens = num_speculative_tokens

        backend.allocate(num_pages, page_size)
        self.blocks = BlockManager(num_pages, page_size, enable_prefix_caching)
        if num_speculative_tokens and drafter is None:
            drafter = MTPDrafter(backend, page_size, self._ensure_pages, num_speculative_tokens)
        self.drafter = drafter if num_speculative_tokens else None
        lookahead = self.drafter.page_lookahead if self.drafter else 0
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens, lookahead,
                                   draft_reserve=max(0, num_speculative_tokens - 1), max_model_len=max_model_len)
        self.stats = EngineStats()
        self._requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []  # outputs owed to the next step() (aborts)
        self._ids = itertools.count()
        self._rng = random.Random(seed)
        self.media_cache = MediaCache()  # encoded images / video by content digest, shared across requests
        #: How served images / video are preprocessed (``m3export.serve.media.media_settings``): the model
        #: directory's preprocessor files, read by ``from_checkpoint`` / ``from_artifact``; None: the processors'
        #: defaults with the model's patch geometry.
        self.media_settings = None

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_checkpoint(cls, path_or_preset: str | Path, device: str = "cpu", dtype: torch.dtype | None = None,
                        enforce_eager: bool = False, kv_cache_dtype: str | None = None,
                        tensor_parallel_size: int = 1, expert_parallel: bool = False, **engine_kwargs) -> Engine:
        """A checkpoint directory or a preset name (``tiny``: deterministic random weights), torch backend (decode
        replayed from CUDA graphs on a CUDA device unless ``enforce_eager``); ``kv_cache_dtype``: ``auto``,
        ``bf16`` or ``fp8`` (vLLM's ``--kv-cache-dtype``). ``tensor_parallel_size`` > 1 (and ``expert_parallel``,
        vLLM's names) runs one process per device over the model's shards (``docs/parallel.md``); ``close()`` the
        engine to stop them. ``dtype`` None: float32 on the CPU (where the reference ops run), bfloat16 elsewhere
        (``checkpoint_dtype``)."""
        dtype = checkpoint_dtype(device, dtype)
        if tensor_parallel_size != 1:
            from .backends.distributed_backend import launch_backend

            backend = launch_backend(path_or_preset, tensor_parallel_size, expert_parallel, device, dtype,
                                     enforce_eager, kv_cache_dtype)
            try:
                return cls(backend, find_tokenizer(path_or_preset, backend.config),
                           **engine_kwargs)._read_media_settings(path_or_preset)
            except BaseException:  # a refused size (pool, length limit): stop the workers now
                backend.close()
                raise
        from m3export import load_model
        from .backends import make_torch_backend

        model = load_model(path_or_preset, device=device, dtype=dtype)
        tokenizer = find_tokenizer(path_or_preset, model.config)
        return cls(make_torch_backend(model, enforce_eager, kv_cache_dtype), tokenizer,
                   **engine_kwargs)._read_media_settings(path_or_preset)

    @classmethod
    def from_artifact(cls, path: str | Path, backend: str = "torch", device: str = "cpu",
                      dtype: torch.dtype | None = None, enforce_eager: bool = False, provider: str | None = None,
                      kv_cache_dtype: str | None = None, tensor_parallel_size: int = 1, expert_parallel: bool = False,
                      **engine_kwargs) -> Engine:
        """An exported artifact directory run by ``backend`` (torch, onnxruntime or tensorrt); ``provider``: the
        onnxruntime backend's execution provider (``cpu``, ``cuda``, ... with options; default: from ``device``);
        ``kv_cache_dtype``: ``auto``, ``bf16`` or ``fp8`` (``create_backend``). Parallel runs start from the
        checkpoint (``from_checkpoint``): an artifact's graphs are one device's."""
        if tensor_parallel_size != 1 or expert_parallel:
            from m3export.errors import M3Error

            raise M3Error(f"{path}: --tensor-parallel-size / --expert-parallel run a checkpoint or preset on the torch "
                          "backend; give the checkpoint the artifact was exported from (per-rank ONNX graphs come "
                          "from `m3export export --tensor-parallel-size N`)")
        be = create_backend(backend, path, device=device, dtype=dtype, enforce_eager=enforce_eager, provider=provider,
                            kv_cache_dtype=kv_cache_dtype)
        return cls(be, find_tokenizer(path, be.config), **engine_kwargs)._read_media_settings(path)

    def _read_media_settings(self, source: str | Path) -> Engine:
        """``media_settings`` from the model directory ``source`` (its ``preprocessor_config.json`` /
        ``video_preprocessor_config.json``, ``MediaSettings``; a preset has none: the defaults). A bad file is one
        error naming the file and the field."""
        from m3export.preprocess.settings import MediaSettings
        from m3export.sources import is_preset

        self.media_settings = MediaSettings.from_directory(None if is_preset(source) else source,
                                                           self.config.vision)
        return self

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    media: Sequence[MediaItem] | None = None) -> None:
        """``media``: the prompt's images and videos (preprocessed), each kind in the order of its placeholders;
        the prompt must already hold one placeholder token per media token (``m3export.preprocess``)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        ids = self._prompt_ids(prompt, media)
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer (this engine has none); use stop_token_ids")
        if params.logprobs is not None and params.logprobs > self.config.vocab_size:
            raise ValueError(f"SamplingParams.logprobs={params.logprobs} exceeds the vocabulary "
                             f"({self.config.vocab_size})")
        attached = None
        if media:  # last: encoding runs the vision tower, which a request refused above must not cost
            if not self.backend.supports_media:
                raise MediaError(f"the {self.backend.name} backend cannot take images or video"
                                 + ("" if self.config.vision is not None else " (the model has no vision tower)"))
            attached = attach_media(ids, media, self.config.vision, self.backend.encode_media, self.media_cache)
        rng = PositionalRandom(params.seed if params.seed is not None else self._rng.randrange(2**64))
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens)
        stop_ids = frozenset(params.stop_token_ids) | frozenset(() if params.ignore_eos else self.config.eos_token_id)
        req = Request(request_id, ids, params, rng, detokenizer,
                      logprobs=[] if params.logprobs is not None else None, media=attached, stop_ids=stop_ids)
        self._requests[request_id] = req
        self.scheduler.add(req)

    def _media_too_long(self, n: int, media: Sequence[MediaItem]) -> MediaError:
        """The refusal, naming the media, of a prompt of ``n`` tokens that its image / video tokens push past the
        context."""
        unit = self.config.vision.merge_unit if self.config.vision is not None else 1
        media_tokens = sum(m.num_tokens(unit) for m in media)
        return MediaError(f"prompt has {n} tokens, {media_tokens} of them for {len(media)} image/video item(s): "
                          f"more than this engine's context allows ({self.max_model_len - 1} prompt tokens, "
                          f"max_model_len {self.max_model_len}); use smaller images or fewer frames")

    def _prompt_ids(self, prompt: str | Sequence[int], media: Sequence[MediaItem] | None = None) -> list[int]:
        """The prompt's token ids, checked (tokenized once: a text prompt with images can be thousands of tokens)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer (this engine has none): pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            vocab = self.config.vocab_size
            bad = [t for t in prompt if not isinstance(t, numbers.Integral) or isinstance(t, bool)
                   or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[0]!r}")
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            if media:
                raise self._media_too_long(len(ids), media)
            raise ValueError(f"prompt has {len(ids)} tokens; this engine allows at most {self.max_model_len - 1} "
                             f"(max_model_len {self.max_model_len} includes at least one generated token)")
        return ids

    def abort(self, request_id: str) -> None:
        """Stop a request and free its pages; the next ``step()`` reports it with finish_reason 'abort'.
        Unknown or already finished ids are ignored (a request may finish while the abort is on its way)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        self.scheduler.finish(req)
        req.finish_reason = "abort"
        self._pending.append(self._output(req))

    def close(self) -> None:
        """Release what the backend holds outside Python's reach (``Backend.close``: a parallel backend's worker
        processes and process group, the onnxruntime backend's ONNX Runtime sessions, which on CUDA must go while
        the CUDA runtime is up); idempotent. Also ``with Engine(...) as engine:``."""
        self.backend.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def has_unfinished(self) -> bool:
        """True while a request is queued or running, or ``step()`` still owes an output."""
        return bool(self._requests or self._pending)

    # ------------------------------------------------------------------ driving
    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 media: Sequence[Sequence[MediaItem] | None] | None = None) -> list[RequestOutput]:
        """Run the prompts to completion; one final output per prompt, in order. Drives the engine itself:
        outputs of other requests produced meanwhile are not returned to anyone. ``media``: per prompt, its
        images / videos (see ``add_request``) or None."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        media = [None] * len(prompts) if media is None else list(media)
        if len(media) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(media)} media lists")
        ids = []
        for prompt, p, m in zip(prompts, params, media):
            rid = f"generate-{next(self._ids)}"
            self.add_request(rid, prompt, p, media=m)
            ids.append(rid)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Outputs of one new request as they come; closing the iterator early aborts the request."""
        rid = f"stream-{next(self._ids)}"
        self.add_request(rid, prompt, params)
        finished = False
        try:
            while not finished:
                for out in self.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.abort(rid)

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration: an output for every request that produced tokens or finished."""
        outputs, self._pending = self._pending, []
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return outputs
        t0 = time.perf_counter()
        logits, hidden = self._forward(plan.scheduled)
        decided = self._decide(plan.scheduled, logits)
        jobs: list[DraftJob] = []
        offset = 0
        for s, rows in zip(plan.scheduled, decided):
            width = s.num_new + s.num_drafts
            job = self._settle(s, rows, hidden[offset:offset + width])
            offset += width
            if job is not None:
                jobs.append(job)
        if self.drafter is not None:
            self.drafter.run(jobs)
        for j in jobs:
            if j.request.num_drafts < j.num_drafts:  # the scheduler reserves the chain's pages: a drafter bug
                log.warning("request %s: %d of %d drafts proposed; its seeded samples may now depend on the "
                            "pool", j.request.request_id, j.request.num_drafts, j.num_drafts)
            cached = self.drafter.cached_len(j.request) if self.drafter else j.request.num_computed
            self.scheduler.publish(j.request, cached)
            self.scheduler.trim_pages(j.request)  # after drafting: the chain wrote into the reserved pages
        progressed = [s.request for s in plan.scheduled if s.samples]
        self._account(plan, progressed, time.perf_counter() - t0)
        for req in progressed:
            outputs.append(self._output(req))
            if req.finished:
                self._requests.pop(req.request_id, None)
        return outputs

    # ------------------------------------------------------------------ step internals
    def _forward(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's target forward. Drafts still on the device (``device_drafts``) go into the input ids there,
        placeholders on the host side (nothing is read back)."""
        segments, logits_rows, offset = [], [], 0
        media_rows, media_values, places = [], [], []
        for s in scheduled:
            r = s.request
            tokens = r.tokens[r.num_computed:r.num_computed + s.num_new]
            pending = r.pending_drafts if s.num_drafts else None
            if pending is None:
                tokens = tokens + r.drafts[:s.num_drafts]
            else:
                places += [(offset + len(tokens) + j, pending.round, pending.flat(j)) for j in range(s.num_drafts)]
                tokens = tokens + [0] * s.num_drafts
            if r.media is not None:  # placeholders computed in this step take their media embeddings
                positions, values = r.media.rows_in(r.num_computed, r.num_computed + s.num_new)
                media_rows.append(positions - r.num_computed + offset)
                media_values.append(values)
            segments.append(Segment(r.pages, r.num_computed, tokens))
            if s.samples:
                first = offset + s.num_new - 1
                logits_rows.extend(range(first, first + 1 + s.num_drafts))
            offset += len(tokens)
        ids, batch = build_batch(segments, self.page_size, self.backend.batch_device)
        index = torch.tensor(logits_rows, dtype=torch.int64, device=ids.device)
        if media_rows and sum(r.numel() for r in media_rows):
            media = (torch.cat(media_rows).to(ids.device), torch.cat(media_values))
            logits, hidden = self.backend.forward(fill_tokens(ids, places), batch, index, media=media)
        elif places and self.backend.stages_draft_tokens:  # the drafts go straight into its staged inputs
            logits, hidden = self.backend.forward(ids, batch, index, drafts=places)
        else:
            logits, hidden = self.backend.forward(fill_tokens(ids, places), batch, index)
        return logits, hidden

    def _decide(self, scheduled: list[ScheduledRequest], logits: torch.Tensor
                ) -> list[tuple[list[Row], list[RowResult]]]:
        """Every sampled row of the step decided in one batched pass where the logits are (``acceptance.decide``:
        only token ids and requested logprobs come to the host). Per scheduled request, its rows and their
        results: 1 + s.num_drafts rows verifying its first drafts, none for a prefill chunk that does not sample.
        Drafts still on the device are verified there and their values come back with the decisions (the
        round's one read); a penalised request needs its drafts' values for the counts and reads them first."""
        rows: list[Row] = []
        spans, places = [], []
        for s in scheduled:
            req, n = s.request, (1 + s.num_drafts if s.samples else 0)
            spans.append((len(rows), n))
            penalised = req.params.penalised
            pending = None if penalised else req.pending_drafts
            has = min(n, req.num_drafts)
            if pending is not None:
                places += [(len(rows) + j, pending.round, pending.flat(j)) for j in range(has)]
            for j in range(n):
                draft = req.drafts[j] if j < has and pending is None else None
                probs = req.draft_probs[j] if j < has and req.draft_probs is not None else None
                rows.append(Row(req.params, req.rng, req.num_tokens + j, draft, probs,
                                req.prompt_token_ids if penalised else (),
                                req.output_token_ids + req.drafts[:j] if penalised else ()))
        results = decide(logits, rows, places)
        return [(rows[a:a + n], results[a:a + n]) for a, n in spans]

    def _settle(self, s: ScheduledRequest, rows: tuple[list[Row], list[RowResult]], hidden: torch.Tensor
                ) -> DraftJob | None:
        """Apply one request's share of the forward: advance its cached length, sample or verify, roll back
        rejected drafts. Returns the drafter's job for the positions kept, or None once the request finished."""
        req, start = s.request, s.request.num_computed
        if not s.samples:
            req.num_computed += s.num_new
            return DraftJob(req, start, hidden, 0)
        tokens = self._next_tokens(req, s, rows)
        # Accepted drafts keep their K/V; a rejected one is past the cached length now, i.e. forgotten. When the
        # rows ran out before the drafts did and every row accepted, the round of drafts goes on: the remaining
        # drafts stay for the next step, and with none remaining the next step's one row is the round's bonus
        # token (computed alone, the step would have had a row after the last draft). Otherwise (a rejection, or
        # the bonus drawn) the round is over and the drafter proposes anew.
        req.num_computed = start + s.num_new + len(tokens) - 1
        num_rows = len(rows[0])
        round_goes_on = num_rows <= req.num_drafts and tokens == [r.draft for r in rows[1]]
        if round_goes_on:
            req.drop_drafts(num_rows)
        else:
            req.clear_drafts()
        self._append(req, tokens, rows[1])
        if req.finished:
            return None
        return DraftJob(req, start, hidden[:req.num_computed - start], 0 if round_goes_on else self._num_drafts(req))

    def _next_tokens(self, req: Request, s: ScheduledRequest, rows: tuple[list[Row], list[RowResult]]
                     ) -> list[int]:
        """The tokens the step's rows decide: with j = len(s.drafts) drafts computed, j + 1 rows verify the
        request's first j + 1 drafts (a bonus only when every draft was among them); with none, a plain sample."""
        tokens = emitted(*rows)
        verified = min(len(rows[0]), req.num_drafts)
        if verified:
            drafts = [r.draft for r in rows[1][:verified]]  # read back with the decisions
            accepted = next((i for i, (a, b) in enumerate(zip(tokens, drafts)) if a != b),
                            min(len(tokens), verified))
            self.stats.verify_steps += 1
            self.stats.draft_tokens += verified
            self.stats.accepted_tokens += accepted
        return tokens

    def _append(self, req: Request, emitted: list[int], results: list[RowResult]) -> None:
        """Add tokens one at a time so that a stop condition discards everything after it."""
        p, stop_ids = req.params, req.stop_ids
        for i, tok in enumerate(emitted):
            req.append_token(tok)
            if req.logprobs is not None:
                lp = results[i].logprobs(tok, p.logprobs)
                req.logprobs.append(lp)
                req.cumulative_logprob += lp[tok]
            # A stop token ends the request without becoming text (it may be a special token that
            # skip_special_tokens=False would otherwise spell out).
            stopped = tok not in stop_ids and req.detokenizer.append(tok)
            if stopped or tok in stop_ids:
                reason = "stop"
            elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
                reason = "length"
            else:
                continue
            req.finish_reason = reason
            self.scheduler.finish(req)
            return

    def _num_drafts(self, req: Request) -> int:
        """Never draft past max_tokens or the length limit: a step emits at most drafts + 1 tokens."""
        room = min(req.params.max_tokens - len(req.output_token_ids), self.max_model_len - req.num_tokens)
        return max(0, min(self.num_speculative_tokens, room - 1))

    def _ensure_pages(self, req: Request, num_tokens: int) -> bool:
        return self.scheduler.ensure_pages(req, num_tokens)

    def _account(self, plan, progressed: list[Request], elapsed: float) -> None:
        st = self.stats
        if plan.num_prefill_tokens:
            st.prefill_tokens += plan.num_prefill_tokens
            st.prefill_time += elapsed
        else:
            st.decode_tokens += sum(len(r.output_token_ids) - r.reported_tokens for r in progressed)
            st.decode_time += elapsed
        st.preemptions = self.scheduler.num_preemptions

    def _output(self, req: Request) -> RequestOutput:
        """The request's output now: its deltas, and its cumulative ids, text and logprobs as ``Deferred`` copies
        of what it holds (its lists only grow and its reported text is final), made only if they are read."""
        n, first = len(req.output_token_ids), req.reported_tokens
        new_ids = req.output_token_ids[first:]
        req.reported_tokens = n
        new_text = req.detokenizer.release(req.finished)
        ids, detok, lps = req.output_token_ids, req.detokenizer, req.logprobs
        chars = detok.released_length
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,  # shared, never mutated: a copy per step cost O(context)
            token_ids=Deferred(lambda: ids[:n]),
            text=Deferred(lambda: detok.released_text(chars)),
            new_token_ids=new_ids,
            new_text=new_text,
            finished=req.finished,
            finish_reason=req.finish_reason,
            logprobs=None if lps is None else Deferred(lambda: lps[:n]),
            new_logprobs=None if lps is None else lps[first:n],
            cumulative_logprob=req.cumulative_logprob,
        )
