"""CUDA graphs for decode steps: one graph per batch-size bucket, with padding rows that cannot do harm.

A decode step of a small model is hundreds of tiny kernels; launching them one by one from Python costs
more than running them. A CUDA graph records the launches once and replays them with one call. A graph
replays fixed addresses and fixed grids, so:
- every input lives in a static buffer sized for the largest bucket, and a step copies its values in;
- a batch of B requests replays the smallest bucket b >= B; rows B..b-1 are padding: token 0 at position
  0, slot -1 (its KV goes to the scratch block, which the block manager never hands out) and seq_len 0
  (attention returns zeros and reads no KV), so they cannot touch a real request;
- the metadata the graph was captured with holds the bucket's host-side sizes, never the step's;
- where the forward's kernels depend on how long the contexts are (a big batch of short contexts packs
  several kv heads into one attention program: kernels.decode_context_bounds), a bucket has one graph
  per side of each bound, and a step replays the one its longest context allows.

On the CPU there are no graphs: the same static-buffer path runs eagerly, so CI tests its logic.
Imports: nanoengine's Batch (lazily, to keep the dependency one way: nanoengine imports this file).
"""
import gc
import time

import torch


def default_buckets(max_num_seqs: int) -> list[int]:
    """Every bucket size, decided here only: fine steps where padding would waste most, then every 8."""
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 8, 8))
    return sorted({min(s, max_num_seqs) for s in sizes})


class GraphRunner:
    def __init__(self, model, kv_cache: torch.Tensor, max_blocks_per_seq: int, buckets=None,
                 max_num_seqs: int = 256, use_cuda_graphs: bool = True):
        self.model, self.kv_cache = model, kv_cache
        self.buckets = sorted(set(buckets or default_buckets(max_num_seqs)))
        if self.buckets[0] < 1:
            raise ValueError(f"graph_buckets={self.buckets} is invalid: sizes must be >= 1")
        self.use_cuda_graphs = use_cuda_graphs
        # Each bucket's graphs, by the longest context each serves: the model's bounds, then any context
        self.max_seq_len = max_blocks_per_seq * kv_cache.shape[3]  # the longest the block table holds
        self.bounds = {b: (*model.decode_context_bounds(b), self.max_seq_len) for b in self.buckets}
        n, dev = self.buckets[-1], kv_cache.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int64, device=dev)  # as the runner stages them
        self.block_table = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        # A decode row has one query token, so the query offsets never change: 0, 1, 2, ...
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=dev)
        self.graphs, self.outputs = {}, {}
        self.capture_seconds, self.capture_bytes = 0.0, 0
        if use_cuda_graphs:
            if not getattr(model, "graph_safe", False):
                raise ValueError("CUDA graphs need a forward that never reads batch values on the host: "
                                 "load the model with fuse=True and Triton kernels, or set enforce_eager=True")
            self.capture()

    def batch(self, b: int, max_seq_len: int):
        """The Batch of bucket b, over the static buffers. max_query_len is the bucket's (1) and max_seq_len
        the graph's bound, fixed."""
        from nanoengine import Batch
        return Batch(input_ids=self.input_ids[:b], positions=self.positions[:b],
                     slot_mapping=self.slot_mapping[:b], query_start_loc=self.query_start_loc[:b + 1],
                     seq_lens=self.seq_lens[:b], block_table=self.block_table[:b],
                     logits_indices=self.logits_indices[:b], max_query_len=1, max_seq_len=max_seq_len)

    def forward(self, b: int, max_seq_len: int) -> torch.Tensor:
        hidden = self.model(self.batch(b, max_seq_len), self.kv_cache)  # (b, hidden): every decode row samples
        return self.model.compute_logits(hidden)                         # (b, vocab)

    @torch.inference_mode()
    def capture(self):
        """Largest bucket first, so the smaller graphs fit in the memory pool the first one reserved."""
        gc.collect()  # so that no dropped object is freed mid-measurement
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # torch.cuda.graph() empties the cache on entry: do it before measuring
        # Reserved, not free, memory: the graphs' pool is reserved by the caching allocator, and frees of
        # unrelated tensors during capture do not lower it.
        reserved, t0, pool = torch.cuda.memory_reserved(), time.perf_counter(), None
        for key in [(b, bound) for b in reversed(self.buckets) for bound in self.bounds[b]]:
            self.forward(*key)  # warm up: compile Triton kernels, let cuBLAS pick its algorithms
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[key] = self.forward(*key)
            except RuntimeError as e:
                raise ValueError(f"capturing the decode graph of batch {key[0]} failed: the forward read a "
                                 f"batch value on the host or synchronised ({e}); set enforce_eager=True") from e
            pool = graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        self.capture_bytes = torch.cuda.memory_reserved() - reserved

    def can_run(self, out) -> bool:
        """Only decode-only steps (one token per request, each sampling) that fit the largest bucket."""
        return len(out.requests) <= self.buckets[-1] and out.is_decode

    def bucket_for(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def key_for(self, batch) -> tuple[int, int]:
        """(bucket, context bound) of the graph a decode batch replays: the smallest bucket that holds its
        requests, and the smallest bound its longest context allows."""
        b = self.bucket_for(batch.seq_lens.shape[0])
        return b, next(bound for bound in self.bounds[b] if batch.max_seq_len <= bound)

    def run(self, batch) -> torch.Tensor:
        """Copy the step in, pad to the bucket, replay; returns logits of the real rows only."""
        B = batch.seq_lens.shape[0]
        key = self.key_for(batch)
        b = key[0]
        self.input_ids[:B].copy_(batch.input_ids)
        self.positions[:B].copy_(batch.positions)
        self.slot_mapping[:B].copy_(batch.slot_mapping)
        self.seq_lens[:B].copy_(batch.seq_lens)
        # Columns past this step's width keep stale block ids: attention never reads past seq_len.
        self.block_table[:B, :batch.block_table.shape[1]].copy_(batch.block_table)
        if b > B:  # padding rows: harmless by construction (see the module docstring)
            self.input_ids[B:b].zero_()
            self.positions[B:b].zero_()
            self.slot_mapping[B:b].fill_(-1)
            self.seq_lens[B:b].zero_()
        if self.use_cuda_graphs:
            self.graphs[key].replay()
            return self.outputs[key][:B]
        return self.forward(*key)[:B]
