"""Triton kernels for nanoengine, each beside a plain-torch reference.

Every kernel comes as three pieces with the same arguments:
  _name_kernel  the Triton program;
  name()        the launcher: checks inputs, picks block sizes from host-side sizes only, launches;
  name_ref()    plain torch, the CPU path of the engine and what the tests compare against.

Rules every launcher keeps:
  * no host sync (no .item(), .tolist(), nonzero, bincount, boolean masks; no grid computed from device
    values), so each launch can be captured in a CUDA graph and replayed with new batch contents;
  * loads are upcast to float32 before any arithmetic and results are cast back once, at the store;
  * pointer offsets that can pass 2**31 (cache slots, expert weights) are computed in int64.

This file imports nothing from the rest of nanoengine. Tests: the kernel section of test_all.py
(on a CPU they run in the Triton interpreter, TRITON_INTERPRET=1).
"""

import functools
import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# tl.dot needs every dimension of its tiles to be at least 16.
MIN_DOT = 16
# Row kernels (norms): at most this many elements per program; 4096 bf16 = 8 KB keeps loads wide ...
ELEMENTS_PER_PROGRAM = 4096
# ... but short rows are packed only while the grid keeps about two programs per SM of an H200 (132 SMs).
MIN_PROGRAMS = 256
# moe_align: the single-program Triton kernel walks the assignments in chunks of 1024, so its time grows
# with their number (H200: 2.4 us at 8, 46 us at 16384, against ~125 us for torch's sort at 8K-32K); past
# this many it is expected to lose to the parallel sort of the torch path. Both are sync-free.
MOE_ALIGN_KERNEL_MAX_ASSIGNMENTS = 32768
# fused_moe: up to this many tokens take the decode path (two GEMV kernels, one program per assignment,
# no moe_align, no silu_and_mul launch, the top-k sum in registers) instead of sorting assignments into
# padded blocks. At 4 tokens x top-8 of 128 experts nearly every assignment has an expert to itself, so
# sorting saves no weight reads and costs three launches; with more tokens, assignments that share an
# expert each re-read its weights and the sorted path should win. A guess: tune it on the H200 with the
# fused_moe_decode rows of `run.py kernels --only moe`.
MOE_DECODE_MAX_TOKENS = 4
# ... whose gate_up kernel takes (BLOCK_N, BLOCK_K, num_warps) = these on 16-bit weights: narrower, shorter
# tiles than linear()'s (two 2 KB tiles a step, 768 programs at 1 token) measured fastest in an H200
# sweep at Qwen3-30B-A3B shapes: 24.3 against 27.1 us for the layer at 1 token, 77.6 against 86.7 at 4.
MOE_DECODE_GATE_UP_BLOCKS = (8, 128, 8)
# Paged attention: keys per tile (a tile spans several paged blocks, gathered token by token).
ATTN_BLOCK_N = 64
# Decode attention over short contexts packs several kv heads of a request into one program. With one
# program per (request, kv head), a program of a short context is a chain of dependent round trips (the
# lengths, the block table, K and V) with little work between, and a big batch waits on them wave after
# wave. A program that takes several kv heads loads their keys side by side as one tile (a token's kv
# heads are adjacent in the cache) and masks each query row to its own head's columns. Heads are packed
# until the grid is down to about this many programs (2 per SM of an H200): Qwen3-0.6B heads, RoPE
# inside, 28-layer chains in a graph (H200, 2026-12-02), us a layer at 33-64-key contexts: 64 requests,
# 2 heads a program, 9.17 against 9.75; 128 requests, 4 heads, 13.4 against 15.5; 256, 8 heads, 21.3
# against 24.6 ...
ATTN_PACK_PROGRAMS = 256
# ... but only when the host knows every context is at most this many keys (decode_attention's
# max_seq_len): every masked column still costs its share of the tile's exp2 and dot. At 65-128 keys
# packing still won (256 requests 35.1 against 38.7 us, 128: 21.3 against 22.8, 64: level), at 256 x
# 100-1,024 keys 4 heads a program lost (189 against 156). The graph runner captures a graph for each
# side of this bound (decode_context_bounds) and replays the one the batch's longest context allows.
ATTN_PACK_MAX_CONTEXT = 128
# ... and a packed program's key tiles have 128 columns (keys x heads), in 3 stages: the sweep's best
# (64 columns: 25.1 us at 256 x 33-64; 2 stages within 3%).
ATTN_PACK_BLOCK_N = 128
ATTN_PACK_STAGES = 3
# Paged attention: query rows (query tokens x heads of one kv group) per program at prefill.
ATTN_PREFILL_BLOCK_M = 64
# paged_attention_ref runs in bounded memory whatever the batch: a request's new tokens go in chunks of at
# most this many queries, and chunks go together while their scores and gathered keys stay within
# ATTN_REF_ELEMENTS float32 elements each (64 MB). Built whole, the scores of a 16,384-token prefill batch
# took tens of GB (`run.py bench` on the CPU).
ATTN_REF_QUERY_CHUNK = 64
ATTN_REF_ELEMENTS = 1 << 24
# Split-KV: aim for this many programs per SM so decode at small batch still fills the GPU; a decode
# program uses ~40 KB of shared memory, so several run on an SM at once. 4 measured best on an H200
# (batch 1-16, contexts 1K-8K) against 2 and 8 ...
ATTN_PROGRAMS_PER_SM = 4
# ... with at least ATTN_MIN_SPLIT_TOKENS keys per split (below), and never more splits than this (each
# keeps a float32 partial of its rows for the merge).
ATTN_MAX_SPLITS = 64
# The split merge is a two-level tree of this fan-in: the last split of each group of 8 merges its group,
# the last group merges the groups, so 64 splits cost 2 x 7 dependent loads, not 63 (batch 1 x 8K).
ATTN_MERGE_FAN_IN = 8
# Paged attention: a split covers at least this many keys (rounded up to whole key tiles). The split
# count is fixed on the host from the block table's width (the graph's maximum context), so without a
# floor a 128-token context was spread over up to 64 splits of a couple of keys each, every one paying
# for a program, a float32 partial and the merge (5.6 us at batch 1 on an H200). With it, contexts up to
# 128 keys run as one split that writes its output directly. Not more than 128 (2 tiles of 64): at batch
# 1 an 8K context then still gets 64 splits per kv head, the 4 programs per SM measured best above.
ATTN_MIN_SPLIT_TOKENS = 128
# Split reductions finish in-kernel: each program of a group that splits one reduction (split-KV
# attention, the sampler's vocabulary chunks) takes a ticket from an atomic counter after writing its
# partial, and the one that draws the last ticket combines them and resets the counter. That replaces a
# second kernel whose launch cost ~3 us per layer at small batch (H200), even when, at short contexts,
# it had nothing to merge. The counters are one zeroed buffer per device that every last program
# restores to zero, so no memset is needed between calls or graph replays; this many groups at most.
MAX_TICKETS = 1 << 16
# Sampling: vocabulary ids per program of the race kernel (152K ids: 19 programs a row), and per loop step.
RACE_CHUNK = 8192
RACE_BLOCK_V = 1024
# linear(): the Triton skinny GEMM takes at most this many rows (max_rows caps it lower; the engine picks
# by model in build_model), more go to F.linear.
LINEAR_MAX_M = 256
# At 128-256 rows cuBLAS wins on a wide matrix, whose many output tiles fill the GPU and run its better
# main loop (Qwen3-0.6B's gate/up, 6144 outputs: 7.8 against 9.6 us at 256 rows; the lm_head 134 against
# 190), but not on a narrow one of at most this many outputs: there it splits K and adds a reduction
# kernel, with a launch gap before each of its kernels. At 256 rows q/k/v (4096 outputs), o and down (1024)
# took 6.1-6.2 / 5.6 / 7.3 us against cuBLAS's 6.7 / 6.5 / 7.8, at 128 rows 5.0 / 5.1 / 6.9 against 5.6 /
# 6.1 / 8.5 (each a 28-layer chain in a CUDA graph, H200, 2026-12-02). So linear() takes a second cap,
# narrow_rows, for them.
LINEAR_NARROW_N = 4096
# ... one row runs on CUDA-core FMAs (one per weight element, ~6% of the H200's fp32 peak at 4.3 TB/s);
# 2 or more rows pad to a power of two from 16 and run on tl.dot, since 16 FMAs per element would reach
# that peak and make the arithmetic, not the memory, the limit; a program takes at most this many rows
# where rows are long (K >= LINEAR_LONG_K: Qwen3-0.6B's o and down, 32 beat 64 and 128 at 64-256 rows) ...
LINEAR_DOT_MAX_BLOCK_M = 32
# ... and up to this many on shorter rows (K = 1024: q/k/v, gate/up, lm_head), where a weight tile's few K
# steps are better spent on more rows than re-read by a second row block: 64 rows of gate/up in one block
# took 5.3 us against 5.9 or more in blocks of 32, 128 rows of q/k/v in blocks of 64 4.6 against 5.3 or
# more (H200 sweep, 2026-12-01) ...
LINEAR_DOT_SHORT_MAX_BLOCK_M = 128
# ... while the tiles leave this many programs, first narrowing the row block (down to the cap above), then
# the tile: about one program per SM, three quarters of the H200's 132 being better than two waves. With
# 96 (128 before) the rule picks the row block and tile width that sweep found best for q/k/v, o, gate/up
# and down at 64-256 rows, within 1%.
LINEAR_DOT_MIN_PROGRAMS = 96
# ... and each program keeps this many K steps in flight (pipeline stages): 4 against the one-row path's 3
# took 64 rows of q/k/v, o, gate/up and down from 5.3 / 4.9 / 5.8 / 6.8 to 4.3 / 4.2 / 5.4 / 5.6 us (each
# timed as a 28-layer chain in a CUDA graph, H200), and 16 rows of q/k/v from 4.4 to 3.6.
LINEAR_DOT_STAGES = 4
# ... or more, up to LINEAR_DOT_MAX_STAGES, while the stages' tiles (weight and x) stay within this many bytes
# of shared memory: at 256 rows o and down's 32 x 64 x 128 tiles (24 KB a stage) took 5.6 and 7.3 us with 5
# stages against 6.2 and 8.1 with 4 (H200 sweep, 2026-12-02).
LINEAR_DOT_PIPELINE_BYTES = 120 * 1024
LINEAR_DOT_MAX_STAGES = 5
# Weight bytes per program per K step: 16 KB in flight per program (8192 bf16, 4-8 x 16 B loads per
# thread on the FMA path); two or more programs per SM then keep the ~32 KB per SM in flight that
# 4.3 TB/s needs at ~1 us DRAM latency.
LINEAR_TILE_BYTES = 16384
# ... and on the one-row path, rows that split into whole steps of this many elements take it as the
# K step (see _linear_blocks).
LINEAR_LONG_K = 2048
# add_rmsnorm_linear makes the normed row inside the one-row matmul only in tiles of this many weight
# rows or more (see there).
LINEAR_NORM_MIN_BLOCK_N = 16
# Stands in for -inf as the running max: exp2(m_old - m_new) stays finite (no inf - inf = NaN) even for
# query rows that see no key at all (padding requests with seq_len 0). A constexpr so kernels may read it.
NEG_BIG = tl.constexpr(-1.0e30)
LOG2E = 1.4426950408889634


def _next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _elementwise_warps(block_elements: int) -> int:
    # One warp moves 32 x 16 B per instruction; more warps only help once the tile is large.
    return 4 if block_elements <= 2048 else 8


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs: exact products ("ieee"), so float32 runs match the references tightly; tl.dot's
    # default would round them to tf32 on the GPU. Other dtypes ignore it; "tf32" is the default.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {tuple(t.stride())}")


# ---------------------------------------------------------------------------------------------------
# Programmatic dependent launch: the next kernel is already on the SMs when this one ends
# ---------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _use_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch needs Hopper (sm_90) or later; the interpreter has no such thing."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def _pdl(device: torch.device) -> dict:
    """Launch options of every kernel here: as a programmatic dependent launch where the GPU has it."""
    return dict(PDL=True, launch_pdl=True) if _use_pdl(device) else dict(PDL=False)


@triton.jit
def _wait_for_inputs(PDL: tl.constexpr, RELEASE_NEXT: tl.constexpr = True):
    """Every kernel here calls this before it reads anything another kernel writes: as its first statement,
    or, in linear, after prefetching its weights. A decode step is a chain of a few hundred short kernels,
    and between two of them the GPU normally drains the first, then launches the second and spreads its
    programs over the SMs: about a microsecond a kernel in which no byte moves. Launched as a
    programmatic dependent launch (PDL), the next kernel starts while this one runs: its programs take
    their places on the SMs and wait here, at griddepcontrol.wait, until the kernel before has finished
    and its writes are visible, then go at once. A kernel lets the next one launch only after its own
    wait, so at most two kernels are in flight, and each still sees the writes of every kernel before
    it (it waits for its predecessor, which waited for its own). Without PDL (an older GPU, or the CPU's
    interpreter) nothing is called and the launch waits as usual.

    RELEASE_NEXT=False: the next kernel is launched only as this one's programs exit, not while they
    run. Decode attention asks for that. Its programs hold most of every SM's shared memory, so the o
    matmul's programs, dispatched early, find room only on the SMs whose attention programs finish first,
    and, by all appearances, pile up there, two or three to an SM, while other SMs get none: at 64 rows
    that matmul took 8.6 us after attention against 5.0 us alone. Released as attention exits, a
    64-request Qwen3-0.6B step took 1.126 against 1.265 ms, 16 requests 0.958 against 0.995, one request
    the same (same-machine H200 A/B)."""
    if PDL:
        gdc_wait()
        if RELEASE_NEXT:
            gdc_launch_dependents()


@triton.jit
def _prefetch_l2(base_ptr, row_offs, row_ok, row_len, BLOCK: tl.constexpr):
    """Ask L2 for elements [0, min(row_len, BLOCK)) of each row_ok row at base_ptr + row_offs [R, 1]:
    one prefetch.global.L2 per 128-byte line, and no register waits for it. CUDA only (inline PTX)."""
    LINE: tl.constexpr = 1024 // base_ptr.dtype.element_ty.primitive_bitwidth  # elements per 128 bytes
    offs = tl.arange(0, (BLOCK + LINE - 1) // LINE) * LINE  # one line at least (16 float32 on a short tile)
    ok = row_ok[:, None] & (offs[None, :] < row_len)
    ptrs = base_ptr + tl.where(ok, row_offs + offs[None, :], 0)  # the rest ask for element 0 again
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@functools.lru_cache(maxsize=None)
def _tickets(device: torch.device) -> torch.Tensor:
    """The device's ticket counters (see MAX_TICKETS). Made on the first call, which in the engine is an
    eager warm-up, so the buffer is ordinary memory, not a graph pool's."""
    return torch.zeros(MAX_TICKETS, dtype=torch.int32, device=device)


@triton.jit
def _last_to_finish(ticket_ptr, group_size):
    """Called by every program of a group after it stored its partial: True in exactly one, the last.
    The barrier makes all this program's threads' stores precede the ticket, and the atomic's
    acquire-release order makes every earlier program's partial visible to the one that sees the last
    ticket. That one resets the counter for the next call."""
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    last = ticket == group_size - 1
    if last:
        tl.atomic_xchg(ticket_ptr, 0)
    return last


# ---------------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _rmsnorm_kernel(
    x_ptr,  # [N0, N1, D], strided rows
    weight_ptr,  # [D]
    out_ptr,  # [N0 * N1, D] contiguous
    num_rows,  # N0 * N1
    rows_inner,  # N1 (heads when x is a per-head view)
    stride_x0,
    stride_x1,
    dim,  # D
    eps,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (see _wait_for_inputs)
):
    _wait_for_inputs(PDL)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < num_rows
    col_ok = cols < dim
    mask = row_ok[:, None] & col_ok[None, :]
    x_row = (rows // rows_inner).to(tl.int64) * stride_x0 + (rows % rows_inner) * stride_x1
    x = tl.load(x_ptr + x_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / dim + eps)
    y = x * inv_rms[:, None] * w[None, :]
    out_row = rows.to(tl.int64) * dim
    tl.store(out_ptr + out_row[:, None] + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows_per_program(num_rows: int, block_d: int) -> int:
    # Short rows (per-head norm, D=128) are packed several to a program so each moves up to ~8 KB.
    rows = min(ELEMENTS_PER_PROGRAM // block_d, num_rows // MIN_PROGRAMS)
    return 1 if rows < 1 else 1 << (rows.bit_length() - 1)  # a power of two, rounded down


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] (last dim contiguous; leading dims may be strided) -> x * rsqrt(mean(x^2) + eps) * weight."""
    _check_last_dim_contiguous("x", x)
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"weight must have shape ({dim},) to match x's last dim, got {tuple(weight.shape)}")
    x3 = x if x.dim() == 3 else x.reshape(-1, 1, dim) if x.dim() <= 2 else x.reshape(-1, x.shape[-2], dim)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows = x3.shape[0] * x3.shape[1]
    if num_rows == 0:
        return out
    block_d = _next_pow2(dim)
    block_rows = _rows_per_program(num_rows, block_d)
    _rmsnorm_kernel[(triton.cdiv(num_rows, block_rows),)](
        x3, weight, out, num_rows, x3.shape[1], x3.stride(0), x3.stride(1), dim, eps,
        BLOCK_ROWS=block_rows, BLOCK_D=block_d, **_pdl(x.device), num_warps=_elementwise_warps(block_rows * block_d),
    )
    return out


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype)


# ---------------------------------------------------------------------------------------------------
# Residual add + RMSNorm
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr,  # [N, D], row stride stride_x
    residual_ptr,  # [N, D] contiguous; overwritten with x + residual
    weight_ptr,  # [D]
    out_ptr,  # [N, D] contiguous
    num_rows,
    stride_x,
    dim,
    eps,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (see _wait_for_inputs)
):
    _wait_for_inputs(PDL)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < dim
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    x_offs = rows.to(tl.int64)[:, None] * stride_x + cols[None, :]
    r_offs = rows.to(tl.int64)[:, None] * dim + cols[None, :]
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(residual_ptr + r_offs, mask=mask, other=0.0).to(tl.float32)
    # Round the sum to the residual's dtype before normalising: the next layer reads the rounded residual,
    # so the norm must see the same numbers.
    s = (x + r).to(residual_ptr.dtype.element_ty)
    tl.store(residual_ptr + r_offs, s, mask=mask)
    s = s.to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(s * s, axis=1) / dim + eps)
    y = s * inv_rms[:, None] * w[None, :]
    tl.store(out_ptr + r_offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rmsnorm(x + residual), x + residual). The sum is written IN PLACE into `residual`,
    which is returned as the second value; `out` is a new tensor. residual must be contiguous."""
    _check_last_dim_contiguous("x", x)
    if residual.shape != x.shape or not residual.is_contiguous():
        raise ValueError(f"residual must be contiguous with x's shape {tuple(x.shape)}, "
                         f"got shape {tuple(residual.shape)} strides {tuple(residual.stride())}")
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"weight must have shape ({dim},) to match x's last dim, got {tuple(weight.shape)}")
    x2 = x.reshape(-1, dim)  # a view unless x's leading dims are strided oddly
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows = x2.shape[0]
    if num_rows == 0:
        return out, residual
    block_d = _next_pow2(dim)
    block_rows = _rows_per_program(num_rows, block_d)
    _add_rmsnorm_kernel[(triton.cdiv(num_rows, block_rows),)](
        x2, residual, weight, out, num_rows, x2.stride(0), dim, eps,
        BLOCK_ROWS=block_rows, BLOCK_D=block_d, **_pdl(x.device), num_warps=_elementwise_warps(block_rows * block_d),
    )
    return out, residual


def add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as add_rmsnorm: the sum is written into `residual` in place."""
    residual.copy_((x.float() + residual.float()).to(residual.dtype))
    return rmsnorm_ref(residual, weight, eps), residual


# ---------------------------------------------------------------------------------------------------
# SiLU(gate) * up
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [N, 2I], row stride stride_x
    out_ptr,  # [N, I] contiguous
    stride_x,
    inter,  # I
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (see _wait_for_inputs)
):
    _wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * inter + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [N, 2I] -> silu(x[:, :I]) * x[:, I:], [N, I]."""
    if x.dim() != 2 or x.shape[1] % 2 != 0:
        raise ValueError(f"x must be [N, 2I] with an even last dim, got shape {tuple(x.shape)}")
    _check_last_dim_contiguous("x", x)
    n, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    block = min(_next_pow2(inter), 1024)
    _silu_and_mul_kernel[(n, triton.cdiv(inter, block))](
        x, out, x.stride(0), inter, BLOCK=block, **_pdl(x.device), num_warps=4,
    )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


# ---------------------------------------------------------------------------------------------------
# Sampling: the exponential race (Gumbel-max) over the vocabulary, with counter-based noise
# ---------------------------------------------------------------------------------------------------


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
    seeds_ptr,  # [S] int64
    counters_ptr,  # [S] int64: index of the token being sampled
    part_score_ptr,  # [S, NUM_CHUNKS] float32 scratch: best score of each chunk
    part_idx_ptr,  # [S, NUM_CHUNKS] int64 scratch: its vocabulary id
    tickets_ptr,  # [>= S] int32 zeros: chunks of the row done so far
    tokens_ptr,  # [S] int64 out
    vocab,
    stride_s,
    NUM_CHUNKS: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,  # NUM_CHUNKS rounded up to a power of two
    CHUNK: tl.constexpr,  # vocabulary ids per program
    BLOCK_V: tl.constexpr,  # ids per loop step
    GREEDY: tl.constexpr,  # every row has temperature 0: plain argmax, no noise to make
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (see _wait_for_inputs)
):
    _wait_for_inputs(PDL)
    # argmax_v softmax(l / T)_v / E_v with E_v ~ Exp(1) draws v from softmax(l / T) (the exponential race);
    # in logs that is argmax_v l_v / T - log(E_v): no softmax, one read of the logits, noise made in
    # registers from (seed, counter, v), so no [S, V] noise tensor ever exists.
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
        mask = v < vocab
        score = tl.load(logits_ptr + row * stride_s + v, mask=mask, other=float("-inf")).to(tl.float32)
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
        # The row's last chunk to finish picks the winner among the chunks' (the lowest id on a tie).
        if _last_to_finish(tickets_ptr + row, NUM_CHUNKS):
            chunks = tl.arange(0, CHUNKS_PAD)
            ok = chunks < NUM_CHUNKS
            scores = tl.load(part_score_ptr + row * NUM_CHUNKS + chunks, mask=ok, other=float("-inf"),
                             cache_modifier=".cg")
            ids = tl.load(part_idx_ptr + row * NUM_CHUNKS + chunks, mask=ok, other=vocab, cache_modifier=".cg")
            tl.store(tokens_ptr + row, tl.min(tl.where(scores == tl.max(scores, axis=0), ids, vocab), axis=0))


def _check_race_args(logits, temperature, seeds, counters) -> None:
    if logits.dim() != 2 or not logits.is_floating_point() or not logits.is_contiguous():
        raise ValueError(f"logits must be a contiguous float [S, V], got {logits.dtype} {tuple(logits.shape)}")
    s = logits.shape[0]
    for name, t in (("temperature", temperature), ("seeds", seeds), ("counters", counters)):
        if t.shape != (s,):
            raise ValueError(f"{name} must be [{s}], got {tuple(t.shape)}")


def race_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                counters: torch.Tensor, greedy: bool = False) -> torch.Tensor:
    """Logits [S, V] (float32, or 16-bit read as float32) -> tokens [S] int64: argmax where temperature is
    0, else a draw from softmax(logits / temperature) whose noise depends only on (seed, counter, token id).
    Logits set to -inf (top-k / top-p filtering) are never drawn. One kernel over (row, vocabulary chunk);
    the last chunk of a row to finish picks the row's token. greedy=True (every temperature 0, known on
    the host) skips the noise."""
    _check_race_args(logits, temperature, seeds, counters)
    s, vocab = logits.shape
    if s > MAX_TICKETS:
        raise ValueError(f"race_sample takes at most {MAX_TICKETS} rows, got {s}")
    chunks = triton.cdiv(vocab, RACE_CHUNK)
    tokens = torch.empty(s, dtype=torch.int64, device=logits.device)
    if s == 0:
        return tokens
    part_score = torch.empty((s, chunks), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty((s, chunks), dtype=torch.int64, device=logits.device)
    _race_kernel[(s, chunks)](
        logits, temperature.float().contiguous(), seeds.contiguous(), counters.contiguous(), part_score, part_idx,
        _tickets(logits.device), tokens, vocab, logits.stride(0),
        NUM_CHUNKS=chunks, CHUNKS_PAD=_next_pow2(chunks), CHUNK=RACE_CHUNK, BLOCK_V=RACE_BLOCK_V, GREEDY=greedy,
        **_pdl(logits.device), num_warps=4,
    )
    return tokens


def _hash32_ref(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 in int64 arithmetic, keeping the low 32 bits (int64 products wrap, low bits intact)."""
    m = 0xFFFFFFFF
    x = (x ^ (x >> 16)) * 0x7FEB352D & m
    x = (x ^ (x >> 15)) * 0x846CA68B & m
    return x ^ (x >> 16)


def race_noise_ref(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """[S, V] uniforms in (0, 1), the ones the kernel makes in registers."""
    m = 0xFFFFFFFF
    key = _hash32_ref((seeds & m) ^ _hash32_ref(seeds >> 32 & m) ^ _hash32_ref(counters * 0x9E3779B9 & m))
    ids = torch.arange(vocab, device=seeds.device)
    return ((_hash32_ref(key[:, None] ^ ids[None, :]) >> 8).float() + 0.5) * (1.0 / (1 << 24))


def race_sample_ref(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                    counters: torch.Tensor, greedy: bool = False) -> torch.Tensor:
    _check_race_args(logits, temperature, seeds, counters)
    logits = logits.float()  # exact for 16-bit logits: what the kernel does in registers
    if greedy:
        return logits.argmax(dim=1)
    u = race_noise_ref(seeds, counters, logits.shape[1])  # [S, V]: what makes this path memory-heavy
    t = temperature.float()[:, None]
    score = torch.where(t == 0, logits, logits / t.clamp(min=1e-5) - torch.log(-torch.log(u)))
    return score.argmax(dim=1)


# ---------------------------------------------------------------------------------------------------
# MoE routing: softmax over the router's logits, top-k experts, optional renormalisation, in one launch
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _moe_route_kernel(
    logits_ptr,  # [T, E] router logits, contiguous
    weights_ptr,  # [T, TOP_K] out: routing weights, in the logits' dtype
    ids_ptr,  # [T, TOP_K] out: expert ids (int64), best first
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORM: tl.constexpr,  # divide the k weights by their sum (Qwen3-MoE's norm_topk_prob)
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (see _wait_for_inputs)
):
    _wait_for_inputs(PDL)
    # One program per token. torch needs five launches for this (float cast, softmax, topk, sum, divide),
    # each a few microseconds at decode, in every MoE layer; here k rounds of max over E values.
    t = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, EXPERTS_PAD)
    x = tl.load(logits_ptr + t * NUM_EXPERTS + experts, mask=experts < NUM_EXPERTS,
                other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)  # [EXPERTS_PAD] softmax; padding lanes are 0
    ks = tl.arange(0, K_PAD)
    top_w = tl.zeros([K_PAD], dtype=tl.float32)
    top_ids = tl.zeros([K_PAD], dtype=tl.int64)
    for j in tl.static_range(TOP_K):  # pick the best, then knock it out
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, experts, EXPERTS_PAD), axis=0)  # lowest id on a tie
        top_w = tl.where(ks == j, best, top_w)
        top_ids = tl.where(ks == j, idx.to(tl.int64), top_ids)
        p = tl.where(experts == idx, -1.0, p)
    if RENORM:
        top_w = top_w / tl.sum(top_w, axis=0)
    mask = ks < TOP_K
    tl.store(weights_ptr + t * TOP_K + ks, top_w.to(weights_ptr.dtype.element_ty), mask=mask)
    tl.store(ids_ptr + t * TOP_K + ks, top_ids, mask=mask)


def _check_moe_route_args(logits, top_k) -> None:
    if logits.dim() != 2 or not logits.is_contiguous():
        raise ValueError(f"router logits must be a contiguous [T, E] matrix, got {tuple(logits.shape)}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k={top_k} must be in [1, E={logits.shape[1]}]")


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k] int64), best first:
    softmax in float32, the top k, and with renormalize the k weights divided by their sum."""
    _check_moe_route_args(logits, top_k)
    t, e = logits.shape
    weights = torch.empty((t, top_k), dtype=logits.dtype, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    if t:
        _moe_route_kernel[(t,)](logits, weights, ids, NUM_EXPERTS=e, EXPERTS_PAD=_next_pow2(e), TOP_K=top_k,
                                K_PAD=_next_pow2(top_k), RENORM=renormalize, **_pdl(logits.device), num_warps=1)
    return weights, ids


def moe_route_ref(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """As Hugging Face's Qwen3-MoE block does it."""
    _check_moe_route_args(logits, top_k)
    probs = torch.softmax(logits.float(), dim=-1)  # (T, E)
    weights, ids = probs.topk(top_k, dim=-1)       # (T, k)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits.dtype), ids


# ---------------------------------------------------------------------------------------------------
# MoE alignment: group (token, expert) assignments by expert, each group padded to a multiple of block_m
# ---------------------------------------------------------------------------------------------------


def moe_max_padded(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Length of sorted_ids: an upper bound on the padded total that depends only on sizes.

    Each expert that receives tokens wastes at most block_m - 1 padding slots, and at most
    min(num_assignments, num_experts) experts receive tokens. Using that min (not num_experts)
    keeps decode grids small: 1 token x top-8 of 128 experts needs 9 blocks of 16, not 121."""
    bound = num_assignments + min(num_assignments, num_experts) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


@triton.jit
def _moe_align_kernel(
    topk_ids_ptr,  # [A] flat expert id of each assignment a = token * k + j
    sorted_ids_ptr,  # [max_padded] out: assignment indices grouped by expert; padding = A
    block_expert_ptr,  # [max_padded // BLOCK_M] out: expert of each block
    num_padded_ptr,  # [1] out: padded length in use
    cursor_ptr,  # [EXPERTS_PAD] int32 scratch: token counts, then each expert's next free slot
    num_assignments,  # A
    max_padded,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,  # next power of two >= NUM_EXPERTS
    BLOCK_M: tl.constexpr,  # each expert's group is padded to a multiple of this
    BLOCK_A: tl.constexpr,  # assignments (or slots) handled per loop step
    BLOCK_B: tl.constexpr,  # blocks handled per loop step
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (see _wait_for_inputs)
):
    _wait_for_inputs(PDL)
    # One program, so tl.debug_barrier (a CTA-wide barrier, which also orders the CTA's global memory
    # accesses) can separate the phases; a second launch would cost more than the whole kernel.
    # Atomics do the counting and slot claiming: the alternative, one-hot [assignments x experts] tiles
    # with a prefix sum, measured 13 us at 1 token and 340 us at 256 tokens on an H200.
    experts = tl.arange(0, EXPERTS_PAD)
    lanes = tl.arange(0, BLOCK_A)
    tl.store(cursor_ptr + experts, tl.zeros([EXPERTS_PAD], dtype=tl.int32))
    for p0 in range(0, max_padded, BLOCK_A):  # every slot starts as padding
        tl.store(sorted_ids_ptr + p0 + lanes, tl.zeros([BLOCK_A], dtype=tl.int32) + num_assignments,
                 mask=p0 + lanes < max_padded)
    tl.debug_barrier()
    for a0 in range(0, num_assignments, BLOCK_A):
        a = a0 + lanes
        ids = tl.load(topk_ids_ptr + a, mask=a < num_assignments, other=0)
        tl.atomic_add(cursor_ptr + ids, 1, mask=a < num_assignments, sem="relaxed")  # barriers order phases
    tl.debug_barrier()
    counts = tl.load(cursor_ptr + experts)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    tl.debug_barrier()  # all counts read before they are overwritten
    tl.store(cursor_ptr + experts, ends - padded)
    num_blocks = max_padded // BLOCK_M
    for b0 in range(0, num_blocks, BLOCK_B):
        blk = b0 + tl.arange(0, BLOCK_B)
        # A block belongs to the first expert whose padded group ends past the block's start.
        owner = tl.sum((ends[None, :] <= (blk * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        # Blocks past num_padded are never computed; clamping keeps their expert id a valid index anyway.
        tl.store(block_expert_ptr + blk, tl.minimum(owner, NUM_EXPERTS - 1), mask=blk < num_blocks)
    tl.debug_barrier()
    for a0 in range(0, num_assignments, BLOCK_A):
        a = a0 + lanes
        ids = tl.load(topk_ids_ptr + a, mask=a < num_assignments, other=0)
        dest = tl.atomic_add(cursor_ptr + ids, 1, mask=a < num_assignments, sem="relaxed")  # claim a slot
        tl.store(sorted_ids_ptr + dest, a, mask=a < num_assignments)


def _check_moe_align_args(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be an int32/int64 [N, k] tensor, got {topk_ids.dtype} "
                         f"shape {tuple(topk_ids.shape)}")
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"num_experts and block_m must be positive, got {num_experts}, {block_m}")


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the N*k assignments by expert, each group padded to a multiple of block_m.

    Returns sorted_ids int32 [max_padded] (flat assignment index token*k + j; padding = N*k),
    block_expert int32 [max_padded // block_m], num_padded int32 [1] (on device).
    max_padded = moe_max_padded(N*k, num_experts, block_m) depends only on sizes, never on routing.
    The order of assignments within an expert's group is unspecified (slots are claimed by atomics);
    no result depends on it. Expert ids must lie in [0, num_experts)."""
    _check_moe_align_args(topk_ids, num_experts, block_m)
    num_assignments = topk_ids.numel()
    if num_assignments > MOE_ALIGN_KERNEL_MAX_ASSIGNMENTS:
        return moe_align_ref(topk_ids, num_experts, block_m)
    max_padded = moe_max_padded(num_assignments, num_experts, block_m)
    device = topk_ids.device
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_padded // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    experts_pad = _next_pow2(num_experts)
    cursor = torch.empty(experts_pad, dtype=torch.int32, device=device)
    num_blocks = max_padded // block_m
    _moe_align_kernel[(1,)](
        topk_ids.reshape(-1), sorted_ids, block_expert, num_padded, cursor, num_assignments, max_padded,
        NUM_EXPERTS=num_experts, EXPERTS_PAD=experts_pad, BLOCK_M=block_m,
        BLOCK_A=min(1024, _next_pow2(max_padded)),
        BLOCK_B=min(_next_pow2(num_blocks), max(1, 8192 // experts_pad)),  # owner search tile <= 8K
        **_pdl(topk_ids.device), num_warps=4,
    )
    return sorted_ids, block_expert, num_padded


def moe_align_ref(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch version, also sync-free (it is the large-batch path of moe_align on the GPU).

    Counts come from scatter_add, not bincount: bincount sizes its output from the data's max, which
    needs the value on the host (a sync) and breaks CUDA-graph capture."""
    _check_moe_align_args(topk_ids, num_experts, block_m)
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()  # [A]
    num_assignments = flat.numel()
    max_padded = moe_max_padded(num_assignments, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)  # [E]
    order = torch.argsort(flat, stable=True)  # assignment indices grouped by expert, in order
    expert_of = flat[order]
    rank = torch.arange(num_assignments, device=device) - (counts.cumsum(0) - counts)[expert_of]
    dest = (ends - padded)[expert_of] + rank
    sorted_ids = torch.full((max_padded,), num_assignments, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    block_expert = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, block_expert.to(torch.int32), ends[-1:].to(torch.int32)


# ---------------------------------------------------------------------------------------------------
# Fused MoE: one grouped GEMM kernel, launched for gate_up and again for down
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _fused_moe_kernel(
    a_ptr,  # [rows_a, K] activations: one row per token (gate_up) or per assignment (down)
    w_ptr,  # [E, N, K] expert weights
    out_ptr,  # [A, N] one row per assignment
    sorted_ids_ptr,  # [max_padded] assignment indices grouped by expert, padding = A
    block_expert_ptr,  # [max_padded // BLOCK_M] expert of each block of sorted_ids
    num_padded_ptr,  # [1] padded length in use
    topk_weights_ptr,  # [A] router weights (read only when MUL_ROUTED_WEIGHT)
    num_assignments,  # A
    n_out,  # N
    k_in,  # K
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    A_ROW_DIV: tl.constexpr,  # activation row = assignment // A_ROW_DIV (top-k for gate_up, 1 for down)
    MUL_ROUTED_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (see _wait_for_inputs)
):
    _wait_for_inputs(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # The grid covers the worst-case padded length; blocks past the length this routing uses stop here.
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    assignment = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = assignment < num_assignments
    a_row = (assignment // A_ROW_DIV).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + ks[None, :]  # [BLOCK_M, BLOCK_K]
    # Weight tile read transposed, [BLOCK_K, BLOCK_N], so the product is a @ w.T.
    w_ptrs = w_ptr + expert * stride_we + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k_ok = ks < k_in - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if MUL_ROUTED_WEIGHT:
        router_w = tl.load(topk_weights_ptr + assignment, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * router_w[:, None]
    out_ptrs = out_ptr + assignment.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _moe_block_sizes(num_assignments: int, num_experts: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) from sizes alone.

    Up to ~16 tokens per expert the layer is memory-bound on the expert weights, and every extra block
    of an expert re-streams its weights: BLOCK_M is sized to about twice the mean tokens per expert, so
    most experts fit one block. These tiles are narrow in N (more programs streaming weights at once)
    and long in K (long contiguous weight rows). Past that, batches are compute-bound and take the
    bigger tiles that let tl.dot reuse each load more. Chosen from a sweep on an H200 at Qwen3-30B-A3B
    shapes (E=128, top-8, D=2048, I=768), where the small tiles stream weights at ~95% of bandwidth."""
    per_expert = num_assignments / num_experts
    if per_expert <= 8:
        return 16, 64, 128, 4, 4
    if per_expert <= 16:
        return 32, 64, 128, 4, 4
    if per_expert <= 64:
        return 64, 128, 64, 4, 3
    return 128, 256, 64, 8, 3  # measured 10% faster than 64 x 128 at 2048 tokens x top-8 of 128


def _moe_gemm(a, w, out, align, topk_weights, a_row_div: int, blocks) -> None:
    """out[assignment] = a[assignment // a_row_div] @ w[expert].T (* router weight when given)."""
    sorted_ids, block_expert, num_padded = align
    block_m, block_n, block_k, num_warps, num_stages = blocks
    n_out, k_in = w.shape[1], w.shape[2]
    grid = (block_expert.shape[0], triton.cdiv(n_out, block_n))
    _fused_moe_kernel[grid](
        a, w, out, sorted_ids, block_expert, num_padded,
        topk_weights if topk_weights is not None else a,
        out.shape[0], n_out, k_in, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_ROW_DIV=a_row_div, MUL_ROUTED_WEIGHT=topk_weights is not None, DOT_PRECISION=_dot_precision(a.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **_pdl(a.device), num_warps=num_warps, num_stages=num_stages,
    )


# ---------------------------------------------------------------------------------------------------
# Fused MoE at decode: a GEMV per assignment, no sorting; the weighted top-k sum in registers
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _moe_decode_gate_up_kernel(
    x_ptr,  # [N, D] tokens, row stride stride_xm
    w_ptr,  # [E, 2I, D] expert gate_up weights, gate rows first
    topk_ids_ptr,  # [A] contiguous: expert of assignment a = token * top_k + j
    act_ptr,  # [A, I] float32 out: silu(gate) * up
    top_k,
    inter,  # I
    hidden,  # D
    stride_xm,
    stride_we,
    stride_wn,
    BLOCK_N: tl.constexpr,  # gate (and as many up) rows per program
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (see _wait_for_inputs)
):
    _wait_for_inputs(PDL)
    # One row of activations: plain FMAs into one accumulator per loaded weight element, summed over K
    # once after the loop, as linear()'s M = 1 path does (tl.dot would pad the single row to 16).
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
        # [BLOCK_N, BLOCK_K] each, K contiguous: 16-byte loads
        acc_gate += tl.load(gate_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32) * x
        acc_up += tl.load(up_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32) * x
    gate = tl.sum(acc_gate, axis=1)  # [BLOCK_N]
    up = tl.sum(acc_up, axis=1)
    tl.store(act_ptr + a.to(tl.int64) * inter + cols, gate * tl.sigmoid(gate) * up, mask=col_ok)


@triton.jit
def _moe_decode_down_kernel(
    act_ptr,  # [A, I] float32, row token * top_k + j
    w_ptr,  # [E, D, I] expert down weights
    topk_ids_ptr,  # [A] contiguous
    topk_weights_ptr,  # [A] contiguous router weights
    out_ptr,  # [N, D] contiguous
    top_k,
    hidden,  # D, output features
    inter,  # I
    stride_we,
    stride_wn,
    BLOCK_N: tl.constexpr,  # output features per program
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (see _wait_for_inputs)
):
    _wait_for_inputs(PDL)
    # A program owns BLOCK_N output features of one token and walks that token's top_k experts in order,
    # so the weighted sum over experts happens in registers, in the same order on every run: no atomics,
    # no [A, D] intermediate, no separate sum. The router weight scales the activation row (w * (W @ h)
    # = W @ (w * h)), so one accumulator serves all experts and is reduced over K once at the end.
    # One flat loop over (expert, K step), not a loop over experts around a loop over K: the pipeliner
    # then issues the next experts' loads while this one's multiply-adds run. Nested, each expert (one
    # K step at I = 768) was a round trip of its own: 10.5 against 9.8 us at 1 token, 29.0 against 21.2
    # at 4 (H200, Qwen3-30B-A3B's down, expert ids cycling so none is found in L2).
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_steps = tl.cdiv(inter, BLOCK_K)
    for i in range(0, top_k * k_steps):
        j = i // k_steps  # the expert slot, then the K step within its row
        ks = (i - j * k_steps) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = t * top_k + j
        expert = tl.load(topk_ids_ptr + a).to(tl.int64)
        router_w = tl.load(topk_weights_ptr + a).to(tl.float32)
        h = tl.load(act_ptr + a.to(tl.int64) * inter + ks, mask=k_ok, other=0.0) * router_w  # [BLOCK_K] fp32
        w_rows = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * h[None, :]
    out = tl.sum(acc, axis=1)  # [BLOCK_N]
    tl.store(out_ptr + t.to(tl.int64) * hidden + cols, out.to(out_ptr.dtype.element_ty), mask=col_ok)


def moe_decode_blocks(rows: int, n_out: int, k_in: int, element_size: int,
                      tiles: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for a decode MoE kernel whose grid is rows x cdiv(n_out, BLOCK_N) and
    which streams `tiles` [BLOCK_N, BLOCK_K] weight tiles per K step (2 for gate_up, 1 for down).

    gate_up on 16-bit weights takes MOE_DECODE_GATE_UP_BLOCKS, an H200 sweep's best. Otherwise linear()'s
    M = 1 rules: the widest BLOCK_N up to 16 that still leaves MIN_PROGRAMS programs (two per SM), and
    LINEAR_TILE_BYTES of weights per program per step, narrower when K is short. Down, whose loop runs
    ahead across experts, takes narrower tiles and twice the programs: up to 8 rows, 2 x MIN_PROGRAMS.
    Qwen3-30B-A3B's down in bf16 then gets 512 tiles of 4 rows at 1 token and 1024 of 8 at 4, BLOCK_K 1024
    (I = 768 of 1024 lanes), an H200 sweep's best (9.8 against 9.9 us for 8 rows at 1 token, 21.2 against
    22.2 for 16 at 4). A separate function so a sweep can pass other triples to fused_moe_decode."""
    if tiles == 2 and element_size == 2:
        return MOE_DECODE_GATE_UP_BLOCKS
    block_n, min_programs = (16, MIN_PROGRAMS) if tiles == 2 else (8, 2 * MIN_PROGRAMS)
    while block_n > 1 and rows * triton.cdiv(n_out, block_n) < min_programs:
        block_n //= 2
    block_k = min(LINEAR_TILE_BYTES // (tiles * block_n * element_size), _next_pow2(k_in))
    # 8 warps spread a 16 KB tile at 4 x 16 B loads per thread (32 fp32 accumulators), as linear() does.
    return block_n, block_k, _elementwise_warps(tiles * block_n * block_k)


def _check_decode_blocks(name: str, blocks) -> None:
    block_n, block_k, num_warps = blocks
    for what, v in (("BLOCK_N", block_n), ("BLOCK_K", block_k), ("num_warps", num_warps)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name}: {what}={v} is invalid: it must be a power of two")


def fused_moe_decode(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_blocks: tuple[int, int, int] | None = None,
    down_blocks: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """fused_moe for a few tokens, in two launches: a gate_up GEMV with silu * up per assignment, then a
    down GEMV per token that sums its top_k experts. Same arguments and result as fused_moe (reference:
    fused_moe_ref); *_blocks override moe_decode_blocks' (BLOCK_N, BLOCK_K, num_warps).

    Every assignment streams its expert's weights on its own, so two tokens that share an expert read it
    twice: right for a handful of tokens (see MOE_DECODE_MAX_TOKENS), wasteful for a batch."""
    _check_fused_moe_args(x, gate_up, down, topk_weights, topk_ids)
    n, d = x.shape
    inter, top_k = gate_up.shape[1] // 2, topk_ids.shape[1]
    num_assignments = n * top_k
    if num_assignments == 0:
        return torch.zeros_like(x)
    out = torch.empty((n, d), dtype=x.dtype, device=x.device)  # every element written by the down kernel
    gate_up_blocks = gate_up_blocks or moe_decode_blocks(num_assignments, inter, d, gate_up.element_size(), 2)
    down_blocks = down_blocks or moe_decode_blocks(n, d, inter, down.element_size(), 1)
    _check_decode_blocks("gate_up_blocks", gate_up_blocks)
    _check_decode_blocks("down_blocks", down_blocks)
    ids = topk_ids.contiguous()  # [N, k]: no copy for moe_route's outputs
    router_w = topk_weights.contiguous()
    # float32 between the kernels: 24 KB at 1 token x top-8 x I=768, read from L2, and the output is
    # rounded once, at the end.
    act = torch.empty((num_assignments, inter), dtype=torch.float32, device=x.device)  # [A, I]
    block_n, block_k, num_warps = gate_up_blocks
    _moe_decode_gate_up_kernel[(num_assignments, triton.cdiv(inter, block_n))](
        x, gate_up, ids, act, top_k, inter, d, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        BLOCK_N=block_n, BLOCK_K=block_k, **_pdl(x.device), num_warps=num_warps,
    )
    block_n, block_k, num_warps = down_blocks
    _moe_decode_down_kernel[(n, triton.cdiv(d, block_n))](
        act, down, ids, router_w, out, top_k, d, inter, down.stride(0), down.stride(1),
        BLOCK_N=block_n, BLOCK_K=block_k, **_pdl(x.device), num_warps=num_warps,
    )
    return out


def _check_fused_moe_args(x, gate_up, down, topk_weights, topk_ids) -> None:
    if x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"expected x [N, D], gate_up [E, 2I, D], down [E, D, I], got shapes "
                         f"{tuple(x.shape)}, {tuple(gate_up.shape)}, {tuple(down.shape)}")
    n, d = x.shape
    e, two_i, _ = gate_up.shape
    if gate_up.shape[2] != d or down.shape != (e, d, two_i // 2) or two_i % 2:
        raise ValueError(f"gate_up must be [E, 2I, {d}] and down [E, {d}, I], got "
                         f"{tuple(gate_up.shape)} and {tuple(down.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != n or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must both be [{n}, k], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"gate_up and down must have x's dtype {x.dtype}, got {gate_up.dtype} and {down.dtype}")
    for name, t in (("x", x), ("gate_up", gate_up), ("down", down)):
        _check_last_dim_contiguous(name, t)


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    decode_max_tokens: int = MOE_DECODE_MAX_TOKENS,
) -> torch.Tensor:
    """out[n] = sum_j w[n, j] * down[e] @ (silu(gate[e] @ x[n]) * (up[e] @ x[n])), e = topk_ids[n, j].

    x [N, D], gate_up [E, 2I, D] (gate rows first), down [E, D, I], topk_* [N, k] -> out [N, D].
    Up to decode_max_tokens tokens run fused_moe_decode; more sort the assignments by expert and run a
    grouped GEMM per projection. A benchmark forces the sorted path with 0, the decode path with N."""
    _check_fused_moe_args(x, gate_up, down, topk_weights, topk_ids)
    if decode_max_tokens < 0:
        raise ValueError(f"decode_max_tokens={decode_max_tokens} is invalid: it must be >= 0")
    if x.shape[0] <= decode_max_tokens:
        return fused_moe_decode(x, gate_up, down, topk_weights, topk_ids)
    n, d = x.shape
    num_experts, two_i, _ = gate_up.shape
    top_k = topk_ids.shape[1]
    num_assignments = n * top_k
    if num_assignments == 0:
        return torch.zeros_like(x)
    blocks = _moe_block_sizes(num_assignments, num_experts)
    align = moe_align(topk_ids, num_experts, blocks[0])
    gate_up_out = torch.empty((num_assignments, two_i), dtype=x.dtype, device=x.device)  # [A, 2I]
    _moe_gemm(x, gate_up, gate_up_out, align, None, top_k, blocks)
    act = silu_and_mul(gate_up_out)  # [A, I]
    down_out = torch.empty((num_assignments, d), dtype=x.dtype, device=x.device)  # [A, D]
    router_w = topk_weights.reshape(-1).contiguous()  # [A], a view unless the caller sliced it
    _moe_gemm(act, down, down_out, align, router_w, 1, blocks)
    return down_out.view(n, top_k, d).sum(dim=1)  # [N, D]


def fused_moe_ref(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Sort the assignments by expert, then one pair of matmuls per expert with tokens.

    Reads the per-expert counts to the host once (one sync; this is the CPU path, where it is free)."""
    _check_fused_moe_args(x, gate_up, down, topk_weights, topk_ids)
    n, d = x.shape
    num_experts = gate_up.shape[0]
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()  # [A]
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    out = torch.zeros((n * top_k, d), dtype=torch.float32, device=x.device)  # [A, D]
    start = 0
    for e, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        assignment = order[start:start + count]
        start += count
        xe = x[assignment // top_k].float()  # [count, D]
        gate, up = (xe @ gate_up[e].float().t()).chunk(2, dim=-1)  # [count, I] each
        ye = (torch.nn.functional.silu(gate) * up) @ down[e].float().t()  # [count, D]
        out[assignment] = ye * topk_weights.reshape(-1)[assignment].float()[:, None]
    return out.view(n, top_k, d).sum(dim=1).to(x.dtype)


# ---------------------------------------------------------------------------------------------------
# RoPE (neox / HF rotate_half), optionally after per-head RMSNorm (Qwen3 q_norm / k_norm), and the
# KV-cache write, in one launch
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _rope_heads(
    x_ptr,  # this token's first head
    stride_h,
    out_ptr,  # where the rotated heads go: x_ptr itself, or the token's KV-cache slot
    out_stride_h,
    norm_ptr,  # [D] RMSNorm weight (read only when HAS_NORM)
    cos,  # [HALF] float32
    sin,  # [HALF] float32
    eps,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HALF)
    mask = (heads < NUM_HEADS)[:, None]
    ptrs1 = x_ptr + heads[:, None] * stride_h + dims[None, :]  # [HEADS_PAD, HALF] first halves
    x1 = tl.load(ptrs1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs1 + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        inv_rms = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        x1 = x1 * inv_rms[:, None] * tl.load(norm_ptr + dims).to(tl.float32)[None, :]
        x2 = x2 * inv_rms[:, None] * tl.load(norm_ptr + HALF + dims).to(tl.float32)[None, :]
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    out_ptrs = out_ptr + heads[:, None] * out_stride_h + dims[None, :]
    tl.store(out_ptrs, out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptrs + HALF, out2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_write_kv_kernel(
    q_ptr,  # [T, H, D] strided view, rotated in place
    k_ptr,  # [T, Hkv, D] strided view, read only: rotated into the cache
    v_ptr,  # [T, Hkv, D] strided view, copied into the cache
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D] contiguous
    v_cache_ptr,
    slot_mapping_ptr,  # [T] slot = block * block_size + offset; -1 = padding row
    scratch_slot,  # first slot of the last (never handed out) block
    positions_ptr,  # [T]
    cos_sin_ptr,  # [max_pos, D] float32: cos in the first half, sin in the second
    q_norm_ptr,  # [D]
    k_norm_ptr,  # [D]
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,  # D // 2
    HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (see _wait_for_inputs)
):
    _wait_for_inputs(PDL)
    # One program per token does every q, k and v head: cos/sin are loaded once and the whole
    # norm + rotate + KV-cache write chain is one launch instead of several per layer.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    dims = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + dims).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + dims).to(tl.float32)
    _rope_heads(q_ptr + t * stride_qt, stride_qh, q_ptr + t * stride_qt, stride_qh, q_norm_ptr, cos, sin, eps,
                NUM_Q_HEADS, Q_HEADS_PAD, HALF, HAS_NORM)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    # Padding rows (CUDA-graph filler) still run; send them to the scratch block so no real block changes.
    slot = tl.where(slot < 0, scratch_slot, slot)
    cache_off = slot * (NUM_KV_HEADS * 2 * HALF)
    _rope_heads(k_ptr + t * stride_kt, stride_kh, k_cache_ptr + cache_off, 2 * HALF, k_norm_ptr, cos, sin,
                eps, NUM_KV_HEADS, KV_HEADS_PAD, HALF, HAS_NORM)
    heads = tl.arange(0, KV_HEADS_PAD)
    all_dims = tl.arange(0, 2 * HALF)
    mask = (heads < NUM_KV_HEADS)[:, None]
    v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + all_dims[None, :], mask=mask)
    tl.store(v_cache_ptr + cache_off + heads[:, None] * (2 * HALF) + all_dims[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check_rope_args(q, k, positions, cos_sin_cache, q_norm_weight, k_norm_weight) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q must be [T, H, D] and k [T, Hkv, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    t, _, d = q.shape
    if d % 2 or d & (d - 1):
        raise ValueError(f"head_dim must be an even power of two, got {d}")
    if positions.shape != (t,):
        raise ValueError(f"positions must be [{t}], got {tuple(positions.shape)}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != d:
        raise ValueError(f"cos_sin_cache must be [max_pos, {d}], got {tuple(cos_sin_cache.shape)}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("pass both q_norm_weight and k_norm_weight, or neither")
    if q_norm_weight is not None and (q_norm_weight.shape != (d,) or k_norm_weight.shape != (d,)):
        raise ValueError(f"norm weights must be [{d}], got {tuple(q_norm_weight.shape)} and "
                         f"{tuple(k_norm_weight.shape)}")
    for name, x in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache)):
        _check_last_dim_contiguous(name, x)


def _check_write_kv_args(k, v, k_cache, v_cache, slot_mapping) -> None:
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k and v must both be [T, Hkv, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    t, hkv, d = k.shape
    if k_cache.dim() != 4 or k_cache.shape[2:] != (hkv, d) or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, {hkv}, {d}], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if slot_mapping.shape != (t,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int64 [{t}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    _check_last_dim_contiguous("k", k)
    _check_last_dim_contiguous("v", v)


def rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> None:
    """q [T, H, D] in place: optional per-head RMSNorm, then rotate_half RoPE with
    cos = cos_sin_cache[pos, :D/2], sin = cos_sin_cache[pos, D/2:]. k [T, Hkv, D] the same, but written
    straight to its slot of k_cache [num_blocks, block_size, Hkv, D] (k itself is left as it was), and v
    beside it in v_cache. Strided views are fine. Slot -1 rows go to the last block (scratch, never handed
    to a request)."""
    _check_rope_args(q, k, positions, cos_sin_cache, q_norm_weight, k_norm_weight)
    _check_write_kv_args(k, v, k_cache, v_cache, slot_mapping)
    t, h, d = q.shape
    hkv = k.shape[1]
    if t == 0:
        return
    has_norm = q_norm_weight is not None
    q_pad, kv_pad = _next_pow2(h), _next_pow2(hkv)
    _rope_write_kv_kernel[(t,)](
        q, k, v, k_cache, v_cache, slot_mapping, (k_cache.shape[0] - 1) * k_cache.shape[1], positions,
        cos_sin_cache,
        q_norm_weight if has_norm else cos_sin_cache, k_norm_weight if has_norm else cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        eps, NUM_Q_HEADS=h, NUM_KV_HEADS=hkv, Q_HEADS_PAD=q_pad, KV_HEADS_PAD=kv_pad, HALF=d // 2,
        HAS_NORM=has_norm, **_pdl(q.device), num_warps=_elementwise_warps((q_pad + 2 * kv_pad) * d),
    )


def _rope_one_ref(x, cos, sin, norm_weight, eps) -> None:
    xf = x.float()  # [T, heads, D]
    if norm_weight is not None:
        xf = rmsnorm_ref(xf, norm_weight, eps)
    x1, x2 = xf.chunk(2, dim=-1)
    x.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype))


def rope_write_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> None:
    _check_rope_args(q, k, positions, cos_sin_cache, q_norm_weight, k_norm_weight)
    _check_write_kv_args(k, v, k_cache, v_cache, slot_mapping)
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    _rope_one_ref(q, cos, sin, q_norm_weight, eps)
    k = k.clone()  # the kernel leaves k as it was
    _rope_one_ref(k, cos, sin, k_norm_weight, eps)
    scratch_slot = (k_cache.shape[0] - 1) * k_cache.shape[1]
    slots = torch.where(slot_mapping < 0, scratch_slot, slot_mapping).long()
    hkv, d = k.shape[1], k.shape[2]
    k_cache.view(-1, hkv, d)[slots] = k.to(k_cache.dtype)  # [num_slots, Hkv, D]
    v_cache.view(-1, hkv, d)[slots] = v.to(v_cache.dtype)


# ---------------------------------------------------------------------------------------------------
# Paged attention: one kernel for prefill, decode and mixed batches, with optional split-KV
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _rope_tile(x, x_swap, swap, norm_ptr, cos, sin, eps, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """[R, HEAD_DIM] float32: heads x, optionally RMSNormed, then rotated: x * cos + rotate_half(x) * sin,
    with sin's first half negated by the caller. rotate_half pairs dim d with swap[d] = d + HEAD_DIM/2
    (mod HEAD_DIM), so the caller loads each head twice: straight (x) and with its halves swapped
    (x_swap, at swap)."""
    dims = tl.arange(0, HEAD_DIM)
    x, x_swap = x.to(tl.float32), x_swap.to(tl.float32)
    if HAS_NORM:
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        x = x * inv_rms * tl.load(norm_ptr + dims).to(tl.float32)[None, :]
        x_swap = x_swap * inv_rms * tl.load(norm_ptr + swap).to(tl.float32)[None, :]
    return x * cos[None, :] + x_swap * sin[None, :]


@triton.jit
def _attend_tiles(
    q,  # [BLOCK_M, HEAD_DIM] query rows (tokens x heads of one kv group)
    q_pos,  # [BLOCK_M] position of each row's token; a key j is visible iff j <= q_pos
    m,  # [BLOCK_M] running max, sum and unnormalised output to go on from
    l,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    block_table_row_ptr,  # this request's row of the block table
    kv_head_off,  # (first) kv head * stride_cache_head
    row_head,  # [BLOCK_M] each row's kv head among the program's packed ones (0 unless PACK_SHIFT)
    stride_cache_head,
    stride_cache_block,
    stride_cache_tok,
    kv_end,  # keys [0, kv_end) may be visible to some row of this tile
    tile_lo,  # this split's key tiles: [tile_lo, tile_hi)
    tile_hi,
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # columns of a key tile: BLOCK_N >> PACK_SHIFT keys x 2^PACK_SHIFT kv heads
    PACK_SHIFT: tl.constexpr,  # log2 of the kv heads a program packs (0: one)
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax over key tiles; returns the running (max, sum, unnormalised output)."""
    dims = tl.arange(0, HEAD_DIM)
    cols = tl.arange(0, BLOCK_N)
    # Column c is key c >> PACK_SHIFT of the tile, in packed kv head c & (2^PACK_SHIFT - 1): a key's kv
    # heads sit side by side in the cache, so a tile reads runs of 2^PACK_SHIFT * HEAD_DIM elements.
    col_head = cols & ((1 << PACK_SHIFT) - 1)
    for tile in range(tile_lo, tile_hi):
        keys = tile * (BLOCK_N >> PACK_SHIFT) + (cols >> PACK_SHIFT)
        key_ok = keys < kv_end
        # A tile spans several pages: look up each key's page, so any page size works.
        page = tl.load(block_table_row_ptr + keys // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
        kv_offs = (page * stride_cache_block + (keys % PAGE_SIZE) * stride_cache_tok + kv_head_off
                   + col_head * stride_cache_head)
        k = tl.load(k_cache_ptr + kv_offs[None, :] + dims[:, None], mask=key_ok[None, :], other=0.0)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = (keys[None, :] <= q_pos[:, None]) & key_ok[None, :]
        if PACK_SHIFT > 0:  # a row scores only its own head's columns; the others' p is 0, so P @ V stays per head
            visible = visible & (col_head[None, :] == row_head[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        # Masked keys must load as 0, not whatever the page holds: 0 * NaN garbage would still be NaN.
        v = tl.load(v_cache_ptr + kv_offs[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    return m, l, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, H, D] strided view
    k_cache_ptr,  # [num_blocks, page_size, Hkv, D]
    v_cache_ptr,  # same shape and strides as k_cache
    query_start_loc_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32 or int64, context length including this step's tokens
    block_table_ptr,  # [B, max_blocks] int32
    out_ptr,  # [T, H, D] contiguous: written here by rows whose keys fit one split
    part_out_ptr,  # [num_splits, T, H, D] float32 unnormalised (SPLIT only)
    part_ml_ptr,  # [num_splits, T, H, 2] float32 running max and sum (same)
    tickets_ptr,  # int32 zeros: per (request, kv head, query tile), groups done, then splits done per group
    num_tokens,  # T
    num_splits,  # splits launched per query tile (a host-side upper bound); 1 unless SPLIT
    k_new_ptr,  # [T, Hkv, D] strided view: this step's keys (ROPE only: rotated and written to the cache)
    v_new_ptr,  # [T, Hkv, D] strided view: this step's values (ROPE only: written to the cache)
    slot_mapping_ptr,  # [T] their cache slots; -1 = padding row (ROPE only)
    positions_ptr,  # [T] their positions (ROPE only)
    scratch_slot,  # first slot of the last (never handed out) block
    cos_sin_ptr,  # [max_pos, D] float32: cos in the first half, sin in the second (ROPE only)
    q_norm_ptr,  # [D] per-head RMSNorm weights (ROPE with HAS_NORM only)
    k_norm_ptr,
    eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_cache_block,
    stride_cache_tok,
    stride_cache_head,
    stride_bt,
    qk_scale,
    NUM_HEADS: tl.constexpr,  # H
    GROUP: tl.constexpr,  # H // Hkv query heads share a kv head
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program; BLOCK_M = BLOCK_Q * GROUP_PAD rows
    BLOCK_M: tl.constexpr,  # (packed decode: at least 2^PACK_SHIFT * GROUP_PAD)
    BLOCK_N: tl.constexpr,
    PACK_SHIFT: tl.constexpr,  # decode: each program takes 2^PACK_SHIFT kv heads (ATTN_PACK_PROGRAMS)
    SPLIT: tl.constexpr,  # num_splits > 1 (a run-time count, so every count shares one compiled kernel)
    MIN_SPLIT_TILES: tl.constexpr,  # key tiles a split covers at least
    MERGE_FAN_IN: tl.constexpr,  # splits merged per group (the first level of the merge tree)
    DOT_PRECISION: tl.constexpr,
    DECODE: tl.constexpr,  # every request has one query token, so token b is request b's
    ROPE: tl.constexpr,  # decode_attention: rotate q and the new k here, and write the new k and v
    HAS_NORM: tl.constexpr,  # ... after Qwen3's per-head RMSNorm
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (see _wait_for_inputs)
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1) << PACK_SHIFT  # the first of this program's kv heads
    # Query tiles in reverse: under the causal mask the last tiles see the most keys, and launching
    # them first keeps them from running alone at the end of a prefill.
    if SPLIT:
        q_tile = tl.num_programs(2) // num_splits - 1 - tl.program_id(2) // num_splits
        split = tl.program_id(2) % num_splits
    else:
        q_tile = tl.num_programs(2) - 1 - tl.program_id(2)
        split = 0
    # At short contexts a program mostly waits on its chain of dependent loads, not on the KV bytes, and
    # a GPU issues a warp's instructions in order: the first use of a loaded value stalls every load
    # behind it. So the lengths are loaded together (a decode batch skips query_start_loc altogether),
    # and the query is loaded before anything waits on seq_len: lengths and query, then the block
    # table, then K and V. What the host stages (lengths, positions, slots, cos and sin; no kernel writes
    # them) is loaded before the wait, so under PDL it is on its way while the q/k/v matmul still runs,
    # and only q, k and v wait (H200, ms a Qwen3-0.6B step: 1 request 0.860 -> 0.831, 64: 1.187 -> 1.157).
    seq_len = tl.load(seq_lens_ptr + req)
    if DECODE:
        q_start = req
        q_len = 1
    else:
        q_start = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    dims = tl.arange(0, HEAD_DIM)
    if ROPE:  # the new token's slot and position (seq_len - 1), and cos and sin there
        slot = tl.load(slot_mapping_ptr + req).to(tl.int64)
        pos = tl.load(positions_ptr + req).to(tl.int64)
        half = dims % (HEAD_DIM // 2)
        cos = tl.load(cos_sin_ptr + pos * stride_cs + half)
        sin = tl.load(cos_sin_ptr + pos * stride_cs + HEAD_DIM // 2 + half)
    _wait_for_inputs(PDL, RELEASE_NEXT=False)  # see there: the next kernel launches as this one exits
    if not DECODE:
        # The grid is sized for the longest query; tiles past this request's tokens have nothing to do.
        if q_tile * BLOCK_Q >= q_len:
            return
    rows = tl.arange(0, BLOCK_M)
    # Row r is query head r % GROUP_PAD of packed kv head row_head (0 unless PACK_SHIFT) of token q_idx.
    row_head = (rows // GROUP_PAD) & ((1 << PACK_SHIFT) - 1)
    q_idx = q_tile * BLOCK_Q + ((rows // GROUP_PAD) >> PACK_SHIFT)  # [BLOCK_M] query token within the request
    head = (kv_head + row_head) * GROUP + rows % GROUP_PAD
    row_ok = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
    token = (q_start + q_idx).to(tl.int64)
    q_rows = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh  # [BLOCK_M, 1]
    m = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if ROPE:
        # Decode: the new token sits at the end of its context (position seq_len - 1). Its query heads
        # are rotated here, in registers, and its key and value are used from registers too: the cache
        # walk below stops before it, so no program waits for it to reach memory. Split 0 of each
        # (request, kv head) writes them to the cache for later steps, and starts from that key.
        swap = (dims + HEAD_DIM // 2) % HEAD_DIM  # rotate_half's partner of each dim
        q = tl.load(q_rows + dims[None, :], mask=row_ok[:, None], other=0.0)
        q_swap = tl.load(q_rows + swap[None, :], mask=row_ok[:, None], other=0.0)
        # The new key and value of the rows' kv head: [1, HEAD_DIM], or packed, a row each [BLOCK_M, HEAD_DIM].
        if PACK_SHIFT > 0:
            kv_of = (kv_head + row_head)[:, None]
        else:
            kv_of = tl.zeros([1, 1], dtype=tl.int32) + kv_head
        k_row = k_new_ptr + req.to(tl.int64) * stride_kt + kv_of * stride_kh
        k = tl.load(k_row + dims[None, :])
        k_swap = tl.load(k_row + swap[None, :])
        v = tl.load(v_new_ptr + req.to(tl.int64) * stride_vt + kv_of * stride_vh + dims[None, :])
        sin = tl.where(dims < HEAD_DIM // 2, -sin, sin)  # rotate_half(x) = [-x2, x1]
        q = _rope_tile(q, q_swap, swap, q_norm_ptr, cos, sin, eps, HEAD_DIM, HAS_NORM)
        q = q.to(q_ptr.dtype.element_ty)
        if split == 0:
            k = _rope_tile(k, k_swap, swap, k_norm_ptr, cos, sin, eps, HEAD_DIM, HAS_NORM)
            k = k.to(k_cache_ptr.dtype.element_ty)
            slot = tl.where(slot < 0, scratch_slot, slot)  # padding rows write to the scratch block
            slot_ptr = slot * stride_cache_tok + kv_of * stride_cache_head + dims[None, :]
            if PACK_SHIFT > 0:  # the first query row of each packed kv head writes it
                writes = ((rows % GROUP_PAD == 0) & (rows < (GROUP_PAD << PACK_SHIFT)))[:, None]
                tl.store(k_cache_ptr + slot_ptr, k, mask=writes)
                tl.store(v_cache_ptr + slot_ptr, v.to(v_cache_ptr.dtype.element_ty), mask=writes)
            else:
                tl.store(k_cache_ptr + slot_ptr, k)
                tl.store(v_cache_ptr + slot_ptr, v.to(v_cache_ptr.dtype.element_ty))
            if seq_len > 0:  # the new key: p = 1 against a running max of its own score
                m = tl.sum(q.to(tl.float32) * k.to(tl.float32), axis=1) * qk_scale
                l = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
                acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32) + v.to(tl.float32)
    else:
        q = tl.load(q_rows + dims[None, :], mask=row_ok[:, None], other=0.0)
    # New tokens sit at the end of the context; padding requests (seq_len 0) get kv_end 0 and read no KV.
    kv_end = seq_len - q_len + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q)
    if ROPE:
        kv_end -= 1  # the new key is already counted, from registers
    kv_end = tl.maximum(kv_end, 0)
    num_tiles = tl.cdiv(kv_end, BLOCK_N >> PACK_SHIFT)
    # The split count is fixed at launch for the longest context the block table allows; this tile uses
    # only as many as its own keys need at MIN_SPLIT_TILES or more each (at least one, which writes the
    # zeros of a seq_len-0 row). The rest exit here, and the merge reads only the used ones.
    if SPLIT:
        tiles_per_split = tl.maximum(tl.cdiv(num_tiles, num_splits), MIN_SPLIT_TILES)
        splits_used = tl.maximum(tl.cdiv(num_tiles, tiles_per_split), 1)
        if split >= splits_used:
            return
        tile_lo = split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    else:
        splits_used = 1  # a constexpr, so only the direct store below is compiled
        tile_lo = 0
        tile_hi = num_tiles
    q_pos = seq_len - q_len + q_idx
    m, l, acc = _attend_tiles(
        q, q_pos, m, l, acc, k_cache_ptr, v_cache_ptr, block_table_ptr + req.to(tl.int64) * stride_bt,
        kv_head * stride_cache_head, row_head, stride_cache_head, stride_cache_block, stride_cache_tok, kv_end,
        tile_lo, tile_hi, qk_scale, HEAD_DIM, PAGE_SIZE, BLOCK_M, BLOCK_N, PACK_SHIFT, DOT_PRECISION,
    )
    row = token * NUM_HEADS + head  # [BLOCK_M] (token, head) row of out
    if SPLIT:
        if splits_used > 1:
            # Not final: publish this split's partial; the last to finish merges (below).
            _store_partial(m, l, acc, split, row, row_ok, num_tokens * NUM_HEADS, part_out_ptr, part_ml_ptr,
                           HEAD_DIM)
            # The merge is a two-level tree, so no program loads more than MERGE_FAN_IN - 1 partials one
            # round trip after another: the last split of each group of MERGE_FAN_IN merges its group
            # into the group's first slot, and the last group to finish merges the groups.
            # Tickets: one per (request, kv head, query tile) counts its groups done; after those, one per
            # group counts its splits done.
            q_tiles = tl.num_programs(2) // num_splits
            tile_id = (req * tl.num_programs(1) + tl.program_id(1)) * q_tiles + q_tile
            num_tile_ids = tl.num_programs(0) * tl.num_programs(1) * q_tiles
            groups = tl.cdiv(splits_used, MERGE_FAN_IN)
            first = split // MERGE_FAN_IN * MERGE_FAN_IN
            members = tl.minimum(splits_used - first, MERGE_FAN_IN)
            if members > 1:
                group_ticket = (tickets_ptr + num_tile_ids + tile_id * tl.cdiv(num_splits, MERGE_FAN_IN)
                                + split // MERGE_FAN_IN)
                if not _last_to_finish(group_ticket, members):
                    return
                m, l, acc = _merge_splits(first, first + members, 1, row, row_ok, num_tokens * NUM_HEADS,
                                          part_out_ptr, part_ml_ptr, BLOCK_M, HEAD_DIM)
                if groups > 1:  # publish the group's merge in its first slot, read only by the last group
                    _store_partial(m, l, acc, first, row, row_ok, num_tokens * NUM_HEADS, part_out_ptr,
                                   part_ml_ptr, HEAD_DIM)
            if groups > 1:
                if not _last_to_finish(tickets_ptr + tile_id, groups):
                    return
                m, l, acc = _merge_splits(0, splits_used, MERGE_FAN_IN, row, row_ok, num_tokens * NUM_HEADS,
                                          part_out_ptr, part_ml_ptr, BLOCK_M, HEAD_DIM)
    # A context that fits one split (all of them without SPLIT) is final here, with no partials.
    out = acc / tl.where(l > 0, l, 1.0)[:, None]  # rows that saw no key stay 0
    tl.store(out_ptr + row[:, None] * HEAD_DIM + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit
def _store_partial(m, l, acc, slot, row, row_ok, rows_per_split, part_out_ptr, part_ml_ptr, HEAD_DIM: tl.constexpr):
    """A split's (or a group's) running max, sum and unnormalised output, to partial slot `slot`."""
    dims = tl.arange(0, HEAD_DIM)
    part_row = slot * rows_per_split + row
    tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])
    tl.store(part_ml_ptr + part_row * 2, m, mask=row_ok)
    tl.store(part_ml_ptr + part_row * 2 + 1, l, mask=row_ok)


@triton.jit
def _merge_splits(lo, hi, step, row, row_ok, rows_per_split, part_out_ptr, part_ml_ptr,
                  BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Log-sum-exp merge of the partials in slots lo, lo + step, ... < hi -> (m, l, acc): rescale each
    by 2^(m_slot - m_max). A slot that saw no key of a row (m = NEG_BIG, l = 0) adds nothing. Loads go
    to L2 (.cg): the partials were written by programs on other SMs. The merging program's own partial
    is read back from memory too: merging into the registers it still held took the kernel from 96 to
    116-142 registers a thread (ptxas for sm_90), fewer programs per SM for every split launch. One slot
    per step, a round trip each, which is why the caller merges in a tree; loading 4 slots at a time as
    one [4, BLOCK_M, HEAD_DIM] tile measured far slower (168 against 35 us at batch 1 x 8K, H200)."""
    dims = tl.arange(0, HEAD_DIM)
    m = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for slot in range(lo, hi, step):
        part_row = slot * rows_per_split + row
        m_o = tl.load(part_ml_ptr + part_row * 2, mask=row_ok, other=NEG_BIG, cache_modifier=".cg")
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
    if device.type != "cuda":
        return 1  # the Triton interpreter runs programs one at a time: splitting only costs
    return torch.cuda.get_device_properties(device).multi_processor_count


def _attention_blocks(max_query_len: int, group: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_Q, BLOCK_M, BLOCK_N). Rows of a tile are BLOCK_Q query tokens x GROUP_PAD heads, so K/V
    are read once per kv head; tl.dot needs BLOCK_M >= 16, so decode pads its 1 x G rows up to 16."""
    group_pad = _next_pow2(group)
    block_m = _next_pow2(max_query_len) * group_pad
    block_m = max(MIN_DOT, group_pad, min(block_m, ATTN_PREFILL_BLOCK_M))
    # Keep one K or V tile at 16 KB in bf16 so several pipeline stages fit in shared memory.
    block_n = max(MIN_DOT, min(ATTN_BLOCK_N, 8192 // head_dim))
    return block_m // group_pad, block_m, block_n


def _past_one_wave(programs: int, device: torch.device) -> bool:
    """Whether a decode grid of this many (request, kv head) programs fills the GPU more than once over
    at ATTN_PROGRAMS_PER_SM each: then it needs no splits, and RoPE runs as a kernel of its own
    (decode_attention)."""
    return programs > ATTN_PROGRAMS_PER_SM * _sm_count(device)


def _decode_pack(b: int, hkv: int) -> int:
    """kv heads a decode program takes when every context is short (ATTN_PACK_PROGRAMS): a power of two
    that divides hkv, as many as still leave ATTN_PACK_PROGRAMS programs; 1 (no packing) below that."""
    most = b * hkv // ATTN_PACK_PROGRAMS
    return math.gcd(hkv, 1 << (most.bit_length() - 1)) if most > 1 else 1


def decode_context_bounds(b: int, hkv: int) -> tuple[int, ...]:
    """The longest contexts (decode_attention's max_seq_len) up to which a decode batch of b requests
    runs other tiles than past them: (ATTN_PACK_MAX_CONTEXT,) where it packs kv heads, else (). A CUDA
    graph fixes the tiles, so the graph runner captures one graph per side of each bound."""
    return (ATTN_PACK_MAX_CONTEXT,) if _decode_pack(b, hkv) > 1 else ()


def _attention_num_splits(programs: int, max_splits: int, device: torch.device) -> int:
    """Split the KV range only when the grid would leave SMs idle (decode at small batch, long context).
    Called only when each request's queries fit one tile: a prefill gets its programs from its query
    tiles, and splitting it (fp32 partials for every token) measured 2x slower at 512 tokens."""
    target = ATTN_PROGRAMS_PER_SM * _sm_count(device)
    # Round down: at batch 16, 8K context, 5 splits (640 programs) measured 20% slower than 4 (512).
    return max(1, min(target // programs, max_splits, ATTN_MAX_SPLITS))


def _check_attention_args(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, max_query_len) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"expected q [T, H, D] and k/v caches [num_blocks, page_size, Hkv, D], got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    h, d = q.shape[1], q.shape[2]
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape[3] != d or h % hkv:
        raise ValueError(f"cache head_dim must equal q's ({d}) and H={h} must be a multiple of Hkv={hkv}")
    if d < MIN_DOT or d & (d - 1) or page_size & (page_size - 1):
        raise ValueError(f"head_dim ({d}) must be a power of two >= {MIN_DOT} and the page size "
                         f"({page_size}) a power of two")
    b = seq_lens.shape[0]
    if query_start_loc is None and q.shape[0] != b:  # decode_attention: token b is request b's
        raise ValueError(f"decode_attention takes one token per request: q has {q.shape[0]} tokens, "
                         f"seq_lens {b} requests")
    qsl_shape = (b + 1,) if query_start_loc is None else tuple(query_start_loc.shape)
    if qsl_shape != (b + 1,) or block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError(f"expected query_start_loc [{b + 1}] and block_table [{b}, max_blocks], got "
                         f"{qsl_shape} and {tuple(block_table.shape)}")
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    if v_cache.stride() != k_cache.stride() or k_cache.stride(-1) != 1 or block_table.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share strides and have a contiguous head_dim, "
                         "and block_table rows must be contiguous")
    _check_last_dim_contiguous("q", q)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    max_query_len: int,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its paged context -> out [T, H, D].

    Request b owns tokens query_start_loc[b]:query_start_loc[b+1] of q, at positions
    seq_lens[b] - q_len .. seq_lens[b] - 1; every token of q must belong to a request. seq_len 0 gives
    zeros. The grid depends only on B, max_query_len (a host upper bound on q_len), H, Hkv and
    block_table.shape[1], so one launch can be graph-captured and replayed with new lengths.
    num_splits overrides the split-KV count chosen from the SM count (tests use it). Either way it is
    an upper bound: each query tile uses only the splits its keys fill at ATTN_MIN_SPLIT_TOKENS each,
    and a tile that fits one split writes its output directly, with no partials to merge."""
    _check_attention_args(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, max_query_len)
    return _attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale, max_query_len,
                      num_splits, rope=None)


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    scale: float,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """rope_write_kv, then paged_attention, for a decode batch (one new token per request: token b is
    request b's, at positions[b] = seq_lens[b] - 1), in one launch while the batch's programs fit one
    wave: one kernel less per layer (~2.7 us with its gap on an H200). k (rotated) and v go to their
    slots of the caches; k and v are left as they were, q may be rotated in place. Returns out [B, H, D].

    A bigger batch takes the two launches: fused, each program waits one more round trip (cos and sin
    need its position) before its first K/V load, once per wave of programs, and at 256 requests that
    cost more than the launch saves (935 against 692 us of attention per Qwen3-0.6B step, H200).

    max_seq_len is a host-side bound on seq_lens (None: not known). At most ATTN_PACK_MAX_CONTEXT, a big
    batch packs several kv heads into a program, and the packed programs count as one: at 256 requests x
    33-64 keys, 8 heads a program fit one wave, so one launch of 21.3 us a layer replaced two of 24.6 (H200)."""
    _check_attention_args(q, k_cache, v_cache, None, seq_lens, block_table, 1)
    _check_rope_args(q, k, positions, cos_sin_cache, q_norm_weight, k_norm_weight)
    _check_write_kv_args(k, v, k_cache, v_cache, slot_mapping)
    b, hkv = seq_lens.shape[0], k.shape[1]
    short = max_seq_len is not None and max_seq_len <= ATTN_PACK_MAX_CONTEXT
    heads = _decode_pack(b, hkv) if short else 1
    if _past_one_wave(b * hkv // heads, q.device):
        rope_write_kv(q, k, v, k_cache, v_cache, slot_mapping, positions, cos_sin_cache, q_norm_weight,
                      k_norm_weight, eps)
        # seq_lens stands in for query_start_loc, which a decode launch never reads
        return _attention(q, k_cache, v_cache, seq_lens, seq_lens, block_table, scale, 1, num_splits, rope=None,
                          heads=heads)
    has_norm = q_norm_weight is not None
    rope = (k, v, slot_mapping, positions, (k_cache.shape[0] - 1) * k_cache.shape[1], cos_sin_cache,
            q_norm_weight if has_norm else cos_sin_cache, k_norm_weight if has_norm else cos_sin_cache, eps,
            has_norm)
    # seq_lens stands in for query_start_loc, which a decode launch never reads
    return _attention(q, k_cache, v_cache, seq_lens, seq_lens, block_table, scale, 1, num_splits, rope=rope,
                      heads=heads)


def _attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale, max_query_len, num_splits,
               rope, heads=1) -> torch.Tensor:
    """The launch behind paged_attention and decode_attention; heads > 1: a decode batch of short contexts,
    that many kv heads a program (see ATTN_PACK_PROGRAMS), if it does not split."""
    t, h, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    b = seq_lens.shape[0]
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0 or b == 0:
        return out
    group = h // hkv
    block_q, block_m, block_n = _attention_blocks(max_query_len, group, d)
    q_tiles = triton.cdiv(max_query_len, block_q)
    if num_splits is None and q_tiles > 1:
        num_splits = 1
    min_split_tiles = triton.cdiv(ATTN_MIN_SPLIT_TOKENS, block_n)
    if num_splits is None:
        # More splits than the longest context the block table holds can fill would all exit at once.
        max_splits = triton.cdiv(block_table.shape[1] * page_size, block_n * min_split_tiles)
        num_splits = _attention_num_splits(b * hkv, max_splits, q.device)
    if b * hkv * q_tiles * (1 + triton.cdiv(num_splits, ATTN_MERGE_FAN_IN)) > MAX_TICKETS:  # a grid this big
        num_splits = 1  # fills the GPU without splitting
    # One query tile (decode, short chunks): 4 warps and 2 stages, not 3. Each stage holds a K and a V
    # tile in shared memory, so fewer stages let more programs share an SM, and at short contexts (a tile
    # or two per program) that hides more latency than a deeper pipeline: 6.4 vs 7.0 us per layer at
    # batch 16 and 36 vs 39 at 256 (80-token contexts), and no slower at 1K-2K contexts (H200 sweep,
    # bf16). 2 warps with 3 stages past one wave of programs was tried: level at 256 x 48-token contexts
    # (1.967 against 1.948 ms a Qwen3-0.6B step), 2.5% fewer tokens/s in run.py bench (25.6K against
    # 26.2K, H200), so one choice serves every batch, and a graph and an eager step run the same tiles.
    decode = max_query_len == 1 and t == b
    warps, stages = (8 if block_m >= 128 else 4), (2 if q_tiles == 1 else 3)
    if num_splits > 1:  # a grid small enough to split has nothing to pack
        heads = 1
    if heads > 1:  # rows: heads x GROUP_PAD; key tiles of 128 columns (keys x heads), 32 KB at bf16 x 128 dims
        block_m = max(MIN_DOT, heads * _next_pow2(group))
        block_n = max(MIN_DOT, heads, min(ATTN_PACK_BLOCK_N, 16384 // d))
        stages = ATTN_PACK_STAGES
    if num_splits > 1:
        part_out = torch.empty((num_splits, t, h, d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((num_splits, t, h, 2), dtype=torch.float32, device=q.device)
        tickets = _tickets(q.device)
    else:
        part_out = part_ml = tickets = out  # unused
    # decode_attention's new keys and RoPE inputs; without them, stand-ins the kernel never reads
    k, v, slot_mapping, positions, scratch_slot, cos_sin, q_norm, k_norm, eps, has_norm = \
        rope or (q, q, seq_lens, seq_lens, 0, q, q, q, 0.0, False)
    _paged_attention_kernel[(b, hkv // heads, q_tiles * num_splits)](
        q, k_cache, v_cache, query_start_loc, seq_lens, block_table, out, part_out, part_ml, tickets, t, num_splits,
        k, v, slot_mapping, positions, scratch_slot, cos_sin, q_norm, k_norm, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0), scale * LOG2E,
        NUM_HEADS=h, GROUP=group, GROUP_PAD=_next_pow2(group), HEAD_DIM=d, PAGE_SIZE=page_size,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, PACK_SHIFT=heads.bit_length() - 1,
        SPLIT=num_splits > 1,
        MIN_SPLIT_TILES=min_split_tiles, MERGE_FAN_IN=ATTN_MERGE_FAN_IN,
        DOT_PRECISION=_dot_precision(q.dtype), DECODE=decode,
        ROPE=rope is not None, HAS_NORM=has_norm, **_pdl(q.device), num_warps=warps, num_stages=stages,
    )
    return out


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    max_query_len: int,
) -> torch.Tensor:
    """Plain torch, no host sync, in bounded memory. Each request's new tokens are cut into chunks of up to
    ATTN_REF_QUERY_CHUNK queries (a decode token is a chunk of its own); a chunk attends to its request's
    context, so its scores are at most chunk x context, and chunks go a group at a time (ATTN_REF_ELEMENTS)."""
    _check_attention_args(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, max_query_len)
    t, h, d = q.shape
    if t == 0:  # no tokens: nothing for the empty chunks to read
        return q.clone()
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    context = block_table.shape[1] * page_size  # L: the most keys a request may have
    rows = min(max_query_len, ATTN_REF_QUERY_CHUNK)  # queries a chunk
    qsl, seq_lens = query_start_loc.long(), seq_lens.long()
    req, first = _query_chunks(qsl, rows, t)  # [N] each chunk's request and first token
    last = torch.minimum(first + rows, qsl[req + 1])  # [N] one past its last token (<= first: empty)
    # One row more than there are tokens: a chunk's rows past its last token write there, and it is dropped.
    out = torch.zeros((t + 1, h, d), dtype=torch.float32, device=q.device)
    group = max(1, ATTN_REF_ELEMENTS // (context * max(hkv * d, h * rows)))  # chunks at a time
    for c in range(0, req.shape[0], group):
        r = req[c:c + group]
        tokens = first[c:c + group, None] + torch.arange(rows, device=q.device)  # [n, rows]
        tokens = torch.where(tokens < last[c:c + group, None], tokens, t)
        pos = seq_lens[r, None] - (qsl[r + 1, None] - tokens)  # [n, rows] each query's position
        out[tokens] = _attend_chunks(q[tokens.clamp(max=t - 1)], k_cache, v_cache, block_table[r], seq_lens[r],
                                     pos, scale)
    return out[:t].to(q.dtype)  # [T, H, D]


def _query_chunks(qsl: torch.Tensor, rows: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request's new tokens cut into chunks of up to `rows`: each chunk's request and first token,
    [N] each. N is fixed on the host: the most chunks t tokens of b requests can make, (t + b (rows - 1))
    // rows; the chunks past the real ones are empty (their first token is past their request's last)."""
    b = qsl.shape[0] - 1
    per_request = (qsl[1:] - qsl[:-1] + rows - 1) // rows  # [B] chunks of each request
    ends = per_request.cumsum(0)  # [B] one past each request's last chunk
    chunk = torch.arange((t + b * (rows - 1)) // rows, device=qsl.device)  # [N]
    req = torch.searchsorted(ends, chunk, right=True).clamp(max=b - 1)
    first = qsl[req] + (chunk - ends[req] + per_request[req]) * rows
    return req, first


def _attend_chunks(q, k_cache, v_cache, block_table, seq_lens, pos, scale) -> torch.Tensor:
    """n chunks of queries, each over its own request's context: q [n, rows, H, D], block_table [n, max_blocks],
    seq_lens [n], pos [n, rows] (a query sees keys 0..pos). Masked softmax in float32 -> [n, rows, H, D]."""
    n, rows, h, d = q.shape
    num_blocks, page_size, hkv, _ = k_cache.shape
    # Unused block-table entries may hold anything; clamp so the gather stays in range (they are masked).
    pages = block_table.long().clamp(0, num_blocks - 1)
    keys = torch.arange(pages.shape[1] * page_size, device=q.device)  # [L]
    in_context = (keys[None, :] < seq_lens[:, None])[:, :, None, None]  # [n, L, 1, 1]
    # Slots past seq_len may hold anything, NaN included, and 0 * NaN is NaN: zero them before the matmuls.
    k = torch.where(in_context, k_cache[pages].reshape(n, -1, hkv, d).float(), 0.0)  # [n, L, Hkv, D]
    v = torch.where(in_context, v_cache[pages].reshape(n, -1, hkv, d).float(), 0.0)
    qg = q.float().view(n, rows, hkv, h // hkv, d)  # [n, rows, Hkv, G, D]
    scores = torch.einsum("nqhgd,nlhd->nhgql", qg, k) * scale  # [n, Hkv, G, rows, L]
    visible = (keys <= pos[:, :, None]) & (keys < seq_lens[:, None, None])  # [n, rows, L]
    visible = visible[:, None, None]  # [n, 1, 1, rows, L]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    probs = torch.where(visible.any(-1, keepdim=True), probs, 0.0)  # rows with no key: 0, not NaN
    return torch.einsum("nhgql,nlhd->nqhgd", probs, v).reshape(n, rows, h, d)


def decode_attention_ref(q, k, v, k_cache, v_cache, slot_mapping, positions, seq_lens, block_table, cos_sin_cache,
                         scale, q_norm_weight=None, k_norm_weight=None, eps=1e-6, max_seq_len=None) -> torch.Tensor:
    """rope_write_kv_ref (q rotated in place), then paged_attention_ref: what decode_attention does
    (max_seq_len only picks decode_attention's tiles)."""
    rope_write_kv_ref(q, k, v, k_cache, v_cache, slot_mapping, positions, cos_sin_cache, q_norm_weight,
                      k_norm_weight, eps)
    qsl = torch.arange(seq_lens.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention_ref(q, k_cache, v_cache, qsl, seq_lens, block_table, scale, 1)


# ---------------------------------------------------------------------------------------------------
# Linear at decode batch sizes: out = x @ weight.T (+ bias), streaming each weight row once
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _linear_kernel(
    x_ptr,  # [M, K], row stride stride_xm
    weight_ptr,  # [N, K] contiguous, as nn.Linear stores it
    bias_ptr,  # [N]; unused unless HAS_BIAS
    out_ptr,  # [M, N] contiguous ([M, N / 2] if GATED)
    residual_ptr,  # [M, K] contiguous; read if ADD
    residual_out_ptr,  # [M, K] contiguous; x + residual is written here if ADD
    norm_weight_ptr,  # [K]; read if NORM
    num_rows,  # M
    out_features,  # N (the weight's rows)
    in_features,  # K
    stride_xm,
    eps,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,  # the weight is [gate; up] (N = 2I rows) and the output silu(x @ gate.T) * (x @ up.T)
    NORM: tl.constexpr,  # one row only: the input is rmsnorm(x (+ residual)) * norm_weight (add_rmsnorm_linear)
    ADD: tl.constexpr,  # ... with the residual added first
    BLOCK_M: tl.constexpr,  # 1 on the FMA path, 16 to LINEAR_DOT_SHORT_MAX_BLOCK_M on the tl.dot path
    BLOCK_N: tl.constexpr,  # output features, i.e. weight rows, per program
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (see _wait_for_inputs)
    PREFETCH: tl.constexpr,  # with PDL: ask L2 for the first weight tile before the wait (_linear_prefetch)
):
    # A program owns BLOCK_N output features for BLOCK_M rows: up to a row block's rows that is all of
    # them, and the weight is read from memory exactly once; x (a few KB to a few hundred) is read again by
    # every program, from L2. With more rows the programs of one weight tile (one per row block) are
    # numbered side by side, so they run together and all but the first read the tile from L2.
    row_blocks = tl.cdiv(num_rows, BLOCK_M)
    pid = tl.program_id(0)
    if GATED:
        # A program's BLOCK_N weight rows are BLOCK_N / 2 gate rows, then the up rows of the same outputs,
        # so it holds both halves of each output it makes.
        outs = out_features // 2
        half = tl.arange(0, BLOCK_N) % (BLOCK_N // 2)
        cols = (pid // row_blocks) * (BLOCK_N // 2) + half  # [BLOCK_N] output of each weight row
        col_ok = cols < outs
        w_rows_of = cols + tl.where(tl.arange(0, BLOCK_N) < BLOCK_N // 2, 0, outs)  # weight row of each
    else:
        outs = out_features
        cols = (pid // row_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < outs
        w_rows_of = cols
    rows = (pid % row_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    w_offs = w_rows_of.to(tl.int64)[:, None] * in_features  # [BLOCK_N, 1]
    w_rows = weight_ptr + w_offs
    x_rows = x_ptr + rows.to(tl.int64) * stride_xm  # [BLOCK_M]
    if PDL and PREFETCH:
        # No kernel writes a weight, so the first tile can be on its way into L2 while the kernel before
        # this one still runs; only x must wait.
        _prefetch_l2(weight_ptr, w_offs, col_ok, in_features, BLOCK_K)
    _wait_for_inputs(PDL)
    if USE_DOT:
        # out^T = weight @ x^T: the weight tile is the MMA's tall operand, x pads to 16 columns.
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        # One row: plain FMAs into one accumulator per loaded weight element, summed over K once after the
        # loop (a reduction across threads at every step would cost more than the multiply-adds). It stays
        # 2-D on purpose: a [M, N, K] accumulator for several rows makes Triton pick a layout unlike the
        # weight load's, and the weight tile would then pass through shared memory at every step.
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    # With NORM the row's sum of squares builds up beside the products, since the norm is a scale of the
    # row: rmsnorm(s) * g @ W.T = (s * g @ W.T) / rms(s). Program 0 also stores the new residual.
    sumsq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < in_features
        # [BLOCK_N, BLOCK_K], K contiguous: 16-byte loads
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if USE_DOT:
            xt = tl.load(x_rows[None, :] + ks[:, None], mask=row_ok[None, :] & k_ok[:, None], other=0.0)
            acc += tl.dot(w, xt, input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
        else:
            x = tl.load(x_ptr + ks, mask=k_ok, other=0.0)  # [BLOCK_K], the only row
            if NORM:  # s = x + residual rounded to x's dtype, as add_rmsnorm makes (and stores) it
                s = x.to(tl.float32)
                if ADD:
                    s = (s + tl.load(residual_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)).to(x.dtype)
                    if pid == 0:
                        tl.store(residual_out_ptr + ks, s, mask=k_ok)
                    s = s.to(tl.float32)
                sumsq += s * s
                x = (s * tl.load(norm_weight_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)).to(x.dtype)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    if USE_DOT:
        out = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    else:
        out = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
    if NORM:
        out = out * tl.rsqrt(tl.sum(sumsq, axis=0) / in_features + eps)
    if HAS_BIAS:
        out += tl.load(bias_ptr + w_rows_of, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        # [BLOCK_M, BLOCK_N] -> gate and up, [BLOCK_M, BLOCK_N / 2] each. Each is rounded to the output's
        # dtype first, as storing gate/up and then silu_and_mul would: the same bits as those two kernels.
        gate, up = tl.split(tl.permute(tl.reshape(out, [BLOCK_M, 2, BLOCK_N // 2]), (0, 2, 1)))
        gate = gate.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = up.to(out_ptr.dtype.element_ty).to(tl.float32)
        out = gate * tl.sigmoid(gate) * up
        cols = (pid // row_blocks) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        col_ok = cols < outs
    out_offs = rows.to(tl.int64)[:, None] * outs + cols[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _linear_blocks(m: int, n: int, k: int, element_size: int, gated: bool = False) -> tuple[int, int, int, bool, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, num_warps) from the shapes alone (n: the weight's rows; gated, a
    tile holds a gate row and its up row at least)."""
    use_dot = m > 1
    if use_dot:
        # From H200 sweeps at Qwen3-0.6B's shapes, 16-256 rows (BLOCK_M 16-128, BLOCK_N 16-128, BLOCK_K
        # 64-256, 4 or 8 warps, 3-5 stages): rows pad to a power of two from 16 (tl.dot's least) up to the
        # row block's cap, which narrows (not below LINEAR_DOT_MAX_BLOCK_M) while it would leave fewer than
        # LINEAR_DOT_MIN_PROGRAMS programs; then the widest BLOCK_N up to 64 (each x chunk reused by more
        # weight rows) that still leaves them, and the BLOCK_K that makes the weight tile LINEAR_TILE_BYTES
        # (x's tile may be larger: at 256 rows of q/k/v, 128 x 64 x 128 tiles took 6.1 us against 7.2 with K
        # steps of 64, which kept x's tile at 16 KB). E.g. 64 rows of q/k/v: 2 row blocks of 32 x 64 x 128
        # tiles, 128 programs; of gate/up: 1 block of 64 x 64 x 128, 96 programs. 4 warps.
        cap = LINEAR_DOT_MAX_BLOCK_M if k >= LINEAR_LONG_K else LINEAR_DOT_SHORT_MAX_BLOCK_M
        block_m, block_n, num_warps = min(max(MIN_DOT, _next_pow2(m)), cap), 64, 4
        while (block_m > LINEAR_DOT_MAX_BLOCK_M
               and triton.cdiv(n, block_n) * triton.cdiv(m, block_m) < LINEAR_DOT_MIN_PROGRAMS):
            block_m //= 2
        row_blocks = triton.cdiv(m, block_m)
        while block_n > MIN_DOT and triton.cdiv(n, block_n) * row_blocks < LINEAR_DOT_MIN_PROGRAMS:
            block_n //= 2
        block_k = max(MIN_DOT, min(LINEAR_TILE_BYTES // (block_n * element_size), _next_pow2(k)))
        return block_m, block_n, block_k, use_dot, num_warps
    # One row, two tile shapes from an H200 sweep (BLOCK_N 2-32, 8-32 KB tiles, 4 or 8 warps, one call per
    # layer in a CUDA graph) at the shapes of Qwen3-0.6B, Llama-3.2-1B and Llama-3-8B. When a row splits
    # into whole LINEAR_LONG_K steps, a few rows of that length at 4 warps (each thread streams long runs
    # of one row): 3-7% faster than the other shape there (Llama-3.2-1B lm_head 121.5 vs 124.8 us, Llama-3-8B
    # gate_up 54.6 vs 57.9). Otherwise (Qwen3-0.6B's K = 1024 and 3072) the widest BLOCK_N up to 16 that
    # still leaves MIN_PROGRAMS programs, at 8 warps, which was 5-20% faster there.
    long_rows = k % LINEAR_LONG_K == 0
    block_n = max(1, LINEAR_TILE_BYTES // (LINEAR_LONG_K * element_size)) if long_rows else 16
    while block_n > 1 + gated and triton.cdiv(n, block_n) < MIN_PROGRAMS:
        block_n //= 2
    if long_rows:
        return 1, block_n, LINEAR_LONG_K, use_dot, 4
    block_k = max(MIN_DOT, min(LINEAR_TILE_BYTES // (block_n * element_size), _next_pow2(k)))
    return 1, block_n, block_k, use_dot, 8


def _linear_stages(blocks, element_size: int) -> int:
    """Pipeline stages for these tiles: 3 on one row; on tl.dot LINEAR_DOT_STAGES, or as many more (up to
    LINEAR_DOT_MAX_STAGES) as fit LINEAR_DOT_PIPELINE_BYTES."""
    block_m, block_n, block_k, use_dot, _ = blocks
    if not use_dot:
        return 3
    fit = LINEAR_DOT_PIPELINE_BYTES // ((block_m + block_n) * block_k * element_size)
    return min(LINEAR_DOT_MAX_STAGES, max(LINEAR_DOT_STAGES, fit))


def _linear_prefetch(block_k: int) -> bool:
    """Whether a linear prefetches its first weight tile before it waits (under PDL): only where that tile
    is a short part of each row. Same-machine H200 A/B, ms a step at batch 1 without / with it: Qwen3-0.6B
    (K 1024-3072, 512-column tiles) 0.830 / 0.823, and 1.139 / 1.127 at 16 rows (tl.dot, 256 columns);
    on the long-row tiles (LINEAR_LONG_K columns, the whole row or half of it) Llama-3.2-1B 0.932 / 0.937,
    Llama-3-8B 4.178 / 4.276, Qwen3-30B-A3B 2.568 / 2.597: there the programs dispatched early fetch a
    whole kernel's worth of rows while the kernel before them still needs the bandwidth."""
    return block_k < LINEAR_LONG_K


def _check_linear_args(x, weight, bias, gated: bool) -> None:
    _check_last_dim_contiguous("x", x)
    k = x.shape[-1]
    if gated and weight.dim() == 2 and weight.shape[0] % 2:
        raise ValueError(f"with gated, weight must be [gate; up], [2I, K], got an odd row count {weight.shape[0]}")
    if weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [N, K={k}] matrix (nn.Linear layout), got "
                         f"shape {tuple(weight.shape)} strides {tuple(weight.stride())}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"x, weight and bias must share a dtype, got {x.dtype}, {weight.dtype}, "
                         f"{None if bias is None else bias.dtype}")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           max_rows: int = LINEAR_MAX_M, gated: bool = False, narrow_rows: int = 0) -> torch.Tensor:
    """x [..., K] (last dim contiguous) @ weight [N, K].T + bias [N] -> [..., N] in x's dtype.

    For decode: with at most max_rows (<= LINEAR_MAX_M) rows the matmul is a pass over the weight, and one
    program per few weight rows streams it at close to full bandwidth (cuBLAS reaches ~30% of it on small
    matrices). More rows go to F.linear, whose tensor-core tiles reuse each weight tile across rows, except
    on a narrow weight (at most LINEAR_NARROW_N outputs), which stays here up to narrow_rows rows if more.
    gated=True: weight is the MLP's [gate; up] ([2I, K]) and the result silu(x @ gate.T) * (x @ up.T),
    [..., I]: silu_and_mul made as the kernel stores its output, once per output, so it costs one launch
    less per layer at any row count (with cuBLAS's rows, F.linear and then silu_and_mul). Same-machine H200
    A/B, ms a Qwen3-0.6B step: 16 requests 1.045 -> 1.010, 64: 1.166 -> 1.135, and 1 request 0.857 ->
    0.820, where silu * up was made as the down matmul loaded it (every program made all of it)."""
    _check_linear_args(x, weight, bias, gated)
    n, k = weight.shape
    x2 = x.reshape(-1, k)  # [M, K], a view for the usual contiguous x
    m = x2.shape[0]
    if n <= LINEAR_NARROW_N:
        max_rows = max(max_rows, narrow_rows)
    if m > min(max_rows, LINEAR_MAX_M):
        out = torch.nn.functional.linear(x, weight, bias)
        return _gate(out, silu_and_mul) if gated else out
    out = torch.empty((*x.shape[:-1], n // 2 if gated else n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    _launch_linear(x2, weight, bias, out, _linear_blocks(m, n, k, x.element_size(), gated), gated=gated)
    return out


def _launch_linear(x2, weight, bias, out, blocks, gated=False, residual=None, new_residual=None,
                   norm_weight=None, eps=0.0, num_stages=None):
    """_linear_kernel over x2 [M, K]; with norm_weight, the input is its add + RMSNorm (see
    add_rmsnorm_linear). Unused pointers get x2, which the kernel then never reads. num_stages: the
    pipeline's depth, _linear_stages's unless given (run.py's tile sweep)."""
    m, (n, k) = x2.shape[0], weight.shape
    block_m, block_n, block_k, use_dot, num_warps = blocks
    _linear_kernel[(triton.cdiv(n, block_n) * triton.cdiv(m, block_m),)](
        x2, weight, weight if bias is None else bias, out, x2 if residual is None else residual,
        x2 if new_residual is None else new_residual, x2 if norm_weight is None else norm_weight,
        m, n, k, x2.stride(0), eps,
        HAS_BIAS=bias is not None, GATED=gated, NORM=norm_weight is not None, ADD=residual is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot,
        DOT_PRECISION=_dot_precision(x2.dtype), **_pdl(x2.device), PREFETCH=_linear_prefetch(block_k),
        num_warps=num_warps, num_stages=num_stages or _linear_stages(blocks, x2.element_size()),
    )


def add_rmsnorm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, bias: torch.Tensor | None = None,
                       max_rows: int = LINEAR_MAX_M, narrow_rows: int = 0,
                       gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rmsnorm(x + residual) * norm_weight, weight, bias, gated), x + residual): a pre-norm layer's
    add_rmsnorm and the matmul after it, in one kernel for one row (max_rows >= 1) in tiles of at least
    LINEAR_NORM_MIN_BLOCK_N weight rows, as add_rmsnorm and linear otherwise. residual None (the first
    layer): rmsnorm(x), and x is the residual. Read the returned residual: add_rmsnorm overwrites the input
    one with the sum, the kernel does not (all programs read it while program 0 writes the sum, to a new
    tensor). Only one row: on the tl.dot path every program makes the whole normed input in registers on
    its way to the MMA, and an H200 step at 16 requests took 1.49 ms that way against 1.14 with add_rmsnorm
    apart (at one row, Qwen3-0.6B: 0.776 against 0.841)."""
    _check_linear_args(x, weight, bias, gated)
    k = x.shape[-1]
    if residual is not None and (residual.shape != x.shape or not residual.is_contiguous()
                                 or residual.dtype != x.dtype):
        raise ValueError(f"residual must be contiguous with x's shape {tuple(x.shape)} and dtype {x.dtype}, got "
                         f"shape {tuple(residual.shape)} strides {tuple(residual.stride())} dtype {residual.dtype}")
    if norm_weight.shape != (k,):
        raise ValueError(f"norm_weight must have shape ({k},) to match x's last dim, got {tuple(norm_weight.shape)}")
    x2 = x.reshape(-1, k)
    n = weight.shape[0]
    # Every program re-reads x, the residual and the norm weight (3 rows of K) beside its BLOCK_N weight
    # rows: 19% more bytes (from L2) at Qwen3-0.6B's 16-row tiles, 75% at the 4-row tiles of long rows,
    # where an H200 step got slower with it (Llama-3.2-1B 0.971 against 0.915 ms, Llama-3-8B 4.41 against
    # 4.10), so those keep add_rmsnorm apart.
    blocks = _linear_blocks(1, n, k, x.element_size(), gated) if x2.shape[0] == 1 and max_rows >= 1 else None
    if blocks is None or blocks[1] < LINEAR_NORM_MIN_BLOCK_N:
        h, residual = _pre_norm(x, residual, norm_weight, eps, rmsnorm, add_rmsnorm)
        return linear(h, weight, bias, max_rows, gated, narrow_rows), residual
    out = torch.empty((*x.shape[:-1], n // 2 if gated else n), dtype=x.dtype, device=x.device)
    new_residual = None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_linear(x2, weight, bias, out, blocks, gated=gated, residual=residual, new_residual=new_residual,
                   norm_weight=norm_weight, eps=eps)
    return out, x if residual is None else new_residual


def add_rmsnorm_linear_ref(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                           weight: torch.Tensor, bias: torch.Tensor | None = None,
                           gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The steps it fuses: add_rmsnorm_ref (rmsnorm_ref for the first layer), F.linear, and if gated
    silu_and_mul_ref."""
    h, residual = _pre_norm(x, residual, norm_weight, eps, rmsnorm_ref, add_rmsnorm_ref)
    out = torch.nn.functional.linear(h, weight, bias)
    return (_gate(out, silu_and_mul_ref) if gated else out), residual


def _pre_norm(x, residual, norm_weight, eps, rms, add_rms) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed input, residual) of a pre-norm layer with these two norms: add_rms(x, residual), or for the
    first layer (residual None) rms(x) with x as the residual."""
    if residual is None:
        return rms(x, norm_weight, eps), x
    return add_rms(x, residual, norm_weight, eps)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               gated: bool = False) -> torch.Tensor:
    """F.linear in float32, cast back: one rounding at the end, as the kernel does; gated, then
    silu_and_mul_ref of that."""
    out = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return _gate(out, silu_and_mul_ref) if gated else out


def _gate(out: torch.Tensor, silu_mul) -> torch.Tensor:
    """[..., 2I] gate | up -> [..., I] by silu_mul (silu_and_mul or its reference, which take [N, 2I])."""
    return silu_mul(out.reshape(-1, out.shape[-1])).view(*out.shape[:-1], out.shape[-1] // 2)
