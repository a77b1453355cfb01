"""CUDA graphs: a step's forward recorded once per bucket and replayed, with padding that cannot do harm.

A decode step of a small model is hundreds of tiny kernels: launching them from Python costs more than running
them. A CUDA graph records the launches once and replays them in one call, at fixed addresses and grids, so:
- every input lives in a static buffer sized for the largest bucket, and a step copies its values in;
- a step replays the smallest bucket that holds it: a decode step by its requests, else by its tokens;
- the padding fills the bucket with tokens that cannot touch a real request: token 0 at position 0, slot
  -1 (its KV goes to the scratch block, which the block manager never hands out), owned by padding
  requests of seq_len 0 (attention reads no KV for them and returns zeros);
- the Batch a graph was captured with holds the bucket's sizes (requests, max_query_len, max_seq_len),
  never a step's: the kernels' grids and tiles are fixed at capture, and the real lengths are only data;
- outputs go to static buffers too, so the graphs share one memory pool the size of the largest graph's.

These are vLLM's "full" CUDA graphs (cudagraph_mode FULL): the whole forward, attention included, as paged
attention reads every length from device buffers and sizes its grid from the bucket.
On the CPU there are no graphs: the same static-buffer path runs eagerly, so CI tests its logic.
Imports: scheduler's Batch (the type the model reads)."""
import gc
import time

import torch

from scheduler import Batch


def default_buckets(max_num_seqs: int) -> list[int]:
    """Decode buckets (requests), decided here only: fine steps where padding would waste most, then every 8."""
    return sorted({min(s, max_num_seqs) for s in [1, 2, 4, 8, *range(16, max_num_seqs + 8, 8)]})


def default_token_buckets(max_num_batched_tokens: int, most: int = 2048) -> list[int]:
    """Prompt-step buckets by tokens: powers of two to 256, then every 128 (a 1k prompt and a few decodes pad
    under an eighth), up to `most`: a bigger step is compute-bound, and its launches are noise."""
    top = min(max_num_batched_tokens, most)
    return sorted({min(t, top) for t in [16, 32, 64, 128, *range(256, top + 128, 128)]})


class GraphRunner:
    """Runs a step's forward through the graph of its bucket. model: nanoengine's Model (forward(batch,
    kv_cache) -> hidden, compute_logits(hidden, out)). token_buckets empty: decode graphs only."""

    def __init__(self, model, kv_cache: torch.Tensor, max_blocks_per_seq: int, max_num_seqs: int,
                 buckets: list[int], token_buckets: list[int], capture: bool):
        self.model, self.kv_cache, self.capture_graphs = model, kv_cache, capture
        self.buckets, self.token_buckets = sorted(set(buckets)), sorted(set(token_buckets))
        self.max_seq_len = max_blocks_per_seq * kv_cache.shape[3]  # the longest context the block table holds
        dev, n_tok = kv_cache.device, max(self.buckets[-1], *self.token_buckets, 0)
        n_seq = max_num_seqs + 1  # one more than a step can have: a padding request always fits
        self.input_ids = torch.zeros(n_tok, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n_tok, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n_tok,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(n_seq, dtype=torch.int64, device=dev)
        self.block_table = torch.zeros(n_seq, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.zeros(n_seq + 1, dtype=torch.int32, device=dev)
        # A decode request has one query token, so its query offsets and sampled tokens never change: 0, 1, 2...
        self.decode_qsl = torch.arange(self.buckets[-1] + 1, dtype=torch.int32, device=dev)
        self.every_token = torch.arange(self.buckets[-1], dtype=torch.int64, device=dev)
        dtype, hidden = model.lm_head.weight.dtype, model.config.hidden_size
        self.logits = torch.empty(self.buckets[-1], model.config.vocab_size, dtype=dtype, device=dev)
        self.hidden = torch.empty(max(self.token_buckets, default=0), hidden, dtype=dtype, device=dev)
        self.graphs, self.capture_seconds, self.capture_bytes = {}, 0.0, 0  # what capture() fills
        self.tokens_run = self.tokens_real = 0  # padding waste: tokens run (the buckets') vs real (the steps')
        if capture:
            if not model.graph_safe:
                raise ValueError("CUDA graphs need a forward that never reads batch values on the host: load the "
                                 "model with fuse=True and Triton kernels, or set enforce_eager=True")
            self.capture()

    # -- the Batch of each graph, over the static buffers ---------------------------------------------
    def decode_batch(self, key: tuple) -> Batch:
        b = key[1]  # requests, a token each
        return Batch(input_ids=self.input_ids[:b], positions=self.positions[:b], slot_mapping=self.slot_mapping[:b],
                     query_start_loc=self.decode_qsl[:b + 1], seq_lens=self.seq_lens[:b],
                     block_table=self.block_table[:b], logits_indices=self.every_token[:b], max_query_len=1,
                     max_seq_len=self.max_seq_len)

    def prompt_batch(self, key: tuple) -> Batch:
        t, r = key[1], self._prompt_requests(key[1])
        return Batch(input_ids=self.input_ids[:t], positions=self.positions[:t], slot_mapping=self.slot_mapping[:t],
                     query_start_loc=self.query_start_loc[:r + 1], seq_lens=self.seq_lens[:r],
                     block_table=self.block_table[:r], logits_indices=self.every_token[:0], max_query_len=t,
                     max_seq_len=self.max_seq_len)

    def _prompt_requests(self, t: int) -> int:
        """Requests of a prompt graph of t tokens: at most t (each has a token), and one for the padding's."""
        return min(self.seq_lens.shape[0] - 1, t) + 1

    def forward(self, key: tuple) -> None:
        """The captured work: the model on a bucket's static Batch, its output into a static buffer."""
        if key[0] == "decode":
            hidden = self.model(self.decode_batch(key), self.kv_cache)  # (b, hidden): every token samples
            self.model.compute_logits(hidden, out=self.logits[:key[1]])
        else:
            self.hidden[:key[1]].copy_(self.model(self.prompt_batch(key), self.kv_cache))

    def warm_up(self, key: tuple) -> None:
        """Before capture, the forward for real (Triton compiles, cuBLAS picks) on the buffers as made: all padding."""
        if key[0] == "prompt":  # request 0 (seq_len 0) owns every token: attention writes only requests' rows
            self.query_start_loc[1:].fill_(key[1])
        self.forward(key)

    def keys(self) -> list[tuple]:
        """Every graph, (kind, size), largest first: the first sets the pool's size, and the rest fit in it."""
        return [("prompt", t) for t in reversed(self.token_buckets)] + [("decode", b) for b in reversed(self.buckets)]

    @torch.inference_mode()
    def capture(self):
        gc.collect()  # so that no dropped object is freed mid-measurement
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # torch.cuda.graph() empties the cache on entry: do it before measuring
        # Reserved, not allocated: the caching allocator reserves the pool, and other tensors' frees never lower it.
        reserved, t0, pool = torch.cuda.memory_reserved(), time.perf_counter(), None
        for key in self.keys():
            self.warm_up(key)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    self.forward(key)
            except RuntimeError as e:
                raise ValueError(f"capturing the {key[0]} graph of {key[1]} failed: the forward read a batch "
                                 f"value on the host or synchronised ({e}); set enforce_eager=True") from e
            pool = graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize()
        self.capture_seconds, self.capture_bytes = time.perf_counter() - t0, torch.cuda.memory_reserved() - reserved

    # -- a step -------------------------------------------------------------------------------------------
    def key_for(self, batch: Batch) -> tuple | None:
        """The graph a step replays (None: eager): the smallest bucket that holds its requests (decode) or tokens."""
        tokens, reqs = batch.input_ids.shape[0], batch.seq_lens.shape[0]
        if batch.max_query_len == 1 and tokens == reqs and reqs <= self.buckets[-1]:
            return "decode", next(b for b in self.buckets if b >= reqs)
        if self.token_buckets and tokens <= self.token_buckets[-1]:
            return "prompt", next(t for t in self.token_buckets if t >= tokens)
        return None

    def run(self, batch: Batch) -> torch.Tensor | None:
        """Copy the step in, pad to its bucket, replay: the sampled tokens' logits, or None (no graph holds it)."""
        key = self.key_for(batch)
        if key is None:
            return None
        kind, size = key[0], key[1]
        T, B = batch.input_ids.shape[0], batch.seq_lens.shape[0]
        self.tokens_run, self.tokens_real = self.tokens_run + size, self.tokens_real + T
        self.input_ids[:T].copy_(batch.input_ids)
        self.positions[:T].copy_(batch.positions)
        self.slot_mapping[:T].copy_(batch.slot_mapping)
        self.seq_lens[:B].copy_(batch.seq_lens)
        # Columns past this step's width keep stale block ids: attention never reads past seq_len.
        self.block_table[:B, :batch.block_table.shape[1]].copy_(batch.block_table)
        if size > T:  # padding tokens: harmless by construction (see the module docstring)
            self.input_ids[T:size].zero_()
            self.positions[T:size].zero_()
            self.slot_mapping[T:size].fill_(-1)
        reqs = size if kind == "decode" else self._prompt_requests(size)
        self.seq_lens[B:reqs].zero_()
        if kind == "prompt":  # request B owns the padding tokens [T, size); the rest own none
            self.query_start_loc[:B + 1].copy_(batch.query_start_loc)
            self.query_start_loc[B + 1:reqs + 1].fill_(size)
        if self.capture_graphs:
            self.graphs[key].replay()
        else:
            self.forward(key)
        return self.logits[:B] if kind == "decode" else self.model.compute_logits(self.hidden[batch.logits_indices])
