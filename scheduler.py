"""Requests, the paged block manager with prefix caching, and continuous batching.

This file knows token ids, block ids and counts, and nothing of torch or of the model: nanoengine.py turns
what `Scheduler.schedule()` plans into tensors (a `Batch`, declared here so that graphs.py and nanoengine.py
share it from below). It imports nothing from the rest of nanoengine.

The life of a request: WAITING (queued, or preempted) -> RUNNING (holds KV blocks; each step computes some
of its tokens: a chunk of its prompt, or the one token it sampled last) -> FINISHED (blocks returned).

Part 1 is the chapter: `BlockManager` (blocks, prefix cache), `RequestBook` (the requests and what happens
to them after a step) and `Scheduler` (what runs next). Part 2 is the tuned host path: a decode of an
unchanged running set planned on arrays (`SteadyDecode`), so a step costs the same at 1 request or 256."""
from __future__ import annotations

import functools
import itertools
import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, fields

import numpy as np

# A token sampled on the device but not yet read back (async scheduling). The next step feeds it to the
# model straight from the device; the host fills it in one step later.
PLACEHOLDER = -1
WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


def cdiv(a, b):
    """ceil(a / b) for positive integers, or numpy arrays of them."""
    return -(-a // b)


@dataclass(eq=False)
class Request:
    request_id: str
    token_ids: list[int]              # prompt + generated tokens (the last ones may be PLACEHOLDERs)
    params: SamplingParams
    seed: int                         # params.seed, or one drawn by the engine
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0      # tokens whose KV is in the cache (or being written by a launched step)
    block_ids: list[int] = field(default_factory=list)
    prefix_ids: list[int] = field(default_factory=list)  # the prefix id of each of its full blocks (block_key)
    status: str = WAITING
    finish_reason: str | None = None  # "stop", "length" or "abort"
    arrival: int = 0                  # FCFS order, kept through preemption
    stop_ids: frozenset = frozenset()  # eos (unless ignore_eos) and stop_token_ids: set by RequestBook.add
    max_len: int = 0                  # token count at which it stops for length: set by RequestBook.add
    last_step: int = -1               # the last step that scheduled it (preemption spares those)
    num_reported: int = 0             # output tokens already returned in outputs (for "delta")
    text: str = ""                    # its output text so far, decoded incrementally (nanoengine.detokenize) ...
    prefix_offset: int = 0            # ... output_token_ids[prefix_offset:read_offset] were decoded last
    read_offset: int = 0
    text_reported: int = 0            # characters of text already returned in outputs (for "delta")
    arrival_time: float = 0.0         # time.perf_counter(), as the three below (first token: on the host)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self):
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def pending(self) -> bool:
        """A token of it is in flight (async). PLACEHOLDERs only ever end token_ids: they are appended at
        launch and filled in the order of the steps, at most two steps apart."""
        return self.token_ids[-1] == PLACEHOLDER

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def reports_each_token(self) -> bool:
        """Its tokens are reported as they land: it streams them, or the engine checks its text for stop strings."""
        return self.params.output_kind != "final_only" or bool(self.params.stop)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens the host has (without the ones still in flight)."""
        ids = self.token_ids[self.num_prompt_tokens:]
        while ids and ids[-1] == PLACEHOLDER:
            ids = ids[:-1]
        return ids


def block_key(parent: int, tokens) -> tuple:
    """A block's identity in the prefix cache: its tokens AND everything before it, as (the prefix id of
    the block before it, 0 for none; its tokens). A dict compares keys exactly, so two prefixes never meet
    in one entry, as two hashes can collide. Each published block gets a new prefix id, never reused, so
    an evicted block's successors cannot be reached through whatever takes its place."""
    return parent, tuple(tokens)


class BlockManager:
    """Hands out KV blocks, ref-counted, with prefix caching.

    A full block of real tokens is published under its key (block_key): a prompt's blocks as soon as they are
    computed (requests that share a system prompt find them while the first still runs), the blocks a request
    fills while decoding when it lets go of them (finish, abort, preemption), as SGLang inserts a request into its
    radix cache when it finishes. A block whose last user lets go is not wiped: it waits in an LRU list of
    cached-free blocks, reusable by a later request with the same prefix until the allocator evicts it. The
    runner's scratch block (index num_blocks) is not known here, so it can never be handed out."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_count = [0] * num_blocks
        self.key_of = [None] * num_blocks           # block -> published key (None: private)
        self.prefix_id = [0] * num_blocks           # block -> the prefix id of it and all before it
        self.block_of: dict[tuple, int] = {}        # published key -> block
        self._prefix_ids = itertools.count(1)       # 0 is the empty prefix
        self.free = deque(range(num_blocks))        # never published, or evicted
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # published, unused; least recent first

    @property
    def num_free_blocks(self) -> int:
        return len(self.free) + len(self.cached_free)

    def cached_prefix(self, req: Request) -> list[int]:
        """Blocks already holding a prefix of req's tokens. The last token is always left to compute,
        since its logits are what the step needs."""
        blocks, parent = [], 0
        for i in range((len(req.token_ids) - 1) // self.block_size):
            tokens = req.token_ids[i * self.block_size:(i + 1) * self.block_size]
            block = None if PLACEHOLDER in tokens else self.block_of.get(block_key(parent, tokens))
            if block is None:
                break
            blocks.append(block)
            parent = self.prefix_id[block]
        return blocks

    def use_cached(self, req: Request, blocks: list[int]):
        for block in blocks:
            if self.ref_count[block] == 0:
                del self.cached_free[block]
            self.ref_count[block] += 1
        req.block_ids = list(blocks)
        req.prefix_ids = [self.prefix_id[b] for b in blocks]
        req.num_computed_tokens = len(blocks) * self.block_size

    def allocate(self, req: Request, num_tokens: int) -> bool:
        """Give req room for num_tokens more tokens; False (and nothing taken) if there is not enough."""
        total = cdiv(req.num_computed_tokens + num_tokens, self.block_size)  # blocks for all its tokens
        need = max(0, total - len(req.block_ids))
        if need > self.num_free_blocks:
            return False
        req.block_ids += self.take(need)
        return True

    def take(self, n: int) -> list[int]:
        """n blocks, each with one user; the caller has checked that there are enough free."""
        assert n <= self.num_free_blocks, f"{n} blocks asked, {self.num_free_blocks} free"
        blocks = []
        for _ in range(n):
            if self.free:
                block = self.free.popleft()
            else:  # evict the least recently freed
                block, _ = self.cached_free.popitem(last=False)
                del self.block_of[self.key_of[block]]
                self.key_of[block] = None
            self.ref_count[block] = 1
            blocks.append(block)
        return blocks

    def publish(self, req: Request, num_tokens: int):
        """Publish the blocks that req's first num_tokens tokens fill, up to its first PLACEHOLDER. A block
        whose content another request already published (the same prefix in one step) stays private, so
        the cache never holds duplicates; req's later blocks then follow on from the published one."""
        bs, ids, tokens = self.block_size, req.prefix_ids, req.token_ids
        end = min(num_tokens, len(tokens))
        while end and tokens[end - 1] == PLACEHOLDER:  # PLACEHOLDERs only end token_ids
            end -= 1
        for i in range(len(ids), end // bs):
            key = block_key(ids[-1] if ids else 0, tokens[i * bs:(i + 1) * bs])
            block = self.block_of.get(key)
            if block is None:  # req's own block: the blocks before it are published, so it is still private
                block = req.block_ids[i]
                assert self.key_of[block] is None, f"block {block} is published twice"
                self.block_of[key], self.key_of[block] = block, key
                self.prefix_id[block] = next(self._prefix_ids)
            ids.append(self.prefix_id[block])

    def release(self, reqs: list[Request]):
        """Publish the blocks the requests filled while decoding (their KV is written, or queued to be), then give
        their blocks back, each one's tail first, so that the LRU evicts a prefix's last blocks before its first."""
        for req in reqs:
            self.publish(req, req.num_computed_tokens)
        for req in reqs:
            for block in reversed(req.block_ids):
                self.ref_count[block] -= 1
                assert self.ref_count[block] >= 0, f"block {block} freed twice"
                if self.ref_count[block] == 0:
                    if self.key_of[block] is None:
                        self.free.append(block)
                    else:
                        self.cached_free[block] = None
            req.block_ids, req.prefix_ids = [], []


@dataclass
class SchedulerOutput:
    """One step's plan: request i computes tokens [starts[i], starts[i] + num_tokens[i])."""
    requests: tuple[Request, ...]  # a tuple: a plan never changes once made
    starts: np.ndarray             # (B,) int64
    num_tokens: list[int]
    samples: list[bool]            # does this request's chunk reach its end (so it samples a token)?
    num_decode: int = 0            # the first num_decode entries are decodes (one token, sampling)
    step: int = 0                  # Scheduler.step_id of this plan

    @property
    def is_decode(self) -> bool:
        return self.num_decode == len(self.requests)

    @property
    def num_samples(self) -> int:
        return len(self.requests) if self.is_decode else sum(self.samples)


@dataclass
class Batch:
    """A plan as the model reads it: tensors on the device, built by nanoengine's InputBuilder. Nothing here
    is a host-side list a CUDA graph could not fix; the two host ints only bound what the tensors hold."""
    input_ids: torch.Tensor        # (T,) int64
    positions: torch.Tensor        # (T,) int64
    slot_mapping: torch.Tensor     # (T,) int64: block * block_size + offset; -1 = padding, goes to scratch
    query_start_loc: torch.Tensor  # (B + 1,) int32: request b's tokens are [qsl[b], qsl[b + 1])
    seq_lens: torch.Tensor         # (B,) int64: context length including this step's tokens; 0 = padding
    block_table: torch.Tensor      # (B, max_blocks) int32
    logits_indices: torch.Tensor   # (S,) int64: the rows whose next token is sampled
    max_query_len: int             # bound on tokens per request: 1 means a decode batch (token b is request b's)
    max_seq_len: int               # bound on seq_lens (Part 2's decode attention picks its tiles by it)


# ----------------------------------------------------------------------------------------------------------
# Part 1: the requests' book and the scheduler
class RequestBook:
    """The requests and what happens to them after a step: a sampled token lands, a stop is checked, a request
    finishes or is aborted and gives its blocks back. It holds the queues the Scheduler plans from.

    Tokens arrive as an int64 array (n,); requests get Python ints (tolist), never numpy scalars. Each landing returns
    the requests to report: those that got a token and want per-step outputs (output_kind), and those that finished."""

    def __init__(self, blocks: BlockManager, max_model_len: int, eos_token_ids: tuple = ()):
        self.blocks, self.max_model_len, self.eos_token_ids = blocks, max_model_len, frozenset(eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.aborted: list[Request] = []  # finished by finish() (abort, stop string), reported with the next outputs
        self._arrivals = itertools.count()
        self.on_release = lambda req: None  # told when a request gives its blocks back (the runner's rows)

    def add(self, req: Request):
        p = req.params
        req.stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_token_ids)
        req.max_len = min(req.num_prompt_tokens + p.max_tokens, self.max_model_len)
        req.arrival, req.arrival_time = next(self._arrivals), time.perf_counter()
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @staticmethod
    def sampling_requests(plan: SchedulerOutput) -> tuple[Request, ...]:
        return plan.requests if plan.is_decode else tuple(r for r, s in zip(plan.requests, plan.samples) if s)

    def update(self, plan: SchedulerOutput, tokens) -> list[Request]:
        """Sync: a launch whose tokens land at once."""
        return self.fill(self.append_placeholders(plan), tokens)

    def append_placeholders(self, plan: SchedulerOutput) -> tuple:
        """A launch: each sampling request gets a PLACEHOLDER where its new token will go. Returns where the
        step's tokens will land, for fill(): the requests and their placeholders' indices."""
        reqs = self.sampling_requests(plan)
        index = [len(r.token_ids) for r in reqs]
        for req in reqs:
            req.token_ids.append(PLACEHOLDER)
        return reqs, index

    def fill(self, landing: tuple, tokens) -> list[Request]:
        """A step's tokens have landed: each goes to its PLACEHOLDER, and finishes its request if it ends it (a stop
        id, or the last allowed index). Returns the requests to report."""
        reqs, index = landing
        now, ended, report = time.perf_counter(), [], []
        for req, i, token in zip(reqs, index, np.asarray(tokens).tolist()):
            if req.status == FINISHED or i >= len(req.token_ids):
                continue  # stopped or aborted meanwhile: this token was computed for nothing, drop it
            assert req.token_ids[i] == PLACEHOLDER, f"slot {i} of {req.request_id} already filled"
            req.token_ids[i] = token
            if req.first_token_time is None:
                req.first_token_time = now
            if token in req.stop_ids or i + 1 >= req.max_len:
                ended.append((req, i, token))
            elif req.reports_each_token:
                report.append(req)
        return report + self._finish_ended(ended)

    def _finish_ended(self, ended: list[tuple[Request, int, int]]) -> list[Request]:
        if not ended:
            return []
        for req, i, token in ended:
            del req.token_ids[i + 1:]  # async: tokens launched after the stop are dropped
            if req.status == WAITING:  # async: preempted since its step was launched
                self.waiting.remove(req)
        finished = [req for req, _, _ in ended]
        self.blocks.release(finished)
        for req, _, token in ended:
            self._retire(req, "stop" if token in req.stop_ids else "length")
        self.running = [r for r in self.running if r.status == RUNNING]  # one pass, not a remove each
        return finished

    def finish(self, req: Request, reason: str):
        """End a request now (abort, or a stop string the engine found): its blocks go back once, and it is
        reported with the next outputs."""
        if req.status == RUNNING:
            self.running.remove(req)
        elif req.status == WAITING:
            self.waiting.remove(req)
        while req.pending:  # tokens in flight (async) are dropped, never read back: fill() skips them
            req.token_ids.pop()
        self.blocks.release([req])
        self._retire(req, reason)
        self.aborted.append(req)

    def _retire(self, req: Request, reason: str):
        self.on_release(req)
        req.status, req.finish_reason, req.finished_time = FINISHED, reason, time.perf_counter()
        del self.requests[req.request_id]

    def preempt(self, req: Request):
        """Back to waiting with nothing computed (its KV will be recomputed), ahead of all that arrived after it."""
        self.running.remove(req)
        self.blocks.release([req])
        self.on_release(req)
        req.num_computed_tokens, req.status = 0, WAITING
        self.waiting.insert(sum(r.arrival < req.arrival for r in self.waiting), req)  # waiting is in arrival order


class Scheduler:
    """Continuous batching with chunked prefill and preemption by recompute: what runs next.

    Each step: first the running requests (decodes, then prompts still being chunked), in arrival order,
    then waiting ones while there is token budget, sequence slots and KV blocks. When a running request
    needs a block and none is free, the most recently arrived running request is preempted (as vLLM does):
    its blocks go back, and it waits to be recomputed later (the prefix cache usually makes that cheap)."""

    def __init__(self, book: RequestBook, max_num_seqs: int, max_num_batched_tokens: int):
        self.book, self.blocks = book, book.blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.step_id, self.num_preemptions = 0, 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache (a statistic)
        self.preempted = False  # this step preempted someone: it admits no one (_admit says why)

    def schedule(self) -> SchedulerOutput:
        self.step_id += 1
        return self._plan()

    def _plan(self) -> SchedulerOutput:
        self.preempted = False
        plan = SchedulerOutput([], [], [], [])
        budget = self._decode_pass(plan)
        for req in [r for r in self.book.running if len(r.token_ids) - r.num_computed_tokens > 1]:
            n = min(len(req.token_ids) - req.num_computed_tokens, budget)  # prompts still being chunked
            # RUNNING again: a _grow before it in this step may have preempted it, and the list is a copy
            if req.status == RUNNING and n > 0 and self._grow(req, n):
                self._add_to_step(plan, req, n)
                budget -= n
        self._admit(plan, budget)
        plan.requests, plan.starts = tuple(plan.requests), np.array(plan.starts, dtype=np.int64)
        plan.step = self.step_id
        return plan

    def _decode_pass(self, plan: SchedulerOutput) -> int:
        """Running requests with one token to compute, preempting if blocks run out. Returns the token budget left."""
        budget, bs = self.max_num_batched_tokens, self.blocks.block_size
        for req in list(self.book.running):  # a copy: preemption removes from running
            nc = req.num_computed_tokens
            if len(req.token_ids) - nc != 1 or (self.preempted and req.status != RUNNING):
                continue  # a prompt chunk, or preempted earlier in this loop
            if budget == 0:
                break
            if len(req.token_ids) >= req.max_len and req.pending:
                continue  # its last allowed token is still in flight: it must not compute another
            new_block = nc == len(req.block_ids) * bs  # its blocks are full: this token starts one
            if new_block and not self._grow(req, 1):
                continue  # it was preempted itself
            plan.requests.append(req)
            plan.starts.append(nc)
            req.num_computed_tokens, req.last_step = nc + 1, self.step_id
            budget -= 1
        plan.num_decode = len(plan.requests)
        plan.num_tokens, plan.samples = [1] * plan.num_decode, [True] * plan.num_decode
        return budget

    def _admit(self, plan: SchedulerOutput, budget: int):
        """New requests only when nothing had to be preempted: otherwise they would take the room back."""
        book = self.book
        while book.waiting and budget > 0 and len(book.running) < self.max_num_seqs and not self.preempted:
            req = book.waiting[0]
            if req.pending:  # preempted with a token in flight: wait for it to land
                break
            self.blocks.use_cached(req, self.blocks.cached_prefix(req))  # it has nothing computed (new, or preempted)
            self.num_cached_tokens += req.num_computed_tokens
            n = min(len(req.token_ids) - req.num_computed_tokens, budget)
            if not self.blocks.allocate(req, n):
                self.blocks.release([req])
                req.num_computed_tokens = 0
                break
            book.waiting.popleft()
            req.status = RUNNING
            book.running.append(req)
            self._add_to_step(plan, req, n)
            budget -= n

    def _grow(self, req: Request, n: int) -> bool:
        """Room for n more tokens of req, preempting others if needed: each time the most recently arrived running
        request not already in this step, else req itself. False if req itself had to go."""
        while not self.blocks.allocate(req, n):
            candidates = [r for r in self.book.running if r is not req and r.last_step != self.step_id]
            victim = max(candidates, key=lambda r: r.arrival, default=req)
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request):
        self.preempted = True
        self.num_preemptions += 1
        self.book.preempt(req)

    def _add_to_step(self, plan: SchedulerOutput, req: Request, n: int):
        start = req.num_computed_tokens
        plan.requests.append(req)
        plan.starts.append(start)
        plan.num_tokens.append(n)
        plan.samples.append(start + n == len(req.token_ids))
        req.num_computed_tokens, req.last_step = start + n, self.step_id
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.perf_counter()
        self.blocks.publish(req, start + n)


# ----------------------------------------------------------------------------------------------------------
# Around the chapter: what a request asks for (SamplingParams), and checks of user input
SEED_RANGE = (-(1 << 63), 1 << 63)  # seeds are int64 on the device (the sampler's noise hashes their bits)

# What a request's outputs carry, as vLLM's RequestOutputKind: every step its tokens so far, every step
# only the new ones, or one output when it finishes (LLM.generate's choice).
OUTPUT_KINDS = ("cumulative", "delta", "final_only")

# vLLM's SamplingParams fields that nanoengine does not implement, each with its "off" value: given that value a
# field is accepted and dropped, so vLLM code ports as it is; any other value is refused (takes_vllm_fields).
VLLM_OFF = dict(n=1, best_of=None, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, min_p=0.0,
                min_tokens=0, logprobs=None, prompt_logprobs=None, detokenize=True, skip_special_tokens=True,
                spaces_between_special_tokens=True, include_stop_str_in_output=False, logits_processors=None,
                truncate_prompt_tokens=None, guided_decoding=None, structured_outputs=None, logit_bias=None,
                allowed_token_ids=None, bad_words=None, extra_args=None)


def takes_vllm_fields(cls):
    """cls's __init__, wrapped: a VLLM_OFF field at its off value is dropped; at another value it is a ValueError,
    and a name that is no field at all (a typo) a TypeError, each naming the fields cls has."""
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        names = [f.name for f in fields(cls)]
        for name in kwargs.keys() - set(names):
            has = f"{cls.__name__} has {', '.join(names)}"
            if name not in VLLM_OFF:
                raise TypeError(f"{name}={kwargs[name]!r:.80}: no such field; {has} (and vLLM's others, off)")
            value, off = kwargs[name], VLLM_OFF[name]
            if not (value is off or (off is not None and np.ndim(value) == 0 and value == off)):
                raise ValueError(f"{name}={value!r:.80} is not supported: {has}; vLLM's other fields only at their "
                                 f"off value ({name}={off!r})")
        init(self, *args, **{k: v for k, v in kwargs.items() if k not in VLLM_OFF})
    cls.__init__ = functools.update_wrapper(__init__, init)
    return cls


@takes_vllm_fields
@dataclass
class SamplingParams:
    """How one request samples, as vLLM's SamplingParams, checked when made; vLLM's other fields only at their off
    values (VLLM_OFF). Any top_k >= the vocabulary is no limit too (vLLM clamps it). Token ids >= the vocabulary,
    and stop strings on a model without a tokenizer, are refused by Engine.add_request, which knows the model."""
    temperature: float = 1.0    # 0 means greedy; vLLM's default is 1.0 too. Finite: inf is refused, as in vLLM
    top_p: float = 1.0          # nucleus sampling: keep the fewest tokens whose mass reaches top_p; 1 keeps all
    top_k: int = -1             # keep the k most likely tokens; -1 or 0 keep all (vLLM: both mean off)
    max_tokens: int = 16        # vLLM's default
    seed: int | None = None     # per-request seed: the same tokens whatever else is in the batch (int64)
    stop_token_ids: tuple = ()  # extra ids that end the request (returned, like eos); None: none
    ignore_eos: bool = False    # keep going past eos (benchmarks)
    output_kind: str = "cumulative"  # one of OUTPUT_KINDS
    stop: tuple = ()            # strings that end the request once its text holds one (not in the text, as vLLM)

    def __post_init__(self):
        for name, kind in dict(temperature="number", top_p="number", top_k="int", max_tokens="int", ignore_eos="bool",
                               output_kind="str", seed="int", stop_token_ids="ints", stop="strs").items():
            check_type(name, getattr(self, name), kind, optional=name in ("seed", "stop_token_ids", "stop"))
        strings = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        require(all(strings), "stop", self.stop, "a non-empty string, or a list of them")
        require(math.isfinite(self.temperature) and self.temperature >= 0, "temperature", self.temperature,
                "a finite number >= 0 (0 means greedy)")
        require(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1] (1 keeps all tokens)")
        require(self.top_k >= -1, "top_k", self.top_k, "an integer >= 1, or -1 or 0 (off)")
        require(self.max_tokens >= 1, "max_tokens", self.max_tokens, "an integer >= 1")
        require(self.seed is None or SEED_RANGE[0] <= self.seed < SEED_RANGE[1], "seed", self.seed,
                "None or an integer in [-2**63, 2**63)")
        require(self.output_kind in OUTPUT_KINDS, "output_kind", self.output_kind, " or ".join(OUTPUT_KINDS))
        stop = tuple(int(t) for t in self.stop_token_ids or ())
        require(all(t >= 0 for t in stop), "stop_token_ids", self.stop_token_ids, "token ids >= 0")
        # numpy scalars become Python's: the scheduler and the runner read plain ints and floats
        self.temperature, self.top_p, self.top_k = float(self.temperature), float(self.top_p), int(self.top_k)
        self.max_tokens, self.ignore_eos, self.stop_token_ids = int(self.max_tokens), bool(self.ignore_eos), stop
        self.seed, self.stop = None if self.seed is None else int(self.seed), strings


def is_int(x) -> bool:
    """A Python or numpy integer, but not a bool: True is an int to Python, never a count or a token id."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


# What an argument may hold, for check_type: (the test, the words an error says it with)
KINDS = {
    "int": (is_int, "an integer"),
    "number": (lambda x: is_int(x) or isinstance(x, (float, np.floating)), "a number"),
    "bool": (lambda x: isinstance(x, (bool, np.bool_)), "True or False"),
    "str": (lambda x: isinstance(x, str), "a string"),
    "ints": (lambda x: isinstance(x, (list, tuple, set, frozenset, np.ndarray)) and all(map(is_int, x)),
             "a list of integers"),
    "strs": (lambda x: isinstance(x, str) or isinstance(x, (list, tuple)) and all(isinstance(s, str) for s in x),
             "a string or a list of strings"),
}


def check_type(name: str, value, kind: str, optional: bool = False):
    test, words = KINDS[kind]
    if not (test(value) or (optional and value is None)):
        raise TypeError(f"{name}={value!r:.80} has type {type(value).__name__}: it must be {words}"
                        + (" or None" if optional else ""))


def require(ok: bool, name: str, value, allowed: str):
    if not ok:
        raise ValueError(f"{name}={value!r:.80} is invalid: it must be {allowed}")


# ----------------------------------------------------------------------------------------------------------
# Part 2: the steady decode, a host fast path (EngineConfig(tuned=...) "steady"; BENCHMARKS.md, host step)
NO_ONE = np.zeros(0, dtype=np.int64)  # an empty selection of requests
STEADY_MAX_STEPS = 256  # rows of tokens a SteadyDecode holds (256 steps of 256 requests: 512 KB)


def others(n: int, index: np.ndarray) -> np.ndarray:
    """The indices in range(n) that are not in `index`, in order (a mask: np.setdiff1d sorts)."""
    keep = np.ones(n, dtype=bool)
    keep[index] = False
    return np.flatnonzero(keep)


@dataclass
class SteadyOutput(SchedulerOutput):
    """A plan of SteadyScheduler's: when it decodes an unchanged running set, that set, and who enters a block."""
    steady: SteadyDecode | None = None  # set when the plan decodes an unchanged running set
    entering: tuple[np.ndarray, np.ndarray] | None = None  # (requests whose token starts a block, the blocks)


@dataclass(eq=False)
class SteadyDecode:
    """The running set as numpy arrays, for the steps that only move every request on by one token: while the set
    stays the same, a step is planned with one numpy operation (counts + 1), not a pass over the requests in Python.

    While it stands, its arrays are the truth about its requests (counts, tokens sampled, blocks handed out); they get
    it all back (hand_back) when the set is dropped, before the general path or a finishing request reads them.
    Requests that finish only leave it (`without`): the rest go on in a new, smaller instance, so a runner can compact
    its rows and a step launched before can land its tokens (`kept_of`). A join, abort or preemption drops it."""
    requests: tuple[Request, ...]  # a new tuple with each instance: a runner tells a set by identity
    # (n,) int64 num_computed_tokens. Replaced each step, never changed in place: a plan's starts and its
    # placeholder indices are earlier arrays, and must keep their values.
    computed: np.ndarray
    last: np.ndarray         # (n,) int64: max_len - 1, the index of a request's last allowed token
    attend_at: np.ndarray    # (n,) int64: the count at which each needs more than +1 (see `of`)
    stops: frozenset         # every stop id of any of them (most often just eos)
    countdown: int           # min(last - computed): steps until the first of them computes its last token
    tokens: np.ndarray       # (steps, n) int64: row k holds the tokens sampled by its k-th step
    num_tokens: list[int]    # [1] * n and [True] * n: every plan's num_tokens and samples, one pair for all
    samples: list[bool]
    entered: list = field(default_factory=list)  # (indices, their new blocks) of each boundary step
    parent: SteadyDecode | None = None  # the set this one came from by `without`
    kept: np.ndarray | None = None       # ... and the parent's indices of this one's requests
    num_steps: int = 0       # rows of `tokens` in use (one per planned step)
    landed: int = 0          # ... of which the first `landed` hold tokens (async: the last may be in flight)
    quiet: int = 0           # min(attend_at - computed): while > 0, no one needs more than +1
    awaiting: bool = True    # planned, and no row yet for its tokens (append_placeholders)

    @classmethod
    def of(cls, plan: SchedulerOutput, block_size: int) -> SteadyDecode:
        """From a plan that decodes the whole running set (already applied to the requests)."""
        reqs, computed = plan.requests, plan.starts + 1
        last = np.array([r.max_len - 1 for r in reqs], dtype=np.int64)
        # The first count at which each needs more than +1: its next token starts a block (it may need one), or
        # is its last allowed (async: it must not compute another while that one is in flight).
        attend_at = np.minimum(cdiv(computed, block_size) * block_size, last)
        countdown = int((last - computed).min())
        # It stands for at most countdown + 1 steps (then someone computes its last token); + 1 to spare.
        tokens = np.empty((min(countdown + 2, STEADY_MAX_STEPS), len(reqs)), dtype=np.int64)
        return cls(reqs, computed, last, attend_at, frozenset().union(*(r.stop_ids for r in reqs)), countdown,
                   tokens, plan.num_tokens, plan.samples, quiet=int((attend_at - computed).min()))

    def land(self, row: int, tokens):
        """A step's tokens arrive; rows land in order (one step is in flight at most)."""
        self.tokens[row] = tokens
        self.landed = row + 1

    def hand_back(self, index: np.ndarray | None = None):
        """Hand the requests (all, or those at `index`) their counts and tokens, and every request its new blocks."""
        self.tokens[self.landed:self.num_steps] = PLACEHOLDER  # launched, not landed: filled by index later
        held, counts, reqs = self.tokens[:self.num_steps], self.computed, self.requests
        if index is not None:
            held, counts, reqs = held[:, index], counts[index], [reqs[i] for i in index.tolist()]
        for req, count, tokens in zip(reqs, counts.tolist(), held.T.tolist()):
            assert req.status == RUNNING, f"{req.request_id} left the set before it was dropped"
            req.num_computed_tokens = count
            req.token_ids += tokens
        for due, blocks in self.entered:  # in the order they were handed out
            for i, block in zip(due.tolist(), blocks):
                self.requests[i].block_ids.append(block)
        self.entered = []

    def without(self, leaving: np.ndarray) -> SteadyDecode | None:
        """The set less the requests at `leaving` (they get back what is held for them), or None if no one stays."""
        self.hand_back(leaving)
        kept = others(len(self.requests), leaving)
        if not len(kept):
            return None
        computed, last, attend_at = self.computed[kept], self.last[kept], self.attend_at[kept]
        countdown = int((last - computed).min())
        rows = max(len(self.tokens), min(self.num_steps + countdown + 2, STEADY_MAX_STEPS))  # as `of`, never fewer
        tokens = np.empty((rows, len(kept)), dtype=np.int64)
        tokens[:self.num_steps] = self.tokens[:self.num_steps, kept]
        # The stop ids stay those of the larger set: a superset only means a closer look (_steady_ended) sooner.
        return SteadyDecode(tuple([self.requests[i] for i in kept.tolist()]), computed, last, attend_at, self.stops,
                            countdown, tokens, self.num_tokens[:len(kept)], self.samples[:len(kept)], parent=self,
                            kept=kept, num_steps=self.num_steps, landed=self.landed,
                            quiet=int((attend_at - computed).min()), awaiting=self.awaiting)

    def kept_of(self, older: SteadyDecode) -> np.ndarray | None:
        """older's indices of this set's requests, where this set came from older by `without`; else None."""
        s, kept = self, None
        while s is not older:
            if s.parent is None:
                return None
            kept, s = (s.kept if kept is None else s.kept[kept]), s.parent
        return kept


class SteadyBook(RequestBook):
    """RequestBook that lands a steady decode's tokens on its arrays (a row each step) and checks their stops
    with one set test, so no request is visited until one stops or the set is dropped."""
    steady: SteadyDecode | None = None  # the running set as arrays, while it is unchanged

    def drop_steady(self):
        """Back to the general path: the requests get their counts and tokens back (SteadyDecode)."""
        s, self.steady = self.steady, None
        if s is not None:
            s.hand_back()

    def append_placeholders(self, plan: SchedulerOutput) -> tuple:
        """A steady plan's tokens land on a row of its set: (requests, indices, (set, row, countdown))."""
        s = plan.steady
        if s is None or s is not self.steady:
            return super().append_placeholders(plan)
        row, s.num_steps, s.awaiting = s.num_steps, s.num_steps + 1, False  # a row for its tokens, which `land` fills
        return s.requests, s.computed, (s, row, s.countdown)

    def fill(self, landing: tuple, tokens) -> list[Request]:
        tokens = np.asarray(tokens)
        if len(landing) == 2:  # the general path's
            return super().fill(landing, tokens)
        reqs, index, (s, row, countdown) = landing
        if s is self.steady:  # no one left the set since the launch
            s.land(row, tokens)
            return self._steady_ended(s, index, countdown, tokens)
        kept = None if self.steady is None else self.steady.kept_of(s)
        if kept is None:  # the set was dropped since the launch: the tokens go to their PLACEHOLDERs
            return super().fill((reqs, index.tolist()), tokens)
        self.steady.land(row, tokens[kept])  # some left since the launch: theirs go to their lists
        gone = others(len(reqs), kept)
        report = super().fill(([reqs[i] for i in gone.tolist()], index[gone].tolist()), tokens[gone])
        return report + self._steady_ended(self.steady, index[kept], countdown, tokens[kept])

    def _steady_ended(self, s: SteadyDecode, index: np.ndarray, countdown: int, tokens: np.ndarray) -> list:
        """Finish the members of the standing set s that a step's tokens (at index; countdown steps to the first last
        token) end, looked at one by one only when some token is a stop id of some request. They leave the set."""
        may_stop = bool(s.stops) and not s.stops.isdisjoint(tokens.tolist())  # exact when all share one eos
        if countdown > 0 and not may_stop:
            return []
        stopped = index >= s.last  # its last allowed token: one comparison, not a visit to each request
        if may_stop:
            stopped |= [token in req.stop_ids for req, token in zip(s.requests, tokens.tolist())]
        stopped = np.flatnonzero(stopped)
        if not len(stopped):
            return []
        ended = list(zip([s.requests[k] for k in stopped.tolist()], index[stopped].tolist(), tokens[stopped].tolist()))
        self.steady = s.without(stopped)
        return super()._finish_ended(ended)  # the set has let them go already: no drop

    def _finish_ended(self, ended: list) -> list[Request]:
        """A member finishing here drops the set: the running set changes, and the cut needs its tokens in token_ids."""
        if self.steady is not None and any(req in self.steady.requests for req, _, _ in ended):
            self.drop_steady()
        return super()._finish_ended(ended)

    def finish(self, req: Request, reason: str):
        if req.status == RUNNING:
            self.drop_steady()
        super().finish(req, reason)


class SteadyScheduler(Scheduler):
    """Scheduler that plans an unchanged running set's decode on SteadyDecode's arrays, with no per-request loop."""

    def _plan(self) -> SchedulerOutput:
        """The steady step where it is the general path's plan; else that plan, which may start a steady decode."""
        if (plan := self._steady_step()) is not None:
            return plan
        self.book.drop_steady()
        plan = SteadyOutput(**vars(super()._plan()))
        # Only requests that want just their final output (LLM.generate's): streamed ones, and those with stop
        # strings, need their tokens in token_ids every step, which is what the arrays avoid.
        if plan.requests and plan.is_decode and len(plan.requests) == len(self.book.running) and all(
                not r.reports_each_token and r.first_token_time is not None for r in plan.requests):
            plan.steady = self.book.steady = SteadyDecode.of(plan, self.blocks.block_size)
        return plan

    def _steady_step(self) -> SchedulerOutput | None:
        """The plan when the running set is unchanged and each request has one token to compute; None where
        the general path's could differ: a waiting request could join, or free blocks are short."""
        book, s = self.book, self.book.steady
        if s is None or s.awaiting or s.num_steps == len(s.tokens) or \
                (book.waiting and len(book.running) < self.max_num_seqs):
            return None
        if s.parent is not None:  # what a launched step or the runner may still look for (kept_of)
            s.parent.parent = None
        if s.countdown <= 0:  # async: their last allowed token is in flight, so they leave the set now
            s = book.steady = s.without(np.flatnonzero(s.computed >= s.last))  # (they finish as it lands)
            if s is None:
                return None
        starts, entering = s.computed, (NO_ONE, NO_ONE)
        if s.quiet <= 0:  # someone needs more than +1: the only steps that look at requests one by one
            # those due (short of the last token, seen to above, only where a token starts a block) each get that
            # block, handed to them at hand_back; if blocks are short, the general path's plan preempts
            due = np.flatnonzero(starts >= s.attend_at)
            if len(due) > self.blocks.num_free_blocks:
                return None
            blocks = self.blocks.take(len(due))
            s.entered.append((due, blocks))
            s.attend_at[due] = np.minimum(starts[due] + self.blocks.block_size, s.last[due])
            s.quiet, entering = int((s.attend_at - starts).min()), (due, np.array(blocks, dtype=np.int64))
        s.computed, s.awaiting = starts + 1, True
        s.countdown, s.quiet = s.countdown - 1, s.quiet - 1
        return SteadyOutput(s.requests, starts, s.num_tokens, s.samples, num_decode=len(s.requests),
                            step=self.step_id, steady=s, entering=entering)
