"""nanoengine: the model, its weights, the paged KV cache, the model runner and the engine.

    from nanoengine import LLM, SamplingParams
    llm = LLM(model="tiny")                       # a preset, or a Hugging Face checkpoint folder
    outs = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=32))

The engine knows only token ids; a tokenizer (optional) turns text into ids at the edges. It imports
kernels.py (Triton kernels and their torch references: by path, see own_kernels), scheduler.py (requests,
blocks, batching, and the Batch type) and graphs.py (CUDA graphs per bucket). run.py is the command line.

Part 1 is the chapter: the model calls the Part 1 kernels by name, the runner turns each plan into a
Batch of device tensors, and the engine plans step s+1 while step s runs (step_async). Part 2, after it,
is the tuned path (EngineConfig.tuned): decode-speed kernel variants and the steady-decode host path; Part 3,
at the end, tensor parallel (EngineConfig.tensor_parallel_size). The forward never reads a batch value back to
the host, so a CUDA graph can hold it.
"""
import gc
import importlib.util
import json
import math
import os
import random
import sys
import time
import typing
from dataclasses import dataclass, fields, replace
from functools import partial
from types import SimpleNamespace

import numpy as np
import torch
import torch._dynamo  # noqa: F401 (imported first under the meta device, it would leave cycles holding an Engine)
import torch.nn.functional as F
from torch import nn

from graphs import GraphRunner, default_buckets, default_token_buckets
from scheduler import (FINISHED, PLACEHOLDER, SEED_RANGE, Batch, BlockManager, Request, RequestBook,
                       SamplingParams, Scheduler, cdiv, check_type, is_int, require)


def own_kernels():
    """kernels.py from this file's folder, whatever else is called `kernels` (transformers 5.x brings Hugging Face's
    `kernels` package): the loaded module if it is this file, else this file loaded by path, under the name "kernels"
    only where `import kernels` would find this file anyway, so another package's import never gets ours."""
    path = os.path.realpath(os.path.join(os.path.dirname(__file__), "kernels.py"))
    ours = lambda file: file is not None and os.path.realpath(file) == path  # noqa: E731
    for name in ("kernels", "nanoengine_kernels"):
        if ours(getattr(sys.modules.get(name), "__file__", None)):
            return sys.modules[name]
    found = importlib.util.find_spec("kernels") if "kernels" not in sys.modules else None
    name = "kernels" if found is not None and ours(found.origin) else "nanoengine_kernels"
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kernels = own_kernels()

__all__ = ["LLM", "SamplingParams", "Engine", "EngineConfig", "ModelConfig", "RequestOutput"]

CPU_KV_BYTES = 512 << 20          # KV cache on the CPU: 16k blocks for `tiny`, modest for real shapes
CUDA_SPARE_BYTES = 1 << 30        # kept free on CUDA beyond the measured activations: cuBLAS, the allocator
STAGING_ALIGN_BYTES = 16          # staged tensors start 16-byte aligned: see aligned_offsets
NO_INDEX = np.zeros(0, dtype=np.int64)  # an empty index array


# ----------------------------------------------------------------------------------------------------------
# Part 1, the model. Parameter names are the checkpoint's, so loading is a dictionary lookup.
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out=None) -> torch.Tensor:
    """cuBLAS's matmul; `out` (a graph's static logits buffer) is written in place."""
    if out is None:
        return F.linear(x, weight, bias)
    return torch.mm(x, weight.t(), out=out) if bias is None else torch.addmm(bias, x, weight.t(), out=out)


def textbook_ops(triton: bool) -> SimpleNamespace:
    """The operations the forward calls by name: Part 1's Triton launchers, or their plain-torch references
    (same arguments); the MoE router and the sampler's race (kernels 1.6, 1.7) are torch either way."""
    k = lambda name: getattr(kernels, name if triton else name + "_ref")  # noqa: E731
    return SimpleNamespace(
        add_rmsnorm=k("add_rmsnorm"), silu_and_mul=k("silu_and_mul"), rope_write_kv=k("rope_write_kv"),
        paged_attention=k("paged_attention"), fused_moe=k("fused_moe"), linear=linear,
        moe_route=kernels.moe_route_ref, race_sample=kernels.race_sample_ref)


def rope_cos_sin(cfg: "ModelConfig", max_pos: int, device) -> torch.Tensor:
    """(max_pos, head_dim) float32: cos in the first half, sin in the second (HF's rotate_half layout)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if cfg.rope_scaling:  # Llama 3.1/3.2: stretch the long wavelengths, keep the short ones, blend between
        s = cfg.rope_scaling
        factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / lo, inv_freq / factor,
                               torch.where(wavelen < old_len / hi, inv_freq, blended))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)  # (max_pos, d/2)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float().to(device)


def fuse_linears(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear whose rows are the parts' rows stacked: one matmul, one read of x, one launch."""
    fused = nn.Linear(1, 1, bias=parts[0].bias is not None, device="meta")
    fused.weight = nn.Parameter(torch.cat([p.weight.data for p in parts]))  # (sum of outs, in)
    if fused.bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias.data for p in parts]))
    return fused


class RMSNorm(nn.Module):
    """Holds the weight; the math is ops.add_rmsnorm (or, inside rope_write_kv, the per-head norm)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class Attention(nn.Module):
    def __init__(self, cfg: "ModelConfig"):
        super().__init__()
        self.H, self.Hkv, self.D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps, self.scale, self.fused = cfg.rms_norm_eps, cfg.head_dim ** -0.5, False
        self.q_proj = nn.Linear(cfg.hidden_size, self.H * self.D, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.Hkv * self.D, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.Hkv * self.D, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.H * self.D, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = self.k_norm = None  # Qwen3 normalises each head of q and k
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(self.D), RMSNorm(self.D)

    def fuse(self):
        """Fusing q, k and v saves two launches, two reads of x, and the two smallest matmuls' poor use of
        the GPU: one (H + 2 Hkv) D-row matmul streams its weight at a better rate than three."""
        self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj
        self.fused = True

    def qkv(self, h: torch.Tensor, ops) -> torch.Tensor:
        """(T, hidden) -> (T, (H + 2 Hkv) D): q, k and v side by side."""
        if self.fused:
            return ops.linear(h, self.qkv_proj.weight, self.qkv_proj.bias)
        return torch.cat([F.linear(h, p.weight, p.bias) for p in (self.q_proj, self.k_proj, self.v_proj)], -1)

    def heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(T, (H + 2 Hkv) D) -> q (T, H, D), k and v (T, Hkv, D): strided views, no copy."""
        T, H, Hkv, D = qkv.shape[0], self.H, self.Hkv, self.D
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        return q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D)

    def norms(self) -> tuple:
        """The per-head norms' weights (q, k), or (None, None)."""
        return (None, None) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)

    def forward(self, qkv: torch.Tensor, batch: Batch, k_cache, v_cache, cos_sin, ops) -> torch.Tensor:
        """qkv (T, (H + 2 Hkv) D) -> (T, hidden)."""
        q, k, v = self.heads(qkv)
        # q rotated in place; k rotated into its cache slot, v beside it
        ops.rope_write_kv(q, k, v, k_cache, v_cache, batch.slot_mapping, batch.positions, cos_sin, *self.norms(),
                          self.eps)
        o = ops.paged_attention(q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
                                self.scale, batch.max_query_len)  # (T, H, D)
        return ops.linear(o.view(qkv.shape[0], -1), self.o_proj.weight, self.o_proj.bias)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.fused = False

    def fuse(self):
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])  # (2I, hidden): gate rows, then up
        del self.gate_proj, self.up_proj
        self.fused = True

    def forward(self, h, ops):
        if self.fused:  # one matmul for gate and up, then silu(gate) * up in one pass
            return ops.linear(ops.silu_and_mul(ops.linear(h, self.gate_up_proj.weight)), self.down_proj.weight)
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))  # as Hugging Face writes it


class MoE(nn.Module):
    """Qwen3-MoE block: a softmax router picks top-k experts per token; their outputs are mixed by weight."""

    def __init__(self, cfg: "ModelConfig"):
        super().__init__()
        self.top_k, self.norm_topk_prob, self.fused = cfg.num_experts_per_tok, cfg.norm_topk_prob, False
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))

    def fuse(self):
        """Stack the experts so one grouped-GEMM kernel can reach any of them by index."""
        self.w_gate_up = nn.Parameter(torch.stack(  # (E, 2I, hidden)
            [torch.cat([e.gate_proj.weight.data, e.up_proj.weight.data]) for e in self.experts]))
        self.w_down = nn.Parameter(torch.stack([e.down_proj.weight.data for e in self.experts]))  # (E, hidden, I)
        del self.experts
        self.fused = True

    def forward(self, h, ops):
        weights, ids = ops.moe_route(ops.linear(h, self.gate.weight), self.top_k, self.norm_topk_prob)  # (T, k) each
        if self.fused:
            return ops.fused_moe(h, self.w_gate_up, self.w_down, weights, ids)
        # Unfused: one small matmul chain per expert that got tokens, and a host sync per expert to know
        # which did: the reason this path can never run inside a CUDA graph.
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(ids == e)
            if token.numel():
                out.index_add_(0, token, expert(h[token], ops) * weights[token, slot, None])
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: "ModelConfig", i: int):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.self_attn = Attention(cfg)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(i) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)

    def forward(self, x, residual, batch, k_cache, v_cache, cos_sin, ops):
        """Pre-norm: residual += x, normalise, attend; residual += that, normalise, MLP. residual is None
        before the first layer. Returns (this layer's output, the residual stream)."""
        h, residual = ops.add_rmsnorm(x, residual, self.input_layernorm.weight, self.eps)
        x = self.self_attn(self.self_attn.qkv(h, ops), batch, k_cache, v_cache, cos_sin, ops)
        h, residual = ops.add_rmsnorm(x, residual, self.post_attention_layernorm.weight, self.eps)
        return self.mlp(h, ops), residual


class Model(nn.Module):
    def __init__(self, cfg: "ModelConfig", layer_type: type = DecoderLayer):
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(layer_type(cfg, i) for i in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.ops = textbook_ops(triton=False)
        self.cos_sin = None  # set by build_model: (max_pos, head_dim) float32 on the model's device
        self.graph_safe = False  # every op a sync-free Triton launch: a CUDA graph can capture the forward

    def fuse(self):
        """Fuse weights once at load (q/k/v, gate/up, stacked experts); the originals are freed."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def forward(self, batch: Batch, kv_cache: torch.Tensor) -> torch.Tensor:
        """batch: one step's tokens; kv_cache (2, layers, blocks + 1, block_size, Hkv, D). -> (T, hidden)"""
        x, residual = self.model.embed_tokens(batch.input_ids), None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, batch, kv_cache[0, i], kv_cache[1, i], self.cos_sin, self.ops)
        return self.ops.add_rmsnorm(x, residual, self.model.norm.weight, self.config.rms_norm_eps)[0]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # (S, vocab) in the model's dtype: the sampler reads it as float32 in registers; a copy would cost a kernel
        return self.ops.linear(hidden, self.lm_head.weight, out=out)


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


# ----------------------------------------------------------------------------------------------------------
# Sampling
@dataclass
class SamplingBatch:
    temperature: torch.Tensor      # (S,) float32; 0 = greedy
    top_k: torch.Tensor            # (S,) int64; vocab size when off
    top_p: torch.Tensor            # (S,) float32
    seeds: torch.Tensor            # (S,) int64
    counters: torch.Tensor         # (S,) int64: index of the token being sampled
    all_greedy: bool
    need_filter: bool              # any top-k or top-p in the batch (a sort over the vocab)


def sample(logits: torch.Tensor, s: SamplingBatch, race=kernels.race_sample_ref) -> torch.Tensor:
    """(S, vocab) logits -> (S,) int64 tokens, on the device, with no host sync. Top-k / top-p set the
    dropped logits to -inf (a sort, only when some request asks for it); then `race` draws each row from
    softmax(logits / T) by the exponential race, with noise that is a hash of (seed, token index,
    vocabulary id): a request's tokens never depend on its batch. Temperature 0 rows take the argmax."""
    if s.all_greedy:
        return race(logits.contiguous(), s.temperature, s.seeds, s.counters, greedy=True)
    if s.need_filter:
        logits = logits.float()
        scaled = logits / s.temperature.clamp(min=1e-5)[:, None]
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(logits.shape[-1], device=logits.device)
        probs = sorted_logits.softmax(dim=-1)
        drop = (rank[None, :] >= s.top_k[:, None]) | (probs.cumsum(-1) - probs > s.top_p[:, None])
        logits = logits.masked_fill(torch.empty_like(drop).scatter_(-1, order, drop), float("-inf"))
    return race(logits.contiguous(), s.temperature, s.seeds, s.counters)


# ----------------------------------------------------------------------------------------------------------
# The model runner: a step's Batch (InputBuilder), then its forward and sampling (ModelRunner)
def aligned_offsets(sizes: list[int], itemsize: int) -> tuple[list[int], int]:
    """Where each of several arrays starts when packed into one buffer with every start 16-byte aligned,
    and the total length. Triton compiles a kernel once per pointer alignment it sees: packed tightly, the
    staged tensors' alignment would change with each step's sizes, and a run would stall on recompiles."""
    align = max(1, STAGING_ALIGN_BYTES // itemsize)
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += cdiv(n, align) * align
    return offsets, total


class Staging:
    """Named host arrays -> device tensors of the same names, in one copy per dtype. On CUDA the arrays are
    packed into pinned buffers and copied without blocking; two buffers alternate so the host can fill one
    while the other's copy may still be queued behind the step in flight (an event guards the reuse). On the
    CPU the tensors are zero-copy views, kept while the same arrays come back (Part 2's steady rows do).
    bounds: each name the caller stages -> (dtype, the most values it holds), which sizes the buffers.
    packed: pack on the CPU too, as on CUDA (for a subclass that sends the packed buffers on)."""

    def __init__(self, device: torch.device, bounds: dict[str, tuple[str, int]], packed: bool = False):
        self.device, self.cuda, self.turn = device, device.type == "cuda", 0
        self.packed = packed or self.cuda
        self.buffers, self.events, self.last = [{}, {}], [None, None], ({}, SimpleNamespace())
        sizes = {}
        for dtype, n in bounds.values():
            sizes[dtype] = sizes.get(dtype, 0) + n + STAGING_ALIGN_BYTES  # + each start's alignment padding
        if self.packed:  # sized up front: allocating pinned memory mid-run can synchronise the device
            for buffers in self.buffers:
                for dtype, n in sizes.items():
                    buffers[np.dtype(dtype)] = torch.empty(n, dtype=getattr(torch, dtype), pin_memory=self.cuda)

    def to_device(self, arrays: dict[str, np.ndarray]) -> SimpleNamespace:
        if not self.packed:
            if arrays.keys() != self.last[0].keys() or any(a is not self.last[0][k] for k, a in arrays.items()):
                self.last = arrays, SimpleNamespace(**{k: torch.from_numpy(np.ascontiguousarray(a))
                                                       for k, a in arrays.items()})
            return self.last[1]
        self.turn ^= 1
        if self.events[self.turn] is not None:
            self.events[self.turn].synchronize()
        by_dtype = {}
        for name, a in arrays.items():
            by_dtype.setdefault(a.dtype, {})[name] = a
        tensors = SimpleNamespace()
        for dtype, group in by_dtype.items():
            tensors.__dict__.update(self._copy(dtype, group))
        if self.cuda:
            self.events[self.turn] = torch.cuda.current_stream().record_event()
        return tensors

    def _copy(self, dtype: np.dtype, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        offsets, total = aligned_offsets([a.size for a in arrays.values()], dtype.itemsize)
        buf = self.buffers[self.turn][dtype]
        assert buf.numel() >= total, f"{total} {dtype} values to stage, but the buffer holds {buf.numel()}"
        host = buf.numpy()
        for a, o in zip(arrays.values(), offsets):
            host[o:o + a.size] = a.ravel()
        dev = self.on_device(buf[:total])
        return {name: dev[o:o + a.size].view(a.shape) for (name, a), o in zip(arrays.items(), offsets)}

    def on_device(self, packed: torch.Tensor) -> torch.Tensor:  # one copy (the allocator aligns its start)
        return packed.to(self.device, non_blocking=True)


def staged_bounds(tokens: int, requests: int, columns: int) -> dict[str, tuple[str, int]]:
    """Every array InputBuilder.prepare stages, by name: its dtype and the most values a step can give it
    (tokens and requests: a step's most; columns: the block table's)."""
    T, S = tokens, requests
    return dict(input_ids=("int64", T), positions=("int64", T), slot_mapping=("int64", T), seq_lens=("int64", S),
                logits_indices=("int64", S), fill_at=("int64", S), fill_from=("int64", S), seeds=("int64", S),
                counters=("int64", S), top_k=("int64", S), query_start_loc=("int32", S + 1),
                block_table=("int32", S * columns), temperature=("float32", S), top_p=("float32", S))


class InputBuilder:
    """Turns a plan (SchedulerOutput) into the step's Batch and SamplingBatch on the device.

    Per-request state lives in persistent rows (block-table row, sampling settings) that change only when
    a request joins or gets a new block, so a step gathers rows instead of rebuilding them. Inputs still
    on the device (async: PLACEHOLDERs) are copied from the last step's sampled tokens, never read back."""
    staging_type = Staging

    def __init__(self, cfg: "EngineConfig", vocab_size: int, max_blocks_per_seq: int):
        self.block_size, self.vocab_size = cfg.block_size, vocab_size
        rows = cfg.max_num_seqs  # one per running request: a preempted or finished one gives its row back
        self.row_of: dict[Request, int] = {}
        self.free_rows = list(range(rows - 1, -1, -1))
        self.table = np.zeros((rows, max_blocks_per_seq), dtype=np.int32)  # block-table rows
        self.row_nblocks = np.zeros(rows, dtype=np.int64)  # how many of its blocks are in self.table
        self.temperature = np.zeros(rows, dtype=np.float32)
        self.top_k = np.zeros(rows, dtype=np.int64)
        self.top_p = np.zeros(rows, dtype=np.float32)
        self.seed = np.zeros(rows, dtype=np.int64)
        self.filtered = np.zeros(rows, dtype=bool)  # uses top-k or top-p: the sampler must sort
        bounds = staged_bounds(cfg.max_num_batched_tokens, cfg.max_num_seqs, max_blocks_per_seq)
        self.staging = self.staging_type(torch.device(cfg.device), bounds)
        # The last step's sampled tokens and whose they are: PLACEHOLDER inputs are copied from there.
        self.prev_tokens, self.prev_sampling, self._prev_index = None, (), None

    # -- persistent rows --------------------------------------------------------------------------------
    def rows(self, plan) -> np.ndarray:
        """Each request's row, its block-table row brought up to date (only new blocks are copied)."""
        reqs, row_of = plan.requests, self.row_of
        rows = [row_of.get(r) for r in reqs]
        if None in rows:  # new requests, or preempted ones back (their row was released with their blocks)
            rows = [self._new_row(r) if i is None else i for r, i in zip(reqs, rows)]
        rows = np.array(rows, dtype=np.int64)
        nblocks = np.array([len(r.block_ids) for r in reqs], dtype=np.int64)
        for i in np.flatnonzero(nblocks != self.row_nblocks[rows]).tolist():
            row, blocks, n0 = rows[i], reqs[i].block_ids, self.row_nblocks[rows[i]]
            self.table[row, n0:len(blocks)] = blocks[n0:]
            self.row_nblocks[row] = len(blocks)
        return rows

    def _new_row(self, req: Request) -> int:
        row = self.row_of[req] = self.free_rows.pop()
        self.row_nblocks[row] = 0
        p = req.params
        self.temperature[row], self.top_p[row], self.seed[row] = p.temperature, p.top_p, req.seed
        top_k = p.top_k if 0 < p.top_k < self.vocab_size else self.vocab_size  # -1, 0, >= vocab: no limit
        self.top_k[row], self.filtered[row] = top_k, top_k < self.vocab_size or p.top_p < 1
        return row

    def release(self, req: Request):
        row = self.row_of.pop(req, None)
        if row is not None:
            self.free_rows.append(row)

    # -- one step's tensors -----------------------------------------------------------------------------
    def prepare(self, plan) -> tuple[Batch, SamplingBatch, tuple]:
        """Host lists -> device tensors. Returns the batch, the sampling batch, and the sampling requests."""
        host, scalars, sampling = self.host_inputs(plan)
        return (*self.device_inputs(self.staging.to_device(host), *scalars), sampling)

    def host_inputs(self, plan) -> tuple[dict, tuple, tuple]:
        """The step's named host arrays, its host scalars (device_inputs' last arguments), its sampling requests."""
        rows = self.rows(plan)
        host, samples = self._decode(plan, rows) if plan.is_decode else self._mixed(plan, rows)
        sampling, srows = tuple(r for r, s in zip(plan.requests, samples) if s), rows[samples]
        max_seq_len = int(host["seq_lens"].max())
        host["block_table"] = self._block_table(rows, max_seq_len)
        host.update(seeds=self.seed[srows], counters=host["seq_lens"][samples], top_k=self.top_k[srows],
                    temperature=self.temperature[srows], top_p=self.top_p[srows])  # counters: the token's index
        # Every input is the token the same request sampled last step, in the same order: one copy, no gather.
        same = plan.is_decode and plan.requests == self.prev_sampling and bool((host["input_ids"] == PLACEHOLDER).all())
        host.update(self._placeholders(plan, host["input_ids"] if not same else NO_INDEX, host["query_start_loc"]))
        qsl = host["query_start_loc"]
        return host, (int((qsl[1:] - qsl[:-1]).max()), max_seq_len, not host["temperature"].any(),
                      bool(self.filtered[srows].any()), same), sampling

    def device_inputs(self, t: SimpleNamespace, max_query_len: int, max_seq_len: int, all_greedy: bool,
                      need_filter: bool, same: bool) -> tuple[Batch, SamplingBatch]:
        """The staged tensors t as a Batch and SamplingBatch; inputs still in flight come from its tokens."""
        batch = Batch(input_ids=t.input_ids, positions=t.positions, slot_mapping=t.slot_mapping,
                      query_start_loc=t.query_start_loc, seq_lens=t.seq_lens, block_table=t.block_table,
                      logits_indices=t.logits_indices, max_query_len=max_query_len, max_seq_len=max_seq_len)
        if same:
            batch.input_ids.copy_(self.prev_tokens)
        elif t.fill_at.numel():
            batch.input_ids[t.fill_at] = self.prev_tokens[t.fill_from]
        return batch, SamplingBatch(temperature=t.temperature, top_k=t.top_k, top_p=t.top_p, seeds=t.seeds,
                                    counters=t.counters, all_greedy=all_greedy, need_filter=need_filter)

    def _decode(self, plan, rows) -> tuple[dict, np.ndarray]:
        """One token per request, at position start, and every request samples: all vectorised."""
        pos, n = plan.starts, len(plan.requests)
        qsl = np.arange(n + 1, dtype=np.int32)
        return dict(input_ids=np.array([r.token_ids[-1] for r in plan.requests], dtype=np.int64), positions=pos,
                    slot_mapping=self._kv_slots(rows, pos), seq_lens=pos + 1, query_start_loc=qsl,
                    logits_indices=qsl[:-1].astype(np.int64)), np.ones(n, dtype=bool)

    def _mixed(self, plan, rows) -> tuple[dict, np.ndarray]:
        """Prompt chunks and decodes together: per-request ranges, so a loop (such steps are rare)."""
        ids, pos = [], []
        for r, s, n in zip(plan.requests, plan.starts, plan.num_tokens):
            ids += r.token_ids[s:s + n]
            pos.append(np.arange(s, s + n))
        ns, pos, samples = np.array(plan.num_tokens, dtype=np.int64), np.concatenate(pos), np.array(plan.samples)
        qsl = np.concatenate([[0], np.cumsum(ns)]).astype(np.int32)
        return dict(input_ids=np.array(ids, dtype=np.int64), positions=pos,
                    slot_mapping=self._kv_slots(np.repeat(rows, ns), pos), seq_lens=plan.starts + ns,
                    query_start_loc=qsl, logits_indices=(qsl[1:] - 1)[samples].astype(np.int64)), samples

    def _placeholders(self, plan, ids: np.ndarray, qsl: np.ndarray) -> dict:
        """Inputs the step in flight samples (async): their indices (fill_at) and their rows in its sampled
        tokens (fill_from). They travel in the same pinned copy as the rest: a pageable copy would wait for
        that step to finish."""
        fill_at = np.flatnonzero(ids == PLACEHOLDER)
        owners = np.searchsorted(qsl, fill_at, side="right") - 1  # the request of each such token
        fill_from = np.array([self.prev_index[plan.requests[b]] for b in owners.tolist()], dtype=np.int64)
        return dict(fill_at=fill_at, fill_from=fill_from)

    def _kv_slots(self, rows: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """(n,) int64 KV slots of the tokens at positions pos of the requests in rows."""
        return self.table[rows, pos // self.block_size].astype(np.int64) * self.block_size + pos % self.block_size

    def _block_table(self, rows: np.ndarray, max_seq_len: int) -> np.ndarray:
        """These rows' block-table columns up to the longest request's (columns first: mixed indexing is slower)."""
        return self.table[:, :cdiv(max_seq_len, self.block_size)][rows]

    def sampled(self, plan, tokens: torch.Tensor, sampling: tuple):
        self.prev_tokens, self.prev_sampling, self._prev_index = tokens, sampling, None

    @property
    def prev_index(self) -> dict:
        """Request -> its index in the previous step's sampled tokens (built only when a step needs it)."""
        if self._prev_index is None:
            self._prev_index = {r: i for i, r in enumerate(self.prev_sampling)}
        return self._prev_index


class ModelRunner:
    """Owns the KV cache and the graphs; runs a step's forward (graphed or eager) and its sampler."""

    def __init__(self, model: Model, cfg: "EngineConfig", num_blocks: int, max_blocks: int, inputs: InputBuilder,
                 graph_runner: type = GraphRunner):
        mc = model.config
        self.model, self.inputs, self.device = model, inputs, torch.device(cfg.device)
        # One extra block at the end: the scratch block. The block manager never hands it out; padding
        # tokens (slot -1) write there, so they can never touch a real request's KV.
        self.kv_cache = torch.zeros(2, mc.num_layers, num_blocks + 1, cfg.block_size, mc.num_kv_heads,
                                    mc.head_dim, dtype=model.lm_head.weight.dtype, device=self.device)
        self.stats = StepStats(cuda=self.device.type == "cuda")
        tokens = () if cfg.cudagraph_mode == "full_decode_only" else \
            (cfg.graph_token_buckets or default_token_buckets(cfg.max_num_batched_tokens))
        self.graphs = None if cfg.enforce_eager else graph_runner(
            model, self.kv_cache, max_blocks, cfg.max_num_seqs,
            cfg.graph_buckets or default_buckets(cfg.max_num_seqs), list(tokens), capture=self.device.type == "cuda")

    def close(self):
        """Drop every tensor this runner holds: KV cache, graphs and their pool, staging, tokens, model."""
        self.kv_cache = self.graphs = self.model = self.inputs = None

    def execute(self, plan) -> torch.Tensor:
        """Launch one step; returns the sampled tokens (S,) on the device, without waiting for them."""
        batch, sbatch, sampling = self.inputs.prepare(plan)
        t0, start = time.perf_counter(), self.stats.now()
        tokens = self.forward_and_sample(batch, sbatch)
        self.stats.end(start, prompt=not plan.is_decode)
        self.stats.forward_s += time.perf_counter() - t0
        self.inputs.sampled(plan, tokens, sampling)
        return tokens

    def forward_and_sample(self, batch: Batch, sbatch: SamplingBatch) -> torch.Tensor:
        """The forward (graphed or eager) and the sampler: (S,) tokens on the device."""
        logits = self.graphs.run(batch) if self.graphs is not None else None
        if logits is None:  # eager: the forward's activations are freed on return
            logits = self.model.compute_logits(self.model(batch, self.kv_cache)[batch.logits_indices])
        return sample(logits, sbatch, self.model.ops.race_sample)


# ----------------------------------------------------------------------------------------------------------
# The engine and the LLM front end
@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]           # output tokens so far ("delta": only the new ones)
    new_token_ids: list[int]       # the tokens this output adds to the last one
    text: str | None
    finished: bool
    finish_reason: str | None      # "stop", "length" or "abort"; None while running
    metrics: dict                  # arrival, first_scheduled, first_token, finished times; ttft, tpot (s)


class Engine:
    """add_request / abort / step / step_async / has_unfinished / stream, over a scheduler and a model runner."""

    def __init__(self, cfg: "EngineConfig | None" = None, **settings):
        cfg = cfg or EngineConfig(**settings)
        if not isinstance(cfg, EngineConfig):
            raise TypeError(f"cfg={cfg!r:.80} has type {type(cfg).__name__}: give an EngineConfig, or the "
                            "settings as keywords (Engine(model=...))")
        self.cfg, self.cuda = cfg, cfg.device.startswith("cuda")
        self.model, folder = build_model(cfg)
        self.tokenizer = load_tokenizer(folder)
        mc = self.model.config
        self.max_model_len = max_model_len(cfg, mc)
        num_blocks = cfg.num_blocks or self._blocks_for_memory()
        parts = engine_parts(cfg)  # RequestBook, Scheduler, InputBuilder, ModelRunner, GraphRunner (or later parts')
        self.book = parts.book(BlockManager(num_blocks, cfg.block_size), self.max_model_len, mc.eos_token_ids)
        self.scheduler = parts.scheduler(self.book, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        max_blocks = cdiv(self.max_model_len, cfg.block_size)
        inputs = parts.inputs(cfg, mc.vocab_size, max_blocks)
        # Finished, aborted or preempted requests give their rows back. The builder's bound method, not a
        # closure over self: nothing refers back to the engine, so dropping it frees it by refcount alone.
        self.book.on_release = inputs.release
        self.runner = parts.runner(self.model, cfg, num_blocks, max_blocks, inputs, parts.graphs)
        self.stats = self.runner.stats  # StepStats: where the steps' time goes (run.py reads it)
        self.rng = random.Random(cfg.seed)
        self.inflight = self.readback = None  # async: the step in flight (landing, tokens, event); pinned buffers
        self._ids = 0
        self.held: list[Request] = []  # requests with news for another caller than the last step's (_outputs)
        self.streamed: set[Request] = set()  # the requests of open streams: their news goes to the stream

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Validate and queue one request; returns its id. Bad input raises ValueError (or TypeError, for
        a wrong type) naming the argument, its value and what is allowed, and changes nothing."""
        ids, params = self._check(prompt, params, request_id)
        return self._add(ids, params, request_id)

    def abort(self, request_id: str):
        """Stop a request and give its blocks back. The next step() or step_async() returns it, once, with
        finish_reason "abort" and the tokens it had, as vLLM does. Safe with a step in flight (async): that
        step's token for it is dropped, never read back. An unknown or finished id is ignored."""
        check_type("request_id", request_id, "str")
        self._check_open()
        req = self.book.requests.get(request_id)
        if req is not None:
            self.book.finish(req, "abort")

    def has_unfinished(self) -> bool:
        self._check_open()
        return self.book.has_unfinished() or self.inflight is not None or bool(self.book.aborted) or \
            any(r not in self.streamed for r in self.held)

    # -- a step ------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run, read the tokens back (one host sync), update. Returns an output for each request
        that got a token (or finished) in this step, as its output_kind asks, or in a stream's steps (_outputs)."""
        return self._outputs(*self._step())

    def step_async(self) -> list[RequestOutput]:
        """Schedule and launch step s+1, then read back step s's tokens while s+1 runs on the device."""
        return self._outputs(*self._step_async())

    def _step(self) -> tuple:
        self._check_open()
        t0 = time.perf_counter()
        report = self._land() if self.inflight else []  # switching from async: land its step first
        plan = self.scheduler.schedule()
        if plan.requests:
            tokens = self.runner.execute(plan)
            t1 = time.perf_counter()
            tokens = tokens.cpu().numpy()
            self.stats.wait_s += time.perf_counter() - t1
            report += self.book.update(plan, tokens)
        return plan, report, t0

    def _step_async(self) -> tuple:
        self._check_open()
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        launched = None
        if plan.requests:
            tokens = self.runner.execute(plan)
            launched = (self.book.append_placeholders(plan), *self._copy_to_host(tokens))
        report = self._land() if self.inflight else []
        self.inflight = launched
        return plan, report, t0

    def _outputs(self, plan, report: list[Request], t0: float, stream: Request | None = None) -> list[RequestOutput]:
        """The outputs for the caller: step()'s (every request not in a stream), or a stream's (its request). Each
        request with news comes once, with all of it; news for another caller is held for its next call, so
        no output is lost when a stream steps the engine for everyone."""
        news = list(dict.fromkeys(self.held + self._check_stop_strings(report) + self.book.aborted))
        mine = [r is stream if stream else r not in self.streamed for r in news]
        self.held, self.book.aborted = [r for r, m in zip(news, mine) if not m], []
        outputs = [self.output(r) for r, m in zip(news, mine) if m]
        st = self.stats
        st.steps += bool(plan.requests)
        st.tokens += plan.num_samples
        st.total_s += time.perf_counter() - t0
        return outputs

    def _copy_to_host(self, tokens: torch.Tensor):
        """Start copying a step's tokens into one of two persistent pinned buffers (one step is in flight at most):
        allocating pinned memory per step could synchronise the device, the one thing this path must not do."""
        if not self.cuda:
            return tokens, None
        if self.readback is None:
            self.readback = [torch.empty(self.cfg.max_num_seqs, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.readback.reverse()
        host = self.readback[0][:tokens.shape[0]].copy_(tokens, non_blocking=True)
        return host, torch.cuda.current_stream().record_event()  # says when the tokens have landed

    def _land(self) -> list[Request]:
        slots, host, event = self.inflight
        self.inflight = None
        t = time.perf_counter()
        if event is not None:
            event.synchronize()
        self.stats.wait_s += time.perf_counter() - t
        return self.book.fill(slots, host.numpy())

    def output(self, req: Request) -> RequestOutput:
        ids = req.output_token_ids
        new, req.num_reported = ids[req.num_reported:], len(ids)
        finished, delta = req.status == FINISHED, req.params.output_kind == "delta"
        assert finished or req.params.output_kind != "final_only", f"{req.request_id} asked for its final output only"
        text = None
        if self.tokenizer is not None:
            detokenize(self.tokenizer, req, final=finished)
            # vLLM: while it runs, the text's last characters could be the start of a stop string: held back
            shown = req.text[:len(req.text) - (0 if finished else max(map(len, req.params.stop), default=1) - 1)]
            text, req.text_reported = shown[req.text_reported:] if delta else shown, len(shown)
        return RequestOutput(req.request_id, req.token_ids[:req.num_prompt_tokens], new if delta else ids, new,
                             text, finished, req.finish_reason, request_metrics(req, len(ids)))

    # -- around the steps: text (stop strings), checking requests, sizing the cache, streaming, closing ---
    def _check_stop_strings(self, report: list[Request]) -> list[Request]:
        """Finish each request whose text now holds one of its stop strings, as vLLM: the text ends before the
        first, whose token is the last (reason "stop", even on the last allowed). Returns those with an output."""
        for req in report:
            if not req.params.stop or req.finish_reason not in (None, "length"):
                continue
            # only where the new text reaches: any earlier match would have stopped it already
            start = len(req.text) - len(detokenize(self.tokenizer, req)) - max(map(len, req.params.stop)) + 1
            if found := [i for i in (req.text.find(s, max(start, 0)) for s in req.params.stop) if i >= 0]:
                req.text = req.text[:min(found)]
                if req.status == FINISHED:
                    req.finish_reason = "stop"
                else:
                    self.book.finish(req, "stop")
        return [r for r in report if r.status == FINISHED or r.params.output_kind != "final_only"]

    def tokenize(self, prompt) -> list[int]:
        """A prompt as token ids: text through the model's tokenizer, or a list (tuple, numpy array, 1-D
        tensor) of integer ids taken as they are. Anything else is a TypeError: an id is never rounded."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt is a string but model={self.cfg.model!r} has no tokenizer (it needs "
                                 "tokenizer.json and the optional 'tokenizers' package); pass token ids instead")
            return self.tokenizer.encode(prompt).ids
        if isinstance(prompt, (np.ndarray, torch.Tensor)):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)):
            raise TypeError(f"prompt={prompt!r:.80} has type {type(prompt).__name__}: give a string or a list of "
                            "token ids")
        bad = next((i for i, t in enumerate(prompt) if type(t) is not int and not is_int(t)), None)
        if bad is not None:
            raise TypeError(f"prompt[{bad}]={prompt[bad]!r:.80} has type {type(prompt[bad]).__name__}: token ids "
                            "must be integers")
        return [int(t) for t in prompt]

    def _check(self, prompt, params, request_id: str | None) -> tuple[list[int], SamplingParams]:
        self._check_open()
        params = check_params("params", params)
        check_type("request_id", request_id, "str", optional=True)
        if request_id in self.book.requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        ids = self.tokenize(prompt)
        vocab, limit = self.model.config.vocab_size, self.max_model_len
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        if bad := [t for t in ids if not 0 <= t < vocab]:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary: ids must be in [0, {vocab})")
        if bad := [t for t in params.stop_token_ids if t >= vocab]:
            raise ValueError(f"stop_token_ids has {bad[0]}, outside the vocabulary: ids must be in [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop={params.stop!r:.80} needs text, but model={self.cfg.model!r} has no tokenizer "
                             "(tokenizer.json and the 'tokenizers' package); use stop_token_ids instead")
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len={limit} leaves room for at most {limit - 1}")
        need = len(ids) + params.max_tokens
        if need > limit:  # as vLLM's server: refused, not cut short
            raise ValueError(f"max_tokens={params.max_tokens} is invalid: the prompt has {len(ids)} tokens and "
                             f"max_model_len={limit} leaves room for at most {limit - len(ids)}")
        capacity = self.book.blocks.num_blocks * self.cfg.block_size
        if need > capacity:
            raise ValueError(f"request needs {need} tokens of KV cache (prompt {len(ids)} + max_tokens "
                             f"{params.max_tokens}) but the whole cache holds {capacity}; lower max_tokens "
                             "or give the engine more num_blocks")
        return ids, params

    def _add(self, ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a request that _check has passed."""
        if request_id is None:  # the next number that no request uses (a caller may have picked it as an id)
            while str(self._ids) in self.book.requests:
                self._ids += 1
            request_id, self._ids = str(self._ids), self._ids + 1
        seed = params.seed if params.seed is not None else self.rng.getrandbits(63)
        self.book.add(Request(request_id, ids, params, seed))
        return request_id

    def _blocks_for_memory(self) -> int:
        """On CUDA, as in vLLM: the KV cache takes gpu_memory_utilization of the GPU's memory less this engine's
        weights, a step's activations (which bound the graphs' pool) and CUDA_SPARE_BYTES, cut only where less is
        free (another engine holds it): an engine made after another was closed or dropped gets as many blocks."""
        mc = self.model.config
        per_block = 2 * mc.num_layers * self.cfg.block_size * mc.num_kv_heads * mc.head_dim * \
            self.model.lm_head.weight.element_size()
        if not self.cuda:
            return max(16, CPU_KV_BYTES // per_block)
        gc.collect()  # a dropped engine that another library's reference cycle still holds lets go now
        torch.cuda.empty_cache()  # dropped engines and the unfused weights left memory in torch's cache
        activations = self._activation_bytes()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        util, weights = self.cfg.gpu_memory_utilization, param_bytes(self.model)
        budget = min(total * util - weights, free) - activations - CUDA_SPARE_BYTES
        if budget < per_block:
            raise ValueError(f"gpu_memory_utilization={util} leaves no room for the KV cache: {free / 2**30:.1f} of "
                             f"{total / 2**30:.1f} GiB are free with the weights ({weights / 2**30:.1f} GiB) loaded; "
                             "close() engines you no longer use, raise gpu_memory_utilization or use a smaller model")
        return int(budget // per_block)

    def _activation_bytes(self) -> int:
        """The most memory a step takes beyond the weights, as vLLM measures it: one forward of a full step on a
        dummy cache. The graphs' pool holds the largest graph's activations: counted too, with the logits buffer."""
        mc, cfg, bs, dtype = self.model.config, self.cfg, self.cfg.block_size, self.model.lm_head.weight.dtype
        T = min(cfg.max_num_batched_tokens, self.max_model_len)
        with torch.device(cfg.device):  # the dummy step's tensors
            kv = torch.zeros(2, mc.num_layers, 2, bs, mc.num_kv_heads, mc.head_dim, dtype=dtype)
            batch = Batch(input_ids=torch.zeros(T, dtype=torch.int64), positions=torch.arange(T),
                          slot_mapping=torch.full((T,), -1), query_start_loc=torch.tensor([0, T], dtype=torch.int32),
                          seq_lens=torch.tensor([T]), block_table=torch.zeros(1, cdiv(T, bs), dtype=torch.int32),
                          logits_indices=torch.arange(min(T, cfg.max_num_seqs)), max_query_len=T, max_seq_len=T)
        for _ in range(2):  # the first also makes what a process makes once (cuBLAS's workspace): not a step's
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            with torch.inference_mode():
                self.model.compute_logits(self.model(batch, kv)[batch.logits_indices])
            torch.cuda.synchronize()
        logits_buffer = cfg.max_num_seqs * mc.vocab_size * self.model.lm_head.weight.element_size()
        return torch.cuda.max_memory_allocated() - base + logits_buffer

    def stream(self, prompt, params: SamplingParams | None = None):
        """Add one request and yield its outputs as they arrive (output_kind "delta" unless given), while
        stepping the engine, whose other requests go on too: their outputs wait for the next step() (_outputs).
        Closing the generator early (a break: a client gone) aborts the request, as vLLM does."""
        params = replace(params or SamplingParams(), output_kind=(params.output_kind if params and
                                                                  params.output_kind != "final_only" else "delta"))
        rid = self.add_request(prompt, params)  # before the book is read: it checks the engine is open (book None)
        req = self.book.requests[rid]
        self.streamed.add(req)
        step = self._step_async if self.cfg.async_scheduling else self._step
        try:
            while True:
                for o in self._outputs(*step(), stream=req):
                    yield o
                    if o.finished:
                        return
        finally:  # no one reads its outputs any more: none is kept
            self.streamed.discard(req)
            self.held = [r for r in self.held if r is not req]
            if req.status != FINISHED and self.book is not None:
                self.book.finish(req, "abort")
                self.book.aborted.remove(req)

    def close(self):
        """Give the engine's memory back now (the runner's tensors, then torch's cache on CUDA). Using the
        engine afterwards raises ValueError; closing twice does nothing. Dropping the last reference frees
        the same, short of emptying torch's cache (the next engine does that before it sizes its KV cache)."""
        if self.runner is None:
            return
        if self.cuda:
            torch.cuda.synchronize()  # a step in flight still reads the cache and writes its tokens
        self.runner.close()
        self.runner = self.scheduler = self.book = self.model = self.tokenizer = self.inflight = self.readback = None
        if self.cuda:
            torch.cuda.empty_cache()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc_info):
        self.close()

    def _check_open(self):
        if self.runner is None:
            raise ValueError("this engine is closed (close() gave its memory back); make a new LLM or Engine")


def request_metrics(req: Request, n: int) -> dict:
    """The request's times (time.perf_counter s), TTFT, and time per output token after the first (n: its tokens)."""
    first, done = req.first_token_time, req.finished_time
    return dict(arrival_time=req.arrival_time, first_scheduled_time=req.first_scheduled_time, first_token_time=first,
                finished_time=done, ttft=None if first is None else first - req.arrival_time,
                tpot=None if first is None or done is None or n < 2 else (done - first) / (n - 1))


def detokenize(tokenizer, req: Request, final: bool = False) -> str:
    """Append to req.text what its new tokens add, and return it. Decoded incrementally, as vLLM: the tokens decoded
    last are decoded again with the new ones, for context, and the new text is the difference; while it ends in an
    incomplete UTF-8 sequence ("\ufffd": a character whose bytes span tokens) it is held back, unless final."""
    ids, start = req.output_token_ids, req.prefix_offset
    before = tokenizer.decode(ids[start:req.read_offset], skip_special_tokens=True)
    after = tokenizer.decode(ids[start:], skip_special_tokens=True)
    if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
        return ""
    req.prefix_offset, req.read_offset = req.read_offset, len(ids)
    req.text += after[len(before):]
    return after[len(before):]


def load_tokenizer(folder: str | None):
    if folder is None or not os.path.exists(os.path.join(folder, "tokenizer.json")):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:  # optional: without it, prompts must be token ids
        return None
    return Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))


class LLM:
    """vLLM's offline API: LLM(model=...).generate(prompts, sampling_params) -> outputs in input order."""

    def __init__(self, model: str = "tiny", **settings):
        self.engine = Engine(EngineConfig(model=model, **settings))

    def generate(self, prompts, sampling_params=None) -> list[RequestOutput]:
        """prompts: one prompt (text, or a list of token ids) or a list of them; sampling_params: one
        SamplingParams for all, a list with one per prompt, or None for the defaults. Every prompt is
        checked before any is queued, so a bad one raises (naming it) and leaves the engine as it was."""
        prompts = prompt_list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(prompts)} "
                                 "prompts; give one, or one per prompt")
            params = [check_params(f"sampling_params[{i}]", p) for i, p in enumerate(sampling_params)]
        else:
            params = [check_params("sampling_params", sampling_params)] * len(prompts)
        engine, checked = self.engine, []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                checked.append(engine._check(prompt, p, None))
            except (TypeError, ValueError) as e:
                raise type(e)(f"prompts[{i}]: {e}") from None
        # one output per prompt, as vLLM's LLM asks for
        ids = [engine._add(tokens, replace(p, output_kind="final_only")) for tokens, p in checked]
        done = {}
        step = engine.step_async if engine.cfg.async_scheduling else engine.step
        while engine.has_unfinished():
            done.update((o.request_id, o) for o in step())
        return [done[rid] for rid in ids]

    def close(self):
        self.engine.close()

    __enter__, __exit__ = Engine.__enter__, Engine.__exit__  # `with LLM(...) as llm:` closes it on the way out


def prompt_list(prompts) -> list:
    """LLM.generate's prompts as a list of prompts: a single one (text, or token ids) becomes a list of one."""
    if isinstance(prompts, (np.ndarray, torch.Tensor)):
        prompts = prompts.tolist()
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts={prompts!r:.80} has type {type(prompts).__name__}: give a prompt (a string or a "
                        "list of token ids) or a list of prompts")
    if prompts and not isinstance(prompts[0], (str, list, tuple, np.ndarray, torch.Tensor)):
        return [prompts]  # one prompt of ids (tokenize says if they are not all integers)
    return list(prompts)


def check_params(name: str, params) -> SamplingParams:
    """A request's SamplingParams: None means the defaults; anything else is a TypeError."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise TypeError(f"{name}={params!r:.80} has type {type(params).__name__}: give a SamplingParams, or None "
                        "for the defaults")
    return params


class StepStats:
    """Where a step's time goes (run.py's benchmarks read it). host = all but the forward + sampler launch and the
    wait for tokens (scheduling, batch building, bookkeeping). With `timing` on (off by default) each step's time is
    kept by kind (prompt tokens or decode only): CUDA events' device time on CUDA, the forward's wall time on CPU."""

    def __init__(self, cuda: bool):
        self.cuda, self.timing = cuda, False
        self.reset()

    def reset(self):
        self.steps = self.tokens = 0
        self.total_s = self.forward_s = self.wait_s = 0.0
        self.events = []  # (start, end, has prompt tokens): CUDA events, or perf_counter times

    @property
    def host_s(self) -> float:
        return self.total_s - self.forward_s - self.wait_s

    def now(self):
        if self.timing and self.cuda:
            return torch.cuda.current_stream().record_event(torch.cuda.Event(enable_timing=True))
        return time.perf_counter() if self.timing else None

    def end(self, start, prompt: bool):
        if start is not None:
            self.events.append((start, self.now(), prompt))

    def step_seconds(self) -> list[tuple[float, bool]]:
        """(seconds, has prompt tokens) of each timed step."""
        if self.cuda and self.events:
            self.events[-1][1].synchronize()
        return [(a.elapsed_time(b) / 1e3 if self.cuda else b - a, prompt) for a, b, prompt in self.events]

    def gpu_seconds(self) -> float:
        return sum(s for s, _ in self.step_seconds())


# ----------------------------------------------------------------------------------------------------------
# Configuration and weights: the settings, the model's shape, a checkpoint folder or a preset's random weights
# EngineConfig's annotations -> what its fields may hold (scheduler.KINDS): see EngineConfig._check_types
SETTING_KINDS = {str: "str", int: "int", float: "number", bool: "bool", tuple: "ints"}
EMBED_STD, LOGIT_STD = 0.02, 6.0  # random preset weights: see init_random

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")

# Built-in models: Hugging Face config.json dicts, so presets and checkpoint folders take the same path.
# Their weights are random (seeded) and made directly on the device: nothing is downloaded.
_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
              max_position_embeddings=40960, eos_token_id=151645)
_LLAMA3 = dict(architectures=["LlamaForCausalLM"], num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
               rms_norm_eps=1e-5, rope_theta=500000.0)
# Small enough that `run.py overhead` takes seconds on a laptop CPU, big enough to have every part.
_TINY = dict(_QWEN3, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
             intermediate_size=512, vocab_size=4096, max_position_embeddings=2048, eos_token_id=4095)
PRESETS = {
    "tiny": _TINY,
    "tiny-moe": dict(_TINY, architectures=["Qwen3MoeForCausalLM"], moe_intermediate_size=128, num_experts=8,
                     num_experts_per_tok=2, norm_topk_prob=True),
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936),
    "llama-3.2-1b": dict(_LLAMA3, hidden_size=2048, num_hidden_layers=16, head_dim=64, intermediate_size=8192,
                         tie_word_embeddings=True, max_position_embeddings=131072,
                         eos_token_id=[128001, 128008, 128009],
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
    "llama-3-8b": dict(_LLAMA3, hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                       tie_word_embeddings=False, max_position_embeddings=8192, eos_token_id=128001),
    "qwen3-30b-a3b": dict(_QWEN3, architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          vocab_size=151936, tie_word_embeddings=False),
}


# config.json fields of the four architectures (transformers 4.x and 5.x) that do not change what the model computes
# at inference: training settings, ids only the tokenizer uses, the checkpoint's storage dtype (EngineConfig.dtype
# decides), pretraining_tp (a split of the same matmuls), and window sizes only use_sliding_window turns on. Every
# other field of those configs is honoured by ModelConfig.from_hf, or refused where its value changes the math.
INERT_FIELDS = ("initializer_range", "use_cache", "attention_dropout", "bos_token_id", "pad_token_id", "torch_dtype",
                "dtype", "pretraining_tp", "output_router_logits", "router_aux_loss_coef", "sliding_window",
                "max_window_layers", "model_type", "transformers_version")
# Fields whose other values change the math in a way nanoengine does not run: {field: the values it runs (a list:
# each entry)}. swish is SiLU (transformers' ACT2FN); a sliding window is a different attention.
RUNS_ONLY = {"hidden_act": ("silu", "swish"), "mlp_bias": (False,), "use_sliding_window": (False,),
             "layer_types": ("full_attention",)}

# config.json fields that transformers 5.x writes under another name: {4.x name: 5.x name} (Qwen3-MoE's
# attribute_map). 5.x also moved rope_theta and rope_scaling into one rope_parameters dict.
V5_NAMES = {"num_experts": "num_local_experts"}


def v4_names(cfg: dict) -> dict:
    """A config.json dict with transformers 4.x's names, whichever version wrote it: the one place that
    reads 5.x's layout. Where a file has both names, the 4.x one wins."""
    cfg = dict(cfg)
    for old, new in V5_NAMES.items():
        if cfg.get(old) is None and new in cfg:
            cfg[old] = cfg[new]
    rope = dict(cfg.get("rope_parameters") or {})  # 5.x: rope_theta, rope_type and the scaling's fields
    theta = rope.pop("rope_theta", None)
    if cfg.get("rope_theta") is None and theta is not None:
        cfg["rope_theta"] = theta
    if not cfg.get("rope_scaling") and rope:
        cfg["rope_scaling"] = rope  # rope_type "default" means none, as in 4.x
    return cfg


def refuse_other_math(cfg: dict, where: str):
    """A ValueError naming the field and its value where the config asks for math nanoengine does not run."""
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise ValueError(f"{where}: quantization_config (quant_method={method!r}) is not supported; "
                         "nanoengine loads unquantized float16/bfloat16/float32 weights only")
    for key, runs in RUNS_ONLY.items():
        value = cfg.get(key)
        if value is not None and any(v not in runs for v in (value if isinstance(value, list) else [value])):
            raise ValueError(f"{where}: {key}={value!r:.120} is not supported; nanoengine runs "
                             f"{' or '.join(map(repr, runs))}" + (" in each entry" if isinstance(value, list) else ""))


@dataclass
class ModelConfig:
    """The model's shape, read from a Hugging Face config.json (transformers 4.x or 5.x layout): every field of the
    four architectures' configs is honoured, refused (refuse_other_math, rope types) or inert (INERT_FIELDS)."""
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple
    qkv_bias: bool = False          # Qwen2 (and attention_bias=True)
    o_bias: bool = False            # attention_bias=True puts a bias on o_proj too (not Qwen2)
    qk_norm: bool = False           # Qwen3: RMSNorm on each head of q and k
    num_experts: int = 0            # Qwen3-MoE
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()

    @classmethod
    def from_hf(cls, cfg: dict, where: str = "config.json") -> "ModelConfig":
        cfg = v4_names(cfg)
        arch = (cfg.get("architectures") or [None])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"{where}: architectures={cfg.get('architectures')} is not supported; "
                             f"nanoengine runs {', '.join(ARCHITECTURES)}")
        moe = arch == "Qwen3MoeForCausalLM"
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")
        for key in required + (("num_experts", "num_experts_per_tok", "moe_intermediate_size") if moe else ()):
            also = f" (transformers 5.x: '{V5_NAMES[key]}')" if key in V5_NAMES else ""
            if cfg.get(key) is None:
                raise ValueError(f"{where}: required field '{key}'{also} is missing")
            if not is_int(cfg[key]) or cfg[key] < 1:
                raise ValueError(f"{where}: {key}={cfg[key]!r} is invalid: it must be an integer >= 1")
        refuse_other_math(cfg, where)
        scaling = cfg.get("rope_scaling") or None
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in ("default", "llama3"):
                raise ValueError(f"{where}: rope_scaling type {kind!r} is not supported; "
                                 "nanoengine supports 'default' and 'llama3'")
            scaling = None if kind == "default" else scaling
        heads, eos, bias = cfg["num_attention_heads"], cfg.get("eos_token_id"), bool(cfg.get("attention_bias", False))
        # absent: transformers' default, which for Qwen3 is 128, not hidden_size / heads
        head_dim = cfg.get("head_dim") or (128 if arch == "Qwen3ForCausalLM" else cfg["hidden_size"] // heads)
        return cls(
            architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], head_dim=head_dim,
            num_layers=cfg["num_hidden_layers"], num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            intermediate_size=cfg["intermediate_size"], rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta") or 10000.0), rope_scaling=scaling, qk_norm=arch.startswith("Qwen3"),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            qkv_bias=arch == "Qwen2ForCausalLM" or bias, o_bias=arch != "Qwen2ForCausalLM" and bias,
            num_experts=cfg["num_experts"] if moe else 0, num_experts_per_tok=cfg.get("num_experts_per_tok", 0),
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()))

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0


@dataclass
class EngineConfig:
    """Engine settings. Every default is stated here once."""
    model: str = "tiny"                  # a preset name or a checkpoint folder
    dtype: str | None = None             # None: float32 on the CPU, bfloat16 on CUDA
    device: str | None = None            # None: cuda if available
    seed: int = 0                        # random preset weights, and requests without their own seed
    block_size: int = 16                 # tokens per KV block: small enough to waste little, big enough to gather
    num_blocks: int | None = None        # None: from CPU_KV_BYTES on the CPU, gpu_memory_utilization on CUDA
    gpu_memory_utilization: float = 0.9  # share of the GPU's memory the engine may hold (weights + KV + graphs)
    max_num_seqs: int = 256              # requests in one batch; also the largest decode graph bucket
    max_num_batched_tokens: int = 2048   # tokens in one step: long prompts are chunked to this
    max_model_len: int | None = None     # None: the model's max_position_embeddings, capped at 8192
    fuse: bool = True                    # fused weights + the kernels (Triton on CUDA, torch references on the CPU)
    triton: bool | None = None           # None: Triton kernels on CUDA; True runs them on the CPU interpreter too
    tuned: bool | str | tuple = False    # Part 2's variants: none (the chapter), all (True), or some by name (TUNED)
    triton_linear_rows: int | None = None  # tuned linear: matmuls up to this many rows in Triton (None: by the model)
    triton_narrow_rows: int | None = None  # ... and narrow ones up to this many, if more (None: by the model)
    enforce_eager: bool | None = None    # None: CUDA graphs on CUDA (fused Triton model), eager on the CPU
    cudagraph_mode: str = "full"         # graphs for decode and prompt steps; "full_decode_only": decode only
    graph_buckets: tuple | None = None   # decode buckets; None: graphs.default_buckets(max_num_seqs)
    graph_token_buckets: tuple | None = None  # prompt buckets; None: graphs.default_token_buckets(...)
    async_scheduling: bool = False       # LLM.generate plans step s+1 while step s runs
    tensor_parallel_size: int = 1        # processes (ranks), each with 1/N of the weights: Part 3

    def __post_init__(self):
        self._check_types()
        require(self.block_size >= 1 and not self.block_size & (self.block_size - 1), "block_size",
                self.block_size, "a power of two")
        require(self.num_blocks is None or self.num_blocks >= 1, "num_blocks", self.num_blocks, "None or >= 1")
        require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", self.gpu_memory_utilization,
                "in (0, 1]")
        for name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            require(getattr(self, name) >= 1, name, getattr(self, name), ">= 1")
        require(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", self.max_model_len,
                "None (the model's) or >= 2: a prompt token and one generated")
        require(SEED_RANGE[0] <= self.seed < SEED_RANGE[1], "seed", self.seed, "an integer in [-2**63, 2**63)")
        for name in ("graph_buckets", "graph_token_buckets"):
            sizes = getattr(self, name)
            require(sizes is None or (len(sizes) > 0 and min(sizes) >= 1), name, sizes, "None or sizes >= 1")
        require(self.cudagraph_mode in ("full", "full_decode_only"), "cudagraph_mode", self.cudagraph_mode,
                "'full' or 'full_decode_only'")
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            device = torch.device(self.device)
        except RuntimeError:  # not a device name at all
            device = None
        require(device is not None and device.type in ("cpu", "cuda"), "device", self.device,
                "'cpu', 'cuda' or 'cuda:N'")
        cuda = device.type == "cuda"
        if cuda and (device.index or 0) + self.tensor_parallel_size > torch.cuda.device_count():
            raise ValueError(f"device={self.device!r} with tensor_parallel_size={self.tensor_parallel_size} (rank r "
                             f"on the r-th GPU from it) but torch sees {torch.cuda.device_count()} CUDA devices; "
                             "use device='cpu', a lower index or fewer ranks")
        if self.dtype is None:
            self.dtype = "bfloat16" if cuda else "float32"
        require(self.dtype in ("float32", "bfloat16", "float16"), "dtype", self.dtype,
                "'float32', 'bfloat16' or 'float16'")
        self.triton = cuda if self.triton is None else self.triton
        self.tuned = tuned_variants(self.tuned) if self.fuse else frozenset()
        if tensor_parallel(self):  # steady keeps staged rows from step to step: other ranks could not follow
            self.tuned -= {"steady"}
        for name in ("triton_linear_rows", "triton_narrow_rows"):
            rows, limit = getattr(self, name), kernels.LINEAR_MAX_M
            require(rows is None or 0 <= rows <= limit, name, rows, f"None or in [0, {limit}]")
        if self.enforce_eager is None:  # graphs need CUDA and a forward that never syncs (fused Triton)
            self.enforce_eager = not (cuda and self.fuse and self.triton)

    def _check_types(self):
        """A TypeError for a setting of the wrong type, before any value is looked at: each field holds the type
        its annotation says (a float any number, a tuple any list of integers), or None where that is its default."""
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        if isinstance(self.dtype, torch.dtype):
            self.dtype = str(self.dtype).removeprefix("torch.")
        for f in fields(self):
            annotated = [t for t in typing.get_args(f.type) or (f.type,) if t is not type(None)]
            if len(annotated) == 1:  # `tuned` may be several types: tuned_variants checks it
                check_type(f.name, getattr(self, f.name), SETTING_KINDS[annotated[0]], optional=f.default is None)


# The tuned path's variants, each a switch of EngineConfig.tuned (Part 2, below; BENCHMARKS.md: what each buys)
TUNED = {
    "gemv": "kernels.linear for decode-sized matmuls, add_rmsnorm in its prologue, silu_and_mul in its epilogue",
    "pdl": "programmatic dependent launch for every Triton kernel (Hopper)",
    "decode_attention": "kernels.decode_attention: RoPE + KV write inside, split-KV, packed kv heads",
    "prefill_attention": "kernels.prefill_attention for paged_attention: GQA query tiles, the causal work balanced",
    "moe_decode": "kernels.fused_moe_decode up to 4 tokens",
    "moe_route": "kernels.moe_route instead of torch's five routing ops",
    "sampler": "kernels.race_sample instead of the torch race",
    "steady": "the steady-decode host path (scheduler.SteadyDecode, DecodeRows)",
}


def tuned_variants(tuned) -> frozenset:
    """True: every variant; False: none; "a,b": those; "-a,-b": all but those."""
    if not isinstance(tuned, (bool, str, tuple, list, set, frozenset)):
        raise TypeError(f"tuned={tuned!r:.80} has type {type(tuned).__name__}: it must be True, False, or variant "
                        f"names (a string 'a,b' or a list) from {', '.join(TUNED)}")
    if tuned is True or tuned is False:
        return frozenset(TUNED) if tuned else frozenset()
    names = [n.strip() for n in tuned.split(",") if n.strip()] if isinstance(tuned, str) else list(tuned)
    bad = [n for n in names if n.lstrip("-") not in TUNED]
    if bad or (names and len({n.startswith("-") for n in names}) > 1):
        raise ValueError(f"tuned={tuned!r} is invalid: give True, False, or names from {', '.join(TUNED)} "
                         "(all with a leading '-' for all but those)")
    if names and names[0].startswith("-"):
        return frozenset(TUNED) - {n[1:] for n in names}
    return frozenset(names)


def tensor_parallel(cfg: EngineConfig) -> bool:
    """Whether Part 3 runs: the one place that says so (a test runs it with one rank, in a group of one)."""
    return cfg.tensor_parallel_size > 1


def read_model_config(model: str) -> tuple[dict, str | None]:
    """(config dict, checkpoint folder or None for a preset)."""
    if model in PRESETS:
        return dict(PRESETS[model]), None
    if not os.path.isdir(model):
        raise ValueError(f"model={model!r} is neither a folder nor a preset; presets: {', '.join(PRESETS)}")
    try:
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"model={model!r}: cannot read config.json ({e})") from None
    gen_path = os.path.join(model, "generation_config.json")
    if os.path.exists(gen_path):  # its eos ids win, as in transformers' generate
        with open(gen_path) as f:
            gen = json.load(f)
        if gen.get("eos_token_id") is not None:
            cfg["eos_token_id"] = gen["eos_token_id"]
    return cfg, model


def checkpoint_files(folder: str) -> list[str]:
    single = os.path.join(folder, "model.safetensors")
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"model={folder!r}: model.safetensors.index.json is unreadable or has no "
                             f"weight_map ({type(e).__name__}: {e})") from None
        return [os.path.join(folder, s) for s in shards]
    if os.path.exists(single):
        return [single]
    raise ValueError(f"model={folder!r}: no model.safetensors or model.safetensors.index.json in the folder")


def load_weights(model: Model, folder: str):
    """Copy each checkpoint tensor into the parameter of the same name, one shard at a time."""
    from safetensors import SafetensorError, safe_open
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = set(params) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    for path in checkpoint_files(folder):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if name.endswith("rotary_emb.inv_freq"):  # old checkpoints saved a derived buffer
                        continue
                    if name not in params:
                        raise ValueError(f"model={folder!r}: tensor {name!r} in {os.path.basename(path)} matches "
                                         "no parameter (quantized or unsupported weights?)")
                    t, p = f.get_tensor(name), params[name]
                    if t.shape != p.shape:
                        raise ValueError(f"model={folder!r}: tensor {name!r} has shape {tuple(t.shape)}, "
                                         f"config.json implies {tuple(p.shape)}")
                    p.data.copy_(t)
                    missing.discard(name)
        except (SafetensorError, OSError) as e:  # truncated, corrupt, or missing: say which file
            raise ValueError(f"model={folder!r}: {os.path.basename(path)} is not a readable safetensors file "
                             f"({e}); is it truncated or corrupt? Download it again") from None
    if missing:
        raise ValueError(f"model={folder!r}: the checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[0]!r}")


@torch.no_grad()
def init_random(model: Model, seed: int):
    """Deterministic random weights made on the model's device. Embeddings are small (std 0.02, as HF initialises
    them): with big ones a tied model's residual stream is its input token and greedy decoding just repeats it.
    The final norm then scales the hidden state so that logits spread with std ~LOGIT_STD: no near-tie greedy picks."""
    gen = torch.Generator(device=model.lm_head.weight.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("bias") or "embed_tokens" in name or "lm_head" in name:  # biases small too
            p.normal_(0.0, EMBED_STD, generator=gen)
        else:  # a linear (or stacked experts): std 1/sqrt(fan_in) keeps activations O(1)
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    model.model.norm.weight.fill_(LOGIT_STD / (EMBED_STD * model.config.hidden_size ** 0.5))


def build_model(cfg: EngineConfig) -> tuple[Model, str | None]:
    """The model on cfg.device in cfg.dtype, weights loaded or random, fused, ops chosen; and its folder or None."""
    hf, folder = read_model_config(cfg.model)
    mcfg = ModelConfig.from_hf(hf, where=f"model={cfg.model!r} config")
    layer_type = TunedDecoderLayer if cfg.tuned & {"gemv", "decode_attention"} else DecoderLayer
    max_len = max_model_len(cfg, mcfg)  # checked before Part 3 starts any process
    group = TPGroup.start(cfg, mcfg) if tensor_parallel(cfg) else None  # Part 3: this rank's place
    with torch.device("meta"):  # no memory and no init until the real device is known
        model = Model(mcfg, layer_type) if group is None else TPModel(mcfg, layer_type, group)
    model = model.to(getattr(torch, cfg.dtype)).to_empty(device=cfg.device)
    if mcfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if folder is None:
        init_random(model, cfg.seed)
    else:
        load_weights(model, folder)
    if group is not None:
        model.shard()
    model.cos_sin = rope_cos_sin(mcfg, max_len, cfg.device)
    if cfg.fuse:
        model.fuse()
        model.ops = textbook_ops(cfg.triton)
        if cfg.tuned:  # Part 2 attaches here: its ops and (TunedDecoderLayer, above) its layers
            model.ops = tuned_ops(model.ops, cfg, mcfg)
        model.graph_safe = cfg.triton  # every op a sync-free Triton launch
    if group is not None:
        model.ops = tp_ops(model.ops)
    # No autograd: the fused weights are new Parameters, and entering inference_mode each step costs host time.
    return model.eval().requires_grad_(False), folder


def engine_parts(cfg: EngineConfig) -> SimpleNamespace:
    """The classes an Engine is built from: the chapter's, Part 2's where cfg.tuned names them, or Part 3's."""
    steady, tp = "steady" in cfg.tuned, tensor_parallel(cfg)
    return SimpleNamespace(book=SteadyBook if steady else RequestBook,
                           scheduler=SteadyScheduler if steady else Scheduler,
                           inputs=TPInputBuilder if tp else SteadyInputBuilder if steady else InputBuilder,
                           runner=TPRunner if tp else ModelRunner,
                           graphs=BoundedGraphRunner if "decode_attention" in cfg.tuned else GraphRunner)


def max_model_len(cfg: EngineConfig, mcfg: ModelConfig) -> int:
    # 8192: a long context for a teaching engine, and it keeps block tables and graph buffers small.
    n = cfg.max_model_len or min(mcfg.max_position_embeddings, 8192)
    if n > mcfg.max_position_embeddings:
        raise ValueError(f"max_model_len={n} exceeds the model's max_position_embeddings="
                         f"{mcfg.max_position_embeddings}")
    return n


# ----------------------------------------------------------------------------------------------------------
# Part 2: the tuned path. Each variant is a switch (EngineConfig.tuned) with a row in BENCHMARKS.md.
from scheduler import SteadyBook, SteadyScheduler  # noqa: E402 (Part 2's, imported where it starts)

def tuned_ops(ops: SimpleNamespace, cfg: EngineConfig, mcfg: ModelConfig) -> SimpleNamespace:
    """Swap the variants named in cfg.tuned into the textbook ops, and add the ops TunedDecoderLayer calls.
    Without Triton (the CPU) each variant is its reference, which computes what the textbook ops do, so the
    tuned forward's structure is tested."""
    v, triton = cfg.tuned, cfg.triton
    pdl = triton and "pdl" in v and kernels.has_pdl(torch.device(cfg.device))
    if pdl:  # Part 1's kernels that the tuned forward still calls, in the chain too (kernels 2.1)
        ops.add_rmsnorm, ops.silu_and_mul = (partial(getattr(kernels, f"{op}_pdl"), pdl=True)
                                             for op in ("add_rmsnorm", "silu_and_mul"))
    ops.add_rmsnorm_linear = partial(add_rmsnorm_then_linear, ops)  # Part 1's kernels, one after the other
    ops.decode_attention, ops.decode_context_bounds = None, no_context_bounds
    if "gemv" in v:
        # Triton streams a one-row matmul faster than cuBLAS on every model; up to 64 rows (256 on narrow
        # matrices, where cuBLAS splits K) only on small models (BENCHMARKS.md).
        cuda, small = cfg.device.startswith("cuda") and triton, mcfg.hidden_size <= 1024
        rows = cfg.triton_linear_rows if cfg.triton_linear_rows is not None else (64 if small else 1) * cuda
        narrow = cfg.triton_narrow_rows if cfg.triton_narrow_rows is not None else \
            kernels.LINEAR_MAX_M * (cuda and small and cfg.triton_linear_rows is None)
        if triton:
            ops.linear = partial(kernels.linear, max_rows=rows, narrow_rows=narrow, pdl=pdl)
        ops.add_rmsnorm_linear = partial(kernels.add_rmsnorm_linear, max_rows=rows, narrow_rows=narrow, pdl=pdl) \
            if triton else kernels.add_rmsnorm_linear_ref
    for variant, op in dict(decode_attention="decode_attention", moe_route="moe_route", sampler="race_sample").items():
        if variant in v:  # the kernel of the op's name, or its reference
            setattr(ops, op, partial(getattr(kernels, op), pdl=pdl) if triton else getattr(kernels, op + "_ref"))
    if "decode_attention" in v and triton:
        ops.decode_context_bounds = kernels.decode_context_bounds
    if "prefill_attention" in v and triton:  # without Triton, paged_attention_ref stays: the same math
        ops.paged_attention = partial(kernels.prefill_attention, pdl=pdl, min_tokens=kernels.PREFILL_MIN_TOKENS)
    if "moe_decode" in v:
        ops.fused_moe = partial(kernels.fused_moe_tuned, pdl=pdl) if triton else kernels.fused_moe_ref
    return ops


def no_context_bounds(b: int, hkv: int) -> tuple:
    """Context bounds of an attention whose tiles never depend on the contexts: none."""
    return ()


def add_rmsnorm_then_linear(ops, x, residual, norm_weight, eps, weight, bias=None, gated=False):
    """add_rmsnorm_linear's contract in Part 1's ops, one after the other (the tuned path without gemv)."""
    h, residual = ops.add_rmsnorm(x, residual, norm_weight, eps)
    y = ops.linear(h, weight, bias)
    return (ops.silu_and_mul(y) if gated else y), residual


class TunedDecoderLayer(DecoderLayer):
    """DecoderLayer on the tuned path: each add + RMSNorm runs in the matmul after it (add_rmsnorm_linear, kernels
    2.2), silu(gate) * up in the gate/up matmul's stores, and a decode's RoPE, KV write and attention in one (2.3)."""

    def forward(self, x, residual, batch, k_cache, v_cache, cos_sin, ops):
        attn, mlp, eps = self.self_attn, self.mlp, self.eps
        qkv, residual = ops.add_rmsnorm_linear(x, residual, self.input_layernorm.weight, eps, attn.qkv_proj.weight,
                                               attn.qkv_proj.bias)
        if ops.decode_attention and batch.max_query_len == 1 and qkv.shape[0] == batch.seq_lens.shape[0]:
            q, k, v = attn.heads(qkv)
            o = ops.decode_attention(q, k, v, k_cache, v_cache, batch.slot_mapping, batch.positions, batch.seq_lens,
                                     batch.block_table, cos_sin, attn.scale, *attn.norms(), attn.eps,
                                     max_seq_len=batch.max_seq_len)
            x = ops.linear(o.view(qkv.shape[0], -1), attn.o_proj.weight, attn.o_proj.bias)
        else:
            x = attn(qkv, batch, k_cache, v_cache, cos_sin, ops)
        if isinstance(mlp, MoE):  # the router and the experts both read the normed x
            h, residual = ops.add_rmsnorm(x, residual, self.post_attention_layernorm.weight, eps)
            return mlp(h, ops), residual
        h, residual = ops.add_rmsnorm_linear(x, residual, self.post_attention_layernorm.weight, eps,
                                             mlp.gate_up_proj.weight, gated=True)
        return ops.linear(h, mlp.down_proj.weight), residual


class BoundedGraphRunner(GraphRunner):
    """GraphRunner for decode_attention, whose tiles depend on how long the contexts are (it packs kv heads while
    all are short): each decode bucket has a graph per side of each bound; a step replays the one its longest allows."""

    def context_bounds(self, b: int) -> tuple:
        """Bucket b's context bounds: the kernel's, then any context the block table holds."""
        return (*self.model.ops.decode_context_bounds(b, self.kv_cache.shape[4]), self.max_seq_len)

    def keys(self) -> list[tuple]:
        keys = []
        for key in super().keys():
            keys += [(*key, bound) for bound in self.context_bounds(key[1])] if key[0] == "decode" else [key]
        return keys

    def key_for(self, batch: Batch) -> tuple | None:
        key = super().key_for(batch)
        if key is None or key[0] != "decode":
            return key
        return (*key, next(bound for bound in self.context_bounds(key[1]) if batch.max_seq_len <= bound))

    def decode_batch(self, key: tuple) -> Batch:
        return replace(super().decode_batch(key), max_seq_len=key[2])


@dataclass(eq=False)
class DecodeRows:
    """A decode batch kept from step to step while the running set is unchanged (scheduler.SteadyDecode): each
    request moves on by one token (its position, KV slot and sequence length +1); the rest is staged once."""
    steady: object                 # the SteadyDecode these rows follow
    step: int                      # the scheduler step the arrays hold
    rows: np.ndarray               # (n,) each request's persistent row
    ints64: np.ndarray             # (3, n): positions, slot_mapping, counters (= the sequence lengths)
    named: dict                    # ints64's rows as views, by name: staged as they are (the CPU reuses them)
    max_seq_len: int               # the counters' max, moved on with them
    block_table: np.ndarray        # (n, width) int32: the columns this step's longest request needs
    query_start_loc: torch.Tensor  # (n + 1,) int32 on the device: 0, 1, ..., n
    logits_indices: torch.Tensor   # (n,) int64 on the device: every row samples
    sampling: SamplingBatch        # its counters are replaced each step


class SteadyInputBuilder(InputBuilder):
    """InputBuilder whose steady-decode steps are last step's batch one token on (DecodeRows), with last
    step's sampled tokens as inputs straight from the device: a few numpy operations at any batch size."""
    decode: DecodeRows | None = None  # the steady decode's rows, built on its first step (_prepare_formed)
    prev_steady = None  # the SteadyDecode of the last step's plan, if it had one

    def rows(self, plan) -> np.ndarray:
        """Also the blocks a standing SteadyDecode handed out (`entered`), in order: its requests get them later."""
        rows = super().rows(plan)
        if plan.steady is not None:
            for due, blocks in plan.steady.entered:
                r = rows[due]
                self.table[r, self.row_nblocks[r]] = blocks
                self.row_nblocks[r] += 1
        return rows

    def sampled(self, plan, tokens, sampling):
        super().sampled(plan, tokens, sampling)
        self.prev_steady = plan.steady

    def prepare(self, plan) -> tuple[Batch, SamplingBatch, tuple]:
        if plan.steady is None:
            return super().prepare(plan)
        if plan.requests is self.prev_sampling:
            return self._prepare_steady(plan, None)
        prev = self.prev_steady  # kept: where some of its requests left since, the rest's indices in its output
        kept = None if prev is None or self.prev_sampling is not prev.requests else plan.steady.kept_of(prev)
        return self._prepare_formed(plan) if kept is None else self._prepare_steady(plan, kept)

    def _prepare_steady(self, plan, kept: np.ndarray | None) -> tuple[Batch, SamplingBatch, tuple]:
        """A decode of last step's requests, or of those still running (last step's indices `kept`)."""
        d = self.decode
        assert d is not None and d.steady is (plan.steady if kept is None else self.prev_steady) and \
            d.step == plan.step - 1, f"step {plan.step}: the decode rows do not follow last step's set"
        if kept is not None:
            self._condense(d, plan, kept)
        self._advance(d, plan)
        if kept is None:
            t = self.staging.to_device(dict(d.named, block_table=d.block_table))
            return self._rows_batch(d, self.prev_tokens, t), d.sampling, plan.requests
        t = self.staging.to_device(dict(d.named, block_table=d.block_table, kept=kept))
        sp, k = d.sampling, t.kept  # the sampling settings of the rows that stay, gathered on the device
        d.sampling = replace(sp, temperature=sp.temperature[k], top_k=sp.top_k[k], top_p=sp.top_p[k],
                             seeds=sp.seeds[k], all_greedy=not self.temperature[d.rows].any(),
                             need_filter=bool(self.filtered[d.rows].any()))
        return self._rows_batch(d, self.prev_tokens[k], t), d.sampling, plan.requests

    def _prepare_formed(self, plan) -> tuple[Batch, SamplingBatch, tuple]:
        """The first step of a steady decode: its rows are built now, so the next step only advances them.
        Its inputs are the requests' last tokens, or where one is in flight (async), last step's output."""
        d = self.decode = self._decode_rows(plan)
        ids = np.array([r.token_ids[-1] for r in plan.requests], dtype=np.int64)
        fills = self._placeholders(plan, ids, np.arange(len(ids) + 1))
        t = self.staging.to_device(dict(d.named, input_ids=ids, block_table=d.block_table, **fills))
        if len(fills["fill_at"]):
            t.input_ids[t.fill_at] = self.prev_tokens[t.fill_from]
        return self._rows_batch(d, t.input_ids, t), d.sampling, plan.requests

    @staticmethod
    def _rows_batch(d: DecodeRows, input_ids, t: SimpleNamespace) -> Batch:
        """The Batch of a steady decode's rows; its counters (= the sequence lengths) are the sampler's too."""
        d.sampling.counters = t.counters
        return Batch(input_ids=input_ids, positions=t.positions, slot_mapping=t.slot_mapping,
                     query_start_loc=d.query_start_loc, seq_lens=t.counters, block_table=t.block_table,
                     logits_indices=d.logits_indices, max_query_len=1, max_seq_len=d.max_seq_len)

    def _decode_rows(self, plan) -> DecodeRows:
        """The decode batch of plan's requests; what stays the same while they run together is staged now."""
        pos, rows, n = plan.starts, self.rows(plan), len(plan.requests)
        temperature = self.temperature[rows]
        t = self.staging.to_device(dict(seeds=self.seed[rows], top_k=self.top_k[rows], temperature=temperature,
                                        top_p=self.top_p[rows], logits_indices=np.arange(n, dtype=np.int64),
                                        query_start_loc=np.arange(n + 1, dtype=np.int32)))
        sampling = SamplingBatch(temperature=t.temperature, top_k=t.top_k, top_p=t.top_p, seeds=t.seeds, counters=None,
                                 all_greedy=not temperature.any(), need_filter=bool(self.filtered[rows].any()))
        ints64, max_seq_len = np.stack([pos, self._kv_slots(rows, pos), pos + 1]), int(pos.max()) + 1
        return DecodeRows(steady=plan.steady, step=plan.step, rows=rows, ints64=ints64, named=self._named(ints64),
                          max_seq_len=max_seq_len, block_table=self._block_table(rows, max_seq_len),
                          query_start_loc=t.query_start_loc, logits_indices=t.logits_indices, sampling=sampling)

    @staticmethod
    def _named(ints64: np.ndarray) -> dict:
        return dict(zip(("positions", "slot_mapping", "counters"), ints64))

    def _condense(self, d: DecodeRows, plan, kept: np.ndarray):
        """Some requests left since last step: keep the rows of those that stay, in order."""
        # C order, as np.stack made it: each of its rows is then one array, staged as it is (named)
        d.steady, d.rows, d.ints64 = plan.steady, d.rows[kept], np.ascontiguousarray(d.ints64[:, kept])
        d.named, d.max_seq_len = self._named(d.ints64), int(d.ints64[2].max())
        d.block_table = self._block_table(d.rows, d.max_seq_len)
        d.query_start_loc, d.logits_indices = d.query_start_loc[:len(kept) + 1], d.logits_indices[:len(kept)]

    def _advance(self, d: DecodeRows, plan):
        """Every request one token on; one whose token starts a block (`entering`) takes its slot and column there."""
        d.ints64 += 1  # positions, slots and counters in one operation
        d.max_seq_len, d.step = d.max_seq_len + 1, plan.step
        entering, blocks = plan.entering
        if len(entering):
            rows, cols = d.rows[entering], d.ints64[0, entering] // self.block_size
            self.table[rows, cols] = blocks
            self.row_nblocks[rows] = cols + 1
            d.ints64[1, entering] = blocks * self.block_size
            if cdiv(d.max_seq_len, self.block_size) == d.block_table.shape[1]:
                d.block_table[entering, cols] = blocks  # in place: on the CPU the array keeps its staged view
            else:  # the longest request has entered a new block: one more column
                d.block_table = self._block_table(d.rows, d.max_seq_len)


# ----------------------------------------------------------------------------------------------------------
# Part 3: tensor parallel (EngineConfig.tensor_parallel_size). Each rank is a process with a share of every
# weight, running the same forward; rank 0 is the engine's own process (API, scheduler) and sends each step's
# inputs to the others. Every rank samples the same tokens: they all hold the same gathered logits, and the
# sampler is a pure function of (seed, token index, id); so a rank's async placeholders are its own tokens.
import contextlib  # noqa: E402 (Part 3's imports, where it starts)
import multiprocessing.connection  # noqa: E402
import socket  # noqa: E402
import traceback  # noqa: E402
import weakref  # noqa: E402

import torch.distributed as dist  # noqa: E402

TP_HOST = "127.0.0.1"  # every socket of the group listens on loopback: nothing outside the machine can join
TP_GLOO = "nanoengine_gloo"  # gloo on TP_HOST (plain gloo listens wherever the hostname resolves)
TP_HEADER = 1 + 2 * len(staged_bounds(1, 1, 1)) + 5  # a step's header: stop, each array's shape, host_inputs' 5 scalars
TP_WAIT_S = 5.0  # how long a rank is waited for (to stop, or to report its error) before it is killed


class TPGroup:
    """This process's place among the ranks (on rank 0, also the others' processes and error pipes). close() (a
    second call does nothing) or the last reference stops every rank and leaves the group: nothing outlives it."""

    def __init__(self, cfg: EngineConfig, rank: int):
        self.rank, self.size, self.procs, self.errors, self.failed = rank, cfg.tensor_parallel_size, [], [], None
        self.state = SimpleNamespace(serving=False)  # True once the other ranks wait for step headers
        self.close = weakref.finalize(self, stop_ranks, self.procs, self.errors, self.state)

    @classmethod
    def start(cls, cfg: EngineConfig, mcfg: ModelConfig) -> "TPGroup":
        """A worker's place (tp_worker has joined the group), or rank 0's: it starts the others and joins them."""
        n, kv = cfg.tensor_parallel_size, mcfg.num_kv_heads
        require(kv % n == 0 or n % kv == 0, "tensor_parallel_size", n, f"a divisor or a multiple of "
                f"num_key_value_heads={kv} (model={cfg.model!r}): each rank gets its kv heads, or a copy of one")
        for name, size in dict(num_attention_heads=mcfg.num_heads, intermediate_size=mcfg.intermediate_size,
                               moe_intermediate_size=mcfg.moe_intermediate_size, vocab_size=mcfg.vocab_size).items():
            require(size % n == 0, "tensor_parallel_size", n, f"a divisor of {name}={size} (model={cfg.model!r})")
        if dist.is_initialized():
            require(dist.get_rank() > 0, "tensor_parallel_size", n, "1 in a process that is in a torch.distributed "
                    "group already (close() the engine that made it)")
            return cls(cfg, dist.get_rank())
        group, listener = cls(cfg, 0), socket.create_server((TP_HOST, 0))  # port 0: a free one, picked now
        store = dist.TCPStore(TP_HOST, listener.getsockname()[1], n, is_master=True, wait_for_workers=False,
                              master_listen_fd=listener.detach())  # the store owns the socket, and closes it
        spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: a forked one could not use CUDA
        for rank in range(1, n):
            errors, sender = spawn.Pipe(duplex=False)
            group.procs.append(spawn.Process(target=tp_worker, args=(cfg, rank, store.port, sender), daemon=True))
            group.procs[-1].start()
            sender.close()  # the worker's end: once it exits, ours reads as closed
            group.errors.append(errors)
        while not store.check([f"rank{r}" for r in range(1, n)]):  # one that fails to start is reported
            group.check(wait=0.01)
        join_group(cfg, 0, store)
        return group

    def check(self, wait: float = 0.0, cause: Exception | None = None):
        """Raise one clear error, and stop every rank, if a rank has failed: its pipe holds its traceback, or
        reads as closed (it exited); `wait` s for one to, as a collective that raised (`cause`) means one is."""
        if self.failed is None:
            ready = multiprocessing.connection.wait(self.errors, timeout=wait)
            if not ready and cause is None:
                return
            self.failed = f"rank 0 raised {cause!r}"
            if ready:
                rank = self.errors.index(ready[0]) + 1
                proc = self.procs[rank - 1]
                try:
                    self.failed = f"rank {rank} (pid {proc.pid}) raised:\n{ready[0].recv()}"
                except EOFError:  # it ended without a word: killed, or crashed below Python
                    proc.join(TP_WAIT_S)
                    self.failed = f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
            self.failed = f"tensor parallel: {self.failed}\nEvery rank is stopped: close() this engine, make a new one."
            self.state.serving = False  # the ranks are out of step: signals stop them, not a header
            self.close()
        raise RuntimeError(self.failed) from cause

    @contextlib.contextmanager
    def watch(self):
        """Collectives inside: a rank that failed before is reported first, one that fails meanwhile (gloo
        raises when a peer is gone) by its own error; any other error stops every rank too."""
        self.check()
        try:
            yield
        except RuntimeError as e:
            self.check(TP_WAIT_S, e)
        except BaseException:
            self.state.serving = False
            self.close()
            raise


def join_group(cfg: EngineConfig, rank: int, store):
    """Join the default process group: gloo on loopback for host tensors (the step headers), NCCL for CUDA ones."""
    def loopback_gloo(store, rank: int, size: int, timeout):
        options = dist.ProcessGroupGloo._Options()
        options._devices, options._timeout = [dist.ProcessGroupGloo.create_device(hostname=TP_HOST)], timeout
        return dist.ProcessGroupGloo(store, rank, size, options)
    if TP_GLOO not in dist.Backend.backend_list:
        dist.Backend.register_backend(TP_GLOO, loopback_gloo, devices=["cpu"])
    backend = f"cpu:{TP_GLOO},cuda:nccl" if cfg.device.startswith("cuda") else TP_GLOO
    dist.init_process_group(backend, store=store, rank=rank, world_size=cfg.tensor_parallel_size)


def stop_ranks(procs: list, errors: list, state: SimpleNamespace):
    """TPGroup's end: the other ranks stopped (a stop header where they wait for one, else a signal), then the
    group left. A function of the group's parts, not of the group: weakref.finalize calls it once it is gone."""
    if procs and state.serving:
        with contextlib.suppress(RuntimeError):  # a rank is gone already: the signals below stop the rest
            dist.broadcast(torch.tensor([1] + [0] * (TP_HEADER - 1)), 0)
    for proc in procs:
        if not state.serving:
            proc.terminate()
        proc.join(TP_WAIT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for pipe in errors:
        pipe.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def tp_worker(cfg: EngineConfig, rank: int, port: int, errors):
    """A rank other than 0, in its own process: join rank 0's group, build the same engine on this rank's share
    (the same collectives, in the same order), and run rank 0's steps until it says stop; an error goes to rank 0."""
    try:
        if cfg.device.startswith("cuda"):  # rank r on the r-th GPU from the engine's
            cfg = replace(cfg, device=f"cuda:{(torch.device(cfg.device).index or 0) + rank}")
            torch.cuda.set_device(cfg.device)
        torch.set_num_threads(max(1, torch.get_num_threads() // cfg.tensor_parallel_size))  # the CPU's cores, shared
        store = dist.TCPStore(TP_HOST, port, cfg.tensor_parallel_size)
        store.set(f"rank{rank}", "up")
        join_group(cfg, rank, store)
        engine = Engine(cfg)
        engine.runner.serve()
    except BaseException:  # KeyboardInterrupt too: rank 0 must hear of it
        errors.send(traceback.format_exc())
        sys.exit(1)


class VocabEmbedding(nn.Embedding):
    """A rank's rows of the embedding: other ids look up zeros, and the first add_rmsnorm's all-reduce sums them."""

    def __init__(self, weight: torch.Tensor, start: int):
        super().__init__(*weight.shape, _weight=weight)
        self.start = start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_embeddings)
        return F.embedding(local * mine, self.weight) * mine[:, None]  # (T, hidden)


class TPModel(Model):
    """A rank's Model. After shard(), its config is the rank's shape: its heads and kv heads (they size its KV
    cache), and the whole vocabulary, as its logits are gathered whole."""

    def __init__(self, cfg: ModelConfig, layer_type: type, group: TPGroup):
        super().__init__(cfg, layer_type)
        self.group = group

    def shard(self):
        """Keep this rank's share of every weight, before fusion (the fused [q; k; v] and [gate; up] are then
        this rank's): q, k and v by heads (where ranks outnumber kv heads, each goes to size / kv of them),
        gate and up by rows of the intermediate (the MLP's, each expert's), o_proj and down_proj by columns
        (their outputs are partial sums: the next add_rmsnorm's all-reduce adds them), the vocabulary."""
        cfg, r, n = self.config, self.group.rank, self.group.size
        h, kv, d = cfg.num_heads // n, max(cfg.num_kv_heads // n, 1), cfg.head_dim
        for layer in self.model.layers:
            attn, kv0 = layer.self_attn, r * cfg.num_kv_heads // n  # this rank's first kv head
            for proj, first, heads in ((attn.q_proj, r * h, h), (attn.k_proj, kv0, kv), (attn.v_proj, kv0, kv)):
                self.keep(proj, 0, first * d, heads * d)
            self.keep(attn.o_proj, 1, r * h * d, h * d, bias=r == 0)
            attn.H, attn.Hkv = h, kv
            for mlp in getattr(layer.mlp, "experts", [layer.mlp]):
                i = mlp.down_proj.weight.shape[1] // n
                for proj, dim in ((mlp.gate_proj, 0), (mlp.up_proj, 0), (mlp.down_proj, 1)):
                    self.keep(proj, dim, r * i, i)
        v = cfg.vocab_size // n
        self.model.embed_tokens = VocabEmbedding(self.model.embed_tokens.weight[r * v:(r + 1) * v].clone(), r * v)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.keep(self.lm_head, 0, r * v, v)
        self.config = replace(cfg, num_heads=h, num_kv_heads=kv)

    @staticmethod
    def keep(linear: nn.Linear, dim: int, start: int, length: int, bias: bool = True):
        """Keep rows (dim 0, the bias's too) or columns (dim 1: the bias is added once, after the sum, where bias)."""
        linear.weight = nn.Parameter(linear.weight.narrow(dim, start, length).clone())
        if linear.bias is not None and (dim == 0 or not bias):
            linear.bias = nn.Parameter(linear.bias.narrow(0, start, length).clone()) if dim == 0 else None

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(S, vocab): this rank's columns (its rows of lm_head), gathered from every rank (into out if given)."""
        local = super().compute_logits(hidden)  # (S, vocab / size)
        parts = local.new_empty(self.group.size, *local.shape)
        dist.all_gather(list(parts.unbind(0)), local)  # (size, S, vocab / size)
        out = local.new_empty(local.shape[0], self.config.vocab_size) if out is None else out
        out.view(local.shape[0], self.group.size, local.shape[1]).copy_(parts.transpose(0, 1))
        return out


def tp_ops(ops: SimpleNamespace) -> SimpleNamespace:
    """ops whose add_rmsnorm and add_rmsnorm_linear sum x over the ranks first (the embedding, or an o_proj, MLP or
    MoE output: a partial sum). A new namespace: add_rmsnorm_then_linear keeps the old add_rmsnorm, summing once."""
    def all_reduced(op, x: torch.Tensor, *args, **kwargs):
        dist.all_reduce(x)
        return op(x, *args, **kwargs)
    new = SimpleNamespace(**vars(ops))
    for name in {"add_rmsnorm", "add_rmsnorm_linear"} & vars(ops).keys():
        setattr(new, name, partial(all_reduced, getattr(ops, name)))
    return new


class TPStaging(Staging):
    """Staging among the ranks, with no Python object pickled: rank 0 broadcasts a header of int64s (stop, each
    array's shape, the host scalars) over gloo, then each packed per-dtype buffer after its copy to the device;
    the others stage arrays of those shapes the same way, and the buffers land in their own (receive)."""

    def __init__(self, device: torch.device, bounds: dict[str, tuple[str, int]]):
        super().__init__(device, bounds, packed=True)
        self.bounds = bounds  # its names' order is the packing order on every rank

    def to_device(self, arrays: dict[str, np.ndarray], scalars: tuple) -> SimpleNamespace:
        arrays = {name: arrays[name] for name in self.bounds}
        assert all(a.dtype == np.dtype(self.bounds[k][0]) for k, a in arrays.items()), "an array's dtype changed"
        shapes = [n for a in arrays.values() for n in (*a.shape, -1)[:2]]  # -1: a one-dimensional array's
        dist.broadcast(torch.tensor([0, *shapes, *scalars]), 0)
        return super().to_device(arrays)

    def on_device(self, packed: torch.Tensor) -> torch.Tensor:
        dev = super().on_device(packed)
        dist.broadcast(dev, 0)  # on the other ranks, rank 0's buffer lands in this one
        return dev

    def receive(self) -> list | None:
        """A step's tensors and host scalars from rank 0 (device_inputs' arguments), or None when it says stop."""
        header = torch.empty(TP_HEADER, dtype=torch.int64)
        dist.broadcast(header, 0)
        stop, *header = header.tolist()
        if stop:
            return None
        arrays = {name: np.empty([n for n in header[2 * i:2 * i + 2] if n >= 0], dtype)
                  for i, (name, (dtype, _)) in enumerate(self.bounds.items())}
        return [Staging.to_device(self, arrays), *header[2 * len(self.bounds):]]  # Staging's: no header to send


class TPInputBuilder(InputBuilder):
    """Rank 0's sends each step's inputs to the others (TPStaging), whose device_inputs build the same batch."""
    staging_type = TPStaging

    def prepare(self, plan) -> tuple[Batch, SamplingBatch, tuple]:
        host, scalars, sampling = self.host_inputs(plan)
        return (*self.device_inputs(self.staging.to_device(host, scalars), *scalars), sampling)


class TPRunner(ModelRunner):
    """A rank's ModelRunner: the same KV cache and graphs on every rank, captured in the same order (their
    collectives pair up). Rank 0's steps are watched for a failed rank; the others serve() until told to stop."""

    def __init__(self, model: TPModel, cfg: EngineConfig, num_blocks: int, *args):
        with model.group.watch():
            blocks = torch.tensor([num_blocks, -num_blocks], device=cfg.device)
            dist.all_reduce(blocks, dist.ReduceOp.MIN)  # the fewest, and minus the most
            fewest, most = blocks[0].item(), -blocks[1].item()
            if fewest != most:  # rank 0 could hand out a block another rank lacks
                raise ValueError(f"the ranks sized their KV caches from {fewest} to {most} blocks (the GPUs' free "
                                 "memory differs): give num_blocks")
            super().__init__(model, cfg, num_blocks, *args)
        model.group.state.serving = True

    def execute(self, plan) -> torch.Tensor:
        with self.model.group.watch():
            return super().execute(plan)

    def serve(self):
        while (step := self.inputs.staging.receive()) is not None:
            self.inputs.sampled(None, self.forward_and_sample(*self.inputs.device_inputs(*step)), ())

    def close(self):
        if self.model is not None:
            self.model.group.close()
        super().close()
