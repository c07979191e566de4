"""In-process step timings of the full-size model on the GPU (no server): prefill of one
1024-token prompt, and decode steps at several batch sizes through the CUDA graphs and through
the eager kernel path, plus a kernel profile of the B=1 graph step.

    python lab/bench_decode.py CKPT_DIR [--batches 1,8,32] [--ctx 1024] [--json OUT]

CKPT_DIR: a config-only full checkpoint (`tailored synth DIR --preset full --config-only`);
weights are drawn on the GPU (dummy). Prints a table; --json writes the numbers with a manifest.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from tailored import flags
from tailored.model.batch import ForwardBatch
from tailored.stack import build_stack


def _set(module: str, attr: str, value):
    """Set tailored.<module>.<attr> = value (a kernel's launch-config table, read at launch
    time); returns the undo."""
    import importlib

    mod = importlib.import_module(f"tailored.{module}")
    old = getattr(mod, attr)
    setattr(mod, attr, value)
    return lambda: setattr(mod, attr, old)


def _flag(**changes):
    """Switch fields of the active flags record (tailored/flags.py; the kernel path reads the
    per-step ones at each call, so a re-capture bakes them in); returns the undo."""
    before = flags.current()
    flags.activate(before.replace(**changes))
    return lambda: flags.activate(before)


_RUNNER = []  # the ModelRunner under test (main sets it): variants swap its cache tensors


def _state_dtype(dtype):
    """The GDN recurrent states stored in `dtype` (EngineConfig.gdn_state_dtype, kb/0056): the
    cache's state tensor swapped for a converted copy before the re-capture; returns the
    undo (the old tensor back)."""
    import torch

    cache = _RUNNER[0].cache
    old = cache.rec
    cache.rec = old.to(getattr(torch, dtype))

    def undo():
        cache.rec = old
    return undo


def _set_route_warps(n):
    from tailored.kernels import moe_route

    warps = {**moe_route.ROUTE_ALIGN_WARPS, **{bt: n for bt in (1, 2, 4, 8)}}
    return _set("kernels.moe_route", "ROUTE_ALIGN_WARPS", warps)


def _set_old_tiles():
    """fused_moe's prefill M tiles as before kb/0031; returns the undo of both settings."""
    undos = [_set("kernels.moe", "BM64_ABOVE", 32), _set("kernels.moe", "BM128_ABOVE", 1 << 30)]
    return lambda: [u() for u in reversed(undos)]


# kernel switches an A/B can flip (each returns its undo); the graphs bake in what they captured
VARIANTS = {
    # a re-capture with nothing changed: an H200 run measured +1.0 % and +2.3 % at B=32 for two
    # switches that do nothing at B=32 (kb/0019), so re-captured graphs (or drift) cost that
    # much; put control first (and last) and read the variants against it, not the first row
    "control": lambda: (lambda: None),
    # the GDN recurrent states stored in bf16 / fp32 (kb/0056; the engine's default, "auto", is
    # bf16 for a bf16 or FP8 checkpoint served in bf16)
    "state_bf16": lambda: _state_dtype("bfloat16"),
    "state_fp32": lambda: _state_dtype("float32"),
    "shared_in_moe": lambda: _flag(shared_in_moe=True),  # kb/0019
    # only for 1-2 rows, where it helped (kb/0024); '+' joins: shared_in_moe+moe_up_to2
    "moe_up_to2": lambda: _flag(shared_in_moe_up_to=2),
    "no_shared_in_moe": lambda: _flag(shared_in_moe=False),
    # routing inside the gate_up GEMM's programs at 1 / 2 rows (moe.route_fused_moe, kb/0036)
    "route_in_gate_up": lambda: _flag(moe_route_in_gate_up_up_to=1),
    "route_in_gate_up2": lambda: _flag(moe_route_in_gate_up_up_to=2),
    "shared_up_to1": lambda: _flag(shared_in_moe_up_to=1),
    # the shared expert as expert E up to 32 rows: FP8 reads its weights as FP8 there (the
    # bf16 copy through cuBLAS + `_silu_mul` otherwise, 3 launches; kb/0042 §3)
    "shared_up_to32": lambda: _flag(shared_in_moe_up_to=32),
    "no_route_in_gate_up": lambda: _flag(moe_route_in_gate_up_up_to=0),
    # the experts of 1-2 row MoE inputs as GEMVs (moe_gemv.route_gemv_moe, kb/0039): FP8
    # only (bf16's measured no gain, kb/0043)
    "no_moe_gemv": lambda: _flag(moe_gemv_up_to=0),
    "moe_gemv1": lambda: _flag(moe_gemv_up_to=1),
    # FP8 dense projections of 1-2 rows through the FP8 GEMV (kernels/fp8_gemv.py, kb/0039 §4;
    # fp8_gemv is the default since 64846c1, i.e. the same as control now)
    "fp8_gemv": lambda: _flag(fp8_gemv_up_to=2),
    "no_fp8_gemv": lambda: _flag(fp8_gemv_up_to=0),
    "fp8_gemv1": lambda: _flag(fp8_gemv_up_to=1),
    # the FP8 GEMV with its one config for every shape (fp8_gemv.CFG) instead of FP8_CFGS
    "fp8_gemv_one_cfg": lambda: _set("kernels.fp8_gemv", "FP8_CFGS", {}),
    # bf16 projections of 1-2 rows through the same GEMV without scales (kb/0039 §7.3), with
    # the FP8 GEMV's configs by shape (the `bf16_gemv_fp8_cfgs` default, kb/0042)
    "bf16_gemv": lambda: _flag(bf16_gemv_up_to=2),
    "bf16_gemv_one_cfg": lambda: _flag(bf16_gemv_fp8_cfgs=False),  # fp8_gemv.CFG everywhere
    # one row's through cuBLAS again (the bf16 GEMV is the default at one row since kb/0042)
    "no_bf16_gemv": lambda: _flag(bf16_gemv_up_to=0),
    # the attention output gate in the merge kernel (kb/0037)
    "attn_gate_in_merge": lambda: _flag(attn_gate_in_merge=True),
    "no_attn_gate_in_merge": lambda: _flag(attn_gate_in_merge=False),
    # GDN state columns over 1 / 2 / 4 programs (kb/0022)
    "gdn_split1": lambda: _flag(gdn_dv_split=1),
    "gdn_split2": lambda: _flag(gdn_dv_split=2),
    "gdn_split4": lambda: _flag(gdn_dv_split=4),
    # the MoE combine does the next add + norm (kb/0023)
    "next_norm": lambda: _flag(combine_next_norm=True),
    "no_next_norm": lambda: _flag(combine_next_norm=False),
    # route_align's two-launch path up to 64 rows (kb/0021; the default)
    "route64": lambda: _flag(route_align_up_to=64),
    "route_warps1": lambda: _set_route_warps(1),  # route_align program of 1 / 2 warps
    "route_warps2": lambda: _set_route_warps(2),
    # FP8 experts' gate_up dots in bf16 instead of the default float16 (kb/0029, 0030;
    # decode and prefill: also a --prefill-variants one)
    "fp8_bf16dot": lambda: _flag(moe_fp8_dot_f16=False),
    # the decode down GEMM's bf16-dot configs only (`moe_fp8_down_f16` off, kb/0045): a new
    # launcher, tuned at the re-capture's warm-up where tuned.json's float16 picks no longer apply
    "down_bf16dot": lambda: _flag(moe_fp8_down_f16=False),
    # FP8 dense projections of 3-64 rows through the split-K W8A16 GEMM over their FP8 weights
    # instead of cuBLAS over the bf16 copy (kb/0045 §4; its configs: fp8_splitk.CFGS)
    "dense_splitk": lambda: _flag(fp8_dense_splitk_up_to=64),
    # the same up to 8 rows only (the default): where the shape sweep found it faster
    # (kb/0047 §2)
    "dense_splitk8": lambda: _flag(fp8_dense_splitk_up_to=8),
    "no_dense_splitk": lambda: _flag(fp8_dense_splitk_up_to=0),
    # programmatic dependent launch of every Triton kernel (kernels/pdl.py, kb/0030; on by
    # default since kb/0041; decode and prefill: also --prefill-variants ones)
    "pdl": lambda: _flag(pdl=True),
    "no_pdl": lambda: _flag(pdl=False),
    # routed experts of eager prefill steps of >= `moe_grouped_from` (6144) tokens through
    # torch's grouped GEMM (kernels/moe_grouped.py, kb/0031; a --prefill-variants one: the
    # batched step). Turned on after start it allocates the FP8 scratch outside the reserve.
    "moe_grouped": lambda: _flag(moe_grouped=True),
    "no_moe_grouped": lambda: _flag(moe_grouped=False),
    # FP8 routed experts of eager prefill steps of >= 1024 / 6144 tokens W8A8 (e4m3
    # activations per 128-wide group, kernels/moe_w8a8.py, kb/0061; a --prefill-variants one:
    # the 8 x 1024 step, and the eager 1024-token prefill from 1024), before the grouped path
    "moe_w8a8": lambda: _flag(moe_w8a8_from=1024),
    "moe_w8a8_6144": lambda: _flag(moe_w8a8_from=6144),
    "no_moe_w8a8": lambda: _flag(moe_w8a8_from=0),
    # FP8 experts' 64-row prefill tiles from 16 rows an expert, as bf16 (kb/0031 §3: worth a
    # try once the FP8 64-row tuned.json entry holds the bench's better config)
    "fp8_tiles16": lambda: _set("kernels.moe", "BM64_ABOVE_FP8", 16),
    # prefill M tiles as before kb/0031 (32 rows up to 32 an expert, never 128)
    "old_tiles": lambda: _set_old_tiles(),
}


def switch(spec: str, kf):
    """Apply the '+'-joined switches in spec, re-capture the decode graphs of the runner's
    KernelForward `kf`; returns the undo (which re-captures with the previous settings)."""
    undos = [VARIANTS[p]() for p in spec.split("+")]
    kf.drop_decode_graphs()
    kf.decode.capture()

    def undo():
        for u in reversed(undos):
            u()
        kf.drop_decode_graphs()
        kf.decode.capture()
    return undo


def prefill_ab(a, variants, kf, pre, pre_b):
    """Time the ctx-token prefill `pre` (and the batched prefill step `pre_b`) under each
    '+'-joined switch set, a.rounds times round-robin; medians by variant. With prefill graphs
    the ctx bucket is re-captured for each variant (the graph bakes its switches in), so the
    time is the replay's, which is the GPU's (the eager prefill is host-bound, kb/0010)."""
    graphs = bool(kf.prefill.graphs)
    bucket = min((b for b in kf.prefill.graphs if b >= a.ctx), default=None)
    if graphs and bucket is None:
        raise SystemExit(f"--ctx {a.ctx} is above the largest prefill graph bucket "
                         f"({max(kf.prefill.graphs)}): the A/B would time eager prefills")

    def recapture():
        # a capture that fails leaves prefill eager, which must not be timed as a replay
        if graphs:
            kf.prefill.graphs.pop(bucket, None)
            kf.prefill.capture(bucket, buckets=[bucket])
            if bucket not in kf.prefill.graphs:
                raise SystemExit(f"prefill graph {bucket} not captured under this variant "
                                 "(see the warning above)")

    samples = {v: {"prefill_ms": [], "prefill_batch_ms": []} for v in variants}
    for rnd in range(a.rounds):
        for v in variants:
            undos = [VARIANTS[p]() for p in v.split("+")]
            recapture()
            pre()
            samples[v]["prefill_ms"].append(timed(pre, 3))
            if pre_b is not None:
                pre_b()
                samples[v]["prefill_batch_ms"].append(timed(pre_b, 3))
            for u in reversed(undos):
                u()
            print(f"round {rnd + 1}: prefill {a.ctx} tokens with {v}: "
                  f"{samples[v]['prefill_ms'][-1]:.2f} ms"
                  + (f", batch step {samples[v]['prefill_batch_ms'][-1]:.1f} ms"
                     if pre_b is not None else ""), flush=True)
    recapture()
    pre()  # sequence 0's state as the decode timings expect it
    out = {v: {k: statistics.median(x) for k, x in d.items() if x} | {"samples": d}
           for v, d in samples.items()}
    base = out.get("control")
    print("\n| prefill variant | prefill ms | vs control | batch step ms | vs control |\n|---|---|---|---|---|")
    for v, r in out.items():
        rel = (lambda k: f"{r[k] / base[k] - 1:+.1%}" if base and k in r and k in base else "-")
        print(f"| {v} | {r['prefill_ms']:.2f} | {rel('prefill_ms')} | "
              f"{r.get('prefill_batch_ms', float('nan')):.1f} | {rel('prefill_batch_ms')} |")
    return out


def timed(fn, n):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-batch", type=int, default=1,
                    help="decode batch of the --profile kernel table (one of --batches)")
    ap.add_argument("--prefill-batch", type=int, default=0,
                    help="also time one prefill step of this many ctx-token prompts (e.g. 8: the "
                         "8192-token step of serve's default budget)")
    ap.add_argument("--variants", default="",
                    help="comma-separated kernel switches to time the same batches with, each "
                         "after a re-capture: " + ", ".join(VARIANTS) + " ('+' joins several, "
                         "e.g. gdn_split4+shared_in_moe)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="cycle through --variants this many times and report each variant's "
                         "median: drift over the run and re-capture noise (1-2 %%, kb/0019) "
                         "average out instead of landing on whichever variant ran last")
    ap.add_argument("--prefill-variants", default="",
                    help="comma-separated switches (as in --variants) to time the ctx-token "
                         "prefill with (replayed after a re-capture of its bucket when "
                         "--prefill-graphs, else eager) and the --prefill-batch step (eager), "
                         "--rounds times each; put control first")
    ap.add_argument("--profile-variant", default="",
                    help="the switches (as in --variants) the --profile kernel table runs with")
    ap.add_argument("--prefill-graphs", action="store_true",
                    help="capture prefill CUDA graphs (kb/0013); the prefill is then timed both "
                         "replayed and eager")
    ap.add_argument("--profile-prefill-batch", action="store_true",
                    help="kernel table (torch profiler, CUDA time) of one --prefill-batch step: "
                         "where a c=32 wave's 8192-token prefill spends its GPU time")
    ap.add_argument("--profile-host", action="store_true",
                    help="cProfile of one ctx-token prefill forward: host time by function")
    a = ap.parse_args()
    batches = [int(x) for x in a.batches.split(",")]
    Bmax = max(batches)
    if a.profile_prefill_batch and not a.prefill_batch:
        ap.error("--profile-prefill-batch needs --prefill-batch N")
    if a.profile and not 1 <= a.profile_batch <= Bmax:
        ap.error(f"--profile-batch must be in 1..{Bmax} (the largest of --batches)")
    # positions per sequence: the context plus every decode step sequence 0 takes part in
    # (each batch size: 1 + steps graph + 1 + 3 eager; again 1 + steps per variant;
    # 5 for --profile), with margin; max_model_len sizes the page table and the page pool
    variants = [v for v in a.variants.split(",") if v]
    prefill_variants = [v for v in a.prefill_variants.split(",") if v]
    for v in variants + prefill_variants + ([a.profile_variant] if a.profile_variant else []):
        for part in v.split("+"):
            if part not in VARIANTS:
                ap.error(f"unknown variant {part!r}: one of {', '.join(VARIANTS)}")
    n_dec = len(batches) * (a.steps + 5) * (1 + len(variants) * a.rounds) + 5 * a.profile
    t0 = time.monotonic()
    st = build_stack(a.ckpt, load_format="dummy", device="cuda", dtype="bfloat16", progress=False,
                     max_model_len=max(a.ctx + 512, a.ctx + n_dec + 64 + 16),
                     max_num_seqs=max(Bmax, 1) + 1, num_pages=None,
                     prefill_graphs=a.prefill_graphs)
    print(f"stack built in {time.monotonic() - t0:.1f} s", flush=True)
    runner = st.engine.runner
    model, cache, kf = runner.model, runner.cache, runner.kernel
    if kf is None:
        raise SystemExit("the kernel path did not start (see the log): nothing to time")
    _RUNNER[:] = [runner]
    ps = cache.page_size
    P = math.ceil((a.ctx + n_dec + 64) / ps)
    g = torch.Generator().manual_seed(0)
    seqs = []
    res = {"ctx": a.ctx}
    for b in range(Bmax):  # prefill every sequence (timing the first)
        ids = torch.randint(0, 248044, (a.ctx,), generator=g).tolist()
        pages = list(range(1 + b * P, 1 + (b + 1) * P))
        batch = ForwardBatch.build([(ids, 0, b + 1, True, pages)], [a.ctx - 1], "cuda")

        def pre(batch=batch):  # bound now: the loop rebinds batch
            h = runner.forward(batch)
            return model.compute_logits(h[batch.logits_rows]).argmax(-1).tolist()

        if b == 0:
            pre0 = pre
            pre()  # warm (triton compiles, fla autotune)
            res["prefill_ms"] = timed(pre, 3)
            print(f"prefill {a.ctx} tokens: {res['prefill_ms']:.1f} ms", flush=True)
            if kf.prefill.graphs:
                def pre_eager():
                    h = kf.km.forward_eager(batch)
                    return model.compute_logits(h[batch.logits_rows]).argmax(-1).tolist()

                res["prefill_graph_buckets"] = sorted(kf.prefill.graphs)
                res["prefill_eager_ms"] = timed(pre_eager, 3)
                res["prefill_graph_equals_eager_token"] = pre() == pre_eager()
                print(f"prefill {a.ctx} tokens: graph {res['prefill_ms']:.1f} ms, eager "
                      f"{res['prefill_eager_ms']:.1f} ms; same next token: "
                      f"{res['prefill_graph_equals_eager_token']}", flush=True)
        else:
            pre()
        seqs.append([a.ctx, b + 1, pages])
    if a.prefill_batch:
        # fresh prompts into the slots/pages of the first prefill_batch sequences, then redo
        # those prefills so the decode timings below see the same contexts
        nb = min(a.prefill_batch, Bmax)
        allp = [torch.randint(0, 248044, (a.ctx,), generator=g).tolist() for _ in range(nb)]
        layout = [(allp[b], 0, b + 1, True, list(range(1 + b * P, 1 + (b + 1) * P))) for b in range(nb)]
        bb = ForwardBatch.build(layout, [(b + 1) * a.ctx - 1 for b in range(nb)], "cuda")

        def pre_b():
            h = runner.forward(bb)
            return model.compute_logits(h[bb.logits_rows]).argmax(-1).tolist()

        pre_b()
        res["prefill_batch"] = {"seqs": nb, "tokens": nb * a.ctx, "ms": timed(pre_b, 3)}
        print(f"prefill step {nb} x {a.ctx} tokens: {res['prefill_batch']['ms']:.1f} ms "
              f"({res['prefill_batch']['ms'] / nb:.1f} ms per prompt)", flush=True)
        if a.profile_prefill_batch:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                pre_b()
                torch.cuda.synchronize()
            print(f"prefill step {nb} x {a.ctx} tokens, kernels by CUDA time:")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18))
    if prefill_variants:
        res["prefill_variants"] = prefill_ab(a, prefill_variants, kf, pre0,
                                             pre_b if a.prefill_batch else None)
    if a.profile_host:
        import cProfile
        import io
        import pstats

        ids = torch.randint(0, 248044, (a.ctx,), generator=g).tolist()
        hb = ForwardBatch.build([(ids, 0, 1, True, list(range(1, 1 + P)))], [a.ctx - 1], "cuda")
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        t0 = time.perf_counter()
        pr.enable()
        runner.forward(hb)
        pr.disable()
        t_host = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        t_all = (time.perf_counter() - t0) * 1e3
        print(f"prefill {a.ctx} host profile: forward returned after {t_host:.1f} ms, GPU done "
              f"after {t_all:.1f} ms (profiler overhead included)")
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(28)
        print("\n".join(line[:150] for line in buf.getvalue().splitlines()[:60]))
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(20)
        print("\n".join(line[:150] for line in buf.getvalue().splitlines()[:45]))
        # restore sequence 0's state for the decode timings
        ids0 = torch.randint(0, 248044, (a.ctx,), generator=g).tolist()
        runner.forward(ForwardBatch.build([(ids0, 0, 1, True, list(range(1, 1 + P)))],
                                          [a.ctx - 1], "cuda"))

    def step_fn(B):
        # a fresh random token per row and step: the same token in every row (what this once
        # did) routes the rows' first layer alike and likely reads fewer experts:
        # B=32 timed 12.6 ms in here against 17.4 ms of GPU time per 32-row step when served
        # (not yet re-measured with random tokens)
        tg = torch.Generator().manual_seed(B)

        def f():
            toks_in = torch.randint(0, 248044, (B,), generator=tg).tolist()
            layout = [([t], s[0], s[1], False, s[2]) for t, s in zip(toks_in, seqs[:B])]
            batch = ForwardBatch.build(layout, list(range(B)), "cuda")
            h = runner.forward(batch)
            toks = model.compute_logits(h).argmax(-1).tolist()
            for s in seqs[:B]:
                s[0] += 1
            return toks
        return f

    rows = []
    for B in batches:
        f = step_fn(B)
        f()
        ms_graph = timed(f, a.steps)
        kf.use_graphs = False
        f()
        ms_eager = timed(f, 3)
        kf.use_graphs = True
        rows.append((B, ms_graph, 1e3 * B / ms_graph, ms_eager))
        print(f"B={B}: graph {ms_graph:.2f} ms/step ({1e3 * B / ms_graph:.0f} tok/s), "
              f"eager kernels {ms_eager:.2f} ms/step", flush=True)
    res["decode"] = [dict(batch=B, graph_ms=g_, tok_s=t, eager_ms=e) for B, g_, t, e in rows]
    res["variants"] = {}
    samples: dict[str, dict[int, list[float]]] = {v: {B: [] for B in batches} for v in variants}
    for rnd in range(a.rounds):  # A/B: the same batches with kernel switches on, re-captured
        for v in variants:
            undo = switch(v, kf)
            for B in batches:
                f = step_fn(B)
                f()
                ms = timed(f, a.steps)
                samples[v][B].append(ms)
                print(f"round {rnd + 1}: B={B}: graph {ms:.2f} ms/step with {v}", flush=True)
            undo()
    for v in variants:
        # min too: two B=1 control re-captures differed by 10 % (3.64 / 4.01 ms,
        # kb/0031), so a few-% switch needs several rounds and both statistics
        res["variants"][v] = [dict(batch=B, graph_ms=statistics.median(samples[v][B]),
                                   graph_ms_min=min(samples[v][B]),
                                   tok_s=1e3 * B / statistics.median(samples[v][B]),
                                   samples_ms=samples[v][B]) for B in batches]
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        undo = switch(a.profile_variant, kf) if a.profile_variant else (lambda: None)
        f = step_fn(a.profile_batch)
        f()
        print(f"B={a.profile_batch} decode step profile (5 steps, switches: "
              f"{a.profile_variant or 'defaults'}):")
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                f()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=26))
        undo()
        ids = torch.randint(0, 248044, (a.ctx,), generator=g).tolist()
        pages = list(range(1 + Bmax * P, 1 + (Bmax + 1) * P))
        batch = ForwardBatch.build([(ids, 0, Bmax + 1, True, pages)], [a.ctx - 1], "cuda")
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            model.compute_logits(runner.forward(batch)[batch.logits_rows]).argmax(-1).tolist()
        print(f"prefill {a.ctx} tokens profile:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14))
    vms = {v: {r["batch"]: r["graph_ms"] for r in rs} for v, rs in res["variants"].items()}
    # ratios against the control re-capture's median when it ran (kb/0019), else the defaults
    base = vms.get("control")
    print("\n| batch | graph ms/step | tok/s | eager-kernel ms/step |"
          + "".join(f" {v} |" for v in vms) + "\n|---|---|---|---|" + "---|" * len(vms))
    for B, g_, t, e in rows:
        ref_ms = base[B] if base else g_
        print(f"| {B} | {g_:.2f} | {t:.0f} | {e:.2f} |"
              + "".join(f" {m[B]:.2f} ({m[B] / ref_ms - 1:+.1%}) |" for m in vms.values()))
    if a.rounds > 1:
        print(f"(variants: median of {a.rounds} rounds; ratios vs "
              f"{'control' if base else 'the first defaults row'})")
        mins = {v: {r["batch"]: r["graph_ms_min"] for r in rs} for v, rs in res["variants"].items()}
        bmin = mins.get("control")
        for B in batches:
            print(f"B={B} min of rounds: " + ", ".join(
                f"{v} {m[B]:.2f}" + (f" ({m[B] / bmin[B] - 1:+.1%})" if bmin else "")
                for v, m in mins.items()))
    print(f"prefill {a.ctx} tokens: {res['prefill_ms']:.1f} ms")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
