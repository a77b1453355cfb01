"""Triton kernels for nanoengine, each beside a plain-torch reference.

Map (Part 1 is the chapter; Part 2 the speed variants the tuned path swaps in):

| kernel               | what it does in one launch                                        | called by (nanoengine.py) |
|----------------------|-------------------------------------------------------------------|---------------------------|
| 1.1 add_rmsnorm      | residual += x, then RMSNorm                                       | DecoderLayer, Model       |
| 1.2 silu_and_mul     | silu(gate) * up                                                   | MLP, fused_moe            |
| 1.3 rope_write_kv    | per-head RMSNorm, RoPE, and the KV-cache write                    | Attention                 |
| 1.4 paged_attention  | causal attention over the paged cache, any batch                  | Attention                 |
| 1.5 moe_align        | (token, expert) pairs grouped by expert, on the device            | fused_moe                 |
| 1.6 fused_moe        | every expert's MLP as one grouped GEMM per projection             | MoE                       |
| 1.7 race_sample_ref  | sampling as an exponential race (torch: the kernel is 2.6)        | sample                    |
| 2.1 pdl              | the next kernel waits on the SMs while this one runs              | every Part 2 kernel       |
| 2.2 linear           | matmul for few rows; + add_rmsnorm before, silu after             | TunedDecoderLayer         |
| 2.3 decode_attention | rope_write_kv + paged_attention at decode, split-KV, packed heads | TunedDecoderLayer         |
| 2.4 fused_moe_decode | fused_moe for a few tokens as two GEMVs                           | MoE (tuned_ops)           |
| 2.5 moe_route        | softmax, top-k, renormalise                                       | MoE (tuned_ops)           |
| 2.6 race_sample      | sampling in one pass over the logits                              | sample (tuned_ops)        |
| 2.7 prefill_attention| paged_attention for prompt steps, in balanced units of work      | Attention (tuned_ops)     |

Every kernel is three pieces with the same arguments: `_name_kernel` (the Triton program), `name()` (the
launcher: checks inputs, picks block sizes from host-side sizes only, launches) and `name_ref()` (plain
torch: the CPU path of the engine, and what the tests compare against; 2.2's are linear_ref and
add_rmsnorm_linear_ref, 2.7's paged_attention_ref, and 2.1 changes no result). Rules every launcher keeps:
  * no host sync (no .item(), .tolist(), nonzero, bincount; no grid from device values), so a CUDA graph
    can capture the launch and replay it with new batch contents;
  * loads are upcast to float32 before any arithmetic, results cast back once, at the store;
  * offsets that can pass 2**31 (cache slots, expert weights) are computed in int64.

Imports nothing from the rest of nanoengine. Tests: test_all.py (on a CPU, the Triton interpreter: TRITON_INTERPRET=1).
"""
import functools
import math

import torch
import triton
import triton.language as tl

# ==========================================================================================================
# Part 1: the chapter's kernels
# ==========================================================================================================
# Each "# -- 1.n" section is a unit you can copy: with torch, triton and triton.language as tl imported, it runs
# (test_all.py runs each from a file of its own, after the sections its title says it needs).


# -- 1.1 add_rmsnorm: the pre-norm residual stream, residual += x, then RMSNorm, in one pass --------------
NORM_TILE, NORM_PROGRAMS = 4096, 256  # short rows go a few to a program, up to 4K elements, while 256 (2 an SM) remain


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr,  # [N, D] the layer's output, row stride stride_x
    residual_ptr,  # [N, D] contiguous: read, then overwritten with x + residual (HAS_RESIDUAL only)
    weight_ptr,  # [D] the norm's weight
    out_ptr,  # [N, D] contiguous: rmsnorm(x + residual) * weight
    num_rows,  # N
    stride_x,  # elements between two rows of x
    dim,  # D
    eps,  # added to the mean square, as the checkpoint's rms_norm_eps says
    HAS_RESIDUAL: tl.constexpr,  # False before the first layer: there is no residual yet
    BLOCK_ROWS: tl.constexpr,  # rows per program
    BLOCK_D: tl.constexpr,  # D rounded up to a power of two
):
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < num_rows)[:, None] & (cols < dim)[None, :]
    s = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_ptrs = residual_ptr + rows[:, None] * dim + cols[None, :]
        # Rounded to the residual's dtype first: the next layer reads the rounded sum, so the norm must too.
        s = (s.to(tl.float32) + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(s.dtype)
        tl.store(r_ptrs, s, mask=mask)
    s = s.to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)
    out = s * tl.rsqrt(tl.sum(s * s, axis=1) / dim + eps)[:, None] * w[None, :]  # 1 / rms: one per row
    tl.store(out_ptr + rows[:, None] * dim + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def _check_add_rmsnorm_args(x, residual, weight, weight_name: str = "weight") -> None:
    if x.stride(-1) != 1 or weight.shape != (x.shape[-1],):
        raise ValueError(f"x must have a contiguous last dim and {weight_name} shape ({x.shape[-1]},), got x "
                         f"strides {tuple(x.stride())} and {weight_name} {tuple(weight.shape)}")
    if residual is not None and ((residual.shape, residual.dtype) != (x.shape, x.dtype)
                                 or not residual.is_contiguous()):
        raise ValueError(f"residual must be contiguous with x's shape {tuple(x.shape)} and dtype {x.dtype}, got "
                         f"{tuple(residual.shape)} strides {tuple(residual.stride())} {residual.dtype}")


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual) for x [..., D]. The sum is written IN PLACE into
    `residual` (contiguous), which is returned. residual None (the first layer): (rmsnorm(x) * weight, x)."""
    _check_add_rmsnorm_args(x, residual, weight)
    x2, out = x.reshape(-1, x.shape[-1]), torch.empty(x.shape, dtype=x.dtype, device=x.device)  # x2: [N, D]
    (num_rows, dim), block_d = x2.shape, triton.next_power_of_2(x2.shape[1])
    if num_rows:
        rows = max(1, min(NORM_TILE // block_d, num_rows // NORM_PROGRAMS))
        block_rows = 1 << (rows.bit_length() - 1)  # a power of two, rounded down
        _add_rmsnorm_kernel[(triton.cdiv(num_rows, block_rows),)](
            x2, x2 if residual is None else residual, weight, out, num_rows, x2.stride(0), dim, eps,
            HAS_RESIDUAL=residual is not None, BLOCK_ROWS=block_rows, BLOCK_D=block_d,
            num_warps=4 if block_rows * block_d <= 2048 else 8)
    return out, (x if residual is None else residual)


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # add_rmsnorm's contract: residual in place
    if residual is None:
        return rmsnorm_ref(x, weight, eps), x
    residual.copy_((x.float() + residual.float()).to(residual.dtype))
    return rmsnorm_ref(residual, weight, eps), residual


# -- 1.2 silu_and_mul: the gated MLP's activation, silu(gate) * up --------------------------------------
SILU_BLOCK = 1024  # outputs a program: a wide row splits over several programs, so a few rows still fill the GPU


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [N, 2I] gate | up, as the fused gate_up matmul stores them; row stride stride_x
    out_ptr,  # [N, I] contiguous
    stride_x,  # elements between two rows of x
    inter,  # I
    BLOCK: tl.constexpr,  # outputs per program
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [N, 2I] -> silu(x[:, :I]) * x[:, I:], [N, I]: one read of gate and up, one write, where torch
    would write silu(gate) and read it back."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [N, 2I] with a contiguous last dim, got shape {tuple(x.shape)}")
    n, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    if n:
        block = min(triton.next_power_of_2(inter), SILU_BLOCK)
        _silu_and_mul_kernel[(n, triton.cdiv(inter, block))](x, out, x.stride(0), inter, BLOCK=block, num_warps=4)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


# -- 1.3 rope_write_kv: per-head RMSNorm (Qwen3), rotary embedding, the KV-cache write (needs 1.1) -------
@triton.jit
def _rope_heads(
    x_ptr,  # this token's first head
    stride_h,  # elements between two heads of x
    out_ptr, out_stride_h,  # where the rotated heads go, x_ptr itself (q) or the KV-cache slot (k); head stride
    norm_ptr,  # [D] per-head RMSNorm weight (HAS_NORM only)
    cos, sin,  # [D / 2] float32 each
    eps,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # NUM_HEADS rounded up to a power of two
    HALF: tl.constexpr,  # D / 2
    HAS_NORM: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HALF)
    mask = (heads < NUM_HEADS)[:, None]
    first = x_ptr + heads[:, None] * stride_h + dims[None, :]  # [HEADS_PAD, HALF]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        inv_rms = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        x1 = x1 * inv_rms * tl.load(norm_ptr + dims).to(tl.float32)[None, :]
        x2 = x2 * inv_rms * tl.load(norm_ptr + HALF + dims).to(tl.float32)[None, :]
    # rotate_half (the Hugging Face / neox layout): dim d pairs with dim d + D/2
    out = out_ptr + heads[:, None] * out_stride_h + dims[None, :]
    tl.store(out, (x1 * cos[None, :] - x2 * sin[None, :]).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_write_kv_kernel(
    q_ptr,  # [T, H, D] strided view: rotated in place
    k_ptr,  # [T, Hkv, D] strided view: read, rotated into the cache
    v_ptr,  # [T, Hkv, D] strided view: copied into the cache
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D] contiguous
    v_cache_ptr,  # same
    slot_mapping_ptr,  # [T] block * block_size + offset; -1: a padding token
    scratch_slot,  # first slot of the scratch block (the last one, never given to a request)
    positions_ptr,  # [T]
    cos_sin_ptr,  # [max_pos, D] float32: cos in the first half, sin in the second
    q_norm_ptr, k_norm_ptr,  # [D] each (HAS_NORM only)
    stride_qt, stride_qh,  # q's strides: tokens, heads
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    Q_PAD: tl.constexpr,  # NUM_Q_HEADS rounded up to a power of two
    KV_PAD: tl.constexpr,  # NUM_KV_HEADS rounded up to a power of two
    HALF: tl.constexpr,  # D / 2
    HAS_NORM: tl.constexpr,  # Qwen3: RMSNorm on each head of q and k before the rotation
):
    # One program per token does all its heads: cos and sin are loaded once.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    dims = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * 2 * HALF + dims)
    sin = tl.load(cos_sin_ptr + pos * 2 * HALF + HALF + dims)
    q = q_ptr + t * stride_qt
    _rope_heads(q, stride_qh, q, stride_qh, q_norm_ptr, cos, sin, eps, NUM_Q_HEADS, Q_PAD, HALF, HAS_NORM)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    cache = tl.where(slot < 0, scratch_slot, slot) * NUM_KV_HEADS * 2 * HALF  # padding: where no request reads
    _rope_heads(k_ptr + t * stride_kt, stride_kh, k_cache_ptr + cache, 2 * HALF, k_norm_ptr, cos, sin, eps,
                NUM_KV_HEADS, KV_PAD, HALF, HAS_NORM)
    heads = tl.arange(0, KV_PAD)[:, None]
    all_dims = tl.arange(0, 2 * HALF)[None, :]
    v = tl.load(v_ptr + t * stride_vt + heads * stride_vh + all_dims, mask=heads < NUM_KV_HEADS)
    tl.store(v_cache_ptr + cache + heads * 2 * HALF + all_dims, v.to(v_cache_ptr.dtype.element_ty),
             mask=heads < NUM_KV_HEADS)


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                  q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6) -> None:
    """q [T, H, D] rotated in place (after the optional per-head norm); k the same but written to its slot
    of k_cache [num_blocks, block_size, Hkv, D] (k itself is left as it was), v beside it in v_cache.
    cos = cos_sin[pos, :D/2], sin = cos_sin[pos, D/2:]. Slot -1 goes to the scratch block (the last)."""
    (t, h, d), hkv = q.shape, k.shape[1]
    if k.shape != (t, hkv, d) or v.shape != k.shape or k_cache.shape[2:] != (hkv, d) or d % 2 or not (
            k_cache.is_contiguous() and v_cache.is_contiguous() and cos_sin.is_contiguous()):
        raise ValueError(f"expected q [T, H, D], k and v [T, Hkv, D], contiguous caches [blocks, block_size, Hkv, D] "
                         f"and cos_sin, D even; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, "
                         f"{tuple(k_cache.shape)}")
    if t == 0:
        return
    has_norm = q_norm is not None
    _rope_write_kv_kernel[(t,)](
        q, k, v, k_cache, v_cache, slot_mapping, (k_cache.shape[0] - 1) * k_cache.shape[1], positions, cos_sin,
        q_norm if has_norm else cos_sin, k_norm if has_norm else cos_sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), eps,
        NUM_Q_HEADS=h, NUM_KV_HEADS=hkv, Q_PAD=triton.next_power_of_2(h), KV_PAD=triton.next_power_of_2(hkv),
        HALF=d // 2, HAS_NORM=has_norm, num_warps=4)


def rope_write_kv_ref(q, k, v, k_cache, v_cache, slot_mapping, positions, cos_sin, q_norm=None, k_norm=None,
                      eps=1e-6) -> None:
    cos, sin = cos_sin[positions.long(), None].chunk(2, dim=-1)  # [T, 1, D/2] each: broadcast over heads

    def rope(x, norm):  # [T, heads, D] -> rotated, float32
        x = x.float() if norm is None else rmsnorm_ref(x.float(), norm, eps)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    q.copy_(rope(q, q_norm).to(q.dtype))
    slots = torch.where(slot_mapping < 0, (k_cache.shape[0] - 1) * k_cache.shape[1], slot_mapping).long()
    k_cache.view(-1, *k.shape[1:])[slots] = rope(k, k_norm).to(k_cache.dtype)  # [slots, Hkv, D]
    v_cache.view(-1, *v.shape[1:])[slots] = v.to(v_cache.dtype)


# -- 1.4 paged_attention: causal attention of each request's new tokens over its paged KV cache ---------
LOG2E = 1.4426950408889634  # the softmax runs in base 2 (exp2 is one instruction): scores are scaled by log2(e)
ATTN_TILE_ROWS = 64  # a prompt tile's rows, query tokens x the heads of a group: a tl.dot wide enough to pay
ATTN_TILE_BYTES = 16384  # a K or V tile in bytes: with 16-bit values, several pipeline stages fit in shared memory
ATTN_REF_CHUNK = 64  # paged_attention_ref's queries at a time: scores of 64 x context, not context x context


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_attention_kernel(
    q_ptr,  # [T, H, D] strided view: this step's queries (prompt chunks and decodes alike)
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # same shape and strides as k_cache
    out_ptr,  # [T, H, D] contiguous
    query_start_loc_ptr,  # [B + 1] int32: request b's tokens are [qsl[b], qsl[b + 1])
    seq_lens_ptr,  # [B] context length including this step's tokens; 0: a padding request
    block_table_ptr,  # [B, max_blocks] int32: request b's KV blocks, in order
    num_seqs,  # B (this and stride_bt vary from step to step: one compile serves every value, no stall)
    stride_qt, stride_qh,  # q's strides: tokens, heads
    stride_cache_block, stride_cache_tok, stride_cache_head,
    stride_bt,  # elements between two rows of the block table
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    GROUP: tl.constexpr,  # query heads per kv head (grouped-query attention)
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # query rows per program: BLOCK_Q tokens x GROUP_PAD heads (>= 16 for tl.dot)
    BLOCK_N: tl.constexpr,  # keys per tile
    DOT_PRECISION: tl.constexpr,
):
    # Program (i, kv_head) takes query tile i of the batch, for one kv head and the GROUP query heads that
    # share it, so K and V are read once per group. Request b's tiles are numbered from qsl[b] // BLOCK_Q +
    # b: the grid, T // BLOCK_Q + B tiles, depends on sizes only, never on the lengths, so a CUDA graph can
    # replay it with new ones. The last tiles see the most keys: run them first (i counts down).
    i = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    lo, hi = 0, num_seqs - 1  # binary search: the last request whose first tile is <= i
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= i:
            lo = mid
        else:
            hi = mid - 1
    req = lo
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_tile = i - (q_start // BLOCK_Q + req)
    if q_tile * BLOCK_Q >= q_len:
        return  # the grid's spare tiles
    seq_len = tl.load(seq_lens_ptr + req)
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + rows // GROUP_PAD  # [BLOCK_M] each row's token among the request's new ones
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
    token = (q_start + q_idx).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
    # The new tokens are the context's last q_len: token q_idx sits at position seq_len - q_len + q_idx
    # and sees the keys up to it. Padding requests (seq_len 0) see none and write zeros.
    q_pos = seq_len - q_len + q_idx
    kv_end = tl.maximum(seq_len - q_len + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q), 0)
    m = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # running max: finite, so exp2(m - m_new) is never NaN
    l = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(s - m)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # running sum of exp2(s - m) * v
    block_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for start in range(0, kv_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < kv_end
        # A tile spans several KV blocks: look up each key's block, so any block size works.
        block = tl.load(block_row + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        kv = block * stride_cache_block + (keys % BLOCK_SIZE) * stride_cache_tok + kv_head * stride_cache_head
        k = tl.load(k_cache_ptr + kv[None, :] + dims[:, None], mask=key_ok[None, :], other=0.0)  # [D, N]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        s = tl.where((keys[None, :] <= q_pos[:, None]) & key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)  # rescales what was summed under the old max
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        # Keys past the context load as 0, not whatever the slot holds: 0 * NaN would still be NaN.
        v = tl.load(v_cache_ptr + kv[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)  # [N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]  # a row that saw no key stays 0
    out_rows = (token * (tl.num_programs(1) * GROUP) + head).to(tl.int64)
    tl.store(out_ptr + out_rows[:, None] * HEAD_DIM + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def _check_attention_args(q, k_cache, v_cache, query_start_loc, seq_lens, block_table) -> None:
    _, h, d = q.shape
    b, hkv, block_size = seq_lens.shape[0], k_cache.shape[2], k_cache.shape[1]
    if k_cache.dim() != 4 or k_cache.shape[3] != d or v_cache.stride() != k_cache.stride() or h % hkv:
        raise ValueError(f"expected q [T, H, D] and caches [blocks, block_size, Hkv, D] with Hkv dividing H, "
                         f"got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if d < 16 or d & (d - 1) or block_size & (block_size - 1) or q.stride(-1) != 1:
        raise ValueError(f"head_dim ({d}) must be a power of two >= 16, the block size ({block_size}) a "
                         "power of two, and q's last dim contiguous")
    if query_start_loc.shape != (b + 1,) or block_table.shape[0] != b or block_table.stride(-1) != 1:
        raise ValueError(f"expected query_start_loc [{b + 1}] and block_table [{b}, max_blocks], got "
                         f"{tuple(query_start_loc.shape)} and {tuple(block_table.shape)}")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
                    max_query_len: int) -> torch.Tensor:
    """Causal attention of each request's new tokens over its paged context -> out [T, H, D].

    Request b owns tokens query_start_loc[b]:query_start_loc[b + 1] of q, at positions seq_lens[b] - q_len
    .. seq_lens[b] - 1; every token of q belongs to a request. The grid depends on T, B, Hkv and whether
    max_query_len (a host-side bound) is 1, never on the lengths themselves: a graph can replay it."""
    _check_attention_args(q, k_cache, v_cache, query_start_loc, seq_lens, block_table)
    t, h, d = q.shape
    b, hkv, block_size = seq_lens.shape[0], k_cache.shape[2], k_cache.shape[1]
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0 or b == 0:
        return out
    group_pad = triton.next_power_of_2(h // hkv)
    block_q = 1 if max_query_len == 1 else max(1, ATTN_TILE_ROWS // group_pad)  # a decode: one token a request
    block_m = max(16, block_q * group_pad)  # tl.dot needs 16 rows at least
    block_n = max(16, min(64, ATTN_TILE_BYTES // (2 * d)))
    _paged_attention_kernel[(t // block_q + b, hkv)](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, b, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0), scale * LOG2E,
        GROUP=h // hkv, GROUP_PAD=group_pad, HEAD_DIM=d, BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=block_n, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=8 if block_m >= 128 else 4)
    return out


def paged_attention_ref(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale,
                        max_query_len) -> torch.Tensor:
    """The math, one request at a time: its new tokens are the last of its context, and each attends to the
    keys up to its own position, gathered from the request's blocks. Queries go ATTN_REF_CHUNK at a time, so
    memory grows with the context, not its square. The lengths are read on the host (free on the CPU)."""
    t, h, d = q.shape
    hkv, block_size = k_cache.shape[2], k_cache.shape[1]
    out = torch.zeros((t, h, d), dtype=torch.float32, device=q.device)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, n in enumerate(lens):  # a padding request (n = 0) sees no key: its rows stay 0
        first, last = starts[b], starts[b + 1]
        blocks = block_table[b, :triton.cdiv(n, block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:n].float().repeat_interleave(h // hkv, dim=1)  # [n, H, D]
        v = v_cache[blocks].flatten(0, 1)[:n].float().repeat_interleave(h // hkv, dim=1)
        for i in range(first, last, ATTN_REF_CHUNK):
            j = min(i + ATTN_REF_CHUNK, last)
            pos = torch.arange(n - last + i, n - last + j, device=q.device)  # [j - i] the queries' positions
            scores = torch.einsum("qhd,khd->hqk", q[i:j].float(), k) * scale  # [H, j - i, n]
            scores.masked_fill_(torch.arange(n, device=q.device) > pos[:, None], float("-inf"))
            out[i:j] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    return out.to(q.dtype)  # [T, H, D]


# -- 1.5 moe_align: group a MoE layer's (token, expert) assignments by expert, without the host ----------
MOE_ALIGN_MAX = 32768  # assignments one program walks; past this, torch's parallel sort (moe_align_ref) is faster
MOE_ALIGN_BLOCK = 1024  # assignments (or slots) a loop step of that program
MOE_OWNER_TILE = 8192  # blocks x experts compared at once when each block finds its expert


def moe_max_padded(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Length of sorted_ids: a bound on the padded total that depends on sizes only. Each expert with
    tokens wastes at most block_m - 1 padding slots, and at most min(assignments, experts) have tokens:
    1 token x top-8 of 128 experts needs 9 blocks of 16, not 121."""
    bound = num_assignments + min(num_assignments, num_experts) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


@triton.jit
def _moe_align_kernel(
    topk_ids_ptr,  # [A] the expert of each assignment a = token * top_k + j
    sorted_ids_ptr,  # [max_padded] out: assignments grouped by expert, each group padded; padding = A
    block_expert_ptr,  # [max_padded // BLOCK_M] out: the expert of each block of sorted_ids
    num_padded_ptr,  # [1] out: the padded length in use
    cursor_ptr,  # [EXPERTS_PAD] int32 scratch: counts, then each expert's next free slot
    num_assignments,  # A
    max_padded,  # moe_max_padded(A, E, BLOCK_M)
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,  # NUM_EXPERTS rounded up to a power of two
    BLOCK_M: tl.constexpr,  # each expert's group is padded to a multiple of this
    BLOCK_A: tl.constexpr,  # assignments (or slots) per loop step
    BLOCK_B: tl.constexpr,  # blocks per loop step
):
    # One program, so that tl.debug_barrier (which also orders the program's memory accesses) can
    # separate the phases; atomics count the assignments and claim the slots.
    experts = tl.arange(0, EXPERTS_PAD)
    lanes = tl.arange(0, BLOCK_A)
    tl.store(cursor_ptr + experts, tl.zeros([EXPERTS_PAD], dtype=tl.int32))
    for p0 in range(0, max_padded, BLOCK_A):  # every slot starts as padding
        tl.store(sorted_ids_ptr + p0 + lanes, tl.zeros([BLOCK_A], dtype=tl.int32) + num_assignments,
                 mask=p0 + lanes < max_padded)
    tl.debug_barrier()
    for a0 in range(0, num_assignments, BLOCK_A):  # 1. count each expert's assignments
        a = a0 + lanes
        ids = tl.load(topk_ids_ptr + a, mask=a < num_assignments, other=0)
        tl.atomic_add(cursor_ptr + ids, 1, mask=a < num_assignments, sem="relaxed")
    tl.debug_barrier()
    counts = tl.load(cursor_ptr + experts)  # 2. pad each count to whole blocks; the groups' ends
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    tl.debug_barrier()  # every count read before the cursors overwrite them
    tl.store(cursor_ptr + experts, ends - padded)
    num_blocks = max_padded // BLOCK_M
    for b0 in range(0, num_blocks, BLOCK_B):  # 3. each block's expert: the first group ending past it
        blk = b0 + tl.arange(0, BLOCK_B)
        owner = tl.sum((ends[None, :] <= (blk * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        # Blocks past num_padded are never computed; clamped, their expert id is still a valid index.
        tl.store(block_expert_ptr + blk, tl.minimum(owner, NUM_EXPERTS - 1), mask=blk < num_blocks)
    tl.debug_barrier()
    for a0 in range(0, num_assignments, BLOCK_A):  # 4. each assignment claims the next slot of its expert
        a = a0 + lanes
        ids = tl.load(topk_ids_ptr + a, mask=a < num_assignments, other=0)
        dest = tl.atomic_add(cursor_ptr + ids, 1, mask=a < num_assignments, sem="relaxed")
        tl.store(sorted_ids_ptr + dest, a, mask=a < num_assignments)


def moe_align(topk_ids: torch.Tensor, num_experts: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the N * k assignments of topk_ids [N, k] by expert, each group padded to a multiple of block_m.
    Returns sorted_ids int32 [max_padded] (assignment token * k + j; padding = N * k), block_expert int32
    [max_padded // block_m] and num_padded int32 [1], all on the device: no size is read back, so a CUDA
    graph can hold it. The order within a group is unspecified (atomics); no result depends on it."""
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64) or num_experts < 1 or block_m < 1:
        raise ValueError(f"expected int [N, k] topk_ids and positive num_experts and block_m, got "
                         f"{topk_ids.dtype} {tuple(topk_ids.shape)}, {num_experts}, {block_m}")
    num_assignments = topk_ids.numel()
    if num_assignments > MOE_ALIGN_MAX:
        return moe_align_ref(topk_ids, num_experts, block_m)
    max_padded = moe_max_padded(num_assignments, num_experts, block_m)
    num_blocks, experts_pad = max_padded // block_m, triton.next_power_of_2(num_experts)
    sorted_ids, block_expert, num_padded, cursor = (torch.empty(n, dtype=torch.int32, device=topk_ids.device)
                                                    for n in (max_padded, num_blocks, 1, experts_pad))
    _moe_align_kernel[(1,)](
        topk_ids.reshape(-1), sorted_ids, block_expert, num_padded, cursor, num_assignments, max_padded,
        NUM_EXPERTS=num_experts, EXPERTS_PAD=experts_pad, BLOCK_M=block_m,
        BLOCK_A=min(MOE_ALIGN_BLOCK, triton.next_power_of_2(max_padded)),
        BLOCK_B=min(triton.next_power_of_2(num_blocks), max(1, MOE_OWNER_TILE // experts_pad)),
        num_warps=4)
    return sorted_ids, block_expert, num_padded


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """In torch, and also sync-free: counts by scatter_add, since bincount sizes its output from the data's
    max, a value only the host can use (a sync, which a CUDA graph cannot capture)."""
    flat = topk_ids.reshape(-1).long()  # [A]
    num_assignments, device = flat.numel(), flat.device
    max_padded = moe_max_padded(num_assignments, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)  # [E]
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert
    rank = torch.arange(num_assignments, device=device) - (counts.cumsum(0) - counts)[flat[order]]
    sorted_ids = torch.full((max_padded,), num_assignments, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, (ends - padded)[flat[order]] + rank, order.to(torch.int32))
    starts = torch.arange(0, max_padded, block_m, device=device)
    block_expert = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, block_expert.to(torch.int32), ends[-1:].to(torch.int32)


# -- 1.6 fused_moe: every expert's MLP as one grouped GEMM per projection (needs 1.2 and 1.5) -----------
# The grouped GEMM's tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) by the assignments an expert gets on
# average: up to ~16 the layer streams the experts' weights (narrow tiles, most experts one block of rows);
# past that it is compute-bound and takes bigger tiles.
MOE_TILES = ((8, (16, 64, 128, 4, 4)), (16, (32, 64, 128, 4, 4)), (64, (64, 128, 64, 4, 3)),
             (float("inf"), (128, 256, 64, 8, 3)))


def moe_route_ref(logits: torch.Tensor, top_k: int, renormalize: bool):
    """The router, as Hugging Face's Qwen3-MoE block: softmax in float32, the top k, renormalised if the
    config says so -> (weights, expert ids), [T, k] each."""
    weights, ids = torch.softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits.dtype), ids


@triton.jit
def _fused_moe_kernel(
    a_ptr,  # [rows, K] activations: one row per token (gate_up) or per assignment (down)
    w_ptr,  # [E, N, K] the experts' weights
    out_ptr,  # [A, N] one row per assignment
    sorted_ids_ptr,  # [max_padded] from moe_align
    block_expert_ptr,  # [max_padded // BLOCK_M] from moe_align
    num_padded_ptr,  # [1] from moe_align
    topk_weights_ptr,  # [A] router weights (MUL_ROUTED_WEIGHT only)
    num_assignments,  # A
    n_out,  # N
    k_in,  # K
    stride_am,  # elements between two rows of a
    stride_we, stride_wn,  # w's strides: experts, rows
    stride_om,  # elements between two rows of out
    A_ROW_DIV: tl.constexpr,  # activation row = assignment // A_ROW_DIV (top_k for gate_up, 1 for down)
    MUL_ROUTED_WEIGHT: tl.constexpr,  # scale each output row by its router weight (down)
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,  # assignments per program: one block of sorted_ids, all of one expert
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    # The grid covers the worst-case padded length; blocks past what this routing uses stop here.
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    assignment = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = assignment < num_assignments
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (assignment // A_ROW_DIV).to(tl.int64)[:, None] * stride_am + ks[None, :]  # [M, K]
    w_ptrs = w_ptr + expert * stride_we + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None]  # [K, N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k_ok = ks < k_in - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & (cols < n_out)[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)  # a @ w.T, w read transposed
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + assignment, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + assignment.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < n_out)[None, :])


def _moe_gemm(a, w, out, align, topk_weights, a_row_div: int, blocks) -> None:
    """out[assignment] = a[assignment // a_row_div] @ w[expert].T (* its router weight when given)."""
    (sorted_ids, block_expert, num_padded), (block_m, block_n, block_k, num_warps, num_stages) = align, blocks
    _fused_moe_kernel[(block_expert.shape[0], triton.cdiv(w.shape[1], block_n))](
        a, w, out, sorted_ids, block_expert, num_padded, a if topk_weights is None else topk_weights,
        out.shape[0], w.shape[1], w.shape[2], a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_ROW_DIV=a_row_div, MUL_ROUTED_WEIGHT=topk_weights is not None,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32", BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)


def _check_moe_args(x, gate_up, down, topk_weights, topk_ids) -> None:
    n, d = x.shape
    e, two_i, _ = gate_up.shape
    if gate_up.shape != (e, two_i, d) or down.shape != (e, d, two_i // 2) or two_i % 2:
        raise ValueError(f"expected x [N, D], gate_up [E, 2I, D], down [E, D, I], got {tuple(x.shape)}, "
                         f"{tuple(gate_up.shape)}, {tuple(down.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != n or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must both be [{n}, k], got {tuple(topk_ids.shape)} "
                         f"and {tuple(topk_weights.shape)}")


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """out[n] = sum_j w[n, j] * down[e] @ (silu(gate[e] @ x[n]) * (up[e] @ x[n])), e = topk_ids[n, j], for
    x [N, D], gate_up [E, 2I, D] (gate rows first), down [E, D, I], topk_* [N, k]. Assignments are sorted
    by expert on the device (moe_align), so one launch serves every expert and nothing waits for the host."""
    _check_moe_args(x, gate_up, down, topk_weights, topk_ids)
    (n, d), (num_experts, two_i, _), top_k = x.shape, gate_up.shape, topk_ids.shape[1]
    num_assignments = n * top_k
    if num_assignments == 0:
        return torch.zeros_like(x)
    blocks = next(tiles for most, tiles in MOE_TILES if num_assignments / num_experts <= most)
    align = moe_align(topk_ids, num_experts, blocks[0])
    gate_up_out = torch.empty((num_assignments, two_i), dtype=x.dtype, device=x.device)  # [A, 2I]
    _moe_gemm(x, gate_up, gate_up_out, align, None, top_k, blocks)
    act = silu_and_mul(gate_up_out)  # [A, I]
    down_out = torch.empty((num_assignments, d), dtype=x.dtype, device=x.device)  # [A, D]
    _moe_gemm(act, down, down_out, align, topk_weights.reshape(-1).contiguous(), 1, blocks)
    return down_out.view(n, top_k, d).sum(dim=1)  # [N, D]


def fused_moe_ref(x, gate_up, down, topk_weights, topk_ids) -> torch.Tensor:
    """A loop over the experts that got tokens: one host sync for the counts (free on the CPU)."""
    _check_moe_args(x, gate_up, down, topk_weights, topk_ids)
    n, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)  # [A]
    out = torch.zeros((n * top_k, x.shape[1]), dtype=torch.float32, device=x.device)  # [A, D]
    for e in flat.unique().tolist():
        assignment = torch.nonzero(flat == e).flatten()
        xe = x[assignment // top_k].float()  # [count, D]
        gate, up = (xe @ gate_up[e].float().t()).chunk(2, dim=-1)  # [count, I] each
        out[assignment] = (torch.nn.functional.silu(gate) * up) @ down[e].float().t() \
            * topk_weights.reshape(-1)[assignment].float()[:, None]
    return out.view(n, top_k, -1).sum(dim=1).to(x.dtype)


# -- 1.7 race_sample_ref: sampling as an exponential race, with noise that is a function, not a state -----
def race_sample_plain(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The idea in three lines (gpt-fast's sampler): with E ~ Exp(1) drawn for every token, probs / E is
    largest at a token drawn from softmax(logits / temperature). One argmax: no cumulative sum, no search."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.argmax(probs / torch.empty_like(probs).exponential_(1), dim=-1)


# A server needs two things more. A request's tokens must not depend on its batch: torch's generator hands
# out its noise in order, so a row's draw would change with the rows before it. And a CUDA graph cannot
# advance a generator's state on the host. So each E comes from a hash of (the request's seed, the index of
# the token being sampled, the vocabulary id): the same noise in any batch, any row, eager or replayed, and a
# kernel can make it in registers (2.6). argmax(probs / E) = argmax(logits / T - log E), so no softmax either.
def _check_race_args(logits, temperature, seeds, counters) -> None:
    if logits.dim() != 2 or not logits.is_floating_point() or not logits.is_contiguous():
        raise ValueError(f"logits must be a contiguous float [S, V], got {logits.dtype} {tuple(logits.shape)}")
    for name, t in (("temperature", temperature), ("seeds", seeds), ("counters", counters)):
        if t.shape != (logits.shape[0],):
            raise ValueError(f"{name} must be [{logits.shape[0]}], got {tuple(t.shape)}")


def _hash32_ref(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 in int64 arithmetic, keeping the low 32 bits (int64 products wrap, low bits intact)."""
    x = (x ^ (x >> 16)) * 0x7FEB352D & 0xFFFFFFFF
    x = (x ^ (x >> 15)) * 0x846CA68B & 0xFFFFFFFF
    return x ^ (x >> 16)


def race_noise_ref(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """[S, V] uniforms in (0, 1), the ones the kernel makes in registers."""
    m = 0xFFFFFFFF
    key = _hash32_ref((seeds & m) ^ _hash32_ref(seeds >> 32 & m) ^ _hash32_ref(counters * 0x9E3779B9 & m))
    ids = torch.arange(vocab, device=seeds.device)
    return ((_hash32_ref(key[:, None] ^ ids[None, :]) >> 8).float() + 0.5) * (1.0 / (1 << 24))


def race_sample_ref(logits, temperature, seeds, counters, greedy: bool = False) -> torch.Tensor:
    """The textbook sampler: the same race in torch, with the [S, V] noise made in memory."""
    _check_race_args(logits, temperature, seeds, counters)
    logits = logits.float()  # exact for 16-bit logits, as the kernel reads them
    if greedy:
        return logits.argmax(dim=1)
    u = race_noise_ref(seeds, counters, logits.shape[1])  # [S, V]
    t = temperature.float()[:, None]
    return torch.where(t == 0, logits, logits / t.clamp(min=1e-5) - torch.log(-torch.log(u))).argmax(dim=1)


# ==========================================================================================================
# Part 2: speed variants
# ==========================================================================================================
# The tuned path (EngineConfig(tuned=...), nanoengine.tuned_ops) swaps these in; BENCHMARKS.md shows what each buys.
# Tuning constants: the best of an H200 sweep (PREFILL_*: an H100's), or the edge where a variant stops paying.
LINEAR_MAX_M = 256  # linear takes at most this many rows; more go to cuBLAS (F.linear)
LINEAR_NARROW_N = 4096  # ... a weight of at most this many rows ("narrow": cuBLAS splits K there) may take more
LINEAR_TILE_BYTES = 16384  # weight bytes a program loads per K step: 2 programs an SM keep 4.3 TB/s in flight
LINEAR_LONG_K = 2048  # one-row tiles: rows that split into steps of this length take them whole
LINEAR_DOT_MAX_BLOCK_M = 32  # tl.dot row blocks on long rows (K >= LINEAR_LONG_K); up to 128 on short ones
LINEAR_NORM_MIN_BLOCK_N = 16  # add_rmsnorm_linear: narrower tiles re-read the row too often to pay
ATTN_PROGRAMS_PER_SM = 4  # decode attention: split a long context until the grid has this many an SM
ATTN_MAX_SPLITS = 64  # ... but never more splits (each keeps a float32 partial to merge)
ATTN_MIN_SPLIT_TOKENS = 128  # ... and each split covers this many keys at least
ATTN_MERGE_FAN_IN = 8  # splits merged per group: 64 splits cost 2 x 7 dependent loads, not 63
ATTN_PACK_PROGRAMS = 256  # pack kv heads while the grid keeps this many programs (2 an SM) ...
ATTN_PACK_MAX_CONTEXT = 128  # ... and every context has at most this many keys (masked columns cost too)
ATTN_PACK_BLOCK_N = 128  # a packed key tile's columns (keys x heads)
MOE_DECODE_MAX_TOKENS = 4  # fused_moe_decode up to this many tokens: past it, tokens share experts' reads
MOE_DECODE_GATE_UP_BLOCKS = (8, 128, 8)  # its gate_up tiles (BLOCK_N, BLOCK_K, warps) on 16-bit weights
RACE_CHUNK = 8192  # race_sample: vocabulary ids per program (152K ids: 19 programs a row)
MAX_TICKETS = 1 << 16  # _last_to_finish counters: groups of programs that merge in-kernel, at most
PREFILL_BLOCK_M = 128  # prefill attention: query rows a unit (tokens x heads), two warpgroups' 64-row MMAs
PREFILL_BLOCK_N = 64  # ... keys a tile: K and V tiles of 16 KB each at D = 128 in bf16
PREFILL_WARPS = 8  # ... warps a program (4 below 64 rows)
PREFILL_STAGES = 5  # ... pipeline depth: the block-table gather takes a stage, K and V the next two
PREFILL_PROGRAMS_PER_SM = 1  # ... programs an SM (132 KB of shared memory each), taking units until none is left
PREFILL_SPLIT_UNITS_PER_SM = 2  # ... split rows, where tiles leave half the programs idle, to this many units an SM
PREFILL_MAX_SPLITS = 2  # ... into this many at most (each keeps a float32 partial to merge)
PREFILL_MIN_SPLIT_TILES = 8  # ... key tiles a split covers at least: a short prompt's rows are not worth a merge
PREFILL_MIN_TOKENS = 256  # ... the tuned path's steps of fewer tokens keep paged_attention (BENCHMARKS.md)
PREFILL_MAX_SEQS = 512  # ... requests a step, scanned as one vector by every program; more: paged_attention


# -- 2.1 pdl: programmatic dependent launch (Hopper and later) ------------------------------------------
# A decode step chains a few hundred short kernels, and between two the GPU idles about a microsecond. Launched
# programmatic-dependent, the next kernel's programs take their places while this one runs and wait at
# griddepcontrol.wait (_wait_for_inputs) until its writes are visible; a kernel releases the next only after its own
# wait, so at most two are in flight and each sees every earlier kernel's writes: no result changes. Before its wait
# a kernel may read only what no kernel writes (weights, what the host staged). Part 1's kernels launch as usual.
@functools.lru_cache(maxsize=None)
def has_pdl(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


@triton.jit
def _wait_for_inputs(PDL: tl.constexpr):
    """Every Part 2 kernel calls this before it reads what an earlier kernel wrote, then lets the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def _launch_options(pdl: bool) -> dict:
    return dict(PDL=True, launch_pdl=True) if pdl else dict(PDL=False)


# Part 1's kernels that Part 2's ops still call (an add + RMSNorm the matmul cannot take, silu_and_mul after a cuBLAS
# gate/up, a big batch's RoPE and KV write) run in the chain too: launched plainly, each would stall it twice.
@triton.jit
def _add_rmsnorm_pdl_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, num_rows, stride_x, dim, eps,
                            HAS_RESIDUAL: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                            PDL: tl.constexpr):
    _wait_for_inputs(PDL)  # then 1.1's program as it is
    _add_rmsnorm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, num_rows, stride_x, dim, eps, HAS_RESIDUAL,
                        BLOCK_ROWS, BLOCK_D)


def add_rmsnorm_pdl(x, residual, weight, eps: float, pdl: bool = False):
    """add_rmsnorm (1.1), its kernel launched behind the wait when pdl."""
    if not pdl:
        return add_rmsnorm(x, residual, weight, eps)
    _check_add_rmsnorm_args(x, residual, weight)
    x2, out = x.reshape(-1, x.shape[-1]), torch.empty(x.shape, dtype=x.dtype, device=x.device)
    (num_rows, dim), block_d = x2.shape, triton.next_power_of_2(x2.shape[1])
    if num_rows:
        rows = max(1, min(NORM_TILE // block_d, num_rows // NORM_PROGRAMS))
        block_rows = 1 << (rows.bit_length() - 1)
        _add_rmsnorm_pdl_kernel[(triton.cdiv(num_rows, block_rows),)](
            x2, x2 if residual is None else residual, weight, out, num_rows, x2.stride(0), dim, eps,
            HAS_RESIDUAL=residual is not None, BLOCK_ROWS=block_rows, BLOCK_D=block_d,
            num_warps=4 if block_rows * block_d <= 2048 else 8, **_launch_options(pdl))
    return out, (x if residual is None else residual)


@triton.jit
def _silu_and_mul_pdl_kernel(x_ptr, out_ptr, stride_x, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _wait_for_inputs(PDL)  # then 1.2's program as it is
    _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, inter, BLOCK)


def silu_and_mul_pdl(x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """silu_and_mul (1.2), its kernel launched behind the wait when pdl (x [N, 2I] contiguous, as cuBLAS writes it)."""
    if not pdl:
        return silu_and_mul(x)
    n, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    if n:
        block = min(triton.next_power_of_2(inter), SILU_BLOCK)
        _silu_and_mul_pdl_kernel[(n, triton.cdiv(inter, block))](x, out, x.stride(0), inter, BLOCK=block, num_warps=4,
                                                                 **_launch_options(pdl))
    return out


@triton.jit
def _rope_write_kv_pdl_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, scratch_slot, positions_ptr,
                              cos_sin_ptr, q_norm_ptr, k_norm_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                              stride_vh, eps, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_PAD: tl.constexpr,
                              KV_PAD: tl.constexpr, HALF: tl.constexpr, HAS_NORM: tl.constexpr, PDL: tl.constexpr):
    _wait_for_inputs(PDL)  # then 1.3's program as it is
    _rope_write_kv_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, scratch_slot, positions_ptr,
                          cos_sin_ptr, q_norm_ptr, k_norm_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                          stride_vh, eps, NUM_Q_HEADS, NUM_KV_HEADS, Q_PAD, KV_PAD, HALF, HAS_NORM)


def rope_write_kv_pdl(q, k, v, k_cache, v_cache, slot_mapping, positions, cos_sin, q_norm, k_norm, eps, pdl=False):
    """rope_write_kv (1.3), its kernel launched behind the wait when pdl (shapes as decode_attention checked them)."""
    if not pdl:
        return rope_write_kv(q, k, v, k_cache, v_cache, slot_mapping, positions, cos_sin, q_norm, k_norm, eps)
    (t, h, d), hkv, has_norm = q.shape, k.shape[1], q_norm is not None
    _rope_write_kv_pdl_kernel[(t,)](
        q, k, v, k_cache, v_cache, slot_mapping, (k_cache.shape[0] - 1) * k_cache.shape[1], positions, cos_sin,
        q_norm if has_norm else cos_sin, k_norm if has_norm else cos_sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), eps,
        NUM_Q_HEADS=h, NUM_KV_HEADS=hkv, Q_PAD=triton.next_power_of_2(h), KV_PAD=triton.next_power_of_2(hkv),
        HALF=d // 2, HAS_NORM=has_norm, num_warps=4, **_launch_options(pdl))


@triton.jit
def _wait_hold_next(PDL: tl.constexpr):
    """_wait_for_inputs that lets the next kernel launch only as this one's programs exit: decode attention's hold
    most of each SM's shared memory, so the o matmul's programs, released early, would pile onto the first SMs freed."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _prefetch_l2(base_ptr, row_offs, row_ok, row_len, BLOCK: tl.constexpr):
    """Ask L2 for elements [0, min(row_len, BLOCK)) of the row_ok rows at base_ptr + row_offs [R, 1], one
    prefetch.global.L2 per 128-byte line, which no register waits for. Only for tiles that are a short part of
    each row: a whole kernel's rows fetched early take the bandwidth the kernel before still needs. CUDA only."""
    LINE: tl.constexpr = 1024 // base_ptr.dtype.element_ty.primitive_bitwidth  # elements per 128 bytes
    offs = tl.arange(0, (BLOCK + LINE - 1) // LINE) * LINE
    ptrs = base_ptr + tl.where(row_ok[:, None] & (offs[None, :] < row_len), row_offs + offs[None, :], 0)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@functools.lru_cache(maxsize=None)
def _tickets(device: torch.device) -> torch.Tensor:
    """Zeroed int32 counters for _last_to_finish, one buffer per device, made on the first (eager) call: ordinary
    memory, not a graph pool's. Each last program zeroes its counter again: no memset between launches or replays."""
    return torch.zeros(MAX_TICKETS, dtype=torch.int32, device=device)


@triton.jit
def _last_to_finish(ticket_ptr, group_size):
    """Called by every program of a group after it stored its partial result: True in exactly one, the last,
    which then combines the partials in the same launch. The barrier puts this program's stores before its
    ticket; the acquire-release atomic makes every earlier program's stores visible to the last ticket's."""
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    last = ticket == group_size - 1
    if last:
        tl.atomic_xchg(ticket_ptr, 0)
    return last


# -- 2.2 linear: the matmul for a few rows (replaces F.linear; its prologue add_rmsnorm, its epilogue silu_and_mul) -
@triton.jit
def _linear_kernel(
    x_ptr,  # [M, K], row stride stride_xm
    weight_ptr,  # [N, K] contiguous, as nn.Linear stores it
    bias_ptr,  # [N] (HAS_BIAS only)
    out_ptr,  # [M, N] contiguous ([M, N / 2] if GATED)
    residual_ptr, residual_out_ptr,  # [M, K] contiguous each: the residual, and x + residual written (ADD only)
    norm_weight_ptr,  # [K] (NORM only)
    num_rows, out_features, in_features,  # M, N (the weight's rows), K
    stride_xm, eps,  # x's row stride; the norm's epsilon (NORM only)
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,  # weight is [gate; up] (N = 2I rows) and out is silu(x @ gate.T) * (x @ up.T)
    NORM: tl.constexpr,  # one row only: the input is rmsnorm(x (+ residual)) * norm_weight
    ADD: tl.constexpr,  # ... with the residual added first
    BLOCK_M: tl.constexpr,  # 1 on the FMA path, 16 or more on the tl.dot path
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # weight rows per program, and elements per K step
    USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,  # see _wait_for_inputs
    PREFETCH: tl.constexpr,  # with PDL: ask L2 for the first weight tile before the wait (_prefetch_l2)
):
    # A program owns BLOCK_N outputs for BLOCK_M rows. With all rows in one block the weight is read from
    # memory exactly once; x (a few KB) is read again by every program, from L2. The programs that share a
    # weight tile (one per row block) are numbered side by side, so all but the first find it in L2.
    row_blocks = tl.cdiv(num_rows, BLOCK_M)
    pid = tl.program_id(0)
    if GATED:
        # A program's weight rows are BLOCK_N / 2 gate rows, then the up rows of the same outputs, so it
        # holds both halves of each output it makes.
        outs = out_features // 2
        cols = (pid // row_blocks) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) % (BLOCK_N // 2)
        w_rows_of = cols + tl.where(tl.arange(0, BLOCK_N) < BLOCK_N // 2, 0, outs)
    else:
        outs = out_features
        cols = (pid // row_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows_of = cols
    col_ok = cols < outs
    rows = (pid % row_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    w_offs = w_rows_of.to(tl.int64)[:, None] * in_features  # [BLOCK_N, 1]
    w_rows = weight_ptr + w_offs
    x_rows = x_ptr + rows.to(tl.int64) * stride_xm  # [BLOCK_M]
    if PDL and PREFETCH:  # no kernel writes a weight: its first tile may move while the kernel before runs
        _prefetch_l2(weight_ptr, w_offs, col_ok, in_features, BLOCK_K)
    _wait_for_inputs(PDL)
    # tl.dot: out.T = weight @ x.T, the weight tile the MMA's tall operand, x padded to 16 columns. One row: an FMA
    # per weight element into a 2-D accumulator, summed over K once after the loop (a sum each step costs more).
    acc = tl.zeros([BLOCK_N, BLOCK_M if USE_DOT else BLOCK_K], dtype=tl.float32)
    # NORM: rmsnorm(s) * g @ W.T = (s * g @ W.T) / rms(s), so the row's sum of squares builds up beside the
    # products and scales the result at the end. Program 0 also stores the new residual.
    sumsq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < in_features
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # K contiguous
        if USE_DOT:
            xt = tl.load(x_rows[None, :] + ks[:, None], mask=row_ok[None, :] & k_ok[:, None], other=0.0)
            acc += tl.dot(w, xt, input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
        else:
            x = tl.load(x_ptr + ks, mask=k_ok, other=0.0)  # [BLOCK_K], the only row
            if NORM:  # s = x + residual, rounded as add_rmsnorm rounds (and stores) it
                s = x.to(tl.float32)
                if ADD:
                    s = (s + tl.load(residual_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)).to(x.dtype)
                    if pid == 0:
                        tl.store(residual_out_ptr + ks, s, mask=k_ok)
                    s = s.to(tl.float32)
                sumsq += s * s
                x = (s * tl.load(norm_weight_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)).to(x.dtype)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    out = tl.trans(acc) if USE_DOT else tl.sum(acc, axis=1)[None, :]  # [BLOCK_M, BLOCK_N]
    if NORM:
        out = out * tl.rsqrt(tl.sum(sumsq, axis=0) / in_features + eps)
    if HAS_BIAS:
        out += tl.load(bias_ptr + w_rows_of, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:  # [BLOCK_M, BLOCK_N] -> gate and up, [BLOCK_M, BLOCK_N / 2] each, rounded as a store would
        gate, up = tl.split(tl.permute(tl.reshape(out, [BLOCK_M, 2, BLOCK_N // 2]), (0, 2, 1)))
        gate = gate.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = up.to(out_ptr.dtype.element_ty).to(tl.float32)
        out = gate * tl.sigmoid(gate) * up
        cols = (pid // row_blocks) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        col_ok = cols < outs
    out_offs = rows.to(tl.int64)[:, None] * outs + cols[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def linear_blocks(m: int, n: int, k: int, element_size: int, gated: bool = False) -> tuple:
    """(BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, num_warps, num_stages) from the shapes alone (n: the weight's rows)."""
    if m > 1:  # tl.dot tiles: rows pad to a power of two from 16
        cap = LINEAR_DOT_MAX_BLOCK_M if k >= LINEAR_LONG_K else 128  # long rows: a tile's K steps are many
        block_m, block_n = min(max(16, triton.next_power_of_2(m)), cap), 64
        while block_m > LINEAR_DOT_MAX_BLOCK_M and triton.cdiv(n, block_n) * triton.cdiv(m, block_m) < 96:
            block_m //= 2  # ~96 programs (3/4 of the SMs) beat two waves: narrow the row block first,
        while block_n > 16 and triton.cdiv(n, block_n) * triton.cdiv(m, block_m) < 96:
            block_n //= 2  # then the tile
        block_k = max(16, min(LINEAR_TILE_BYTES // (block_n * element_size), triton.next_power_of_2(k)))
        stages = 5 if (block_m + block_n) * block_k * element_size * 5 <= 120 * 1024 else 4  # shared memory: 120 KB
        return block_m, block_n, block_k, True, 4, stages
    # One row. K in whole LINEAR_LONG_K steps: a few weight rows a program at 4 warps (long runs of one row
    # per thread); else the widest BLOCK_N up to 16 that still leaves 256 programs (two per SM), 8 warps.
    long_rows = k % LINEAR_LONG_K == 0
    block_n = max(1, LINEAR_TILE_BYTES // (LINEAR_LONG_K * element_size)) if long_rows else 16
    while block_n > 1 + gated and triton.cdiv(n, block_n) < 256:
        block_n //= 2
    block_k = max(16, min(LINEAR_TILE_BYTES // (block_n * element_size), triton.next_power_of_2(k)))
    return (1, block_n, LINEAR_LONG_K, False, 4, 3) if long_rows else (1, block_n, block_k, False, 8, 3)


def _check_linear_args(x, weight, bias, gated: bool) -> None:
    k = x.shape[-1]
    if x.stride(-1) != 1 or weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous():
        raise ValueError(f"expected x [..., K] with a contiguous last dim and a contiguous weight [N, K={k}], "
                         f"got x strides {tuple(x.stride())}, weight {tuple(weight.shape)}")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"with gated, weight must be [gate; up], [2I, K], got {weight.shape[0]} rows")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"x, weight and bias must share a dtype, got {x.dtype}, {weight.dtype}, "
                         f"{None if bias is None else bias.dtype}")


def _launch_linear(x2, weight, bias, out, blocks, pdl: bool, gated=False, residual=None, new_residual=None,
                   norm_weight=None, eps=0.0) -> None:
    """_linear_kernel over x2 [M, K] (norm_weight: over its add + RMSNorm); unused pointers get x2, never read."""
    (m, k), n = x2.shape, weight.shape[0]
    block_m, block_n, block_k, use_dot, num_warps, num_stages = blocks
    _linear_kernel[(triton.cdiv(n, block_n) * triton.cdiv(m, block_m),)](
        x2, weight, weight if bias is None else bias, out, x2 if residual is None else residual,
        x2 if new_residual is None else new_residual, x2 if norm_weight is None else norm_weight,
        m, n, k, x2.stride(0), eps, HAS_BIAS=bias is not None, GATED=gated, NORM=norm_weight is not None,
        ADD=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot,
        DOT_PRECISION="ieee" if x2.dtype == torch.float32 else "tf32", num_warps=num_warps,
        num_stages=num_stages, PREFETCH=block_k < LINEAR_LONG_K, **_launch_options(pdl))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, max_rows: int = LINEAR_MAX_M,
           narrow_rows: int = 0, gated: bool = False, pdl: bool = False, out: torch.Tensor | None = None):
    """x [..., K] @ weight [N, K].T + bias -> [..., N] in a pass that streams the weight near full bandwidth,
    where cuBLAS's tiles are built for reuse across many rows. Up to max_rows rows (narrow weights, at most
    LINEAR_NARROW_N rows: up to narrow_rows if more); more go to F.linear. gated=True: weight is [gate; up] and
    the result silu(x @ gate.T) * (x @ up.T), [..., N / 2]. out: where to write (a graph's static buffer)."""
    _check_linear_args(x, weight, bias, gated)
    n, k = weight.shape
    x2 = x.reshape(-1, k)  # [M, K]
    m, max_rows = x2.shape[0], max(max_rows, narrow_rows) if n <= LINEAR_NARROW_N else max_rows
    if m > min(max_rows, LINEAR_MAX_M):  # cuBLAS
        if out is not None and bias is None and not gated:
            return torch.mm(x2, weight.t(), out=out.view(m, n)).view(out.shape)
        y = torch.nn.functional.linear(x, weight, bias)
        if gated:
            y = silu_and_mul_pdl(y.reshape(m, n), pdl).view(*x.shape[:-1], n // 2)
        return y if out is None else out.copy_(y)
    if out is None:
        out = torch.empty((*x.shape[:-1], n // 2 if gated else n), dtype=x.dtype, device=x.device)
    if m and n:
        _launch_linear(x2, weight, bias, out, linear_blocks(m, n, k, x.element_size(), gated), pdl, gated)
    return out


def add_rmsnorm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, bias: torch.Tensor | None = None, max_rows: int = LINEAR_MAX_M,
                       narrow_rows: int = 0, gated: bool = False,
                       pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(add_rmsnorm(x, residual)[0], weight, ...), x + residual), the add + RMSNorm made as the one-row
    matmul loads its input: one launch, not two. Only for one row and tiles of at least LINEAR_NORM_MIN_BLOCK_N
    weight rows (each program re-reads x, the residual and the norm weight); else add_rmsnorm, then linear.
    Unlike add_rmsnorm it leaves `residual` as it was (every program reads it while program 0 writes the sum)."""
    _check_linear_args(x, weight, bias, gated)
    _check_add_rmsnorm_args(x, residual, norm_weight, "norm_weight")
    x2, n = x.reshape(-1, x.shape[-1]), weight.shape[0]
    blocks = linear_blocks(1, n, x.shape[-1], x.element_size(), gated) if x2.shape[0] == 1 and max_rows else None
    if blocks is None or blocks[1] < LINEAR_NORM_MIN_BLOCK_N:
        h, residual = add_rmsnorm_pdl(x, residual, norm_weight, eps, pdl)
        return linear(h, weight, bias, max_rows, narrow_rows, gated, pdl), residual
    out = torch.empty((*x.shape[:-1], n // 2 if gated else n), dtype=x.dtype, device=x.device)
    new_residual = None if residual is None else torch.empty_like(x)
    _launch_linear(x2, weight, bias, out, blocks, pdl, gated, residual, new_residual, norm_weight, eps)
    return out, x if residual is None else new_residual


def linear_ref(x, weight, bias=None, gated: bool = False) -> torch.Tensor:
    """F.linear in float32, rounded once at the end as the kernel does; gated, then silu_and_mul_ref."""
    y = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return silu_and_mul_ref(y) if gated else y


def add_rmsnorm_linear_ref(x, residual, norm_weight, eps, weight, bias=None, gated=False):
    h, residual = add_rmsnorm_ref(x, residual, norm_weight, eps)
    y = torch.nn.functional.linear(h, weight, bias)
    return (silu_and_mul_ref(y) if gated else y), residual


# -- 2.3 decode_attention: rope_write_kv + paged_attention at decode in one launch, split-KV, packed kv heads --
@triton.jit
def _rope_tile(x, x_swap, swap, norm_ptr, cos, sin, eps, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """[R, HEAD_DIM] float32: rows x, optionally RMSNormed, then x * cos + rotate_half(x) * sin (sin's first
    half negated by the caller). rotate_half pairs dim d with swap[d] = (d + HEAD_DIM / 2) % HEAD_DIM, so the
    caller loads each row twice: straight (x) and with its halves swapped (x_swap)."""
    dims = tl.arange(0, HEAD_DIM)
    x, x_swap = x.to(tl.float32), x_swap.to(tl.float32)
    if HAS_NORM:
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        x = x * inv_rms * tl.load(norm_ptr + dims).to(tl.float32)[None, :]
        x_swap = x_swap * inv_rms * tl.load(norm_ptr + swap).to(tl.float32)[None, :]
    return x * cos[None, :] + x_swap * sin[None, :]


@triton.jit
def _decode_attention_kernel(
    q_ptr,  # [B, H, D] strided view: one new token per request
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, Hkv, D] each, with the same strides
    out_ptr,  # [B, H, D] contiguous
    part_out_ptr,  # [num_splits, B, H, D] float32 unnormalised partials (SPLIT only)
    part_ml_ptr,  # [num_splits, B, H, 2] float32 their running max and sum (SPLIT only)
    tickets_ptr,  # int32 zeros (_tickets): per (request, kv head) the groups done, then per group the splits
    seq_lens_ptr,  # [B] context length including the new token; 0: a padding row
    block_table_ptr,  # [B, max_blocks] int32
    num_splits,  # splits per (request, kv head), an upper bound fixed on the host; 1 unless SPLIT
    k_new_ptr, v_new_ptr,  # [B, Hkv, D] strided views: the new keys and values (ROPE only)
    slot_mapping_ptr, positions_ptr,  # [B] each: their cache slots (-1: a padding row) and positions (ROPE only)
    scratch_slot,  # first slot of the scratch block
    cos_sin_ptr,  # [max_pos, D] float32, cos then sin (ROPE only)
    q_norm_ptr, k_norm_ptr, eps,  # [D] each, and the norm's epsilon (ROPE and HAS_NORM only)
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cache_block, stride_cache_tok, stride_cache_head, stride_bt,
    qk_scale,  # softmax scale * log2(e)
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,  # H, and H // Hkv
    GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,  # GROUP rounded up to a power of two; D
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    BLOCK_M: tl.constexpr,  # query rows: 2^PACK_SHIFT kv heads x GROUP_PAD, at least 16
    BLOCK_N: tl.constexpr,  # key-tile columns: BLOCK_N >> PACK_SHIFT keys x 2^PACK_SHIFT kv heads
    PACK_SHIFT: tl.constexpr,  # log2 of the kv heads a program takes (0: one)
    SPLIT: tl.constexpr,  # num_splits > 1 (a run-time count, so every count shares one compiled kernel)
    MIN_SPLIT_TILES: tl.constexpr,  # key tiles a split covers at least
    MERGE_FAN_IN: tl.constexpr,  # splits merged per group (ATTN_MERGE_FAN_IN)
    ROPE: tl.constexpr,  # rotate q and the new k here, write the new k and v, use them from registers
    HAS_NORM: tl.constexpr,  # ... after Qwen3's per-head RMSNorm
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,  # see _wait_for_inputs; the next kernel launches as this one exits (_wait_hold_next)
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1) << PACK_SHIFT  # the first of this program's kv heads
    split = tl.program_id(2)
    # What the host staged (no kernel writes it) is loaded before the wait: under PDL it is on its way while
    # the q/k/v matmul still runs, and only q, k and v wait for it. A split with no keys exits at once.
    seq_len = tl.load(seq_lens_ptr + req)
    # With ROPE the new token (the context's last) comes from registers: the cache walk stops before it.
    kv_end = tl.maximum(seq_len - 1, 0) if ROPE else seq_len
    num_tiles = tl.cdiv(kv_end, BLOCK_N >> PACK_SHIFT)
    if SPLIT:
        # The split count was fixed for the longest context the block table holds; this context uses as
        # many as its keys fill at MIN_SPLIT_TILES each (at least one), and the rest exit here.
        tiles_per_split = tl.maximum(tl.cdiv(num_tiles, num_splits), MIN_SPLIT_TILES)
        splits_used = tl.maximum(tl.cdiv(num_tiles, tiles_per_split), 1)
        if split >= splits_used:
            return
        tile_lo = split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    else:
        splits_used, tile_lo, tile_hi = 1, 0, num_tiles
    dims = tl.arange(0, HEAD_DIM)
    if ROPE:  # the new token's position and slot, and cos and sin there
        pos = tl.load(positions_ptr + req).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + req).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * HEAD_DIM + dims % (HEAD_DIM // 2))
        sin = tl.load(cos_sin_ptr + pos * HEAD_DIM + HEAD_DIM // 2 + dims % (HEAD_DIM // 2))
    _wait_hold_next(PDL)
    rows = tl.arange(0, BLOCK_M)
    # Row r is query head r % GROUP_PAD of packed kv head row_head; rows past the packed heads are padding.
    row_head = (rows // GROUP_PAD) & ((1 << PACK_SHIFT) - 1)
    row_ok = (rows // GROUP_PAD < (1 << PACK_SHIFT)) & (rows % GROUP_PAD < GROUP)
    head = (kv_head + row_head) * GROUP + rows % GROUP_PAD
    q_rows = q_ptr + req.to(tl.int64) * stride_qt + head[:, None] * stride_qh  # [BLOCK_M, 1]
    m = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if ROPE:
        # The new token's query heads are rotated here, and its key and value used from registers, so no program
        # waits for them to reach memory. Split 0 writes them to the cache for later steps.
        swap = (dims + HEAD_DIM // 2) % HEAD_DIM
        sin = tl.where(dims < HEAD_DIM // 2, -sin, sin)  # rotate_half(x) = [-x2, x1]
        q = _rope_tile(tl.load(q_rows + dims[None, :], mask=row_ok[:, None], other=0.0),
                       tl.load(q_rows + swap[None, :], mask=row_ok[:, None], other=0.0),
                       swap, q_norm_ptr, cos, sin, eps, HEAD_DIM, HAS_NORM).to(q_ptr.dtype.element_ty)
        # The new k, v of each row's kv head ([1, D]; packed [BLOCK_M, D]), in every split: the loads overlap q's RoPE
        kv_of = (kv_head + row_head)[:, None] if PACK_SHIFT > 0 else tl.zeros([1, 1], dtype=tl.int32) + kv_head
        k_row = k_new_ptr + req.to(tl.int64) * stride_kt + kv_of * stride_kh
        k = _rope_tile(tl.load(k_row + dims[None, :]), tl.load(k_row + swap[None, :]), swap, k_norm_ptr, cos,
                       sin, eps, HEAD_DIM, HAS_NORM).to(k_cache_ptr.dtype.element_ty)
        v = tl.load(v_new_ptr + req.to(tl.int64) * stride_vt + kv_of * stride_vh + dims[None, :])
        if split == 0:
            slot = tl.where(slot < 0, scratch_slot, slot)  # padding rows write to the scratch block
            slot_ptr = slot * stride_cache_tok + kv_of * stride_cache_head + dims[None, :]
            # Packed, the first query row of each kv head writes it; unpacked, the one [1, D] row writes unmasked
            writes = ((rows % GROUP_PAD == 0) & row_ok)[:, None] if PACK_SHIFT > 0 else None
            tl.store(k_cache_ptr + slot_ptr, k, mask=writes)
            tl.store(v_cache_ptr + slot_ptr, v.to(v_cache_ptr.dtype.element_ty), mask=writes)
            if seq_len > 0:  # the new key itself: p = 1 against a running max of its own score
                m = tl.sum(q.to(tl.float32) * k.to(tl.float32), axis=1) * qk_scale
                l = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
                acc += v.to(tl.float32)
    else:
        q = tl.load(q_rows + dims[None, :], mask=row_ok[:, None], other=0.0)
    # Column c of a key tile is key c >> PACK_SHIFT in packed kv head c & (2^PACK_SHIFT - 1): a key's kv
    # heads sit side by side in the cache, so a packed tile reads runs of 2^PACK_SHIFT * D elements.
    cols = tl.arange(0, BLOCK_N)
    col_head = cols & ((1 << PACK_SHIFT) - 1)
    block_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        keys = tile * (BLOCK_N >> PACK_SHIFT) + (cols >> PACK_SHIFT)
        key_ok = keys < kv_end
        block = tl.load(block_row + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        kv = (block * stride_cache_block + (keys % BLOCK_SIZE) * stride_cache_tok
              + (kv_head + col_head) * stride_cache_head)
        k_tile = tl.load(k_cache_ptr + kv[None, :] + dims[:, None], mask=key_ok[None, :], other=0.0)
        s = tl.dot(q, k_tile, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = key_ok[None, :]
        if PACK_SHIFT > 0:  # a row scores only its own head's columns; P @ V then stays per head
            visible = visible & (col_head[None, :] == row_head[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v_tile = tl.load(v_cache_ptr + kv[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=DOT_PRECISION)
        m = m_new
    row = req.to(tl.int64) * NUM_HEADS + head  # [BLOCK_M] (request, head) row of out
    if SPLIT:
        if splits_used > 1:
            # Publish this split's partial; the last to finish merges, in a two-level tree (ATTN_MERGE_FAN_IN): the
            # last split of each group merges it into the group's first slot, the last group the groups.
            rows_per_split = tl.num_programs(0) * NUM_HEADS
            _store_partial(m, l, acc, split, row, row_ok, rows_per_split, part_out_ptr, part_ml_ptr, HEAD_DIM)
            group_id = req * tl.num_programs(1) + tl.program_id(1)
            num_group_ids = tl.num_programs(0) * tl.num_programs(1)
            groups = tl.cdiv(splits_used, MERGE_FAN_IN)
            first = split // MERGE_FAN_IN * MERGE_FAN_IN
            members = tl.minimum(splits_used - first, MERGE_FAN_IN)
            if members > 1:
                ticket = (tickets_ptr + num_group_ids + group_id * tl.cdiv(num_splits, MERGE_FAN_IN)
                          + split // MERGE_FAN_IN)
                if not _last_to_finish(ticket, members):
                    return
                m, l, acc = _merge_splits(first, first + members, 1, row, row_ok, rows_per_split, part_out_ptr,
                                          part_ml_ptr, BLOCK_M, HEAD_DIM)
                if groups > 1:  # the group's merge, to its first slot, for the last group to read
                    _store_partial(m, l, acc, first, row, row_ok, rows_per_split, part_out_ptr, part_ml_ptr, HEAD_DIM)
            if groups > 1:
                if not _last_to_finish(tickets_ptr + group_id, groups):
                    return
                m, l, acc = _merge_splits(0, splits_used, MERGE_FAN_IN, row, row_ok, rows_per_split,
                                          part_out_ptr, part_ml_ptr, BLOCK_M, HEAD_DIM)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]  # a row that saw no key stays 0
    tl.store(out_ptr + row[:, None] * HEAD_DIM + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _store_partial(m, l, acc, slot, row, row_ok, rows_per_split, part_out_ptr, part_ml_ptr, HEAD_DIM: tl.constexpr):
    part_row = slot * rows_per_split + row
    tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :], acc, mask=row_ok[:, None])
    tl.store(part_ml_ptr + part_row * 2, m, mask=row_ok)
    tl.store(part_ml_ptr + part_row * 2 + 1, l, mask=row_ok)


@triton.jit
def _merge_splits(lo, hi, step, row, row_ok, rows_per_split, part_out_ptr, part_ml_ptr,
                  BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Log-sum-exp merge of the partials in slots lo, lo + step, ... < hi -> (m, l, acc). A slot that saw no
    key (m = -1e30, l = 0) adds nothing. The loads bypass L1 (.cg): other SMs wrote the partials."""
    dims = tl.arange(0, HEAD_DIM)
    m = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for slot in range(lo, hi, step):
        part_row = slot * rows_per_split + row
        m_o = tl.load(part_ml_ptr + part_row * 2, mask=row_ok, other=-1.0e30, cache_modifier=".cg")
        l_o = tl.load(part_ml_ptr + part_row * 2 + 1, mask=row_ok, other=0.0, cache_modifier=".cg")
        acc_o = tl.load(part_out_ptr + part_row[:, None] * HEAD_DIM + dims[None, :], mask=row_ok[:, None],
                        other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, m_o)
        alpha, beta = tl.exp2(m - m_new), tl.exp2(m_o - m_new)
        acc = acc * alpha[:, None] + acc_o * beta[:, None]
        l = l * alpha + l_o * beta
        m = m_new
    return m, l, acc


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def decode_pack(b: int, hkv: int) -> int:
    """kv heads a decode program takes when every context is short: a power of two dividing hkv, as many as
    still leave ATTN_PACK_PROGRAMS programs; 1 below that."""
    most = b * hkv // ATTN_PACK_PROGRAMS
    return math.gcd(hkv, 1 << (most.bit_length() - 1)) if most > 1 else 1


def decode_context_bounds(b: int, hkv: int) -> tuple[int, ...]:
    """The longest contexts up to which a decode of b requests runs other tiles than past them: the graph
    runner captures a graph for each side of each bound, and replays the one the batch allows."""
    return (ATTN_PACK_MAX_CONTEXT,) if decode_pack(b, hkv) > 1 else ()


def decode_attention(q, k, v, k_cache, v_cache, slot_mapping, positions, seq_lens, block_table, cos_sin, scale,
                     q_norm=None, k_norm=None, eps=1e-6, max_seq_len: int | None = None,
                     num_splits: int | None = None, pdl: bool = False) -> torch.Tensor:
    """rope_write_kv, then paged_attention, for a decode batch (token b at position seq_lens[b] - 1) -> [B, H, D]:
    one launch while the grid fits one wave, long contexts at a small batch split over programs, a big batch of short
    ones (host-side max_seq_len) packed. num_splits overrides the split count chosen from the SM count (tests)."""
    b, h, d = q.shape
    hkv, block_size = k_cache.shape[2], k_cache.shape[1]
    if k.shape != (b, hkv, d) or seq_lens.shape != (b,) or block_table.shape[0] != b or h % hkv:
        raise ValueError(f"decode_attention takes one token per request: expected q [B, H, D], k [B, Hkv, D], "
                         f"seq_lens [B], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(seq_lens.shape)}")
    out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    group_pad = triton.next_power_of_2(h // hkv)
    block_n = max(16, min(64, ATTN_TILE_BYTES // (2 * d)))
    min_split_tiles = triton.cdiv(ATTN_MIN_SPLIT_TOKENS, block_n)
    if num_splits is None:  # as many as fill ATTN_PROGRAMS_PER_SM a SM, and the longest context can use
        max_splits = triton.cdiv(block_table.shape[1] * block_size, block_n * min_split_tiles)
        num_splits = max(1, min(ATTN_PROGRAMS_PER_SM * _sm_count(q.device) // (b * hkv), max_splits, ATTN_MAX_SPLITS))
    if b * hkv * (1 + triton.cdiv(num_splits, ATTN_MERGE_FAN_IN)) > MAX_TICKETS:
        num_splits = 1  # a grid this big fills the GPU without splitting
    short = max_seq_len is not None and max_seq_len <= ATTN_PACK_MAX_CONTEXT
    heads = decode_pack(b, hkv) if short and num_splits == 1 else 1  # a grid small enough to split has nothing to pack
    # Past one wave, fused RoPE would make every program wait one more round trip (cos and sin need its
    # position) before its first K/V load, once per wave: RoPE and the KV write go first, apart.
    fused = b * hkv // heads <= ATTN_PROGRAMS_PER_SM * _sm_count(q.device)
    if not fused:
        rope_write_kv_pdl(q, k, v, k_cache, v_cache, slot_mapping, positions, cos_sin, q_norm, k_norm, eps, pdl)
    block_m, stages = max(16, heads * group_pad), 2  # fewer stages, more programs an SM: short contexts
    if heads > 1:  # key tiles of 128 columns (keys x heads)
        block_n, stages = max(16, heads, min(ATTN_PACK_BLOCK_N, 16384 // d)), 3
    part_out, part_ml = (torch.empty((num_splits, b, h, n), dtype=torch.float32, device=q.device) for n in (d, 2)) \
        if num_splits > 1 else (out, out)  # out: never read unless split
    has_norm = q_norm is not None
    _decode_attention_kernel[(b, hkv // heads, num_splits)](
        q, k_cache, v_cache, out, part_out, part_ml, _tickets(q.device), seq_lens, block_table, num_splits,
        k, v, slot_mapping, positions, (k_cache.shape[0] - 1) * block_size, cos_sin,
        q_norm if has_norm else cos_sin, k_norm if has_norm else cos_sin, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0), scale * LOG2E,
        NUM_HEADS=h, GROUP=h // hkv, GROUP_PAD=group_pad, HEAD_DIM=d, BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_N=block_n, PACK_SHIFT=heads.bit_length() - 1, SPLIT=num_splits > 1, MIN_SPLIT_TILES=min_split_tiles,
        MERGE_FAN_IN=ATTN_MERGE_FAN_IN, ROPE=fused, HAS_NORM=has_norm and fused, num_warps=8 if block_m >= 128 else 4,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_stages=stages, **_launch_options(pdl))
    return out


def decode_attention_ref(q, k, v, k_cache, v_cache, slot_mapping, positions, seq_lens, block_table, cos_sin, scale,
                         q_norm=None, k_norm=None, eps=1e-6, max_seq_len=None) -> torch.Tensor:
    rope_write_kv_ref(q, k, v, k_cache, v_cache, slot_mapping, positions, cos_sin, q_norm, k_norm, eps)
    qsl = torch.arange(seq_lens.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention_ref(q, k_cache, v_cache, qsl, seq_lens, block_table, scale, 1)


# -- 2.4 fused_moe_decode: fused_moe for a few tokens as two GEMVs (no sorting, the top-k sum in registers) --
@triton.jit
def _moe_decode_gate_up_kernel(
    x_ptr,  # [N, D] tokens, row stride stride_xm
    w_ptr,  # [E, 2I, D] the experts' gate_up weights, gate rows first
    topk_ids_ptr,  # [A] contiguous: the expert of assignment a = token * top_k + j
    act_ptr,  # [A, I] float32 out: silu(gate) * up
    top_k, inter, hidden,  # k, I, D
    stride_xm, stride_we, stride_wn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # gate rows (and as many up rows) per program; K per step
    PDL: tl.constexpr,  # see _wait_for_inputs
):
    # One row: FMAs summed over K once at the end, as linear's one-row path (tl.dot would pad the row to 16).
    _wait_for_inputs(PDL)
    a = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    expert = tl.load(topk_ids_ptr + a).to(tl.int64)
    x_row = x_ptr + (a // top_k).to(tl.int64) * stride_xm
    gate_rows = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    up_rows = gate_rows + inter * stride_wn
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        x = tl.load(x_row + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]  # [1, BLOCK_K]
        mask = col_ok[:, None] & k_ok[None, :]
        acc_gate += tl.load(gate_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32) * x
        acc_up += tl.load(up_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32) * x
    gate, up = tl.sum(acc_gate, axis=1), tl.sum(acc_up, axis=1)  # [BLOCK_N]
    tl.store(act_ptr + a.to(tl.int64) * inter + cols, gate * tl.sigmoid(gate) * up, mask=col_ok)


@triton.jit
def _moe_decode_down_kernel(
    act_ptr,  # [A, I] float32
    w_ptr,  # [E, D, I] the experts' down weights
    topk_ids_ptr, topk_weights_ptr,  # [A] contiguous each: the experts and their router weights
    out_ptr,  # [N, D] contiguous
    top_k, hidden, inter,  # k, D (the outputs), I
    stride_we, stride_wn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # output features per program; K per step
    PDL: tl.constexpr,  # see _wait_for_inputs
):
    # A program owns BLOCK_N outputs of one token and walks its top_k experts, so the weighted sum over
    # experts happens in registers, in the same order on every run. The router weight scales the
    # activation (w * (W @ h) = W @ (w * h)), so one accumulator serves every expert. One flat loop over
    # (expert, K step): the pipeliner then issues the next expert's loads while this one's FMAs run.
    _wait_for_inputs(PDL)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_steps = tl.cdiv(inter, BLOCK_K)
    for i in range(0, top_k * k_steps):
        j = i // k_steps
        ks = (i - j * k_steps) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = t * top_k + j
        expert = tl.load(topk_ids_ptr + a).to(tl.int64)
        h = tl.load(act_ptr + a.to(tl.int64) * inter + ks, mask=k_ok, other=0.0) \
            * tl.load(topk_weights_ptr + a).to(tl.float32)  # [BLOCK_K]
        w_rows = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * h[None, :]
    tl.store(out_ptr + t.to(tl.int64) * hidden + cols, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=col_ok)


def moe_decode_blocks(rows: int, n_out: int, k_in: int, element_size: int, tiles: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for rows x cdiv(n_out, BLOCK_N) programs that each stream `tiles` weight tiles a
    K step (2: gate_up, 1: down); down's are narrower, with more programs (its loop runs ahead across experts)."""
    if tiles == 2 and element_size == 2:
        return MOE_DECODE_GATE_UP_BLOCKS
    block_n, min_programs = (16, 256) if tiles == 2 else (8, 512)
    while block_n > 1 and rows * triton.cdiv(n_out, block_n) < min_programs:
        block_n //= 2
    block_k = min(LINEAR_TILE_BYTES // (tiles * block_n * element_size), triton.next_power_of_2(k_in))
    return block_n, block_k, 4 if tiles * block_n * block_k <= 2048 else 8


def fused_moe_decode(x, gate_up, down, topk_weights, topk_ids, gate_up_blocks=None, down_blocks=None,
                     pdl: bool = False) -> torch.Tensor:
    """fused_moe for a few tokens, same result: each assignment streams its expert's weights alone (tokens that share
    an expert read it twice: right for a handful, wasteful for a batch). *_blocks override moe_decode_blocks."""
    _check_moe_args(x, gate_up, down, topk_weights, topk_ids)
    (n, d), inter, top_k = x.shape, gate_up.shape[1] // 2, topk_ids.shape[1]
    if n * top_k == 0:
        return torch.zeros_like(x)
    out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    ids, router_w = topk_ids.contiguous(), topk_weights.contiguous()
    # float32 between the kernels (24 KB at one token x top-8 x I = 768, read from L2): one rounding at the end
    act = torch.empty((n * top_k, inter), dtype=torch.float32, device=x.device)  # [A, I]
    block_n, block_k, num_warps = gate_up_blocks or moe_decode_blocks(n * top_k, inter, d, gate_up.element_size(), 2)
    _moe_decode_gate_up_kernel[(n * top_k, triton.cdiv(inter, block_n))](
        x, gate_up, ids, act, top_k, inter, d, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, **_launch_options(pdl))
    block_n, block_k, num_warps = down_blocks or moe_decode_blocks(n, d, inter, down.element_size(), 1)
    _moe_decode_down_kernel[(n, triton.cdiv(d, block_n))](
        act, down, ids, router_w, out, top_k, d, inter, down.stride(0), down.stride(1),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, **_launch_options(pdl))
    return out


def fused_moe_tuned(x, gate_up, down, topk_weights, topk_ids, pdl: bool = False) -> torch.Tensor:
    if x.shape[0] <= MOE_DECODE_MAX_TOKENS:
        return fused_moe_decode(x, gate_up, down, topk_weights, topk_ids, pdl=pdl)
    return fused_moe(x, gate_up, down, topk_weights, topk_ids)


# -- 2.5 moe_route: the router's softmax, top-k and renormalisation in one launch (replaces torch's five) ---
@triton.jit
def _moe_route_kernel(
    logits_ptr,  # [T, E] router logits, contiguous
    weights_ptr, ids_ptr,  # [T, TOP_K] out each: routing weights (the logits' dtype), expert ids (int64), best first
    NUM_EXPERTS: tl.constexpr, EXPERTS_PAD: tl.constexpr,  # E, and E rounded up to a power of two
    TOP_K: tl.constexpr, K_PAD: tl.constexpr,  # k, and k rounded up to a power of two
    RENORM: tl.constexpr,  # divide the k weights by their sum (Qwen3-MoE's norm_topk_prob)
    PDL: tl.constexpr,  # see _wait_for_inputs
):
    _wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)  # one program per token: k rounds of max over E values
    experts = tl.arange(0, EXPERTS_PAD)
    x = tl.load(logits_ptr + t * NUM_EXPERTS + experts, mask=experts < NUM_EXPERTS, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)  # softmax; padding lanes are 0
    ks = tl.arange(0, K_PAD)
    top_w = tl.zeros([K_PAD], dtype=tl.float32)
    top_ids = tl.zeros([K_PAD], dtype=tl.int64)
    for j in tl.static_range(TOP_K):  # pick the best, then knock it out
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, experts, EXPERTS_PAD), axis=0)  # the lowest id on a tie
        idx = tl.minimum(idx, NUM_EXPERTS - 1)  # NaN logits equal no lane: bad tokens, not an out-of-range read
        top_w = tl.where(ks == j, best, top_w)
        top_ids = tl.where(ks == j, idx.to(tl.int64), top_ids)
        p = tl.where(experts == idx, -1.0, p)
    if RENORM:
        top_w = top_w / tl.sum(top_w, axis=0)
    tl.store(weights_ptr + t * TOP_K + ks, top_w.to(weights_ptr.dtype.element_ty), mask=ks < TOP_K)
    tl.store(ids_ptr + t * TOP_K + ks, top_ids, mask=ks < TOP_K)


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool, pdl: bool = False):
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k] int64), best first."""
    if logits.dim() != 2 or not logits.is_contiguous() or not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"expected contiguous router logits [T, E] and 1 <= top_k <= E, got "
                         f"{tuple(logits.shape)} and top_k={top_k}")
    t, e = logits.shape
    weights = torch.empty((t, top_k), dtype=logits.dtype, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    if t:
        _moe_route_kernel[(t,)](logits, weights, ids, NUM_EXPERTS=e, EXPERTS_PAD=triton.next_power_of_2(e),
                                TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), RENORM=renormalize,
                                num_warps=1, **_launch_options(pdl))
    return weights, ids


# -- 2.6 race_sample: sampling in one pass over the logits (replaces 1.7's race_sample_ref) -----------
@triton.jit
def _hash32(x):
    """lowbias32 on uint32 lanes: multiplications wrap mod 2**32, shifts are logical."""
    x = (x ^ (x >> 16)) * 0x7FEB352D
    x = (x ^ (x >> 15)) * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _race_kernel(
    logits_ptr,  # [S, V] float32 or 16-bit, rows contiguous: read as float32
    temperature_ptr,  # [S] float32; 0 = greedy
    seeds_ptr, counters_ptr,  # [S] int64 each: the row's seed, and the index of the token being sampled
    part_score_ptr, part_idx_ptr,  # [S, NUM_CHUNKS] scratch: each chunk's best score (float32) and its id (int64)
    tickets_ptr,  # [>= S] int32 zeros (_tickets)
    tokens_ptr,  # [S] int64 out
    vocab, stride_s,  # V, and elements between two rows of logits
    NUM_CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr,  # programs a row, and rounded up to a power of two
    CHUNK: tl.constexpr, BLOCK_V: tl.constexpr,  # vocabulary ids per program, and per loop step
    GREEDY: tl.constexpr,  # every row has temperature 0: the argmax, no noise
    PDL: tl.constexpr,  # see _wait_for_inputs
):
    # 1.7's race, argmax_v l_v / T - log(E_v), in one read of the logits, the noise made in registers.
    _wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temp = tl.load(temperature_ptr + row)
    inv_t = 1.0 / tl.maximum(temp, 1e-5)
    seed = tl.load(seeds_ptr + row).to(tl.uint64)
    counter = tl.load(counters_ptr + row).to(tl.uint64)
    lo, hi = (seed & 0xFFFFFFFF).to(tl.uint32), (seed >> 32).to(tl.uint32)
    key = _hash32(lo ^ _hash32(hi) ^ _hash32((counter & 0xFFFFFFFF).to(tl.uint32) * 0x9E3779B9))
    best_score = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros([BLOCK_V], dtype=tl.int64)
    for start in tl.static_range(0, CHUNK, BLOCK_V):
        v = chunk * CHUNK + start + tl.arange(0, BLOCK_V)
        score = tl.load(logits_ptr + row * stride_s + v, mask=v < vocab, other=float("-inf")).to(tl.float32)
        if not GREEDY:
            u = ((_hash32(key ^ v.to(tl.uint32)) >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216)  # (0, 1)
            score = tl.where(temp == 0, score, score * inv_t - tl.log(-tl.log(u)))
        better = score > best_score  # per lane; on a tie the lower id, seen first, stays
        best_score = tl.where(better, score, best_score)
        best_idx = tl.where(better, v.to(tl.int64), best_idx)
    top = tl.max(best_score, axis=0)
    idx = tl.min(tl.where(best_score == top, best_idx, vocab), axis=0)  # the lowest id among the maxima
    if NUM_CHUNKS == 1:
        tl.store(tokens_ptr + row, idx)
    else:
        tl.store(part_score_ptr + row * NUM_CHUNKS + chunk, top)
        tl.store(part_idx_ptr + row * NUM_CHUNKS + chunk, idx)
        if _last_to_finish(tickets_ptr + row, NUM_CHUNKS):  # the row's last chunk picks among the chunks'
            chunks = tl.arange(0, CHUNKS_PAD)
            ok = chunks < NUM_CHUNKS
            scores = tl.load(part_score_ptr + row * NUM_CHUNKS + chunks, mask=ok, other=float("-inf"),
                             cache_modifier=".cg")
            ids = tl.load(part_idx_ptr + row * NUM_CHUNKS + chunks, mask=ok, other=vocab, cache_modifier=".cg")
            tl.store(tokens_ptr + row, tl.min(tl.where(scores == tl.max(scores, axis=0), ids, vocab), axis=0))


def race_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
                greedy: bool = False, pdl: bool = False) -> torch.Tensor:
    """Logits [S, V] -> tokens [S] int64: argmax at temperature 0, else a draw from softmax(logits / temperature)
    whose noise depends only on (seed, counter, token id); -inf logits are never drawn. One program per (row,
    vocabulary chunk). greedy=True (every temperature 0, known on the host) skips the noise."""
    _check_race_args(logits, temperature, seeds, counters)
    s, vocab = logits.shape
    if s > MAX_TICKETS:
        raise ValueError(f"race_sample takes at most {MAX_TICKETS} rows, got {s}")
    chunks = triton.cdiv(vocab, RACE_CHUNK)
    tokens = torch.empty(s, dtype=torch.int64, device=logits.device)
    if s:
        part_score = torch.empty((s, chunks), dtype=torch.float32, device=logits.device)
        part_idx = torch.empty((s, chunks), dtype=torch.int64, device=logits.device)
        _race_kernel[(s, chunks)](
            logits, temperature.float().contiguous(), seeds.contiguous(), counters.contiguous(), part_score, part_idx,
            _tickets(logits.device), tokens, vocab, logits.stride(0), NUM_CHUNKS=chunks, CHUNK=RACE_CHUNK, BLOCK_V=1024,
            CHUNKS_PAD=triton.next_power_of_2(chunks), GREEDY=greedy, num_warps=4, **_launch_options(pdl))
    return tokens


# -- 2.7 prefill_attention: paged_attention for prompt steps, in balanced units of work (needs 1.4, 2.1, 2.3) --
# The same arguments and result as 1.4, for any step (prompt chunks and decodes mixed), without what slows 1.4:
# - a mask on every key tile: here the tiles wholly below a query tile's diagonal take an unmasked loop, the one
#   or two it cuts a masked one, and the tiles above it are never loaded;
# - a long row walking every key alone while SMs idle: where a step's query tiles leave half the programs without
#   one (a chunk on a long prefix, long decodes beside a short prompt), its keys split over up to num_splits
#   units, merged by the last to finish in the same launch, as in 2.3 (only rows of many key tiles: elsewhere the
#   partials' stores and merges cost more than they balance);
# - a decode beside a prompt padded to the prompt's query tile: here a decode's unit is its group's rows alone;
# - a program for each request row, where a prompt graph has max_num_seqs + 1 rows, mostly padding: here a few
#   programs an SM take units (query tile x split x kv head) from a shared counter until none is left, so a
#   padding row costs one element of a vector, and no SM idles while another has units to run.
@triton.jit
def _attend_tiles(q, m, l, acc, q_pos, tile_lo, tile_hi, kv_end, block_row, k_head_ptr, v_head_ptr, stride_cache_block,
                  stride_cache_tok, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The online softmax of q [BLOCK_M, D] carried over key tiles tile_lo .. tile_hi - 1 of one kv head (k_head_ptr,
    v_head_ptr: the caches offset to it) -> (m, l, acc).
    MASKED: row r sees the keys up to q_pos[r], and keys from kv_end on load as 0 (0 * NaN would be NaN);
    else every row sees every key, and each load is a plain one that the pipeline issues stages ahead."""
    dims = tl.arange(0, HEAD_DIM)
    for tile in range(tile_lo, tile_hi):
        keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok, zero = (keys < kv_end, 0) if MASKED else (None, None)  # tl.load takes no fill without a mask
        block = tl.load(block_row + keys // BLOCK_SIZE, mask=key_ok, other=zero).to(tl.int64)  # [BLOCK_N]
        kv = (block * stride_cache_block + (keys % BLOCK_SIZE) * stride_cache_tok)[:, None] + dims[None, :]
        kv_ok = key_ok[:, None] if MASKED else None
        k = tl.load(k_head_ptr + kv, mask=kv_ok, other=zero)  # [BLOCK_N, D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if MASKED:
            s = tl.where(keys[None, :] <= q_pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_head_ptr + kv, mask=kv_ok, other=zero)  # [BLOCK_N, D]
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m = m_new
    return m, l, acc


@triton.jit
def _splits_of(seq_len, num_splits, min_split_tiles, BLOCK_N: tl.constexpr):
    """Splits a query tile with this context may take: at most num_splits, of min_split_tiles key tiles at least."""
    return tl.maximum(tl.minimum(tl.cdiv(tl.cdiv(seq_len, BLOCK_N), min_split_tiles), num_splits), 1)


@triton.jit
def _attend_unit(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_ml_ptr, ticket_ptr, block_row, q_start,
                 q_len, seq_len, q_tile, split, splits, per_split, kv_head, rows_per_split, stride_qt, stride_qh,
                 stride_cache_block, stride_cache_tok, stride_cache_head, qk_scale, NUM_KV_HEADS: tl.constexpr,
                 GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """One unit: query tile q_tile (BLOCK_Q tokens x the group's heads, BLOCK_M rows) of one request, over split
    `split` of its keys (per_split key tiles each). Writes out, or its partial; the tile's last split merges."""
    # Token j of the chunk sits at position seq_len - q_len + j. Every row sees the keys up to the tile's first
    # position (no mask), the diagonal's tiles up to kv_end (masked); a padding request (seq_len 0) sees none.
    first_pos = seq_len - q_len + q_tile * BLOCK_Q
    kv_end = tl.maximum(first_pos + tl.minimum(q_len - q_tile * BLOCK_Q, BLOCK_Q), 0)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    full_tiles = tl.maximum(first_pos + 1, 0) // BLOCK_N
    splits_used = tl.maximum(tl.cdiv(num_tiles, per_split), 1)  # a tile near the prompt's start needs fewer
    tile_lo = split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, num_tiles)
    if split < splits_used:
        rows = tl.arange(0, BLOCK_M)
        q_idx = q_tile * BLOCK_Q + rows // GROUP_PAD  # [BLOCK_M] each row's token among the request's new ones
        head = kv_head * GROUP + rows % GROUP_PAD
        row_ok = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
        token = (q_start + q_idx).to(tl.int64)
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]
        m = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # running max: finite, so exp2(m - m_new) is never NaN
        l = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        q_pos = first_pos + rows // GROUP_PAD
        k_head, v_head = k_cache_ptr + kv_head * stride_cache_head, v_cache_ptr + kv_head * stride_cache_head
        m, l, acc = _attend_tiles(q, m, l, acc, q_pos, tile_lo, tl.minimum(tile_hi, full_tiles), kv_end, block_row,
                                  k_head, v_head, stride_cache_block, stride_cache_tok, qk_scale, HEAD_DIM,
                                  BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION)
        m, l, acc = _attend_tiles(q, m, l, acc, q_pos, tl.maximum(tile_lo, full_tiles), tile_hi, kv_end, block_row,
                                  k_head, v_head, stride_cache_block, stride_cache_tok, qk_scale, HEAD_DIM,
                                  BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION)
        row = token * (NUM_KV_HEADS * GROUP) + head  # [BLOCK_M] (token, head) row of out
        done = splits_used == 1
        if SPLIT:
            if splits_used > 1:  # publish this split's partial; the tile's last split to finish merges them
                _store_partial(m, l, acc, split, row, row_ok, rows_per_split, part_out_ptr, part_ml_ptr, HEAD_DIM)
                done = _last_to_finish(ticket_ptr, splits_used)
                if done:
                    m, l, acc = _merge_splits(0, splits_used, 1, row, row_ok, rows_per_split, part_out_ptr,
                                              part_ml_ptr, BLOCK_M, HEAD_DIM)
        if done:
            out = acc / tl.where(l > 0, l, 1.0)[:, None]  # a row that saw no key stays 0
            tl.store(out_ptr + row[:, None] * HEAD_DIM + dims[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_seqs", "num_splits", "min_split_tiles", "rows_per_split", "stride_bt"])
def _prefill_attention_kernel(
    q_ptr,  # [T, H, D] strided view: this step's queries (prompt chunks and decodes alike)
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, Hkv, D] each, with the same strides
    out_ptr,  # [T, H, D] contiguous
    part_out_ptr,  # [num_splits, T, H, D] float32 unnormalised partials (SPLIT only)
    part_ml_ptr,  # [num_splits, T, H, 2] float32 their running max and sum (SPLIT only)
    tickets_ptr,  # int32 zeros (_tickets): [0] the next unit, [1] programs done, then each tile's splits done
    query_start_loc_ptr,  # [B + 1] int32: request b's tokens are [qsl[b], qsl[b + 1])
    seq_lens_ptr,  # [B] context length including this step's tokens; 0: a padding request
    block_table_ptr,  # [B, max_blocks] int32: request b's KV blocks, in order
    num_seqs,  # B, at most BLOCK_B
    num_splits,  # splits a query tile may take, at most
    min_split_tiles,  # key tiles a split covers at least
    rows_per_split,  # T * H: the rows of out, and of each split's partials
    stride_qt, stride_qh,  # q's strides: tokens, heads
    stride_cache_block, stride_cache_tok, stride_cache_head,
    stride_bt,  # elements between two rows of the block table
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,  # Hkv, and query heads per kv head
    GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,  # GROUP rounded up to a power of two; D
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    BLOCK_Q: tl.constexpr,  # query tokens a unit
    BLOCK_M: tl.constexpr,  # query rows a unit: BLOCK_Q tokens x GROUP_PAD heads (>= 16 for tl.dot)
    BLOCK_MD: tl.constexpr,  # query rows a decode's unit: one token x GROUP_PAD heads (>= 16)
    BLOCK_N: tl.constexpr,  # keys a tile
    BLOCK_B: tl.constexpr,  # requests scanned as one vector (PREFILL_MAX_SEQS)
    SPLIT: tl.constexpr,  # num_splits > 1
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,  # see _wait_for_inputs
):
    _wait_for_inputs(PDL)
    # Request b's items are its query tiles x its splits, numbered after request b - 1's; a unit is an item and
    # a kv head. Every program counts them alike from the lengths, in one vector of the batch's requests.
    reqs = tl.arange(0, BLOCK_B)
    in_batch = reqs < num_seqs
    q_lens = (tl.load(query_start_loc_ptr + reqs + 1, mask=in_batch, other=0)
              - tl.load(query_start_loc_ptr + reqs, mask=in_batch, other=0))
    req_splits = _splits_of(tl.load(seq_lens_ptr + reqs, mask=in_batch, other=0).to(tl.int32), num_splits,
                            min_split_tiles, BLOCK_N) if SPLIT else 1
    # The prompts' items first (their longest rows lead), then the decodes' (one token: a tile of BLOCK_MD rows,
    # not BLOCK_M rows of which all but GROUP are padding).
    decode = q_lens == 1
    ends = tl.cumsum(tl.where(decode, 0, tl.cdiv(q_lens, BLOCK_Q)) * req_splits, axis=0)  # one past each's last
    prompt_items = tl.max(ends, axis=0)
    decode_ends = prompt_items + tl.cumsum(tl.where(decode, req_splits, 0), axis=0)
    num_units = tl.max(decode_ends, axis=0) * NUM_KV_HEADS
    unit = tl.atomic_add(tickets_ptr, 1, sem="relaxed")
    while unit < num_units:
        next_unit = tl.atomic_add(tickets_ptr, 1, sem="relaxed")  # fetched now: its round trip hides behind this unit
        item, kv_head = unit // NUM_KV_HEADS, unit % NUM_KV_HEADS
        is_decode = item >= prompt_items
        first, bounds = tl.where(is_decode, prompt_items, 0), tl.where(is_decode, decode_ends, ends)
        before = bounds <= item  # the requests wholly before this item
        req = tl.sum(before.to(tl.int32), axis=0)
        local = item - tl.max(tl.where(before, bounds, first), axis=0)  # the item among its request's
        q_start = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
        splits = _splits_of(seq_len, num_splits, min_split_tiles, BLOCK_N) if SPLIT else 1
        per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len, BLOCK_N), splits), 1)  # a request's splits: as many tiles
        split = local % splits
        q_tile = tl.cdiv(q_len, BLOCK_Q) - 1 - local // splits  # the last tile first (its rows see the most keys)
        ticket = tickets_ptr + 2 + (item - split) * NUM_KV_HEADS + kv_head
        block_row = block_table_ptr + req.to(tl.int64) * stride_bt
        if is_decode:  # one token (q_tile 0): the unit's rows are its group's, not a prompt tile's BLOCK_M
            _attend_unit(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_ml_ptr, ticket, block_row,
                         q_start, q_len, seq_len, q_tile, split, splits, per_split, kv_head, rows_per_split, stride_qt,
                         stride_qh, stride_cache_block, stride_cache_tok, stride_cache_head, qk_scale, NUM_KV_HEADS,
                         GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, 1, BLOCK_MD, BLOCK_N, SPLIT, DOT_PRECISION)
        else:
            _attend_unit(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_ml_ptr, ticket, block_row,
                         q_start, q_len, seq_len, q_tile, split, splits, per_split, kv_head, rows_per_split, stride_qt,
                         stride_qh, stride_cache_block, stride_cache_tok, stride_cache_head, qk_scale, NUM_KV_HEADS,
                         GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_Q, BLOCK_M, BLOCK_N, SPLIT, DOT_PRECISION)
        unit = next_unit
    if _last_to_finish(tickets_ptr + 1, tl.num_programs(0)):
        tl.atomic_xchg(tickets_ptr, 0)  # every program has taken its last unit: the next launch counts from 0


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float, max_query_len: int,
                      pdl: bool = False, min_tokens: int = 0) -> torch.Tensor:
    """paged_attention's result, out [T, H, D]. The grid (PREFILL_PROGRAMS_PER_SM programs an SM) and the splits
    depend on T, B, Hkv and max_query_len, never on the lengths: a graph can replay it. Past PREFILL_MAX_SEQS
    requests, or under min_tokens tokens (a host-side size), paged_attention runs instead."""
    _check_attention_args(q, k_cache, v_cache, query_start_loc, seq_lens, block_table)
    t, h, d = q.shape
    b, hkv, block_size = seq_lens.shape[0], k_cache.shape[2], k_cache.shape[1]
    if b > PREFILL_MAX_SEQS or t < min_tokens:
        return paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale, max_query_len)
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0 or b == 0:
        return out
    group_pad = triton.next_power_of_2(h // hkv)
    # A decode batch has one token a request; else full tiles, so a load run compiles no new tiles mid-run.
    block_q = 1 if max_query_len == 1 else max(1, PREFILL_BLOCK_M // group_pad)
    block_m, programs = max(16, block_q * group_pad), PREFILL_PROGRAMS_PER_SM * _sm_count(q.device)
    # A split costs its float32 partial and a merge, which only idle programs repay: split only where T tokens, in
    # as few query tiles as they can make, leave half the programs without a unit.
    units = triton.cdiv(t, block_q) * hkv
    splits = 1 if 2 * units > programs else \
        max(1, min(PREFILL_MAX_SPLITS, PREFILL_SPLIT_UNITS_PER_SM * programs // units))
    if 2 + (t // block_q + b) * splits * hkv > MAX_TICKETS:  # a bound on the split tiles' tickets
        splits = 1
    part_out, part_ml = (torch.empty((splits, t, h, n), dtype=torch.float32, device=q.device) for n in (d, 2)) \
        if splits > 1 else (out, out)  # out: never read unless split
    _prefill_attention_kernel[(min(programs, (t // block_q + b) * splits * hkv),)](
        q, k_cache, v_cache, out, part_out, part_ml, _tickets(q.device), query_start_loc, seq_lens, block_table, b,
        splits, max(1, PREFILL_MIN_SPLIT_TILES), t * h, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), block_table.stride(0), scale * LOG2E, NUM_KV_HEADS=hkv,
        GROUP=h // hkv, GROUP_PAD=group_pad, HEAD_DIM=d, BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_MD=max(16, group_pad), BLOCK_N=PREFILL_BLOCK_N, BLOCK_B=PREFILL_MAX_SEQS, SPLIT=splits > 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=PREFILL_WARPS if block_m >= 64 else 4, num_stages=PREFILL_STAGES, **_launch_options(pdl))
    return out
