"""nanoengine's command line: the only entry point besides the Python API.

    python run.py overhead --requests 16          # the main job: what fusion, graphs and async each buy
    python run.py generate --prompt-ids 1,2,3 --max-tokens 16
    python run.py bench                           # offline throughput, nano-vllm's protocol
    python run.py profile --requests 64           # Chrome traces of a few decode steps per configuration
    python run.py kernels                         # each Triton kernel against its torch reference (CUDA)

Results go to stdout as JSON lines (generate's text, unless --json), and nothing else does: progress goes
to stderr. Bad input prints one line naming the problem and exits with status 2. On the CPU the defaults
are smaller where a command would take long (bench), and each command's --help says how long it takes.
Imports nanoengine (and, for `kernels`, kernels.py).
"""
import argparse
import collections
import itertools
import json
import os
import random
import sys
import time

import torch
import triton

import kernels
from nanoengine import PRESETS, Engine, EngineConfig, SamplingParams, param_bytes

# The floors divide bytes by the device's bandwidth: --bandwidth, else measured by a copy of this many bytes
# (past every cache: the H200's L2 is 60 MB), the best of COPY_REPEATS, well under a second. An H200
# measures about 4.27e12 bytes/s read + written (../shared/GPU.md).
COPY_BYTES = dict(cuda=1 << 30, cpu=256 << 20)
COPY_REPEATS = 5

# `run.py bench`'s defaults, (CUDA, CPU): nano-vllm's protocol on CUDA; on the CPU, where the torch
# reference attention reads every request's whole context each step, fewer and shorter requests, so that
# the run takes a minute or two on a 2-core laptop, not hours.
BENCH_DEFAULTS = dict(num_requests=(256, 64), min_len=(100, 16), max_len=(1024, 128))
PROGRESS_S = 5.0  # seconds between bench's progress lines

# name -> engine settings. Graph configurations need CUDA; on the CPU they are skipped.
CONFIGS = {
    "eager": dict(fuse=False, enforce_eager=True),
    "fused": dict(fuse=True, enforce_eager=True),
    "fused+async": dict(fuse=True, enforce_eager=True, async_scheduling=True),
    "fused+graphs": dict(fuse=True, enforce_eager=False),
    "fused+graphs+async": dict(fuse=True, enforce_eager=False, async_scheduling=True),
}


def emit(record: dict):
    """One JSON line per record: easy to read, easy to grep, easy to paste into a table."""
    print(json.dumps(record), flush=True)


def note(text: str):
    """Progress for whoever watches, on stderr: stdout carries the results only."""
    print(text, file=sys.stderr, flush=True)


def make_engine(label: str, **settings) -> Engine:
    """Engine(EngineConfig(**settings)), with a line before and after: building takes a while with a big
    model, and on CUDA it captures a graph per batch size."""
    cfg = EngineConfig(**settings)
    graphs = " and its CUDA graphs" if cfg.device.startswith("cuda") and not cfg.enforce_eager else ""
    note(f"{label}: building the engine{graphs} ({cfg.model}, {cfg.device}) ...")
    t0 = time.perf_counter()
    engine = Engine(cfg)
    g = engine.runner.graphs
    captured = f", {len(g.graphs)} graphs in {g.capture_seconds:.1f} s" if g is not None and g.graphs else ""
    note(f"{label}: ready in {time.perf_counter() - t0:.1f} s ({engine.scheduler.blocks.num_blocks} KV blocks"
         f"{captured})")
    return engine


def measure_bandwidth(device: str) -> float:
    """Bytes read + written per second by a large copy on the device: the most a decode step's reads of
    weights and KV can reach."""
    cuda = device.startswith("cuda")
    n = COPY_BYTES["cuda" if cuda else "cpu"]
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(COPY_REPEATS + 1):  # the first touches dst's pages: only the best counts
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n / best


def floor_bandwidth(a, device: str) -> tuple[float, str]:
    """The bytes/s the floors divide by, and where it came from: --bandwidth if given, else measured here."""
    if a.bandwidth is not None:
        if not a.bandwidth > 0:
            raise ValueError(f"--bandwidth {a.bandwidth} is invalid: give the device's bytes/s, e.g. 4.27e12")
        return a.bandwidth, "--bandwidth"
    note(f"measuring the copy bandwidth of {device} (under a second; --bandwidth skips it) ...")
    return measure_bandwidth(device), "measured"


def bandwidth_fields(bandwidth: float, source: str) -> dict:
    return dict(bandwidth_gb_s=round(bandwidth / 1e9, 1), bandwidth_source=source)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def floor_seconds(engine: Engine, batch: int, context: int, bandwidth: float) -> float:
    """Bytes one decode step must move / bandwidth: weights once (for MoE only the experts a batch of
    this size touches, in expectation), plus every request's KV, plus the logits written."""
    mc, model = engine.model.config, engine.model
    total = param_bytes(model)
    elem = model.lm_head.weight.element_size()
    if not mc.tie_word_embeddings:  # the embedding table is only gathered from (B rows), not read whole
        total -= model.model.embed_tokens.weight.numel() * elem
    if mc.num_experts:
        per_expert = 3 * mc.hidden_size * mc.moe_intermediate_size * elem
        moe_layers = sum(mc.is_moe_layer(i) for i in range(mc.num_layers))
        touched = mc.num_experts * (1 - (1 - mc.num_experts_per_tok / mc.num_experts) ** batch)
        total -= moe_layers * (mc.num_experts - touched) * per_expert
    kv = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * elem * context * batch
    return (total + kv + batch * mc.vocab_size * 4) / bandwidth


def cmd_overhead(a):
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    names = a.configs.split(",") if a.configs else [c for c in CONFIGS
                                                    if device.startswith("cuda") or "graphs" not in c]
    for c in names:
        if c not in CONFIGS:
            raise ValueError(f"--configs has {c!r}; choose from {', '.join(CONFIGS)}")
    base = dict(model=a.model, device=device, dtype=a.dtype, max_num_seqs=a.slots or a.requests,
                num_blocks=a.num_blocks, triton_linear_rows=a.triton_linear_rows,
                triton_narrow_rows=a.triton_narrow_rows)
    EngineConfig(**base)  # bad settings fail here, as one line, before any progress is printed
    bandwidth = floor_bandwidth(a, device)
    params = SamplingParams(temperature=0, max_tokens=a.new_tokens, ignore_eos=True)
    header, records, reference, fused_reference = None, [], None, None
    for name in names:
        engine = make_engine(name, **base, **CONFIGS[name])
        prompts = random_prompts(a.requests, a.prompt_len, engine.model.config.vocab_size, a.seed)
        note(f"{name}: warm-up, then {a.requests} requests x {a.new_tokens} tokens ...")
        run_engine(engine, prompts, SamplingParams(temperature=0, max_tokens=3))  # warm up: compile, allocate
        r = run_engine(engine, prompts, params)
        header = header or overhead_header(engine, a, device, *bandwidth)
        if engine.runner.graphs is not None and engine.runner.graphs.use_cuda_graphs:
            header.update(graph_capture_s=round(engine.runner.graphs.capture_seconds, 2),
                          graph_mem_mb=round(engine.runner.graphs.capture_bytes / 2**20, 1))
        reference = reference or r["outputs"]
        fused_reference = fused_reference or (r["outputs"] if name != "eager" else None)
        steps = max(r["steps"], 1)
        rec = dict(config=name, tok_s=round(r["decode_tokens"] / r["wall"], 1), steps=steps,
                   ms_per_step=round(1e3 * r["wall"] / steps, 3),
                   host_ms_per_step=round(1e3 * r["host_s"] / steps, 3))
        if device.startswith("cuda"):
            rec["gpu_ms_per_step"] = round(1e3 * r["gpu_s"] / steps, 3)
            rec["x_floor"] = round(r["wall"] / steps / header["floor_ms"] * 1e3, 2)
            # Wall time not covered by any step's device time (start event to end event): the GPU waiting
            # for the host between steps. Measured without a profiler, which would slow the host.
            rec["idle_between_steps_pct"] = round(100 * max(0.0, 1 - r["gpu_s"] / r["wall"]), 1)
        rec["same_tokens"] = r["outputs"] == reference
        if name != "eager":  # in bf16, fused kernels round differently from eager torch ops; the fused
            rec["same_as_fused"] = r["outputs"] == fused_reference  # configs must still agree exactly
        records.append(rec)
        note(f"{name}: {rec['tok_s']} tok/s, {rec['ms_per_step']} ms a step ({rec['host_ms_per_step']} ms on the "
             f"host), same tokens as {names[0]}: {rec['same_tokens']}")
        engine.close()  # its KV cache and graphs go before the next configuration sizes its own
    for rec in [header] + records:  # the header carries the graphs' capture cost, known only now
        emit(rec)


def overhead_header(engine: Engine, a, device: str, bandwidth: float, source: str) -> dict:
    context = a.prompt_len + a.new_tokens // 2
    floor = floor_seconds(engine, a.requests, context, bandwidth)
    dev = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    return dict(device=dev, model=a.model, dtype=engine.cfg.dtype, requests=a.requests,
                triton_linear_rows=engine.cfg.triton_linear_rows, triton_narrow_rows=engine.cfg.triton_narrow_rows,
                prompt_len=a.prompt_len, new_tokens=a.new_tokens, floor_ms=round(floor * 1e3, 4),
                **bandwidth_fields(bandwidth, source),
                floor_note=f"decode step at mean context {context}: weights + KV bytes / {bandwidth / 1e12:.3f} TB/s")


def run_engine(engine: Engine, prompts, params) -> dict:
    """Run prompts to the end; time only the decode steps (from when every request has its first token)."""
    ids = [engine.add_request(p, params) for p in prompts]
    step = engine.step_async if engine.cfg.async_scheduling else engine.step
    done = {}
    while engine.has_unfinished():  # prefill, untimed
        for o in step():
            done[o.request_id] = o
        if all(r.num_output_tokens > 0 for r in engine.scheduler.requests.values()):
            break
    sync(engine)
    engine.stats.reset()
    engine.stats.gpu_timing = True  # device time per decode step, for gpu_ms_per_step
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for o in step():
            done[o.request_id] = o
    sync(engine)
    st = engine.stats
    return dict(outputs=[done[i].token_ids for i in ids], wall=time.perf_counter() - t0, steps=st.steps,
                host_s=st.host_s, gpu_s=st.gpu_seconds(), decode_tokens=st.tokens)


def sync(engine: Engine):
    if engine.cfg.device.startswith("cuda"):
        torch.cuda.synchronize()


def cmd_generate(a):
    if (a.prompt is None) == (a.prompt_ids is None):
        raise ValueError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    prompt = a.prompt
    if a.prompt_ids is not None:
        try:
            prompt = [int(t) for t in a.prompt_ids.split(",")]
        except ValueError:
            raise ValueError(f"--prompt-ids {a.prompt_ids!r} is invalid: give comma-separated integers") from None
    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, max_tokens=a.max_tokens,
                            seed=a.seed)
    # No progress lines: the command is short, and bad input (a model, a prompt) prints its one line alone
    engine = Engine(EngineConfig(model=a.model, device=a.device, dtype=a.dtype, enforce_eager=a.enforce_eager,
                                 triton_linear_rows=a.triton_linear_rows, triton_narrow_rows=a.triton_narrow_rows))
    engine.add_request(prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    o = outs[0]
    if a.json:
        emit(dict(prompt_token_ids=o.prompt_token_ids, token_ids=o.token_ids, text=o.text,
                  finish_reason=o.finish_reason))
    else:
        print(o.text if o.text is not None else " ".join(map(str, o.token_ids)))


def cmd_bench(a):
    """nano-vllm's offline protocol: random prompt and output lengths in [min_len, max_len], ignore_eos."""
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    for name, (on_cuda, on_cpu) in BENCH_DEFAULTS.items():
        if getattr(a, name) is None:
            setattr(a, name, on_cuda if device.startswith("cuda") else on_cpu)
    if a.min_len > a.max_len:
        raise ValueError(f"--min-len {a.min_len} is more than --max-len {a.max_len}")
    bandwidth = floor_bandwidth(a, device)  # before the engine takes the GPU's memory
    engine = make_engine("bench", model=a.model, device=device, dtype=a.dtype, enforce_eager=a.enforce_eager,
                         async_scheduling=not a.sync, max_num_seqs=a.max_num_seqs,
                         max_num_batched_tokens=a.max_num_batched_tokens,
                         triton_linear_rows=a.triton_linear_rows, triton_narrow_rows=a.triton_narrow_rows)
    rng = random.Random(a.seed)
    vocab = engine.model.config.vocab_size
    reqs = [([rng.randrange(vocab) for _ in range(rng.randint(a.min_len, a.max_len))],
             SamplingParams(temperature=0.6, max_tokens=rng.randint(a.min_len, a.max_len), ignore_eos=True,
                            seed=i)) for i in range(a.num_requests)]
    # Warm up with a run like the timed one (other random prompts of the same lengths, a few tokens each),
    # so no Triton kernel compiles inside the timed run (on the H200's slow host one compile stalls the GPU
    # for ~0.7 s): prefill chunks, mixed steps and decode within and past one wave of attention programs
    # meet the same shapes. With two warm-up prompts the first bench of a fresh process measured 20.0K
    # tokens/s against 26.2K for the next (whose kernels were compiled on disk), and 22.7K against 26.6K
    # with a full batch of equal short prompts (H200).
    warm_rng = random.Random(a.seed + 1)
    warm = [[warm_rng.randrange(vocab) for _ in range(len(p))] for p, _ in reqs]
    prompt_tokens, planned = sum(len(p) for p, _ in reqs), sum(sp.max_tokens for _, sp in reqs)
    note(f"bench: warm-up, {len(warm)} prompts ({prompt_tokens} tokens) x 8 new tokens ...")
    t0 = time.perf_counter()
    run_engine(engine, warm, SamplingParams(temperature=0.6, seed=0, max_tokens=8, ignore_eos=True))
    note(f"bench: warm-up took {time.perf_counter() - t0:.1f} s; timed run, {a.num_requests} requests, "
         f"{prompt_tokens} prompt + {planned} output tokens ...")
    engine.stats.reset()
    engine.stats.gpu_timing = True  # device time per step: how much of the run the GPU was busy
    for p, sp in reqs:
        engine.add_request(p, sp)
    step = engine.step_async if engine.cfg.async_scheduling else engine.step
    out_tokens, t0, last = 0, time.perf_counter(), time.perf_counter()
    while engine.has_unfinished():
        for o in step():
            out_tokens += len(o.token_ids)
        now = time.perf_counter()
        if now - last > PROGRESS_S:
            last = now
            note(f"  {engine.stats.tokens} of {planned} output tokens, {now - t0:.0f} s, "
                 f"{len(engine.scheduler.requests)} requests left")
    sync(engine)
    wall = time.perf_counter() - t0
    emit(dict(model=a.model, requests=a.num_requests, output_tokens=out_tokens, prompt_tokens=prompt_tokens,
              wall_s=round(wall, 2), output_tok_s=round(out_tokens / wall, 1),
              total_tok_s=round((out_tokens + prompt_tokens) / wall, 1), steps=engine.stats.steps,
              host_ms_per_step=round(1e3 * engine.stats.host_s / max(engine.stats.steps, 1), 3),
              gpu_busy_pct=round(100 * engine.stats.gpu_seconds() / wall, 1) if device.startswith("cuda") else None,
              floor_s=round(bench_floor(engine, reqs, bandwidth[0]), 2), **bandwidth_fields(*bandwidth)))


def bench_floor(engine: Engine, reqs, bandwidth: float) -> float:
    """A lower bound for the run as scheduled: each step reads the weights once; each generated token
    reads its context's KV once. (Prefill compute is ignored: decode dominates this workload.)"""
    mc = engine.model.config
    elem = engine.model.lm_head.weight.element_size()
    kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * elem
    kv = sum(kv_per_token * (len(p) * sp.max_tokens + sp.max_tokens ** 2 / 2) for p, sp in reqs)
    return (engine.stats.steps * param_bytes(engine.model) + kv) / bandwidth


def cmd_profile(a):
    """A torch.profiler trace of a few decode steps per configuration (Chrome trace JSON: open in
    Perfetto), and a summary: kernels per step, GPU busy fraction, mean gap between kernels."""
    from torch.profiler import ProfilerActivity, profile
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    names = a.configs.split(",") if a.configs else [c for c in CONFIGS if cuda or "graphs" not in c]
    os.makedirs(a.out, exist_ok=True)
    for name in names:
        if name not in CONFIGS:
            raise ValueError(f"--configs has {name!r}; choose from {', '.join(CONFIGS)}")
        engine = make_engine(name, model=a.model, device=device, dtype=a.dtype, max_num_seqs=a.requests,
                             triton_linear_rows=a.triton_linear_rows, triton_narrow_rows=a.triton_narrow_rows,
                             **CONFIGS[name])
        note(f"{name}: prefill and 8 steps, then {a.steps} traced decode steps ...")
        prompts = random_prompts(a.requests, a.prompt_len, engine.model.config.vocab_size, a.seed)
        for p in prompts:
            engine.add_request(p, SamplingParams(temperature=0, max_tokens=a.steps + 20, ignore_eos=True))
        step = engine.step_async if engine.cfg.async_scheduling else engine.step
        for _ in range(8):  # prefill and warm-up decode steps, outside the trace
            step()
        sync(engine)
        # On CUDA, kernels only unless asked: tracing every CPU op slows the host several-fold, and with it
        # the very idle time between steps that the summary measures.
        acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if a.with_cpu else []) if cuda \
            else [ProfilerActivity.CPU]
        with profile(activities=acts) as prof:
            for _ in range(a.steps):
                step()
            sync(engine)
        path = os.path.join(a.out, f"{a.model}-{a.requests}-{name.replace('+', '_')}.json")
        prof.export_chrome_trace(path)
        emit(dict(config=name, requests=a.requests, trace=path, **trace_summary(path, a.steps, cuda)))
        while engine.has_unfinished():
            step()
        engine.close()


def trace_summary(path: str, steps: int, cuda: bool) -> dict:
    """From the Chrome trace: GPU kernels per step, busy fraction of the traced span, and the idle time
    split in two: gaps under STEP_GAP_US are kernel-to-kernel latency inside a step (a graph replay's own
    gaps are ~0.5-1 us), longer ones are the GPU waiting for the host, i.e. the idle between steps."""
    if not cuda:
        return dict(note="CPU run: no GPU timeline")
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kernel_events = sorted((e for e in events if e.get("cat") == "kernel" and "dur" in e), key=lambda e: e["ts"])
    if not kernel_events:
        return dict(note="no kernels in the trace")
    # A kernel is charged only the time no earlier kernel was still running: under programmatic dependent
    # launch (kernels.py, Hopper on) the next kernel starts while this one runs and waits for it, and its
    # own span would count that wait twice (add+norms at 840 us a step in a 2.6 ms 30B step).
    by_name = collections.Counter()  # where the busy time goes: the kernels that take most of a step
    busy, gaps, end = 0.0, [], kernel_events[0]["ts"]
    for ev in kernel_events:  # merge overlaps; a gap is time with no kernel running
        s, e = ev["ts"], ev["ts"] + ev["dur"]
        if s > end:
            gaps.append(s - end)
        own = max(0.0, e - max(s, end))
        busy += own
        by_name[ev["name"][:60]] += own
        end = max(end, e)
    top = by_name.most_common(TOP_KERNELS)
    span = end - kernel_events[0]["ts"]
    waiting = sum(g for g in gaps if g >= STEP_GAP_US)
    return dict(kernels_per_step=round(len(kernel_events) / steps, 1), gpu_busy=round(busy / span, 4),
                gpu_idle_pct=round(100 * (1 - busy / span), 2),
                idle_between_steps_pct=round(100 * waiting / span, 2),
                idle_within_steps_pct=round(100 * (span - busy - waiting) / span, 2),
                mean_gap_us=round(sum(gaps) / max(len(gaps), 1), 2), span_ms_per_step=round(span / steps / 1e3, 3),
                top_kernels_us_per_step={name: round(us / steps, 1) for name, us in top})


TOP_KERNELS = 6
STEP_GAP_US = 2.0  # longer than any launch-to-launch gap inside a replayed graph (measured 0.5-1 us)


# ----------------------------------------------------------------------------------------------------------
# run.py kernels: each Triton kernel against its torch reference and its bandwidth floor (CUDA only).
# Times come from CUDA-graph replay of back-to-back calls (triton.testing.do_bench_cudagraph), so launch
# overhead is excluded and inputs smaller than the 60 MB L2 stay cached: small shapes can pass 100%.
# Functions that synchronise with the host cannot be captured and are timed eagerly with CUDA events.

KERNEL_GROUPS = ("elementwise", "moe", "attention", "linear", "tiles")
# The tile sweep takes minutes: it runs only when asked for.
DEFAULT_KERNEL_GROUPS = tuple(g for g in KERNEL_GROUPS if g != "tiles")
REP_MS = 20  # timed replay per measurement; ~60 measurements keep the run well under a minute
PAGE_SIZE = 16  # the engine's KV page size
QWEN3_0_6B = dict(hidden=1024, inter=3072, heads=16, kv_heads=8, head_dim=128)
QWEN3_30B_A3B_MOE = dict(hidden=2048, moe_inter=768, experts=128, top_k=8)
TOKENS = (1, 16, 256)
MOE_TOKENS = (1, 16, 64, 256)
MOE_DECODE_TOKENS = (1, 2, 4, 8, 16)  # both fused_moe paths, forced, to place kernels.MOE_DECODE_MAX_TOKENS
DECODE_BATCHES = (1, 16, 64)
DECODE_CONTEXTS = (128, 1024, 8192)
BF16 = torch.bfloat16
BYTES = 2  # per bf16 element


def _time_us(fn, graph: bool = True, rep: int = REP_MS) -> float:
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3
    return triton.testing.do_bench(fn, warmup=5, rep=rep, return_mode="median") * 1e3


def _report(bandwidth: float, kernel: str, shape: dict, fn, ref_fn, floor_bytes: float, ref_graph=True, **extra):
    us = _time_us(fn)
    floor_us = floor_bytes / bandwidth * 1e6
    row = dict(kernel=kernel, **shape, us=round(us, 2), ref_us=round(_time_us(ref_fn, ref_graph), 2),
               floor_us=round(floor_us, 2), pct_of_bw=round(100 * floor_us / us, 1),
               timing="cuda_graph", ref_timing="cuda_graph" if ref_graph else "events", **extra)
    if "loop_us" in extra:
        row["x_vs_loop"] = round(extra["loop_us"] / us, 1)  # speed-up over the per-expert torch loop
    print(json.dumps(row), flush=True)


def _bench_elementwise(bandwidth: float, t: int) -> None:
    hidden, inter = QWEN3_0_6B["hidden"], QWEN3_0_6B["inter"]
    h, hkv, d = QWEN3_0_6B["heads"], QWEN3_0_6B["kv_heads"], QWEN3_0_6B["head_dim"]
    dev = "cuda"
    x, w = torch.randn(t, hidden, device=dev, dtype=BF16), torch.randn(hidden, device=dev, dtype=BF16)
    res = torch.randn(t, hidden, device=dev, dtype=BF16)
    shape = dict(tokens=t)
    _report(bandwidth, "rmsnorm", shape, lambda: kernels.rmsnorm(x, w, 1e-6),
            lambda: kernels.rmsnorm_ref(x, w, 1e-6), 2 * t * hidden * BYTES)
    _report(bandwidth, "add_rmsnorm", shape, lambda: kernels.add_rmsnorm(x, res, w, 1e-6),
            lambda: kernels.add_rmsnorm_ref(x, res, w, 1e-6), 4 * t * hidden * BYTES)
    gu = torch.randn(t, 2 * inter, device=dev, dtype=BF16)
    _report(bandwidth, "silu_and_mul", shape, lambda: kernels.silu_and_mul(gu),
            lambda: kernels.silu_and_mul_ref(gu), 3 * t * inter * BYTES)
    qkv = torch.randn(t, (h + 2 * hkv) * d, device=dev, dtype=BF16)
    q, k = qkv[:, : h * d].view(t, h, d), qkv[:, h * d : (h + hkv) * d].view(t, hkv, d)
    v = qkv[:, (h + hkv) * d :].view(t, hkv, d)
    angles = torch.rand(4096, d // 2, device=dev) * 6.28
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)  # a true rotation: values stay bounded
    positions = torch.randint(0, 4096, (t,), device=dev)
    qn, kn = torch.ones(d, device=dev, dtype=BF16), torch.ones(d, device=dev, dtype=BF16)
    num_blocks = triton.cdiv(4 * t, PAGE_SIZE) + 1
    k_cache = torch.zeros(num_blocks, PAGE_SIZE, hkv, d, device=dev, dtype=BF16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm((num_blocks - 1) * PAGE_SIZE, device=dev)[:t]
    # RoPE with Qwen3's per-head norm, and the KV-cache write: one launch (k goes to the cache, not back
    # to qkv). Floor: q read and written, k and v read and written to the cache, cos/sin read.
    _report(bandwidth, "rope_write_kv", shape,
            lambda: kernels.rope_write_kv(q, k, v, k_cache, v_cache, slots, positions, cos_sin, qn, kn),
            lambda: kernels.rope_write_kv_ref(q, k, v, k_cache, v_cache, slots, positions, cos_sin, qn, kn),
            2 * t * h * d * BYTES + 4 * t * hkv * d * BYTES + t * d * 4)
    # Sampling at temperature 0.6 over Qwen3's vocabulary: the kernel reads the logits once; the torch
    # reference materialises [t, V] noise through a dozen int64 ops.
    vocab = 151936
    logits = torch.randn(t, vocab, device=dev)
    temp, seeds, counters = torch.full((t,), 0.6, device=dev), torch.arange(t, device=dev), torch.arange(t, device=dev)
    _report(bandwidth, "race_sample", shape, lambda: kernels.race_sample(logits, temp, seeds, counters),
            lambda: kernels.race_sample_ref(logits, temp, seeds, counters), t * vocab * 4)


def _moe_loop(x, gate_up, down, topk_weights, topk_ids):
    """The obvious torch MoE: for each expert, find its tokens, run its MLP, scatter-add the result."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(topk_ids == e)
        if token.numel() == 0:
            continue
        gate, up = (x[token] @ gate_up[e].t()).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ down[e].t()
        out.index_add_(0, token, y.float() * topk_weights[token, slot, None])
    return out.to(x.dtype)


def _moe_case(n: int, weights) -> tuple[tuple, torch.Tensor, int, float]:
    """(fused_moe's arguments, router scores, experts touched, floor bytes) for n random tokens."""
    d, inter, e, top_k = (QWEN3_30B_A3B_MOE[k] for k in ("hidden", "moe_inter", "experts", "top_k"))
    gate_up, down = weights
    x = torch.randn(n, d, device="cuda", dtype=BF16)
    scores = torch.randn(n, e, device="cuda")
    topk_weights, topk_ids = torch.topk(torch.softmax(scores, dim=-1), top_k, dim=-1)
    touched = topk_ids.unique().numel()  # on the host, outside the timing
    floor_bytes = touched * 3 * inter * d * BYTES + 2 * n * d * BYTES  # each touched expert read once
    return (x, gate_up, down, topk_weights, topk_ids), scores, touched, floor_bytes


def _bench_moe(bandwidth: float, n: int, weights) -> None:
    e, top_k = QWEN3_30B_A3B_MOE["experts"], QWEN3_30B_A3B_MOE["top_k"]
    args, scores, touched, floor_bytes = _moe_case(n, weights)
    loop_us = _time_us(lambda: _moe_loop(*args), graph=False)
    _report(bandwidth, "fused_moe", dict(tokens=n, experts_touched=touched),
            lambda: kernels.fused_moe(*args), lambda: kernels.fused_moe_ref(*args), floor_bytes,
            ref_graph=False, loop_us=round(loop_us, 2))
    logits = scores.to(BF16)
    _report(bandwidth, "moe_route", dict(tokens=n), lambda: kernels.moe_route(logits, top_k, True),
            lambda: kernels.moe_route_ref(logits, top_k, True), n * e * BYTES + n * top_k * (8 + BYTES))


def _bench_moe_paths(bandwidth: float, n: int, weights) -> None:
    """fused_moe forced onto its decode path (us) against its sorted path (ref_us) at n tokens. Same floor
    for both: the decode path re-reads an expert for every token routed to it (from L2 if it is lucky), so
    its pct_of_bw falls as tokens share experts, and the threshold belongs where us passes ref_us."""
    args, _, touched, floor_bytes = _moe_case(n, weights)
    x, gate_up, _, _, topk_ids = args
    decode, sorted_path = (lambda: kernels.fused_moe(*args, decode_max_tokens=n),
                           lambda: kernels.fused_moe(*args, decode_max_tokens=0))
    torch.testing.assert_close(decode(), sorted_path(), atol=3e-2, rtol=3e-2)  # bf16, as the GPU tests
    inter, num_assignments = gate_up.shape[1] // 2, topk_ids.numel()
    _report(bandwidth, "fused_moe_decode", dict(tokens=n, experts_touched=touched), decode, sorted_path,
            floor_bytes, ref="fused_moe sorted path",
            gate_up_blocks=kernels.moe_decode_blocks(num_assignments, inter, x.shape[1], BYTES, 2),
            down_blocks=kernels.moe_decode_blocks(n, x.shape[1], inter, BYTES, 1))


def _bench_decode_attention(bandwidth: float, b: int, ctx: int, width: int = 0) -> None:
    """width: block-table columns, as in a CUDA graph (sized for the longest context); 0 = just enough."""
    h, hkv, d = QWEN3_0_6B["heads"], QWEN3_0_6B["kv_heads"], QWEN3_0_6B["head_dim"]
    blocks_per_seq = triton.cdiv(ctx, PAGE_SIZE)
    num_blocks = b * blocks_per_seq + 1
    k_cache = torch.randn(num_blocks, PAGE_SIZE, hkv, d, device="cuda", dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    block_table = torch.randperm(num_blocks - 1, device="cuda")[: b * blocks_per_seq].view(b, -1).int()
    if width > blocks_per_seq:
        block_table = torch.nn.functional.pad(block_table, (0, width - blocks_per_seq))
    q = torch.randn(b, h, d, device="cuda", dtype=BF16)
    qsl = torch.arange(b + 1, device="cuda", dtype=torch.int32)
    seq_lens = torch.full((b,), ctx, device="cuda", dtype=torch.int32)
    args = (q, k_cache, v_cache, qsl, seq_lens, block_table, d**-0.5, 1)
    floor_bytes = 2 * b * ctx * hkv * d * BYTES + 2 * b * h * d * BYTES
    _report(bandwidth, "paged_attention_decode", dict(batch=b, context=ctx, table_blocks=block_table.shape[1]),
            lambda: kernels.paged_attention(*args), lambda: kernels.paged_attention_ref(*args), floor_bytes)


def _bench_packed_decode_attention(bandwidth: float, b: int, lo: int = 33, hi: int = 64) -> None:
    """decode_attention as the engine runs it (RoPE, Qwen3's norms and the KV write inside while the grid
    fits one wave) over b contexts of lo..hi keys: told they are short (max_seq_len = hi), it packs kv
    heads into a program; the reference column is the same kernel not told (one kv head a program)."""
    h, hkv, d = QWEN3_0_6B["heads"], QWEN3_0_6B["kv_heads"], QWEN3_0_6B["head_dim"]
    lens = torch.randint(lo, hi + 1, (b,))
    pages = -(-lens // PAGE_SIZE)
    num_blocks = int(pages.sum()) + 1  # + the scratch block
    k_cache = torch.randn(num_blocks, PAGE_SIZE, hkv, d, device="cuda", dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    block_table = torch.zeros(b, int(pages.max()), dtype=torch.int32)
    for r, page_ids in enumerate(torch.randperm(num_blocks - 1).split(pages.tolist())):
        block_table[r, :len(page_ids)] = page_ids
    seq_lens = lens.to("cuda", torch.int32)
    positions = seq_lens.long() - 1
    slots = block_table.cuda().gather(1, (positions // PAGE_SIZE)[:, None])[:, 0] * PAGE_SIZE + positions % PAGE_SIZE
    qkv = torch.randn(b, (h + 2 * hkv) * d, device="cuda", dtype=BF16)  # q, k, v: views of one matmul's output
    q, k, v = (t.view(b, -1, d) for t in qkv.split([h * d, hkv * d, hkv * d], dim=1))
    cos_sin = torch.randn(hi, d, device="cuda")
    norms = (torch.randn(d, device="cuda", dtype=BF16), torch.randn(d, device="cuda", dtype=BF16))
    args = (k, v, k_cache, v_cache, slots.long(), positions, seq_lens, block_table.cuda(), cos_sin, d**-0.5, *norms)
    packed = lambda q=q: kernels.decode_attention(q, *args, max_seq_len=hi)
    one_head = lambda q=q: kernels.decode_attention(q, *args)
    torch.testing.assert_close(packed(q.clone()), one_head(q.clone()), atol=3e-2, rtol=3e-2)  # bf16
    floor_bytes = 2 * int(lens.sum()) * hkv * d * BYTES + 2 * b * h * d * BYTES
    _report(bandwidth, "decode_attention_short", dict(batch=b, context=[lo, hi]), packed, one_head, floor_bytes,
            kv_heads_a_program=kernels._decode_pack(b, hkv), ref="one kv head a program")


def bench_kernels(bandwidth: float, groups=DEFAULT_KERNEL_GROUPS) -> None:
    """Print one JSON line per kernel and shape; the floors are bytes / bandwidth (bytes/s)."""
    torch.manual_seed(0)
    if "elementwise" in groups:
        for t in TOKENS:
            _bench_elementwise(bandwidth, t)
    if "moe" in groups:
        d, inter, e = (QWEN3_30B_A3B_MOE[k] for k in ("hidden", "moe_inter", "experts"))
        weights = (torch.randn(e, 2 * inter, d, device="cuda", dtype=BF16) * d**-0.5,  # gate_up [E, 2I, D]
                   torch.randn(e, d, inter, device="cuda", dtype=BF16) * inter**-0.5)  # down [E, D, I]
        for n in MOE_TOKENS:
            _bench_moe(bandwidth, n, weights)
        for n in MOE_DECODE_TOKENS:
            _bench_moe_paths(bandwidth, n, weights)
        del weights
    if "attention" in groups:
        for b in DECODE_BATCHES:
            for ctx in DECODE_CONTEXTS:
                _bench_decode_attention(bandwidth, b, ctx)
        for b in (1, 16):  # as the graphs run it: the table is as wide as max_model_len (8192 tokens)
            _bench_decode_attention(bandwidth, b, 128, width=8192 // PAGE_SIZE)
        for b in (64, 128, 256):
            _bench_packed_decode_attention(bandwidth, b)
    if "linear" in groups:
        bench_linear(bandwidth)
    if "tiles" in groups:
        sweep_linear_tiles(bandwidth)


LINEAR_REP_MS = 5  # timed replay per measurement; 84 measurements keep the run near 30 s
LINEAR_M = (1, 4, 16, 64)  # decode batch sizes the Triton linear serves on every matrix (128-256: tiles)
ROTATE_BYTES = 192 * 2**20  # weight copies cycled per shape: over 3x the 60 MB L2
# (K, N) of each matrix; layers = how often a decode step reads it.
LINEAR_SHAPES = {
    "qwen3_0.6b": dict(layers=28, qkv=(1024, 4096), o=(2048, 1024), gate_up=(1024, 6144), down=(3072, 1024),
                       lm_head=(1024, 151936)),
    "llama3.2_1b": dict(layers=16, qkv=(2048, 3072), o=(2048, 2048), gate_up=(2048, 16384), down=(8192, 2048),
                        lm_head=(2048, 128256)),
    "llama3_8b": dict(layers=32, qkv=(4096, 6144), o=(4096, 4096), gate_up=(4096, 28672), down=(14336, 4096)),
}


def _bench_matrix(bandwidth: float, model: str, name: str, k: int, n: int, m: int) -> dict:
    weight_bytes = n * k * 2
    copies = max(1, -(-ROTATE_BYTES // weight_bytes))
    weights = torch.randn(copies, n, k, device="cuda", dtype=BF16) * k**-0.5  # [copies, N, K]
    x = torch.randn(m, k, device="cuda", dtype=BF16)
    torch.testing.assert_close(kernels.linear(x, weights[0]), torch.nn.functional.linear(x, weights[0]), atol=3e-2, rtol=1.6e-2)
    ours, theirs = itertools.cycle(weights), itertools.cycle(weights)
    us = _time_us(lambda: kernels.linear(x, next(ours)), rep=LINEAR_REP_MS)
    cublas_us = _time_us(lambda: torch.nn.functional.linear(x, next(theirs)), rep=LINEAR_REP_MS)
    floor_us = weight_bytes / bandwidth * 1e6
    block_m, block_n, block_k, use_dot, _ = kernels._linear_blocks(m, n, k, 2)
    return dict(kernel="linear", model=model, matrix=name, M=m, N=n, K=k, us=round(us, 2),
                cublas_us=round(cublas_us, 2), floor_us=round(floor_us, 2), pct_of_bw=round(100 * floor_us / us, 1),
                cublas_pct_of_bw=round(100 * floor_us / cublas_us, 1), speedup=round(cublas_us / us, 2),
                blocks=[block_m, block_n, block_k], path="dot" if use_dot else "fma", programs=-(-n // block_n),
                weight_copies=copies, timing="cuda_graph")


def bench_linear(bandwidth: float) -> list[dict]:
    rows = []
    for model, spec in LINEAR_SHAPES.items():
        step = {m: [0.0, 0.0, 0.0] for m in LINEAR_M}  # M -> [us, cublas_us, floor_us] per decode step
        for name, shape in spec.items():
            if name == "layers":
                continue
            times = 1 if name == "lm_head" else spec["layers"]
            for m in LINEAR_M:
                row = _bench_matrix(bandwidth, model, name, *shape, m)
                print(json.dumps(row), flush=True)
                rows.append(row)
                for i, key in enumerate(("us", "cublas_us", "floor_us")):
                    step[m][i] += times * row[key]
        for m, (us, cublas_us, floor_us) in step.items():
            print(json.dumps(dict(kernel="linear_decode_step", model=model, M=m, us=round(us, 1),
                                  cublas_us=round(cublas_us, 1), floor_us=round(floor_us, 1),
                                  pct_of_bw=round(100 * floor_us / us, 1), speedup=round(cublas_us / us, 2))),
                  flush=True)
    return rows


TILE_ROWS = (16, 64, 128, 256)
TILE_LAYERS = 28  # each matrix is timed as a chain of this many calls over as many weight copies, as in a step
TILE_TOP = 8
TILE_REP_MS = 15  # timed replay per measurement: ~1,500 of them, about 3 minutes on the H200


def _tile_configs(m: int):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for the tl.dot linear at m rows: row blocks of 16
    at 16 rows, 32-128 (not past m) otherwise; at most 200 KB of shared memory for the pipeline's tiles."""
    block_ms = [16] if m <= 16 else [b for b in (32, 64, 128) if b <= m]
    for bm, bn, bk, stages in itertools.product(block_ms, (16, 32, 64, 128), (64, 128, 256), (3, 4, 5)):
        if stages * (bn + bm) * bk * BYTES <= 200 * 1024:
            for warps in (4, 8) if bm * bn >= 128 * 64 else (4,):
                yield bm, bn, bk, warps, stages


def sweep_linear_tiles(bandwidth: float) -> None:
    """The sweep behind kernels._linear_blocks' tl.dot tiles: each Qwen3-0.6B matrix at TILE_ROWS rows, as a
    chain of TILE_LAYERS calls in one CUDA graph (so programmatic dependent launch overlaps call with call,
    as in a step), for cuBLAS, the engine's own tiles and every tile of _tile_configs; us per call."""
    for m in TILE_ROWS:
        for name, shape in LINEAR_SHAPES["qwen3_0.6b"].items():
            if name == "layers":
                continue
            k, n = shape
            copies = 2 if name == "lm_head" else TILE_LAYERS  # the lm_head alone is 5x the L2
            ws = [torch.randn(n, k, device="cuda", dtype=BF16) * k**-0.5 for _ in range(copies)]
            x, out = torch.randn(m, k, device="cuda", dtype=BF16), torch.empty(m, n, device="cuda", dtype=BF16)
            ref = torch.nn.functional.linear(x, ws[0])
            chain = lambda fn: _time_us(lambda: [fn(w) for w in ws], rep=TILE_REP_MS) / copies
            row = dict(kernel="linear_tiles", M=m, matrix=name, floor_us=round(n * k * BYTES / bandwidth * 1e6, 2),
                       cublas_us=round(chain(lambda w: torch.nn.functional.linear(x, w)), 2),
                       engine_tile=kernels._linear_blocks(m, n, k, BYTES),
                       engine_us=round(chain(lambda w: kernels.linear(x, w)), 2))
            timed = []
            for cfg in _tile_configs(m):
                bm, bn, bk, warps, stages = cfg
                launch = lambda w: kernels._launch_linear(x, w, None, out, (bm, bn, bk, True, warps), num_stages=stages)
                try:
                    launch(ws[0])
                except triton.runtime.errors.OutOfResources:
                    continue
                torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)  # bf16, as the GPU tests
                timed.append((round(chain(launch), 2), cfg))
            row["top"] = sorted(timed)[:TILE_TOP]  # [us, (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)]
            print(json.dumps(row), flush=True)
            del ws


def cmd_kernels(a):
    groups = a.only.split(",") if a.only else DEFAULT_KERNEL_GROUPS
    for g in groups:
        if g not in KERNEL_GROUPS:
            raise ValueError(f"--only has {g!r}; choose from {', '.join(KERNEL_GROUPS)}")
    if not torch.cuda.is_available():
        raise ValueError("run.py kernels needs a CUDA device")
    bandwidth = floor_bandwidth(a, "cuda")
    emit(dict(device=torch.cuda.get_device_name(), **bandwidth_fields(*bandwidth)))
    bench_kernels(bandwidth[0], groups)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block: the CLI's rule for bad input
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is invalid: it must be >= 1")
    return n


def by_device(name: str, what: str) -> str:
    """Help for a bench flag whose default depends on the device (BENCH_DEFAULTS)."""
    on_cuda, on_cpu = BENCH_DEFAULTS[name]
    return f"{what} (default: {on_cuda} on CUDA, {on_cpu} on the CPU)"


def make_parser() -> Parser:
    """Every flag's help says its unit and its default; every command's says how long its defaults take."""
    p = Parser(prog="run.py", description=__doc__.splitlines()[0],
               epilog="Results: JSON lines on stdout (generate: its text, unless --json). Progress: stderr. "
                      "`run.py COMMAND --help` for each command's flags and time.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    common = Parser(add_help=False)
    common.add_argument("--model", default="tiny",
                        help=f"checkpoint folder or preset: {', '.join(PRESETS)} (default: %(default)s)")
    common.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    common.add_argument("--dtype", default=None,
                        help="float32, bfloat16 or float16 (default: bfloat16 on CUDA, float32 on the CPU)")
    common.add_argument("--seed", type=int, default=0,
                        help="seed of the random prompts, or of sampling for generate (default: %(default)s)")
    common.add_argument("--triton-linear-rows", type=int, default=None,
                        help="matmuls of up to N rows (0-256) in Triton, not cuBLAS (default: by the model on CUDA, "
                             "0 on the CPU)")
    common.add_argument("--triton-narrow-rows", type=int, default=None,
                        help="... and narrow ones (<= 4096 outputs) up to N rows, if more (default: by the model)")
    floors = Parser(add_help=False)  # the commands that report a bandwidth floor
    floors.add_argument("--bandwidth", type=float, default=None,
                        help="the device's memory bandwidth in bytes/s, for the floors (default: measured by a "
                             "large copy on the device, under a second; an H200 measures about 4.27e12)")

    def command(name: str, text: str, parents=(common,)) -> Parser:
        return sub.add_parser(name, parents=list(parents), help=text, description=text)

    g = command("generate", "generate from one prompt: its text, or its token ids (2-core CPU: ~10 s)")
    g.add_argument("--prompt", default=None,
                   help="the prompt as text; needs the model's tokenizer.json (default: none, give --prompt-ids)")
    g.add_argument("--prompt-ids", default=None, help="the prompt as comma-separated token ids (default: none)")
    g.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 = greedy (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the most likely tokens that hold this share of the probability; 1 = all "
                        "(default: %(default)s)")
    g.add_argument("--top-k", type=int, default=-1,
                   help="sample from this many most likely tokens; -1 = all (default: %(default)s)")
    g.add_argument("--json", action="store_true",
                   help="print one JSON line (ids, text, finish reason) (default: off, the text or the ids)")
    g.add_argument("--enforce-eager", action="store_true", default=None,
                   help="no CUDA graphs (default: graphs on CUDA, eager on the CPU)")
    o = command("overhead", "decode a batch under each configuration: a JSON header line (the bandwidth floor of "
                "a step), then one line per configuration (2-core CPU: ~1 min)", (common, floors))
    o.add_argument("--requests", type=positive, default=16, help="requests decoded together (default: %(default)s)")
    o.add_argument("--slots", type=positive, default=None,
                   help="max_num_seqs, requests the engine batches at most (default: --requests)")
    o.add_argument("--new-tokens", type=positive, default=64,
                   help="tokens each request generates (default: %(default)s)")
    o.add_argument("--prompt-len", type=positive, default=32,
                   help="tokens in each random prompt (default: %(default)s)")
    o.add_argument("--num-blocks", type=positive, default=None,
                   help="KV cache blocks of 16 tokens (default: 512 MiB of cache on the CPU, "
                        "gpu_memory_utilization=0.9 of the GPU on CUDA)")
    o.add_argument("--configs", default=None,
                   help=f"comma-separated subset of {','.join(CONFIGS)} (default: all; graphs only on CUDA)")
    b = command("bench", "offline throughput, nano-vllm's protocol: one JSON line (2-core CPU: ~1-2 min)",
                (common, floors))
    b.add_argument("--num-requests", type=positive, default=None, help=by_device("num_requests", "requests"))
    b.add_argument("--min-len", type=positive, default=None,
                   help=by_device("min_len", "fewest tokens in a prompt, and to generate"))
    b.add_argument("--max-len", type=positive, default=None,
                   help=by_device("max_len", "most tokens in a prompt, and to generate"))
    b.add_argument("--max-num-seqs", type=positive, default=256,
                   help="requests the engine batches at most (default: %(default)s)")
    b.add_argument("--max-num-batched-tokens", type=positive, default=16384,
                   help="tokens per step: prompts go in a few large chunks (default: %(default)s, nano-vllm's)")
    b.add_argument("--sync", action="store_true", help="sync scheduling (default: off, async)")
    b.add_argument("--enforce-eager", action="store_true", default=None,
                   help="no CUDA graphs (default: graphs on CUDA, eager on the CPU)")
    r = command("profile", "Chrome traces of decode steps per configuration, one JSON line each (2-core CPU: ~1 min)")
    r.add_argument("--requests", type=positive, default=16, help="requests decoded together (default: %(default)s)")
    r.add_argument("--prompt-len", type=positive, default=32,
                   help="tokens in each random prompt (default: %(default)s)")
    r.add_argument("--steps", type=positive, default=10, help="decode steps traced (default: %(default)s)")
    r.add_argument("--configs", default=None,
                   help=f"comma-separated subset of {','.join(CONFIGS)} (default: all; graphs only on CUDA)")
    r.add_argument("--out", default="traces", help="folder for the traces (default: %(default)s)")
    r.add_argument("--with-cpu", action="store_true",
                   help="on CUDA, trace the host's ops too, which slows the host (default: off, kernels only)")
    k = command("kernels", "each Triton kernel against its torch reference and its bandwidth floor, one JSON "
                "line per kernel and shape (CUDA only; a few minutes on an H200)", (floors,))
    k.add_argument("--only", default=None,
                   help=f"comma-separated subset of {','.join(KERNEL_GROUPS)} "
                        f"(default: {','.join(DEFAULT_KERNEL_GROUPS)}; tiles takes minutes)")
    return p


def parse_args(argv=None):
    return make_parser().parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    try:
        {"generate": cmd_generate, "overhead": cmd_overhead, "bench": cmd_bench, "profile": cmd_profile,
         "kernels": cmd_kernels}[a.cmd](a)
    except (ValueError, TypeError, OSError) as e:  # bad input (or a path it names): one line, no traceback
        print(f"run.py {a.cmd}: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
