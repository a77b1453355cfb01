"""nanoengine's command line: the only entry point besides the Python API.

    python run.py overhead --requests 16          # the main job: what fusion, graphs and async each buy
    python run.py generate --prompt-ids 1,2,3 --max-tokens 16
    python run.py bench                           # offline throughput, nano-vllm's protocol
    python run.py profile --requests 64           # Chrome traces of a few decode steps per configuration
    python run.py kernels                         # each Triton kernel against its torch reference (CUDA)

Bad input prints one line naming the problem and exits with status 2.
Imports nanoengine (and, for `kernels`, kernels.py).
"""
import argparse
import gc
import json
import os
import random
import sys
import time

import torch

from nanoengine import PRESETS, Engine, EngineConfig, SamplingParams, param_bytes

BANDWIDTH = 4.27e12  # bytes/s: the H200's measured device-to-device copy rate (../shared/GPU.md)

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


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def floor_seconds(engine: Engine, batch: int, context: int, bandwidth: float) -> float:
    """Bytes one decode step must move / bandwidth: weights once (for MoE only the experts a batch of
    this size touches, in expectation), plus every request's KV, plus the logits written."""
    mc, model = engine.model.config, engine.model
    total = param_bytes(model)
    elem = model.lm_head.weight.element_size()
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
                num_blocks=a.num_blocks)
    params = SamplingParams(temperature=0, max_tokens=a.new_tokens, ignore_eos=True)
    header, records, reference = None, [], None
    for name in names:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        engine = Engine(EngineConfig(**base, **CONFIGS[name]))
        prompts = random_prompts(a.requests, a.prompt_len, engine.model.config.vocab_size, a.seed)
        run_engine(engine, prompts, SamplingParams(temperature=0, max_tokens=3))  # warm up: compile, allocate
        r = run_engine(engine, prompts, params)
        header = header or overhead_header(engine, a, device)
        g = engine.runner.graphs
        if g is not None and g.use_cuda_graphs:
            header.update(graph_capture_s=round(g.capture_seconds, 2), graph_mem_mb=round(g.capture_bytes / 2**20, 1))
        reference = reference or r["outputs"]
        steps = max(r["steps"], 1)
        rec = dict(config=name, tok_s=round(r["decode_tokens"] / r["wall"], 1), steps=steps,
                   ms_per_step=round(1e3 * r["wall"] / steps, 3),
                   host_ms_per_step=round(1e3 * r["host_s"] / steps, 3))
        if device.startswith("cuda"):
            rec["gpu_ms_per_step"] = round(1e3 * r["gpu_s"] / steps, 3)
            rec["x_floor"] = round(r["wall"] / steps / header["floor_ms"] * 1e3, 2)
        rec["same_tokens"] = r["outputs"] == reference
        records.append(rec)
        del engine
        free_memory()
    for rec in [header] + records:  # the header carries the graphs' capture cost, known only now
        emit(rec)


def overhead_header(engine: Engine, a, device: str) -> dict:
    context = a.prompt_len + a.new_tokens // 2
    floor = floor_seconds(engine, a.requests, context, a.bandwidth)
    dev = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    return dict(device=dev, model=a.model, dtype=engine.cfg.dtype, requests=a.requests,
                prompt_len=a.prompt_len, new_tokens=a.new_tokens, floor_ms=round(floor * 1e3, 4),
                floor_note=f"decode step at mean context {context}: weights + KV bytes / {a.bandwidth / 1e12:.2f} TB/s")


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
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for o in step():
            done[o.request_id] = o
    sync(engine)
    st = engine.stats
    return dict(outputs=[done[i].token_ids for i in ids], wall=time.perf_counter() - t0, steps=st.steps,
                host_s=st.host_s, gpu_s=st.gpu_seconds(), decode_tokens=st.tokens)


def free_memory():
    """Give a dropped engine's GPU memory back now (its KV cache takes most of the card): its graphs and
    modules hold reference cycles, which only the cycle collector frees."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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
    engine = Engine(EngineConfig(model=a.model, device=a.device, dtype=a.dtype, enforce_eager=a.enforce_eager))
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
    engine = Engine(EngineConfig(model=a.model, device=device, dtype=a.dtype, enforce_eager=a.enforce_eager,
                                 async_scheduling=not a.sync, max_num_seqs=a.max_num_seqs))
    rng = random.Random(a.seed)
    vocab = engine.model.config.vocab_size
    reqs = [([rng.randrange(vocab) for _ in range(rng.randint(a.min_len, a.max_len))],
             SamplingParams(temperature=0.6, max_tokens=rng.randint(a.min_len, a.max_len), ignore_eos=True,
                            seed=i)) for i in range(a.num_requests)]
    run_engine(engine, [[1, 2, 3]], SamplingParams(max_tokens=4))  # warm up
    engine.stats.reset()
    for p, sp in reqs:
        engine.add_request(p, sp)
    step = engine.step_async if engine.cfg.async_scheduling else engine.step
    out_tokens, t0, last = 0, time.perf_counter(), 0.0
    while engine.has_unfinished():
        for o in step():
            out_tokens += len(o.token_ids)
        now = time.perf_counter()
        if now - last > 2:
            last = now
            print(f"  {out_tokens} tokens from finished requests, {now - t0:.1f} s, "
                  f"{len(engine.scheduler.requests)} left", file=sys.stderr, flush=True)
    sync(engine)
    wall = time.perf_counter() - t0
    prompt_tokens = sum(len(p) for p, _ in reqs)
    emit(dict(model=a.model, requests=a.num_requests, output_tokens=out_tokens, prompt_tokens=prompt_tokens,
              wall_s=round(wall, 2), output_tok_s=round(out_tokens / wall, 1),
              total_tok_s=round((out_tokens + prompt_tokens) / wall, 1), steps=engine.stats.steps,
              host_ms_per_step=round(1e3 * engine.stats.host_s / max(engine.stats.steps, 1), 3),
              floor_s=round(bench_floor(engine, reqs, a.bandwidth), 2)))


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
        engine = Engine(EngineConfig(model=a.model, device=device, dtype=a.dtype, max_num_seqs=a.requests,
                                     **CONFIGS[name]))
        prompts = random_prompts(a.requests, a.prompt_len, engine.model.config.vocab_size, a.seed)
        for p in prompts:
            engine.add_request(p, SamplingParams(temperature=0, max_tokens=a.steps + 20, ignore_eos=True))
        step = engine.step_async if engine.cfg.async_scheduling else engine.step
        for _ in range(8):  # prefill and warm-up decode steps, outside the trace
            step()
        sync(engine)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            for _ in range(a.steps):
                step()
            sync(engine)
        path = os.path.join(a.out, f"{a.model}-{a.requests}-{name.replace('+', '_')}.json")
        prof.export_chrome_trace(path)
        emit(dict(config=name, requests=a.requests, trace=path, **trace_summary(path, a.steps, cuda)))
        while engine.has_unfinished():
            step()
        del engine
        free_memory()


def trace_summary(path: str, steps: int, cuda: bool) -> dict:
    """From the Chrome trace: GPU kernels per step, busy fraction of the traced span, mean idle gap."""
    if not cuda:
        return dict(note="CPU run: no GPU timeline")
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("cat") == "kernel" and "dur" in e)
    if not kernels:
        return dict(note="no kernels in the trace")
    busy, gaps, end = 0.0, [], kernels[0][0]
    for s, e in kernels:  # merge overlaps; a gap is time with no kernel running
        if s > end:
            gaps.append(s - end)
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
    span = end - kernels[0][0]
    return dict(kernels_per_step=round(len(kernels) / steps, 1), gpu_busy=round(busy / span, 4),
                gpu_idle_pct=round(100 * (1 - busy / span), 2), mean_gap_us=round(sum(gaps) / max(len(gaps), 1), 2),
                span_ms_per_step=round(span / steps / 1e3, 3))


def cmd_kernels(a):
    bench_kernels()


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block: the CLI's rule for bad input
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is invalid: it must be >= 1")
    return n


def parse_args(argv=None):
    p = Parser(prog="run.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    common = Parser(add_help=False)
    common.add_argument("--model", default="tiny", help=f"checkpoint folder or preset: {', '.join(PRESETS)}")
    common.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    common.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: by device)")
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--bandwidth", type=float, default=BANDWIDTH, help="bytes/s for the floor")
    g = sub.add_parser("generate", parents=[common], help="generate from one prompt")
    g.add_argument("--prompt", default=None)
    g.add_argument("--prompt-ids", default=None, help="comma-separated token ids")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the CLI's default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--json", action="store_true")
    g.add_argument("--enforce-eager", action="store_true", default=None)
    o = sub.add_parser("overhead", parents=[common], help="decode a batch under each configuration")
    o.add_argument("--requests", type=positive, default=16)
    o.add_argument("--slots", type=positive, default=None, help="max_num_seqs (default: --requests)")
    o.add_argument("--new-tokens", type=positive, default=64)
    o.add_argument("--prompt-len", type=positive, default=32)
    o.add_argument("--num-blocks", type=positive, default=None)
    o.add_argument("--configs", default=None, help=f"comma-separated subset of {','.join(CONFIGS)}")
    b = sub.add_parser("bench", parents=[common], help="offline throughput (nano-vllm's protocol)")
    b.add_argument("--num-requests", type=positive, default=256)
    b.add_argument("--min-len", type=positive, default=100)
    b.add_argument("--max-len", type=positive, default=1024)
    b.add_argument("--max-num-seqs", type=positive, default=256)
    b.add_argument("--sync", action="store_true", help="sync scheduling (default: async)")
    b.add_argument("--enforce-eager", action="store_true", default=None)
    r = sub.add_parser("profile", parents=[common], help="Chrome traces of decode steps per configuration")
    r.add_argument("--requests", type=positive, default=16)
    r.add_argument("--prompt-len", type=positive, default=32)
    r.add_argument("--steps", type=positive, default=10)
    r.add_argument("--configs", default=None)
    r.add_argument("--out", default="traces")
    sub.add_parser("kernels", parents=[common], help="Triton kernels vs torch references (CUDA)")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    try:
        {"generate": cmd_generate, "overhead": cmd_overhead, "bench": cmd_bench, "profile": cmd_profile,
         "kernels": cmd_kernels}[a.cmd](a)
    except ValueError as e:
        print(f"run.py {a.cmd}: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
