"""nanoengine's command line: the only entry point besides the Python API.

    python run.py overhead --requests 16          # the main job: the ladder, eager -> fused -> graphs -> async -> tuned
    python run.py generate --prompt-ids 1,2,3 --max-tokens 16 [--stream] [--json]
    python run.py bench                           # offline throughput, nano-vllm's protocol
    python run.py online --rate 16,64,128         # Poisson arrivals: TTFT, TPOT, ITL, end-to-end latency

Results: JSON lines on stdout (generate: its text, unless --json); progress: stderr; bad input: one line, status 2.
Each command's --help says how long it takes (smaller defaults on the CPU). Imports nanoengine and its kernels."""
import argparse
import collections
import itertools
import json
import math
import os
import random
import sys
import time

import torch
import triton
from torch.profiler import ProfilerActivity, profile

from nanoengine import PRESETS, TUNED, Engine, EngineConfig, SamplingParams, kernels, param_bytes

# The floors divide bytes by the device's bandwidth: --bandwidth, else measured by a copy of this many bytes
# (past every cache: the H200's L2 is 60 MB), the best of COPY_REPEATS, well under a second.
COPY_BYTES = dict(cuda=1 << 30, cpu=256 << 20)
COPY_REPEATS = 5
# Defaults that depend on the device, (CUDA, CPU): on the CPU the torch reference attention reads every
# request's whole context each step, so fewer and shorter requests, for a run of a minute or two.
DEVICE_DEFAULTS = dict(num_requests=(256, 64), min_len=(100, 16), max_len=(1024, 128),  # bench
                       requests=(200, 24), min_prompt=(256, 16), max_prompt=(1024, 64),
                       output_len=(128, 16), join_prompt_len=(1024, 256))  # online
PROGRESS_S = 5.0  # seconds between progress lines of the long runs
PROFILED_STEPS = 5  # decode steps a profile covers (overhead's kernel count, --trace)

# The ladder: name -> engine settings, each adding one technique to the row above. Graphs need CUDA.
CONFIGS = {
    "eager": dict(fuse=False, tuned=False, enforce_eager=True),
    "fused": dict(fuse=True, tuned=False, enforce_eager=True),
    "fused+async": dict(fuse=True, tuned=False, enforce_eager=True, async_scheduling=True),
    "fused+graphs": dict(fuse=True, tuned=False, enforce_eager=False),
    "fused+graphs+async": dict(fuse=True, tuned=False, enforce_eager=False, async_scheduling=True),
    "tuned": dict(fuse=True, enforce_eager=None, async_scheduling=True),  # tuned: --tuned (all by default)
}
CPU_CONFIGS = ("eager", "fused", "fused+async", "tuned")
CUDA_CONFIGS = ("eager", "fused", "fused+graphs", "fused+graphs+async", "tuned")
# The flags named as EngineConfig fields, which the commands that have them pass on as they are
ENGINE_FLAGS = ("model", "dtype", "tuned", "enforce_eager", "triton_linear_rows", "triton_narrow_rows", "num_blocks",
                "max_num_seqs", "max_num_batched_tokens", "cudagraph_mode", "device", "tensor_parallel_size")


def emit(record: dict):
    print(json.dumps(record), flush=True)


def note(text: str):
    """Progress for whoever watches, on stderr: stdout carries the results only."""
    print(text, file=sys.stderr, flush=True)


def engine_settings(a, **settings) -> dict:
    return {name: getattr(a, name) for name in ENGINE_FLAGS if hasattr(a, name)} | settings


def make_engine(label: str, settings: dict) -> Engine:
    """Engine(EngineConfig(**settings)) between two progress lines: a big model, or CUDA graphs, take a while."""
    cfg = EngineConfig(**settings)
    note(f"{label}: building the engine ({cfg.model}, {cfg.device}) ...")
    t0 = time.perf_counter()
    engine = Engine(cfg)
    g = engine.runner.graphs
    captured = f", {len(g.graphs)} graphs in {g.capture_seconds:.1f} s, {g.capture_bytes / 2**20:.0f} MiB" \
        if g is not None and g.graphs else ""
    note(f"{label}: ready in {time.perf_counter() - t0:.1f} s ({engine.book.blocks.num_blocks} KV blocks{captured})")
    return engine


def measure_bandwidth(device: str) -> float:
    """Bytes read + written per second by a large copy: the most a decode step's reads of weights and KV reach."""
    src = torch.ones(COPY_BYTES["cuda" if device.startswith("cuda") else "cpu"], dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(COPY_REPEATS + 1):  # the first touches dst's pages: only the best counts
        sync_device(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync_device(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best


def floor_bandwidth(a) -> tuple[float, dict]:
    """The bytes/s the floors divide by (--bandwidth, else measured here), and the JSON fields that report it."""
    if a.bandwidth is None:
        note(f"measuring the copy bandwidth of {a.device} (under a second; --bandwidth skips it) ...")
        bandwidth, source = measure_bandwidth(a.device), "measured"
    elif a.bandwidth > 0:
        bandwidth, source = a.bandwidth, "--bandwidth"
    else:
        raise ValueError(f"--bandwidth {a.bandwidth} is invalid: give the device's bytes/s, e.g. 4.27e12")
    return bandwidth, dict(bandwidth_gb_s=round(bandwidth / 1e9, 1), bandwidth_source=source)


def sync_device(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def stepper(engine: Engine):
    return engine.step_async if engine.cfg.async_scheduling else engine.step


def percentiles(values: list[float], scale: float = 1e3) -> dict:
    """p50 / p90 / p99 (nearest rank), in ms for seconds."""
    v = sorted(values)
    pick = lambda q: round(scale * v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))], 3) if v else None  # noqa
    return dict(p50=pick(0.5), p90=pick(0.9), p99=pick(0.99))


# ----------------------------------------------------------------------------------------------------------
# run.py overhead: the ladder, each configuration one technique on from the one before
def ladder(a, cuda: bool) -> list[str]:
    """The configurations of --configs, checked, else every one this device runs."""
    names = a.configs.split(",") if a.configs else list(CUDA_CONFIGS if cuda else CPU_CONFIGS)
    for name in names:
        if name not in CONFIGS or ("graphs" in name and not cuda):
            raise ValueError(f"--configs has {name!r}; choose from {', '.join(CONFIGS)} (graphs need CUDA)")
    return names


def cmd_overhead(a):
    cuda = a.device.startswith("cuda")
    names, slots = ladder(a, cuda), a.slots or a.requests
    EngineConfig(**engine_settings(a, max_num_seqs=slots))  # bad settings fail here, before any progress line
    bandwidth, bandwidth_fields = floor_bandwidth(a)
    tau = launch_costs() if cuda else None
    params = SamplingParams(temperature=0, max_tokens=a.new_tokens, ignore_eos=True, output_kind="final_only")
    header, records, reference, fused_reference = None, [], None, None
    for name in names:
        engine = make_engine(name, engine_settings(a, max_num_seqs=slots, **CONFIGS[name]))
        rng, vocab = random.Random(a.seed), engine.model.config.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(a.prompt_len)] for _ in range(a.requests)]
        note(f"{name}: warm-up, then {a.requests} requests x {a.new_tokens} tokens ...")
        run_engine(engine, prompts, SamplingParams(temperature=0, max_tokens=3, output_kind="final_only"))
        r = run_engine(engine, prompts, params)
        header = header or overhead_header(engine, a, bandwidth, bandwidth_fields)
        reference = reference or r["outputs"]
        fused_reference = fused_reference or (r["outputs"] if name != "eager" else None)
        steps = max(r["steps"], 1)
        rec = dict(config=name, tok_s=round(r["decode_tokens"] / r["wall"], 1), steps=steps,
                   ms_per_step=round(1e3 * r["wall"] / steps, 3), host_ms_per_step=round(1e3 * r["host_s"] / steps, 3))
        if name == "tuned":
            rec["tuned"] = ",".join(sorted(engine.cfg.tuned))
        if cuda or a.trace:
            prof = profile_steps(engine, prompts)
        if cuda:
            rec["gpu_ms_per_step"] = round(1e3 * r["gpu_s"] / steps, 3)
            rec["x_floor"] = round(r["wall"] / steps / header["floor_ms"] * 1e3, 2)
            # Wall time not covered by any step's device time: the GPU waiting for the host between steps.
            rec["idle_between_steps_pct"] = round(100 * max(0.0, 1 - r["gpu_s"] / r["wall"]), 1)
            rec.update(launch_model(engine, prof, header["floor_ms"], tau))
        if a.trace:  # one timeline a rung, for chrome://tracing or ui.perfetto.dev
            os.makedirs(a.trace, exist_ok=True)
            rec["trace"] = os.path.join(a.trace, f"{name}.json")
            prof.export_chrome_trace(rec["trace"])
        if r["tokens_run"]:  # the graphs' padding: tokens run for the tokens the steps had
            rec["padding_pct"] = round(100 * (1 - r["tokens_real"] / r["tokens_run"]), 1)
        rec["same_tokens"] = r["outputs"] == reference
        if name != "eager":  # in bf16, fused kernels round differently from eager torch ops
            rec["same_as_fused"] = r["outputs"] == fused_reference
            rec["share_as_fused"] = same_share(r["outputs"], fused_reference)
        records.append(rec)
        note(f"{name}: {rec['tok_s']} tok/s, {rec['ms_per_step']} ms a step ({rec['host_ms_per_step']} ms on the "
             f"host), same tokens as {names[0]}: {rec['same_tokens']}")
        engine.close()  # its KV cache and graphs go before the next configuration sizes its own
    if header is not None and tau:
        header["tau_us"] = {k: round(v, 2) for k, v in tau.items()}
    for rec in [header] + records:
        emit(rec)


def same_share(outputs: list, reference: list) -> float:
    """The share of tokens equal to the reference's at the same place: in bf16 one changed reduction order
    can flip a near-tie, and each request's tokens after it differ."""
    pairs = [(a, b) for x, y in zip(outputs, reference) for a, b in zip(x, y)]
    return round(sum(a == b for a, b in pairs) / max(len(pairs), 1), 4)


def overhead_header(engine: Engine, a, bandwidth: float, bandwidth_fields: dict) -> dict:
    """The header line, with the floor of a decode step at mean context: the bytes it must move / bandwidth: weights
    once (for MoE only the experts a batch of this size touches, in expectation), every request's KV, the logits."""
    mc, model, batch, context = engine.model.config, engine.model, a.requests, a.prompt_len + a.new_tokens // 2
    total, elem = param_bytes(model), model.lm_head.weight.element_size()
    if not mc.tie_word_embeddings:  # the embedding table is only gathered from (B rows), not read whole
        total -= model.model.embed_tokens.weight.numel() * elem
    if mc.num_experts:
        per_expert = 3 * mc.hidden_size * mc.moe_intermediate_size * elem
        moe_layers = sum(mc.is_moe_layer(i) for i in range(mc.num_layers))
        touched = mc.num_experts * (1 - (1 - mc.num_experts_per_tok / mc.num_experts) ** batch)
        total -= moe_layers * (mc.num_experts - touched) * per_expert
    kv = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * elem * context * batch
    floor = (total + kv + batch * mc.vocab_size * 4) / bandwidth
    return dict(device=torch.cuda.get_device_name() if engine.cuda else "cpu", model=a.model, dtype=engine.cfg.dtype,
                requests=a.requests, prompt_len=a.prompt_len, new_tokens=a.new_tokens, floor_ms=round(floor * 1e3, 4),
                **bandwidth_fields,
                floor_note=f"decode step at mean context {context}: weights + KV bytes / {bandwidth / 1e12:.3f} TB/s")


def run_engine(engine: Engine, prompts, params) -> dict:
    """Run prompts to the end; time only the decode steps (from when every request has its first token)."""
    ids = [engine.add_request(p, params) for p in prompts]
    step, done = stepper(engine), {}
    while engine.has_unfinished():  # prefill, untimed
        done.update({o.request_id: o for o in step()})
        if all(r.num_output_tokens > 0 for r in engine.book.requests.values()):
            break
    sync_device(engine.cfg.device)
    engine.stats.reset()
    engine.stats.timing = True  # device time per decode step, for gpu_ms_per_step
    graphs = engine.runner.graphs
    if graphs is not None:
        graphs.tokens_run = graphs.tokens_real = 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        done.update({o.request_id: o for o in step()})
    sync_device(engine.cfg.device)
    st = engine.stats
    return dict(outputs=[done[i].token_ids for i in ids], wall=time.perf_counter() - t0, steps=st.steps,
                host_s=st.host_s, gpu_s=st.gpu_seconds() if engine.cuda else 0.0, decode_tokens=st.tokens,
                tokens_run=graphs.tokens_run if graphs else 0, tokens_real=graphs.tokens_real if graphs else 0)


def launch_costs() -> dict:
    """tau in us: host time to launch one tiny kernel eagerly (a torch op, a Triton kernel), or a graph of one."""
    x, y = torch.zeros(16, device="cuda"), torch.zeros(1, 2, device="cuda")

    def per_call(fn, n=500) -> float:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e6

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
    return dict(torch=per_call(lambda: x.add_(1)), triton=per_call(lambda: kernels.silu_and_mul(y)),
                replay=per_call(graph.replay))


def profile_steps(engine: Engine, prompts, steps: int = PROFILED_STEPS):
    """torch.profiler (host, and the GPU's kernels on CUDA) over `steps` decode steps of the prompts' requests,
    after 3 untraced ones (prefill among them); 12 tokens to spare keep every request decoding in each traced step."""
    params = SamplingParams(temperature=0, max_tokens=3 + steps + 12, ignore_eos=True, output_kind="final_only")
    for p in prompts:
        engine.add_request(p, params)
    step = stepper(engine)
    for _ in range(3):
        step()
    sync_device(engine.cfg.device)
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * engine.cuda) as prof:
        for _ in range(steps):
            step()
        sync_device(engine.cfg.device)
    while engine.has_unfinished():
        step()
    return prof


def launch_model(engine: Engine, prof, floor_ms: float, tau: dict) -> dict:
    """The launch model beside the measured step: eager ~ T_compute + N tau (each of a step's N kernels launched
    from Python), graphed ~ T_compute + tau (one replay); T_compute: the floor; N: kernels a profiled step."""
    n = sum(e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
            for e in prof.events()) / PROFILED_STEPS
    graphed = engine.runner.graphs is not None
    tau_us = tau["replay"] if graphed else tau["torch" if not engine.cfg.fuse else "triton"]
    return dict(kernels_per_step=round(n, 1), launch_tau_us=round(tau_us, 2),
                predicted_ms=round(floor_ms + (tau_us if graphed else n * tau_us) / 1e3, 3))


# ----------------------------------------------------------------------------------------------------------
# run.py online: requests arrive over time; what a user waits for
def cmd_online(a):
    if a.min_prompt > a.max_prompt:
        raise ValueError(f"--min-prompt {a.min_prompt} is more than --max-prompt {a.max_prompt}")
    rates = [None] if a.burst else online_rates(a.rate)
    engine = make_engine("online", engine_settings(a, async_scheduling=not a.sync))
    rng, vocab = random.Random(a.seed), engine.model.config.vocab_size
    loads = []
    for rate in rates:  # Poisson arrivals: exponential gaps at `rate` a second (all at 0 with --burst)
        arrivals = itertools.accumulate(0.0 if rate is None else rng.expovariate(rate) for _ in range(a.requests))
        loads.append([(s, [rng.randrange(vocab) for _ in range(rng.randint(a.min_prompt, a.max_prompt))])
                      for s in arrivals])
    note(f"online: a step with one {a.join_prompt_len}-token prompt joining 16 decodes, three times ...")
    join = [join_step(engine, a.join_prompt_len, rng) for _ in range(3)]
    note("online: warm-up, 8 requests like the load's ...")
    drive(engine, [(0.0, p) for _, p in loads[0][:8]], a.output_len)
    for rate, load in zip(rates, loads):
        note(f"online: {a.requests} requests, {'all at once' if rate is None else f'{rate:g} a second'} ...")
        emit(online_record(engine, a, rate, load) | dict(
            join_step_ms=dict(prompt_tokens=a.join_prompt_len, decodes=16, first=join[0], median=sorted(join)[1])))
    engine.close()


def online_rates(text: str) -> list[float]:
    """--rate: requests a second, one number or several comma-separated."""
    try:
        rates = [float(r) for r in text.split(",")]
    except ValueError:
        raise ValueError(f"--rate {text!r} is invalid: give requests per second, comma-separated for several") from None
    bad = [r for r in rates if not r > 0]  # NaN too
    if bad:
        raise ValueError(f"--rate {bad[0]} is invalid: give requests per second > 0, or --burst")
    return rates


def online_record(engine: Engine, a, rate: float | None, load: list) -> dict:
    """One load run: what its users waited for, and the steps' times."""
    compiles = CompileCounter(engine.cuda)
    engine.stats.reset()
    engine.stats.timing = True
    r = drive(engine, load, a.output_len)
    compiles.stop()
    times, out_tokens = r["times"], sum(len(t) for _, t in r["times"])
    steps = engine.stats.step_seconds()  # waits for the last step's end event, once
    engine.stats.timing = False
    decode_steps, prompt_steps = [s for s, prompt in steps if not prompt], [s for s, prompt in steps if prompt]
    return dict(model=a.model, device=torch.cuda.get_device_name() if engine.cuda else "cpu", requests=a.requests,
                rate=rate, burst=a.burst, prompt_tokens=f"uniform {a.min_prompt}-{a.max_prompt}",
                output_tokens_each=a.output_len, tuned=",".join(sorted(engine.cfg.tuned)),
                graphs=None if engine.runner.graphs is None else engine.cfg.cudagraph_mode,
                duration_s=round(r["wall"], 2), output_tok_s=round(out_tokens / r["wall"], 1),
                total_tok_s=round((out_tokens + sum(len(p) for _, p in load)) / r["wall"], 1),
                offered_output_tok_s=None if rate is None else round(rate * a.output_len, 1),
                # the run ends at its last arrival plus that request's decode: this sample's ceiling on output_tok_s
                last_arrival_s=round(max(s for s, _ in load), 3),
                ttft_ms=percentiles([t[0] - s for s, t in times]),
                tpot_ms=percentiles([(t[-1] - t[0]) / (len(t) - 1) for _, t in times if len(t) > 1]),
                itl_ms=percentiles([b - x for _, t in times for x, b in zip(t, t[1:])]),
                e2e_ms=percentiles([t[-1] - s for s, t in times]),
                decode_step_ms=dict(percentiles(decode_steps), n=len(decode_steps)),
                prompt_step_ms=dict(percentiles(prompt_steps), n=len(prompt_steps)),
                step_timing="gpu events" if engine.cuda else "host wall", compiles_during_run=compiles.count)


def drive(engine: Engine, load: list, output_len: int) -> dict:
    """Add each (arrival s, prompt) when its time comes, step while anything runs, and note when each token
    reaches the host. Returns the wall time and, per request, (its arrival, its tokens' times)."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, output_kind="delta")
    step, pending, times = stepper(engine), collections.deque(sorted(load, key=lambda x: x[0])), {}
    t0 = last = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= time.perf_counter() - t0:
            arrival, prompt = pending.popleft()
            times[engine.add_request(prompt, params)] = (t0 + arrival, [])
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][0] - (time.perf_counter() - t0)))
            continue
        for o in step():
            times[o.request_id][1].extend([time.perf_counter()] * len(o.new_token_ids))
        if time.perf_counter() - last > PROGRESS_S:
            last = time.perf_counter()
            note(f"  {last - t0:.0f} s: {len(times)} arrived, {len(engine.book.requests)} running or waiting")
    sync_device(engine.cfg.device)
    return dict(wall=time.perf_counter() - t0, times=list(times.values()))


def join_step(engine: Engine, prompt_len: int, rng, decodes: int = 16) -> float:
    """ms of the one step (sync) in which a prompt_len-token prompt joins `decodes` running decodes: device
    time on CUDA, wall time on the CPU."""
    vocab, sp = engine.model.config.vocab_size, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    ids = [engine.add_request([rng.randrange(vocab) for _ in range(32)], sp) for _ in range(decodes)]
    while engine.has_unfinished() and any(r.num_output_tokens < 2 for r in engine.book.requests.values()):
        engine.step()
    engine.stats.reset()
    engine.stats.timing = True
    ids.append(engine.add_request([rng.randrange(vocab) for _ in range(prompt_len)], sp))
    engine.step()
    ms = 1e3 * engine.stats.step_seconds()[-1][0]
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    engine.stats.timing = False
    return round(ms, 3)


class CompileCounter:
    """Triton kernels compiled (or loaded from disk) while it runs: a kernel's first launch with new
    specialisations stalls the GPU for up to a second, which a load must never meet."""

    def __init__(self, cuda: bool):
        self.count, self.prev = None, triton.knobs.runtime.jit_post_compile_hook
        if cuda:  # an engine on the CPU runs torch (or the interpreter), which compiles nothing: None
            self.count = 0
            triton.knobs.runtime.jit_post_compile_hook = self.hook

    def hook(self, *args, **kwargs):
        self.count += 1
        return self.prev(*args, **kwargs) if self.prev else None

    def stop(self):
        triton.knobs.runtime.jit_post_compile_hook = self.prev


# ----------------------------------------------------------------------------------------------------------
# run.py generate and bench
def cmd_generate(a):
    if (a.prompt is None) == (a.prompt_ids is None):
        raise ValueError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    try:
        prompt = a.prompt if a.prompt_ids is None else [int(t) for t in a.prompt_ids.split(",")]
    except ValueError:
        raise ValueError(f"--prompt-ids {a.prompt_ids!r} is invalid: give comma-separated integers") from None
    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, max_tokens=a.max_tokens,
                            seed=a.seed, output_kind="delta" if a.stream else "final_only")
    # No progress lines: the command is short, and bad input (a model, a prompt) prints its one line alone
    engine = Engine(EngineConfig(**engine_settings(a)))
    if a.stream:  # each output as it reaches the host: its new text (with a tokenizer) or ids, or a JSON line
        for o in engine.stream(prompt, params):
            if a.json:
                emit(dict(token_ids=o.new_token_ids, text=o.text, finished=o.finished, finish_reason=o.finish_reason))
            else:
                print(" ".join(map(str, o.new_token_ids)) + " " if o.text is None else o.text, end="", flush=True)
        if not a.json:
            print()
        return
    engine.add_request(prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    o = outs[-1]
    if a.json:
        emit(dict(prompt_token_ids=o.prompt_token_ids, token_ids=o.token_ids, text=o.text,
                  finish_reason=o.finish_reason, ttft_s=o.metrics["ttft"]))
    else:
        print(o.text if o.text is not None else " ".join(map(str, o.token_ids)))


def cmd_bench(a):
    """nano-vllm's offline protocol: random prompt and output lengths in [min_len, max_len], ignore_eos."""
    if a.min_len > a.max_len:
        raise ValueError(f"--min-len {a.min_len} is more than --max-len {a.max_len}")
    bandwidth, bandwidth_fields = floor_bandwidth(a)  # before the engine takes the GPU's memory
    engine = make_engine("bench", engine_settings(a, async_scheduling=not a.sync))
    rng, vocab = random.Random(a.seed), engine.model.config.vocab_size
    reqs = [([rng.randrange(vocab) for _ in range(rng.randint(a.min_len, a.max_len))],
             SamplingParams(temperature=0.6, max_tokens=rng.randint(a.min_len, a.max_len), ignore_eos=True, seed=i,
                            output_kind="final_only")) for i in range(a.num_requests)]
    # Warm up with a run like the timed one (other prompts of the same lengths, a few tokens each), so no
    # Triton kernel compiles inside the timed run: prefill chunks, mixed steps and decode meet its shapes.
    warm_rng = random.Random(a.seed + 1)
    warm = [[warm_rng.randrange(vocab) for _ in range(len(p))] for p, _ in reqs]
    prompt_tokens, planned = sum(len(p) for p, _ in reqs), sum(sp.max_tokens for _, sp in reqs)
    note(f"bench: warm-up, {len(warm)} prompts ({prompt_tokens} tokens) x 8 new tokens ...")
    run_engine(engine, warm, SamplingParams(temperature=0.6, seed=0, max_tokens=8, ignore_eos=True,
                                            output_kind="final_only"))
    note(f"bench: timed run, {a.num_requests} requests, {prompt_tokens} prompt + {planned} output tokens ...")
    engine.stats.reset()
    engine.stats.timing = True  # device time per step: how much of the run the GPU was busy
    for p, sp in reqs:
        engine.add_request(p, sp)
    step, out_tokens, t0, last = stepper(engine), 0, time.perf_counter(), time.perf_counter()
    while engine.has_unfinished():
        for o in step():
            out_tokens += len(o.token_ids)
        if time.perf_counter() - last > PROGRESS_S:
            last = time.perf_counter()
            note(f"  {engine.stats.tokens} of {planned} output tokens, {last - t0:.0f} s, "
                 f"{len(engine.book.requests)} requests left")
    sync_device(a.device)
    wall, st = time.perf_counter() - t0, engine.stats
    emit(dict(model=a.model, tuned=",".join(sorted(engine.cfg.tuned)), requests=a.num_requests,
              output_tokens=out_tokens, prompt_tokens=prompt_tokens, wall_s=round(wall, 2),
              output_tok_s=round(out_tokens / wall, 1), total_tok_s=round((out_tokens + prompt_tokens) / wall, 1),
              steps=st.steps, host_ms_per_step=round(1e3 * st.host_s / max(st.steps, 1), 3),
              gpu_busy_pct=round(100 * st.gpu_seconds() / wall, 1) if engine.cuda else None,
              floor_s=round(bench_floor(engine, reqs, bandwidth), 2), **bandwidth_fields))
    engine.close()


def bench_floor(engine: Engine, reqs, bandwidth: float) -> float:
    """A lower bound for the run as scheduled: each step reads the weights once; each generated token
    reads its context's KV once. (Prefill compute is ignored: decode dominates this workload.)"""
    mc = engine.model.config
    kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * engine.model.lm_head.weight.element_size()
    kv = sum(kv_per_token * (len(p) * sp.max_tokens + sp.max_tokens ** 2 / 2) for p, sp in reqs)
    return (engine.stats.steps * param_bytes(engine.model) + kv) / bandwidth


# ----------------------------------------------------------------------------------------------------------
# The command line
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
    on_cuda, on_cpu = DEVICE_DEFAULTS[name]
    return f"{what} (default: {on_cuda} on CUDA, {on_cpu} on the CPU)"


def make_parser() -> Parser:
    """Every flag's help says its unit and its default; every command's says how long its defaults take."""
    p = Parser(prog="run.py", description=__doc__.splitlines()[0], epilog="Results: JSON lines on stdout (generate: "
               "its text, unless --json). Progress: stderr. `run.py COMMAND --help` for a command's flags and time.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    common = Parser(add_help=False)
    common.add_argument("--model", default="tiny",
                        help=f"checkpoint folder or preset: {', '.join(PRESETS)} (default: %(default)s)")
    common.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda or cpu (default: cuda if available)")
    common.add_argument("--dtype", help="float32, bfloat16 or float16 (default: bfloat16 on CUDA, float32 on the CPU)")
    common.add_argument("--seed", type=int, default=0, help="seed of the prompts and sampling (default: %(default)s)")
    common.add_argument("--tuned", nargs="?", const=True, metavar="VARIANTS",
                        help=f"Part 2's variants: all with no value; or some, comma-separated, of {', '.join(TUNED)}; "
                             "or '-a,-b': all but those (default: all; none for generate and overhead's untuned rows)")
    common.add_argument("--no-tuned", dest="tuned", action="store_false", help="the chapter's path only (default: off)")
    common.add_argument("--tensor-parallel-size", type=positive, default=1, help="processes (ranks), each with 1/N "
                        "of the weights: tensor parallel, Part 3 (default: %(default)s)")
    rows = Parser(add_help=False)
    rows.add_argument("--triton-linear-rows", type=int, help="tuned: matmuls of up to N rows (0-256) in Triton, not "
                      "cuBLAS (default: by the model on CUDA, 0 on the CPU)")
    rows.add_argument("--triton-narrow-rows", type=int,
                      help="tuned: ... and narrow ones (<= 4096 outputs) up to N rows, if more (default: by the model)")
    floors = Parser(add_help=False)  # the commands that report a bandwidth floor
    floors.add_argument("--bandwidth", type=float, help="the device's memory bandwidth in bytes/s, for the floors "
                        "(default: measured by a large copy, under a second; an H200 measures about 4.27e12)")
    eager = Parser(add_help=False)
    eager.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs (default: off)")
    load = Parser(add_help=False)  # bench and online: many requests through the scheduler
    load.add_argument("--max-num-seqs", type=positive, default=256, help="most requests a step (default: %(default)s)")
    load.add_argument("--sync", action="store_true", help="sync scheduling (default: off, async)")

    def command(name: str, text: str, *parents: Parser) -> Parser:
        return sub.add_parser(name, parents=[common, *parents], help=text, description=text)

    g = command("generate", "generate from one prompt: its text, or its token ids (2-core CPU: ~10 s)", rows, eager)
    g.add_argument("--prompt", help="the prompt as text; needs the model's tokenizer.json (default: none)")
    g.add_argument("--prompt-ids", help="the prompt as comma-separated token ids (default: none)")
    g.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="temperature; 0 = greedy (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, help="sample from the most likely tokens that hold this share "
                   "of the probability; 1 = all (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=-1, help="only the k likeliest tokens; -1 = all (default: %(default)s)")
    g.add_argument("--json", action="store_true", help="one JSON line: ids, text, finish reason, TTFT; with --stream, "
                   "one a token: its ids and text, finished, finish reason (default: off)")
    g.add_argument("--stream", action="store_true", help="print each token as it reaches the host (default: off)")
    o = command("overhead", "decode a batch under each rung of the ladder: a JSON header line (the bandwidth floor "
                "of a step), then one line per configuration (2-core CPU: ~1 min)", rows, floors)
    o.add_argument("--requests", type=positive, default=16, help="requests decoded together (default: %(default)s)")
    o.add_argument("--prompt-len", type=positive, default=32, help="tokens in each prompt (default: %(default)s)")
    o.add_argument("--configs", help=f"comma-separated subset of {','.join(CONFIGS)} (default: "
                   f"{','.join(CPU_CONFIGS)} on the CPU, {','.join(CUDA_CONFIGS)} on CUDA)")
    o.add_argument("--slots", type=positive, help="max_num_seqs: most requests a step (default: --requests)")
    o.add_argument("--new-tokens", type=positive, default=64, help="output tokens a request (default: %(default)s)")
    o.add_argument("--num-blocks", type=positive, help="KV cache blocks of 16 tokens (default: 512 MiB of cache on the "
                   "CPU, gpu_memory_utilization=0.9 of the GPU on CUDA)")
    o.add_argument("--trace", metavar="DIR", help="write a Chrome/Perfetto trace of 5 decode steps per rung to "
                   "DIR/<config>.json (default: none)")
    b = command("bench", "offline throughput, nano-vllm's protocol (2-core CPU: ~1-2 min)", rows, floors, eager, load)
    b.add_argument("--num-requests", type=positive, help=by_device("num_requests", "requests"))
    b.add_argument("--min-len", type=positive, help=by_device("min_len", "fewest tokens in a prompt, and to generate"))
    b.add_argument("--max-len", type=positive, help=by_device("max_len", "most tokens in a prompt, and to generate"))
    b.add_argument("--max-num-batched-tokens", type=positive, default=16384,
                   help="tokens per step: prompts go in a few large chunks (default: %(default)s, nano-vllm's)")
    n = command("online", "requests arriving over time (Poisson, or --burst): TTFT, TPOT, ITL and end-to-end latency "
                "at p50/p90/p99, step times by kind, compiles during the run (2-core CPU: ~1 min)", eager, load)
    n.add_argument("--rate", default="16", help="requests a second, Poisson; several, comma-separated (16,64,128): "
                   "one run and one JSON line each, on one engine (default: %(default)s)")
    n.add_argument("--burst", action="store_true", help="every request at once (default: off, Poisson)")
    n.add_argument("--requests", type=positive, help=by_device("requests", "requests in the run"))
    n.add_argument("--min-prompt", type=positive, help=by_device("min_prompt", "fewest prompt tokens (uniform)"))
    n.add_argument("--max-prompt", type=positive, help=by_device("max_prompt", "most prompt tokens"))
    n.add_argument("--output-len", type=positive, help=by_device("output_len", "tokens each generates"))
    n.add_argument("--join-prompt-len", type=positive,
                   help=by_device("join_prompt_len", "tokens of the prompt timed joining 16 decodes"))
    n.add_argument("--max-num-batched-tokens", type=positive, default=2048,
                   help="tokens per step: longer prompts are chunked (default: %(default)s)")
    n.add_argument("--cudagraph-mode", default="full",
                   help="full: graphs for every step; full_decode_only: decode steps only (default: %(default)s)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    a = make_parser().parse_args(argv)
    if a.tuned is None:  # the commands whose job is speed turn Part 2 on; generate runs the chapter
        a.tuned = a.cmd != "generate"
    for name, on_device in DEVICE_DEFAULTS.items():  # the flags of this command left unset: by the device
        if getattr(a, name, 0) is None:
            setattr(a, name, on_device[0 if a.device.startswith("cuda") else 1])
    return a


def main(argv=None):
    a = parse_args(argv)
    try:
        {"generate": cmd_generate, "overhead": cmd_overhead, "bench": cmd_bench, "online": cmd_online}[a.cmd](a)
    except (ValueError, TypeError, OSError) as e:  # bad input (or a path it names): one line, no traceback
        print(f"run.py {a.cmd}: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
