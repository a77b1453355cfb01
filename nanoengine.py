"""nanoengine: the model, its weights, the paged KV cache, the model runner and the engine.

    from nanoengine import LLM, SamplingParams
    llm = LLM(model="tiny")                       # a preset, or a Hugging Face checkpoint folder
    outs = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=32))

The engine knows only token ids; a tokenizer (optional) turns text into ids at the edges.
It imports kernels.py (Triton kernels and their torch references), scheduler.py (requests, blocks,
batching) and graphs.py (CUDA graphs per batch bucket). run.py is the command line.

The forward pass never reads a batch value back to the host: every per-step value is a tensor in a
`Batch`, and the only host-side numbers (`max_query_len`, the tensor sizes) are ones a CUDA graph can fix.
"""
import gc
import json
import math
import os
import random
import time
import typing
from dataclasses import dataclass, fields
from functools import partial
from types import SimpleNamespace

import numpy as np
import torch
import torch._dynamo  # noqa: F401 (see build_model)
import torch.nn.functional as F
from torch import nn

import kernels
from graphs import GraphRunner
from scheduler import (FINISHED, PLACEHOLDER, RUNNING, SEED_RANGE, Request, SamplingParams, Scheduler, check_type,
                       is_int, require)

__all__ = ["LLM", "SamplingParams", "Engine", "EngineConfig", "ModelConfig", "RequestOutput"]

# EngineConfig's annotations -> what its fields may hold (scheduler.KINDS): see EngineConfig._check_types
SETTING_KINDS = {str: "str", int: "int", float: "number", bool: "bool", tuple: "ints"}
EMBED_STD, LOGIT_STD = 0.02, 6.0  # random preset weights: see init_random
CPU_KV_BYTES = 512 << 20          # KV cache on the CPU: 16k blocks for `tiny`, modest for real shapes
CUDA_HEADROOM_BYTES = 4 << 30     # kept free on CUDA for activations, logits and graphs
STAGING_ALIGN_BYTES = 16          # staged tensors start 16-byte aligned: see aligned_offsets

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")

# Built-in models: Hugging Face config.json dicts, so presets and checkpoint folders take the same path.
# Their weights are random (seeded) and made directly on the device: nothing is downloaded.
_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
              max_position_embeddings=40960, eos_token_id=151645)
PRESETS = {
    # Small enough that `run.py overhead` takes seconds on a laptop CPU, big enough to have every part.
    "tiny": dict(_QWEN3, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=32, intermediate_size=512, vocab_size=4096, max_position_embeddings=2048,
                 eos_token_id=4095),
    "tiny-moe": dict(_QWEN3, architectures=["Qwen3MoeForCausalLM"], hidden_size=256, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=32, intermediate_size=512,
                     moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                     vocab_size=4096, max_position_embeddings=2048, eos_token_id=4095),
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936),
    "llama-3.2-1b": dict(architectures=["LlamaForCausalLM"], hidden_size=2048, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, intermediate_size=8192,
                         vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192),
                         max_position_embeddings=131072, eos_token_id=[128001, 128008, 128009]),
    "llama-3-8b": dict(architectures=["LlamaForCausalLM"], hidden_size=4096, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                       vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                       max_position_embeddings=8192, eos_token_id=128001),
    "qwen3-30b-a3b": dict(_QWEN3, architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936,
                          tie_word_embeddings=False),
}


# ----------------------------------------------------------------------------------------------------------
# Configuration


# config.json fields that transformers 5.x writes under another name: {4.x name: 5.x name}. From 5.x's
# configuration_llama.py, _qwen2.py, _qwen3.py and _qwen3_moe.py (whose attribute_map stores num_experts
# as num_local_experts) and configuration_utils.py. 5.x also moved rope_theta and rope_scaling into one
# rope_parameters dict, and renamed torch_dtype to dtype, which nanoengine does not read.
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


@dataclass
class ModelConfig:
    """The model's shape, read from a Hugging Face config.json (transformers 4.x or 5.x layout)."""
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
        if cfg.get("quantization_config"):
            method = cfg["quantization_config"].get("quant_method", "?")
            raise ValueError(f"{where}: quantization_config (quant_method={method!r}) is not supported; "
                             "nanoengine loads unquantized float16/bfloat16/float32 weights only")
        if cfg.get("use_sliding_window"):
            raise ValueError(f"{where}: use_sliding_window=True is not supported; only full attention is")
        scaling = cfg.get("rope_scaling") or None
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in ("default", "llama3"):
                raise ValueError(f"{where}: rope_scaling type {kind!r} is not supported; "
                                 "nanoengine supports 'default' and 'llama3'")
            scaling = None if kind == "default" else scaling
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"], rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta") or 10000.0), rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            o_bias=arch != "Qwen2ForCausalLM" and bool(cfg.get("attention_bias", False)),
            qk_norm=arch.startswith("Qwen3"),
            num_experts=cfg["num_experts"] if moe else 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0),
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()))

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)


@dataclass
class EngineConfig:
    """Engine settings. Every default is stated here once."""
    model: str = "tiny"                  # a preset name or a checkpoint folder
    dtype: str | None = None             # None: float32 on the CPU, bfloat16 on CUDA
    device: str | None = None            # None: cuda if available
    seed: int = 0                        # random preset weights, and requests without their own seed
    block_size: int = 16                 # tokens per KV block: small enough to waste little, big enough to gather
    num_blocks: int | None = None        # None: from CPU_KV_BYTES on the CPU, gpu_memory_utilization on CUDA
    gpu_memory_utilization: float = 0.9  # share of the GPU's memory the engine may hold (weights + KV)
    max_num_seqs: int = 256              # requests in one batch; also the largest graph bucket
    max_num_batched_tokens: int = 2048   # tokens in one step: long prompts are chunked to this
    max_model_len: int | None = None     # None: the model's max_position_embeddings, capped at 8192
    fuse: bool = True                    # fused weights + kernels (Triton on CUDA, torch references on the CPU)
    triton: bool | None = None           # None: Triton kernels on CUDA; True runs them on the CPU interpreter too
    triton_linear_rows: int | None = None  # matmuls of up to this many rows in Triton, not cuBLAS (None: by
                                           # the model, see build_model)
    triton_narrow_rows: int | None = None  # ... and narrow ones (kernels.LINEAR_NARROW_N outputs or fewer) up
                                           # to this many, if more (None: by the model; 0 when
                                           # triton_linear_rows is given)
    enforce_eager: bool | None = None    # None: CUDA graphs on CUDA (fused model), eager on the CPU
    graph_buckets: tuple | None = None   # None: graphs.default_buckets(max_num_seqs)
    async_scheduling: bool = False       # LLM.generate plans step s+1 while step s runs

    def __post_init__(self):
        self._check_types()
        require(self.block_size >= 1 and not self.block_size & (self.block_size - 1), "block_size",
                self.block_size, "a power of two")
        require(self.num_blocks is None or self.num_blocks >= 1, "num_blocks", self.num_blocks, "None or >= 1")
        require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", self.gpu_memory_utilization,
                "in (0, 1]")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            require(getattr(self, name) >= 1, name, getattr(self, name), ">= 1")
        require(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", self.max_model_len,
                "None (the model's) or >= 2: a prompt token and one generated")
        require(SEED_RANGE[0] <= self.seed < SEED_RANGE[1], "seed", self.seed, "an integer in [-2**63, 2**63)")
        require(self.graph_buckets is None or (len(self.graph_buckets) > 0 and min(self.graph_buckets) >= 1),
                "graph_buckets", self.graph_buckets, "None or batch sizes >= 1")
        self._pick_device()
        if self.dtype is None:
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        require(self.dtype in ("float32", "bfloat16", "float16"), "dtype", self.dtype,
                "'float32', 'bfloat16' or 'float16'")
        if self.triton is None:
            self.triton = self.device.startswith("cuda")
        for name in ("triton_linear_rows", "triton_narrow_rows"):
            rows = getattr(self, name)
            if rows is None and not (self.device.startswith("cuda") and self.triton):
                setattr(self, name, 0)  # the CPU: torch's matmul (the interpreter would only be slower)
            else:
                require(rows is None or 0 <= rows <= kernels.LINEAR_MAX_M, name, rows,
                        f"in [0, {kernels.LINEAR_MAX_M}]")
        if self.enforce_eager is None:  # graphs need CUDA and a forward that never syncs (fused Triton)
            self.enforce_eager = not (self.device.startswith("cuda") and self.fuse and self.triton)

    def _check_types(self):
        """A TypeError for a setting of the wrong type, before any value is looked at: each field holds the
        type its annotation says (a float any number, a tuple any list of integers), or None where that is
        its default. A path may also be a pathlib.Path, and dtype a torch.dtype."""
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        if isinstance(self.dtype, torch.dtype):
            self.dtype = str(self.dtype).removeprefix("torch.")
        for f in fields(self):
            annotated = [t for t in typing.get_args(f.type) or (f.type,) if t is not type(None)][0]
            check_type(f.name, getattr(self, f.name), SETTING_KINDS[annotated], optional=f.default is None)

    def _pick_device(self):
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            device = torch.device(self.device)
        except RuntimeError:  # not a device name at all
            device = None
        require(device is not None and device.type in ("cpu", "cuda"), "device", self.device,
                "'cpu', 'cuda' or 'cuda:N'")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} but torch sees no CUDA device; use device='cpu'")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"device={self.device!r} but torch sees {torch.cuda.device_count()} CUDA devices")


# ----------------------------------------------------------------------------------------------------------
# The model. Parameter names are the checkpoint's, so loading is a dictionary lookup.

OPS = ("rmsnorm", "add_rmsnorm", "moe_route", "fused_moe", "rope_write_kv", "paged_attention",
       "decode_attention", "race_sample")


def make_ops(triton: bool, triton_linear_rows: int = 0, triton_narrow_rows: int = 0) -> SimpleNamespace:
    """The kernels the forward calls: Triton launchers, or their plain-torch references (same arguments).
    `linear` is cuBLAS (F.linear), except that matmuls of up to triton_linear_rows rows run a Triton kernel
    that streams the weights at closer to full bandwidth than cuBLAS manages for so few rows, and narrow
    ones (kernels.LINEAR_NARROW_N outputs or fewer) up to triton_narrow_rows if that is more (the defaults
    by model size are in build_model)."""
    ops = {name: getattr(kernels, name if triton else name + "_ref") for name in OPS}
    # The context lengths at which decode attention changes its tiles (the graph runner's concern)
    ops["decode_context_bounds"] = kernels.decode_context_bounds if triton else lambda b, hkv: ()
    rows = dict(max_rows=triton_linear_rows, narrow_rows=triton_narrow_rows)
    if triton and (triton_linear_rows or triton_narrow_rows):
        ops["linear"] = partial(kernels.linear, **rows)
    else:
        ops["linear"] = F.linear
    # A pre-norm layer's residual add and RMSNorm, made as the next matmul loads its input (one row), and
    # the MLP's silu(gate) * up, made as its gate/up matmul stores the output; with no Triton rows,
    # add_rmsnorm, F.linear and silu_and_mul (the reference: their _ref versions).
    if triton:
        ops["add_rmsnorm_linear"] = partial(kernels.add_rmsnorm_linear, **rows)
    else:
        ops["add_rmsnorm_linear"] = kernels.add_rmsnorm_linear_ref
    return SimpleNamespace(**ops)


def linear(ops, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return ops.linear(x, layer.weight, layer.bias)


def rope_cos_sin(cfg: ModelConfig, max_pos: int, device) -> torch.Tensor:
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


class RMSNorm(nn.Module):
    """Holds the weight; the math is ops.rmsnorm / ops.add_rmsnorm."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.H, self.Hkv, self.D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps, self.scale = cfg.rms_norm_eps, cfg.head_dim ** -0.5
        self.q_proj = nn.Linear(cfg.hidden_size, self.H * self.D, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.Hkv * self.D, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.Hkv * self.D, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.H * self.D, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(self.D), RMSNorm(self.D)

    def fuse(self):
        """One matmul for q, k and v instead of three: fewer launches, one read of x."""
        parts = [self.q_proj, self.k_proj, self.v_proj]
        qkv = nn.Linear(1, 1, bias=parts[0].bias is not None, device="meta")
        qkv.weight = nn.Parameter(torch.cat([p.weight.data for p in parts]))  # ((H + 2 Hkv) D, hidden)
        if qkv.bias is not None:
            qkv.bias = nn.Parameter(torch.cat([p.bias.data for p in parts]))
        self.qkv_proj = qkv
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, batch, k_cache, v_cache, cos_sin, ops):
        """Unfused: three matmuls. Fused, DecoderLayer makes q, k and v in one (with the norm before it)."""
        return self.attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), batch, k_cache, v_cache, cos_sin, ops)

    def attend(self, q, k, v, batch, k_cache, v_cache, cos_sin, ops):
        T, H, Hkv, D = q.shape[0], self.H, self.Hkv, self.D
        q, k, v = q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
        qn = self.q_norm.weight if hasattr(self, "q_norm") else None
        kn = self.k_norm.weight if hasattr(self, "k_norm") else None
        if batch.max_query_len == 1 and T == batch.seq_lens.shape[0]:
            # Decode (one token per request, at position seq_len - 1): up to a batch that fills the GPU,
            # the attention kernel rotates q and k itself and writes k and v to the cache: one launch.
            o = ops.decode_attention(q, k, v, k_cache, v_cache, batch.slot_mapping, batch.positions,
                                     batch.seq_lens, batch.block_table, cos_sin, self.scale, qn, kn, self.eps,
                                     max_seq_len=batch.max_seq_len)
        else:
            # q rotated in place; k rotated into its cache slot, v beside it ((per-head norm), rotary, store)
            ops.rope_write_kv(q, k, v, k_cache, v_cache, batch.slot_mapping, batch.positions, cos_sin, qn, kn,
                              self.eps)
            o = ops.paged_attention(q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens,
                                    batch.block_table, self.scale, batch.max_query_len)  # (T, H, D)
        return linear(ops, self.o_proj, o.view(T, H * D))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def fuse(self):
        self.gate_up_proj = nn.Linear(1, 1, bias=False, device="meta")
        self.gate_up_proj.weight = nn.Parameter(torch.cat([self.gate_proj.weight.data, self.up_proj.weight.data]))
        del self.gate_proj, self.up_proj

    def forward(self, x, ops):
        """Unfused (and a MoE's experts). Fused, DecoderLayer runs gate/up (with the norm before it) and down."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Qwen3-MoE block: a softmax router picks top-k experts per token; their outputs are mixed by weight."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size)
                                     for _ in range(cfg.num_experts))

    def fuse(self):
        """Stack the experts so one grouped-GEMM kernel can reach any of them by index."""
        self.w_gate_up = nn.Parameter(torch.stack(  # (E, 2I, hidden)
            [torch.cat([e.gate_proj.weight.data, e.up_proj.weight.data]) for e in self.experts]))
        self.w_down = nn.Parameter(torch.stack([e.down_proj.weight.data for e in self.experts]))  # (E, hidden, I)
        del self.experts

    def forward(self, x, ops):
        # softmax in float32 as HF does, top k, renormalised if the config says so: (T, k) each
        weights, ids = ops.moe_route(linear(ops, self.gate, x), self.top_k, self.norm_topk_prob)
        if hasattr(self, "w_gate_up"):
            return ops.fused_moe(x, self.w_gate_up, self.w_down, weights, ids)
        # Unfused: one small matmul chain per expert that got tokens (and a host sync per expert to know).
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(ids == e)
            if token.numel():
                out.index_add_(0, token, expert(x[token], ops) * weights[token, slot, None])
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.self_attn = Attention(cfg)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(i) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)

    def forward(self, x, residual, batch, k_cache, v_cache, cos_sin, ops):
        attn, mlp, eps = self.self_attn, self.mlp, self.eps
        if hasattr(attn, "qkv_proj"):
            # Fused: residual += x and the RMSNorm happen as the q/k/v matmul loads its input (one kernel at
            # one row; else add_rmsnorm, then the matmul).
            qkv, residual = ops.add_rmsnorm_linear(x, residual, self.input_layernorm.weight, eps,
                                                   attn.qkv_proj.weight, attn.qkv_proj.bias)
            H, Hkv, D = attn.H, attn.Hkv, attn.D
            x = attn.attend(*qkv.split([H * D, Hkv * D, Hkv * D], dim=-1), batch, k_cache, v_cache, cos_sin, ops)
        else:
            x, residual = add_norm(x, residual, self.input_layernorm.weight, eps, ops)
            x = attn(x, batch, k_cache, v_cache, cos_sin, ops)
        if hasattr(mlp, "gate_up_proj"):  # fused dense MLP: the same for gate/up, with silu * up, then down
            h, residual = ops.add_rmsnorm_linear(x, residual, self.post_attention_layernorm.weight, eps,
                                                 mlp.gate_up_proj.weight, gated=True)
            return ops.linear(h, mlp.down_proj.weight, mlp.down_proj.bias), residual
        x, residual = add_norm(x, residual, self.post_attention_layernorm.weight, eps, ops)
        return mlp(x, ops), residual  # a MoE block reads the normed x twice (router, experts): no fusing


def add_norm(x, residual, weight, eps, ops):
    """Pre-norm residual stream: residual += x, then normalise it. The first layer has no residual yet."""
    if residual is None:
        return ops.rmsnorm(x, weight, eps), x
    return ops.add_rmsnorm(x, residual, weight, eps)


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.ops = make_ops(triton=False)
        self.cos_sin = None  # set by build_model: (max_pos, head_dim) float32 on the model's device
        self.graph_safe = False

    def tie(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def fuse(self, kernels: bool = True, triton: bool = False, triton_linear_rows: int = 0,
             triton_narrow_rows: int = 0):
        """Fuse weights once at load (q/k/v, gate/up, stacked experts); the originals are freed.
        kernels=True also switches to the fused kernels: Triton if triton, else their torch references."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        self.ops = make_ops(triton=triton and kernels, triton_linear_rows=triton_linear_rows,
                            triton_narrow_rows=triton_narrow_rows)
        self.graph_safe = triton and kernels  # every op a sync-free Triton launch: capturable
        self.requires_grad_(False)  # the fused weights are new Parameters (see ModelRunner.execute)
        return self

    def forward(self, batch: "Batch", kv_cache: torch.Tensor) -> torch.Tensor:
        """batch: one step's tokens; kv_cache (2, layers, blocks + 1, block_size, Hkv, D). -> (T, hidden)"""
        x, residual = self.model.embed_tokens(batch.input_ids), None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, batch, kv_cache[0, i], kv_cache[1, i], self.cos_sin, self.ops)
        x, _ = add_norm(x, residual, self.model.norm.weight, self.config.rms_norm_eps, self.ops)
        return x

    def decode_context_bounds(self, b: int) -> tuple[int, ...]:
        """Longest contexts up to which a decode of b requests runs other kernels than past them (see
        kernels.decode_context_bounds): a graph per side of each."""
        return self.ops.decode_context_bounds(b, self.config.num_kv_heads)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # (S, vocab) in the model's dtype. The sampler reads it as float32 in registers: a float32 copy
        # would be one more kernel and, at 256 rows of 151,936, 234 MB more traffic per step.
        return linear(self.ops, self.lm_head, hidden)


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


# ----------------------------------------------------------------------------------------------------------
# Weights: a checkpoint folder, or random weights for a preset


def read_model_config(model: str) -> tuple[dict, str | None]:
    """(config dict, checkpoint folder or None for a preset)."""
    if model in PRESETS:
        return dict(PRESETS[model]), None
    if not os.path.isdir(model):
        raise ValueError(f"model={model!r} is neither a folder nor a preset; presets: {', '.join(PRESETS)}")
    path = os.path.join(model, "config.json")
    try:
        with open(path) as f:
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
    """Deterministic random weights made on the model's device. Linears get std 1/sqrt(fan_in) so
    activations stay O(1). Embeddings are small (std 0.02, as HF initialises them): with big ones a tied
    model's residual stream is its input token and greedy decoding just repeats it. The final norm then
    scales the hidden state so that logits spread with std ~LOGIT_STD: greedy picks are not near-ties."""
    gen = torch.Generator(device=model.lm_head.weight.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.normal_(0.0, 0.02, generator=gen)
        elif "embed_tokens" in name or "lm_head" in name:
            p.normal_(0.0, EMBED_STD, generator=gen)
        else:  # a linear (or stacked experts): std 1/sqrt(fan_in)
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    model.model.norm.weight.fill_(LOGIT_STD / (EMBED_STD * model.config.hidden_size ** 0.5))


def build_model(cfg: EngineConfig) -> tuple[Model, str | None]:
    """The model on cfg.device in cfg.dtype, weights loaded or random. Returns (model, folder or None)."""
    hf, folder = read_model_config(cfg.model)
    mcfg = ModelConfig.from_hf(hf, where=f"model={cfg.model!r} config")
    dtype = getattr(torch, cfg.dtype)
    # On the meta device torch imports torch._dynamo the first time; that import leaves cyclic garbage that
    # holds the frames it ran under, and with them the first Engine of a process, until the cycle
    # collector runs. Imported at the top of this file, it holds nothing of ours.
    with torch.device("meta"):  # no memory and no init until the real device is known
        model = Model(mcfg)
    model = model.to(dtype).to_empty(device=cfg.device)
    model.tie()
    if folder is None:
        init_random(model, cfg.seed)
    else:
        load_weights(model, folder)
    model.cos_sin = rope_cos_sin(mcfg, max_model_len(cfg, mcfg), cfg.device)
    if cfg.triton_narrow_rows is None:
        # On a small model its narrow matrices (q/k/v, o and down on Qwen3-0.6B) take the Triton matmul up to
        # 256 rows, where cuBLAS still loses on them (kernels.LINEAR_NARROW_N); not measured on bigger models'
        # shapes. A triton_linear_rows given alone means what it says: that many rows, for every matmul.
        small = cfg.triton_linear_rows is None and mcfg.hidden_size <= 1024
        cfg.triton_narrow_rows = kernels.LINEAR_MAX_M if small else 0
    if cfg.triton_linear_rows is None:
        # On CUDA the Triton matmul takes one row on every model: it streams a decode matrix faster than
        # cuBLAS (Qwen3-0.6B's matmuls 554 against 962 us a step, H200). Up to 64 rows only on small
        # models: at Qwen3-0.6B's shapes, with 4 pipeline stages, its q/k/v, o, gate/up and down took 19.4-
        # 20.2 us a layer at 64 rows against cuBLAS's 25.7 (each timed as a chain of 28 calls in a CUDA
        # graph: cuBLAS's figure holds the split-K reduction it adds to o and down and a launch gap before
        # each of its kernels, which programmatic dependent launch spares the Triton kernels); at 128-256
        # rows cuBLAS's lm_head is 1.2-1.4x faster, and at Llama-3-8B's shapes cuBLAS is 4-8% faster from
        # 4 rows.
        cfg.triton_linear_rows = 64 if mcfg.hidden_size <= 1024 else 1
    if cfg.fuse:
        model.fuse(kernels=True, triton=cfg.triton, triton_linear_rows=cfg.triton_linear_rows,
                   triton_narrow_rows=cfg.triton_narrow_rows)
    return model.eval().requires_grad_(False), folder  # no autograd: see ModelRunner.execute


def max_model_len(cfg: EngineConfig, mcfg: ModelConfig) -> int:
    # 8192: a long context for a teaching engine, and it keeps block tables and graph buffers small.
    n = cfg.max_model_len or min(mcfg.max_position_embeddings, 8192)
    if n > mcfg.max_position_embeddings:
        raise ValueError(f"max_model_len={n} exceeds the model's max_position_embeddings="
                         f"{mcfg.max_position_embeddings}")
    return n


# ----------------------------------------------------------------------------------------------------------
# One step's batch, and sampling


@dataclass
class Batch:
    """Everything the forward reads about one step, as tensors (no host-side lists the graph can't fix)."""
    input_ids: torch.Tensor        # (T,) int64
    positions: torch.Tensor        # (T,) int64
    slot_mapping: torch.Tensor     # (T,) int64: block * block_size + offset; -1 = padding, goes to scratch
    query_start_loc: torch.Tensor  # (B + 1,) int32: request b's tokens are [qsl[b], qsl[b + 1])
    # int64, not the kernels' usual int32: a steady decode stages its counters as these (DecodeRows), one
    # array fewer to advance per step; the kernels and references load either
    seq_lens: torch.Tensor         # (B,) int64: context length including this step's tokens; 0 = padding
    block_table: torch.Tensor      # (B, max_blocks) int32
    logits_indices: torch.Tensor   # (S,) int64: the rows whose next token is sampled
    max_query_len: int             # host-side bound on tokens per request; sizes the attention grid
    max_seq_len: int               # host-side bound on seq_lens: short contexts take other decode tiles


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
    """(S, vocab) logits (float32 or the model's 16-bit dtype) -> (S,) int64 tokens, on the device, with no
    host sync; the arithmetic is float32 either way.
    Top-k / top-p set the dropped logits to -inf (a sort, only when some request asks for it); then `race`
    (kernels.race_sample or its reference) draws each row from softmax(logits / T) by the exponential race,
    with noise that is a hash of (seed, token index, vocabulary id): a request's tokens never depend on
    its batch. Temperature 0 rows take the argmax; an all-greedy batch skips the noise (the kernel's one
    pass over the logits beat torch's argmax, 28 us at 128K ids and batch 1 on an H200)."""
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
# The model runner: KV cache, batch building, forward (eager or graphed) and sampling


def aligned_offsets(sizes: list[int], itemsize: int) -> tuple[list[int], int]:
    """Where each of several arrays starts when packed into one buffer with every start 16-byte aligned,
    and the total length. Triton compiles a kernel once per pointer alignment it sees: packed tightly,
    the staged tensors' alignment changed with each step's sizes, and a run stalled on recompiles."""
    align = max(1, STAGING_ALIGN_BYTES // itemsize)
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // align) * align
    return offsets, total


class Staging:
    """Host arrays -> device tensors in one copy per dtype. On CUDA the arrays are packed into pinned
    buffers and copied without blocking; two buffers alternate so the host can fill one while the
    other's copy may still be queued behind the step in flight (an event guards the reuse)."""

    def __init__(self, device: torch.device, sizes: dict):
        self.device, self.cuda, self.turn = device, device.type == "cuda", 0
        self.buffers = [{}, {}]
        # CPU: the arrays of the last call and their views. A steady decode stages the same arrays each
        # step, advanced in place, and its views stay valid: making them anew cost ~35 us of a ~150 us step
        # (a tensor's construction, out of the CPU's caches after the forward).
        self.last = [], []
        self.events = [None, None]
        if self.cuda:  # sized up front: allocating pinned memory mid-run can synchronise the device
            for buffers in self.buffers:
                for dtype, n in sizes.items():
                    n += STAGING_ALIGN_BYTES * 16  # alignment padding: under 16 bytes for each of <= 16 arrays
                    buffers[np.dtype(dtype)] = torch.empty(n, dtype=getattr(torch, dtype), pin_memory=True)

    def to_device(self, *groups: list) -> list[list[torch.Tensor]]:
        if not self.cuda:  # zero-copy views of the numpy arrays
            arrays = [a for g in groups for a in g]
            if len(arrays) != len(self.last[0]) or any(a is not b for a, b in zip(arrays, self.last[0])):
                self.last = arrays, [[torch.from_numpy(np.ascontiguousarray(a)) for a in g] for g in groups]
            return self.last[1]
        self.turn ^= 1
        if self.events[self.turn] is not None:
            self.events[self.turn].synchronize()
        result = [self._copy(g) for g in groups]
        self.events[self.turn] = torch.cuda.Event()
        self.events[self.turn].record()
        return result

    def _copy(self, arrays: list) -> list[torch.Tensor]:
        dtype = arrays[0].dtype
        offsets, total = aligned_offsets([a.size for a in arrays], dtype.itemsize)
        buf = self.buffers[self.turn].get(dtype)
        if buf is None or buf.numel() < total:
            buf = torch.empty(max(total, 2 * (0 if buf is None else buf.numel())),
                              dtype=torch.from_numpy(arrays[0][:0]).dtype, pin_memory=self.cuda)
            self.buffers[self.turn][dtype] = buf
        host = buf.numpy()
        for a, o in zip(arrays, offsets):
            host[o:o + a.size] = a.ravel()
        dev = buf[:total].to(self.device, non_blocking=True)  # one copy; the allocator aligns its start
        return [dev[o:o + a.size].view(a.shape) for a, o in zip(arrays, offsets)]


@dataclass(eq=False)
class DecodeRows:
    """A decode batch kept from step to step while the running set is unchanged (the scheduler's
    SteadyDecode), so that a step costs a few numpy operations whatever the batch size.

    From one such step to the next every request moves on by one token: its position, its KV slot and
    its sequence length are all +1, and its sampling settings do not change. So the arrays here are
    advanced in place, and a row whose new token starts a block takes that block from the scheduler.
    The settings, query_start_loc and logits_indices are staged once, when the set forms."""
    steady: object                 # the scheduler's SteadyDecode these rows follow
    step: int                      # the scheduler step the arrays hold
    rows: np.ndarray               # (n,) each request's persistent row
    ints64: np.ndarray             # (3, n): positions, slot_mapping, counters (the sampled token's index,
                                   # which is also the sequence length: staged as both)
    rows64: tuple                  # ints64's three rows, as views: staged as they are, so that on the CPU
                                   # each is one same array every step (Staging reuses its view)
    max_seq_len: int               # the counters' max (the longest context), moved on with them
    block_table: np.ndarray        # (n, width) int32: the columns this step's longest request needs
    query_start_loc: torch.Tensor  # (n + 1,) int32 on the device: 0, 1, ..., n
    logits_indices: torch.Tensor   # (n,) int64 on the device: every row samples
    sampling: "SamplingBatch"      # its counters are replaced each step


class ModelRunner:
    """Owns the KV cache and turns a SchedulerOutput into a Batch, a forward and sampled tokens.

    Host work per step is what limits big batches on a fast GPU, so per-request state lives in
    persistent rows (block table, sampling settings) that change only when a request joins or gets a
    new block. A decode step of an unchanged running set goes further (DecodeRows): last step's batch,
    one token on, with last step's sampled tokens as its inputs, straight from the device."""

    def __init__(self, model: Model, cfg: EngineConfig, num_blocks: int, max_len: int):
        mc = model.config
        self.model, self.cfg, self.device = model, cfg, torch.device(cfg.device)
        self.block_size, self.max_len = cfg.block_size, max_len
        self.max_blocks_per_seq = -(-max_len // cfg.block_size)
        # One extra block at the end: the scratch block. The block manager never hands it out; padding
        # rows (slot -1) write there, so they can never touch a real request's KV.
        self.kv_cache = torch.zeros(2, mc.num_layers, num_blocks + 1, cfg.block_size, mc.num_kv_heads,
                                    mc.head_dim, dtype=model.lm_head.weight.dtype, device=self.device)
        # The last step's sampled tokens and whose they are: PLACEHOLDER inputs are copied from there.
        self.prev_tokens, self.prev_sampling, self._prev_rows = None, [], None
        self.prev_steady = None  # the SteadyDecode of the last step's plan, if it had one
        self.stats = StepStats(cuda=self.device.type == "cuda")
        # Persistent rows, one per live request (running, or preempted and coming back).
        rows = 2 * cfg.max_num_seqs
        self.row_of: dict[Request, int] = {}
        self.free_rows = list(range(rows - 1, -1, -1))
        self.table = np.zeros((rows, self.max_blocks_per_seq), dtype=np.int32)  # block table rows
        self.row_nblocks = np.zeros(rows, dtype=np.int64)  # how many of its blocks are in self.table
        self.temperature = np.zeros(rows, dtype=np.float32)
        self.top_k = np.zeros(rows, dtype=np.int64)
        self.top_p = np.zeros(rows, dtype=np.float32)
        self.seed = np.zeros(rows, dtype=np.int64)
        self.filtered = np.zeros(rows, dtype=bool)  # uses top-k or top-p: the sampler must sort
        self.decode: DecodeRows | None = None
        T, S = cfg.max_num_batched_tokens, cfg.max_num_seqs  # the most tokens and requests in a step
        self.staging = Staging(self.device, {"int64": 6 * T + 5 * S, "int32": S + 1 + S * self.max_blocks_per_seq,
                                             "float32": 2 * S})
        self.graphs = None
        if not cfg.enforce_eager:
            self.graphs = GraphRunner(model, self.kv_cache, self.max_blocks_per_seq,
                                      buckets=cfg.graph_buckets, max_num_seqs=cfg.max_num_seqs,
                                      use_cuda_graphs=self.device.type == "cuda")

    # -- persistent rows ------------------------------------------------------------------------------
    def rows(self, reqs: tuple[Request, ...]) -> np.ndarray:
        """Each request's row, with its block-table row brought up to date (only new blocks are copied).
        A preempted request's row was released (its blocks went back), so it starts afresh."""
        row_of = self.row_of
        rows = [row_of.get(r) for r in reqs]
        if None in rows:
            rows = [self._new_row(r) if i is None else i for r, i in zip(reqs, rows)]
        rows = np.array(rows, dtype=np.int64)
        nblocks = np.array([len(r.block_ids) for r in reqs], dtype=np.int64)
        for i in np.flatnonzero(nblocks != self.row_nblocks[rows]).tolist():
            row, blocks, n0 = rows[i], reqs[i].block_ids, self.row_nblocks[rows[i]]
            self.table[row, n0:len(blocks)] = blocks[n0:]
            self.row_nblocks[row] = len(blocks)
        return rows

    def _rows_of(self, out) -> np.ndarray:
        """rows() of a plan's requests. A standing SteadyDecode holds the blocks it handed out at block
        boundaries (`entered`) until it is dropped, so they are not in block_ids yet: they are appended
        here, in the order they were handed out."""
        rows = self.rows(out.requests)
        if out.steady is not None:
            for due, blocks in out.steady.entered:
                r = rows[due]
                self.table[r, self.row_nblocks[r]] = blocks
                self.row_nblocks[r] += 1
        return rows

    def _new_row(self, req: Request) -> int:
        if not self.free_rows:  # rows of requests not running now (preempted ones re-sync when back)
            for r in [r for r in self.row_of if r.status != RUNNING]:
                self.release(r)
        row = self.free_rows.pop()
        self.row_of[req] = row
        self.row_nblocks[row] = 0
        p = req.params
        self.temperature[row], self.top_p[row], self.seed[row] = p.temperature, p.top_p, req.seed
        vocab = self.model.config.vocab_size
        top_k = p.top_k if 0 < p.top_k < vocab else vocab  # -1, 0 or >= the vocabulary: no limit (as vLLM)
        self.top_k[row], self.filtered[row] = top_k, top_k < vocab or p.top_p < 1
        return row

    def release(self, req: Request):
        row = self.row_of.pop(req, None)
        if row is not None:
            self.free_rows.append(row)

    def close(self):
        """Drop every tensor this runner holds: the KV cache, the graphs (and with them their memory pool),
        the staging buffers, last step's tokens and the model (Engine.close)."""
        self.kv_cache = self.graphs = self.staging = self.decode = self.prev_tokens = self.model = None

    # -- one step's tensors ---------------------------------------------------------------------------
    def prepare(self, out) -> tuple[Batch, SamplingBatch, tuple]:
        """Host lists -> device tensors. Returns the batch, the sampling batch, and the sampling requests."""
        if out.steady is not None:
            kept = None if out.requests is self.prev_sampling else self._kept(out)
            if out.requests is self.prev_sampling or kept is not None:
                return self._prepare_steady(out, kept)
            return self._prepare_formed(out)
        reqs = out.requests
        rows, starts = self._rows_of(out), out.starts
        if out.is_decode:  # one token per request, each at position start: all vectorised
            ids = np.array([r.token_ids[-1] for r in reqs], dtype=np.int64)
            pos, seq_lens = starts, starts + 1
            slots = self._slots(rows, pos)
            qsl = np.arange(len(reqs) + 1, dtype=np.int32)
            sampling, srows, logits_indices, max_query_len = reqs, rows, qsl[:-1].astype(np.int64), 1
            counters = seq_lens
        else:
            ids, pos, slots, qsl, seq_lens, sample = self._prepare_mixed(out, rows, starts)
            sampling = tuple(r for r, s in zip(reqs, out.samples) if s)
            srows, logits_indices = rows[sample], (qsl[1:] - 1)[sample].astype(np.int64)
            max_query_len, counters = int((qsl[1:] - qsl[:-1]).max()), seq_lens[sample]
        # Inputs still on the device (async): PLACEHOLDERs, sampled by the step in flight. Their indices
        # travel in the same pinned copy as the rest; a pageable copy would wait for that step to finish.
        fills = np.flatnonzero(ids == PLACEHOLDER)
        same_rows = out.is_decode and len(fills) == len(reqs) and reqs == self.prev_sampling
        if len(fills) and not same_rows:
            owners = np.searchsorted(qsl, fills, side="right") - 1  # the request of each such token
            src = np.array([self.prev_rows[reqs[b]] for b in owners.tolist()], dtype=np.int64)
        else:
            fills = src = np.zeros(0, dtype=np.int64)
        temperature = self.temperature[srows]
        max_seq_len = int(seq_lens.max())
        ints64, ints32, floats = self.staging.to_device(
            [ids, pos, slots, logits_indices, self.seed[srows], counters, self.top_k[srows], fills, src, seq_lens],
            [qsl, self._block_table(rows, max_seq_len)],
            [temperature, self.top_p[srows]])
        batch = Batch(input_ids=ints64[0], positions=ints64[1], slot_mapping=ints64[2],
                      query_start_loc=ints32[0], seq_lens=ints64[9], block_table=ints32[1],
                      logits_indices=ints64[3], max_query_len=max_query_len, max_seq_len=max_seq_len)
        if same_rows:  # every input is the token the same row sampled last step
            batch.input_ids.copy_(self.prev_tokens)
        elif len(fills):
            batch.input_ids[ints64[7]] = self.prev_tokens[ints64[8]]
        sbatch = SamplingBatch(temperature=floats[0], top_k=ints64[6], top_p=floats[1], seeds=ints64[4],
                               counters=ints64[5], all_greedy=not temperature.any(),
                               need_filter=bool(self.filtered[srows].any()))
        return batch, sbatch, sampling

    def _slots(self, rows: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """(n,) int64 KV slots of the tokens at these positions, one per row."""
        bs = self.block_size
        return self.table[rows, pos // bs].astype(np.int64) * bs + pos % bs

    def _block_table(self, rows: np.ndarray, max_seq_len: int) -> np.ndarray:
        """These rows of the block table, as many columns as the longest request needs. Columns first,
        then rows: numpy's mixed indexing, table[rows, :width], was the slowest line of a boundary step
        at 256 requests on the 2-core CPU, right after a forward (a line profile: ~140 against ~30 us;
        both ~4 us when repeated; interleaved runs found such a step ~25 us faster)."""
        return self.table[:, :self._table_width(max_seq_len)][rows]

    def _table_width(self, max_seq_len: int) -> int:
        """Block-table columns a context of max_seq_len tokens needs."""
        return -(-max_seq_len // self.block_size)

    def _kept(self, out) -> np.ndarray | None:
        """Where some requests of last step's steady decode have left it since (SteadyDecode.without):
        last step's indices of the requests out decodes (their tokens are only in last step's output,
        not yet in token_ids); else None."""
        prev = self.prev_steady
        if prev is None or prev is out.steady or self.prev_sampling is not prev.requests:
            return None
        return out.steady.kept_of(prev)

    def _prepare_steady(self, out, kept: np.ndarray | None) -> tuple[Batch, SamplingBatch, tuple]:
        """A decode of the same requests as last step, or of those of them still running (last step's
        indices `kept`): their inputs are last step's sampled tokens, on the device already, and the
        rest is last step's batch one token on (DecodeRows, built when the set formed: _prepare_formed)."""
        d = self.decode
        last_set = out.steady if kept is None else self.prev_steady
        assert d is not None and d.steady is last_set and d.step == out.step - 1, \
            f"step {out.step}: the decode rows do not follow last step's set (built at step {d and d.step})"
        if kept is None:
            self._advance(d, out)
        else:
            self._condense(d, out, kept)
        (positions, slots, counters, *kept_t), (block_table,) = self.staging.to_device(
            list(d.rows64) + ([] if kept is None else [kept]), [d.block_table])
        input_ids = self.prev_tokens if kept is None else self.prev_tokens[kept_t[0]]
        if kept is not None:  # the sampling settings of the rows that stay, gathered likewise
            sp, rows = d.sampling, d.rows
            d.sampling = SamplingBatch(temperature=sp.temperature[kept_t[0]], top_k=sp.top_k[kept_t[0]],
                                       top_p=sp.top_p[kept_t[0]], seeds=sp.seeds[kept_t[0]], counters=None,
                                       all_greedy=not self.temperature[rows].any(),
                                       need_filter=bool(self.filtered[rows].any()))
        return self._rows_batch(d, input_ids, positions, slots, counters, block_table), d.sampling, out.requests

    def _prepare_formed(self, out) -> tuple[Batch, SamplingBatch, tuple]:
        """The first step of a steady decode (the general path formed it): its rows are built now, so
        that the next step only advances them (a batch built here and rows built again on the next step
        cost ~0.4 ms more at 256 requests). Its inputs are the requests' last tokens, or where one is still
        in flight (async), the token that request's row of last step's output holds."""
        d = self.decode = self._decode_rows(out)
        reqs = out.requests
        ids = np.array([r.token_ids[-1] for r in reqs], dtype=np.int64)
        fills = np.flatnonzero(ids == PLACEHOLDER)
        src = np.array([self.prev_rows[reqs[i]] for i in fills.tolist()], dtype=np.int64)
        (input_ids, fills, src, positions, slots, counters), (block_table,) = self.staging.to_device(
            [ids, fills, src, *d.rows64], [d.block_table])
        if len(fills):
            input_ids[fills] = self.prev_tokens[src]
        return self._rows_batch(d, input_ids, positions, slots, counters, block_table), d.sampling, reqs

    @staticmethod
    def _rows_batch(d: DecodeRows, input_ids, positions, slots, counters, block_table) -> Batch:
        """The Batch of a steady decode's rows, from their staged tensors; the counters (the sampled
        token's index, = the sequence length) are the sampler's too."""
        d.sampling.counters = counters
        return Batch(input_ids=input_ids, positions=positions, slot_mapping=slots,
                     query_start_loc=d.query_start_loc, seq_lens=counters, block_table=block_table,
                     logits_indices=d.logits_indices, max_query_len=1, max_seq_len=d.max_seq_len)

    def _condense(self, d: DecodeRows, out, kept: np.ndarray):
        """Some requests left since last step: the rows of those that stay (kept), in order, then one
        token on (_advance). Their block-table rows are this runner's own, so nothing is rebuilt from
        the requests."""
        n = len(kept)
        # C order, as np.stack made it: each of its rows is then one array, staged as it is (rows64)
        d.steady, d.rows, d.ints64 = out.steady, d.rows[kept], np.ascontiguousarray(d.ints64[:, kept])
        d.rows64, d.max_seq_len = tuple(d.ints64), int(d.ints64[2].max())
        d.block_table = self._block_table(d.rows, d.max_seq_len)
        d.query_start_loc, d.logits_indices = d.query_start_loc[:n + 1], d.logits_indices[:n]
        self._advance(d, out)

    def _decode_rows(self, out) -> DecodeRows:
        """The decode batch of out's requests, from their rows and positions; what stays the same while
        they run together is staged now, once."""
        reqs, pos = out.requests, out.starts
        rows, n = self._rows_of(out), len(reqs)
        temperature = self.temperature[rows]
        (seeds, top_k, logits_indices), (qsl,), (temperature_t, top_p) = self.staging.to_device(
            [self.seed[rows], self.top_k[rows], np.arange(n, dtype=np.int64)],
            [np.arange(n + 1, dtype=np.int32)], [temperature, self.top_p[rows]])
        sampling = SamplingBatch(temperature=temperature_t, top_k=top_k, top_p=top_p, seeds=seeds,
                                 counters=None, all_greedy=not temperature.any(),
                                 need_filter=bool(self.filtered[rows].any()))
        seq_lens = pos + 1
        ints64, max_seq_len = np.stack([pos, self._slots(rows, pos), seq_lens]), int(seq_lens.max())
        return DecodeRows(steady=out.steady, step=out.step, rows=rows, ints64=ints64, rows64=tuple(ints64),
                          max_seq_len=max_seq_len, block_table=self._block_table(rows, max_seq_len),
                          query_start_loc=qsl, logits_indices=logits_indices, sampling=sampling)

    def _advance(self, d: DecodeRows, out):
        """Every request one token on. Those whose new token starts a block (the scheduler's `entering`,
        with that block) take their slot from it: its first, and the block table gains it."""
        d.ints64 += 1  # positions, slots and counters (= sequence lengths) in one operation
        d.max_seq_len += 1
        d.step = out.step
        entering, blocks = out.entering
        if len(entering):
            rows, cols = d.rows[entering], d.ints64[0, entering] // self.block_size
            self.table[rows, cols] = blocks
            self.row_nblocks[rows] = cols + 1
            d.ints64[1, entering] = blocks * self.block_size
            if self._table_width(d.max_seq_len) == d.block_table.shape[1]:
                # In place, as on 2 of every 3 such steps at 256 requests: on the CPU the array keeps its
                # staged view (Staging), and a new one cost ~40 us with the gather, after the forward.
                d.block_table[entering, cols] = blocks
            else:  # the longest request has entered a new block: one more column
                d.block_table = self._block_table(d.rows, d.max_seq_len)

    def _prepare_mixed(self, out, rows, starts):
        """Prompt chunks and decodes together: per-request ranges, so a loop (such steps are rare)."""
        bs, ids, pos = self.block_size, [], []
        for r, s, n in zip(out.requests, out.starts, out.num_tokens):
            ids += r.token_ids[s:s + n]
            pos.append(np.arange(s, s + n))
        ns = np.array(out.num_tokens, dtype=np.int64)
        pos = np.concatenate(pos)
        row_of_token = np.repeat(rows, ns)
        slots = self.table[row_of_token, pos // bs].astype(np.int64) * bs + pos % bs
        qsl = np.concatenate([[0], np.cumsum(ns)]).astype(np.int32)
        return (np.array(ids, dtype=np.int64), pos, slots, qsl, starts + ns,
                np.array(out.samples, dtype=bool))

    def execute(self, out) -> torch.Tensor:
        """Launch one step; returns the sampled tokens (S,) on the device, without waiting for them.
        Not under torch.inference_mode: entering and leaving it cost ~40 us a step on the 2-core CPU, with
        its caches cold after the forward (a fifth of a quiet step's host work at 256 requests). No weight
        requires grad (build_model, Model.fuse), so autograd records nothing anyway."""
        batch, sbatch, sampling = self.prepare(out)
        t0 = time.perf_counter()
        start = self.stats.gpu_start()
        tokens = self.forward_and_sample(out, batch, sbatch)  # its activations are freed on return
        self.stats.gpu_end(start)
        self.stats.forward_s += time.perf_counter() - t0
        self.prev_tokens, self.prev_sampling, self._prev_rows = tokens, sampling, None
        self.prev_steady = out.steady
        return tokens

    def forward_and_sample(self, out, batch: Batch, sbatch: SamplingBatch) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(out):
            logits = self.graphs.run(batch)
        else:
            hidden = self.model(batch, self.kv_cache)
            logits = self.model.compute_logits(hidden[batch.logits_indices])
        return sample(logits, sbatch, self.model.ops.race_sample)

    @property
    def prev_rows(self) -> dict:
        """Request -> its row in the previous step's token tensor (built only when a step needs it)."""
        if self._prev_rows is None:
            self._prev_rows = {r: i for i, r in enumerate(self.prev_sampling)}
        return self._prev_rows


class StepStats:
    """Where a step's time goes. host = everything but the forward + sampler launch and the wait for tokens
    (so: scheduling, batch building, bookkeeping). With gpu_timing on (CUDA, benchmarks only), a pair of
    events per step measures its device time; off by default, so a long-running engine creates none."""

    def __init__(self, cuda: bool):
        self.cuda, self.gpu_timing = cuda, False
        self.reset()

    def reset(self):
        self.steps = self.tokens = 0
        self.total_s = self.forward_s = self.wait_s = 0.0
        self.events = []

    @property
    def host_s(self) -> float:
        return self.total_s - self.forward_s - self.wait_s

    def gpu_start(self):
        if not (self.cuda and self.gpu_timing):
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def gpu_end(self, start):
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events.append((start, end))

    def gpu_seconds(self) -> float:
        if self.events:
            self.events[-1][1].synchronize()
        return sum(a.elapsed_time(b) for a, b in self.events) / 1e3


# ----------------------------------------------------------------------------------------------------------
# The engine and the LLM front end


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    finished: bool = True


class Engine:
    """add_request / abort / step / step_async / has_unfinished, over a scheduler and a model runner."""

    def __init__(self, cfg: EngineConfig | None = None, **settings):
        cfg = cfg or EngineConfig(**settings)
        if not isinstance(cfg, EngineConfig):
            raise TypeError(f"cfg={cfg!r:.80} has type {type(cfg).__name__}: give an EngineConfig, or the "
                            "settings as keywords (Engine(model=...))")
        self.cfg = cfg
        self.model, folder = build_model(cfg)
        self.tokenizer = load_tokenizer(folder)
        mc = self.model.config
        self.max_model_len = max_model_len(cfg, mc)
        num_blocks = cfg.num_blocks or self._blocks_for_memory()
        self.scheduler = Scheduler(num_blocks, cfg.block_size, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   self.max_model_len, mc.eos_token_ids)
        self.runner = ModelRunner(self.model, cfg, num_blocks, self.max_model_len)
        # Finished, aborted or preempted requests give their rows back. The runner's bound method, not a
        # closure over self: nothing refers back to the engine, so dropping it frees it by refcount alone.
        self.scheduler.on_release = self.runner.release
        self.rng = random.Random(cfg.seed)
        self.inflight = None  # async: (placeholder slots, pinned host tokens, event) of the launched step
        self.readback = None  # async on CUDA: two pinned token buffers, alternating
        self.cuda = cfg.device.startswith("cuda")
        self._ids = 0
        self.aborted: list[Request] = []  # aborted since the last step, which returns them

    def _blocks_for_memory(self) -> int:
        """On CUDA, as in vLLM: the KV cache takes gpu_memory_utilization of the GPU's memory less this
        engine's weights and CUDA_HEADROOM_BYTES. That depends on nothing else in the process, so an engine
        made after another was closed or dropped gets as many blocks as the first. Only where less is free
        (another engine or process holds it) is the cache cut to what is."""
        mc = self.model.config
        per_block = 2 * mc.num_layers * self.cfg.block_size * mc.num_kv_heads * mc.head_dim * \
            self.model.lm_head.weight.element_size()
        if not self.cfg.device.startswith("cuda"):
            return max(16, CPU_KV_BYTES // per_block)
        gc.collect()  # a dropped engine that another library's reference cycle still holds lets go now
        torch.cuda.empty_cache()  # dropped engines and the unfused weights left memory in torch's cache
        free, total = torch.cuda.mem_get_info()
        util, weights = self.cfg.gpu_memory_utilization, param_bytes(self.model)
        budget = min(total * util - weights, free) - CUDA_HEADROOM_BYTES
        if budget < per_block:
            raise ValueError(f"gpu_memory_utilization={util} leaves no room for the KV cache: {free / 2**30:.1f} "
                             f"of {total / 2**30:.1f} GiB are free with the weights ({weights / 2**30:.1f} GiB) "
                             "loaded; close() engines you no longer use, raise gpu_memory_utilization or use "
                             "a smaller model")
        return int(budget // per_block)

    # -- life cycle ---------------------------------------------------------------------------------------
    def close(self):
        """Give the engine's memory back now: KV cache, CUDA graphs and their memory pool, staging buffers
        and weights, then torch's cache on CUDA. Using the engine afterwards raises ValueError; closing
        twice does nothing. Dropping the last reference frees the same, short of emptying torch's cache
        (the next engine does that before it sizes its KV cache)."""
        if self.runner is None:
            return
        if self.cuda:
            torch.cuda.synchronize()  # a step in flight still reads the cache and writes its tokens
        self.runner.close()
        self.runner = self.scheduler = self.model = self.tokenizer = None
        self.inflight = self.readback = None
        if self.cuda:
            torch.cuda.empty_cache()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc_info):
        self.close()

    def _check_open(self):
        if self.runner is None:
            raise ValueError("this engine is closed (close() gave its memory back); make a new LLM or Engine")

    # -- requests ---------------------------------------------------------------------------------------
    def tokenize(self, prompt) -> list[int]:
        """A prompt as token ids: text through the model's tokenizer, or a list (tuple, numpy array, 1-D
        tensor) of integer ids taken as they are. Anything else is a TypeError: an id is never rounded."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt is a string but model={self.cfg.model!r} has no tokenizer "
                                 "(it needs tokenizer.json and the optional 'tokenizers' package); "
                                 "pass token ids instead")
            return self.tokenizer.encode(prompt).ids
        if isinstance(prompt, (np.ndarray, torch.Tensor)):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)):
            raise TypeError(f"prompt={prompt!r:.80} has type {type(prompt).__name__}: give a string or a list of "
                            "token ids")
        if not all(type(t) is int for t in prompt):  # one quick pass for the usual case; numpy ints pass too
            bad = next((i for i, t in enumerate(prompt) if not is_int(t)), None)
            if bad is not None:
                raise TypeError(f"prompt[{bad}]={prompt[bad]!r:.80} has type {type(prompt[bad]).__name__}: token "
                                "ids must be integers")
        return [int(t) for t in prompt]

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Validate and queue one request; returns its id. Bad input raises ValueError (or TypeError, for
        a wrong type) naming the argument, its value and what is allowed, and changes nothing."""
        ids, params = self._check(prompt, params, request_id)
        return self._add(ids, params, request_id)

    def _check(self, prompt, params, request_id: str | None) -> tuple[list[int], SamplingParams]:
        """The checks of add_request: (the prompt's ids, the params). Raises on bad input."""
        self._check_open()
        params = check_params("params", params)
        check_type("request_id", request_id, "str", optional=True)
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        ids = self.tokenize(prompt)
        vocab, limit = self.model.config.vocab_size, self.max_model_len
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary: ids must be in [0, {vocab})")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids has {bad[0]}, outside the vocabulary: ids must be in [0, {vocab})")
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len={limit} leaves room for at most "
                             f"{limit - 1}")
        capacity = self.scheduler.blocks.num_blocks * self.cfg.block_size
        need = min(len(ids) + params.max_tokens, limit)
        if need > capacity:
            raise ValueError(f"request needs {need} tokens of KV cache (prompt {len(ids)} + max_tokens "
                             f"{params.max_tokens}) but the whole cache holds {capacity}; lower max_tokens "
                             "or give the engine more num_blocks")
        return ids, params

    def _add(self, ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a request that _check has passed."""
        if request_id is None:  # the next number that no request uses (a caller may have picked it as an id)
            while str(self._ids) in self.scheduler.requests:
                self._ids += 1
            request_id, self._ids = str(self._ids), self._ids + 1
        seed = params.seed if params.seed is not None else self.rng.getrandbits(63)
        self.scheduler.add(Request(request_id, ids, params, seed))
        return request_id

    def abort(self, request_id: str):
        """Stop a request and give its blocks back. The next step() or step_async() returns it, once, with
        finish_reason "abort" and the tokens it had, as vLLM does. Safe at any time, also with a step in
        flight (async): that step's token for it is dropped, as it was never read back. An unknown or
        finished id is ignored."""
        check_type("request_id", request_id, "str")
        self._check_open()
        req = self.scheduler.requests.get(request_id)
        if req is not None:
            self.scheduler.finish(req, "abort")
            self.aborted.append(req)

    def has_unfinished(self) -> bool:
        """Requests to run, a step in flight, or aborted requests not yet returned."""
        self._check_open()
        return self.scheduler.has_unfinished() or self.inflight is not None or bool(self.aborted)

    # -- steps --------------------------------------------------------------------------------------------
    @property
    def stats(self) -> "StepStats":
        return self.runner.stats

    def step(self) -> list[RequestOutput]:
        """Schedule, run, read the tokens back (one host sync), update. Returns the requests that finished."""
        self._check_open()
        t0 = time.perf_counter()
        finished = self._land() if self.inflight else []  # switching from async: land its step first
        out = self.scheduler.schedule()
        if out.requests:
            tokens = self.runner.execute(out)
            t1 = time.perf_counter()
            tokens = tokens.cpu().numpy()
            self.stats.wait_s += time.perf_counter() - t1
            finished += self.scheduler.update(out, tokens)
        return self._outputs(out, finished, t0)

    def step_async(self) -> list[RequestOutput]:
        """Schedule and launch step s+1, then read back step s's tokens while s+1 runs on the device."""
        self._check_open()
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        launched = None
        if out.requests:
            tokens = self.runner.execute(out)
            slots = self.scheduler.append_placeholders(out)
            launched = (slots, *self._copy_to_host(tokens))
        finished = self._land() if self.inflight else []
        self.inflight = launched
        return self._outputs(out, finished, t0)

    def _outputs(self, out, finished: list[Request], t0: float) -> list[RequestOutput]:
        outputs = [self.output(r) for r in self.aborted + finished]
        self.aborted = []
        st = self.stats
        st.steps += bool(out.requests)
        st.tokens += out.num_samples
        st.total_s += time.perf_counter() - t0
        return outputs

    def _copy_to_host(self, tokens: torch.Tensor):
        """Start the copy of a step's tokens into pinned memory; an event says when they have landed.
        Two persistent buffers alternate (one step is in flight at most): allocating pinned memory per
        step could synchronise the device, which is the one thing this path must not do."""
        if not self.cuda:  # (not tokens.device.type: that alone cost ~20 us a step on a cold CPU)
            return tokens, None
        if self.readback is None:
            self.readback = [torch.empty(self.cfg.max_num_seqs, dtype=torch.int64, pin_memory=True)
                             for _ in range(2)]
        self.readback.reverse()
        host = self.readback[0][:tokens.shape[0]]
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def _land(self) -> list[Request]:
        slots, host, event = self.inflight
        self.inflight = None
        t = time.perf_counter()
        if event is not None:
            event.synchronize()
        tokens = host.numpy()
        self.stats.wait_s += time.perf_counter() - t
        return self.scheduler.fill(slots, tokens)

    def output(self, req: Request) -> RequestOutput:
        ids = req.output_token_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else None
        return RequestOutput(req.request_id, req.token_ids[:req.num_prompt_tokens], ids, text,
                             req.finish_reason, req.status == FINISHED)


def load_tokenizer(folder: str | None):
    if folder is None or not os.path.exists(os.path.join(folder, "tokenizer.json")):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:  # optional: without it, prompts must be token ids
        return None
    return Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))


class LLM:
    """vLLM's offline API: LLM(model=...).generate(prompts, sampling_params) -> outputs in input order.
    `with LLM(...) as llm:` gives its memory back on leaving the block (close())."""

    def __init__(self, model: str = "tiny", **settings):
        self.engine = Engine(EngineConfig(model=model, **settings))

    def close(self):
        """Engine.close: the KV cache, graphs and weights go now; generate then raises ValueError."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info):
        self.close()

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
        ids = [engine._add(tokens, p) for tokens, p in checked]
        done = {}
        step = engine.step_async if engine.cfg.async_scheduling else engine.step
        while engine.has_unfinished():
            for o in step():
                done[o.request_id] = o
        return [done[rid] for rid in ids]


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
