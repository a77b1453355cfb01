"""nanoengine's tests: every fast path checked against a slow, obvious one.

    python -m pytest -q test_all.py     # CPU: Triton kernels run in the interpreter; the CUDA tests skip
On a CUDA machine the same command also runs the GPU tests (the names with "gpu": bf16 kernels at real
shapes, real CUDA graphs, a forward and an async loop that never synchronise).

Index: what this file guards, in the reading order (kernels.py, scheduler.py, graphs.py, nanoengine.py,
run.py), then the guards on tuning decisions. Its sections follow the same order; a test below that is not
named here fails test_the_index_names_every_test.

  The files
    imports run one way, no two files import each other . test_imports_run_one_way
    nanoengine runs its own kernels.py beside another `kernels` (transformers 5.x's)
        test_nanoengine_runs_its_own_kernels_beside_another_kernels_package
    this index names every test ........................ test_the_index_names_every_test
    the chapter (the README's ranges) names nothing of a later part; the README's example runs it
        test_the_chapter_holds_no_name_of_a_later_part, test_the_readme_example_runs_the_chapter
  kernels.py, Part 1: the chapter's kernels, each against its plain-torch reference
    each section runs alone: copy-paste proven .......... test_kernel_part1_sections_run_alone
    1.1 add_rmsnorm: residual += x then RMSNorm, in place; the first layer; strided rows; eps where it shows
        test_kernel_add_rmsnorm_first_layer, test_kernel_add_rmsnorm_in_place, test_kernel_add_rmsnorm_strided_rows,
        test_kernel_rmsnorm_at_activation_magnitudes
    1.2 silu_and_mul .................................... test_kernel_silu_and_mul
    1.3 rope_write_kv: per-head norm, RoPE, KV write, padding to the scratch block
        test_kernel_rope_write_kv, test_kernel_rope_write_kv_norm_at_activation_magnitudes
    1.4 paged_attention: any batch, a grid fixed by sizes, no unmasked read; its reference in bounded memory
        test_kernel_paged_attention_mixed_batch, test_kernel_paged_attention_prefill_tiles,
        test_kernel_paged_attention_decode_batches, test_kernel_paged_attention_one_token_rows_with_an_empty_request,
        test_kernel_paged_attention_all_padding, test_kernel_paged_attention_grid_depends_on_sizes_only,
        test_kernel_paged_attention_never_reads_what_it_did_not_write, test_kernel_paged_attention_ref_in_small_chunks,
        test_attention_ref_memory_does_not_grow_with_the_square_of_a_long_prompt,
        test_kernel_gpu_paged_attention_compiles_once_for_any_batch (one compile for any batch: no stall mid-run)
    1.5 moe_align: grouped by expert on the device, shapes from sizes only ... test_kernel_moe_align
    1.6 fused_moe ...................................... test_kernel_fused_moe, test_kernel_fused_moe_rejects_bad_input
    on the GPU: bf16 at Qwen3 shapes; no launcher synchronises with the host
        test_kernel_gpu_elementwise_bf16, test_kernel_gpu_fused_moe_bf16, test_kernel_gpu_paged_attention_bf16,
        test_kernel_gpu_no_host_sync
  scheduler.py: blocks, prefix cache, continuous batching
    block manager: batched release, LRU eviction tail first
        test_release_of_many_requests_equals_their_releases_one_by_one,
        test_prefix_cache_evicts_the_least_recently_freed_block_tail_first
    chunked prefill with decodes beside it .............. test_chunked_prefill_matches_reference
    prefix cache hits, blocks filled while decoding, after evictions
        test_prefix_cache_hits_match_reference, test_prefix_cache_hits_blocks_filled_while_decoding,
        test_prefix_cache_hits_after_evictions
    preemption: the newest goes, recomputed later
        test_preemption_matches_reference, test_preemption_takes_the_newest_request_and_recomputes_it
    stops: eos, stop ids, max_tokens, max_model_len ..... test_stops_on_eos_stop_ids_and_max_len
  graphs.py: static buffers, buckets, padding that cannot do harm (eager on the CPU, captured on CUDA)
    buckets decided once; the key a step replays ........ test_graph_buckets_are_decided_once,
        test_graph_key_for_picks_the_smallest_bucket
    decode graphs equal the plain forward, and eager tokens
        test_graph_runner_equals_plain_forward_for_every_batch_size, test_graphed_engine_tokens_equal_eager,
        test_gpu_graphs_equal_eager_for_every_batch_size
    graphs for steps with prompt tokens, by token bucket . test_graphed_prompt_steps_equal_eager,
        test_gpu_graphed_prompt_steps_equal_eager
    padding rows and padding tokens touch no real KV .... test_padding_rows_cannot_touch_real_kv,
        test_padding_tokens_are_harmless, test_scratch_block_never_handed_out_under_pressure
    capture's warm-up steps give every token a request .. test_capture_warm_up_steps_give_every_token_a_request,
        test_gpu_capture_warm_ups_read_no_unwritten_memory
    capture refuses a forward that reads the host; outputs never written in place; replays allocate nothing
        test_graphs_refuse_a_forward_that_reads_the_host, test_steps_outside_inference_mode_never_write_graph_outputs,
        test_gpu_replays_allocate_nothing
  nanoengine.py: the model, the engine, the LLM
    unfused, textbook and tuned forwards equal the reference model; checkpoints; tokenizer; refused models
        test_greedy_matches_reference, test_safetensors_round_trip, test_string_prompts_with_a_tokenizer,
        test_bad_models_are_refused
    every field of the four architectures' transformers configs: honoured, refused, or inert
        test_every_config_field_is_honoured_refused_or_inert
    fusion costs no memory and records no autograd; the whole forward on Triton
        test_fused_equals_unfused_and_costs_no_memory, test_no_weight_requires_grad_and_the_step_records_nothing,
        test_triton_kernels_end_to_end_equal_unfused
    the textbook path, the tuned one and each variant alone: the same tokens
        test_textbook_and_tuned_paths_match_the_reference
    sampling: seeded draws batch-invariant, top-k / top-p, the race draws from the softmax, staging
        test_seeded_sampling_does_not_depend_on_the_batch, test_top_k_1_equals_greedy_and_filters_apply,
        test_race_sample_draws_from_the_softmax, test_seeded_noise_is_uniform,
        test_staging_packs_every_array_16_byte_aligned
    per-token outputs (cumulative, delta, final_only), streaming, request metrics
        test_step_outputs_stream_every_token, test_engine_stream_yields_the_tokens_of_generate,
        test_request_metrics_are_ordered_and_present
    a stream loses no other request's output; closing it aborts its request
        test_a_stream_loses_no_output_of_the_other_requests, test_closing_a_stream_aborts_its_request
    text: delta outputs carry only the new text (incremental detokenization); stop strings; vLLM's other fields
        test_delta_text_is_only_the_new_text, test_stop_strings_end_the_request_before_them,
        test_vllm_sampling_fields_port_at_their_off_values
    async scheduling: sync's tokens; max_tokens kept; inputs from the device; aborts come back once
        test_async_equals_sync_on_random_workloads, test_async_never_exceeds_max_tokens_and_drops_tokens_after_a_stop,
        test_async_placeholder_input_comes_from_the_device, test_aborted_requests_come_back_once
    bad input: one clear error, and the engine keeps serving
        test_bad_input_raises_one_clear_error_and_the_engine_keeps_serving
    engines come and go ................................. test_close_frees_the_engine_and_later_use_is_a_clear_error,
        test_a_dropped_engine_is_freed_by_refcount_alone,
        test_gpu_default_engines_one_after_another_get_the_same_kv_cache
    on the GPU: no sync in the forward or the async loop; float32 tokens; async equals sync with graphs
        test_gpu_fused_forward_never_syncs, test_gpu_triton_float32_matches_reference,
        test_gpu_async_loop_never_syncs_but_for_its_event, test_gpu_async_equals_sync_with_graphs
    Part 3, tensor parallel (two ranks, gloo, float32): one rank's tokens through every scheduler path, sync and
    async, from shards that are halves of its weights; biases added once, a kv head copied; engines come and go
    leaving no process or port; a rank that dies or raises is one clear error; KV caches sized apart are refused
        test_tp_two_ranks_give_one_ranks_tokens, test_tp_biases_added_once_and_kv_heads_copied,
        test_tp_engines_come_and_go_leaving_no_process_or_port, test_tp_a_rank_that_dies_or_raises_is_one_clear_error,
        test_tp_ranks_that_size_their_kv_caches_apart_are_refused
    on the GPU: a group of one (NCCL) in CUDA graphs; two ranks on two GPUs
        test_gpu_tp_a_group_of_one_in_graphs_gives_the_same_tokens, test_gpu_tp_two_gpus_give_one_gpus_tokens
  run.py: the command line
    the overhead ladder, floors, help, generate (--stream), bench, online, bad input in one line
        test_cli_overhead_prints_every_configuration, test_cli_floors_use_the_bandwidth_given_or_measured,
        test_cli_help_states_every_default_and_each_command_its_time, test_cli_generate_and_bench,
        test_cli_generate_stream_prints_the_same_ids, test_cli_online_reports_latency_percentiles,
        test_cli_bad_input_is_one_line,
        test_gpu_online_compiles_nothing_after_warm_up
  Guards on tuning decisions (Part 2: each variant computes what it replaces, on the path it says)
    EngineConfig.tuned: names, and what each variant swaps
        test_tuned_variants_parse_names, test_engine_config_takes_tuned_names, test_each_variant_swaps_only_its_ops
    2.1 pdl: every kernel compiles for sm_90 and waits before any load; a PDL chain in a graph is exact
        test_kernels_compile_for_sm90_and_wait_before_any_load, test_jit_functions_read_only_constexpr_globals,
        test_kernel_every_kernel_waits_for_its_inputs, test_kernel_gpu_pdl_chain_in_graph_matches_plain_launches,
        test_gpu_tuned_decode_steps_launch_every_triton_kernel_in_the_pdl_chain
    2.2 linear, gated, with add_rmsnorm inside; its rows, narrow rows and tiles
        test_kernel_linear_matches_ref, test_kernel_linear_long_rows_take_blocks_of_32, test_kernel_linear_gated,
        test_kernel_linear_writes_into_out, test_kernel_add_rmsnorm_linear_matches_ref,
        test_kernel_add_rmsnorm_linear_norm_at_activation_magnitudes,
        test_kernel_add_rmsnorm_linear_keeps_the_norm_apart_on_narrow_tiles, test_kernel_add_rmsnorm_linear_bad_input,
        test_kernel_add_rmsnorm_linear_checks_its_inputs_on_the_one_launch_path,
        test_kernel_linear_default_blocks_small_n, test_kernel_linear_strided_rows_and_leading_dims,
        test_kernel_linear_above_max_m_falls_back_to_f_linear, test_triton_linear_rows_setting,
        test_kernel_linear_keeps_narrow_weights_past_max_rows, test_gpu_triton_linear_rows_default,
        test_kernel_linear_empty, test_kernel_linear_block_choice, test_kernel_linear_tiles_at_256_rows,
        test_kernel_gpu_linear_bf16_real_shapes, test_kernel_gpu_linear_gated_bf16,
        test_kernel_gpu_add_rmsnorm_linear_bf16, test_kernel_gpu_linear_no_host_sync
    2.3 decode_attention: RoPE inside, split-KV merged in-kernel, packed kv heads and their graphs
        test_kernel_decode_attention, test_kernel_decode_attention_packs_kv_heads_of_short_contexts,
        test_kernel_decode_attention_norm_at_activation_magnitudes, test_kernel_decode_attention_splits_merge_in_kernel,
        test_kernel_decode_attention_merges_many_splits, test_kernel_decode_attention_short_contexts_many_splits,
        test_graph_runner_packs_kv_heads_of_short_contexts, test_kernel_gpu_decode_attention_bf16,
        test_gpu_packed_attention_graphs_equal_unpacked_eager
    2.4 fused_moe_decode, and where it takes over ........ test_kernel_fused_moe_decode,
        test_kernel_fused_moe_decode_explicit_blocks, test_kernel_fused_moe_picks_path_by_tokens,
        test_kernel_gpu_fused_moe_decode_bf16
    2.5 moe_route ....................................... test_kernel_moe_route, test_kernel_gpu_moe_route_bf16
    2.6 race_sample ..................................... test_race_sample_kernel_equals_reference,
        test_race_sample_greedy_path, test_kernel_gpu_race_sample
    2.7 prefill_attention: prompts, chunks on a prefix, decodes and padding beside them, every GQA ratio, long
        rows split and merged in-kernel, a graph's sizes, a CUDA graph replayed; bf16 at Qwen3-0.6B shapes
        test_kernel_prefill_attention_prompts_alone, test_kernel_prefill_attention_chunk_on_a_cached_prefix,
        test_kernel_prefill_attention_mixed_with_decodes_and_padding,
        test_kernel_prefill_attention_every_gqa_ratio_of_the_presets,
        test_kernel_prefill_attention_splits_long_rows_and_merges_them,
        test_kernel_prefill_attention_grid_depends_on_sizes_only,
        test_kernel_prefill_attention_past_max_seqs_runs_paged_attention, test_kernel_gpu_prefill_attention_bf16,
        test_kernel_gpu_prefill_attention_graph_replays
    the steady decode (host path): the general path's plans and batches, rows built once
        test_steady_decode_plans_and_stages_what_the_general_path_does,
        test_seq_lens_are_int64_on_both_paths_and_the_counters_on_the_fast_path,
        test_a_steady_decode_builds_its_rows_once
"""
import os

import torch

if not torch.cuda.is_available():  # before triton is imported: run kernels in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import ast
import collections
import contextlib
import dataclasses
import gc
import importlib.util
import inspect
import io
import itertools
import json
import linecache
import math
import multiprocessing
import random
import re
import signal
import subprocess
import sys
import textwrap
import tokenize
import weakref
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.utils._python_dispatch import TorchDispatchMode

import graphs
import nanoengine
import scheduler
from nanoengine import SamplingParams, kernels  # the kernels.py nanoengine runs (nanoengine.own_kernels)
from scheduler import PLACEHOLDER

CUDA = torch.cuda.is_available()


# The engine tests pin the CPU (float32, torch references), so they mean the same on a GPU machine; the
# GPU tests ask for CUDA explicitly, with a small KV cache (the default takes 90% of the card).
def Engine(**kw):
    return nanoengine.Engine(**{"device": "cpu", **kw})


def LLM(model="tiny", **kw):
    return nanoengine.LLM(model, **{"device": "cpu", **kw})


GPU = dict(device="cuda", num_blocks=2048)
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def sync_debug_mode_restored():
    """A test that leaves torch's sync check on fails itself, instead of every CUDA test after it."""
    yield
    if CUDA and torch.cuda.get_sync_debug_mode() != 0:
        torch.cuda.set_sync_debug_mode("default")
        pytest.fail("the test left torch.cuda.set_sync_debug_mode on")


HERE = os.path.dirname(os.path.abspath(__file__))

# ==========================================================================================================
# The reference model: no paging, no batching, no fusion, full recompute per token. Written from the
# Hugging Face modeling code, sharing nothing with nanoengine.py.
# ==========================================================================================================


ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def rope_inv_freq(config: dict, head_dim: int) -> torch.Tensor:
    """inv_freq exactly as HF's _compute_default/_compute_llama3_parameters (float32)."""
    if config.get("rope_parameters") is not None:  # transformers 5.x
        params = dict(config["rope_parameters"])
        theta = params["rope_theta"]
    else:  # transformers 4.x
        params = dict(config.get("rope_scaling") or {})
        theta = config.get("rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise NotImplementedError(f"rope_type {rope_type!r}")
    factor, old_context_len = params["factor"], params["original_max_position_embeddings"]
    low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def rms_norm(x, weight, eps):
    input_dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(input_dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def mlp(state, prefix, x):  # SwiGLU: down(silu(gate(x)) * up(x))
    gate = F.linear(x, state[prefix + "gate_proj.weight"])
    up = F.linear(x, state[prefix + "up_proj.weight"])
    return F.linear(F.silu(gate) * up, state[prefix + "down_proj.weight"])


def moe(state, prefix, config, x):
    """Qwen3-MoE sparse block: float32 softmax over all experts, top-k, optional renorm."""
    router_logits = F.linear(x, state[prefix + "gate.weight"])  # [T, E]
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, config["num_experts_per_tok"], dim=-1)
    if config.get("norm_topk_prob", False):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        # HF accumulates into zeros expert by expert in ascending expert index; do the same.
        for slot in sorted(range(experts.shape[1]), key=lambda s: int(experts[t, s])):
            e = int(experts[t, slot])
            out[t] += mlp(state, f"{prefix}experts.{e}.", x[t : t + 1])[0] * weights[t, slot]
    return out


def is_sparse_layer(config, i):
    return (i not in config.get("mlp_only_layers", [])) and (
        config.get("num_experts", 0) > 0 and (i + 1) % config.get("decoder_sparse_step", 1) == 0)


def attention(state, prefix, config, arch, x, cos, sin):
    T = x.shape[0]
    n_heads = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_heads
    head_dim = config.get("head_dim") or config["hidden_size"] // n_heads
    qkv_bias = arch == "Qwen2ForCausalLM" or config.get("attention_bias", False)
    o_bias = arch != "Qwen2ForCausalLM" and config.get("attention_bias", False)

    def proj(name, bias):
        return F.linear(x, state[prefix + name + ".weight"], state[prefix + name + ".bias"] if bias else None)

    q = proj("q_proj", qkv_bias).view(T, n_heads, head_dim)
    k = proj("k_proj", qkv_bias).view(T, n_kv, head_dim)
    v = proj("v_proj", qkv_bias).view(T, n_kv, head_dim)
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):  # per-head RMSNorm before RoPE
        q = rms_norm(q, state[prefix + "q_norm.weight"], config["rms_norm_eps"])
        k = rms_norm(k, state[prefix + "k_norm.weight"], config["rms_norm_eps"])
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, T, head_dim]
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    k = k.repeat_interleave(n_heads // n_kv, dim=0)  # query head h uses kv head h // n_rep
    v = v.repeat_interleave(n_heads // n_kv, dim=0)
    scores = torch.matmul(q, k.transpose(1, 2)) * head_dim**-0.5  # [heads, T, T]
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)  # True above the diagonal = future
    scores = scores.masked_fill(causal, float("-inf"))
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v).transpose(0, 1).reshape(T, n_heads * head_dim)
    return F.linear(out, state[prefix + "o_proj.weight"], state[prefix + "o_proj.bias"] if o_bias else None)


@torch.no_grad()
def ref_logits(state: dict, config: dict, tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens), vocab] for the whole sequence, computed from scratch."""
    arch = config["architectures"][0]
    if arch not in ARCHS:
        raise NotImplementedError(arch)
    if config.get("use_sliding_window", False):
        raise NotImplementedError("sliding window attention")
    n_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_heads
    eps = config["rms_norm_eps"]
    embed = state["model.embed_tokens.weight"]
    x = embed[torch.tensor(tokens, dtype=torch.long)]  # [T, hidden]

    positions = torch.arange(len(tokens), dtype=torch.float32)
    freqs = positions[:, None] * rope_inv_freq(config, head_dim)[None, :]  # float32, [T, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, state[p + "input_layernorm.weight"], eps)
        x = x + attention(state, p + "self_attn.", config, arch, h, cos, sin)
        h = rms_norm(x, state[p + "post_attention_layernorm.weight"], eps)
        if arch == "Qwen3MoeForCausalLM" and is_sparse_layer(config, i):
            x = x + moe(state, p + "mlp.", config, h)
        else:
            x = x + mlp(state, p + "mlp.", h)
    x = rms_norm(x, state["model.norm.weight"], eps)
    lm_head = embed if config.get("tie_word_embeddings", False) else state["lm_head.weight"]
    return F.linear(x, lm_head)


def ref_greedy(state: dict, config: dict, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy decode max_tokens tokens (no EOS stop), recomputing everything each step."""
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        nxt = int(torch.argmax(ref_logits(state, config, tokens)[-1]))
        out.append(nxt)
        tokens.append(nxt)
    return out


def to_v5_config(config: dict) -> dict:
    """The config as transformers 5.x writes it: rope_theta / rope_scaling moved into rope_parameters,
    Qwen3-MoE's num_experts named num_local_experts (Qwen3MoeConfig.attribute_map), torch_dtype named dtype."""
    cfg = dict(config)
    if "num_experts" in cfg:
        cfg["num_local_experts"] = cfg.pop("num_experts")
    if "torch_dtype" in cfg:
        cfg["dtype"] = cfg.pop("torch_dtype")
    params = dict(cfg.pop("rope_scaling", None) or {})
    if "type" in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params["rope_theta"] = cfg.pop("rope_theta", 10000.0)
    cfg["rope_parameters"] = params
    return cfg


def random_hf_checkpoint(arch: str, seed: int = 0, tie: bool = False, **overrides):
    """(config, state) of a tiny random float32 model; arch in llama/qwen2/qwen3/qwen3_moe."""
    cfg = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, intermediate_size=128, vocab_size=256, max_position_embeddings=1024,
               rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=tie, torch_dtype="float32")
    if arch == "llama":
        cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False,
                   mlp_bias=False, rope_theta=500000.0,
                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                     high_freq_factor=4.0, original_max_position_embeddings=256))
    elif arch == "qwen2":
        cfg.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1000000.0,
                   use_sliding_window=False)
    elif arch in ("qwen3", "qwen3_moe"):  # head_dim != hidden_size // heads, like real Qwen3
        cfg.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32,
                   attention_bias=False, rope_theta=1000000.0, use_sliding_window=False)
        if arch == "qwen3_moe":
            cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_hidden_layers=3,
                       num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, moe_intermediate_size=32,
                       decoder_sparse_step=1, mlp_only_layers=[1])
    else:
        raise ValueError(arch)
    cfg.update(overrides)
    arch_name = cfg["architectures"][0]
    D, V = cfg["hidden_size"], cfg["vocab_size"]
    H, KV = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    Dh = cfg.get("head_dim") or D // H
    g = torch.Generator().manual_seed(seed)

    def w(*shape, std=0.02):
        return torch.randn(*shape, generator=g) * std

    def norm(n):
        return 1.0 + w(n, std=0.1)

    def linear(out_f, in_f):  # std ~ 1/sqrt(fan_in) so attention and MLPs really matter
        return w(out_f, in_f, std=in_f**-0.5)

    sd = {"model.embed_tokens.weight": w(V, D)}  # small, so the layers (not the last
    # token's own embedding) dominate the output, also when lm_head is tied to it
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm(D)
        sd[p + "post_attention_layernorm.weight"] = norm(D)
        for name, n_out in (("q_proj", H * Dh), ("k_proj", KV * Dh), ("v_proj", KV * Dh)):
            sd[p + f"self_attn.{name}.weight"] = linear(n_out, D)
            if arch_name == "Qwen2ForCausalLM" or cfg.get("attention_bias", False):
                sd[p + f"self_attn.{name}.bias"] = w(n_out, std=0.1)
        sd[p + "self_attn.o_proj.weight"] = linear(D, H * Dh)
        if arch_name != "Qwen2ForCausalLM" and cfg.get("attention_bias", False):
            sd[p + "self_attn.o_proj.bias"] = w(D, std=0.1)
        if arch_name in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
            sd[p + "self_attn.q_norm.weight"] = norm(Dh)
            sd[p + "self_attn.k_norm.weight"] = norm(Dh)
        if arch_name == "Qwen3MoeForCausalLM" and is_sparse_layer(cfg, i):
            I, experts = cfg["moe_intermediate_size"], range(cfg["num_experts"])
            sd[p + "mlp.gate.weight"] = linear(cfg["num_experts"], D)
            prefixes = [p + f"mlp.experts.{e}." for e in experts]
        else:
            I, prefixes = cfg["intermediate_size"], [p + "mlp."]
        for q in prefixes:
            sd[q + "gate_proj.weight"] = linear(I, D)
            sd[q + "up_proj.weight"] = linear(I, D)
            sd[q + "down_proj.weight"] = linear(D, I)
    sd["model.norm.weight"] = norm(D)
    if not cfg["tie_word_embeddings"]:
        sd["lm_head.weight"] = linear(V, D)
    return cfg, sd


# ==========================================================================================================
# Helpers: checkpoints, workloads, and what every run checks (the outputs' stream, the metrics, a clean book)
# ==========================================================================================================

ARCH_NAMES = ("llama", "qwen2", "qwen3", "qwen3_moe")


def checkpoint(arch: str, tie: bool = False, seed: int = 0):
    """A tiny random HF checkpoint whose logits spread wide enough that fp32 rounding never flips an argmax."""
    cfg, sd = random_hf_checkpoint(arch, seed=seed, tie=tie)
    sd["model.norm.weight"] = sd["model.norm.weight"] * 30
    return cfg, sd


def save_checkpoint(folder, cfg: dict, sd: dict, shards: int = 1):
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    names = sorted(sd)
    if shards == 1:
        save_file({k: sd[k].contiguous() for k in names}, os.path.join(folder, "model.safetensors"))
        return str(folder)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: sd[k].contiguous() for k in part}, os.path.join(folder, fname))
        weight_map.update({k: fname for k in part})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return str(folder)


@pytest.fixture(scope="module")
def ckpt_dirs(tmp_path_factory):
    """arch -> (config, state, folder) for untied checkpoints of the four architectures."""
    out = {}
    for arch in ARCH_NAMES:
        cfg, sd = checkpoint(arch)
        out[arch] = (cfg, sd, save_checkpoint(tmp_path_factory.mktemp(arch), cfg, sd))
    return out


def mixed_prompts(n: int, vocab: int, seed: int = 0, lengths=(1, 2, 7, 16, 17, 40, 130, 300)):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    """Greedy, no eos; one output at the end unless output_kind says otherwise: as LLM.generate asks, and
    the only kind the steady-decode fast path serves (scheduler.SteadyScheduler)."""
    return SamplingParams(**{"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
                             "output_kind": "final_only", **kw})


def check_clean(engine):
    """Once a workload is done: nothing left in the book (no request, running or waiting, no abort not yet
    returned, no steady set), nothing in flight, every block back (cached ones evictable), no refcount
    left, the scratch block never handed out, the cache's maps consistent."""
    book, bm = engine.book, engine.book.blocks
    assert not book.requests and not book.running and not book.waiting, "a request is still in the book"
    assert not book.aborted, "an aborted request was never returned"
    assert getattr(book, "steady", None) is None, "a steady set outlived its requests"
    assert engine.inflight is None, "a step is still in flight"
    assert all(c == 0 for c in bm.ref_count), "refcount leak"
    pool = list(bm.free) + list(bm.cached_free)
    assert sorted(pool) == list(range(bm.num_blocks)), "a block is lost, duplicated, or the scratch block leaked"
    for h, b in bm.block_of.items():
        assert bm.key_of[b] == h
    assert engine.runner.kv_cache.shape[2] == bm.num_blocks + 1  # + the scratch block


def drive(engine, use_async=False, after_step=None) -> dict:
    """Step until nothing is left. Returns every output, by request id, in order. after_step(n) runs after
    the n-th step (to abort, or to look at the book). No step may report a request twice."""
    streams = collections.defaultdict(list)
    for n in itertools.count(1):
        if not engine.has_unfinished():
            return streams
        outs = engine.step_async() if use_async else engine.step()
        assert len({o.request_id for o in outs}) == len(outs), f"step {n} reported a request twice"
        for o in outs:
            streams[o.request_id].append(o)
        if after_step is not None:
            after_step(n)
        assert n < 3000, "a request that should have stopped keeps going"


def check_metrics(o, num_tokens: int):
    """A finished output's times are ordered and what derives from them is there: arrival <= first
    scheduled <= first token <= finished, TTFT > 0, TPOT once there are two tokens."""
    m = o.metrics
    assert m["arrival_time"] <= m["finished_time"], m
    if not num_tokens:  # aborted before its first token landed
        assert m["ttft"] is None and m["tpot"] is None, m
        return
    assert m["arrival_time"] <= m["first_scheduled_time"] <= m["first_token_time"] <= m["finished_time"], m
    assert m["ttft"] == m["first_token_time"] - m["arrival_time"] and m["ttft"] > 0, m
    if num_tokens > 1:
        assert m["tpot"] == pytest.approx((m["finished_time"] - m["first_token_time"]) / (num_tokens - 1)), m
    else:
        assert m["tpot"] is None, m


def final_output(outs: list, kind: str):
    """One request's outputs, checked against its output_kind (vLLM's RequestOutputKind): an output for each
    token as it lands, the last one finished and only it; "cumulative" outputs carry every token so far,
    "delta" ones only the new one, "final_only" is one output. Returns the final output with all its tokens
    (and checks its metrics)."""
    assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1]), [o.finished for o in outs]
    if kind == "final_only":
        assert len(outs) == 1, "final_only: one output, at the end"
    tokens = []
    for o in outs:
        if kind != "final_only":  # one token each; an abort adds none (every landed token was reported)
            assert len(o.new_token_ids) == (0 if o.finish_reason == "abort" else 1), o
        tokens += o.new_token_ids
        assert o.token_ids == (o.new_token_ids if kind == "delta" else tokens), o
    assert PLACEHOLDER not in tokens
    check_metrics(outs[-1], len(tokens))
    return dataclasses.replace(outs[-1], token_ids=tokens)


def run(engine, prompts, params, use_async=False) -> list:
    """Add the prompts, step to the end, check each request's stream; the final outputs, in order."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    streams = drive(engine, use_async)
    return [final_output(streams[i], sp.output_kind) for i, sp in zip(ids, params)]


def tokens_of(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


# Kernel tests: tiny float32 shapes with tight tolerances (on the CPU they run in the Triton interpreter,
# which costs milliseconds per program; with CUDA on the GPU, where tl.dot takes float32 exactly); with
# CUDA also bf16 at real shapes and no-host-sync checks. Each float comparison is held to a tolerance that
# states its float32 budget: a kernel sums in another order than its reference, and how a sum rounds
# depends on the CPU and its BLAS (the interpreter's np.matmul rounds an output by its place in the tile).
# Exact comparisons are kept for what is exact by construction on every machine: integer outputs (token,
# expert and block ids), copies (v into the cache, slots a kernel must not touch), the zeros of padding
# rows, and one correctly rounded add (the residual).

# The small float32 tests run on the GPU when there is one (real compilation, same edge cases), else on
# the CPU under the interpreter.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# float32, elementwise kernels and row norms: a few operations per output, on inputs and outputs of unit
# scale, and at most one sum of <= 128 terms (a row's squares, a softmax over experts), which kernel and
# ref add in different orders (relative error below 128 * 2^-24 = 8e-6 at the very worst, ~1e-7 in
# practice), plus the GPU's approximate rsqrt and exp2 (2 ulp).
F32_TOL = dict(atol=1e-5, rtol=1e-5)
# fused_moe: two float32 matmuls (K <= 72 terms of unit scale, then the intermediate) and a weighted sum
# over top_k <= 8 experts, each summed in another order than the ref: ~1e-6 on outputs of unit scale.
MOE_TOL = dict(atol=1e-5, rtol=1e-4)
# Attention: the kernel's online softmax (exp2, rescaled tile by tile, splits merged in a tree) against
# one softmax of the ref, over <= 1,400 keys, and the weighted sum of unit-scale V rows in another order:
# ~1e-6 on its outputs (averages of V rows).
ATTN_TOL = dict(atol=1e-5, rtol=1e-4)
# float32 matmuls: kernel and reference differ only in the order they add K <= 600 products. Partial sums
# grow like sqrt(k) and the K roundings add up like a random walk: about K * 2^-24 ~ 4e-5 at K = 600 of unit
# products (outputs ~ N(0, K)), well inside atol + rtol * |out| ~ 3e-4 there; ~1e-6 on the unit-scale
# outputs of K = 200 with scaled weights.
LINEAR_TOL = dict(atol=1e-4, rtol=1e-5)
# Activations are not unit-scale: hidden states grow to 1e2 and more through the layers, and a head or a
# row can sit near 1e-3. There mean(x^2) ~ 1e-6 = eps, so a norm that adds eps anywhere but beside the
# mean inside the rsqrt is off by tens of percent, while at unit scale the same bug is off by ~1e-6.
NORM_SCALES = (1e-3, 1.0, 1e2)
NORM_EPS = 1e-6  # Qwen3's rms_norm_eps
# A norm's output is unit-scale whatever its input's (the residual sum keeps the input's), so its budget
# is relative to each output row: F32_TOL's, a sum of D <= 64 squares and a few operations an element.
NORM_RTOL = 1e-5
CUDA_DEVICE = torch.device("cuda")
BF16 = torch.bfloat16
# bf16 keeps 8 mantissa bits (~4e-3 relative); kernels round once at the end, refs in places more often.
BF16_ELEMENTWISE_TOL = dict(atol=2e-2, rtol=2e-2)
# Matmuls and attention sum thousands of bf16 products; bf16 inputs to tl.dot add per-tile rounding.
BF16_GEMM_TOL = dict(atol=3e-2, rtol=3e-2)
# Both sides accumulate in float32 and round once to bf16 (8 mantissa bits): they may differ by one
# bf16 step, 2^-7 relative at worst, on outputs of magnitude ~1-4 here.
BF16_LINEAR_TOL = dict(atol=3e-2, rtol=1.6e-2)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed: int, device=DEVICE, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)).to(device=device, dtype=dtype)


def _qkv_views(t: int, h: int, hkv: int, d: int, seed: int, device=DEVICE, dtype=torch.float32):
    """q, k, v as strided views of one [T, (H + 2 Hkv) D] matmul output, as the model produces them."""
    qkv = _randn(t, (h + 2 * hkv) * d, seed=seed, device=device, dtype=dtype)
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + hkv) * d].view(t, hkv, d)
    v = qkv[:, (h + hkv) * d :].view(t, hkv, d)
    return qkv, q, k, v


def _routing(n: int, top_k: int, num_experts: int, seed: int, device=DEVICE, only=None):
    """Distinct experts per token; `only` restricts routing to the first `only` experts (others get none)."""
    g = _gen(seed)
    pool = only or num_experts
    ids = torch.stack([torch.randperm(pool, generator=g)[:top_k] for _ in range(n)])
    weights = torch.rand(n, top_k, generator=g)
    return weights.to(device), ids.to(device)


def _rows_at_scales(*shape, seed: int) -> torch.Tensor:
    """randn(*shape), row i (along dim 0) scaled by NORM_SCALES[i % 3]."""
    scales = torch.tensor(NORM_SCALES, device=DEVICE).repeat(shape[0])[: shape[0]]
    return _randn(*shape, seed=seed) * scales.view(-1, *[1] * (len(shape) - 1))


def _assert_close_per_row(out: torch.Tensor, ref: torch.Tensor, rtol: float = NORM_RTOL) -> None:
    """|out - ref| within rtol of the largest |ref| of its row (the last dim), at every row's scale."""
    err = ((out - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item()
    assert err <= rtol, f"off by {err:.1e} of a row's largest value; the budget is {rtol:.0e}"


def _attention_case(q_lens, seq_lens, h, hkv, d, page, max_blocks, seed, device=DEVICE, dtype=torch.float32):
    """A batch whose caches hold NaN everywhere a request may not look: past each seq_len, unused pages,
    so any unmasked load shows up as NaN in the output."""
    b = len(q_lens)
    num_blocks = b * max_blocks + 1  # + the scratch block
    k_cache = torch.full((num_blocks, page, hkv, d), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    g = _gen(seed)
    block_table = torch.randperm(num_blocks - 1, generator=g)[: b * max_blocks].view(b, max_blocks).int()
    for r, seq_len in enumerate(seq_lens):
        pos = torch.arange(seq_len)
        blk, off = block_table[r, pos // page].long().to(device), (pos % page).to(device)
        k_cache[blk, off] = torch.randn(seq_len, hkv, d, generator=g).to(device, dtype)
        v_cache[blk, off] = torch.randn(seq_len, hkv, d, generator=g).to(device, dtype)
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), h, d, generator=g).to(device, dtype)
    tensors = (k_cache, v_cache, qsl.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device),
               block_table.to(device))
    return q, tensors


def _poison_empty(monkeypatch) -> None:
    """Make kernels' torch.empty hand out NaN (-1 in integer buffers), so an element the kernel should have
    written and did not, or one it should not have read and did, shows up."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    monkeypatch.setattr(kernels.torch, "empty", poisoned)


class Spy:
    """Stands in for a @triton.jit kernel of kernels.py: records each launch's grid and keyword arguments
    (its constexprs), then launches the real one."""

    def __init__(self, fn):
        self.fn, self.launches = fn, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(SimpleNamespace(grid=tuple(grid), **kwargs))
            return self.fn[grid](*args, **kwargs)
        return launch


def spy(monkeypatch, name: str) -> Spy:
    s = Spy(getattr(kernels, name))
    monkeypatch.setattr(kernels, name, s)
    return s

# ==========================================================================================================
# The files: one-way imports, and this file's index
# ==========================================================================================================

FILES = ("kernels", "scheduler", "graphs", "nanoengine", "run")
# What each file may import of the others (STYLE.md, habit 14): kernels.py and scheduler.py nothing,
# graphs.py only its batch type from below, nanoengine.py ties them, run.py is the command line.
MAY_IMPORT = {"kernels": set(), "scheduler": set(), "graphs": {"scheduler"},
              "nanoengine": {"kernels", "graphs", "scheduler"}, "run": {"nanoengine", "kernels"}}


def _imports(name: str) -> set[str]:
    """The top-level modules a file imports, anywhere in it (a function's imports too)."""
    tree = ast.parse(open(os.path.join(HERE, name + ".py")).read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{name}.py: a relative import"
            found.add(node.module.split(".")[0])
    return found


def test_imports_run_one_way():
    ours = {name: _imports(name) & set(FILES) for name in FILES}
    for name in FILES:
        assert ours[name] <= MAY_IMPORT[name], f"{name}.py imports {sorted(ours[name] - MAY_IMPORT[name])}"
        for other in ours[name]:
            assert name not in ours[other], f"{name}.py and {other}.py import each other"
    assert "scheduler" in ours["graphs"], "graphs.py takes Batch from scheduler.py, below it"
    assert not {"torch", "triton"} & _imports("scheduler"), "scheduler.py knows no torch"


# A script that checks nanoengine runs its own kernels.py while `import kernels` gets another package's (Hugging
# Face's, which transformers 5.x imports; here a stand-in), whichever of the two is imported first.
OWN_KERNELS_SCRIPT = """
import os, sys, torch
{imports}
assert kernels.CUDAProperties and sys.modules["kernels"] is kernels, "`import kernels` is the stand-in"
assert os.path.samefile(nanoengine.kernels.__file__, {ours!r}), nanoengine.kernels.__file__
[out] = nanoengine.LLM("tiny", device="cpu").generate([[1, 2, 3]], nanoengine.SamplingParams(max_tokens=2))
x = torch.randn(3, 16)  # a Triton launch too (the interpreter)
torch.testing.assert_close(nanoengine.kernels.silu_and_mul(x), nanoengine.kernels.silu_and_mul_ref(x))
print(len(out.token_ids))
"""


def test_nanoengine_runs_its_own_kernels_beside_another_kernels_package(tmp_path):
    """With a stand-in `kernels` package installed (first on the path): a script elsewhere that imports it before
    nanoengine, and a script in this folder that imports nanoengine first after the README's line (the folder
    moved to the end of sys.path), both get the stand-in from `import kernels`, and nanoengine its own kernels.py."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("class CUDAProperties:\n    pass\n")
    elsewhere = ("import kernels\nimport nanoengine", tmp_path, f"{tmp_path}{os.pathsep}{HERE}")
    in_folder = ("sys.path.append(sys.path.pop(0))\nimport nanoengine\nimport kernels", HERE, str(tmp_path))
    for imports, cwd, path in (elsewhere, in_folder):  # python -c: sys.path[0] is the folder it runs in
        script = OWN_KERNELS_SCRIPT.format(imports=imports, ours=kernels.__file__)
        env = os.environ | {"PYTHONPATH": path, "TRITON_INTERPRET": "1"}
        r = subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and r.stdout.split() == ["2"], (imports, r.stderr[-2000:])


def test_the_index_names_every_test():
    """The module docstring's index names every test in this file, and nothing that is not one."""
    named = set(re.findall(r"\btest_\w+", __doc__[__doc__.index("Index:"):]))
    defined = {name for name, obj in globals().items() if name.startswith("test_") and callable(obj)}
    assert not defined - named, f"tests missing from the index: {sorted(defined - named)}"
    assert not named - defined, f"the index names tests that do not exist: {sorted(named - defined)}"


def chapter_ranges() -> dict[str, tuple[int, int]]:
    """The chapter's line ranges as the README's reading order gives them: file -> (first, last) line."""
    readme = open(os.path.join(HERE, "README.md")).read()
    found = re.findall(r"`(\w+\.py)` (?:lines (\d+)-(\d+)|\(all (\d+)\))", readme[readme.index("## Reading order"):])
    return {f: (int(a or 1), int(b or n)) for f, a, b, n in found}


def later_parts(name: str) -> list[str]:
    """A file's lines from its "# Part 2" banner on (Part 2 and anything after it)."""
    lines = open(os.path.join(HERE, name)).read().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("# Part 2")), len(lines))
    return lines[start:]


def test_the_chapter_holds_no_name_of_a_later_part():
    """The chapter's code (the README's line ranges, which must end where a section does and stay under 2,000
    lines) names nothing that Part 2 or later defines, nor a variant of EngineConfig.tuned: each later part
    attaches from its own place. Names the chapter defines itself (its ops' slots included) are its own."""
    ranges = chapter_ranges()
    assert set(ranges) == {"scheduler.py", "kernels.py", "nanoengine.py", "graphs.py"}, ranges
    assert sum(b - a + 1 for a, b in ranges.values()) <= 2000, ranges
    later, chapter_code = set(nanoengine.TUNED), {}
    for name, (first, last) in ranges.items():
        lines = open(os.path.join(HERE, name)).read().splitlines()
        after = [line for line in lines[last:] if line.strip()]
        assert not after or after[0].lstrip().startswith(("# --", "# ==")), f"{name}: line {last} ends mid-section"
        chapter_code[name] = "\n".join(lines[first - 1:last])
        tree = ast.parse(textwrap.dedent("\n".join(later_parts(name))) or "pass")
        later |= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        later |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    own = set(vars(nanoengine.textbook_ops(False)))
    for code in chapter_code.values():
        tree = ast.parse(textwrap.dedent(code))
        own |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    for name, code in chapter_code.items():
        tokens = {tok.string for tok in tokenize.generate_tokens(io.StringIO(code).readline) if tok.type == tokenize.NAME}
        assert not (tokens & later) - own, f"{name}'s chapter names {sorted((tokens & later) - own)}"


def test_the_readme_example_runs_the_chapter(capsys):
    """The README's API example, run as a learner would (a breakpoint in the chapter's functions stops it):
    every function of nanoengine's files that it runs lies before their Part 2, and the chapter's step
    (the scheduler, the input builder, the decoder layer, the book) runs."""
    readme = open(os.path.join(HERE, "README.md")).read()
    example = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    files = {os.path.join(HERE, f): f for f in ("kernels.py", "scheduler.py", "nanoengine.py", "graphs.py")}
    ran = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename in files:
            ran.add((files[frame.f_code.co_filename], frame.f_code.co_qualname, frame.f_code.co_firstlineno))
    sys.setprofile(profile)
    try:
        exec(compile(example, "README.md", "exec"), {})
    finally:
        sys.setprofile(None)
    assert capsys.readouterr().out, "the example prints its outputs"
    for f in files.values():
        part2 = len(open(os.path.join(HERE, f)).read().splitlines()) - len(later_parts(f)) + 1
        beyond = sorted(q for g, q, line in ran if g == f and line >= part2)
        assert not beyond, f"the README's example runs {f}'s {beyond}"
    names = {q for _, q, _ in ran}
    assert {"Scheduler.schedule", "InputBuilder.prepare", "DecoderLayer.forward", "Attention.forward",
            "RequestBook.fill", "Engine.step", "sample"} <= names, sorted(names)


# ==========================================================================================================
# kernels.py, Part 1: the chapter's kernels, each against its plain-torch reference
# ==========================================================================================================


def _part1() -> tuple[str, dict]:
    """kernels.py's Part 1 header (the code between the Part 1 banner and "# -- 1.1") and its sections by
    number: each the text from its "# -- 1.n" line to the next "# -- " line, or to the Part 2 banner."""
    lines = open(kernels.__file__).read().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("# Part 1"))
    end = next(i for i, line in enumerate(lines) if line.startswith("# Part 2")) - 1  # the banner's first rule
    heads = [i for i in range(start, end) if lines[i].startswith("# -- ")]
    sections = {re.match(r"# -- (1\.\d+) ", lines[a]).group(1): "".join(lines[a:b])
                for a, b in zip(heads, heads[1:] + [end])}
    return "".join(lines[start + 2:heads[0]]), sections


def _needs(section: str) -> list[str]:
    """The sections a section's title line says it needs: "(needs 1.2 and 1.5)"."""
    title = section.splitlines()[0]
    needs = re.search(r"\(needs ([^)]*)\)", title)
    return re.findall(r"1\.\d+", needs.group(1)) if needs else []


def _run_alone(number: str, folder) -> dict:
    """Section `number` of Part 1 as someone who copied it would have it: a file of its own in `folder` holding
    only the imports of torch, triton and triton.language as tl, the Part 1 header, the sections its title
    says it needs and the section, imported as a module. A name from anywhere else in kernels.py (a Part 2
    constant, another section's helper) is then a NameError. A file, not a string: Triton's compiler reads a
    kernel's source from the file that defines it."""
    header, sections = _part1()
    source = ("import torch\nimport triton\nimport triton.language as tl\n" + header
              + "".join(sections[n] for n in _needs(sections[number])) + sections[number])
    name = f"copied_{number.replace('.', '_')}"
    path = os.path.join(folder, name + ".py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return vars(module)


@pytest.mark.parametrize("number,with_norm", [
    ("1.1", False), ("1.2", False), ("1.3", False), ("1.3", True), ("1.4", False), ("1.5", False), ("1.6", False),
    ("1.7", False)])
def test_kernel_part1_sections_run_alone(tmp_path, number, with_norm):
    """Copy-paste proven, not promised: each Part 1 section (kernel, launcher, reference), copied into a file
    of its own (_run_alone), computes what its own reference does, on a small float32 input."""
    header, sections = _part1()
    assert list(sections) == ["1.1", "1.2", "1.3", "1.4", "1.5", "1.6", "1.7"]
    assert _needs(sections["1.6"]) == ["1.2", "1.5"], "fused_moe calls silu_and_mul and moe_align, and says so"
    assert _needs(sections["1.3"]) == ["1.1"], "rope_write_kv_ref's per-head norm is 1.1's rmsnorm_ref, and says so"
    assert all(line.startswith("#") or not line.strip() for line in header.splitlines()), "the header is prose"
    ns = _run_alone(number, tmp_path)
    if number == "1.1":  # residual += x, then RMSNorm; and the first layer's, with no residual
        x, res, w = _randn(5, 48, seed=1), _randn(5, 48, seed=2), _randn(48, seed=3)
        out, new_res = ns["add_rmsnorm"](x, res.clone(), w, 1e-6)
        ref, ref_res = ns["add_rmsnorm_ref"](x, res.clone(), w, 1e-6)
        torch.testing.assert_close(out, ref, **F32_TOL)
        assert torch.equal(new_res, ref_res), "one float32 add each side: exact"
        torch.testing.assert_close(ns["add_rmsnorm"](x, None, w, 1e-6)[0], ns["rmsnorm_ref"](x, w, 1e-6), **F32_TOL)
    elif number == "1.2":
        x = _randn(3, 80, seed=4)
        torch.testing.assert_close(ns["silu_and_mul"](x), ns["silu_and_mul_ref"](x), **F32_TOL)
    elif number == "1.3":  # q rotated in place, k and v into their slots (-1: the scratch block)
        slots, positions = torch.tensor([3, -1, 9, 4], device=DEVICE), torch.tensor([0, 5, 2, 7], device=DEVICE)
        cos_sin = _randn(8, 16, seed=5)
        norms = (1 + 0.1 * _randn(16, seed=6), 1 + 0.1 * _randn(16, seed=7)) if with_norm else (None, None)
        results = []
        for fn in (ns["rope_write_kv"], ns["rope_write_kv_ref"]):
            qkv, q, k, v = _qkv_views(4, 4, 2, 16, seed=8)
            caches = torch.zeros(2, 4, 4, 2, 16, device=DEVICE)  # 3 blocks of 4 and the scratch block
            fn(q, k, v, caches[0], caches[1], slots, positions, cos_sin, *norms)
            results.append((qkv, caches))
        torch.testing.assert_close(results[0][0], results[1][0], **F32_TOL)
        torch.testing.assert_close(results[0][1], results[1][1], **F32_TOL)
    elif number == "1.4":  # a prompt, a chunk on a context, a decode
        q, tensors = _attention_case([5, 3, 1], [5, 40, 9], h=4, hkv=2, d=16, page=4, max_blocks=10, seed=9)
        out = ns["paged_attention"](q, *tensors, 0.25, 5)
        torch.testing.assert_close(out, ns["paged_attention_ref"](q, *tensors, 0.25, 5), **ATTN_TOL)
    elif number == "1.5":
        _, ids = _routing(7, 3, 6, seed=10)
        got, want = ns["moe_align"](ids, 6, 4), ns["moe_align_ref"](ids, 6, 4)
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
        assert torch.equal(_moe_canonical(got[0], got[1], 4), _moe_canonical(want[0], want[1], 4))
    elif number == "1.6":
        x, weights_ids = _randn(5, 32, seed=11), _routing(5, 2, 4, seed=12)
        gate_up, down = _randn(4, 48, 32, seed=13) / 32**0.5, _randn(4, 32, 24, seed=14) / 24**0.5
        torch.testing.assert_close(ns["fused_moe"](x, gate_up, down, *weights_ids),
                                   ns["fused_moe_ref"](x, gate_up, down, *weights_ids), **MOE_TOL)
    else:  # torch only: the engine's race, and the plain form on logits that leave it one choice
        logits, temperature = _randn(3, 50, seed=15), torch.tensor([0.0, 0.7, 1.3], device=DEVICE)
        seeds, counters = torch.tensor([1, -5, 2**40], device=DEVICE), torch.tensor([3, 0, 9], device=DEVICE)
        assert torch.equal(ns["race_sample_ref"](logits, temperature, seeds, counters),
                           kernels.race_sample_ref(logits, temperature, seeds, counters))
        peaked = torch.full((2, 50), -1e4, device=DEVICE).index_fill_(1, torch.tensor([7], device=DEVICE), 0.0)
        assert ns["race_sample_plain"](peaked, 1.0).tolist() == [7, 7]


# -- 1.1 add_rmsnorm ----------------------------------------------------------------------------------


@pytest.mark.parametrize("rows,dim", [(1, 16), (7, 100), (33, 64)])
def test_kernel_add_rmsnorm_first_layer(rows, dim):
    """residual None (before the first layer): (rmsnorm(x) * w, x itself)."""
    x, w = _randn(rows, dim, seed=1), _randn(dim, seed=2)
    out, residual = kernels.add_rmsnorm(x, None, w, 1e-6)
    assert residual is x
    torch.testing.assert_close(out, kernels.rmsnorm_ref(x, w, 1e-6), **F32_TOL)


# 1, 9: a row a program; 513 rows of 8: two rows a program (BLOCK_ROWS from the row count), the last one alone.
@pytest.mark.parametrize("rows,dim", [(1, 48), (9, 100), (513, 8)])
def test_kernel_add_rmsnorm_in_place(rows, dim):
    x, res, w = _randn(rows, dim, seed=5), _randn(rows, dim, seed=6), _randn(dim, seed=7)
    res_ref = res.clone()
    out, new_res = kernels.add_rmsnorm(x, res, w, 1e-6)
    out_ref, new_res_ref = kernels.add_rmsnorm_ref(x, res_ref, w, 1e-6)
    assert new_res.data_ptr() == res.data_ptr(), "the sum must be written into residual's storage"
    torch.testing.assert_close(new_res, x + _randn(rows, dim, seed=6), **F32_TOL)
    torch.testing.assert_close(new_res, new_res_ref, **F32_TOL)
    torch.testing.assert_close(out, out_ref, **F32_TOL)


def test_kernel_add_rmsnorm_strided_rows():
    """Rows of x may sit apart (a column slice of a wider matmul output): read through the row stride, no
    copy. The per-head norm on q and k's strided heads is not this kernel's: it is inside rope_write_kv
    (test_kernel_rope_write_kv) and decode_attention. A last dim that is not contiguous is refused."""
    wide, w = _randn(6, 80, seed=3), _randn(48, seed=4)
    x = wide[:, 16:64]  # rows 80 apart
    for residual in (None, _randn(6, 48, seed=5)):
        out, new_res = kernels.add_rmsnorm(x, None if residual is None else residual.clone(), w, 1e-6)
        ref, ref_res = kernels.add_rmsnorm_ref(x, None if residual is None else residual.clone(), w, 1e-6)
        torch.testing.assert_close(out, ref, **F32_TOL)
        torch.testing.assert_close(new_res, ref_res, **F32_TOL)
    with pytest.raises(ValueError, match="contiguous last dim"):
        kernels.add_rmsnorm(wide.t(), None, _randn(6, seed=6), 1e-6)
    with pytest.raises(ValueError, match="residual must be contiguous"):
        kernels.add_rmsnorm(x, _randn(48, 6, seed=7).t(), w, 1e-6)
    with pytest.raises(ValueError, match="residual must be contiguous .* dtype torch.float32, got .* torch.float64"):
        kernels.add_rmsnorm(x, _randn(6, 48, seed=7).double(), w, 1e-6)  # its sum would be stored as x's dtype


@pytest.mark.parametrize("add", [False, True])
def test_kernel_rmsnorm_at_activation_magnitudes(add):
    """add_rmsnorm, with and without the residual, on rows at 1e-3, 1 and 1e2, where eps's place shows
    (NORM_SCALES)."""
    x, w = _rows_at_scales(6, 64, seed=80), 1 + 0.1 * _randn(64, seed=81)
    if add:
        residual = _rows_at_scales(6, 64, seed=82)
        out, new_residual = kernels.add_rmsnorm(x, residual.clone(), w, NORM_EPS)
        ref, ref_residual = kernels.add_rmsnorm_ref(x, residual.clone(), w, NORM_EPS)
        assert torch.equal(new_residual, ref_residual), "one float32 add each side: exact"
    else:
        out, ref = kernels.add_rmsnorm(x, None, w, NORM_EPS)[0], kernels.rmsnorm_ref(x, w, NORM_EPS)
    _assert_close_per_row(out, ref)


# -- 1.2 silu_and_mul ---------------------------------------------------------------------------------


@pytest.mark.parametrize("rows,inter", [(1, 24), (5, 1100)])  # 1100 > one 1024-wide block
def test_kernel_silu_and_mul(rows, inter):
    x = _randn(rows, 2 * inter + 8, seed=8)[:, : 2 * inter]  # strided rows
    out = kernels.silu_and_mul(x)
    assert out.shape == (rows, inter)
    torch.testing.assert_close(out, kernels.silu_and_mul_ref(x), **F32_TOL)


# -- 1.3 rope_write_kv --------------------------------------------------------------------------------


@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("t,h,hkv,d", [(1, 4, 2, 16), (6, 6, 2, 32)])  # 6 heads: not a power of two
def test_kernel_rope_write_kv(with_norm, t, h, hkv, d):
    """q rotated in place (after Qwen3's per-head norm on its strided heads); rotated k and v stored at their
    slots, padding rows (slot -1) in the scratch block; nothing else changed: not k, not v, not any other
    slot of a real block. Kernel and reference."""
    num_blocks, page = 5, 4  # block 4 is the scratch block
    positions = torch.randint(0, 64, (t,), generator=_gen(24)).to(DEVICE)
    cos_sin = _randn(64, d, seed=25)
    norms = (_randn(d, seed=26), _randn(d, seed=27)) if with_norm else (None, None)
    slots = torch.tensor([0, 7, -1, 13, -1, 2][:t] if t > 1 else [9], device=DEVICE)
    real, real_slots = slots >= 0, (num_blocks - 1) * page
    garbage = _randn(2, num_blocks, page, hkv, d, seed=28)  # must survive outside the slots
    caches = {}
    for fn in (kernels.rope_write_kv, kernels.rope_write_kv_ref):
        qkv, q, k, v = _qkv_views(t, h, hkv, d, seed=23)  # strided views
        k_cache, v_cache = garbage[0].clone(), garbage[1].clone()
        fn(q, k, v, k_cache, v_cache, slots, positions, cos_sin, *norms, eps=1e-6)
        assert torch.equal(qkv[:, h * d:], _randn(t, (h + 2 * hkv) * d, seed=23)[:, h * d:]), "k, v untouched"
        expect_v = garbage[1].clone()
        expect_v.view(-1, hkv, d)[slots[real]] = v[real]
        assert torch.equal(v_cache.view(-1, hkv, d)[:real_slots], expect_v.view(-1, hkv, d)[:real_slots])
        untouched = torch.ones(real_slots, dtype=torch.bool, device=DEVICE)
        untouched[slots[real]] = False
        assert torch.equal(k_cache.view(-1, hkv, d)[:real_slots][untouched],
                           garbage[0].view(-1, hkv, d)[:real_slots][untouched])
        if not real.all():
            assert any(torch.equal(v_cache[-1, 0], v[i]) for i in range(t) if not real[i]), "padding in scratch"
        caches[fn] = (qkv, k_cache)
    (qkv, k_cache), (qkv_ref, k_cache_ref) = caches.values()
    torch.testing.assert_close(qkv, qkv_ref, **F32_TOL)
    torch.testing.assert_close(k_cache.view(-1, hkv, d)[slots[real]], k_cache_ref.view(-1, hkv, d)[slots[real]],
                               **F32_TOL)


def test_kernel_rope_write_kv_norm_at_activation_magnitudes():
    """Qwen3's per-head q and k norm, on the heads of tokens at 1e-3, 1 and 1e2 (NORM_SCALES): q rotated
    in place and k in its cache slot, against the reference, to the budget of each head's output."""
    t, h, hkv, d = 3, 2, 1, 16
    positions, slots = torch.tensor([5, 0, 9], device=DEVICE), torch.tensor([0, 6, 3], device=DEVICE)
    cos_sin, norms = _randn(16, d, seed=90), (1 + 0.1 * _randn(d, seed=91), 1 + 0.1 * _randn(d, seed=92))
    results = []
    for fn in (kernels.rope_write_kv, kernels.rope_write_kv_ref):
        qkv = _rows_at_scales(t, (h + 2 * hkv) * d, seed=93)  # token i's heads all at NORM_SCALES[i]
        q, k, v = qkv[:, : h * d].view(t, h, d), *qkv[:, h * d:].view(t, 2, hkv, d).unbind(1)
        k_cache, v_cache = torch.zeros(2, 3, 4, hkv, d, device=DEVICE)  # 2 blocks of 4 and the scratch block
        fn(q, k, v, k_cache, v_cache, slots, positions, cos_sin, *norms, eps=NORM_EPS)
        results.append((q, k_cache.view(-1, hkv, d)[slots]))
    (q, k), (q_ref, k_ref) = results
    _assert_close_per_row(q, q_ref)
    _assert_close_per_row(k, k_ref)


# -- 1.4 paged_attention ------------------------------------------------------------------------------


def _check_attention(q_lens, seq_lens, h, hkv, d, page, max_blocks, seed, **ref_kw):
    q, tensors = _attention_case(q_lens, seq_lens, h, hkv, d, page, max_blocks, seed)
    scale, max_q = d**-0.5, max(q_lens)
    out = kernels.paged_attention(q, *tensors, scale, max_q)
    ref = kernels.paged_attention_ref(q, *tensors, scale, max_q, **ref_kw)
    assert not out.isnan().any() and not ref.isnan().any()
    torch.testing.assert_close(out, ref, **ATTN_TOL)
    return out


def test_kernel_paged_attention_mixed_batch():
    # prefill from scratch, chunked prefill on a context, decode, padding row (seq_len 0), decode
    q_lens, seq_lens = [5, 3, 1, 1, 1], [5, 70, 19, 0, 130]
    out = _check_attention(q_lens, seq_lens, h=4, hkv=2, d=32, page=4, max_blocks=34, seed=23)
    assert out[9].abs().max() == 0, "the seq_len-0 request must produce zeros"


@pytest.mark.parametrize("h,hkv,d,page", [(4, 4, 16, 8), (8, 2, 16, 16), (3, 1, 64, 4)])
def test_kernel_paged_attention_prefill_tiles(h, hkv, d, page):
    # 37 new tokens span several query tiles (BLOCK_Q = 64 / GROUP_PAD), with a context before them.
    _check_attention([37, 2], [45, 2], h, hkv, d, page, max_blocks=48 // page, seed=24)


def test_kernel_paged_attention_decode_batches():
    """max_query_len 1: one query tile a request. A single token, and a batch of decodes over contexts of
    several hundred keys (the tiles walk many KV blocks), with a padding row."""
    _check_attention([1], [33], h=2, hkv=1, d=32, page=16, max_blocks=20, seed=25)
    out = _check_attention([1, 1, 1, 1], [300, 5, 0, 140], h=4, hkv=2, d=32, page=16, max_blocks=20, seed=26)
    assert out[2].abs().max() == 0


def test_kernel_paged_attention_one_token_rows_with_an_empty_request():
    # max_query_len 1 but a request with no token: token b is not request b's; every request finds its
    # own tokens through query_start_loc.
    _check_attention([1, 0, 1], [5, 7, 9], h=4, hkv=2, d=16, page=4, max_blocks=3, seed=27)
    _check_attention([0, 1], [3, 6], h=4, hkv=2, d=16, page=4, max_blocks=2, seed=28)


def test_kernel_paged_attention_all_padding():
    out = _check_attention([1, 1], [0, 0], h=2, hkv=1, d=16, page=4, max_blocks=3, seed=26)
    assert out.abs().max() == 0


def test_kernel_paged_attention_grid_depends_on_sizes_only(monkeypatch):
    """The grid is (T // BLOCK_Q + B, Hkv): fixed by the batch's sizes, never by its lengths, so a CUDA graph
    captured with one batch replays another of the same sizes. Two batches of 9 tokens in 3 requests, cut
    differently, launch the same grid; each is right."""
    launches = spy(monkeypatch, "_paged_attention_kernel").launches
    for q_lens, seq_lens in (([7, 1, 1], [7, 30, 2]), ([3, 3, 3], [40, 3, 9])):
        _check_attention(q_lens, seq_lens, h=4, hkv=2, d=16, page=4, max_blocks=10, seed=29)
    (a, b) = launches
    assert a.grid == b.grid == (9 // a.BLOCK_Q + 3, 2) and a.BLOCK_Q == b.BLOCK_Q


def test_kernel_paged_attention_ref_in_small_chunks(monkeypatch):
    """The reference's queries 3 at a time, against the kernel: chunk edges inside prompts, decode rows, a
    padding row (seq_len 0) and a request with no new token."""
    monkeypatch.setattr(kernels, "ATTN_REF_CHUNK", 3)
    _check_attention([5, 3, 1, 0, 1, 7], [5, 70, 19, 4, 0, 130], h=4, hkv=2, d=32, page=4, max_blocks=34, seed=30)


def test_kernel_paged_attention_never_reads_what_it_did_not_write(monkeypatch):
    """With kernels' torch.empty poisoned (NaN), a batch of short decodes, a long one, a padding row and a
    3-token chunk: an output left unwritten, or a buffer read before it was written, would show."""
    _poison_empty(monkeypatch)
    out = _check_attention([1, 1, 1, 1, 3], [5, 40, 300, 0, 40], h=4, hkv=2, d=32, page=16, max_blocks=20, seed=30)
    assert out[3].abs().max() == 0, "the seq_len-0 request must produce zeros"


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op made while active: a peak-memory gauge that works on the CPU,
    where torch keeps no allocator statistics (every op's outputs pass through here)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_attention_ref_memory_does_not_grow_with_the_square_of_a_long_prompt():
    """A 4,096-token prompt: its whole score matrix is 4 heads x 4,096 x 4,096 = 67M elements, which
    `run.py bench` on the CPU (16,384 tokens a step) would build at tens of GB. The reference's scores stay
    ATTN_REF_CHUNK queries x the context, and its rows are still right on either side of a chunk's edge."""
    n, h, hkv, d = 4096, 4, 2, 16
    q, tensors = _attention_case([n], [n], h, hkv, d, page=16, max_blocks=n // 16, seed=31)
    gauge = LargestTensor()
    with gauge:
        out = kernels.paged_attention_ref(q, *tensors, d**-0.5, n)
    assert gauge.largest <= h * kernels.ATTN_REF_CHUNK * n < h * n * n, gauge.largest
    k_cache, v_cache, _, _, block_table = tensors
    k, v = (c[block_table[0].long()].reshape(n, hkv, d).repeat_interleave(h // hkv, dim=1)  # [L, H, D]
            for c in (k_cache, v_cache))
    for i in (0, 63, 64, 2500, n - 1):  # query i sees keys 0..i
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[i], k[:i + 1]) * d**-0.5, dim=-1)
        torch.testing.assert_close(out[i], torch.einsum("hl,lhd->hd", p, v[:i + 1]), atol=1e-5, rtol=1e-4)


# -- 1.5 moe_align ------------------------------------------------------------------------------------


def _check_moe_align_invariants(topk_ids, num_experts, block_m, sorted_ids, block_expert, num_padded):
    n_assign = topk_ids.numel()
    flat = topk_ids.reshape(-1).long().cpu()
    sorted_ids, block_expert = sorted_ids.cpu().long(), block_expert.cpu().long()
    used = int(num_padded.cpu()[0])
    counts = torch.bincount(flat, minlength=num_experts)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert sorted_ids.shape[0] == kernels.moe_max_padded(n_assign, num_experts, block_m)
    assert block_expert.shape[0] == sorted_ids.shape[0] // block_m
    real = sorted_ids[sorted_ids < n_assign]
    assert torch.equal(real.sort().values, torch.arange(n_assign)), "each assignment exactly once"
    assert bool((sorted_ids[used:] == n_assign).all()), "slots past num_padded are padding"
    for blk in range(used // block_m):
        ids = sorted_ids[blk * block_m : (blk + 1) * block_m]
        ids = ids[ids < n_assign]
        assert bool((flat[ids] == block_expert[blk]).all()), f"block {blk} mixes experts"
    # Each expert's blocks: exactly ceil(count / block_m) of them, so zero-token experts get none.
    blocks_per_expert = torch.bincount(block_expert[: used // block_m], minlength=num_experts)
    assert torch.equal(blocks_per_expert, (counts + block_m - 1) // block_m)


def _moe_canonical(sorted_ids, block_expert, block_m):
    """sorted_ids with each expert's group sorted: the order inside a group is unspecified."""
    expert_of_slot = block_expert.long().repeat_interleave(block_m)
    return (expert_of_slot * (2**32) + sorted_ids.long()).sort().values


@pytest.mark.parametrize("n,top_k,num_experts,block_m,only", [
    (1, 1, 4, 16, None),  # single token, top-1
    (1, 8, 16, 16, None),  # single token, top-8
    (5, 2, 8, 4, 3),  # experts 3..7 get no tokens
    (13, 8, 9, 16, None),  # not a multiple of anything
    (40, 4, 128, 16, 20),  # many experts, most empty
])
def test_kernel_moe_align(n, top_k, num_experts, block_m, only):
    _, ids = _routing(n, top_k, num_experts, seed=9, only=only)
    got = kernels.moe_align(ids, num_experts, block_m)
    want = kernels.moe_align_ref(ids, num_experts, block_m)
    _check_moe_align_invariants(ids, num_experts, block_m, *got)
    _check_moe_align_invariants(ids, num_experts, block_m, *want)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert torch.equal(_moe_canonical(got[0], got[1], block_m), _moe_canonical(want[0], want[1], block_m))
    _, other_ids = _routing(n, top_k, num_experts, seed=10)
    other = kernels.moe_align(other_ids, num_experts, block_m)
    assert [t.shape for t in other] == [t.shape for t in got], "shapes must not depend on routing"


# -- 1.6 fused_moe ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,top_k,num_experts,d,inter,only", [
    (1, 1, 4, 32, 24, None),  # single token, top-1
    (3, 8, 10, 40, 40, None),  # top-8
    (6, 2, 8, 48, 72, 3),  # experts with no tokens
    (24, 2, 4, 24, 16, None),  # 12 tokens per expert: BLOCK_M 32
    (70, 4, 4, 16, 20, None),  # 70 tokens per expert: BLOCK_M 64
])
def test_kernel_fused_moe(n, top_k, num_experts, d, inter, only):
    """The sorted path (moe_align, two grouped GEMMs, silu_and_mul between) at every token count."""
    x = _randn(n, d, seed=11)
    gate_up = _randn(num_experts, 2 * inter, d, seed=12) / d**0.5
    down = _randn(num_experts, d, inter, seed=13) / inter**0.5
    weights, ids = _routing(n, top_k, num_experts, seed=14, only=only)
    out = kernels.fused_moe(x, gate_up, down, weights, ids)
    torch.testing.assert_close(out, kernels.fused_moe_ref(x, gate_up, down, weights, ids), **MOE_TOL)


def test_kernel_fused_moe_rejects_bad_input():
    x, gate_up, down = _randn(2, 32, seed=15), _randn(8, 32, 32, seed=16), _randn(8, 32, 16, seed=17)
    weights, ids = _routing(2, 2, 8, seed=18)
    cases = [("gate_up", dict(gate_up=gate_up[:, :, :16])), ("down", dict(down=down[:, :, :8])),
             ("topk_ids", dict(topk_ids=ids[:1])), ("topk_weights", dict(topk_weights=weights[:, :1]))]
    for fn in (kernels.fused_moe, kernels.fused_moe_decode, kernels.fused_moe_ref):
        for name, bad in cases:
            kw = dict(x=x, gate_up=gate_up, down=down, topk_weights=weights, topk_ids=ids) | bad
            with pytest.raises(ValueError, match=name):
                fn(**kw)
    with pytest.raises(ValueError, match="expected int"):  # moe_align sorts integer expert ids only
        kernels.fused_moe(x, gate_up, down, weights, ids.float())


# -- Part 1 on the GPU: bf16 at Qwen3 shapes, and no host sync ---------------------------------------


@needs_cuda
def test_kernel_gpu_elementwise_bf16():
    t, h, hkv, d, hidden, inter = 256, 16, 8, 128, 1024, 3072
    x, w = _randn(t, hidden, seed=30, device=CUDA_DEVICE, dtype=BF16), _randn(hidden, seed=31, device=CUDA_DEVICE, dtype=BF16)
    torch.testing.assert_close(kernels.add_rmsnorm(x, None, w, 1e-6)[0], kernels.rmsnorm_ref(x, w, 1e-6),
                               **BF16_ELEMENTWISE_TOL)
    res = _randn(t, hidden, seed=32, device=CUDA_DEVICE, dtype=BF16)
    out, new_res = kernels.add_rmsnorm(x, res.clone(), w, 1e-6)
    out_ref, new_res_ref = kernels.add_rmsnorm_ref(x, res.clone(), w, 1e-6)
    torch.testing.assert_close(out, out_ref, **BF16_ELEMENTWISE_TOL)
    torch.testing.assert_close(new_res, new_res_ref, atol=0, rtol=0)
    gu = _randn(t, 2 * inter, seed=33, device=CUDA_DEVICE, dtype=BF16)
    torch.testing.assert_close(kernels.silu_and_mul(gu), kernels.silu_and_mul_ref(gu), **BF16_ELEMENTWISE_TOL)
    qkv, q, k, v = _qkv_views(t, h, hkv, d, seed=34, device=CUDA_DEVICE, dtype=BF16)
    qkv_ref, q_ref, _, _ = _qkv_views(t, h, hkv, d, seed=34, device=CUDA_DEVICE, dtype=BF16)
    positions = torch.randint(0, 4096, (t,), device=CUDA_DEVICE)
    cos_sin = _randn(4096, d, seed=35, device=CUDA_DEVICE)
    norms = (_randn(d, seed=36, device=CUDA_DEVICE, dtype=BF16), _randn(d, seed=37, device=CUDA_DEVICE, dtype=BF16))
    nan_cache = torch.full((65, 16, hkv, d), float("nan"), device=CUDA_DEVICE, dtype=BF16)
    caches, caches_ref = (nan_cache.clone(), nan_cache.clone()), (nan_cache.clone(), nan_cache.clone())
    slots = torch.randperm(64 * 16, device=CUDA_DEVICE)[:t]
    slots[::7] = -1
    kernels.rope_write_kv(q, k, v, *caches, slots, positions, cos_sin, *norms)
    kernels.rope_write_kv_ref(q_ref, k, v, *caches_ref, slots, positions, cos_sin, *norms)
    torch.testing.assert_close(qkv, qkv_ref, **BF16_ELEMENTWISE_TOL)  # q rotated; k and v untouched
    real = slots >= 0
    assert torch.equal(caches[1].view(-1, hkv, d)[slots[real]], v[real])
    for c, c_ref in zip(caches, caches_ref):
        assert c[:64].isnan().sum() == (64 * 16 - int(real.sum())) * hkv * d, "only the real slots change"
        torch.testing.assert_close(c[:64], c_ref[:64], equal_nan=True, **BF16_ELEMENTWISE_TOL)


@needs_cuda
@pytest.mark.parametrize("n", [1, 64, 300, 2100, 4200])  # 4200 x 8 assignments: the torch moe_align path
def test_kernel_gpu_fused_moe_bf16(n):
    num_experts, d, inter, top_k = 128, 2048, 768, 8
    x = _randn(n, d, seed=40, device=CUDA_DEVICE, dtype=BF16)
    gate_up = (_randn(num_experts, 2 * inter, d, seed=41, device=CUDA_DEVICE) / d**0.5).to(BF16)
    down = (_randn(num_experts, d, inter, seed=42, device=CUDA_DEVICE) / inter**0.5).to(BF16)
    weights, ids = _routing(n, top_k, num_experts, seed=43, device=CUDA_DEVICE)
    align = kernels.moe_align(ids, num_experts, 16)
    _check_moe_align_invariants(ids, num_experts, 16, *align)
    out = kernels.fused_moe(x, gate_up, down, weights, ids)
    torch.testing.assert_close(out, kernels.fused_moe_ref(x, gate_up, down, weights, ids), **BF16_GEMM_TOL)


@needs_cuda
@pytest.mark.parametrize("q_lens,seq_lens", [
    ([1] * 4, [8000, 1, 0, 555]),  # decode: one program a request and kv head walks its whole context
    ([300, 1, 17, 1], [300, 4000, 1000, 0]),  # mixed prefill / decode / padding
    ([1, 1], [3000, 70]),
])
def test_kernel_gpu_paged_attention_bf16(q_lens, seq_lens):
    h, hkv, d, page = 16, 8, 128, 16
    max_blocks = -(-max(seq_lens) // page) + 1
    q, tensors = _attention_case(q_lens, seq_lens, h, hkv, d, page, max_blocks, seed=44, device=CUDA_DEVICE, dtype=BF16)
    out = kernels.paged_attention(q, *tensors, d**-0.5, max(q_lens))
    ref = kernels.paged_attention_ref(q, *tensors, d**-0.5, max(q_lens))
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **BF16_GEMM_TOL)


def _paged_attention_compiles() -> int:
    """paged_attention over batches of 1, 2, 3 and 16 requests with block tables 1, 16, 33 and 2 wide (Triton
    would specialise on == 1 and multiples of 16), each checked: how many times it compiled."""
    compiled, prev = [], triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda *args, **kwargs: compiled.append(kwargs.get("repr"))
    try:
        for q_lens, seq_lens, width in [([5], [5], 1), ([3, 1], [40, 9], 16), ([20, 1, 1], [40, 9, 300], 33),
                                        ([1] * 16, [17] * 16, 2)]:
            q, tensors = _attention_case(q_lens, seq_lens, 16, 8, 128, 16, width, seed=45, device=CUDA_DEVICE,
                                         dtype=BF16)
            out = kernels.paged_attention(q, *tensors, 128**-0.5, 20)  # one host-side bound: the same tiles
            torch.testing.assert_close(out, kernels.paged_attention_ref(q, *tensors, 128**-0.5, 20), **BF16_GEMM_TOL)
    finally:
        triton.knobs.runtime.jit_post_compile_hook = prev
    return len(compiled)


@needs_cuda
def test_kernel_gpu_paged_attention_compiles_once_for_any_batch():
    """An eager prompt step's request count and block-table width change from step to step: paged_attention
    compiles once for all of them, so a load run never meets a compile (it stalls the GPU for up to a second).
    In a fresh process, so no variant an earlier test compiled can hide a second one."""
    r = subprocess.run([sys.executable, "-c", "import test_all; print(test_all._paged_attention_compiles())"],
                       capture_output=True, text=True, timeout=300, cwd=HERE)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-1] == "1", r.stdout


@needs_cuda
def test_kernel_gpu_no_host_sync():
    """Every launcher, Part 1 and Part 2, with torch's sync check on: no .item(), no grid from device values."""
    t, h, hkv, d = 16, 16, 8, 128
    x, w = _randn(t, 1024, seed=50, device=CUDA_DEVICE, dtype=BF16), _randn(1024, seed=51, device=CUDA_DEVICE, dtype=BF16)
    qkv, q, k, v = _qkv_views(t, h, hkv, d, seed=52, device=CUDA_DEVICE, dtype=BF16)
    positions = torch.arange(t, device=CUDA_DEVICE)
    cos_sin = _randn(128, d, seed=53, device=CUDA_DEVICE)  # positions up to 99
    gate_up = _randn(128, 2 * 768, 1024, seed=54, device=CUDA_DEVICE, dtype=BF16)
    down = _randn(128, 1024, 768, seed=55, device=CUDA_DEVICE, dtype=BF16)
    weights, ids = _routing(t, 8, 128, seed=56, device=CUDA_DEVICE)
    _, big_ids = _routing(4200, 8, 128, seed=57, device=CUDA_DEVICE)
    q_att, tensors = _attention_case([1] * t, [100] * t, h, hkv, d, 16, 8, seed=58, device=CUDA_DEVICE, dtype=BF16)
    q_pre, tensors_pre = _attention_case([20, 1], [40, 9], h, hkv, d, 16, 4, seed=59, device=CUDA_DEVICE, dtype=BF16)
    k_cache, v_cache, _, seq_lens, block_table = tensors
    slots = block_table[:, -1].long() * 16
    w_lin = _randn(4096, 1024, seed=60, device=CUDA_DEVICE, dtype=BF16)
    logits = _randn(4, 20000, seed=61, device=CUDA_DEVICE)
    temperature, seeds = torch.full((4,), 0.7, device=CUDA_DEVICE), torch.arange(4, device=CUDA_DEVICE)
    residual = x.clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kernels.add_rmsnorm(x, None, w, 1e-6)
        kernels.add_rmsnorm(x, residual, w, 1e-6)
        kernels.silu_and_mul(qkv)
        kernels.rope_write_kv(q, k, v, tensors[0], tensors[1], positions, positions, cos_sin, w[:d], w[:d])
        kernels.moe_align(ids, 128, 16)
        kernels.moe_align(big_ids, 128, 64)  # above the kernel threshold: the torch path
        kernels.moe_align_ref(ids, 128, 16)
        kernels.fused_moe(x, gate_up, down, weights, ids)
        kernels.paged_attention(q_att, *tensors, d**-0.5, 1)
        kernels.paged_attention(q_pre, *tensors_pre, d**-0.5, 20)
        kernels.prefill_attention(q_att, *tensors, d**-0.5, 1)
        kernels.prefill_attention(q_pre, *tensors_pre, d**-0.5, 20)
        # Part 2
        kernels.moe_route(x[:, :128].contiguous(), 8, True)
        kernels.fused_moe_decode(x[:2], gate_up, down, weights[:2], ids[:2])
        kernels.fused_moe_tuned(x[:2], gate_up, down, weights[:2], ids[:2])
        kernels.linear(x[:1], w_lin)
        kernels.linear(x, w_lin, gated=True)
        kernels.add_rmsnorm_linear(x[:1], residual[:1], w, 1e-6, w_lin)
        for splits in (None, 1, 4):  # splits chosen from the SM count, none, and forced
            kernels.decode_attention(q_att.clone(), k, v, k_cache, v_cache, slots, seq_lens.long() - 1, seq_lens,
                                     block_table, cos_sin, d**-0.5, num_splits=splits)
        kernels.race_sample(logits, temperature, seeds, seeds)
        kernels.race_sample(logits, temperature * 0, seeds, seeds, greedy=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()

# ==========================================================================================================
# scheduler.py: the block manager and its prefix cache, continuous batching, chunked prefill, preemption,
# stops (through the engine, against the reference model)
# ==========================================================================================================


def test_release_of_many_requests_equals_their_releases_one_by_one():
    """Requests that finish on one step give their blocks back in one call: the cache must end up as if
    each had been released alone, in order (the same publishes, the same LRU order of cached-free blocks,
    the same free list), and a block released twice must still be caught."""
    def managers():
        bm = scheduler.BlockManager(num_blocks=16, block_size=4)
        shared = [1, 2, 3, 4]
        reqs = [scheduler.Request(str(i), shared + [10 + i] * 8, SamplingParams(), 0) for i in range(3)]
        reqs[2].token_ids = list(reqs[1].token_ids)  # the same decode content as request 1: stays private
        for req in reqs:
            bm.use_cached(req, bm.cached_prefix(req))
            assert bm.allocate(req, len(req.token_ids) - req.num_computed_tokens)
            bm.publish(req, 4)  # the shared prompt block: published by the first, reused by the others
            req.num_computed_tokens = len(req.token_ids)
        reqs[0].token_ids[-1] = PLACEHOLDER  # its last token in flight: its last block stays private
        return bm, reqs

    one, reqs = managers()
    for req in reqs:
        one.release([req])
    many, reqs = managers()
    many.release(reqs)
    for name in ("ref_count", "key_of", "prefix_id", "block_of", "free", "cached_free"):
        assert getattr(many, name) == getattr(one, name), name
    assert len(many.block_of) == 4 and len(many.cached_free) == 4  # shared; 1 of request 0, 2 of request 1
    assert all(not r.block_ids and not r.prefix_ids for r in reqs)
    reqs[0].block_ids = [next(iter(many.cached_free))]
    with pytest.raises(AssertionError, match="freed twice"):
        many.release(reqs[:1])


def _serve_prompt(bm: scheduler.BlockManager, tokens: list[int]) -> list[int]:
    """What the scheduler does with a prompt that is computed and finishes: it takes its cached prefix,
    blocks for the rest, publishes its full blocks, and gives them all back. Returns the cached blocks."""
    req = scheduler.Request("r", list(tokens), SamplingParams(), 0)
    hit = bm.cached_prefix(req)
    bm.use_cached(req, hit)
    assert bm.allocate(req, len(tokens) - req.num_computed_tokens)
    req.num_computed_tokens = len(tokens)
    bm.publish(req, len(tokens))
    bm.release([req])
    return hit


def _prefix_hits(bm: scheduler.BlockManager, tokens: list[int]) -> int:
    return len(bm.cached_prefix(scheduler.Request("probe", list(tokens), SamplingParams(), 0)))


def test_prefix_cache_evicts_the_least_recently_freed_block_tail_first():
    """Cached-free blocks are evicted only once no never-published block is left, the least recently freed
    first, and of one request's blocks the last first, so a prefix loses its tail before its head: a
    prompt seen again after evictions still finds what is left of its prefix."""
    bm = scheduler.BlockManager(num_blocks=8, block_size=4)
    a, b = list(range(100, 109)), list(range(200, 209))  # 9 tokens: 2 full blocks (cacheable) and 1 more
    assert _serve_prompt(bm, a) == [] and _serve_prompt(bm, b) == []
    assert _serve_prompt(bm, a) == [0, 1], "a's prefix, found again"  # and freed again: now newer than b's
    assert len(bm.cached_free) == 4 and len(bm.free) == 4
    c = scheduler.Request("c", list(range(300, 317)), SamplingParams(), 0)  # 17 tokens: 5 blocks, 1 evicted
    assert bm.allocate(c, 17) and len(bm.cached_free) == 3
    assert _prefix_hits(bm, a) == 2, "a was freed last: none of its blocks goes"
    assert _prefix_hits(bm, b) == 1, "b's tail goes, its head stays"
    d = scheduler.Request("d", [400], SamplingParams(), 0)
    assert bm.allocate(d, 1)  # the next eviction: b's head, still before any of a's
    assert _prefix_hits(bm, a) == 2 and _prefix_hits(bm, b) == 0
    bm.release([c, d])
    assert _serve_prompt(bm, a) == [0, 1], "a's prefix survived both evictions"


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_chunked_prefill_matches_reference(ckpt_dirs, arch):
    """Long prompts in chunks of a 48-token budget, decodes beside them, each step driven by hand through
    the scheduler's plan, the runner and the book."""
    cfg, sd, folder = ckpt_dirs[arch]
    prompts = mixed_prompts(6, cfg["vocab_size"], seed=2, lengths=(300, 3, 120, 1, 64, 45))
    engine = Engine(model=folder, max_num_batched_tokens=48)  # every long prompt takes several steps
    chunks = []
    ids = [engine.add_request(p, greedy(5)) for p in prompts]
    done = {}
    while engine.has_unfinished():
        out = engine.scheduler.schedule()
        chunks.append(out.num_tokens)
        toks = engine.runner.execute(out).tolist() if out.requests else []
        for r in engine.book.update(out, toks):
            done[r.request_id] = r.output_token_ids
    assert any(len(c) > 1 and max(c) > 1 and min(c) == 1 for c in chunks), "decodes ran beside a chunk"
    assert all(sum(c) <= 48 for c in chunks)
    for p, i in zip(prompts, ids):
        assert done[i] == ref_greedy(sd, cfg, p, 5)
    check_clean(engine)


def test_prefix_cache_hits_match_reference(ckpt_dirs):
    cfg, sd, folder = ckpt_dirs["llama"]
    rng = random.Random(3)
    shared = [rng.randrange(cfg["vocab_size"]) for _ in range(70)]
    prompts = [shared + [rng.randrange(cfg["vocab_size"]) for _ in range(k)] for k in (0, 1, 5, 40)]
    prompts.append(shared[:64])  # entirely cached blocks: the last token is still recomputed
    engine = Engine(model=folder)
    first = run(engine, prompts, greedy(5))  # same step: duplicates must not be published twice
    bm = engine.book.blocks
    published = [h for h in bm.key_of if h is not None]  # one block per content, however many requests had it
    assert len(published) == len(set(published)) == len(bm.block_of) >= 4
    hits_before = engine.scheduler.num_cached_tokens
    second = run(engine, prompts, greedy(5))
    assert engine.scheduler.num_cached_tokens - hits_before >= 4 * 64, "second run reused the prefix"
    for p, a, b in zip(prompts, first, second):
        want = ref_greedy(sd, cfg, p, 5)
        assert a.token_ids == want and b.token_ids == want
    check_clean(engine)


@pytest.mark.parametrize("use_async", [False, True])
def test_prefix_cache_hits_blocks_filled_while_decoding(ckpt_dirs, use_async):
    """A block filled while decoding is published when its request finishes: a later request whose prompt
    is the first one's prompt and output (a conversation's next turn) reuses it."""
    cfg, sd, folder = ckpt_dirs["llama"]
    rng = random.Random(5)
    prompt = [rng.randrange(cfg["vocab_size"]) for _ in range(20)]
    engine = Engine(model=folder)
    first = run(engine, [prompt], greedy(40), use_async)[0]
    # 60 tokens, the first 59 in the cache: blocks 0-2 full, blocks 1 and 2 filled while decoding.
    turn = prompt + first.token_ids + [rng.randrange(cfg["vocab_size"]) for _ in range(3)]
    hits_before = engine.scheduler.num_cached_tokens
    second = run(engine, [turn], greedy(5), use_async)[0]
    assert engine.scheduler.num_cached_tokens - hits_before == 3 * 16, "the decode-filled blocks were reused"
    assert second.token_ids == ref_greedy(sd, cfg, turn, 5)
    check_clean(engine)


def test_prefix_cache_hits_after_evictions(ckpt_dirs):
    """Under cache pressure the engine evicts the least recently freed blocks, a prefix's tail first: the
    prompts it keeps coming back to keep their prefix, and tokens from cached blocks stay right."""
    cfg, sd, folder = ckpt_dirs["llama"]
    rng = random.Random(6)
    a, b, c = ([rng.randrange(cfg["vocab_size"]) for _ in range(n)] for n in (9, 9, 17))
    engine = Engine(model=folder, block_size=4, num_blocks=8)  # a and b take 3 blocks each (2 cacheable), c 5
    hits = []
    for prompt in (a, b, a, c, a, b):  # c finds 4 blocks free and evicts 1: b's tail, b being freed before a
        before = engine.scheduler.num_cached_tokens
        out = run(engine, [prompt], greedy(1))[0]
        hits.append(engine.scheduler.num_cached_tokens - before)
        assert out.token_ids == ref_greedy(sd, cfg, prompt, 1)
    assert hits == [0, 0, 8, 0, 8, 4], "prefix tokens found in the cache, run by run"
    check_clean(engine)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_preemption_matches_reference(ckpt_dirs, arch):
    cfg, sd, folder = ckpt_dirs[arch]
    prompts = mixed_prompts(6, cfg["vocab_size"], seed=4, lengths=(40, 33, 60, 17, 50, 25))
    engine = Engine(model=folder, num_blocks=12)  # 192 tokens for ~225 of prompts + 90 generated
    outs = run(engine, prompts, greedy(15))
    assert engine.scheduler.num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert o.token_ids == ref_greedy(sd, cfg, p, 15)
    check_clean(engine)


def test_preemption_takes_the_newest_request_and_recomputes_it(ckpt_dirs, monkeypatch):
    """When a running request needs a block and none is free, the most recently arrived of the others not
    yet scheduled in this step is preempted, as in vLLM: it gives back its blocks, forgets its KV and
    waits at the head of the queue, before requests that arrived after it; readmitted, it recomputes its
    prompt and the tokens it had generated (past any prefix still cached), and ends as it would have."""
    cfg, _, folder = ckpt_dirs["qwen3"]
    # a's 7 tokens cross a block boundary two steps before b, c and d's 5 do; e waits for a sequence slot.
    prompts = mixed_prompts(5, cfg["vocab_size"], seed=7, lengths=(7, 5, 5, 5, 5))
    engine = Engine(model=folder, block_size=4, num_blocks=8, max_num_seqs=4)  # 8 blocks: 2 each for a-d
    sched, book = engine.scheduler, engine.book
    victims, plans, schedule, preempt = [], [], sched.schedule, sched._preempt

    def recording_preempt(req):
        unscheduled = [r.request_id for r in book.running if r.last_step != sched.step_id]
        victims.append((req.request_id, unscheduled))
        preempt(req)

    def recording_schedule():
        out = schedule()
        plans.append(([(r.request_id, start, n, len(r.token_ids)) for r, start, n in
                       zip(out.requests, out.starts.tolist(), out.num_tokens)],
                      [(r.request_id, r.status, r.num_computed_tokens, list(r.block_ids)) for r in book.waiting]))
        return out

    monkeypatch.setattr(sched, "_preempt", recording_preempt)
    monkeypatch.setattr(sched, "schedule", recording_schedule)
    outs = run(engine, prompts, greedy(10))
    a, b, c, d, e = (o.request_id for o in outs)
    # Step 3: a computes its 9th token and needs a third block. b, c and d wait their turn in this step;
    # the newest of them, d, goes (oldest-first would take b), and a, b and c decode.
    assert victims[0] == (d, [a, b, c, d]), "a grows; of b, c and d, the newest goes"
    step, first = next((i, p) for i, p in enumerate(plans) if any(r == d for r, *_ in p[1]))
    assert [r for r, *_ in first[0]] == [a, b, c]
    assert first[1] == [(d, "waiting", 0, []), (e, "waiting", 0, [])], "d, KV forgotten, waits before e"
    # Its next plan recomputes the tokens it had, all but a cached prefix of whole prompt blocks, in one chunk.
    start, n, length = next(x[1:] for plan, _ in plans[step + 1:] for x in plan if x[0] == d)
    assert start in (0, 4) and n > 1 and start + n == length > len(prompts[3])
    unpressured = run(Engine(model=folder, block_size=4), prompts, greedy(10))
    assert tokens_of(outs) == tokens_of(unpressured)
    check_clean(engine)


def test_stops_on_eos_stop_ids_and_max_len(ckpt_dirs):
    cfg, sd, folder = ckpt_dirs["qwen3"]
    p = mixed_prompts(1, cfg["vocab_size"], seed=5, lengths=(20,))[0]
    want = ref_greedy(sd, cfg, p, 8)
    engine = Engine(model=folder, max_model_len=len(p) + 4)
    o = run(engine, [p], greedy(4))[0]  # max_tokens fills max_model_len: the model length is reached
    assert o.token_ids == want[:4] and o.finish_reason == "length"
    with pytest.raises(ValueError, match="max_tokens=5 is invalid: the prompt has 20 tokens and max_model_len=24 "
                                         "leaves room for at most 4"):  # refused, as vLLM's server does
        engine.add_request(p, greedy(5))
    engine = Engine(model=folder)
    o = run(engine, [p], greedy(8, stop_token_ids=[want[2]]))[0]
    assert o.token_ids == want[:want.index(want[2]) + 1] and o.finish_reason == "stop"
    # eos from generation_config.json wins over config.json's; ignore_eos turns it off
    folder2 = save_checkpoint(os.path.join(folder, "eos"), dict(cfg, eos_token_id=9999), sd)
    with open(os.path.join(folder2, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [want[3]]}, f)
    engine = Engine(model=folder2)
    o = run(engine, [p], SamplingParams(temperature=0, max_tokens=8))[0]
    assert o.token_ids == want[:want.index(want[3]) + 1] and o.finish_reason == "stop"
    assert run(engine, [p], greedy(8))[0].token_ids == want
    check_clean(engine)

# ==========================================================================================================
# graphs.py: the static-buffer runner (eager on the CPU, captured on CUDA), its buckets, and padding that
# cannot do harm
# ==========================================================================================================


def _decode_step(engine, prompts):
    """Add prompts, run their prefill, and return the next (decode-only) step's plan and batch. The requests
    stream their tokens ("cumulative"), so the plan is the general path's, whatever the engine's tuning."""
    for p in prompts:
        engine.add_request(p, greedy(3, output_kind="cumulative"))
    engine.step()
    out = engine.scheduler.schedule()
    assert out.is_decode and len(out.requests) == len(prompts)
    return out, engine.runner.inputs.prepare(out)[0]


def _finish(engine, out, logits):
    engine.book.update(out, logits.argmax(-1).tolist())
    while engine.has_unfinished():
        engine.step()
    check_clean(engine)


def test_graph_buckets_are_decided_once():
    assert graphs.default_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert graphs.default_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert graphs.default_buckets(256)[-1] == 256 and len(graphs.default_buckets(256)) == 35
    # steps with prompt tokens, by tokens: powers of two to 256, then every 128, at most 2048
    assert graphs.default_token_buckets(2048) == [16, 32, 64, 128, *range(256, 2049, 128)]
    assert graphs.default_token_buckets(100) == [16, 32, 64, 100]
    assert graphs.default_token_buckets(16384) == graphs.default_token_buckets(2048)
    engine = Engine(model="tiny", enforce_eager=False, max_num_seqs=20, max_num_batched_tokens=100)
    g = engine.runner.graphs
    assert g.buckets == graphs.default_buckets(20) and g.token_buckets == graphs.default_token_buckets(100)
    decode_only = Engine(model="tiny", enforce_eager=False, cudagraph_mode="full_decode_only")
    assert decode_only.runner.graphs.token_buckets == []
    g = Engine(model="tiny", enforce_eager=False, graph_buckets=(8, 2), graph_token_buckets=(64, 16)).runner.graphs
    assert g.buckets == [2, 8] and g.token_buckets == [16, 64] and not g.capture_graphs  # the CPU: eager
    assert Engine(model="tiny").runner.graphs is None, "the CPU's default: no graph runner"


def _shape(tokens: int, requests: int, max_query_len: int, max_seq_len: int = 40):
    """What key_for reads of a Batch: its sizes and its two host bounds."""
    return SimpleNamespace(input_ids=torch.zeros(tokens), seq_lens=torch.zeros(requests),
                           max_query_len=max_query_len, max_seq_len=max_seq_len)


def test_graph_key_for_picks_the_smallest_bucket():
    """A decode step (one token a request) replays ("decode", the smallest bucket >= its requests); any other
    step ("prompt", the smallest token bucket >= its tokens); a step past the largest bucket runs eagerly
    (None). Part 2's BoundedGraphRunner adds the smallest context bound >= the step's longest context."""
    g = Engine(model="tiny", enforce_eager=False, graph_buckets=(1, 2, 4, 8), graph_token_buckets=(16, 64),
               max_num_seqs=16).runner.graphs
    assert type(g) is graphs.GraphRunner, "the chapter's engine runs the chapter's graph runner"
    assert [g.key_for(_shape(b, b, 1)) for b in (1, 2, 3, 5, 8)] == \
        [("decode", 1), ("decode", 2), ("decode", 4), ("decode", 8), ("decode", 8)]
    assert g.key_for(_shape(9, 9, 1)) == ("prompt", 16), "a decode past the decode buckets: by its tokens"
    assert g.key_for(_shape(2, 3, 1)) == ("prompt", 16), "one-token rows with an empty request: not a decode"
    assert [g.key_for(_shape(t, 1, t)) for t in (2, 16, 17, 64)] == \
        [("prompt", 16), ("prompt", 16), ("prompt", 64), ("prompt", 64)]
    assert g.key_for(_shape(65, 3, 60)) is None and g.key_for(_shape(65, 65, 1)) is None
    decode_only = Engine(model="tiny", enforce_eager=False, graph_buckets=(1, 2, 4, 8),
                         cudagraph_mode="full_decode_only").runner.graphs
    assert decode_only.key_for(_shape(4, 4, 1)) == ("decode", 4)
    assert decode_only.key_for(_shape(5, 2, 4)) is None and decode_only.key_for(_shape(9, 9, 1)) is None
    # Decode graphs on both sides of a context bound (Part 2's packed attention): the one the batch allows
    tuned = Engine(model="tiny", enforce_eager=False, graph_buckets=(1, 2, 4, 8), graph_token_buckets=(16, 64),
                   max_num_seqs=16, tuned=True).runner.graphs
    bound = tuned.max_seq_len  # the CPU's ops have no context bounds: one decode graph a bucket
    assert type(tuned) is nanoengine.BoundedGraphRunner and tuned.context_bounds(8) == (bound,)
    assert tuned.key_for(_shape(3, 3, 1)) == ("decode", 4, bound) and tuned.key_for(_shape(2, 1, 2)) == ("prompt", 16)
    tuned.model.ops.decode_context_bounds = lambda b, hkv: (24,) if b == 8 else ()
    assert [tuned.key_for(_shape(7, 7, 1, m)) for m in (1, 24, 25)] == \
        [("decode", 8, 24), ("decode", 8, 24), ("decode", 8, bound)]
    assert ("decode", 8, 24) in tuned.keys() and ("decode", 4, bound) in tuned.keys()
    assert tuned.decode_batch(("decode", 8, 24)).max_seq_len == 24


@pytest.mark.parametrize("mode", ["full", "full_decode_only"])
def test_graph_runner_equals_plain_forward_for_every_batch_size(mode):
    """Decode batches of 1 to 11 through the static buffers, padded to their bucket: the logits of the plain
    forward. Past the largest decode bucket (8) a decode is a prompt graph's step ("full"), or eager."""
    engine = Engine(model="tiny", enforce_eager=False, graph_buckets=(1, 2, 4, 8), max_num_seqs=12,
                    cudagraph_mode=mode)
    g = engine.runner.graphs
    assert g is not None and not g.capture_graphs and g.buckets == [1, 2, 4, 8]
    for B in range(1, 12) if mode == "full" else (7, 9):  # the modes differ past the largest bucket only
        out, batch = _decode_step(engine, mixed_prompts(B, 4096, seed=B, lengths=(3, 17, 30, 1, 9)))
        with torch.inference_mode():
            plain = engine.model.compute_logits(engine.model(batch, engine.runner.kv_cache))
            key = g.key_for(batch)
            if B <= 8:
                assert key == ("decode", min(b for b in g.buckets if b >= B))
            else:
                assert key == (("prompt", 16) if mode == "full" else None)
            if key is not None:
                torch.testing.assert_close(g.run(batch), plain, atol=1e-4, rtol=1e-5)
            else:
                assert g.run(batch) is None  # above the largest bucket: eager
        _finish(engine, out, plain)


def test_graphed_engine_tokens_equal_eager():
    prompts = mixed_prompts(11, 4096, seed=13, lengths=(5, 17, 33, 2))
    for B in (1, 3, 4, 5, 8, 9, 11):
        graphed = LLM("tiny", enforce_eager=False, graph_buckets=(1, 2, 4, 8), max_num_seqs=11)
        eager = LLM("tiny", enforce_eager=True, max_num_seqs=11)
        assert tokens_of(graphed.generate(prompts[:B], greedy(5))) == tokens_of(eager.generate(prompts[:B], greedy(5)))


@pytest.mark.parametrize("use_async", [False, True])
def test_graphed_prompt_steps_equal_eager(monkeypatch, use_async):
    """Steps with prompt tokens replay a graph by their token count ("full", vLLM's FULL), padded with
    tokens that cannot touch a real request: prompts in chunks of a 32-token budget with decodes beside
    them give the float32 tokens of decode-only graphs and of no graphs at all. On the CPU the graphs are
    the same static-buffer path, run eagerly."""
    prompts = mixed_prompts(9, 4096, seed=44, lengths=(5, 40, 17, 2, 33, 1, 60))
    kinds = ["cumulative", "delta", "final_only"]
    params = [greedy(6, output_kind=kinds[i % 3]) for i in range(len(prompts))]
    keys, forward = [], graphs.GraphRunner.forward
    monkeypatch.setattr(graphs.GraphRunner, "forward", lambda self, key: keys.append(key) or forward(self, key))
    results = {}
    for name, settings in (("full", dict(enforce_eager=False, cudagraph_mode="full")),
                           ("full_decode_only", dict(enforce_eager=False, cudagraph_mode="full_decode_only")),
                           ("eager", dict(enforce_eager=True))):
        keys.clear()
        engine = Engine(model="tiny", max_num_batched_tokens=32, max_num_seqs=8, async_scheduling=use_async,
                        **settings)
        plans, schedule = [], engine.scheduler.schedule
        engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
        results[name] = tokens_of(run(engine, prompts, params, use_async))
        assert any(0 < p.num_decode < len(p.requests) for p in plans), "decodes ran beside prompt chunks"
        prompt_keys = [k for k in keys if k[0] == "prompt"]
        assert bool(prompt_keys) == (name == "full") and all(k[1] in (16, 32) for k in prompt_keys)
        assert any(k[0] == "decode" for k in keys) == (name != "eager")
        if name == "full":
            g = engine.runner.graphs
            assert g.tokens_run > g.tokens_real, "some steps were padded to their bucket"
        check_clean(engine)
    assert results["full"] == results["full_decode_only"] == results["eager"]


def test_padding_rows_cannot_touch_real_kv():
    engine = Engine(model="tiny", enforce_eager=False, graph_buckets=(8,), max_num_seqs=8, num_blocks=16)
    out, batch = _decode_step(engine, mixed_prompts(3, 4096, seed=14, lengths=(5, 20, 35)))
    kv = engine.runner.kv_cache
    kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(0)))  # known values everywhere
    before = kv.clone()
    with torch.inference_mode():
        logits = engine.runner.graphs.run(batch)  # 3 real rows, 5 padding rows
    changed = (kv != before).flatten(4).any(-1).any(0).any(0)  # (blocks + 1, block_size): slot written?
    real = set(batch.slot_mapping.tolist())
    bs, scratch = engine.cfg.block_size, engine.book.blocks.num_blocks
    written = {b * bs + o for b, o in changed.nonzero().tolist()}
    assert real <= written, "every real row's KV was written"
    assert {s for s in written if s // bs != scratch} == real, "nothing else in a real block changed"
    assert changed[scratch].any(), "padding rows wrote to the scratch block"
    assert logits.shape[0] == 3
    _finish(engine, out, logits)


def test_padding_tokens_are_harmless():
    """One prompt graph step of 14 real tokens in the bucket of 32, on a KV cache full of NaN: only the real
    tokens' slots (and the scratch block, the 18 padding tokens') change, nothing real reads a slot it did
    not write (NaN would show), and the real rows' logits are an eager step's."""
    prompts = mixed_prompts(2, 4096, seed=45, lengths=(5, 9))
    graphed = Engine(model="tiny", enforce_eager=False, graph_buckets=(1,), graph_token_buckets=(32,),
                     max_num_seqs=4, num_blocks=16)
    eager = Engine(model="tiny", enforce_eager=True, max_num_seqs=4, num_blocks=16)
    steps = []
    for engine in (graphed, eager):
        for p in prompts:
            engine.add_request(p, greedy(3, output_kind="cumulative"))
        out = engine.scheduler.schedule()
        steps.append((out, engine.runner.inputs.prepare(out)[0]))
    (out, batch), (eager_out, eager_batch) = steps
    g, kv = graphed.runner.graphs, graphed.runner.kv_cache
    assert g.key_for(batch) == ("prompt", 32) and batch.input_ids.shape[0] == 14
    kv.fill_(float("nan"))
    before = kv.clone()
    with torch.inference_mode():
        logits = g.run(batch)
        eager_logits = eager.model.compute_logits(eager.model(eager_batch, eager.runner.kv_cache)
                                                  [eager_batch.logits_indices])
    assert (g.tokens_run, g.tokens_real) == (32, 14)
    same = (kv == before) | (kv.isnan() & before.isnan())
    changed = (~same).flatten(4).any(-1).any(0).any(0)  # (blocks + 1, block_size): slot written?
    bs, scratch = graphed.cfg.block_size, graphed.book.blocks.num_blocks
    written = {b * bs + o for b, o in changed.nonzero().tolist()}
    assert {s for s in written if s // bs != scratch} == set(batch.slot_mapping.tolist()), "only the real slots"
    assert changed[scratch].any(), "the padding tokens wrote to the scratch block"
    assert logits.shape[0] == 2 and not logits.isnan().any()
    torch.testing.assert_close(logits, eager_logits, atol=1e-4, rtol=1e-5)
    _finish(graphed, out, logits)
    _finish(eager, eager_out, eager_logits)


def test_capture_warm_up_steps_give_every_token_a_request():
    """Capture runs each graph's forward once for real first (warm_up), on the static buffers as made: a step of
    padding only, every token owned by a request of seq_len 0, as attention asks. A token that none owned kept
    what attention's output memory held: on a card, NaN that the tuned MoE router made into an expert id past
    the last, an illegal address that took the process down."""
    engine = Engine(model="tiny-moe", tuned=True, enforce_eager=False, graph_buckets=(1, 4),
                    graph_token_buckets=(16, 64), max_num_seqs=4, num_blocks=16)
    g, seen = engine.runner.graphs, []
    assert not g.capture_graphs, "on the CPU the buffers are as made: no capture warmed them up"
    g.model.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    with torch.inference_mode():
        for key in g.keys():
            g.warm_up(key)
            batch = seen[-1]
            qsl, tokens = batch.query_start_loc.tolist(), batch.input_ids.shape[0]
            assert tokens == key[1] and qsl[0] == 0 and qsl[-1] == tokens, (key, qsl)
            assert all(a <= b for a, b in zip(qsl, qsl[1:])), (key, qsl)
            assert not batch.seq_lens.any() and (batch.slot_mapping == -1).all() and not batch.positions.any(), key
    assert len(seen) == len(g.keys()) and {key[0] for key in g.keys()} == {"prompt", "decode"}, "each graph once"


@needs_cuda
def test_gpu_capture_warm_ups_read_no_unwritten_memory(monkeypatch):
    """A real capture with every torch.empty full of NaN (what freed memory may hold): the tuned MoE forward's
    warm-ups leave finite hidden states, and the graphed engine's tokens are the eager one's."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    prompts = mixed_prompts(3, 4096, seed=61, lengths=(5, 20, 9))
    kw = dict(model="tiny-moe", tuned=True, dtype="float32", graph_token_buckets=(16, 64), **GPU)
    want = tokens_of(nanoengine.LLM(enforce_eager=True, **kw).generate(prompts, greedy(4)))
    with monkeypatch.context() as m:
        m.setattr(torch, "empty", nan_empty)
        llm = nanoengine.LLM(enforce_eager=False, **kw)
    g = llm.engine.runner.graphs
    assert g.capture_graphs and torch.isfinite(g.hidden[:16]).all(), "the 16-token warm-up, the last prompt one"
    assert tokens_of(llm.generate(prompts, greedy(4))) == want


def test_scratch_block_never_handed_out_under_pressure(monkeypatch):
    taken, take = [], scheduler.BlockManager.take

    def recording_take(self, n):
        blocks = take(self, n)
        taken.extend(blocks)
        return blocks
    monkeypatch.setattr(scheduler.BlockManager, "take", recording_take)
    engine = Engine(model="tiny", enforce_eager=False, graph_buckets=(1, 2, 4, 8), num_blocks=10)
    outs = run(engine, mixed_prompts(8, 4096, seed=15, lengths=(30, 40, 9)), greedy(20))
    assert engine.scheduler.num_preemptions > 0 and taken and max(taken) < 10
    assert all(len(o.token_ids) == 20 for o in outs)
    check_clean(engine)


def test_graphs_refuse_a_forward_that_reads_the_host():
    """Capture needs a forward that never reads a batch value on the host: the unfused MoE asks which experts
    got tokens, and the torch references are not known to be sync-free (graph_safe is False for both)."""
    for engine in (Engine(model="tiny-moe", fuse=False), Engine(model="tiny-moe", triton=False)):
        assert not engine.model.graph_safe
        with pytest.raises(ValueError, match="enforce_eager=True"):
            graphs.GraphRunner(engine.model, engine.runner.kv_cache, 8, 2, buckets=[1, 2], token_buckets=[16],
                               capture=True)
    assert nanoengine.build_model(nanoengine.EngineConfig(model="tiny", device="cpu", triton=True))[0].graph_safe


def test_steps_outside_inference_mode_never_write_graph_outputs(monkeypatch):
    """A captured graph's outputs are inference tensors (capture runs under inference_mode), and steps run
    outside it, where writing to one in place raises. Made so here, the graph runner's outputs (decode and
    prompt graphs) go through greedy, temperature, top-k / top-p sampling, sync and async, without such a
    write."""
    real_forward = graphs.GraphRunner.forward

    def forward_as_captured(self, key):
        with torch.inference_mode():
            return real_forward(self, key)
    monkeypatch.setattr(graphs.GraphRunner, "forward", forward_as_captured)
    prompts = mixed_prompts(3, 4096, seed=24, lengths=(5, 20, 3))
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1, max_tokens=8), greedy(8),
              SamplingParams(temperature=1.0, top_p=0.5, seed=2, max_tokens=8)]
    for async_scheduling in (False, True):
        llm = LLM("tiny", enforce_eager=False, async_scheduling=async_scheduling, max_num_seqs=8)
        assert llm.engine.runner.graphs is not None
        assert [len(o.token_ids) for o in llm.generate(prompts, params)] == [8, 8, 8]
    assert not torch.is_inference_mode_enabled()


@needs_cuda
def test_gpu_graphs_equal_eager_for_every_batch_size():
    graphed = nanoengine.LLM("tiny", enforce_eager=False, max_num_seqs=40, **GPU)
    eager = nanoengine.LLM("tiny", enforce_eager=True, max_num_seqs=41, **GPU)
    buckets = graphed.engine.runner.graphs.buckets
    assert buckets == [1, 2, 4, 8, 16, 24, 32, 40] and graphed.engine.runner.graphs.capture_graphs
    prompts = mixed_prompts(41, 4096, seed=16, lengths=(5, 17, 33, 2))
    for B in sorted(set(range(1, 12)) | {b + d for b in buckets for d in (-1, 0, 1)}):
        if 1 <= B <= 40:
            a = tokens_of(graphed.generate(prompts[:B], greedy(6)))
            assert a == tokens_of(eager.generate(prompts[:B], greedy(6))), f"batch {B}"


@needs_cuda
@pytest.mark.parametrize("use_async", [False, True])
def test_gpu_graphed_prompt_steps_equal_eager(monkeypatch, use_async):
    """Real CUDA graphs for steps with prompt tokens ("full"): prompts in chunks of a 64-token budget, decodes
    beside them and joining, float32: the eager engine's tokens, and the prompt graphs were replayed."""
    dev = dict(GPU, dtype="float32", max_num_batched_tokens=64, max_num_seqs=16)
    prompts = mixed_prompts(24, 4096, seed=46, lengths=(5, 90, 17, 200, 33, 1))
    graphed = nanoengine.LLM("tiny", cudagraph_mode="full", async_scheduling=use_async, **dev)
    g = graphed.engine.runner.graphs
    assert g.capture_graphs and g.token_buckets == [16, 32, 64] and ("prompt", 64) in g.graphs
    replayed, key_for = collections.Counter(), g.key_for

    def counted(batch):
        key = key_for(batch)
        replayed[key and key[0]] += 1
        return key
    monkeypatch.setattr(g, "key_for", counted)
    got = tokens_of(graphed.generate(prompts, greedy(12)))
    assert replayed["prompt"] >= 5 and replayed["decode"] > 0 and not replayed[None], replayed
    eager = nanoengine.LLM("tiny", enforce_eager=True, async_scheduling=use_async, **dev)
    assert got == tokens_of(eager.generate(prompts, greedy(12)))


@needs_cuda
def test_gpu_replays_allocate_nothing():
    engine = nanoengine.Engine(model="tiny", enforce_eager=False, max_num_seqs=16, **GPU)
    out, batch = _decode_step(engine, mixed_prompts(5, 4096, seed=17))
    g = engine.runner.graphs
    with torch.inference_mode():
        g.run(batch)
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        for _ in range(50):
            logits = g.run(batch)
        torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before, "a replay allocated memory"
    _finish(engine, out, logits)
    # A first run may allocate once for good (cuBLAS's 32 MB workspace, at the first matmul too big for
    # the Triton kernel); a second like it must not grow.
    run(engine, mixed_prompts(16, 4096, seed=18), greedy(30))
    m0 = torch.cuda.memory_allocated()
    run(engine, mixed_prompts(16, 4096, seed=20), greedy(30))
    assert torch.cuda.memory_allocated() <= m0 + (1 << 20), "memory grew across many steps"

# ==========================================================================================================
# nanoengine.py: the model and its weights against the reference model, the textbook and tuned paths,
# sampling, per-token outputs and streaming, async scheduling, bad input, and engines' life cycle
# ==========================================================================================================

_REF_TOKENS = {}


def ref_tokens(sd: dict, cfg: dict, prompt: list[int], n: int) -> list[int]:
    """ref_greedy, computed once per (state, prompt, n) in a session: the reference recomputes everything."""
    key = (id(sd), tuple(prompt), n)
    if key not in _REF_TOKENS:
        _REF_TOKENS[key] = ref_greedy(sd, cfg, prompt, n)
    return _REF_TOKENS[key]


# The three forwards: torch ops on separate weights; the fused weights and Part 1's ops (kernels' torch
# references on the CPU); and the tuned path, Part 2's variants on top (the default).
PATHS = {"unfused": dict(fuse=False), "textbook": dict(tuned=False), "tuned": dict(tuned=True)}


@pytest.mark.parametrize("arch", ARCH_NAMES)
@pytest.mark.parametrize("path", list(PATHS))
def test_greedy_matches_reference(ckpt_dirs, arch, path):
    cfg, sd, folder = ckpt_dirs[arch]
    prompts = mixed_prompts(8, cfg["vocab_size"], seed=1)
    engine = Engine(model=folder, **PATHS[path])
    outs = run(engine, prompts, greedy(6))
    for p, o in zip(prompts, outs):
        assert o.token_ids == ref_tokens(sd, cfg, p, 6), f"{arch} prompt of {len(p)} tokens"
        assert o.finish_reason == "length"
    check_clean(engine)


@pytest.mark.parametrize("arch,tie,shards", [("qwen3", True, 1), ("qwen3", False, 3), ("llama", True, 2),
                                             ("qwen2", False, 1), ("qwen3_moe", False, 2)])
def test_safetensors_round_trip(tmp_path, arch, tie, shards):
    cfg, sd = checkpoint(arch, tie=tie, seed=7)
    assert ("lm_head.weight" in sd) != tie
    folder = save_checkpoint(tmp_path / "ck", cfg, sd, shards=shards)
    prompts = mixed_prompts(3, cfg["vocab_size"], seed=8)
    outs = LLM(model=folder).generate(prompts, greedy(6))
    assert tokens_of(outs) == [ref_greedy(sd, cfg, p, 6) for p in prompts]
    # transformers 5.x's config.json (renamed fields, rope_parameters): the same model, the same tokens
    v5 = to_v5_config(cfg)
    assert nanoengine.ModelConfig.from_hf(v5) == nanoengine.ModelConfig.from_hf(cfg)
    llm5 = LLM(model=save_checkpoint(tmp_path / "ck5", v5, sd, shards=shards))
    assert llm5.engine.model.config.num_experts == cfg.get("num_experts", 0)  # a MoE loads as one
    assert tokens_of(llm5.generate(prompts, greedy(6))) == tokens_of(outs)


def test_string_prompts_with_a_tokenizer(tmp_path, ckpt_dirs):
    tokenizers = pytest.importorskip("tokenizers")
    cfg, sd, _ = ckpt_dirs["qwen3"]
    folder = save_checkpoint(tmp_path / "tok", cfg, sd)
    vocab = {chr(ord("a") + i): i for i in range(26)} | {"[UNK]": 26}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tok.save(os.path.join(folder, "tokenizer.json"))
    llm = LLM(model=folder)
    ids = [7, 4, 11, 11, 14]
    text_out, ids_out, np_out = llm.generate(["hello", ids, np.array(ids)], greedy(4))  # numpy ids are ints too
    assert text_out.prompt_token_ids == ids == np_out.prompt_token_ids
    assert text_out.token_ids == ids_out.token_ids == np_out.token_ids
    assert isinstance(text_out.text, str)
    # streamed, each output's text is the decoding of the tokens so far
    outs = list(llm.engine.stream("hello", greedy(4, output_kind="cumulative")))
    assert outs[-1].token_ids == text_out.token_ids and outs[-1].text == text_out.text


def test_bad_models_are_refused(tmp_path, ckpt_dirs):
    with pytest.raises(ValueError, match="neither a folder nor a preset"):
        Engine(model=str(tmp_path / "missing"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read config.json"):
        Engine(model=str(tmp_path / "broken"))
    cfg, sd, _ = ckpt_dirs["llama"]
    cases = [(dict(cfg, hidden_size=None), "required field 'hidden_size'"),
             (dict(cfg, architectures=["MistralForCausalLM"]), "MistralForCausalLM"),
             (dict(cfg, rope_scaling=dict(rope_type="yarn", factor=4.0)), "'yarn'"),
             (dict(cfg, quantization_config=dict(quant_method="gptq")), "gptq"),
             (dict(cfg, use_sliding_window=True), "use_sliding_window"),
             (dict(cfg, vocab_size="256"), "vocab_size='256' is invalid: it must be an integer >= 1"),
             (dict(cfg, architectures=["Qwen3MoeForCausalLM"]),  # a MoE with no expert count, in either layout
              r"required field 'num_experts' \(transformers 5\.x: 'num_local_experts'\) is missing")]
    for i, (bad_cfg, msg) in enumerate(cases):
        with pytest.raises(ValueError, match=msg):
            Engine(model=save_checkpoint(tmp_path / f"bad{i}", bad_cfg, sd))
    with pytest.raises(ValueError, match="lacks"):
        Engine(model=save_checkpoint(tmp_path / "partial", cfg, {k: v for k, v in sd.items() if "layers.1." not in k}))


# Every field of transformers' LlamaConfig, Qwen2Config, Qwen3Config and Qwen3MoeConfig (4.57.1 and 5.25.0), and
# those every config.json carries: CONFIG_FIELDS has a row for each.
HF_CONFIG_FIELDS = {
    "llama": "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
             "hidden_act max_position_embeddings initializer_range rms_norm_eps use_cache pad_token_id bos_token_id "
             "eos_token_id pretraining_tp tie_word_embeddings rope_theta rope_scaling rope_parameters attention_bias "
             "attention_dropout mlp_bias head_dim",
    "qwen2": "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
             "hidden_act max_position_embeddings initializer_range rms_norm_eps use_cache tie_word_embeddings "
             "rope_theta rope_scaling rope_parameters use_sliding_window sliding_window max_window_layers layer_types "
             "attention_dropout pad_token_id bos_token_id eos_token_id",
    "qwen3": "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
             "head_dim hidden_act max_position_embeddings initializer_range rms_norm_eps use_cache tie_word_embeddings "
             "rope_theta rope_scaling rope_parameters attention_bias use_sliding_window sliding_window "
             "max_window_layers layer_types attention_dropout pad_token_id bos_token_id eos_token_id",
    "qwen3_moe": "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
                 "hidden_act max_position_embeddings initializer_range rms_norm_eps use_cache tie_word_embeddings "
                 "rope_theta rope_scaling rope_parameters attention_bias use_sliding_window sliding_window "
                 "attention_dropout decoder_sparse_step moe_intermediate_size num_experts_per_tok num_experts "
                 "num_local_experts norm_topk_prob output_router_logits router_aux_loss_coef mlp_only_layers "
                 "pad_token_id bos_token_id eos_token_id",
    "every config.json": "architectures model_type torch_dtype dtype transformers_version quantization_config",
}
LLAMA3 = dict(rope_type="llama3", factor=2.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=128)
# (field, the architecture's test checkpoint it is set in, a value that is accepted (None: absent), what that sets in
# ModelConfig (None: nothing changes), a value that is refused or None, the refusal's message)
CONFIG_FIELDS = [
    ("vocab_size", "llama", 300, {"vocab_size": 300}, 0, "vocab_size=0 is invalid: it must be an integer >= 1"),
    ("hidden_size", "llama", 128, {"hidden_size": 128}, 1.5, "hidden_size=1.5 is invalid"),
    ("intermediate_size", "llama", 96, {"intermediate_size": 96}, -1, "intermediate_size=-1 is invalid"),
    ("num_hidden_layers", "llama", 3, {"num_layers": 3}, None, "required field 'num_hidden_layers' is missing"),
    ("num_attention_heads", "llama", 8, {"num_heads": 8}, 0, "num_attention_heads=0 is invalid"),
    ("num_key_value_heads", "llama", 1, {"num_kv_heads": 1}, None, None),
    ("head_dim", "llama", 32, {"head_dim": 32}, None, None),
    ("head_dim", "qwen3", None, {"head_dim": 128}, None, None),  # Qwen3's default, not hidden_size / heads
    ("hidden_act", "llama", "swish", None, "gelu", "hidden_act='gelu' is not supported; nanoengine runs 'silu' or "
                                                   "'swish'"),
    ("mlp_bias", "llama", False, None, True, "mlp_bias=True is not supported; nanoengine runs False"),
    ("attention_bias", "llama", True, {"qkv_bias": True, "o_bias": True}, None, None),
    ("max_position_embeddings", "llama", 4096, {"max_position_embeddings": 4096}, None, None),
    ("rms_norm_eps", "llama", 1e-5, {"rms_norm_eps": 1e-5}, None, None),
    ("eos_token_id", "llama", [3, 4], {"eos_token_ids": (3, 4)}, None, None),
    ("tie_word_embeddings", "llama", True, {"tie_word_embeddings": True}, None, None),
    ("rope_theta", "llama", 1e4, {"rope_theta": 1e4}, None, None),
    ("rope_scaling", "qwen3", LLAMA3, {"rope_scaling": LLAMA3}, dict(rope_type="yarn", factor=4.0),
     "rope_scaling type 'yarn' is not supported"),
    ("rope_parameters", "qwen3", dict(rope_type="default", rope_theta=5e5), {"rope_theta": 5e5},
     dict(rope_type="dynamic", factor=2.0, rope_theta=5e5), "rope_scaling type 'dynamic' is not supported"),
    ("use_sliding_window", "qwen2", False, None, True, "use_sliding_window=True is not supported; nanoengine runs False"),
    ("layer_types", "qwen2", ["full_attention"] * 2, None, ["full_attention", "sliding_attention"],
     "layer_types=['full_attention', 'sliding_attention'] is not supported; nanoengine runs 'full_attention' in each"),
    ("num_experts", "qwen3_moe", 16, {"num_experts": 16}, None,
     "required field 'num_experts' (transformers 5.x: 'num_local_experts') is missing"),
    ("num_local_experts", "qwen3_moe", 4, {"num_experts": 4}, None, "required field 'num_experts'"),
    ("num_experts_per_tok", "qwen3_moe", 4, {"num_experts_per_tok": 4}, 0, "num_experts_per_tok=0 is invalid"),
    ("moe_intermediate_size", "qwen3_moe", 64, {"moe_intermediate_size": 64}, None,
     "required field 'moe_intermediate_size' is missing"),
    ("norm_topk_prob", "qwen3_moe", False, {"norm_topk_prob": False}, None, None),
    ("decoder_sparse_step", "qwen3_moe", 2, {"decoder_sparse_step": 2}, None, None),
    ("mlp_only_layers", "qwen3_moe", [0, 2], {"mlp_only_layers": (0, 2)}, None, None),
    ("architectures", "llama", ["LlamaForCausalLM"], None, ["MistralForCausalLM"],
     "architectures=['MistralForCausalLM'] is not supported"),
    ("quantization_config", "llama", None, None, dict(quant_method="gptq"),
     "quantization_config (quant_method='gptq') is not supported"),
] + [(name, arch, value, None, None, None) for name, arch, value in [  # inert: nothing changes
    ("initializer_range", "llama", 0.5), ("use_cache", "llama", False), ("attention_dropout", "llama", 0.1),
    ("bos_token_id", "llama", 7), ("pad_token_id", "llama", 0), ("pretraining_tp", "llama", 2),
    ("torch_dtype", "llama", "bfloat16"), ("dtype", "llama", "float16"), ("model_type", "llama", "mistral"),
    ("transformers_version", "llama", "5.25.0"), ("sliding_window", "qwen2", 8), ("max_window_layers", "qwen2", 1),
    ("output_router_logits", "qwen3_moe", True), ("router_aux_loss_coef", "qwen3_moe", 0.5)]]
V5_REPLACES = {"rope_parameters": ("rope_theta", "rope_scaling"), "num_local_experts": ("num_experts",)}


def test_every_config_field_is_honoured_refused_or_inert(ckpt_dirs):
    """Each field of the four architectures' transformers configs (HF_CONFIG_FIELDS) either sets what the model
    computes (ModelConfig), or is refused at a value whose math nanoengine does not run, naming the field and the
    value, or changes nothing (nanoengine.INERT_FIELDS, listed in the README): one row each (CONFIG_FIELDS)."""
    assert set(" ".join(HF_CONFIG_FIELDS.values()).split()) == {row[0] for row in CONFIG_FIELDS}
    assert set(nanoengine.INERT_FIELDS) == {f for f, _, _, sets, _, msg in CONFIG_FIELDS if sets is msg is None}
    from_hf = nanoengine.ModelConfig.from_hf
    for field, arch, value, sets, refused, msg in CONFIG_FIELDS:
        base = {k: v for k, v in ckpt_dirs[arch][0].items() if k not in V5_REPLACES.get(field, ())}  # a 5.x file
        cfg = lambda v: {k: x for k, x in (base | {field: v}).items() if x is not None}  # noqa: E731 (None: absent)
        was, now = dataclasses.asdict(from_hf(ckpt_dirs[arch][0])), dataclasses.asdict(from_hf(cfg(value)))
        changed = {k: v for k, v in now.items() if v != was[k]}
        assert changed == (sets or {}), (field, changed)
        if msg is not None:
            with pytest.raises(ValueError, match=re.escape(f"config.json: {msg}")):
                from_hf(cfg(refused))


# -- Fusion -------------------------------------------------------------------------------------------


def _logits_for(engine, prompts):
    for p in prompts:
        engine.add_request(p, greedy(1))
    out = engine.scheduler.schedule()
    batch, _, _ = engine.runner.inputs.prepare(out)
    with torch.inference_mode():
        hidden = engine.model(batch, engine.runner.kv_cache)
        return engine.model.compute_logits(hidden[batch.logits_indices])


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_fused_equals_unfused_and_costs_no_memory(preset):
    unfused, fused = Engine(model=preset, fuse=False), Engine(model=preset, fuse=True)
    before = nanoengine.param_bytes(unfused.model)
    assert nanoengine.param_bytes(fused.model) == before
    names = {n for n, _ in fused.model.named_parameters()}
    assert any("qkv_proj" in n for n in names) and not any("q_proj" in n or "gate_proj" in n for n in names)
    prompts = mixed_prompts(4, 4096, seed=11)
    torch.testing.assert_close(_logits_for(fused, prompts), _logits_for(unfused, prompts), atol=1e-3, rtol=1e-4)
    # the fuse step itself frees the originals: parameter bytes unchanged on the same model object
    model = Engine(model=preset, fuse=False).model
    model.fuse()
    assert nanoengine.param_bytes(model) == before


def test_no_weight_requires_grad_and_the_step_records_nothing():
    """Steps run outside torch.inference_mode (entering it each step costs host time): that is free of
    autograd only because no weight requires grad, also after fuse() made new Parameters."""
    for settings in (dict(fuse=False), dict(tuned=False), dict(model="tiny", triton=True)):
        assert not any(p.requires_grad for p in Engine(**{"model": "tiny-moe", **settings}).model.parameters())
    engine = Engine(model="tiny-moe")
    assert not any(p.requires_grad for p in engine.model.parameters()), "fuse()'s new Parameters too"
    out, batch = _decode_step(engine, mixed_prompts(3, 4096, seed=23))
    hidden = engine.model(batch, engine.runner.kv_cache)
    assert hidden.grad_fn is None and not hidden.requires_grad and not torch.is_inference_mode_enabled()
    _finish(engine, out, engine.model.compute_logits(hidden))


@pytest.mark.parametrize("tuned,rows,narrow", [(False, None, None), (True, 0, 0), (True, 16, 0), (True, 1, 16)])
def test_triton_kernels_end_to_end_equal_unfused(tmp_path, monkeypatch, tuned, rows, narrow):
    """The whole fused forward on the Triton kernels (the interpreter on the CPU), MoE included: the textbook
    path's Part 1 kernels, or the tuned path's, with the Triton matmul for every matrix up to `rows` rows,
    or (narrow) for this small model's narrow ones."""
    cfg, sd = checkpoint("qwen3_moe", seed=12)
    folder = save_checkpoint(tmp_path / "moe", cfg, sd)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [2, 7], [1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5]]
    dev = dict(device="cuda", dtype="float32", num_blocks=256) if CUDA else {}  # interpreter on the CPU
    unfused = LLM(model=folder, fuse=False, **dev).generate(prompts, greedy(3))
    llm = LLM(model=folder, fuse=True, triton=True, tuned=tuned, triton_linear_rows=rows, triton_narrow_rows=narrow,
              **dev)
    ops = llm.engine.model.ops
    assert ops.rope_write_kv is kernels.rope_write_kv
    if tuned:
        assert ops.paged_attention.func is kernels.prefill_attention and ops.linear.func is kernels.linear
        assert ops.paged_attention.keywords["min_tokens"] == kernels.PREFILL_MIN_TOKENS
        assert (ops.linear.keywords["max_rows"], ops.linear.keywords["narrow_rows"]) == (rows, narrow)
        assert ops.decode_attention.func is kernels.decode_attention and ops.fused_moe.func is kernels.fused_moe_tuned
    else:
        assert ops.linear is nanoengine.linear and ops.fused_moe is kernels.fused_moe and not hasattr(ops, "decode_attention")
        assert ops.paged_attention is kernels.paged_attention
    launched, launch = [], kernels._launch_linear
    monkeypatch.setattr(kernels, "_launch_linear",
                        lambda x2, *a, **kw: launched.append(x2.shape[0]) or launch(x2, *a, **kw))
    triton_out = llm.generate(prompts, greedy(3))
    if tuned:
        assert any(m > rows for m in launched) == (narrow > 0), "Triton matmuls past `rows` only with narrow rows"
    else:
        assert not launched, "the textbook path's matmuls are cuBLAS's"
    assert tokens_of(triton_out) == tokens_of(unfused)
    assert tokens_of(unfused) == [ref_greedy(sd, cfg, p, 3) for p in prompts]


# -- The textbook path and the tuned one: the same tokens ---------------------------------------------

# Every path EngineConfig.tuned selects: none, all, and each variant alone.
TUNED_SETTINGS = [False, True] + [frozenset({name}) for name in nanoengine.TUNED]


@pytest.fixture(scope="module")
def preset_references():
    """preset -> (a mixed workload, the reference model's greedy tokens for it), from the preset's own
    (seeded) weights read back from an unfused engine: the reference shares no code with the engine."""
    refs = {}
    for preset in ("tiny", "tiny-moe"):
        sd = Engine(model=preset, fuse=False).model.state_dict()
        prompts = mixed_prompts(7, 4096, seed=53, lengths=(1, 30, 7, 16, 2, 40, 9))
        refs[preset] = prompts, [ref_greedy(sd, nanoengine.PRESETS[preset], p, 5) for p in prompts]
    return refs


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("use_async", [False, True])
def test_textbook_and_tuned_paths_match_the_reference(preset_references, preset, use_async):
    """tuned=False (the chapter), tuned=True (every Part 2 variant) and each variant alone: float32 greedy
    tokens equal to the reference model's, on a workload with prompts in chunks and decodes beside them
    (each variant's CPU stand-in is its torch reference, so this checks the tuned forward's structure)."""
    prompts, want = preset_references[preset]
    for tuned in TUNED_SETTINGS:
        engine = Engine(model=preset, tuned=tuned, max_num_batched_tokens=24, async_scheduling=use_async)
        v, ops = engine.cfg.tuned, engine.model.ops
        assert v == (tuned if isinstance(tuned, frozenset) else frozenset(nanoengine.TUNED) if tuned else frozenset())
        if not v:  # the chapter: its ops, layers and host classes, nothing of Part 2
            assert vars(ops).keys() == vars(nanoengine.textbook_ops(False)).keys()
            assert {type(layer) for layer in engine.model.model.layers} == {nanoengine.DecoderLayer}
        else:
            assert (getattr(ops.add_rmsnorm_linear, "func", None) is nanoengine.add_rmsnorm_then_linear) == \
                ("gemv" not in v)
            assert (ops.decode_attention is None) == ("decode_attention" not in v)
        assert isinstance(engine.book, scheduler.SteadyBook) == ("steady" in v)
        plans, schedule = [], engine.scheduler.schedule
        engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
        assert tokens_of(run(engine, prompts, greedy(5), use_async)) == want, f"tuned={sorted(v)}"
        assert any(0 < p.num_decode < len(p.requests) for p in plans), "decodes ran beside prompt chunks"
        assert any(getattr(p, "steady", None) is not None for p in plans) == ("steady" in v)
        check_clean(engine)


# -- Sampling -----------------------------------------------------------------------------------------


def test_seeded_sampling_does_not_depend_on_the_batch():
    llm = LLM("tiny")
    vocab = llm.engine.model.config.vocab_size
    probe = [5, 6, 7, 8]
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=200, seed=1234, max_tokens=12)
    alone = llm.generate([probe], sp)[0].token_ids
    others = mixed_prompts(5, vocab, seed=9)
    batch = llm.generate(others[:2] + [probe] + others[2:],
                         [SamplingParams(temperature=1.0, seed=i, max_tokens=20) for i in range(2)] + [sp] +
                         [greedy(3)] * 3)
    assert batch[2].token_ids == alone
    other_seed = llm.generate([probe], SamplingParams(temperature=0.9, top_p=0.95, top_k=200, seed=99,
                                                      max_tokens=12))[0].token_ids
    assert other_seed != alone
    check_clean(llm.engine)


def test_top_k_1_equals_greedy_and_filters_apply():
    llm = LLM("tiny")
    prompts = mixed_prompts(4, 4096, seed=10)
    g = tokens_of(llm.generate(prompts, greedy(8)))
    k1 = tokens_of(llm.generate(prompts, SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=8,
                                                        ignore_eos=True)))
    assert k1 == g
    # vLLM's "no limit" values, -1, 0 and any k past the vocabulary, keep every token: the same draws
    off = [tokens_of(llm.generate(prompts, SamplingParams(temperature=1.0, top_k=k, seed=3, max_tokens=8,
                                                          ignore_eos=True)))
           for k in (-1, 0, 4096, 10**30)]
    assert off[1:] == off[:1] * 3 and off[0] != g
    # the sampler itself: top-k keeps only the k best, top-p only the nucleus, temperature 0 is argmax
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    s = nanoengine.SamplingBatch(temperature=torch.tensor([1.0, 1.0, 0.0]), top_k=torch.tensor([3, 50, 50]),
                                 top_p=torch.tensor([1.0, 0.3, 1.0]), seeds=torch.tensor([1, 2, 3]),
                                 counters=torch.tensor([0, 0, 0]), all_greedy=False, need_filter=True)
    top3, seen = set(logits[0].topk(3).indices.tolist()), [set(), set()]
    probs = logits[1].softmax(-1).sort(descending=True)
    nucleus = set(probs.indices[:int((probs.values.cumsum(0) - probs.values < 0.3).sum())].tolist())
    for c in range(200):
        s.counters = torch.tensor([c, c, c])
        t = nanoengine.sample(logits, s).tolist()
        seen[0].add(t[0]); seen[1].add(t[1])
        assert t[2] == logits[2].argmax().item()
    assert 1 < len(nucleus) < 20 and seen[0] == top3 and seen[1] == nucleus


def test_race_sample_draws_from_the_softmax():
    """1,200 draws (one seed, counters 0..1199) of the textbook sampler follow softmax(logits / T); -inf is
    never drawn. Part 2's kernel makes the same draws (test_race_sample_kernel_equals_reference)."""
    fn = kernels.race_sample_ref
    n, t = 1200, 0.7
    logits = torch.tensor([0.0, 1.0, 2.0, float("-inf"), 0.5], device=DEVICE).repeat(n, 1)
    tokens = fn(logits, torch.full((n,), t, device=DEVICE), torch.full((n,), 5, device=DEVICE),
                torch.arange(n, device=DEVICE))
    freq = torch.bincount(tokens, minlength=5).float().cpu() / n
    torch.testing.assert_close(freq, torch.softmax(logits[0].cpu() / t, dim=0), atol=0.04, rtol=0)
    assert freq[3] == 0


def test_seeded_noise_is_uniform():
    u = kernels.race_noise_ref(torch.tensor([7, 8]), torch.tensor([0, 1]), 100_000)
    assert 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u[0], u[1])


def test_staging_packs_every_array_16_byte_aligned():
    """Staged tensors start on 16 bytes whatever the step's sizes (Triton compiles per alignment), and
    round-trip exactly: on CUDA through the pinned buffers, one copy per dtype; on the CPU as zero-copy
    views, kept while the same arrays come back (a steady decode's rows do)."""
    assert nanoengine.aligned_offsets([3, 2, 5], 8) == ([0, 4, 6], 12)
    assert nanoengine.aligned_offsets([1, 4, 0, 1], 4) == ([0, 4, 8, 8], 12)
    rng = np.random.default_rng(0)
    bounds = {f"i{k}": ("int64", 8) for k in range(4)} | {f"s{k}": ("int32", 8) for k in range(3)}
    for device in ("cpu", "cuda") if CUDA else ("cpu",):
        staging = nanoengine.Staging(torch.device(device), bounds)
        for _ in range(5):
            arrays = {f"i{k}": rng.integers(0, 100, int(n)) for k, n in enumerate(rng.integers(0, 9, 4))}
            arrays |= {f"s{k}": rng.integers(0, 100, int(n)).astype(np.int32)
                       for k, n in enumerate(rng.integers(0, 9, 3))}
            out = staging.to_device(arrays)
            for name, a in arrays.items():
                t = getattr(out, name)
                assert torch.equal(t.cpu(), torch.from_numpy(a)) and t.dtype == torch.from_numpy(a).dtype, name
                assert device == "cpu" or t.data_ptr() % 16 == 0, name
        if device == "cpu":
            assert staging.to_device(dict(arrays)) is out, "the same arrays: the same views"


# -- Per-token outputs, streaming, request metrics ----------------------------------------------------


@pytest.fixture
def no_placeholder_hashed(monkeypatch):
    orig = scheduler.block_key

    def checked(parent, tokens):
        assert PLACEHOLDER not in tokens, "a placeholder reached the prefix cache"
        return orig(parent, tokens)
    monkeypatch.setattr(scheduler, "block_key", checked)


OUTPUT_KINDS = ("cumulative", "delta", "final_only")


@pytest.mark.parametrize("use_async", [False, True])
def test_step_outputs_stream_every_token(use_async, no_placeholder_hashed):
    """As vLLM's LLMEngine.step: each step returns an output for every request that got a token in it (in
    async mode, when the token is read back), with its tokens so far ("cumulative"), only the new one
    ("delta"), or nothing until the end ("final_only"); each request's streamed tokens add up to its final
    output. Under preemption (a cache too small for all) and with aborts mid-run (one request of each kind,
    running): an aborted request's streamed tokens are those of its final "abort" output, and a prefix of
    what it would have generated."""
    prompts = mixed_prompts(9, 4096, seed=50, lengths=(30, 41, 9, 25, 3, 50, 17, 33, 12))
    params = [greedy(12, output_kind=OUTPUT_KINDS[i % 3]) for i in range(len(prompts))]
    want = tokens_of(run(Engine(model="tiny"), prompts, greedy(12)))
    engine = Engine(model="tiny", num_blocks=8, max_num_batched_tokens=40, async_scheduling=use_async)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    streams, aborted = {rid: [] for rid in ids}, {}
    for n in itertools.count(1):
        if not engine.has_unfinished():
            break
        outs = engine.step_async() if use_async else engine.step()
        assert len({o.request_id for o in outs}) == len(outs), "a request reported twice in one step"
        for o in outs:
            streams[o.request_id].append(o)
        for rid, sp in zip(ids, params):
            req = engine.book.requests.get(rid)
            if req is None or sp.output_kind == "final_only":
                continue
            # every token on the host has been reported, and only those: outputs come as tokens land
            assert sum(len(o.new_token_ids) for o in streams[rid]) == len(req.output_token_ids), f"step {n}"
            if rid in ids[:2] and len(req.output_token_ids) >= 6 and rid not in aborted:
                engine.abort(rid)  # a streaming request, running, with tokens reported
                aborted[rid] = n
        if n == 8 and ids[2] in engine.book.requests:
            engine.abort(ids[2])  # a final_only request
            aborted[ids[2]] = n
        assert n < 500
    assert engine.scheduler.num_preemptions > 0, "the cache was meant to be too small for all"
    assert len(aborted) == 3
    for i, (rid, sp) in enumerate(zip(ids, params)):
        final = final_output(streams[rid], sp.output_kind)  # streamed tokens add up to the final output
        if rid in aborted:
            assert final.finish_reason == "abort" and final.token_ids == want[i][:len(final.token_ids)]
            assert len(final.token_ids) >= (6 if i < 2 else 1)
            if sp.output_kind == "cumulative":  # the final "abort" output carries what was streamed
                assert streams[rid][-1].token_ids == [t for o in streams[rid] for t in o.new_token_ids]
        else:
            assert final.token_ids == want[i] and final.finish_reason == "length"
        assert len(streams[rid]) == (1 if sp.output_kind == "final_only" else len(final.token_ids) + (rid in aborted))
    check_clean(engine)


@pytest.mark.parametrize("use_async", [False, True])
def test_engine_stream_yields_the_tokens_of_generate(use_async):
    """Engine.stream(prompt, params): a generator of the request's outputs (delta unless asked otherwise),
    whose tokens add up to what LLM.generate returns for the same greedy prompt, while the engine's other
    requests go on beside it and end as they would alone."""
    prompt, others = [11, 12, 13, 14, 15], mixed_prompts(3, 4096, seed=51, lengths=(9, 20, 4))
    want = tokens_of(LLM("tiny").generate([prompt] + others, [greedy(8)] + [greedy(30)] * 3))
    engine = Engine(model="tiny", async_scheduling=use_async)
    other_ids = [engine.add_request(p, greedy(30)) for p in others]
    outs = list(engine.stream(prompt, greedy(8)))
    assert all(len(o.new_token_ids) == 1 and o.token_ids == o.new_token_ids for o in outs), "delta by default"
    assert [t for o in outs for t in o.new_token_ids] == want[0] and outs[-1].finished
    assert not any(o.finished for o in outs[:-1])
    for rid, p in zip(other_ids, others):
        req = engine.book.requests[rid]
        assert req.num_computed_tokens > len(p), "the other requests progressed while the stream ran"
    streams = drive(engine, use_async)
    assert [final_output(streams[rid], "final_only").token_ids for rid in other_ids] == want[1:]
    cumulative = list(engine.stream(prompt, greedy(8, output_kind="cumulative")))
    assert cumulative[-1].token_ids == want[0] and [len(o.token_ids) for o in cumulative] == list(range(1, 9))
    check_clean(engine)


@pytest.mark.parametrize("use_async", [False, True])
def test_a_stream_loses_no_output_of_the_other_requests(use_async):
    """A stream steps the engine for every request: what the others got meanwhile waits for the next step(), each
    request once with all its news (has_unfinished() stays True until then); and what a step() called while a stream
    is open gets for the stream's request waits for the stream. The first lines are the issue's example."""
    want = tokens_of(LLM("tiny").generate([[1, 2, 3], [4, 5, 6], [7, 8, 9]], [greedy(3), greedy(8), greedy(6)]))
    with Engine(model="tiny", async_scheduling=use_async) as e:
        a = e.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=3))
        streamed = list(e.stream([4, 5, 6], SamplingParams(temperature=0, max_tokens=8)))
        rest = []
        while e.has_unfinished():
            rest += e.step()
        assert [t for o in streamed for t in o.new_token_ids] == want[1]
        [o] = rest  # cumulative: a's tokens so far, in one output that finishes it
        assert (o.request_id, o.token_ids, o.new_token_ids, o.finished) == (a, want[0], want[0], True)
        stream = e.stream([7, 8, 9], greedy(6, output_kind="delta"))
        first = next(stream)
        b = e.add_request([1, 2, 3], greedy(3, output_kind="delta"))
        rest = []
        while e.has_unfinished():  # runs the stream's request to its end too, keeping its outputs for the stream
            rest += e.step()
        assert {o.request_id for o in rest} == {b} and [t for o in rest for t in o.token_ids] == want[0]
        later = list(stream)  # the stream's tokens since, in one output
        assert first.new_token_ids + later[0].new_token_ids == want[2] and len(later) == 1 and later[0].finished
        assert not e.has_unfinished() and e.step() == []
        check_clean(e)


@pytest.mark.parametrize("use_async", [False, True])
def test_closing_a_stream_aborts_its_request(use_async):
    """A reader that stops early (a break, or close(): a client gone) aborts the stream's request, as vLLM does: its
    blocks go back, no step computes it again, and no output of it reaches anyone (no step() returns it, none is
    held); the other requests end as they would alone."""
    want = tokens_of(LLM("tiny").generate([[1, 2, 3]], greedy(20)))
    e = Engine(model="tiny", async_scheduling=use_async)
    other = e.add_request([1, 2, 3], greedy(20))
    planned = []
    schedule = e.scheduler.schedule
    e.scheduler.schedule = lambda: planned.append(out := schedule()) or out
    for stop_reading in ("break", "close"):
        if stop_reading == "break":
            for o in e.stream([4, 5, 6], greedy(100, output_kind="delta")):
                rid = o.request_id
                break  # the loop's generator is closed as its last reference goes (CPython: at once)
        else:
            stream = e.stream([4, 5, 6], greedy(100, output_kind="delta"))
            rid = [next(stream), next(stream)][0].request_id
            stream.close()
        req = next(r for out in planned for r in out.requests if r.request_id == rid)
        assert req.status == "finished" and req.block_ids == [] and req.finish_reason == "abort"
        steps_before = len(planned)
        assert rid not in [o.request_id for o in e.step()], "an output no one reads any more"
        assert not any(req in out.requests for out in planned[steps_before:]), "it ran after its stream closed"
    streams = drive(e, use_async)
    assert set(streams) == {other} and final_output(streams[other], "final_only").token_ids == want[0]
    check_clean(e)


# -- Text: incremental detokenization and stop strings, with a byte-level BPE tokenizer --------------

TEXT = "né😀 ok"  # é is two byte tokens; 😀 (F0 9F 98 80) two BPE tokens of two bytes each


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    """A checkpoint folder with a byte-level BPE tokenizer.json, as GPT-2's and Qwen's: ids 0-255 are the bytes
    (in GPT-2's printable alphabet), and two merges make 😀 the tokens 256 and 257."""
    tokenizers = pytest.importorskip("tokenizers")
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted = iter(range(256, 512))
    char = {b: chr(b if b in keep else next(shifted)) for b in range(256)}  # GPT-2's bytes_to_unicode
    merges = [(char[0xF0], char[0x9F]), (char[0x98], char[0x80])]
    vocab = {char[b]: b for b in range(256)} | {a + b: 256 + i for i, (a, b) in enumerate(merges)}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    folder = save_checkpoint(tmp_path_factory.mktemp("text"), *random_hf_checkpoint("qwen3", vocab_size=258))
    tok.save(os.path.join(folder, "tokenizer.json"))
    return folder


def scripted(monkeypatch, ids: list[int]):
    """Each sampled token is the script's next id, then "x" (a fake sampler: the text is known in advance)."""
    script = itertools.chain(ids, itertools.repeat(ord("x")))
    monkeypatch.setattr(nanoengine, "sample", lambda logits, s, race: torch.full((len(logits),), next(script)))


@pytest.mark.parametrize("use_async", [False, True])
def test_delta_text_is_only_the_new_text(text_model, monkeypatch, use_async):
    """output_kind "delta": each output's text is what its token adds, decoded incrementally as vLLM does, and the
    texts join to the whole: a character whose bytes span tokens comes whole with the token that completes it, and
    one cut off by the end comes as U+FFFD in the last output. "cumulative": the whole text so far."""
    llm = LLM(text_model, async_scheduling=use_async)
    ids = llm.engine.tokenizer.encode(TEXT).ids
    assert len(ids) == 8 and ids[1:5] == [0xC3, 0xA9, 256, 257]
    texts = {}
    for kind in ("delta", "cumulative"):
        scripted(monkeypatch, ids)
        texts[kind] = [o.text for o in llm.engine.stream([1, 2], greedy(8, output_kind=kind))]
    assert texts["delta"] == ["n", "", "é", "", "😀", " ", "o", "k"]
    assert texts["cumulative"] == list(itertools.accumulate(texts["delta"]))
    scripted(monkeypatch, ids)
    assert [o.text for o in llm.engine.stream([1, 2], greedy(4))] == ["n", "", "é", "\ufffd"]  # 😀 cut in half
    scripted(monkeypatch, ids)
    assert llm.generate([[1, 2]], greedy(8))[0].text == TEXT
    check_clean(llm.engine)


# (stop strings, the tokens of TEXT the request keeps, its text): é spans two tokens; of two the first in the text
# wins, whether it is completed first or by the same token
STOP_CASES = [(["😀"], 5, "né"), (["k", " o"], 7, "né😀"), ("é", 3, "n"), ([" ok"], 8, "né😀"), (["😀", "é😀"], 5, "n")]


@pytest.mark.parametrize("use_async", [False, True])
def test_stop_strings_end_the_request_before_them(text_model, monkeypatch, use_async):
    """SamplingParams(stop=...), as vLLM: the request ends once its text holds a stop string, with finish_reason
    "stop", the text ending before the string and the token ids with the token that completed it; in every
    output_kind, and through LLM.generate. Streamed text never shows the start of a stop string (the last
    len(longest) - 1 characters wait): the deltas join to the final text."""
    llm = LLM(text_model, async_scheduling=use_async)
    engine, ids = llm.engine, llm.engine.tokenizer.encode(TEXT).ids
    for stop, n, text in STOP_CASES:
        for kind in OUTPUT_KINDS:
            scripted(monkeypatch, ids)
            rid = engine.add_request([1, 2], greedy(12, stop=stop, output_kind=kind))
            outs = drive(engine, use_async)[rid]
            final = final_output(outs, kind)
            assert (final.token_ids, final.finish_reason) == (ids[:n], "stop"), (stop, kind)
            shown = [o.text for o in outs]
            assert ("".join(shown) if kind == "delta" else shown[-1]) == text, (stop, kind, shown)
            assert kind == "delta" or all(text.startswith(t) for t in shown), (stop, kind, shown)
        scripted(monkeypatch, ids)  # its last allowed token completes the stop string: "stop" still, as vLLM
        [o] = llm.generate([[1, 2]], greedy(n, stop=stop))
        assert (o.token_ids, o.text, o.finish_reason) == (ids[:n], text, "stop")
    check_clean(engine)


def test_vllm_sampling_fields_port_at_their_off_values():
    """vLLM code ports as it is: each field of vLLM's SamplingParams that nanoengine lacks is accepted at its off
    value (and changes nothing), and at any other value is a ValueError naming the fields nanoengine has."""
    assert SamplingParams(temperature=0, **scheduler.VLLM_OFF) == SamplingParams(temperature=0)
    assert SamplingParams(n=1, presence_penalty=0, skip_special_tokens=True, logprobs=None).max_tokens == 16
    for name, off in scheduler.VLLM_OFF.items():
        on = (not off) if isinstance(off, bool) else 3 if off is None else off + 1
        with pytest.raises(ValueError, match=rf"^{name}={on!r} is not supported: SamplingParams has temperature, "
                                             rf".*, stop; vLLM's other fields only at their off value \({name}="):
            SamplingParams(**{name: on})


@pytest.mark.parametrize("use_async", [False, True])
def test_request_metrics_are_ordered_and_present(use_async):
    """Each request records when it arrived, was first scheduled, got its first token and finished; its final
    output carries them with TTFT (> 0) and TPOT (once it has two tokens). With 2 sequence slots the third
    and fourth requests wait for one, and are first scheduled after the first request's first token; a
    request aborted before it ran has no first token and no TTFT."""
    engine = Engine(model="tiny", max_num_seqs=2, async_scheduling=use_async)
    prompts = mixed_prompts(4, 4096, seed=52, lengths=(5, 9, 3, 7))
    params = [greedy(6), greedy(1), greedy(6, output_kind="cumulative"), greedy(4, output_kind="delta")]
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    never_ran = engine.add_request([1, 2, 3], greedy(5))
    engine.abort(never_ran)
    streams = drive(engine, use_async)
    outs = [final_output(streams[rid], sp.output_kind) for rid, sp in zip(ids, params)]  # check_metrics: ordered
    for o, n in zip(outs, (6, 1, 6, 4)):
        m = o.metrics
        assert set(m) == {"arrival_time", "first_scheduled_time", "first_token_time", "finished_time", "ttft", "tpot"}
        assert len(o.token_ids) == n and None not in (m["first_scheduled_time"], m["first_token_time"], m["ttft"])
        assert (m["tpot"] is None) == (n == 1)
    for late in outs[2:]:
        assert late.metrics["first_scheduled_time"] > outs[0].metrics["first_token_time"], "it waited for a slot"
    [o] = streams[never_ran]
    assert o.finish_reason == "abort" and o.token_ids == [] and o.metrics["first_scheduled_time"] is None
    assert o.metrics["arrival_time"] <= o.metrics["finished_time"] and o.metrics["ttft"] is None
    check_clean(engine)


# -- Async scheduling: identical results to sync, on random workloads ---------------------------------


def _random_workload(seed: int):
    rng = random.Random(seed)
    shared = [rng.randrange(4096) for _ in range(48)]
    prompts = [(shared[:rng.randint(16, 48)] if rng.random() < 0.5 else []) +
               [rng.randrange(4096) for _ in range(rng.randint(1, 50))] for _ in range(rng.randint(4, 12))]
    params = []
    kinds = random.Random(seed + 1000)  # apart, so the rest of the workload is the one the seed always made
    for i in range(len(prompts)):
        kw = dict(max_tokens=rng.randint(1, 24), ignore_eos=rng.random() < 0.5)
        if rng.random() < 0.5:
            kw.update(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(1000))
        else:
            kw.update(temperature=0)
        kw["output_kind"] = kinds.choice(OUTPUT_KINDS) if seed % 2 else "final_only"  # even: the steady path
        params.append(kw)
    num_blocks = rng.choice([None, 10, 14])  # small caches force preemption
    aborts = {rng.randrange(len(prompts)): rng.randint(1, 8)} if rng.random() < 0.6 else {}
    return prompts, params, num_blocks, aborts


def _run_with_aborts(engine, prompts, params, aborts, use_async):
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]

    def abort(step):
        for i, at in aborts.items():
            if step == at:
                engine.abort(ids[i])  # async: with this request's next token in flight
    streams = drive(engine, use_async, abort)
    return [(o.token_ids, o.finish_reason) for o in
            (final_output(streams[rid], sp.output_kind) for rid, sp in zip(ids, params))]


@pytest.mark.parametrize("seed", range(8))
def test_async_equals_sync_on_random_workloads(seed, no_placeholder_hashed):
    prompts, raw, num_blocks, aborts = _random_workload(seed)
    # stop tokens that fire mid-stream: taken from a first run's outputs
    first = run(Engine(model="tiny"), prompts, [SamplingParams(**kw) for kw in raw])
    rng = random.Random(seed)
    for kw, o in zip(raw, first):
        if len(o.token_ids) > 2 and rng.random() < 0.5:
            kw["stop_token_ids"] = [o.token_ids[rng.randrange(1, len(o.token_ids))]]
    params = [SamplingParams(**kw) for kw in raw]
    results = []
    for use_async in (False, True):
        engine = Engine(model="tiny", num_blocks=num_blocks)
        results.append(_run_with_aborts(engine, prompts, params, aborts, use_async))
        check_clean(engine)
    sync_out, async_out = results
    for i, (a, b) in enumerate(zip(sync_out, async_out)):
        if i in aborts:
            continue  # aborted at different points of its life in the two modes
        assert a == b, f"request {i}: sync {a} vs async {b}"
        assert PLACEHOLDER not in a[0] and len(a[0]) <= params[i].max_tokens


def test_async_never_exceeds_max_tokens_and_drops_tokens_after_a_stop(no_placeholder_hashed):
    engine = Engine(model="tiny")
    p = [9, 8, 7, 6]
    want = run(engine, [p], greedy(10))[0].token_ids
    stop = want[4]
    launched = []  # tokens launched for the request: never more than max_tokens
    place = engine.book.append_placeholders
    engine.book.append_placeholders = lambda out: launched.extend(engine.book.sampling_requests(out)) or place(out)
    for mt in (1, 2, 7):
        for kind in OUTPUT_KINDS:
            launched.clear()
            o = run(engine, [p], greedy(mt, output_kind=kind), use_async=True)[0]
            assert o.token_ids == want[:mt] and o.finish_reason == "length"
            assert len(launched) == mt, "a request whose last token was in flight was scheduled again"
    o = run(engine, [p], greedy(10, stop_token_ids=[stop]), use_async=True)[0]
    assert o.token_ids == want[:want.index(stop) + 1] and o.finish_reason == "stop"
    check_clean(engine)


def test_async_placeholder_input_comes_from_the_device():
    """The token fed to step s+1 is read from step s's token tensor, never through the host."""
    engine = Engine(model="tiny")
    engine.add_request([1, 2, 3], greedy(4))
    engine.step_async()  # prefill launched; its token is a PLACEHOLDER on the host
    req = next(iter(engine.book.requests.values()))
    assert req.token_ids[-1] == PLACEHOLDER
    out = engine.scheduler.schedule()
    batch, _, _ = engine.runner.inputs.prepare(out)
    assert batch.input_ids.tolist() == engine.runner.inputs.prev_tokens.tolist()
    engine.abort(req.request_id)
    engine.inflight = None  # its token is never read back
    assert [(o.request_id, o.finish_reason) for o in engine.step()] == [(req.request_id, "abort")]
    check_clean(engine)


@pytest.mark.parametrize("use_async", [False, True])
def test_aborted_requests_come_back_once(use_async):
    """As in vLLM: an aborted request is returned once, by the next step, with finish_reason "abort" and the
    tokens it had; its blocks go back once; the others' tokens are those of a run without it. Aborted: one
    still waiting, and one running (async: with its step in flight, whose token is dropped)."""
    prompts = mixed_prompts(4, 4096, seed=21)
    keep = run(Engine(model="tiny"), prompts[:2], greedy(12))  # the two that are never aborted
    alone = run(Engine(model="tiny"), prompts[2:3], greedy(12))[0].token_ids  # the running one, not aborted
    engine = Engine(model="tiny", max_num_seqs=3)  # the fourth request waits while three run
    ids = [engine.add_request(p, greedy(12)) for p in prompts]
    step = engine.step_async if use_async else engine.step
    outs = {rid: [] for rid in ids}
    for n in range(1, 100):
        for o in step():
            outs[o.request_id].append(o)
        if n == 1:
            assert engine.book.requests[ids[3]].status == "waiting"
            engine.abort(ids[3])
        if n == 4:  # three steady decodes after the prefill
            req = engine.book.requests[ids[2]]
            assert req.status == "running" and (engine.inflight is not None) == use_async
            engine.abort(ids[2])
            engine.abort(ids[2])  # aborted already: a no-op, as an unknown id
            engine.abort("no such request")
        if not engine.has_unfinished():
            break
    had = 4 - use_async  # async: the fourth step's token was in flight, never read back
    for i, want in ((3, []), (2, alone[:had])):
        [o] = outs[ids[i]]
        assert (o.finish_reason, o.finished, o.token_ids, o.prompt_token_ids) == ("abort", True, want, prompts[i])
    assert [[o.token_ids for o in outs[rid]] for rid in ids[:2]] == [[o.token_ids] for o in keep]
    engine.abort(ids[0])  # finished: a no-op
    assert not engine.has_unfinished() and engine.step() == []
    check_clean(engine)


# -- Bad input: a ValueError (TypeError for a wrong type) naming the argument, its value and what is
# -- allowed, and the engine keeps serving ------------------------------------------------------------

EngineConfig = nanoengine.EngineConfig

# (what, a call that must raise, the exception, a fragment of its message). A call gets the `serving`
# fixture: its LLM (whose engine has the good requests in flight) and broken checkpoint folders.
BAD_INPUT = [
    # prompts: Engine.add_request and LLM.generate
    ("empty prompt", lambda s: s.engine.add_request([]), ValueError, "prompt is empty"),
    ("id past the vocabulary", lambda s: s.engine.add_request([1, 99999]), ValueError,
     "prompt token id 99999 is outside the vocabulary: ids must be in [0, 4096)"),
    ("negative id", lambda s: s.engine.add_request([-1]), ValueError, "prompt token id -1 is outside"),
    ("prompt past max_model_len", lambda s: s.engine.add_request([1] * 3000), ValueError,
     "prompt has 3000 tokens; max_model_len=2048"),
    ("more KV than the cache", lambda s: s.engine.add_request([1] * 30, SamplingParams(max_tokens=300)),
     ValueError, "the whole cache holds 256"),
    ("max_tokens past max_model_len", lambda s: s.engine.add_request([1] * 30, SamplingParams(max_tokens=2019)),
     ValueError, "max_tokens=2019 is invalid: the prompt has 30 tokens and max_model_len=2048 leaves room for at "
     "most 2018"),
    ("stop strings without a tokenizer", lambda s: s.engine.add_request([1], SamplingParams(stop="\n")), ValueError,
     "stop=('\\n',) needs text, but model='tiny' has no tokenizer"),
    ("text without a tokenizer", lambda s: s.engine.add_request("hello"), ValueError, "no tokenizer"),
    ("float id", lambda s: s.engine.add_request([1, 2.0]), TypeError,
     "prompt[1]=2.0 has type float: token ids must be integers"),
    ("str id", lambda s: s.engine.add_request([1, "2"]), TypeError, "prompt[1]='2' has type str"),
    ("None id", lambda s: s.engine.add_request([None]), TypeError, "prompt[0]=None has type NoneType"),
    ("bool id", lambda s: s.engine.add_request([1, True]), TypeError, "prompt[1]=True has type bool"),
    ("float numpy ids", lambda s: s.engine.add_request(np.array([1.0, 2.0])), TypeError,
     "prompt[0]=1.0 has type float"),
    ("prompt an int", lambda s: s.engine.add_request(5), TypeError,
     "prompt=5 has type int: give a string or a list of token ids"),
    ("prompt None", lambda s: s.engine.add_request(None), TypeError, "prompt=None has type NoneType"),
    ("request_id an int", lambda s: s.engine.add_request([1], None, 7), TypeError,
     "request_id=7 has type int: it must be a string or None"),
    ("request_id in use", lambda s: s.engine.add_request([1], None, "good0"), ValueError,
     "request_id='good0' is already in use"),
    ("params a string", lambda s: s.engine.add_request([1], "greedy"), TypeError,
     "params='greedy' has type str: give a SamplingParams, or None"),
    ("stop id past the vocabulary", lambda s: s.engine.add_request([1], SamplingParams(stop_token_ids=[4096])),
     ValueError, "stop_token_ids has 4096, outside the vocabulary"),
    ("stream: an empty prompt", lambda s: next(s.engine.stream([])), ValueError, "prompt is empty"),
    ("generate: sampling_params a string", lambda s: s.llm.generate([[1]], "greedy"), TypeError,
     "sampling_params='greedy' has type str"),
    ("generate: one of the params a dict", lambda s: s.llm.generate([[1], [2]], [greedy(2), {"temperature": 0}]),
     TypeError, "sampling_params[1]={'temperature': 0} has type dict"),
    ("generate: params per prompt", lambda s: s.llm.generate([[1], [2]], [greedy(2)] * 3), ValueError,
     "sampling_params has 3 entries for 2 prompts"),
    ("generate: a bad prompt after good ones", lambda s: s.llm.generate([[1, 2], [3], [5, 10**6]], greedy(2)),
     ValueError, "prompts[2]: prompt token id 1000000 is outside the vocabulary"),
    ("generate: float ids", lambda s: s.llm.generate([1, 2.5]), TypeError, "prompts[0]: prompt[1]=2.5"),
    ("generate: prompts None", lambda s: s.llm.generate(None), TypeError, "prompts=None has type NoneType"),
    ("generate: max_tokens past max_model_len", lambda s: s.llm.generate([[1, 2]], greedy(2047)), ValueError,
     "prompts[0]: max_tokens=2047 is invalid: the prompt has 2 tokens and max_model_len=2048"),
    ("abort: a list of ids", lambda s: s.engine.abort(["good0"]), TypeError, "request_id=['good0'] has type list"),
    # SamplingParams (vLLM: a finite temperature, top_k -1 or 0 for off, integer ids)
    ("temperature inf", lambda s: SamplingParams(temperature=math.inf), ValueError,
     "temperature=inf is invalid: it must be a finite number >= 0"),
    ("temperature nan", lambda s: SamplingParams(temperature=math.nan), ValueError, "temperature=nan"),
    ("temperature negative", lambda s: SamplingParams(temperature=-1), ValueError, "temperature=-1"),
    ("temperature a string", lambda s: SamplingParams(temperature="0.5"), TypeError,
     "temperature='0.5' has type str: it must be a number"),
    ("top_p nan", lambda s: SamplingParams(top_p=math.nan), ValueError, "top_p=nan is invalid: it must be in (0, 1]"),
    ("top_p 0", lambda s: SamplingParams(top_p=0), ValueError, "top_p=0"),
    ("top_p above 1", lambda s: SamplingParams(top_p=1.5), ValueError, "top_p=1.5"),
    ("top_k below -1", lambda s: SamplingParams(top_k=-2), ValueError,
     "top_k=-2 is invalid: it must be an integer >= 1, or -1 or 0 (off)"),
    ("top_k a float", lambda s: SamplingParams(top_k=5.0), TypeError, "top_k=5.0 has type float"),
    ("max_tokens 0", lambda s: SamplingParams(max_tokens=0), ValueError, "max_tokens=0"),
    ("max_tokens a float", lambda s: SamplingParams(max_tokens=8.0), TypeError, "max_tokens=8.0 has type float"),
    ("seed a string", lambda s: SamplingParams(seed="abc"), TypeError,
     "seed='abc' has type str: it must be an integer or None"),
    ("seed past int64", lambda s: SamplingParams(seed=2**64), ValueError, "seed=18446744073709551616 is invalid"),
    ("negative stop id", lambda s: SamplingParams(stop_token_ids=[-5]), ValueError, "stop_token_ids=[-5] is invalid"),
    ("stop ids an int", lambda s: SamplingParams(stop_token_ids=5), TypeError,
     "stop_token_ids=5 has type int: it must be a list of integers"),
    ("float stop ids", lambda s: SamplingParams(stop_token_ids=[2.0]), TypeError, "stop_token_ids=[2.0]"),
    ("ignore_eos a string", lambda s: SamplingParams(ignore_eos="no"), TypeError,
     "ignore_eos='no' has type str: it must be True or False"),
    ("output_kind unknown", lambda s: SamplingParams(output_kind="stream"), ValueError,
     "output_kind='stream' is invalid: it must be cumulative or delta or final_only"),
    ("output_kind an int", lambda s: SamplingParams(output_kind=1), TypeError, "output_kind=1 has type int"),
    ("stop a list of ids", lambda s: SamplingParams(stop=[13]), TypeError,
     "stop=[13] has type list: it must be a string or a list of strings or None"),
    ("stop an empty string", lambda s: SamplingParams(stop=["", "x"]), ValueError,
     "stop=['', 'x'] is invalid: it must be a non-empty string, or a list of them"),
    ("a vLLM field nanoengine lacks", lambda s: SamplingParams(n=2), ValueError,
     "n=2 is not supported: SamplingParams has temperature, top_p, top_k, max_tokens, seed, stop_token_ids, "
     "ignore_eos, output_kind, stop; vLLM's other fields only at their off value (n=1)"),
    ("logprobs", lambda s: SamplingParams(logprobs=5), ValueError, "logprobs=5 is not supported: SamplingParams has"),
    ("presence_penalty", lambda s: SamplingParams(presence_penalty=0.5), ValueError,
     "presence_penalty=0.5 is not supported"),
    ("a misspelt field", lambda s: SamplingParams(temprature=0), TypeError,
     "temprature=0: no such field; SamplingParams has temperature, top_p"),
    # LLM / Engine settings (EngineConfig)
    ("block_size 3", lambda s: EngineConfig(block_size=3), ValueError, "block_size=3 is invalid: it must be a power"),
    ("block_size a float", lambda s: EngineConfig(block_size=16.0), TypeError, "block_size=16.0 has type float"),
    ("num_blocks 0", lambda s: EngineConfig(num_blocks=0), ValueError, "num_blocks=0 is invalid"),
    ("gpu_memory_utilization nan", lambda s: EngineConfig(gpu_memory_utilization=math.nan), ValueError,
     "gpu_memory_utilization=nan is invalid: it must be in (0, 1]"),
    ("max_num_seqs 0", lambda s: EngineConfig(max_num_seqs=0), ValueError, "max_num_seqs=0 is invalid"),
    ("max_num_batched_tokens -1", lambda s: EngineConfig(max_num_batched_tokens=-1), ValueError,
     "max_num_batched_tokens=-1 is invalid"),
    ("max_model_len 0", lambda s: EngineConfig(max_model_len=0), ValueError, "max_model_len=0 is invalid"),
    ("max_model_len past the model", lambda s: LLM("tiny", max_model_len=10**6), ValueError,
     "max_model_len=1000000 exceeds the model's max_position_embeddings=2048"),
    ("seed a string", lambda s: EngineConfig(seed="abc"), TypeError, "seed='abc' has type str"),
    ("device tpu", lambda s: EngineConfig(device="tpu"), ValueError,
     "device='tpu' is invalid: it must be 'cpu', 'cuda' or 'cuda:N'"),
    ("device cuda:99", lambda s: EngineConfig(device="cuda:99"), ValueError, "device='cuda:99'"),
    ("dtype int8", lambda s: EngineConfig(dtype="int8"), ValueError, "dtype='int8' is invalid"),
    ("model None", lambda s: LLM(None), TypeError, "model=None has type NoneType: it must be a string"),
    ("model missing", lambda s: LLM("/no/such/folder"), ValueError, "neither a folder nor a preset"),
    ("fuse a string", lambda s: EngineConfig(fuse="yes"), TypeError, "fuse='yes' has type str: it must be True"),
    ("tuned an int", lambda s: EngineConfig(tuned=3), TypeError, "tuned=3 has type int: it must be True, False, or"),
    ("tuned an unknown variant", lambda s: EngineConfig(tuned="fast"), ValueError,
     "tuned='fast' is invalid: give True, False, or names from gemv"),
    ("tuned both ways", lambda s: EngineConfig(tuned="gemv,-pdl"), ValueError, "tuned='gemv,-pdl' is invalid"),
    ("async_scheduling 1", lambda s: EngineConfig(async_scheduling=1), TypeError, "async_scheduling=1 has type int"),
    ("triton_linear_rows 257", lambda s: EngineConfig(triton_linear_rows=257), ValueError,
     "triton_linear_rows=257 is invalid: it must be None or in [0, 256]"),
    ("triton_narrow_rows -1", lambda s: EngineConfig(triton_narrow_rows=-1), ValueError,
     "triton_narrow_rows=-1 is invalid: it must be None or in [0, 256]"),
    ("cudagraph_mode piecewise", lambda s: EngineConfig(cudagraph_mode="piecewise"), ValueError,
     "cudagraph_mode='piecewise' is invalid: it must be 'full' or 'full_decode_only'"),
    ("graph_buckets 0", lambda s: EngineConfig(graph_buckets=(0, 8)), ValueError, "graph_buckets=(0, 8) is invalid"),
    ("graph_buckets an int", lambda s: EngineConfig(graph_buckets=8), TypeError, "graph_buckets=8 has type int"),
    ("graph_token_buckets empty", lambda s: EngineConfig(graph_token_buckets=()), ValueError,
     "graph_token_buckets=() is invalid: it must be None or sizes >= 1"),
    ("tensor_parallel_size 0", lambda s: EngineConfig(tensor_parallel_size=0), ValueError,
     "tensor_parallel_size=0 is invalid: it must be >= 1"),
    ("tensor_parallel_size 3 of 4 kv heads", lambda s: LLM("tiny", tensor_parallel_size=3), ValueError,
     "tensor_parallel_size=3 is invalid: it must be a divisor or a multiple of num_key_value_heads=4 (model='tiny')"),
    ("tensor_parallel_size 16 of 8 heads", lambda s: LLM("tiny", tensor_parallel_size=16), ValueError,
     "tensor_parallel_size=16 is invalid: it must be a divisor of num_attention_heads=8 (model='tiny')"),
    ("an unknown setting", lambda s: LLM("tiny", max_seqs=4), TypeError, "max_seqs"),
    ("Engine given a model name", lambda s: nanoengine.Engine("tiny"), TypeError,
     "cfg='tiny' has type str: give an EngineConfig"),
    # checkpoints
    ("truncated model.safetensors", lambda s: LLM(s.truncated), ValueError,
     "model.safetensors is not a readable safetensors file (Error while deserializing header"),
    ("a shard missing", lambda s: LLM(s.shard_missing), ValueError,
     "model-00002-of-00002.safetensors is not a readable safetensors file"),
    ("index not JSON", lambda s: LLM(s.bad_index), ValueError, "model.safetensors.index.json is unreadable"),
]

GOOD_PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 20]
GOOD_PARAMS = [greedy(6), SamplingParams(temperature=0.8, top_k=50, seed=5, max_tokens=6, ignore_eos=True),
               SamplingParams(temperature=1.0, top_p=0.9, seed=6, max_tokens=6, ignore_eos=True, output_kind="delta")]


def _serve_good_requests(engine, bad_call=lambda: None) -> dict:
    """The good requests, added and one step in (so some hold KV) before bad_call; run to the end."""
    ids = [engine.add_request(p, sp, request_id=f"good{i}")
           for i, (p, sp) in enumerate(zip(GOOD_PROMPTS, GOOD_PARAMS))]
    streams = collections.defaultdict(list)
    for o in engine.step():
        streams[o.request_id].append(o)
    bad_call()
    assert set(engine.book.requests) <= set(ids), "the bad call left a request in the engine"
    for rid, outs in drive(engine).items():
        streams[rid] += outs
    return {rid: final_output(streams[rid], sp.output_kind).token_ids for rid, sp in zip(ids, GOOD_PARAMS)}


@pytest.fixture(scope="module")
def serving(tmp_path_factory, ckpt_dirs):
    llm = LLM("tiny", num_blocks=16)  # 256 tokens of KV
    cfg, sd, _ = ckpt_dirs["qwen3"]
    root = tmp_path_factory.mktemp("broken")
    truncated = save_checkpoint(root / "truncated", cfg, sd)
    path = os.path.join(truncated, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)  # as a download cut short
    shard_missing = save_checkpoint(root / "shard_missing", cfg, sd, shards=2)
    os.remove(os.path.join(shard_missing, "model-00002-of-00002.safetensors"))
    bad_index = save_checkpoint(root / "bad_index", cfg, sd, shards=2)
    with open(os.path.join(bad_index, "model.safetensors.index.json"), "w") as f:
        f.write("{not json")
    return SimpleNamespace(llm=llm, engine=llm.engine, truncated=truncated, shard_missing=shard_missing,
                           bad_index=bad_index, want=_serve_good_requests(llm.engine))


@pytest.mark.parametrize("what,call,error,msg", BAD_INPUT, ids=[row[0] for row in BAD_INPUT])
def test_bad_input_raises_one_clear_error_and_the_engine_keeps_serving(serving, what, call, error, msg):
    """Each bad input raises its own exception type with a message naming the argument, its value and what
    is allowed; the requests already in the engine finish with the tokens of a run without it."""
    def bad_call():
        with pytest.raises(error) as e:
            call(serving)
        assert msg in str(e.value), f"{what}: {e.value}"
    assert _serve_good_requests(serving.engine, bad_call) == serving.want
    check_clean(serving.engine)


# -- Engines come and go: close(), `with`, and refcount alone give their memory back ------------------


def test_close_frees_the_engine_and_later_use_is_a_clear_error():
    with LLM("tiny") as llm:
        assert len(llm.generate([[1, 2, 3]], greedy(4))[0].token_ids) == 4
        kv_cache, weights = weakref.ref(llm.engine.runner.kv_cache), weakref.ref(llm.engine.model)
    # llm still holds the engine, and close() let go of its memory anyway
    assert kv_cache() is None and weights() is None, "close() left the KV cache or the weights alive"
    engine = llm.engine
    for use in (lambda: llm.generate([[1, 2]], greedy(2)), lambda: engine.add_request([1, 2]), engine.step,
                engine.step_async, engine.has_unfinished, lambda: engine.abort("0"),
                lambda: next(engine.stream([1, 2]))):
        with pytest.raises(ValueError, match="engine is closed"):
            use()
    llm.close()  # a second close does nothing
    with Engine(model="tiny", async_scheduling=True) as engine:
        engine.add_request([1, 2, 3], greedy(3))
        engine.step_async()  # leaves a step in flight: close() must wait for it, not crash
    with pytest.raises(ValueError, match="engine is closed"):
        engine.step_async()


def test_a_dropped_engine_is_freed_by_refcount_alone():
    """A fresh process, as a notebook's first engine, with the cycle collector off: each engine, and its KV
    cache, is gone right after `del`. A reference cycle through the engine keeps it alive here."""
    script = textwrap.dedent("""
        import gc, weakref
        gc.disable()
        import nanoengine
        for settings in ({}, {"async_scheduling": True}, {"fuse": False}, {"tuned": False},
                         {"enforce_eager": False}):
            llm = nanoengine.LLM("tiny", device="cpu", **settings)
            llm.generate([[1, 2, 3]] * 3, nanoengine.SamplingParams(max_tokens=4))
            engine, kv_cache = weakref.ref(llm.engine), weakref.ref(llm.engine.runner.kv_cache)
            del llm
            assert engine() is None and kv_cache() is None, f"{settings}: the engine outlived its last reference"
        print("freed")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=HERE,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert r.returncode == 0 and r.stdout.strip() == "freed", r.stderr[-2000:]


# -- On the GPU: bf16, the default engines, and the proof that the forward and the async loop never sync -


# Run in a fresh process: its first engine is its first use of the GPU, when a step also allocates what a
# process makes once (cuBLAS's workspace), which the KV cache's sizing must not count as a step's.
DEFAULT_ENGINES_SCRIPT = """
import gc, weakref, nanoengine
prompts = [[5, 17, 300, 42], list(range(100, 140)), [9] * 7]
params = nanoengine.SamplingParams(temperature=0, max_tokens=8)
tokens = lambda llm: [o.token_ids for o in llm.generate(prompts, params)]
gc.disable()  # the first must go by refcount alone
llm = nanoengine.LLM("tiny", device="cuda")
blocks, want = llm.engine.book.blocks.num_blocks, tokens(llm)
kv_cache = weakref.ref(llm.engine.runner.kv_cache)
del llm
assert kv_cache() is None, "the dropped engine's KV cache outlived it"
gc.enable()
with nanoengine.LLM("tiny", device="cuda") as llm:
    got = llm.engine.book.blocks.num_blocks, tokens(llm)
assert got == (blocks, want), f"closed by `with`: {got[0]} blocks after {blocks}, same tokens: {got[1] == want}"
llm = nanoengine.LLM("tiny", device="cuda")
got = llm.engine.book.blocks.num_blocks, tokens(llm)
llm.close()
assert got == (blocks, want), f"closed by close(): {got[0]} blocks after {blocks}, same tokens: {got[1] == want}"
print("ok")
"""


@needs_cuda
def test_gpu_default_engines_one_after_another_get_the_same_kv_cache():
    """Default settings (90% of the GPU, graphs), in a fresh process: one dropped with `del`, one closed by
    `with`, one by close(); each gets as many KV blocks as the first and generates the same tokens."""
    r = subprocess.run([sys.executable, "-c", DEFAULT_ENGINES_SCRIPT], cwd=HERE, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["ok"], r.stderr[-3000:]


@needs_cuda
@pytest.mark.parametrize("tuned", [True, False])
@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_gpu_fused_forward_never_syncs(preset, tuned):
    """The textbook forward and the tuned one, on a mixed step (prompts and decodes), then sampling: no
    host sync anywhere, so a CUDA graph can hold it."""
    engine = nanoengine.Engine(model=preset, enforce_eager=True, tuned=tuned, **GPU)
    for p in mixed_prompts(6, 4096, seed=19):
        engine.add_request(p, SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1, max_tokens=4))
    engine.step()  # a mixed step first, then decodes with prompts still arriving
    engine.add_request([5] * 40, greedy(3))
    out = engine.scheduler.schedule()
    batch, sbatch, _ = engine.runner.inputs.prepare(out)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            hidden = engine.model(batch, engine.runner.kv_cache)
            logits = engine.model.compute_logits(hidden[batch.logits_indices])
            tokens = nanoengine.sample(logits, sbatch, engine.model.ops.race_sample)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.shape[0] == sum(out.samples)


@needs_cuda
@pytest.mark.parametrize("arch", ARCH_NAMES)
@pytest.mark.parametrize("tuned,rows", [(False, None), (True, 0), (True, 1), (True, 16)])
def test_gpu_triton_float32_matches_reference(ckpt_dirs, arch, tuned, rows):
    cfg, sd, folder = ckpt_dirs[arch]
    prompts = mixed_prompts(8, cfg["vocab_size"], seed=1)
    llm = nanoengine.LLM(model=folder, dtype="float32", tuned=tuned, triton_linear_rows=rows, **GPU)
    outs = llm.generate(prompts, greedy(6))
    assert tokens_of(outs) == [ref_tokens(sd, cfg, p, 6) for p in prompts]


@needs_cuda
def test_gpu_async_loop_never_syncs_but_for_its_event(monkeypatch):
    """Between the event waits, a whole async step (plan, copy in, replay, sample, copy out) never blocks:
    decode steps, and a step with a prompt in the middle (a prompt graph)."""
    engine = nanoengine.Engine(model="tiny", async_scheduling=True, max_num_seqs=16, **GPU)
    for p in mixed_prompts(12, 4096, seed=21):
        engine.add_request(p, greedy(40))
    for _ in range(4):
        engine.step_async()
    torch.cuda.synchronize()
    waited = []
    real_sync = torch.cuda.Event.synchronize

    def allowed_wait(event):  # the one wait async scheduling keeps: for the step before the one in flight
        waited.append(event)
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("default")
        real_sync(event)
        torch.cuda.set_sync_debug_mode(mode)  # "error" inside the checked loop, "default" after it
    monkeypatch.setattr(torch.cuda.Event, "synchronize", allowed_wait)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(10):
            if i == 5:
                engine.add_request([7] * 30, greedy(5))  # a mixed step in the middle
            engine.step_async()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(waited) >= 10
    while engine.has_unfinished():
        engine.step_async()
    check_clean(engine)


@needs_cuda
def test_gpu_async_equals_sync_with_graphs():
    prompts = mixed_prompts(24, 4096, seed=20, lengths=(5, 60, 17, 200))
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=12, ignore_eos=True) for i in range(24)]
    a = nanoengine.LLM("tiny", async_scheduling=False, **GPU).generate(prompts, params)
    b = nanoengine.LLM("tiny", async_scheduling=True, **GPU).generate(prompts, params)
    assert tokens_of(a) == tokens_of(b)


# -- Part 3: tensor parallel. Two ranks with gloo on the CPU, float32: every split must give one rank's tokens --

TP = dict(tensor_parallel_size=2)


def _tp_workload():
    """Prompts, params and aborts (request -> the step it is aborted at) that pass through every path of the
    scheduler at max_num_batched_tokens=64 and num_blocks=12: four prompts share 48 tokens (prefix-cache hits),
    three are longer than a step (chunked prefill), and together they outgrow the cache (preemption)."""
    rng = random.Random(37)
    shared = [rng.randrange(4096) for _ in range(48)]
    prompts = [shared + [rng.randrange(4096) for _ in range(n)] for n in (3, 20, 40, 9)] + \
        [[rng.randrange(4096) for _ in range(n)] for n in (1, 90, 17, 5)]
    params = [greedy(n) for n in (10, 6, 14, 12, 9, 8, 11, 13)]
    params[4] = params[6] = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=9, ignore_eos=True)
    return prompts, params, {3: 4}


def _check_rank0_shards(tp, one):
    """Rank 0 of two holds half of each split weight, the first half of one rank's: q, k and v heads, o_proj's
    and down_proj's columns, gate and up rows (an MLP's, or each expert's), and the vocabulary's rows."""
    a, b, halves = tp.model, one.model, lambda t, dim: t.chunk(2, dim)[0]
    mc = b.config
    for la, lb in zip(a.model.layers, b.model.layers):
        q, k, v = lb.self_attn.qkv_proj.weight.split([mc.num_heads * mc.head_dim, *[mc.num_kv_heads * mc.head_dim] * 2])
        assert torch.equal(la.self_attn.qkv_proj.weight, torch.cat([halves(q, 0), halves(k, 0), halves(v, 0)]))
        assert torch.equal(la.self_attn.o_proj.weight, halves(lb.self_attn.o_proj.weight, 1))
        moe = isinstance(lb.mlp, nanoengine.MoE)
        (ga, da), (gb, db) = [(m.w_gate_up, m.w_down) if moe else (m.gate_up_proj.weight, m.down_proj.weight)
                              for m in (la.mlp, lb.mlp)]
        gate, up = gb.chunk(2, dim=-2)
        assert torch.equal(ga, torch.cat([halves(gate, -2), halves(up, -2)], dim=-2))
        assert torch.equal(da, halves(db, -1))
    assert torch.equal(a.model.embed_tokens.weight, halves(b.model.embed_tokens.weight, 0))
    assert a.lm_head.weight is a.model.embed_tokens.weight  # tied, as one rank's


@pytest.mark.parametrize("preset,settings", [("tiny", dict(tuned=False, enforce_eager=False)),
                                             ("tiny-moe", dict(tuned="-gemv"))])
def test_tp_two_ranks_give_one_ranks_tokens(preset, settings):
    """Two ranks give one rank's greedy tokens, sync and async (the second pass hits the prefix cache on
    every prompt), with chunked prefill, preemption and an abort in flight; seeded sampled requests get the
    same tokens sync and async, which they cannot unless every rank samples the token rank 0 does (async
    inputs come from each rank's own). tiny runs the graph runner's static buffers (the logits gathered into
    them), tiny-moe Part 2's ops (add_rmsnorm_linear made of add_rmsnorm: x is summed once)."""
    prompts, params, aborts = _tp_workload()
    kw = dict(model=preset, num_blocks=12, max_num_batched_tokens=64, **settings)
    one = Engine(**kw)
    want = _run_with_aborts(one, prompts, params, aborts, False)
    with Engine(**kw, **TP) as engine:
        _check_rank0_shards(engine, one)
        sync, async_ = [_run_with_aborts(engine, prompts, params, aborts, use_async) for use_async in (False, True)]
        check_clean(engine)
        assert engine.scheduler.num_preemptions and engine.scheduler.num_cached_tokens
    for i, p in enumerate(params):
        if i not in aborts:
            assert sync[i] == async_[i], f"request {i}: sync {sync[i]} vs async {async_[i]}"
            assert p.temperature > 0 or sync[i] == want[i], f"request {i}: two ranks {sync[i]}, one {want[i]}"


@pytest.mark.parametrize("fuse", [False, True])
def test_tp_biases_added_once_and_kv_heads_copied(tmp_path, fuse):
    """Llama with attention_bias (q, k, v and o_proj biases) and one kv head for two ranks: each rank gets a
    copy of the kv head and its heads' share of the q, k, v biases; o_proj's bias is added once (by rank 0).
    Unfused weights are split the same way (the split comes before fusion)."""
    cfg, sd = random_hf_checkpoint("llama", attention_bias=True, num_key_value_heads=1)
    sd["model.norm.weight"] = sd["model.norm.weight"] * 30  # as checkpoint(): logits too spread for a near tie
    folder = save_checkpoint(tmp_path, cfg, sd)
    prompts = mixed_prompts(3, cfg["vocab_size"], seed=3, lengths=(5, 30, 12))
    with Engine(model=folder, fuse=fuse, **TP) as engine:
        assert engine.model.config.num_kv_heads == 1 and engine.model.model.layers[0].self_attn.o_proj.bias is not None
        outs = run(engine, prompts, greedy(5))
    assert [o.token_ids for o in outs] == [ref_tokens(sd, cfg, p, 5) for p in prompts]


def _listening() -> set[str]:
    """The addresses of this process's listening TCP sockets, 'ip:port' (hex, as /proc/net writes them)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed since the listing
            inodes.add(os.readlink(f"/proc/self/fd/{fd}").removeprefix("socket:[").removesuffix("]"))
    return {f[1] for name in ("tcp", "tcp6") for f in (line.split() for line in open(f"/proc/self/net/{name}"))
            if f[3] == "0A" and f[9] in inodes}  # 0A: LISTEN


LOOPBACK = ("0100007F:", "00000000000000000000000001000000:")  # 127.0.0.1 and ::1 as /proc/net writes them


def test_tp_engines_come_and_go_leaving_no_process_or_port():
    """Engines one after another: closed twice, or dropped (its last reference stops the ranks); each listens
    on loopback only while it lives, and leaves no process, port or process group behind."""
    before = _listening()
    want = tokens_of(run(Engine(model="tiny"), [[1, 2, 3], [4] * 20], greedy(6)))
    for drop in (False, True):
        engine = Engine(model="tiny", **TP)
        procs = list(engine.model.group.procs)
        assert len(procs) == 1 and all(a.startswith(LOOPBACK) for a in _listening() - before), _listening() - before
        assert tokens_of(run(engine, [[1, 2, 3], [4] * 20], greedy(6))) == want
        if drop:
            del engine
        else:
            engine.close()
            engine.close()  # a second close does nothing
        assert not multiprocessing.active_children() and not torch.distributed.is_initialized()
        assert procs[0].exitcode == 0, "the rank was not stopped by a stop header"
        with pytest.raises(ProcessLookupError):
            os.kill(procs[0].pid, 0)
        assert _listening() == before


@pytest.mark.parametrize("how,said", [("SIGKILL", "exited with code -9"),
                                      ("SIGINT", "raised:\nTraceback(.|\n)*KeyboardInterrupt")], ids=["dies", "raises"])
def test_tp_a_rank_that_dies_or_raises_is_one_clear_error(how, said):
    """A rank killed, or raising (SIGINT: a KeyboardInterrupt in its next step), mid-run: rank 0 raises one
    error that names the rank and what happened to it, and stops every process."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell's background job ignores SIGINT,
    try:  # and so would the ranks it spawns: they start with Python's own handler
        engine = Engine(model="tiny", **TP)
    finally:
        signal.signal(signal.SIGINT, before)
    proc = engine.model.group.procs[0]
    engine.add_request([1, 2, 3], greedy(50))
    engine.step_async()
    os.kill(proc.pid, getattr(signal, how))
    with pytest.raises(RuntimeError, match=rf"rank 1 \(pid {proc.pid}\) {said}(.|\n)*Every rank is stopped"):
        while engine.has_unfinished():
            engine.step_async()
    assert not multiprocessing.active_children() and not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="Every rank is stopped"):  # the next launch says it again
        engine.add_request([1, 2], greedy(2))
        engine.step()
    engine.close()
    engine.close()


def test_tp_ranks_that_size_their_kv_caches_apart_are_refused(monkeypatch):
    """Every rank sizes its own KV cache (on CUDA, from its GPU's free memory); if they differ, rank 0 could hand
    out a block another rank lacks: refused, and nothing is left running."""
    monkeypatch.setattr(nanoengine, "CPU_KV_BYTES", nanoengine.CPU_KV_BYTES // 2)  # rank 0's only
    with pytest.raises(ValueError, match="the ranks sized their KV caches from 8192 to 16384 blocks"):
        Engine(model="tiny", **TP)
    assert not multiprocessing.active_children() and not torch.distributed.is_initialized()


@needs_cuda
def test_gpu_tp_a_group_of_one_in_graphs_gives_the_same_tokens(monkeypatch):
    """Part 3 on one GPU: a world-size-1 NCCL group, its all-reduces and the logits' gather captured in CUDA
    graphs, sync and async: the tokens of the engine without it."""
    prompts, params = mixed_prompts(6, 4096, seed=37, lengths=(5, 60, 17, 200)), greedy(12)
    settings = dict(dtype="float32", **GPU)
    with nanoengine.LLM("tiny", **settings) as llm:
        want = tokens_of(llm.generate(prompts, params))
    monkeypatch.setattr(nanoengine, "tensor_parallel", lambda cfg: True)
    for use_async in (False, True):
        with nanoengine.LLM("tiny", async_scheduling=use_async, **settings) as llm:
            assert isinstance(llm.engine.runner, nanoengine.TPRunner) and llm.engine.runner.graphs.graphs
            assert tokens_of(llm.generate(prompts, params)) == want
        assert not torch.distributed.is_initialized()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_gpu_tp_two_gpus_give_one_gpus_tokens(preset):
    """Two ranks on two GPUs in float32 (NCCL, the collectives inside CUDA graphs): one GPU's greedy tokens, sync
    and async, through every scheduler path."""
    prompts, params, aborts = _tp_workload()
    kw = dict(model=preset, dtype="float32", device="cuda", num_blocks=12, max_num_batched_tokens=64)
    with nanoengine.Engine(**kw) as one:
        want = _run_with_aborts(one, prompts, params, aborts, False)
    with nanoengine.Engine(**kw, **TP) as engine:
        assert engine.runner.graphs.graphs
        for use_async in (False, True):
            got = _run_with_aborts(engine, prompts, params, aborts, use_async)
            assert [g for i, g in enumerate(got) if i not in aborts and params[i].temperature == 0] == \
                [w for i, w in enumerate(want) if i not in aborts and params[i].temperature == 0]
    assert not multiprocessing.active_children()

# ==========================================================================================================
# run.py: the command line
# ==========================================================================================================


def cli(*args):
    """run.py's main on these arguments, in this process, on the CPU: its exit status, stdout and stderr (a
    fresh Python costs seconds a call; test_cli_generate_stream_prints_the_same_ids runs run.py as a script)."""
    run_py, out, err, code = import_run(), io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            run_py.main([*args, "--device", "cpu"])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def script(*args, cuda=False, timeout=600):
    """run.py run as a script, in a fresh process (on the CPU unless cuda)."""
    env = dict(os.environ) if cuda else dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, os.path.join(HERE, "run.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=HERE, env=env)


def is_json(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except ValueError:
        return False


def import_run():
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import run as run_py
    return run_py


def test_cli_overhead_prints_every_configuration():
    """The ladder on the CPU: eager, fused, fused+async and the tuned path, each with the eager row's tokens."""
    r = cli("overhead", "--requests", "4", "--new-tokens", "6")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]  # stdout: JSON lines only (`| jq` works)
    assert lines[0]["device"] == "cpu" and lines[0]["requests"] == 4 and lines[0]["floor_ms"] > 0
    assert lines[0]["bandwidth_source"] == "measured" and lines[0]["bandwidth_gb_s"] > 0
    assert [x["config"] for x in lines[1:]] == ["eager", "fused", "fused+async", "tuned"]
    for x in lines[1:]:
        assert x["same_tokens"] is True and x["steps"] > 0 and x["tok_s"] > 0 and x["host_ms_per_step"] > 0, x
    assert lines[-1]["tuned"] == ",".join(sorted(nanoengine.TUNED)), "--tuned defaults to every variant"
    assert all(x["same_as_fused"] is True and x["share_as_fused"] == 1.0 for x in lines[2:])
    # stderr: progress for a person, a few lines a configuration, and not the results again
    progress = r.stderr.splitlines()
    assert not [line for line in progress if is_json(line)], r.stderr
    for name in ("eager", "fused", "fused+async", "tuned"):
        assert any(line.startswith(f"{name}: ready in") for line in progress), r.stderr


def test_cli_floors_use_the_bandwidth_given_or_measured():
    r = cli("overhead", "--requests", "2", "--new-tokens", "3", "--configs", "fused", "--bandwidth", "1e11")
    header = json.loads(r.stdout.splitlines()[0])
    assert header["bandwidth_source"] == "--bandwidth" and header["bandwidth_gb_s"] == 100.0, header
    assert "0.100 TB/s" in header["floor_note"]
    measured = import_run().measure_bandwidth("cpu")
    assert 1e8 < measured < 1e13 and measured != 4.27e12  # bytes/s of this machine, not the H200's


def test_cli_help_states_every_default_and_each_command_its_time():
    run_py = import_run()
    commands = next(a for a in run_py.make_parser()._actions if a.dest == "cmd").choices
    assert set(commands) == {"generate", "overhead", "bench", "online"}
    for name, parser in commands.items():
        assert "CPU: ~" in parser.description or "H200" in parser.description, name
        for action in parser._actions:
            if action.dest != "help":
                assert "default" in (action.help or ""), f"run.py {name} {action.option_strings[0]}: no default"
    r = cli("bench", "--help")
    assert r.returncode == 0 and "(default: 256 on CUDA, 64 on the CPU)" in " ".join(r.stdout.split())
    assert run_py.parse_args(["overhead"]).tuned is True and run_py.parse_args(["overhead", "--no-tuned"]).tuned is False
    assert run_py.parse_args(["generate"]).tuned is False, "generate runs the chapter"
    assert run_py.parse_args(["bench"]).tuned is run_py.parse_args(["online"]).tuned is True
    assert run_py.parse_args(["generate", "--tuned=-pdl"]).tuned == "-pdl"


def test_cli_generate_and_bench():
    r = cli("generate", "--prompt-ids", "1,2,3", "--max-tokens", "4", "--json")
    rec = json.loads(r.stdout)
    assert r.returncode == 0 and len(rec["token_ids"]) == 4 and rec["finish_reason"] == "length" and rec["ttft_s"] > 0
    r = cli("generate", "--prompt-ids", "1,2,3", "--max-tokens", "4", "--json", "--tensor-parallel-size", "2")
    assert json.loads(r.stdout)["token_ids"] == rec["token_ids"] and not multiprocessing.active_children(), r.stderr
    r = cli("bench", "--num-requests", "3", "--min-len", "4", "--max-len", "12")
    rec = json.loads(r.stdout)
    assert r.returncode == 0 and rec["output_tokens"] > 0 and rec["output_tok_s"] > 0
    assert rec["bandwidth_source"] == "measured" and "bench: warm-up" in r.stderr
    r = cli("bench", "--min-len", "300")  # past the CPU's default --max-len
    assert r.returncode == 2 and "--min-len 300 is more than --max-len 128" in r.stderr, r.stderr


def test_cli_generate_stream_prints_the_same_ids():
    """generate --stream prints each token id as it reaches the host: the ids generate prints at the end; with
    --json, one JSON line a token."""
    args = ("generate", "--prompt-ids", "5,6,7", "--max-tokens", "6", "--temperature", "0.8", "--seed", "3")
    streamed, whole = script(*args, "--stream"), cli(*args)  # once as a script, from the shell
    assert streamed.returncode == whole.returncode == 0, streamed.stderr + whole.stderr
    assert streamed.stdout.split() == whole.stdout.split() and len(whole.stdout.split()) == 6
    assert all(t.isdigit() for t in whole.stdout.split())
    lines = [json.loads(line) for line in cli(*args, "--stream", "--json").stdout.splitlines()]  # one per token
    assert [t for x in lines for t in x["token_ids"]] == list(map(int, whole.stdout.split()))
    assert [(x["finished"], x["finish_reason"], x["text"]) for x in lines] == [(False, None, None)] * 5 + [
        (True, "length", None)]


def test_cli_online_reports_latency_percentiles():
    """run.py online at a tiny size on the CPU, at two rates on one engine: a JSON line each, with TTFT / TPOT /
    ITL / end-to-end latency at p50 <= p90 <= p99, throughput, step times by kind, no compile count (the
    interpreter compiles nothing), and the join step, measured once, in both."""
    r = cli("online", "--requests", "6", "--rate", "50,80", "--output-len", "4", "--min-prompt", "8",
            "--max-prompt", "16", "--join-prompt-len", "32")
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in r.stdout.splitlines()]
    assert [rec["rate"] for rec in records] == [50.0, 80.0]
    assert records[0]["join_step_ms"] == records[1]["join_step_ms"] and r.stderr.count("three times") == 1
    for rec in records:
        assert rec["requests"] == 6 and rec["device"] == "cpu" and rec["output_tokens_each"] == 4
        for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "decode_step_ms", "prompt_step_ms"):
            p = rec[name]
            assert 0 < p["p50"] <= p["p90"] <= p["p99"], (name, p)
        assert rec["ttft_ms"]["p50"] <= rec["e2e_ms"]["p50"]
        assert rec["output_tok_s"] > 0 and rec["total_tok_s"] > rec["output_tok_s"]
        assert rec["offered_output_tok_s"] == rec["rate"] * 4
        assert 0 < rec["last_arrival_s"] < rec["duration_s"], rec
        assert rec["decode_step_ms"]["n"] > 0 and rec["prompt_step_ms"]["n"] > 0
        assert rec["compiles_during_run"] is None and rec["join_step_ms"]["median"] > 0
    assert "online: warm-up" in r.stderr and not [x for x in r.stderr.splitlines() if is_json(x)]


@pytest.mark.parametrize("args,msg", [
    (["generate", "--prompt-ids", "1,2", "--max-tokens", "0"], "max_tokens=0"),
    (["overhead", "--triton-linear-rows", "257"], "triton_linear_rows=257"),
    (["generate", "--prompt-ids", "1,x"], "--prompt-ids"),
    (["generate", "--model", "/no/such/dir", "--prompt-ids", "1"], "neither a folder nor a preset"),
    (["generate", "--prompt", "hi"], "no tokenizer"),
    (["generate", "--prompt-ids", "1", "--temperature", "-1"], "temperature=-1"),
    (["overhead", "--requests", "0"], "--requests"),
    (["overhead", "--configs", "turbo"], "turbo"),
    (["overhead", "--configs", "fused+graphs"], "graphs need CUDA"),
    (["generate", "--prompt-ids", "1", "--temperature", "inf"], "temperature=inf is invalid"),
    (["bench", "--min-len", "50", "--max-len", "10"], "--min-len 50 is more than --max-len 10"),
    (["online", "--rate", "0"], "--rate 0.0 is invalid"),
    (["online", "--rate", "16,x"], "--rate '16,x' is invalid"),
    (["online", "--min-prompt", "50", "--max-prompt", "10"], "--min-prompt 50 is more than --max-prompt 10"),
    (["online", "--cudagraph-mode", "piecewise"], "cudagraph_mode='piecewise' is invalid"),
    (["generate", "--model", "{truncated}", "--prompt-ids", "1"], "model.safetensors is not a readable safetensors"),
])
def test_cli_bad_input_is_one_line(tmp_path, args, msg):
    if "{truncated}" in args:  # a checkpoint whose download was cut short
        path = os.path.join(save_checkpoint(tmp_path, *checkpoint("qwen3")), "model.safetensors")
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        args = [str(tmp_path) if x == "{truncated}" else x for x in args]
    r = cli(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and msg in r.stderr, r.stderr


@needs_cuda
def test_gpu_online_compiles_nothing_after_warm_up():
    """run.py online on CUDA with its graphs (decode and prompt steps): after its warm-up, a load of Poisson
    arrivals compiles no Triton kernel (a compile stalls the GPU for up to a second), and reports its
    latencies."""
    r = script("online", "--requests", "24", "--rate", "40", "--output-len", "16", "--min-prompt", "16",
               "--max-prompt", "300", "--join-prompt-len", "256", "--max-num-seqs", "32", cuda=True)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads(r.stdout.splitlines()[-1])
    assert rec["graphs"] == "full" and rec["step_timing"] == "gpu events"
    assert rec["compiles_during_run"] == 0, rec
    assert rec["prompt_step_ms"]["n"] > 0 and rec["decode_step_ms"]["n"] > 0
    assert rec["ttft_ms"]["p50"] <= rec["ttft_ms"]["p99"]

# ==========================================================================================================
# Guards on tuning decisions: each Part 2 variant (kernels.py Part 2, nanoengine.tuned_ops, the steady
# decode of scheduler.py and nanoengine.py) computes what it replaces, takes the path it says it takes,
# and can be switched alone
# ==========================================================================================================


def test_tuned_variants_parse_names():
    """EngineConfig.tuned: True every variant, False none, "a,b" those, "-a,-b" all but those; anything else
    is a ValueError that names `tuned`, its value and the names allowed."""
    every = frozenset(nanoengine.TUNED)
    assert nanoengine.tuned_variants(True) == every and nanoengine.tuned_variants(False) == frozenset()
    assert nanoengine.tuned_variants("gemv, steady") == {"gemv", "steady"}
    assert nanoengine.tuned_variants(("gemv", "steady")) == {"gemv", "steady"}
    assert nanoengine.tuned_variants("-pdl") == every - {"pdl"}
    assert nanoengine.tuned_variants("-pdl,-steady") == every - {"pdl", "steady"}
    for bad in ("bogus", "gemv,bogus", "gemv,-pdl", "-pdl,gemv"):
        with pytest.raises(ValueError, match=f"tuned={bad!r} is invalid: give True, False, or names from gemv"):
            nanoengine.tuned_variants(bad)


def test_engine_config_takes_tuned_names():
    """EngineConfig(tuned=...) and run.py's --tuned take the names (the type check leaves the field to
    tuned_variants, which names it when its type is wrong)."""
    assert nanoengine.EngineConfig(device="cpu", tuned="-pdl").tuned == frozenset(nanoengine.TUNED) - {"pdl"}
    assert nanoengine.EngineConfig(device="cpu", tuned=("gemv",)).tuned == {"gemv"}
    assert nanoengine.EngineConfig(device="cpu", fuse=False, tuned="gemv").tuned == frozenset(), "unfused: none"
    with pytest.raises(ValueError, match="tuned='bogus' is invalid"):
        nanoengine.EngineConfig(device="cpu", tuned="bogus")
    r = cli("generate", "--prompt-ids", "1,2", "--max-tokens", "2", "--tuned", "gemv,steady")
    assert r.returncode == 0, r.stderr


# What each variant swaps into the textbook ops on a Triton device without PDL (the interpreter); steady is the
# host path (SteadyBook, SteadyScheduler, SteadyInputBuilder), no op.
SWAPS = {"gemv": {"linear", "add_rmsnorm_linear"}, "pdl": set(), "decode_attention": {"decode_attention",
         "decode_context_bounds"}, "prefill_attention": {"paged_attention"}, "moe_decode": {"fused_moe"},
         "moe_route": {"moe_route"}, "sampler": {"race_sample"}, "steady": set()}


@pytest.mark.parametrize("variant", list(nanoengine.TUNED))
def test_each_variant_swaps_only_its_ops(variant):
    assert set(SWAPS) == set(nanoengine.TUNED)
    mcfg = nanoengine.ModelConfig.from_hf(nanoengine.PRESETS["tiny-moe"])
    for triton_on in (True, False):
        cfg = nanoengine.EngineConfig(device="cpu", triton=triton_on)
        assert not {"add_rmsnorm_linear", "decode_attention"} & set(vars(nanoengine.textbook_ops(triton_on))), \
            "the chapter's ops hold no slot for Part 2"
        cfg.tuned = frozenset()  # Part 2's ops, none of them a variant: add_rmsnorm_linear is Part 1's ops in turn
        before = vars(nanoengine.tuned_ops(nanoengine.textbook_ops(triton_on), cfg, mcfg))
        cfg.tuned = frozenset({variant})
        after = vars(nanoengine.tuned_ops(nanoengine.textbook_ops(triton_on), cfg, mcfg))
        same = lambda a, b: a is b or (isinstance(a, partial) and isinstance(b, partial) and a.func is b.func  # noqa
                                       and a.keywords == b.keywords and len(a.args) == len(b.args))
        changed = {name for name in after if not same(after[name], before[name])}
        # Without Triton (the CPU's forward) gemv's matmul stays cuBLAS's, and a variant whose reference is
        # the textbook op itself (moe_route, sampler, the MoE's) changes nothing.
        without_triton = {"gemv": {"add_rmsnorm_linear"}, "decode_attention": {"decode_attention"}}
        expect = SWAPS[variant] if triton_on else without_triton.get(variant, set())
        assert changed == expect, f"{variant}, triton={triton_on}"
    assert before["decode_attention"] is None and before["add_rmsnorm_linear"].func is nanoengine.add_rmsnorm_then_linear


# -- 2.1 pdl: programmatic dependent launch --------------------------------------------------------------
# Every kernel compiled for an H200 (sm_90) without one: Triton emits PTX on any machine, and only the
# interpreter cannot, hence a subprocess. Each kernels.py kernel is replaced by a stand-in that compiles it
# with the arguments its launcher gives (pdl=True) instead of launching it.
PTX_SCRIPT = r'''
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
import kernels

DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int32: "i32", torch.int64: "i64"}
result = {}


class CompileForH200:
    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return self.compile

    def compile(self, *args, **kwargs):
        fn = self.fn
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "launch_pdl") if k in kwargs}
        values = dict(zip(fn.arg_names, args)) | kwargs
        signature, constexprs = {}, {}
        for p in fn.params:
            v = values[p.name]
            if p.is_constexpr:
                signature[p.name], constexprs[p.name] = "constexpr", v
            elif isinstance(v, torch.Tensor):
                signature[p.name] = "*" + DTYPES[v.dtype]
            else:
                signature[p.name] = "fp32" if isinstance(v, float) else "i32" if -2**31 <= v < 2**31 else "i64"
        src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        vars(kernels).update(ORIGINALS)  # a kernel that calls another (2.1's _pdl ones) compiles that one inline
        try:
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
            result.setdefault(fn.__name__, {})["ptx"] = ptx
        except Exception as e:
            result.setdefault(fn.__name__, {})["error"] = f"{type(e).__name__}: {e}"[-1500:]
        finally:
            vars(kernels).update(STAND_INS)
        result[fn.__name__]["constexprs"] = {k: v for k, v in constexprs.items() if isinstance(v, (bool, int, str))}


ORIGINALS = {name: fn for name, fn in vars(kernels).items()
             if name.endswith("_kernel") and isinstance(fn, triton.runtime.jit.JITFunction)}
STAND_INS = {name: CompileForH200(fn) for name, fn in ORIGINALS.items()}
vars(kernels).update(STAND_INS)
z = lambda *shape, dtype=torch.bfloat16: torch.zeros(*shape, dtype=dtype)
ints = lambda *shape: torch.zeros(*shape, dtype=torch.int64)


def decode_attention(b, hkv, **kw):  # the CPU counts as 1 SM: past 4 programs, RoPE goes apart
    sl = torch.full((b,), 20)
    kernels.decode_attention(z(b, 2 * hkv, 64), z(b, hkv, 64), z(b, hkv, 64), z(9, 16, hkv, 64), z(9, 16, hkv, 64),
                             sl, sl - 1, sl, ints(b, 2).int(), torch.zeros(64, 64), 0.1, z(64), z(64), pdl=True, **kw)


def prefill_attention(programs_per_sm, max_splits=1):  # the CPU counts as 1 SM: 64 programs split the 2 query tiles
    kernels.PREFILL_PROGRAMS_PER_SM, kernels.PREFILL_MAX_SPLITS = programs_per_sm, max_splits
    qsl = torch.tensor([0, 64, 70], dtype=torch.int32)
    kernels.prefill_attention(z(70, 4, 64), z(9, 16, 2, 64), z(9, 16, 2, 64), qsl, ints(2), ints(2, 4).int(), 0.1, 64,
                              pdl=True)


CASES = {
    "add_rmsnorm": lambda: kernels.add_rmsnorm(z(4, 256), z(4, 256), z(256), 1e-6),
    "silu_and_mul": lambda: kernels.silu_and_mul(z(4, 512)),
    "rope_write_kv": lambda: kernels.rope_write_kv(z(3, 4, 64), z(3, 2, 64), z(3, 2, 64), z(5, 16, 2, 64),
                                                   z(5, 16, 2, 64), ints(3), ints(3), torch.zeros(64, 64), z(64),
                                                   z(64)),
    "paged_attention": lambda: kernels.paged_attention(z(5, 4, 64), z(5, 16, 2, 64), z(5, 16, 2, 64),
                                                       torch.tensor([0, 3, 5], dtype=torch.int32), ints(2),
                                                       ints(2, 2).int(), 0.1, 3),
    "fused_moe": lambda: kernels.fused_moe(z(4, 128), z(8, 256, 128), z(8, 128, 128), z(4, 2), ints(4, 2)),
    "add_rmsnorm_pdl": lambda: kernels.add_rmsnorm_pdl(z(4, 256), z(4, 256), z(256), 1e-6, pdl=True),
    "silu_and_mul_pdl": lambda: kernels.silu_and_mul_pdl(z(4, 512), pdl=True),
    "linear": lambda: kernels.linear(z(1, 1024), z(512, 1024), pdl=True),
    "linear_dot": lambda: kernels.linear(z(16, 1024), z(512, 1024), pdl=True),
    "add_rmsnorm_linear": lambda: kernels.add_rmsnorm_linear(z(1, 1024), z(1, 1024), z(1024), 1e-6, z(1024, 1024),
                                                             gated=True, pdl=True),
    "decode_attention": lambda: decode_attention(4, 2, num_splits=1),
    "decode_attention_packed": lambda: decode_attention(128, 4, num_splits=1, max_seq_len=20),
    "decode_attention_split": lambda: decode_attention(5, 1, num_splits=4),
    "decode_attention_rope_inside": lambda: decode_attention(2, 2, num_splits=1),
    "decode_attention_rope_inside_split": lambda: decode_attention(1, 1, num_splits=4),
    "prefill_attention": lambda: prefill_attention(1),
    "prefill_attention_split": lambda: prefill_attention(64, 4),
    "fused_moe_decode": lambda: kernels.fused_moe_decode(z(2, 128), z(8, 256, 128), z(8, 128, 128), z(2, 2),
                                                         ints(2, 2), pdl=True),
    "moe_route": lambda: kernels.moe_route(z(3, 8), 2, True, pdl=True),
    "race_sample": lambda: kernels.race_sample(z(2, 20000), torch.zeros(2), ints(2), ints(2), pdl=True),
}
for case, launch in CASES.items():
    result = {}
    launch()
    print(json.dumps(dict(case=case, kernels=result)), flush=True)
'''
@pytest.fixture(scope="module")
def h200_ptx():
    """case -> {kernel name -> {"ptx" or "error", "constexprs"}}, from one subprocess."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"CUDA_VISIBLE_DEVICES": "",
                                                                              "PYTHONPATH": HERE}
    r = subprocess.run([sys.executable, "-c", PTX_SCRIPT], env=env, capture_output=True, text=True, cwd=HERE,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return {rec["case"]: rec["kernels"] for rec in map(json.loads, r.stdout.splitlines())}


PART1_CASES = ["add_rmsnorm", "silu_and_mul", "rope_write_kv", "paged_attention", "fused_moe"]  # plain launches
PTX_CASES = PART1_CASES + ["add_rmsnorm_pdl", "silu_and_mul_pdl", "linear", "linear_dot", "add_rmsnorm_linear", "decode_attention", "decode_attention_packed",
                           "decode_attention_split", "decode_attention_rope_inside",
                           "decode_attention_rope_inside_split", "prefill_attention", "prefill_attention_split",
                           "fused_moe_decode", "moe_route", "race_sample"]


@pytest.mark.parametrize("case", PTX_CASES)
def test_kernels_compile_for_sm90_and_wait_before_any_load(h200_ptx, case):
    """Each kernel a launcher starts compiles for an H200, where the compiler is stricter than the CPU's
    interpreter (only tl.constexpr globals, loop-carried variables of one type). Part 1's kernels launch
    plainly: no griddepcontrol in them. Part 2's launch under PDL, where a kernel touches
    no memory before griddepcontrol.wait, since the kernel before may still be writing, but for what no kernel
    writes: linear prefetches its first weight tile into L2 (short rows only), decode attention loads what the
    host staged. Every kernel then lets the next one launch (griddepcontrol.launch_dependents), but decode
    attention: the o matmul after it launches as its programs exit, rather than piled onto the first SMs they
    free (kernels._wait_hold_next)."""
    compiled = h200_ptx[case]
    assert compiled, f"{case}: no kernel launched"
    for name, out in compiled.items():
        assert "error" not in out, f"{name} does not compile for sm_90: {out.get('error')}"
        body = out["ptx"][out["ptx"].index(".entry"):]
        if name in _part1_kernels():
            assert "griddepcontrol" not in body, f"{name}: a Part 1 kernel with PDL in it"
            continue
        wait = body.find("griddepcontrol.wait")
        assert wait >= 0, f"{name} never waits for its inputs"
        early = [line.strip() for line in body[:wait].splitlines()
                 if re.search(r"\b(ld\.global|ld\.shared|prefetch|st\.global|atom|cp\.async)", line)]
        allowed = {"_linear_kernel": "prefetch.global.L2", "_decode_attention_kernel": "ld.global"}.get(name)
        assert all(allowed and allowed in line for line in early), \
            f"{name} touches memory before griddepcontrol.wait: {early[:3]}"
        if case in ("linear", "decode_attention_rope_inside"):  # the early loads are there, not lost to a refactor
            assert early, f"{name} loads nothing before griddepcontrol.wait"
        releases = "griddepcontrol.launch_dependents" in body[wait:]
        assert releases == (name != "_decode_attention_kernel"), name
        assert "griddepcontrol.launch_dependents" not in body[:wait], f"{name} releases the next kernel before it waits"
    if case.startswith("decode_attention"):  # the launch took the path the case names
        c = compiled["_decode_attention_kernel"]["constexprs"]
        assert (c["PACK_SHIFT"] > 0, c["SPLIT"], c["ROPE"]) == ("packed" in case, "split" in case, "rope" in case), c
        assert ("_rope_write_kv_pdl_kernel" in compiled) == (not c["ROPE"]), list(compiled)  # RoPE apart: in the chain
    if case.startswith("prefill_attention"):
        assert compiled["_prefill_attention_kernel"]["constexprs"]["SPLIT"] == ("split" in case)


def _part1_kernels() -> set[str]:
    part2 = next(i for i, line in enumerate(open(kernels.__file__), 1) if line.startswith("# Part 2"))
    return {fn.name for fn in _jit_functions()[1] if fn.lineno < part2}


def _jit_functions():
    tree = ast.parse(open(kernels.__file__).read())
    return tree, [fn for fn in tree.body if isinstance(fn, ast.FunctionDef)
                  and any("jit" in ast.unparse(d) for d in fn.decorator_list)]


@pytest.mark.parametrize("name", [fn.name for fn in _jit_functions()[1]])
def test_jit_functions_read_only_constexpr_globals(name):
    """The interpreter lets a kernel read any module global; the GPU compiler refuses all but tl.constexpr
    ones. Caught here, where only the interpreter runs, with the name of what to pass as an argument."""
    tree, functions = _jit_functions()
    assigns = [n for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))]
    targets = lambda n: n.targets if isinstance(n, ast.Assign) else [n.target]  # noqa: E731
    plain = {t.id for n in assigns for t in targets(n)
             if isinstance(t, ast.Name) and "constexpr" not in ast.unparse(n.value)}
    fn = next(f for f in functions if f.name == name)
    read = {x.id for x in ast.walk(fn) if isinstance(x, ast.Name)}
    assert not read & plain, f"{fn.name} reads non-constexpr globals {read & plain}: pass them as arguments"


def test_kernel_every_kernel_waits_for_its_inputs():
    """A kernel launched with launch_pdl must wait before it reads what the kernel before wrote: every
    Part 2 kernel takes PDL (Part 1's none), and its first statement is _wait_for_inputs(PDL) (decode attention's
    _wait_hold_next(PDL) waits without releasing the next kernel early). Two read before it only what no
    kernel writes: linear prefetches its weight into L2, decode attention loads what the host staged."""
    staged = {"_linear_kernel": set(), "_decode_attention_kernel": {"seq_lens_ptr", "positions_ptr",
                                                                     "slot_mapping_ptr", "cos_sin_ptr"}}
    _, functions = _jit_functions()
    part1 = _part1_kernels()
    kernels_found = [fn for fn in functions if fn.name.endswith("_kernel") and fn.name not in part1]
    assert len(kernels_found) >= 6 and len(part1) >= 6
    for fn in functions:
        assert fn.name not in part1 or "PDL" not in [a.arg for a in fn.args.args], f"{fn.name}: Part 1 takes no PDL"
    for fn in kernels_found:
        assert "PDL" in [a.arg for a in fn.args.args], fn.name
        docstring = isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant)
        body = fn.body[1:] if docstring else fn.body
        want = "_wait_hold_next(PDL)" if fn.name == "_decode_attention_kernel" else "_wait_for_inputs(PDL)"
        wait = next(i for i, stmt in enumerate(body) if ast.unparse(stmt) == want)
        assert wait == 0 or fn.name in staged, f"{fn.name} starts with {ast.unparse(body[0])!r}, not {want}"
        early = [n for stmt in body[:wait] for n in ast.walk(stmt) if isinstance(n, ast.Call)]
        loaded = {n.id for c in early if ast.unparse(c.func) == "tl.load" for n in ast.walk(c.args[0])
                  if isinstance(n, ast.Name) and n.id.endswith("_ptr")}
        assert loaded <= staged.get(fn.name, set()), f"{fn.name} loads {loaded} before it waits"
        names = [ast.unparse(c.func) for c in early]
        assert not [f for f in names if f.startswith(("tl.store", "tl.atomic"))], f"{fn.name} writes before it waits"
        prefetched = [ast.unparse(c.args[0]) for c in early if ast.unparse(c.func) == "_prefetch_l2"]
        assert prefetched == (["weight_ptr"] if fn.name == "_linear_kernel" else []), (fn.name, prefetched)
        calls = [n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
        assert calls.count("_wait_for_inputs") + calls.count("_wait_hold_next") == 1, fn.name
    assert kernels._launch_options(True) == dict(PDL=True, launch_pdl=True)
    assert kernels._launch_options(False) == dict(PDL=False) and not kernels.has_pdl(torch.device("cpu"))


@needs_cuda
@pytest.mark.parametrize("rows", [1, 4])  # linear's FMA path and its tl.dot path
def test_kernel_gpu_pdl_chain_in_graph_matches_plain_launches(rows):
    """80 kernels, each reading what the one before it wrote at once, replayed from a CUDA graph with
    programmatic dependent launch: a kernel that started before its predecessor's writes were visible
    would read stale rows, so the result must equal, bit for bit, the same chain launched plainly."""
    if not kernels.has_pdl(CUDA_DEVICE):
        pytest.skip("programmatic dependent launch needs sm_90 or later")
    hidden = 2048
    w = (_randn(hidden, hidden, seed=70, device="cuda") * hidden**-0.5).to(BF16)
    g = (1 + 0.1 * _randn(hidden, seed=71, device="cuda")).to(BF16)
    x0 = _randn(rows, hidden, seed=72, device="cuda", dtype=BF16)

    def chain(x, residual, pdl):
        for _ in range(40):  # one row: add + norm inside the matmul; four: Part 1's add_rmsnorm, then linear
            x, residual = kernels.add_rmsnorm_linear(x, residual, g, 1e-6, w, pdl=pdl)
        return x, residual

    x, residual = x0.clone(), torch.zeros_like(x0)
    chain(x.clone(), residual.clone(), True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, out_residual = chain(x, residual, True)
    graph.replay()
    ref, ref_residual = chain(x0.clone(), torch.zeros_like(x0), False)
    torch.cuda.synchronize()
    assert torch.equal(out, ref) and torch.equal(out_residual, ref_residual)


@needs_cuda
@pytest.mark.parametrize("requests,rows", [(1, None), (16, None), (40, 16)])
def test_gpu_tuned_decode_steps_launch_every_triton_kernel_in_the_pdl_chain(requests, rows):
    """One plain launch in a PDL chain stalls it on both sides, so every Triton kernel of a tuned decode step takes
    PDL, Part 1's that the tuned ops still call too (2.1's _pdl launchers): one row (the add + norm in the matmul),
    16 (add_rmsnorm, then tl.dot tiles), 40 past a 16-row limit (cuBLAS, then silu_and_mul). Same tokens as -pdl."""
    if not kernels.has_pdl(CUDA_DEVICE):
        pytest.skip("programmatic dependent launch needs sm_90 or later")
    prompts, jit = mixed_prompts(requests, 4096, seed=41, lengths=(5, 17, 9)), triton.runtime.jit.JITFunction
    plain_run, launched, tokens = jit.run, [], []

    def spy(self, *args, **kwargs):
        launched.append((self.fn.__name__, kwargs.get("PDL", False)))
        return plain_run(self, *args, **kwargs)

    for tuned in (True, "-pdl"):
        engine = nanoengine.Engine(model="tiny", tuned=tuned, enforce_eager=True, triton_linear_rows=rows,
                                   triton_narrow_rows=rows, **GPU)
        ids = [engine.add_request(p, greedy(8)) for p in prompts]
        # step 1 takes every prompt; step 2, a decode step, is watched
        watch = lambda n: setattr(jit, "run", spy if n == 1 and tuned is True else plain_run)  # noqa: E731
        try:
            streams = drive(engine, after_step=watch)
        finally:
            jit.run = plain_run
        tokens.append([streams[i][-1].token_ids for i in ids])
        engine.close()
    assert launched and not [name for name, pdl in launched if not pdl], launched
    assert tokens[0] == tokens[1]


# -- 2.2 linear: the decode-sized matmul, with add_rmsnorm in its prologue and silu_and_mul in its epilogue


# M = 1: the FMA path; 3 and 16: tl.dot with rows padded to 16; 40 and 130 (short rows, so the row block
# may grow, then narrows to leave programs): the last block ragged. (70, 200): N and K both ragged against
# every block size; (64, 512): whole blocks; (37, 600): a ragged tail.
@pytest.mark.parametrize("m", [1, 3, 16, 40, 130])
@pytest.mark.parametrize("n,k", [(70, 200), (64, 512), (37, 600)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_linear_matches_ref(monkeypatch, m, n, k, with_bias):
    # 1 KB tiles give the FMA path (BLOCK_N 1 at these N) K steps of 256: one ragged step at K = 200, two at
    # 512, three at 600 (ragged); and the tl.dot path (BLOCK_N 16) steps of 16.
    monkeypatch.setattr(kernels, "LINEAR_TILE_BYTES", 1024)
    _poison_empty(monkeypatch)
    x, w = _randn(m, k, seed=1), _randn(n, k, seed=2)
    bias = _randn(n, seed=3) if with_bias else None
    blocks = kernels.linear_blocks(m, n, k, 4)
    assert blocks[3] == (m > 1) and (m > 1 or blocks[2] == 256)
    out = kernels.linear(x, w, bias)
    assert out.shape == (m, n) and out.dtype == x.dtype
    torch.testing.assert_close(out, kernels.linear_ref(x, w, bias), **LINEAR_TOL)


def test_kernel_linear_long_rows_take_blocks_of_32(monkeypatch):
    """K >= LINEAR_LONG_K caps the row block at LINEAR_DOT_MAX_BLOCK_M: 40 rows are two blocks of 32, the
    second ragged, each reading the weight tile (the second from L2 on the GPU)."""
    monkeypatch.setattr(kernels, "LINEAR_TILE_BYTES", 4096)
    _poison_empty(monkeypatch)
    m, n, k = 40, 37, kernels.LINEAR_LONG_K + 52
    assert kernels.linear_blocks(m, n, k, 4)[0] == kernels.LINEAR_DOT_MAX_BLOCK_M == 32
    assert kernels.linear_blocks(128, 8192, kernels.LINEAR_LONG_K - 1, 4)[0] == 128, "short rows: blocks of 128"
    assert kernels.linear_blocks(128, 8192, kernels.LINEAR_LONG_K, 4)[0] == 32
    x, w = _randn(m, k, seed=4), _randn(n, k, seed=5) * k**-0.5
    torch.testing.assert_close(kernels.linear(x, w), kernels.linear_ref(x, w), **LINEAR_TOL)


@pytest.mark.parametrize("m", [1, 3, 40])
@pytest.mark.parametrize("norm", [False, True])
def test_kernel_linear_gated(monkeypatch, m, norm):
    """The MLP's gate/up matmul with silu(gate) * up made as it stores (the FMA path at one row, tl.dot
    otherwise; with the add+norm made as it loads at one row): the plain kernel followed by silu_and_mul,
    and the references; past max_rows, F.linear and silu_and_mul."""
    monkeypatch.setattr(kernels, "LINEAR_TILE_BYTES", 4096)
    monkeypatch.setattr(kernels, "LINEAR_NORM_MIN_BLOCK_N", 2)
    _poison_empty(monkeypatch)
    inter, k = 37, 200  # ragged against every tile: a program's last outputs are masked in both halves
    x, w, bias = _randn(m, k, seed=17), _randn(2 * inter, k, seed=18) * k**-0.5, _randn(2 * inter, seed=19)
    if norm:
        residual, g = _randn(m, k, seed=20), 1 + 0.1 * _randn(k, seed=21)
        out, new_residual = kernels.add_rmsnorm_linear(x, residual.clone(), g, 1e-6, w, bias, gated=True)
        plain, plain_residual = kernels.add_rmsnorm_linear(x, residual.clone(), g, 1e-6, w, bias)
        ref, ref_residual = kernels.add_rmsnorm_linear_ref(x, residual.clone(), g, 1e-6, w, bias, gated=True)
        assert torch.equal(new_residual, plain_residual)
    else:
        out, plain = kernels.linear(x, w, bias, gated=True), kernels.linear(x, w, bias)
        ref = kernels.linear_ref(x, w, bias, gated=True)
        torch.testing.assert_close(kernels.linear(x, w, bias, max_rows=0, gated=True), ref, **LINEAR_TOL)
    assert out.shape == (m, inter)
    # Not bit for bit: in float32, rounding gate and up to the output's dtype (what makes the bits those of
    # the two kernels in bf16, checked on the GPU by test_kernel_gpu_linear_gated_bf16) changes nothing,
    # and a fused tile holds gate and up rows where the plain one holds neighbours, which the interpreter's
    # np.matmul may round differently: the K-term sums' budget, as against the reference.
    torch.testing.assert_close(out, kernels.silu_and_mul(plain), **LINEAR_TOL)
    torch.testing.assert_close(out, ref, **LINEAR_TOL)
    with pytest.raises(ValueError, match="gated"):
        kernels.linear(x, w[1:], gated=True)  # [gate; up] has an even row count


def test_kernel_linear_writes_into_out():
    """out= (a graph's static logits buffer): the Triton kernel and cuBLAS (torch.mm out=) both write the
    result into it and return it, with a bias too; and so does the textbook path's nanoengine.linear."""
    x, w, bias = _randn(3, 64, seed=22), _randn(40, 64, seed=23), _randn(40, seed=24)
    for max_rows, b in ((256, None), (0, None), (0, bias), (256, bias)):  # Triton, cuBLAS (mm, then F.linear)
        out = torch.full((3, 40), float("nan"), device=DEVICE)
        got = kernels.linear(x, w, b, max_rows=max_rows, out=out)
        assert got.data_ptr() == out.data_ptr() and got.shape == (3, 40)
        torch.testing.assert_close(out, kernels.linear_ref(x, w, b), **LINEAR_TOL)
    for b in (None, bias):
        out = torch.full((3, 40), float("nan"), device=DEVICE)
        assert nanoengine.linear(x, w, b, out=out).data_ptr() == out.data_ptr()
        torch.testing.assert_close(out, kernels.linear_ref(x, w, b), **LINEAR_TOL)


# add_rmsnorm_linear: the pre-norm add and RMSNorm inside the matmul after them, at one row (several
# programs, program 0 writing the residual); more rows take add_rmsnorm and linear.
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("first_layer", [False, True])
def test_kernel_add_rmsnorm_linear_matches_ref(monkeypatch, m, first_layer):
    monkeypatch.setattr(kernels, "LINEAR_TILE_BYTES", 4096)
    monkeypatch.setattr(kernels, "LINEAR_NORM_MIN_BLOCK_N", 1)  # 70 weight rows: one a program, the norm inside
    _poison_empty(monkeypatch)
    k, n = 600, 70
    x, w, bias = _randn(m, k, seed=50), _randn(n, k, seed=51) * k**-0.5, _randn(n, seed=52)
    g = 1 + 0.1 * _randn(k, seed=53)
    residual = None if first_layer else _randn(m, k, seed=54)
    kept = None if first_layer else residual.clone()
    launches, launch, signature = [], kernels._launch_linear, inspect.signature(kernels._launch_linear)
    monkeypatch.setattr(kernels, "_launch_linear",
                        lambda *a, **kw: launches.append(signature.bind(*a, **kw).arguments) or launch(*a, **kw))
    out, new_residual = kernels.add_rmsnorm_linear(x, residual, g, 1e-6, w, bias)
    assert [args.get("norm_weight") is not None for args in launches] == [m == 1], "the norm inside at one row only"
    ref_out, ref_residual = kernels.add_rmsnorm_linear_ref(x, None if first_layer else kept.clone(), g, 1e-6, w,
                                                          bias)
    assert torch.equal(new_residual, ref_residual), "the residual stream, rounded as add_rmsnorm rounds it"
    assert first_layer or m > 1 or torch.equal(residual, kept), "the kernel leaves its input residual alone"
    torch.testing.assert_close(out, ref_out, **LINEAR_TOL)
    # above max_rows: add_rmsnorm (in place) and then the plain path
    out2, residual2 = kernels.add_rmsnorm_linear(x, None if first_layer else kept.clone(), g, 1e-6, w, bias,
                                                 max_rows=0)
    torch.testing.assert_close(out2, ref_out, **LINEAR_TOL)
    assert torch.equal(residual2, ref_residual)


def test_kernel_add_rmsnorm_linear_norm_at_activation_magnitudes(monkeypatch):
    """The norm made inside the one-row matmul, on rows at 1e-3, 1 and 1e2 (NORM_SCALES): the outputs are
    unit-scale at each, so LINEAR_TOL is relative to them."""
    monkeypatch.setattr(kernels, "LINEAR_NORM_MIN_BLOCK_N", 1)
    k, n = 64, 32
    assert kernels.linear_blocks(1, n, k, 4)[1] >= kernels.LINEAR_NORM_MIN_BLOCK_N, "the norm inside"
    w, g = _randn(n, k, seed=100) * k**-0.5, 1 + 0.1 * _randn(k, seed=101)
    x, residual = _rows_at_scales(3, k, seed=102), _rows_at_scales(3, k, seed=103)
    for i in range(3):
        out, new_residual = kernels.add_rmsnorm_linear(x[i:i + 1], residual[i:i + 1].clone(), g, NORM_EPS, w)
        ref, ref_residual = kernels.add_rmsnorm_linear_ref(x[i:i + 1], residual[i:i + 1].clone(), g, NORM_EPS, w)
        assert torch.equal(new_residual, ref_residual), f"scale {NORM_SCALES[i]}"
        torch.testing.assert_close(out, ref, **LINEAR_TOL, msg=lambda m: f"scale {NORM_SCALES[i]}: {m}")


def test_kernel_add_rmsnorm_linear_keeps_the_norm_apart_on_narrow_tiles():
    """Tiles of fewer than LINEAR_NORM_MIN_BLOCK_N weight rows (K = 2048's long-row tiles, or a short matrix)
    would re-read the row in every program for too few rows: add_rmsnorm (in place) and the plain kernel,
    same results."""
    for k, n in ((kernels.LINEAR_LONG_K, 8), (64, 40)):
        x, w, g = _randn(1, k, seed=62), _randn(n, k, seed=63) * k**-0.5, 1 + 0.1 * _randn(k, seed=64)
        residual = _randn(1, k, seed=65)
        assert kernels.linear_blocks(1, n, k, 4)[1] < kernels.LINEAR_NORM_MIN_BLOCK_N
        ref_out, ref_residual = kernels.add_rmsnorm_linear_ref(x, residual.clone(), g, 1e-6, w)
        out, new_residual = kernels.add_rmsnorm_linear(x, residual, g, 1e-6, w)
        assert new_residual is residual and torch.equal(residual, ref_residual)  # add_rmsnorm's in-place sum
        torch.testing.assert_close(out, ref_out, **LINEAR_TOL)


def test_kernel_add_rmsnorm_linear_bad_input():
    x, w, g = _randn(2, 64, seed=59), _randn(8, 64, seed=60), torch.ones(64, device=DEVICE)
    with pytest.raises(ValueError, match="residual must be contiguous"):
        kernels.add_rmsnorm_linear(x, _randn(3, 64, seed=61), g, 1e-6, w)
    with pytest.raises(ValueError, match="residual must be contiguous .* dtype torch.float32, got .* torch.float64"):
        kernels.add_rmsnorm_linear(x, x.double(), g, 1e-6, w)
    with pytest.raises(ValueError, match=r"shape \(64,\)"):
        kernels.add_rmsnorm_linear(x, None, torch.ones(32, device=DEVICE), 1e-6, w)
    with pytest.raises(ValueError, match="contiguous weight"):
        kernels.add_rmsnorm_linear(x, None, g, 1e-6, w.t().contiguous().t())


def test_kernel_add_rmsnorm_linear_checks_its_inputs_on_the_one_launch_path(monkeypatch):
    """The one-launch path (one row, tiles of at least LINEAR_NORM_MIN_BLOCK_N weight rows) refuses what the
    two-launch path refuses (add_rmsnorm's checks): a residual or norm weight shorter than K would be read
    past its end, a residual of another dtype read as if it were x's."""
    monkeypatch.setattr(kernels, "LINEAR_NORM_MIN_BLOCK_N", 1)  # 64 weight rows, one a program: one launch
    x, w, g = _randn(1, 64, seed=66), _randn(64, 64, seed=67), torch.ones(64, device=DEVICE)
    launches = spy(monkeypatch, "_linear_kernel").launches
    with pytest.raises(ValueError, match=r"shape \(64,\)"):
        kernels.add_rmsnorm_linear(x, None, torch.ones(32, device=DEVICE), 1e-6, w)
    with pytest.raises(ValueError, match="residual must be contiguous"):
        kernels.add_rmsnorm_linear(x, _randn(1, 32, seed=68), g, 1e-6, w)
    with pytest.raises(ValueError, match="residual must be contiguous .* dtype torch.float32, got .* torch.float64"):
        kernels.add_rmsnorm_linear(x, _randn(1, 64, seed=68).double(), g, 1e-6, w)
    assert not launches
    kernels.add_rmsnorm_linear(x, _randn(1, 64, seed=68), g, 1e-6, w)
    assert [launch.NORM for launch in launches] == [True], "the inputs above were refused on the one-launch path"


def test_kernel_linear_default_blocks_small_n():
    # Unpatched sizes: N = 70 at M = 1 gets BLOCK_N 1 (70 programs), the path a short matrix takes.
    x, w, bias = _randn(1, 200, seed=4), _randn(70, 200, seed=5), _randn(70, seed=6)
    assert kernels.linear_blocks(1, 70, 200, 4)[1] == 1
    torch.testing.assert_close(kernels.linear(x, w, bias), kernels.linear_ref(x, w, bias), **LINEAR_TOL)


def test_kernel_linear_strided_rows_and_leading_dims(monkeypatch):
    monkeypatch.setattr(kernels, "LINEAR_TILE_BYTES", 4096)
    wide = _randn(3, 300, seed=7)
    x = wide[:, :200]  # rows 300 apart: handled through the row stride, no copy
    w = _randn(40, 200, seed=8)
    torch.testing.assert_close(kernels.linear(x, w), kernels.linear_ref(x, w), **LINEAR_TOL)
    x3 = _randn(2, 3, 200, seed=9)  # [B, T, K] -> [B, T, N], 6 rows
    out = kernels.linear(x3, w)
    assert out.shape == (2, 3, 40)
    torch.testing.assert_close(out, kernels.linear_ref(x3, w), **LINEAR_TOL)
    with pytest.raises(ValueError, match="contiguous last dim"):
        kernels.linear(_randn(200, 3, seed=10).t(), w)  # strided K: rejected, not silently copied
    with pytest.raises(ValueError, match="contiguous weight"):
        kernels.linear(x, w.t().contiguous().t())
    with pytest.raises(ValueError, match="bias"):
        kernels.linear(x, w, _randn(41, seed=11))
    with pytest.raises(ValueError, match="share a dtype"):
        kernels.linear(x, w.double())


def test_kernel_linear_above_max_m_falls_back_to_f_linear():
    m = kernels.LINEAR_MAX_M + 1
    x, w, bias = _randn(m, 200, seed=12), _randn(70, 200, seed=13), _randn(70, seed=14)
    assert torch.equal(kernels.linear(x, w, bias), F.linear(x, w, bias))
    assert torch.equal(kernels.linear(x[:2], w, bias, max_rows=1), F.linear(x[:2], w, bias))  # the engine's cap


def test_triton_linear_rows_setting():
    """triton_linear_rows / triton_narrow_rows stay None unless given: the defaults by model are decided in
    tuned_ops (on the CPU, or a Triton interpreter, no Triton matmul), and a given value means what it says."""
    mcfg = nanoengine.ModelConfig.from_hf(nanoengine.PRESETS["tiny"])
    cfg = nanoengine.EngineConfig(device="cpu", triton=True, tuned=True)
    assert cfg.triton_linear_rows is None and cfg.triton_narrow_rows is None
    keywords = lambda cfg: nanoengine.tuned_ops(nanoengine.textbook_ops(True), cfg, mcfg).linear.keywords  # noqa
    assert keywords(cfg) == {"max_rows": 0, "narrow_rows": 0, "pdl": False}
    given = nanoengine.EngineConfig(device="cpu", triton=True, tuned=True, triton_linear_rows=16, triton_narrow_rows=32)
    assert keywords(given) == {"max_rows": 16, "narrow_rows": 32, "pdl": False}


def test_kernel_linear_keeps_narrow_weights_past_max_rows(monkeypatch):
    """narrow_rows: a weight of at most LINEAR_NARROW_N outputs stays on the Triton kernel up to that many
    rows; a wider one goes to F.linear past max_rows."""
    calls = []
    f_linear = F.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: calls.append(a[1].shape[0]) or f_linear(*a))
    x = _randn(3, 32, seed=17)
    narrow, wide = _randn(64, 32, seed=18), _randn(kernels.LINEAR_NARROW_N + 1, 32, seed=19)
    out = kernels.linear(x, narrow, max_rows=1, narrow_rows=3)
    assert calls == [] and out.shape == (3, 64)
    torch.testing.assert_close(out, x @ narrow.T, **LINEAR_TOL)
    kernels.linear(x, narrow, max_rows=1, narrow_rows=2)  # more rows than either cap
    kernels.linear(x, wide, max_rows=1, narrow_rows=3)
    assert calls == [64, kernels.LINEAR_NARROW_N + 1]


@needs_cuda
def test_gpu_triton_linear_rows_default():
    """On CUDA the Triton matmul takes up to 64 rows on a small model (hidden size <= 1024), its narrow
    matrices up to 256, and one row on a bigger one; a given value means what it says, narrow rows then 0."""
    pdl = kernels.has_pdl(CUDA_DEVICE)
    linear = lambda cfg: nanoengine.build_model(cfg)[0].ops.linear.keywords  # noqa: E731
    assert linear(nanoengine.EngineConfig(model="tiny", device="cuda", tuned=True)) == \
        {"max_rows": 64, "narrow_rows": kernels.LINEAR_MAX_M, "pdl": pdl}
    big = nanoengine.EngineConfig(model="llama-3.2-1b", device="cuda", tuned=True)
    assert linear(big) == {"max_rows": 1, "narrow_rows": 0, "pdl": pdl}
    assert big.triton_linear_rows is None and big.triton_narrow_rows is None, "decided in tuned_ops, once"
    given = nanoengine.EngineConfig(model="tiny", device="cuda", tuned=True, triton_linear_rows=16)
    assert linear(given) == {"max_rows": 16, "narrow_rows": 0, "pdl": pdl}


def test_kernel_linear_empty():
    w = _randn(70, 200, seed=15)
    assert kernels.linear(_randn(0, 200, seed=16), w).shape == (0, 70)


# Every shape the brief targets: enough programs for the SMs, and tiles that fill the tile budget.
SHAPES = {  # name: (K, N)
    "qwen3_0.6b_qkv": (1024, 4096), "qwen3_0.6b_o": (2048, 1024), "qwen3_0.6b_gate_up": (1024, 6144),
    "qwen3_0.6b_down": (3072, 1024), "qwen3_0.6b_lm_head": (1024, 151936),
    "llama3.2_1b_qkv": (2048, 3072), "llama3.2_1b_o": (2048, 2048), "llama3.2_1b_gate_up": (2048, 16384),
    "llama3.2_1b_down": (8192, 2048), "llama3.2_1b_lm_head": (2048, 128256),
    "llama3_8b_qkv": (4096, 6144), "llama3_8b_o": (4096, 4096), "llama3_8b_gate_up": (4096, 28672),
    "llama3_8b_down": (14336, 4096),
}
DOT_PROGRAMS = 96  # linear_blocks narrows tl.dot tiles until this many programs (3/4 of the SMs) ...
FMA_PROGRAMS = 256  # ... and one-row tiles until this many (two an SM)


@pytest.mark.parametrize("m", [1, 2, 16, 64, 256])
def test_kernel_linear_block_choice(m):
    for name, (k, n) in SHAPES.items():
        for gated in (False, True):
            block_m, block_n, block_k, use_dot, num_warps, stages = kernels.linear_blocks(m, n, k, 2, gated)
            programs = -(-n // block_n) * -(-m // block_m)
            assert use_dot == (m > 1), name
            long_rows = not use_dot and k % kernels.LINEAR_LONG_K == 0  # e.g. Llama's K = 2048, 8192
            if use_dot:  # rows pad to a power of two from 16, capped by the row length ...
                cap = kernels.LINEAR_DOT_MAX_BLOCK_M if k >= kernels.LINEAR_LONG_K else 128
                widest = min(max(16, 1 << (m - 1).bit_length()), cap)
                assert block_m <= widest and block_m & (block_m - 1) == 0, name
                # ... and narrow (the row block, not below LINEAR_DOT_MAX_BLOCK_M, then the tile, not below
                # 16) only while the grid has fewer than DOT_PROGRAMS programs
                leaves = lambda bm, bn: -(-n // bn) * -(-m // bm) >= DOT_PROGRAMS  # noqa: E731
                assert block_m == widest or not leaves(2 * block_m, 64), name
                assert block_m >= min(widest, kernels.LINEAR_DOT_MAX_BLOCK_M), name
                assert block_n == 64 or (block_n >= 16 and not leaves(block_m, 2 * block_n)), name
                # the pipeline is 5 stages deep while the stages' tiles fit 120 KB of shared memory, else 4
                assert stages == (5 if (block_m + block_n) * block_k * 2 * 5 <= 120 * 1024 else 4), name
                assert num_warps == 4, name
            else:
                assert block_m == 1 and stages == 3, name
                assert programs >= FMA_PROGRAMS or block_n == 1 + gated, name  # the narrowest BLOCK_N allowed
                assert num_warps == (4 if long_rows else 8), name
                assert block_k == kernels.LINEAR_LONG_K or not long_rows, name
            # the weight's tile [BLOCK_N, BLOCK_K] fills the budget (x's [BLOCK_K, BLOCK_M] may be larger)
            assert block_n * block_k * 2 == kernels.LINEAR_TILE_BYTES or block_k >= k or long_rows, name
            assert not gated or block_n % 2 == 0, "gated tiles hold gate and up rows in halves"


def test_kernel_linear_tiles_at_256_rows():
    """The sweep's best tiles at 256 rows of Qwen3-0.6B (2026-12-02): q/k/v 128 x 64 x 128 (x's tile wider
    than the weight's) in 4 stages, o and down 32 x 64 x 128 in 5."""
    for name, want in [("qwen3_0.6b_qkv", (128, 64, 128, 4)), ("qwen3_0.6b_o", (32, 64, 128, 5)),
                       ("qwen3_0.6b_down", (32, 64, 128, 5))]:
        k, n = SHAPES[name]
        blocks = kernels.linear_blocks(256, n, k, 2)
        assert (*blocks[:3], blocks[5]) == want, name


@needs_cuda
@pytest.mark.parametrize("m", [1, 16, 40, 64])  # 40: a ragged row block (of 64 on K = 1024, of 32 beyond)
@pytest.mark.parametrize("name", list(SHAPES))
def test_kernel_gpu_linear_bf16_real_shapes(name, m):
    k, n = SHAPES[name]
    x = _randn(m, k, seed=40, device="cuda", dtype=torch.bfloat16)
    w = (_randn(n, k, seed=41, device="cuda") * k**-0.5).to(torch.bfloat16)  # outputs ~ N(0, 1)
    bias = _randn(n, seed=42, device="cuda", dtype=torch.bfloat16) if "qkv" in name else None
    out = kernels.linear(x, w, bias)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.linear(x, w, bias), **BF16_LINEAR_TOL)


@needs_cuda
@pytest.mark.parametrize("m", [1, 16, 64, 256])
def test_kernel_gpu_linear_gated_bf16(m):
    """At Qwen3-0.6B's gate/up shape in bf16, on the Triton tiles (linear's default max_rows takes 256): the
    same bits as the plain kernel and silu_and_mul."""
    k, n = SHAPES["qwen3_0.6b_gate_up"]
    x = _randn(m, k, seed=47, device="cuda", dtype=torch.bfloat16)
    w = (_randn(n, k, seed=48, device="cuda") * k**-0.5).to(torch.bfloat16)
    out = kernels.linear(x, w, gated=True)
    assert torch.equal(out, kernels.silu_and_mul(kernels.linear(x, w)))
    torch.testing.assert_close(out, kernels.linear_ref(x, w, gated=True), **BF16_LINEAR_TOL)


@needs_cuda
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("name", ["qwen3_0.6b_qkv", "qwen3_0.6b_gate_up", "llama3_8b_qkv"])
def test_kernel_gpu_add_rmsnorm_linear_bf16(name, m):
    k, n = SHAPES[name]
    x = _randn(m, k, seed=55, device="cuda", dtype=torch.bfloat16)
    residual = _randn(m, k, seed=56, device="cuda", dtype=torch.bfloat16) * 4
    g = (1 + 0.1 * _randn(k, seed=57, device="cuda")).to(torch.bfloat16)
    w = (_randn(n, k, seed=58, device="cuda") * k**-0.5).to(torch.bfloat16)
    ref_out, ref_residual = kernels.add_rmsnorm_linear_ref(x, residual.clone(), g, 1e-6, w)
    out, new_residual = kernels.add_rmsnorm_linear(x, residual, g, 1e-6, w)  # may overwrite residual
    assert torch.equal(new_residual, ref_residual)
    torch.testing.assert_close(out, ref_out, **BF16_LINEAR_TOL)


@needs_cuda
def test_kernel_gpu_linear_no_host_sync():
    x16 = _randn(16, 1024, seed=43, device="cuda", dtype=torch.bfloat16)
    x17 = _randn(17, 1024, seed=44, device="cuda", dtype=torch.bfloat16)
    w = _randn(4096, 1024, seed=45, device="cuda", dtype=torch.bfloat16)
    bias = _randn(4096, seed=46, device="cuda", dtype=torch.bfloat16)
    kernels.linear(x16[:1], w, bias), kernels.linear(x16, w)  # compile outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kernels.linear(x16[:1], w, bias)
        kernels.linear(x16, w)
        kernels.linear(x17, w, bias, max_rows=16)  # the F.linear fallback
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


# -- 2.3 decode_attention: rope_write_kv + paged_attention at decode, in one launch, split-KV, packed heads


def _decode_case(seq_lens, h, hkv, d, page, seed, max_blocks=None):
    """A decode batch (one new token a request, at position seq_len - 1) over NaN-guarded caches
    (_attention_case); its new key and value as strided views, as the model makes them, and the new
    token's slot holding NaN beforehand, so a kernel that read it back (rather than using the key from
    registers) or counted it twice would show."""
    b = len(seq_lens)
    max_blocks = max_blocks or max(1, -(-max(seq_lens) // page))
    q, (k_cache, v_cache, _, sl, bt) = _attention_case([1] * b, seq_lens, h, hkv, d, page, max_blocks, seed=seed)
    kv = _randn(b, 2 * hkv * d, seed=seed + 1)
    k, v = kv[:, : hkv * d].view(b, hkv, d), kv[:, hkv * d:].view(b, hkv, d)
    slots = torch.tensor([int(bt[r, (s - 1) // page]) * page + (s - 1) % page if s else -1
                          for r, s in enumerate(seq_lens)], device=DEVICE)
    for r in range(b):
        if seq_lens[r]:
            k_cache.view(-1, hkv, d)[slots[r]] = v_cache.view(-1, hkv, d)[slots[r]] = float("nan")
    return SimpleNamespace(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, slots=slots,
                           positions=(sl.long() - 1).clamp(min=0), seq_lens=sl, block_table=bt,
                           cos_sin=_randn(max(seq_lens) + 1, d, seed=seed + 2), scale=d**-0.5)


def _check_decode_attention(monkeypatch, with_norm, h, hkv, seq_lens, one_launch, d=16, page=4, max_blocks=34,
                            seed=31, **kw) -> list:
    """decode_attention against decode_attention_ref (output, both caches, k and v left alone, every ticket
    back at zero). Returns its launches as (RoPE inside the attention kernel, kv heads a program)."""
    monkeypatch.setattr(kernels, "ATTN_PROGRAMS_PER_SM", 1000 if one_launch else 0)  # the interpreter: 1 "SM"
    attention, ropes, real_rope = spy(monkeypatch, "_decode_attention_kernel"), [], kernels.rope_write_kv
    monkeypatch.setattr(kernels, "rope_write_kv", lambda *a, **k_: ropes.append(1) or real_rope(*a, **k_))
    c = _decode_case(seq_lens, h, hkv, d, page, seed, max_blocks)
    norms = (_randn(d, seed=34), _randn(d, seed=35)) if with_norm else (None, None)
    inputs = [t.clone() for t in (c.k, c.v)]
    results = []
    for fn in (partial(kernels.decode_attention, **kw), kernels.decode_attention_ref):
        kc, vc = c.k_cache.clone(), c.v_cache.clone()
        out = fn(c.q.clone(), c.k, c.v, kc, vc, c.slots, c.positions, c.seq_lens, c.block_table, c.cos_sin, c.scale,
                 *norms, eps=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(inputs, (c.k, c.v))), "k and v are left as they were"
        results.append((out, kc[:-1], vc[:-1]))  # all but the scratch block
    (out, kc, vc), (ref, kc_ref, vc_ref) = results
    assert not out.isnan().any()
    for r, s in enumerate(seq_lens):
        if not s:
            assert out[r].abs().max() == 0, "a padding row attends to nothing"
    torch.testing.assert_close(out, ref, **ATTN_TOL)
    torch.testing.assert_close(kc, kc_ref, equal_nan=True, **ATTN_TOL)  # rotated keys: elementwise, well inside
    torch.testing.assert_close(vc, vc_ref, atol=0, rtol=0, equal_nan=True)  # a copy: exact
    assert kernels._tickets(DEVICE).count_nonzero() == 0, "a merging split must reset its counter"
    launches = [(launch.ROPE, 1 << launch.PACK_SHIFT) for launch in attention.launches]
    assert len(ropes) == sum(not rope for rope, _ in launches), "RoPE apart exactly when not inside"
    b = len(seq_lens)
    bad = [torch.cat([t, t[:1]]) for t in (c.q, c.k, c.v)]  # one token more than there are requests
    with pytest.raises(ValueError, match="one token per request"):
        kernels.decode_attention(*bad, c.k_cache, c.v_cache, c.slots, c.positions, c.seq_lens[:b], c.block_table,
                                 c.cos_sin, c.scale, *norms)
    return launches


@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("h,hkv,num_splits", [(4, 2, None), (3, 1, 3), (4, 2, 5)])
@pytest.mark.parametrize("one_launch", [True, False])
def test_kernel_decode_attention(monkeypatch, with_norm, h, hkv, num_splits, one_launch):
    """rope_write_kv then paged_attention, in one launch (or two, for a batch past one wave of programs):
    the same output and caches as the two references."""
    monkeypatch.setattr(kernels, "ATTN_MIN_SPLIT_TOKENS", 1)  # 64-key splits: the long rows use several
    launches = _check_decode_attention(monkeypatch, with_norm, h, hkv, [5, 70, 0, 130, 1], one_launch,
                                       num_splits=num_splits)
    assert launches == [(one_launch, 1)], "RoPE inside while the batch fits a wave of programs, else apart"


@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("programs,heads", [(10, 2), (5, 4)])
@pytest.mark.parametrize("one_launch", [True, False])
def test_kernel_decode_attention_packs_kv_heads_of_short_contexts(monkeypatch, with_norm, programs, heads,
                                                                   one_launch):
    """Given a bound on the contexts of at most ATTN_PACK_MAX_CONTEXT, a batch past ATTN_PACK_PROGRAMS
    programs takes several kv heads a program, each query row masked to its own head's key columns; the
    same output and caches as the references. Without the bound, or past it, one kv head a program."""
    monkeypatch.setattr(kernels, "ATTN_PACK_PROGRAMS", programs)  # 5 requests x 4 kv heads: pack 2 or 4
    monkeypatch.setattr(kernels, "ATTN_PACK_BLOCK_N", 32)  # 8 or 16 keys a tile: several tiles a context
    seq_lens, bound = [5, 70, 0, 128, 1], kernels.ATTN_PACK_MAX_CONTEXT  # a padding row, a new key alone
    assert kernels.decode_pack(5, 4) == heads
    for max_seq_len, packed in ((bound, heads), (None, 1), (bound + 1, 1)):
        launches = _check_decode_attention(monkeypatch, with_norm, 8, 4, seq_lens, one_launch,
                                           max_seq_len=max_seq_len, num_splits=1)
        assert launches == [(one_launch, packed)], f"max_seq_len={max_seq_len}"
    assert kernels.decode_context_bounds(5, 4) == (bound,) and kernels.decode_context_bounds(1, 4) == ()


def test_kernel_decode_attention_norm_at_activation_magnitudes(monkeypatch):
    """decode_attention with RoPE inside normalizes each q and k head itself: request i's at NORM_SCALES[i].
    Its keys, written to the cache, to each head's budget; its output to attention's."""
    h, hkv, d, page, seq_lens = 2, 1, 16, 4, [3, 6, 9]
    b = len(seq_lens)
    launches = spy(monkeypatch, "_decode_attention_kernel").launches
    q, (k_cache, v_cache, _, sl, bt) = _attention_case([1] * b, seq_lens, h, hkv, d, page, 3, seed=94)
    q = q * torch.tensor(NORM_SCALES, device=DEVICE)[:, None, None]
    k, v = _rows_at_scales(b, hkv, d, seed=95), _randn(b, hkv, d, seed=96)
    slots = torch.stack([bt[r, (s - 1) // page].long() * page + (s - 1) % page for r, s in enumerate(seq_lens)])
    cos_sin, norms = _randn(16, d, seed=97), (1 + 0.1 * _randn(d, seed=98), 1 + 0.1 * _randn(d, seed=99))
    results = []
    for fn in (kernels.decode_attention, kernels.decode_attention_ref):
        kc, vc = k_cache.clone(), v_cache.clone()
        out = fn(q.clone(), k, v, kc, vc, slots, sl.long() - 1, sl, bt, cos_sin, d**-0.5, *norms, eps=NORM_EPS)
        results.append((out, kc.view(-1, hkv, d)[slots]))
    assert [(x.ROPE, x.HAS_NORM) for x in launches] == [(True, True)], "the norm made in the attention kernel"
    (out, keys), (ref, ref_keys) = results
    _assert_close_per_row(keys, ref_keys)
    torch.testing.assert_close(out, ref, **ATTN_TOL)


def test_kernel_decode_attention_splits_merge_in_kernel(monkeypatch):
    """The last split to finish merges: calls in a row, each with new data (stale partials or outputs of the
    call before would show), must each be right and leave every ticket counter back at zero."""
    for seed, splits in enumerate((3, 5, 3, 2), start=40):
        launches = _check_decode_attention(monkeypatch, False, 4, 2, [300, 140, 90], True, d=32, page=16,
                                           max_blocks=20, seed=seed, num_splits=splits)
        assert launches == [(True, 1)]


def test_kernel_decode_attention_merges_many_splits(monkeypatch):
    """One 64-key tile per split, merged in a tree of ATTN_MERGE_FAN_IN = 8: contexts of 700 / 130 / 560 /
    1400 / 1024 keys (the new one aside) use 11 (groups of 8 + 3), 3 (one group), 9 (8 + a lone split), 22
    (8 + 8 + 6) and 16 (8 + 8) splits. A merge that stopped early, skipped a partial or a group, or let a lone
    split's partial be overwritten shows; every ticket counter must be back at zero. The interpreter runs
    programs in grid order, so the highest split always merges here; the bf16 GPU test runs a 64-split tree
    whose programs finish in any order."""
    monkeypatch.setattr(kernels, "ATTN_MIN_SPLIT_TOKENS", 1)
    assert kernels.ATTN_MERGE_FAN_IN == 8
    _check_decode_attention(monkeypatch, False, 2, 1, [700, 130, 560], True, d=32, page=16, max_blocks=44, seed=29,
                            num_splits=16)
    _check_decode_attention(monkeypatch, False, 4, 2, [1400, 1024], True, d=32, page=16, max_blocks=88, seed=30,
                            num_splits=24)


# min_split_tokens 1 (one 64-key tile per split) spreads the 300-key row over 5 splits and the 40-key row
# over 1; the default (128) gives the 300-key row 3 splits and the 5- and 40-key rows one direct pass each.
@pytest.mark.parametrize("min_split_tokens", [None, 1])
def test_kernel_decode_attention_short_contexts_many_splits(monkeypatch, min_split_tokens):
    """16 splits asked for, few used: partials of unused splits and skipped merge rows are never read
    (kernels' torch.empty poisoned with NaN)."""
    if min_split_tokens is not None:
        monkeypatch.setattr(kernels, "ATTN_MIN_SPLIT_TOKENS", min_split_tokens)
    _poison_empty(monkeypatch)
    _check_decode_attention(monkeypatch, False, 4, 2, [5, 40, 300, 0], True, d=32, page=16, max_blocks=20,
                            seed=30, num_splits=16)


def test_graph_runner_packs_kv_heads_of_short_contexts(monkeypatch):
    """A bucket whose decode attention packs kv heads over short contexts has a graph per side of the
    bound (run eagerly on the CPU, on the Triton interpreter), and a step replays the one its longest
    context allows: packed while every context is short, one kv head a program past that. Tokens as the
    unfused reference model's, either way."""
    monkeypatch.setattr(kernels, "ATTN_PACK_PROGRAMS", 8)  # tiny's 4 kv heads: 2 a program at 4 requests, 4 at 8
    monkeypatch.setattr(kernels, "ATTN_PACK_MAX_CONTEXT", 24)  # short prompts suffice to pass it (the interpreter)
    dev = dict(device="cuda", dtype="float32", num_blocks=256) if CUDA else {}
    llm = LLM("tiny", fuse=True, triton=True, tuned=True, enforce_eager=False, graph_buckets=(2, 4, 8), max_num_seqs=8,
              **dev)
    g, bound = llm.engine.runner.graphs, kernels.ATTN_PACK_MAX_CONTEXT
    assert {b: g.context_bounds(b) for b in (2, 4, 8)} == {2: (g.max_seq_len,), 4: (bound, g.max_seq_len),
                                                    8: (bound, g.max_seq_len)}
    keys, key_for = [], g.key_for
    monkeypatch.setattr(g, "key_for", lambda batch: keys.append(key_for(batch)) or keys[-1])
    reference = LLM("tiny", fuse=False, **dev)
    short = mixed_prompts(7, 4096, seed=41, lengths=(5, 17, 9, 2))  # contexts of at most 17 + 3 keys
    long = short[:6] + mixed_prompts(1, 4096, seed=42, lengths=(bound,))  # its context passes the bound
    for prompts, graph in ((short, ("decode", 8, bound)), (long, ("decode", 8, g.max_seq_len))):
        keys.clear()
        out = llm.generate(prompts, greedy(3))
        assert tokens_of(out) == tokens_of(reference.generate(prompts, greedy(3)))
        decode_keys = {k for k in keys if k is not None and k[0] == "decode"}
        assert decode_keys == {graph}, "7 decodes, padded to the bucket of 8"


@needs_cuda
@pytest.mark.parametrize("h,hkv,seq_lens,max_seq_len,num_splits", [
    (16, 8, [48, 0, 33, 64, 1], None, None),  # Qwen3-0.6B heads, short contexts: one split each, a padding row
    (32, 4, [8000, 200, 2], None, None),  # Qwen3-30B-A3B heads, a long context over many splits
    (16, 8, [0, 1] + [33 + 7 * i % 96 for i in range(254)], 128, None),  # 256 short contexts: 8 kv heads a program
    (16, 8, [3000, 70], None, 5),
    (16, 8, [8100], None, None),  # batch 1: 64 splits, merged in a tree of 8 groups of 8 that finish in any order
])
def test_kernel_gpu_decode_attention_bf16(h, hkv, seq_lens, max_seq_len, num_splits):
    d, page, b = 128, 16, len(seq_lens)
    max_blocks = -(-max(seq_lens) // page) + 1
    q, (k_cache, v_cache, _, sl, bt) = _attention_case([1] * b, seq_lens, h, hkv, d, page, max_blocks, seed=45,
                                                       device=CUDA_DEVICE, dtype=BF16)
    k, v = (_randn(b, hkv, d, seed=s, device=CUDA_DEVICE, dtype=BF16) for s in (46, 47))
    slots = torch.tensor([int(bt[r, (s - 1) // page]) * page + (s - 1) % page if s else -1
                          for r, s in enumerate(seq_lens)], device=CUDA_DEVICE)
    cos_sin = _randn(8192, d, seed=48, device=CUDA_DEVICE)
    norms = (_randn(d, seed=49, device=CUDA_DEVICE, dtype=BF16), _randn(d, seed=50, device=CUDA_DEVICE, dtype=BF16))
    kc, vc = k_cache.clone(), v_cache.clone()
    positions = (sl.long() - 1).clamp(min=0)
    assert (kernels.decode_pack(b, hkv) == 8) == (max_seq_len is not None)
    out = kernels.decode_attention(q.clone(), k, v, kc, vc, slots, positions, sl, bt, cos_sin, d**-0.5, *norms,
                                   max_seq_len=max_seq_len, num_splits=num_splits)
    ref = kernels.decode_attention_ref(q, k, v, k_cache, v_cache, slots, positions, sl, bt, cos_sin, d**-0.5,
                                       *norms)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **BF16_GEMM_TOL)
    torch.testing.assert_close(kc[:-1], k_cache[:-1], **BF16_GEMM_TOL, equal_nan=True)
    assert torch.equal(vc[:-1].nan_to_num(), v_cache[:-1].nan_to_num())
    assert kernels._tickets(CUDA_DEVICE).count_nonzero() == 0


@needs_cuda
def test_gpu_packed_attention_graphs_equal_unpacked_eager(monkeypatch):
    """256 requests of short contexts replay the graph that packs tiny's kv heads (4 a program); their
    tokens equal an eager engine's that never packs (float32, so no tile order can round differently)."""
    dev = dict(GPU, dtype="float32")
    graphed = nanoengine.LLM("tiny", enforce_eager=False, max_num_seqs=256, tuned=True, **dev)
    g, key = graphed.engine.runner.graphs, ("decode", 256, kernels.ATTN_PACK_MAX_CONTEXT)
    assert kernels.decode_pack(256, 4) == 4 and key in g.graphs
    replays, graph = [], g.graphs[key]
    g.graphs[key] = SimpleNamespace(replay=lambda: replays.append(1) or graph.replay())
    prompts = mixed_prompts(256, 4096, seed=43, lengths=(5, 17, 33, 60))
    packed = tokens_of(graphed.generate(prompts, greedy(16)))
    assert len(replays) >= 8, "the decode steps of 256 short contexts replay the packed graph"
    monkeypatch.setattr(kernels, "ATTN_PACK_MAX_CONTEXT", 0)  # never pack
    eager = nanoengine.LLM("tiny", enforce_eager=True, max_num_seqs=256, tuned=True, **dev)
    assert packed == tokens_of(eager.generate(prompts, greedy(16)))


# -- 2.4 fused_moe_decode: a MoE layer for a few tokens as two GEMVs ------------------------------------

# Distinct experts per token, and shared between tokens: expert 3 is in every token's top 2 but the third's,
# and tokens 0, 1 and 3 also share expert 0 from top 3 on.
SHARED_IDS = [[3, 0, 5, 7], [6, 3, 1, 0], [2, 7, 4, 6], [3, 1, 0, 5]]


def _moe_decode_case(n: int, top_k: int, d: int, inter: int, num_experts: int = 8):
    x = _randn(n, d, seed=15)
    gate_up = _randn(num_experts, 2 * inter, d, seed=16) / d**0.5
    down = _randn(num_experts, d, inter, seed=17) / inter**0.5
    ids = torch.tensor(SHARED_IDS, device=DEVICE)[:n, :top_k]
    weights = (0.5 + torch.rand(n, top_k, generator=_gen(18))).to(DEVICE)  # far from 0 and from each other
    return x, gate_up, down, weights, ids


# 256-byte tiles: gate_up (BLOCK_N 1 at these sizes) steps of 32 over D, two at D = 64 and a ragged one at
# D = 40; down one step over I, ragged at I = 24, and its loop runs over the top_k experts.
@pytest.mark.parametrize("n,top_k,d,inter", [(1, 2, 64, 32), (2, 4, 64, 32), (3, 3, 40, 24), (4, 2, 64, 32)])
def test_kernel_fused_moe_decode(monkeypatch, n, top_k, d, inter):
    monkeypatch.setattr(kernels, "LINEAR_TILE_BYTES", 256)
    _poison_empty(monkeypatch)
    args = _moe_decode_case(n, top_k, d, inter)
    assert kernels.moe_decode_blocks(n * top_k, inter, d, 4, 2)[1] == 32
    out = kernels.fused_moe_decode(*args)
    assert out.shape == (n, d) and out.dtype == args[0].dtype
    torch.testing.assert_close(out, kernels.fused_moe_ref(*args), **MOE_TOL)


def test_kernel_fused_moe_decode_explicit_blocks():
    # Blocks a sweep might pass: several K steps with ragged tails in both kernels, ragged N tiles, 1 row.
    args = _moe_decode_case(3, 4, 40, 24)
    want = kernels.fused_moe_ref(*args)
    for gate_up_blocks, down_blocks in [((16, 16, 4), (16, 16, 4)), ((1, 64, 1), (8, 8, 2))]:
        out = kernels.fused_moe_decode(*args, gate_up_blocks=gate_up_blocks, down_blocks=down_blocks)
        torch.testing.assert_close(out, want, **MOE_TOL)


def test_kernel_fused_moe_picks_path_by_tokens(monkeypatch):
    """fused_moe_tuned: fused_moe_decode up to MOE_DECODE_MAX_TOKENS tokens (4), the sorted fused_moe past
    that; both compute the same."""
    calls = []
    decode = kernels.fused_moe_decode
    monkeypatch.setattr(kernels, "fused_moe_decode", lambda *a, **kw: calls.append(a[0].shape[0]) or decode(*a, **kw))
    x, gate_up, down, weights, ids = args = _moe_decode_case(4, 3, 32, 16)
    assert kernels.MOE_DECODE_MAX_TOKENS == 4
    decode_out = kernels.fused_moe_tuned(*args)
    assert calls == [4]
    sorted_out = kernels.fused_moe(*args)
    assert calls == [4], "fused_moe is the sorted path only"
    torch.testing.assert_close(decode_out, sorted_out, **MOE_TOL)
    kernels.fused_moe_tuned(x[:1], gate_up, down, weights[:1], ids[:1])
    assert calls == [4, 1], "one token takes the decode path"
    monkeypatch.setattr(kernels, "MOE_DECODE_MAX_TOKENS", 3)
    torch.testing.assert_close(kernels.fused_moe_tuned(*args), sorted_out, **MOE_TOL)
    assert calls == [4, 1], "past MOE_DECODE_MAX_TOKENS: the sorted path"


@needs_cuda
@pytest.mark.parametrize("n", [1, 4])
def test_kernel_gpu_fused_moe_decode_bf16(n):
    num_experts, d, inter, top_k = 128, 2048, 768, 8
    x = _randn(n, d, seed=45, device=CUDA_DEVICE, dtype=BF16)
    gate_up = (_randn(num_experts, 2 * inter, d, seed=46, device=CUDA_DEVICE) / d**0.5).to(BF16)
    down = (_randn(num_experts, d, inter, seed=47, device=CUDA_DEVICE) / inter**0.5).to(BF16)
    weights, ids = _routing(n, top_k, num_experts, seed=48, device=CUDA_DEVICE)
    ids = torch.where(ids == 5, ids[:, :1], ids)  # every token shares expert 5, each still distinct
    ids[:, 0] = 5
    weights = weights.to(BF16)  # as moe_route returns them
    args = (x, gate_up, down, weights, ids)
    out = kernels.fused_moe_decode(*args)
    torch.testing.assert_close(out, kernels.fused_moe_ref(*args), **BF16_GEMM_TOL)
    torch.testing.assert_close(out, kernels.fused_moe(*args), **BF16_GEMM_TOL)
    assert torch.equal(out, kernels.fused_moe_decode(*args)), "no atomics: the same bits on every run"


# -- 2.5 moe_route: softmax, top-k and renormalisation in one launch -----------------------------------


@pytest.mark.parametrize("t,num_experts,top_k", [(1, 8, 2), (5, 6, 3), (7, 128, 8)])  # 6, 3: padded lanes
@pytest.mark.parametrize("renormalize", [False, True])
def test_kernel_moe_route(t, num_experts, top_k, renormalize):
    logits = _randn(t, num_experts, seed=7) * 3
    weights, ids = kernels.moe_route(logits, top_k, renormalize)
    ref_w, ref_ids = kernels.moe_route_ref(logits, top_k, renormalize)
    assert torch.equal(ids, ref_ids) and ids.dtype == torch.int64
    torch.testing.assert_close(weights, ref_w, **F32_TOL)
    with pytest.raises(ValueError, match="top_k=9"):
        kernels.moe_route(logits[:, :8].contiguous(), 9, renormalize)
    logits[0] = float("nan")  # a NaN row picks no expert well, but an expert (fused_moe indexes the weights by it)
    nan_ids = kernels.moe_route(logits, top_k, renormalize)[1][0]
    assert ((nan_ids >= 0) & (nan_ids < num_experts)).all(), nan_ids


@needs_cuda
def test_kernel_gpu_moe_route_bf16():
    logits = _randn(300, 128, seed=38, device=CUDA_DEVICE, dtype=BF16)
    weights, ids = kernels.moe_route(logits, 8, True)
    ref_w, ref_ids = kernels.moe_route_ref(logits, 8, True)
    # bf16 logits tie often (6% of picks here), and topk breaks ties its own way: compare what was picked
    probs = torch.softmax(logits.float(), dim=-1)
    torch.testing.assert_close(probs.gather(1, ids), probs.topk(8).values, atol=0, rtol=0)
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all(), "8 distinct experts per token"
    torch.testing.assert_close(weights, ref_w, atol=1e-2, rtol=1e-2)


# -- 2.6 race_sample: sampling in one pass over the logits ---------------------------------------------


def test_race_sample_kernel_equals_reference():
    """The draws of test_race_sample_draws_from_the_softmax (200 of them): the reference's, token for token,
    so the kernel's follow the softmax too. Three vocabulary chunks, greedy and sampled rows, filtered (-inf)
    logits, a seed past 2**32."""
    n = 200
    logits = torch.tensor([0.0, 1.0, 2.0, float("-inf"), 0.5], device=DEVICE).repeat(n, 1)
    args = (logits, torch.full((n,), 0.7, device=DEVICE), torch.full((n,), 5, device=DEVICE),
            torch.arange(n, device=DEVICE))
    assert torch.equal(kernels.race_sample(*args), kernels.race_sample_ref(*args))
    s, vocab = 4, 2 * kernels.RACE_CHUNK + 300
    logits = _randn(s, vocab, seed=60) * 2
    logits[1, ::3] = float("-inf")
    temperature = torch.tensor([0.0, 0.8, 1.0, 1.7], device=DEVICE)
    seeds = torch.tensor([1, 2**40 + 5, 3, 4], device=DEVICE)
    counters = torch.tensor([0, 7, 2**31 + 1, 3], device=DEVICE)
    tokens = kernels.race_sample(logits, temperature, seeds, counters)
    assert torch.equal(tokens, kernels.race_sample_ref(logits, temperature, seeds, counters))
    assert tokens[0] == logits[0].argmax() and logits[1, tokens[1]] > float("-inf")
    # 16-bit logits (the lm_head's output) are read as float32 in registers: the same draws as their copy
    half = logits.to(torch.bfloat16)
    for greedy_rows in (False, True):
        tokens = kernels.race_sample(half, temperature, seeds, counters, greedy=greedy_rows)
        assert torch.equal(tokens, kernels.race_sample(half.float(), temperature, seeds, counters, greedy=greedy_rows))
        assert torch.equal(tokens, kernels.race_sample_ref(half, temperature, seeds, counters, greedy=greedy_rows))


@pytest.mark.parametrize("vocab", [300, 3 * kernels.RACE_CHUNK + 7])
def test_race_sample_greedy_path(vocab):
    """greedy=True is argmax with the lowest id on a tie, also across chunks (the last chunk to finish
    picks among them), call after call with new logits, and it leaves the ticket counters at zero."""
    temperature, seeds, counters = (torch.zeros(3, device=DEVICE), torch.arange(3, device=DEVICE),
                                    torch.zeros(3, dtype=torch.long, device=DEVICE))
    for seed in range(3):
        logits = _randn(3, vocab, seed=70 + seed)
        logits[1, [vocab - 1, 5]] = 100.0  # a tie across chunks: id 5 wins
        tokens = kernels.race_sample(logits, temperature, seeds, counters, greedy=True)
        assert torch.equal(tokens, logits.argmax(dim=1)) and tokens[1] == 5
        assert torch.equal(tokens, kernels.race_sample(logits, temperature, seeds, counters))
        assert kernels._tickets(DEVICE).count_nonzero() == 0


@needs_cuda
def test_kernel_gpu_race_sample():
    s, vocab = 64, 151936
    logits = _randn(s, vocab, seed=61, device=CUDA_DEVICE) * 3
    temperature = torch.rand(s, generator=_gen(62)).to(CUDA_DEVICE) * 1.5
    temperature[::5] = 0
    seeds, counters = torch.arange(s, device=CUDA_DEVICE) * 7919, torch.arange(s, device=CUDA_DEVICE) + 11
    tokens = kernels.race_sample(logits, temperature, seeds, counters)
    assert torch.equal(tokens, kernels.race_sample_ref(logits, temperature, seeds, counters))
    half = logits.to(BF16)
    tokens = kernels.race_sample(half, temperature, seeds, counters)
    assert torch.equal(tokens, kernels.race_sample(half.float(), temperature, seeds, counters))


# -- 2.7 prefill_attention: paged_attention in units of work, the diagonal masked alone, long rows split ---


def _check_prefill_attention(monkeypatch, q_lens, seq_lens, h=4, hkv=2, d=16, page=4, max_blocks=None, seed=80,
                             programs=2, split_units=0, min_split_tiles=2, max_splits=4) -> torch.Tensor:
    """prefill_attention against paged_attention_ref, float32 on NaN-guarded caches (_attention_case), kernels'
    torch.empty poisoned: an output left unwritten, or a partial read before it was written, shows as NaN. Tiles
    of 16 query rows and 16 keys, so that short rows cross several; `programs` programs in all (one "SM" on
    any machine, as the interpreter counts), and, where the fewest query tiles x Hkv are at most half of them,
    splits up to split_units x programs / those, max_splits at most. Every ticket must be back at 0."""
    monkeypatch.setattr(kernels, "_sm_count", lambda device: 1)
    monkeypatch.setattr(kernels, "PREFILL_BLOCK_M", 16)
    monkeypatch.setattr(kernels, "PREFILL_BLOCK_N", 16)
    monkeypatch.setattr(kernels, "PREFILL_PROGRAMS_PER_SM", programs)
    monkeypatch.setattr(kernels, "PREFILL_SPLIT_UNITS_PER_SM", split_units)
    monkeypatch.setattr(kernels, "PREFILL_MAX_SPLITS", max_splits)
    monkeypatch.setattr(kernels, "PREFILL_MIN_SPLIT_TILES", min_split_tiles)
    _poison_empty(monkeypatch)
    max_blocks = max_blocks or max(1, -(-max(seq_lens) // page))
    q, tensors = _attention_case(q_lens, seq_lens, h, hkv, d, page, max_blocks, seed)
    out = kernels.prefill_attention(q, *tensors, d**-0.5, max(q_lens))
    ref = kernels.paged_attention_ref(q, *tensors, d**-0.5, max(q_lens))
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **ATTN_TOL)
    assert kernels._tickets(DEVICE).count_nonzero() == 0, "the counter, the programs done and each merge's ticket"
    qsl = tensors[2].tolist()
    for r, seq_len in enumerate(seq_lens):
        if not seq_len:
            assert not out[qsl[r]:qsl[r + 1]].any(), "a padding request attends to nothing"
    return out


def test_kernel_prefill_attention_prompts_alone(monkeypatch):
    """Prompts from their first token: each query tile's diagonal (8 tokens x 2 heads a tile, 16 keys) masked,
    the tiles before it not; one prompt, then two of odd lengths (no multiple of any tile) in one batch."""
    _check_prefill_attention(monkeypatch, [37], [37])
    _check_prefill_attention(monkeypatch, [21, 34], [21, 34], seed=81)


def test_kernel_prefill_attention_chunk_on_a_cached_prefix(monkeypatch):
    """Chunks on top of cached contexts (seq_len - q_len keys before the chunk): every row sees the whole
    prefix unmasked, and its diagonal falls anywhere in a key tile."""
    _check_prefill_attention(monkeypatch, [21], [70])
    _check_prefill_attention(monkeypatch, [5, 16, 9], [45, 116, 9], seed=82)


def test_kernel_prefill_attention_mixed_with_decodes_and_padding(monkeypatch):
    """A prompt step as the scheduler makes it: decodes (q_len 1) beside a prompt, a chunk, and padding requests
    (seq_len 0, with tokens or without), which write zeros."""
    _check_prefill_attention(monkeypatch, [1, 19, 1, 3, 1, 2, 0], [40, 19, 0, 30, 130, 0, 0])
    _check_prefill_attention(monkeypatch, [1, 1], [0, 0], seed=83)  # all padding


@pytest.mark.parametrize("h,hkv", [(4, 4), (8, 4), (16, 8), (32, 8), (32, 4)])
def test_kernel_prefill_attention_every_gqa_ratio_of_the_presets(monkeypatch, h, hkv):
    """The heads of every preset (tiny 8/4, qwen3-0.6b 16/8, llama 32/8, qwen3-30b-a3b 32/4) and one kv head a
    query head: a unit's rows are BLOCK_Q tokens x the group's heads, at a small head_dim."""
    presets = {(c.num_heads, c.num_kv_heads) for c in map(nanoengine.ModelConfig.from_hf, nanoengine.PRESETS.values())}
    assert {a // b for a, b in presets} <= {1, 2, 4, 8}, "a preset with a new ratio: test it here"
    _check_prefill_attention(monkeypatch, [13, 1, 6], [13, 50, 36], h=h, hkv=hkv, seed=84)


def test_kernel_prefill_attention_splits_long_rows_and_merges_them(monkeypatch):
    """Asked for 64 units an SM, the few query tiles (8 units: 4 tiles x 2 kv heads, on 16 programs) split 8 ways,
    one 16-key tile a split at least: the prompt's last tiles and the long decode use 8 splits, its first tiles
    fewer, the short prompt none. The last of a tile's splits to finish merges; calls in a row, each with new data
    (a stale partial would show). On 15 programs the 8 units leave fewer than half idle: no split."""
    launches = spy(monkeypatch, "_prefill_attention_kernel").launches
    for seed in (85, 86, 87):
        _check_prefill_attention(monkeypatch, [24, 1, 5], [224, 300, 5], programs=16, split_units=64, min_split_tiles=1,
                                 max_splits=8, seed=seed)
    _check_prefill_attention(monkeypatch, [24, 1, 5], [224, 300, 5], programs=15, split_units=64, min_split_tiles=1,
                             max_splits=8)
    assert [x.SPLIT for x in launches] == [True] * 3 + [False]


def test_kernel_prefill_attention_grid_depends_on_sizes_only(monkeypatch):
    """A call like a prompt graph's: a block table far wider than any context (the bucket's max_seq_len), more
    request rows than requests (q_len 0, seq_len 0) and a request of padding tokens. Two batches of the same
    sizes, cut differently, launch the same grid and tiles, and each is right."""
    launches = spy(monkeypatch, "_prefill_attention_kernel").launches
    for q_lens, seq_lens in (([9, 1, 1, 5, 0, 0], [30, 12, 70, 0, 0, 0]), ([1, 14, 1, 0, 0, 0], [3, 14, 40, 0, 0, 0])):
        _check_prefill_attention(monkeypatch, q_lens, seq_lens, max_blocks=64, programs=8, split_units=16)
    (a, b) = launches
    assert a.grid == b.grid and vars(a) == vars(b) and a.SPLIT


def test_kernel_prefill_attention_past_max_seqs_runs_paged_attention(monkeypatch):
    """More requests than its programs scan in one vector (PREFILL_MAX_SEQS), or fewer tokens than min_tokens
    (the tuned path's PREFILL_MIN_TOKENS: short steps, where paged_attention is as fast or faster):
    paged_attention takes the call. At min_tokens or more, prefill_attention does."""
    prefill, paged = (spy(monkeypatch, f"_{name}_kernel").launches for name in ("prefill_attention", "paged_attention"))
    q, tensors = _attention_case([1, 4, 1], [9, 4, 20], 4, 2, 16, 4, 8, seed=83)
    for min_tokens, kernel in ((7, paged), (6, prefill)):
        out = kernels.prefill_attention(q, *tensors, 0.25, 4, min_tokens=min_tokens)
        torch.testing.assert_close(out, kernels.paged_attention_ref(q, *tensors, 0.25, 4), **ATTN_TOL)
        assert len(kernel) == 1, f"min_tokens={min_tokens}: not the kernel it should be"
    monkeypatch.setattr(kernels, "PREFILL_MAX_SEQS", 2)
    _check_prefill_attention(monkeypatch, [1, 4, 1], [9, 4, 20])
    assert len(prefill) == 1 and len(paged) == 2


@needs_cuda
@pytest.mark.parametrize("q_lens,seq_lens,max_splits", [
    ([1024], [1024], None),  # a 1,024-token prompt (None: kernels.py's split settings)
    ([1024], [4024], None),  # a chunk on a 3,000-token prefix
    ([1] * 16 + [1024], [300 + 53 * i for i in range(16)] + [1024], None),  # 16 decodes and a prompt joining them
    ([7, 1, 0, 300], [7, 8100, 0, 3300], 1),  # odd lengths, a long decode, a padding row: unsplit
    ([7, 1, 0, 300], [7, 8100, 0, 3300], 4),  # the same, its few query tiles split and merged
])
def test_kernel_gpu_prefill_attention_bf16(monkeypatch, q_lens, seq_lens, max_splits):
    """Qwen3-0.6B's heads, bf16. Both sides accumulate in float32 and round the output to bf16 once; the kernel
    also rounds each softmax weight to bf16 for the P @ V matmul, off by at most 2^-9 of it: at most 2^-9 x max|v|
    (~5 for these normal V, so ~1e-2) on an output, plus one bf16 step (2^-8) of outputs of magnitude <= ~2,
    together under BF16_GEMM_TOL's atol 3e-2."""
    h, hkv, d, page = 16, 8, 128, 16
    max_blocks = -(-max(seq_lens) // page) + 1
    q, tensors = _attention_case(q_lens, seq_lens, h, hkv, d, page, max_blocks, seed=88, device=CUDA_DEVICE, dtype=BF16)
    if max_splits is not None:
        monkeypatch.setattr(kernels, "PREFILL_MAX_SPLITS", max_splits)
    launches = spy(monkeypatch, "_prefill_attention_kernel").launches
    out = kernels.prefill_attention(q, *tensors, d**-0.5, max(q_lens))
    assert len(launches) == 1 and (max_splits is None or launches[0].SPLIT == (max_splits > 1))  # the kernel ran once
    ref = kernels.paged_attention_ref(q, *tensors, d**-0.5, max(q_lens))
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **BF16_GEMM_TOL)
    assert kernels._tickets(CUDA_DEVICE).count_nonzero() == 0


@needs_cuda
def test_kernel_gpu_prefill_attention_graph_replays():
    """Captured in a CUDA graph with a prompt bucket's sizes (1,280 tokens, more request rows than requests, a
    block table of 8,192 keys) and replayed with other lengths of the same sizes: each replay right, the work
    counter and every ticket back at zero between replays."""
    h, hkv, d, page, t, rows, width = 16, 8, 128, 16, 1280, 33, 512
    cases = [([1] * 16 + [1024], [300 + 53 * i for i in range(16)] + [1024]), ([640, 1, 400], [3640, 8000, 400])]
    batches = []
    for seed, (q_lens, seq_lens) in enumerate(cases, start=89):
        pad = t - sum(q_lens)  # the padding tokens' request, then empty rows
        q_lens, seq_lens = q_lens + [pad] + [0] * (rows - len(q_lens) - 1), seq_lens + [0] * (rows - len(seq_lens))
        batches.append(_attention_case(q_lens, seq_lens, h, hkv, d, page, width, seed=seed, device=CUDA_DEVICE,
                                       dtype=BF16))
    q, tensors = batches[0][0].clone(), [x.clone() for x in batches[0][1]]
    kernels.prefill_attention(q, *tensors, d**-0.5, t)  # compile, and make the tickets, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.prefill_attention(q, *tensors, d**-0.5, t)
    for q_new, tensors_new in batches:
        q.copy_(q_new)
        for static, new in zip(tensors, tensors_new):
            static.copy_(new)
        graph.replay()
        torch.testing.assert_close(out, kernels.paged_attention_ref(q, *tensors, d**-0.5, t), **BF16_GEMM_TOL)
        assert kernels._tickets(CUDA_DEVICE).count_nonzero() == 0


# -- The steady decode: a decode of an unchanged running set planned and staged on arrays --------------


def _staged(x):
    """A Batch or SamplingBatch as plain values, to compare what two runners staged."""
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in vars(x).items()}


def _blocks_of(engine, req) -> list[int]:
    """req's blocks, with those a standing SteadyDecode holds for it until it hands them back."""
    blocks, s = list(req.block_ids), getattr(engine.book, "steady", None)
    if s is not None and req in s.requests:
        i = s.requests.index(req)
        blocks += [b for due, new in s.entered for j, b in zip(due.tolist(), new) if j == i]
    return blocks


def _leaving_workload():
    """Six requests that leave one by one, a few quiet steps apart, in a cache too small for all."""
    rng = random.Random(7)
    prompts = [[rng.randrange(4096) for _ in range(rng.randint(5, 40))] for _ in range(6)]
    params = [dict(max_tokens=6 + 7 * i, ignore_eos=True, temperature=0.7 * (i % 2), seed=i) for i in range(6)]
    return prompts, params, 30, {}


@pytest.mark.parametrize("seed", [*range(6), "leaving"])
@pytest.mark.parametrize("use_async", [False, True])
def test_steady_decode_plans_and_stages_what_the_general_path_does(seed, use_async, no_placeholder_hashed):
    """A decode step of an unchanged running set takes a fast path: the scheduler advances SteadyDecode's
    arrays instead of visiting each request, and the input builder advances DecodeRows instead of
    rebuilding the batch; requests that finish leave both (SteadyDecode.without,
    SteadyInputBuilder._condense). Two engines run the same workload in lock-step, the second with the
    steady variant off (tuned="-steady": RequestBook, Scheduler, InputBuilder): every step must plan the
    same requests, positions and blocks and stage the same batch, across block boundaries, stops, leavers,
    joins (4 slots on odd seeds), aborts and preemption."""
    prompts, raw, num_blocks, aborts = _random_workload(seed) if seed != "leaving" else _leaving_workload()
    for kw in raw:
        kw["output_kind"] = "final_only"  # the only kind the fast path serves
    first = run(Engine(model="tiny"), prompts, [SamplingParams(**kw) for kw in raw])
    for i, (kw, o) in enumerate(zip(raw, first)):
        if i % 2 and len(o.token_ids) > 2:  # a stop token that fires mid-stream
            kw["stop_token_ids"] = [o.token_ids[len(o.token_ids) // 2]]
    params = [SamplingParams(**kw) for kw in raw]
    settings = dict(model="tiny", num_blocks=num_blocks, max_num_seqs=4 if seed in (1, 3, 5) else 256)
    engines = [Engine(tuned=True, **settings), Engine(tuned="-steady", **settings)]
    assert isinstance(engines[0].book, scheduler.SteadyBook) and type(engines[1].book) is scheduler.RequestBook
    fast_plans, logs, condensed = [], [[], []], []
    steady_step, condense = engines[0].scheduler._steady_step, engines[0].runner.inputs._condense
    engines[0].scheduler._steady_step = lambda: fast_plans.append(steady_step()) or fast_plans[-1]
    engines[0].runner.inputs._condense = lambda *a: condensed.append(1) or condense(*a)
    for engine, log in zip(engines, logs):
        def logged(out, prepare=engine.runner.inputs.prepare, log=log, engine=engine):
            batch, sbatch, sampling = prepare(out)
            log.append(([r.request_id for r in out.requests], out.starts.tolist(), list(out.num_tokens),
                        [(_blocks_of(engine, r), len(r.prefix_ids)) for r in out.requests], _staged(batch),
                        _staged(sbatch)))
            return batch, sbatch, sampling
        engine.runner.inputs.prepare = logged
    ids = [[e.add_request(p, sp) for p, sp in zip(prompts, params)] for e in engines]
    done, steps = [{}, {}], 0
    while any(e.has_unfinished() for e in engines):
        for engine, d in zip(engines, done):
            for o in (engine.step_async() if use_async else engine.step()):
                d[o.request_id] = (o.token_ids, o.finish_reason)
        assert logs[0] == logs[1], f"step {steps}: the fast path planned or staged something else"
        steps += 1
        assert steps < 500, "a request that should have stopped keeps going"
        for i, at in aborts.items():
            if steps == at:
                for engine, rids in zip(engines, ids):
                    engine.abort(rids[i])
    assert done[0] == done[1] and any(reason == "stop" for _, reason in done[0].values())
    assert sum(p is not None for p in fast_plans) >= steps // 4, "the fast path was hardly taken"
    if seed == "leaving":  # most leave on the fast path: a stop, or (async) a last token in flight
        assert len(condensed) >= 4, "finished requests did not leave the steady decode"
    for engine in engines:
        check_clean(engine)


def test_seq_lens_are_int64_on_both_paths_and_the_counters_on_the_fast_path():
    """A steady decode stages its counters (the sampled token's index) as seq_lens too, so it advances one
    int64 array a step, not two; the general path stages int64 seq_lens as well, and so do the graphs'
    buffers, so the attention kernel sees one dtype (on CUDA a second would compile it again)."""
    engine = Engine(model="tiny", tuned=True)
    inputs = engine.runner.inputs
    seen, prepare = [], inputs.prepare

    def logged(out):
        batch, sbatch, sampling = prepare(out)
        # the counters as staged now: a steady decode's SamplingBatch is one object, given new ones each step
        seen.append((out.steady is not None and out.requests is inputs.prev_sampling, batch, sbatch.counters))
        return batch, sbatch, sampling
    inputs.prepare = logged
    run(engine, mixed_prompts(3, 4096, lengths=(5, 20, 40)), greedy(20))
    assert {b.seq_lens.dtype for _, b, _ in seen} == {torch.int64}
    assert Engine(model="tiny", enforce_eager=False).runner.graphs.seq_lens.dtype == torch.int64
    fast = [(b, counters) for steady, b, counters in seen if steady]
    assert fast, "no step took the fast path"
    for b, counters in fast:
        assert b.seq_lens is counters, "the fast path staged seq_lens apart from the counters"
        assert b.seq_lens.tolist() == (b.positions + 1).tolist()
    check_clean(engine)


@pytest.mark.parametrize("use_async", [False, True])
def test_a_steady_decode_builds_its_rows_once(use_async):
    """The step that forms a steady decode builds its DecodeRows (_prepare_formed), with its inputs from
    the requests' last tokens, or in flight (async); every later step of the set only advances those rows,
    across block boundaries too. The tokens are those of an engine without the steady variant."""
    engines = [Engine(model="tiny", tuned=True), Engine(model="tiny", tuned="-steady")]
    inputs, built = engines[0].runner.inputs, []
    decode_rows = inputs._decode_rows  # is its plan one step on from the last (its set formed before)?
    inputs._decode_rows = lambda out: built.append(out.requests is inputs.prev_sampling) or decode_rows(out)
    prompts = [[1, 2, 3 + i] for i in range(4)]  # one prefill step, then one set decodes 40 tokens
    outs = [run(engine, prompts, greedy(40), use_async=use_async) for engine in engines]
    assert built == [False], f"the rows were built {len(built)} times, or not on the step that formed the set"
    assert tokens_of(outs[0]) == tokens_of(outs[1])
    for engine in engines:
        check_clean(engine)
