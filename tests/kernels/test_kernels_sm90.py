"""Every Triton kernel compiles for the H200 (sm_90) — checked on the CPU, before device time.

The interpreter (tests/test_kernels.py) checks what the kernels compute, not that compiled
Triton accepts them or what ptxas makes of them: session 5 found, by compiling for sm_90 on the
CPU, that ptxas fused multiply-adds the reference rounds twice (kb/0012). Here each kernel
wrapper runs on CPU tensors — fp32, bf16 and FP8 weights, decode and prefill sizes — with its
launches recorded instead of interpreted; a subprocess without the interpreter then compiles
every recorded launch (signature from the arguments' dtypes, the same constexprs and launch
options) for GPUTarget("cuda", 90, 32) with Triton's bundled ptxas, and checks the PTX of the
kernels that must keep their roundings for fused bf16 FMAs. Skips on a GPU machine (the real
tests compile there) and when Triton has no CUDA backend. The compiles take minutes with a cold
Triton cache (~400 s on 2 cores, ~30 s warm): they run in the slow tier (`pytest -m slow`), the
recording and its checks in the default one.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tailored import kernels

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel tests compile them"),
    pytest.mark.skipif(not kernels.available(), reason="triton not installed"),
]

TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.int32: "*i32",
         torch.int64: "*i64", torch.float8_e4m3fn: "*fp8e4nv", torch.bool: "*i1",
         torch.uint8: "*u8"}
# kernels that read what no kernel of the step writes (weights, the GDN state) before their
# PDL wait (kb/0040): their PTX loads before the wait; every other kernel's first global load
# and store come after it
PDL_PREFETCH = {"_fp8_gemv_kernel", "_recurrent_kernel", "_splitk_kernel"}
NO_FMA = {"_qk_norm_rope_kernel", "_moe_combine_kernel",
          "_silu_mul_kernel"}

COMPILE = r'''
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import importlib
out = []
for r in json.loads(sys.stdin.read()):
    fn = getattr(importlib.import_module(r["module"]), r["name"])
    if not isinstance(fn, triton.runtime.JITFunction):  # an autotuner wraps the JITFunction
        fn = fn.fn
    try:
        k = triton.compile(ASTSource(fn, r["signature"], r["constexprs"]),
                           target=GPUTarget("cuda", 90, 32), options=r["options"])
        ptx = k.asm["ptx"]
        out.append({"key": r["key"], "ok": True, "bf16_fma": "fma.rn.bf16" in ptx,
                    # PDL: both instructions; is the wait before the first global store,
                    # before the first global load?
                    "gdc": ["griddepcontrol.wait" in ptx, "griddepcontrol.launch_dependents" in ptx,
                            *[0 <= ptx.find("griddepcontrol.wait") < (
                                ptx.find(op) if op in ptx else len(ptx))
                              for op in ("st.global", "ld.global")]]})
    except Exception as e:  # report every failure, not only the first
        out.append({"key": r["key"], "ok": False, "error": f"{type(e).__name__}: {e}"[:2000]})
print(json.dumps(out))
'''


def _record(calls) -> list[dict]:
    """Run each wrapper call with interpreted launches replaced by a recorder."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    recs, seen = [], set()
    orig = InterpretedFunction.run

    def run(self, *args, grid, warmup=False, **kwargs):
        names = self.arg_names
        bound = dict(zip(names, args))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        sig, consts = {}, {}
        for p in inspect.signature(self.fn).parameters.values():
            if p.name not in bound and p.default is p.empty:
                raise TypeError(f"{self.fn.__name__}: no argument for {p.name}")
            v = bound.get(p.name, p.default)  # a parameter left at its default is not passed
            if v is None:  # an unused pointer (None): Triton binds it as a constexpr
                sig[p.name], consts[p.name] = "constexpr", None
            elif p.annotation in (tl.constexpr, "tl.constexpr", "constexpr"):
                sig[p.name], consts[p.name] = "constexpr", v
            elif isinstance(v, torch.Tensor):
                sig[p.name] = TYPES[v.dtype]
            elif isinstance(v, bool):
                sig[p.name] = "i1"
            elif isinstance(v, int):
                sig[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
            elif isinstance(v, float):
                sig[p.name] = "fp32"
            else:
                raise TypeError(f"{self.fn.__name__}: argument {p.name}={v!r}")
        options = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages",
                                                            "enable_fp_fusion", "launch_pdl")}
        key = json.dumps([self.fn.__name__, sig, {k: str(v) for k, v in consts.items()}, options],
                         sort_keys=True)
        if key not in seen:
            seen.add(key)
            recs.append({"key": key, "module": self.fn.__module__, "name": self.fn.__name__,
                         "signature": sig, "constexprs": consts, "options": options})

    InterpretedFunction.run = run
    try:
        for call in calls:
            call()
    finally:
        InterpretedFunction.run = orig
    return recs


def _calls(dtypes=(torch.float32, torch.bfloat16)):
    from tailored.kernels.attention_decode import paged_decode_attention
    from tailored.kernels.fp8_dequant import dequantize_rows
    from tailored.kernels.fp8_gemv import bf16_gemv, fp8_gemv
    from tailored.kernels.fp8_linear import fp8_linear
    from tailored.kernels.fp8_splitk import fp8_linear_splitk
    from tailored.kernels.gdn_conv import conv_prefill, conv_state_update
    from tailored.kernels.gdn_decode import conv_step, recurrent_step
    from tailored.kernels.gdn_verify import conv_verify, recurrent_verify
    from tailored.kernels.state_commit import commit_snapshots
    from tailored.kernels import moe_grouped, moe_w8a8, nvfp4_grouped
    from tailored.kernels.moe import fused_moe, route_fused_moe
    from tailored.kernels.moe_route import route_align
    from tailored.kernels.moe_combine import moe_combine, moe_combine_folded, silu_mul
    from tailored.kernels.moe_gemv import route_gemv_moe
    from tailored.kernels.norm import add_rms_norm_1p
    from tailored.kernels.qk_norm_rope import qk_norm_rope
    from tailored.ops import reference as ref

    f8 = torch.float8_e4m3fn
    H, I, E, K = 2048, 512, 256, 8  # the model's MoE dims (spec §7)
    calls = []
    for dt in dtypes:
        for T in (1, 40):  # a decode batch and a prefill chunk
            x = torch.randn(T, H, dtype=dt)
            calls.append(lambda x=x: add_rms_norm_1p(x, x, torch.zeros(H, dtype=dt), 1e-6))
            qg = torch.randn(T, 16, 512, dtype=dt)
            cos, sin = ref.rope_cos_sin(torch.arange(T), 64, 1e7, dt)
            calls.append(lambda qg=qg, cos=cos, sin=sin: qk_norm_rope(
                qg[..., :256], torch.zeros(256, dtype=dt), cos, sin, 1e-6))
            kvc = torch.zeros(64, 2, 256, dtype=dt)  # decode keys: the KV store in the launch
            calls.append(lambda qg=qg, cos=cos, sin=sin, kvc=kvc, T=T, dt=dt: qk_norm_rope(
                qg[:, :2, :256], torch.zeros(256, dtype=dt), cos, sin, 1e-6,
                rows=torch.arange(T), out=kvc, v=qg[:, :2, 256:], v_out=kvc))
            r = torch.randn(T, E + 2 * I + 1, dtype=dt)
            calls.append(lambda r=r: silu_mul(r[:, E:E + I], r[:, E + I:E + 2 * I]))
            calls.append(lambda r=r, T=T, dt=dt: moe_combine(torch.zeros(T * K, H), K, r[:, -1:],
                                                             torch.zeros(T, H, dtype=dt)))
            # with the next layer's add + norm in the launch (kb/0023)
            calls.append(lambda r=r, T=T, dt=dt: moe_combine(
                torch.zeros(T * K, H), K, r[:, -1:], torch.zeros(T, H, dtype=dt),
                (torch.zeros(T, H, dtype=dt), torch.zeros(H, dtype=dt), 1e-6)))
            ids = torch.randint(0, E, (T, K))
            w = torch.rand(T, K, dtype=dt)
            for wdt in (dt, f8):
                gu = torch.zeros(E, 2 * I, H, dtype=wdt)
                dn = torch.zeros(E, H, I, dtype=wdt)
                # block scales (fp8.expert_block_scales, kb/0027)
                sc = ((torch.ones(E, 2 * I // 128, H // 128), torch.ones(E, H // 128, I // 128))
                      if wdt == f8 else (None, None))
                calls.append(lambda x=x, w=w, ids=ids, gu=gu, dn=dn, sc=sc: fused_moe(
                    x, w, ids, gu, dn, None, *sc))
            wl = torch.zeros(1024, H, dtype=f8)
            calls.append(lambda x=x, wl=wl: fp8_linear(x, wl, torch.ones(1024, H // 128)))
            # the split-K GEMM (bench only, kb/0045 §4): partials + reduce, and one split;
            # float16 dots with power-of-2 rows for bf16
            for ks, bn, f16 in ((512, 256, dt == torch.bfloat16), (H, 128, False)):
                calls.append(lambda x=x, wl=wl, ks=ks, bn=bn, f16=f16, dt=dt: fp8_linear_splitk(
                    x, wl, torch.ones(1024, H // 128), ks, bn, 8, 4, f16,
                    torch.zeros(64, H, dtype=dt)))  # with bf16 rows in the launch
            if T == 1:  # the FP8 GEMV (kb/0039 §4), 1 and 2 rows
                for xr in (x, torch.randn(2, H, dtype=dt)):
                    calls.append(lambda xr=xr, wl=wl: fp8_gemv(xr, wl, torch.ones(1024, H // 128)))
                    calls.append(lambda xr=xr, wl=wl, dt=dt: fp8_gemv(  # with bf16 rows
                        xr, wl, torch.ones(1024, H // 128), other=torch.zeros(64, H, dtype=dt)))
                    calls.append(lambda xr=xr, dt=dt: bf16_gemv(xr, torch.zeros(512, H, dtype=dt)))
            if T == 1:  # routing inside the gate_up programs, shared expert stacked (kb/0036)
                for wdt in (dt, f8):
                    calls.append(lambda x=x, wdt=wdt, dt=dt: route_fused_moe(
                        x, torch.randn(1, E, dtype=dt), K,
                        torch.empty(E + 1, 2 * I, H, dtype=wdt),
                        torch.empty(E + 1, H, I, dtype=wdt), torch.randn(1, 1, dtype=dt),
                        *((torch.ones(E + 1, 2 * I // 128, H // 128),
                           torch.ones(E + 1, H // 128, I // 128)) if wdt == f8 else ())))
                    # the same as GEMVs, one pair a program (kb/0039)
                    calls.append(lambda x=x, wdt=wdt, dt=dt: route_gemv_moe(
                        x, torch.randn(1, E, dtype=dt), K,
                        torch.empty(E + 1, 2 * I, H, dtype=wdt),
                        torch.empty(E + 1, H, I, dtype=wdt), torch.randn(1, 1, dtype=dt),
                        *((torch.ones(E + 1, 2 * I // 128, H // 128),
                           torch.ones(E + 1, H // 128, I // 128)) if wdt == f8 else ())))
            if T == 1:  # FP8 weight -> activation dtype for the prefill GEMMs (kb/0026)
                calls.append(lambda wl=wl, dt=dt: dequantize_rows(
                    wl, torch.ones(1024, H // 128), dtype=dt))
        # the grouped prefill experts' kernels (kb/0031): weighted unsort, expert dequant,
        # the combine gathering expert-sorted outputs; fused_moe's 128-row bf16 tiles
        T, P = 40, 40 * K
        rows, w40 = torch.arange(P, dtype=torch.int32), torch.rand(40, K, dtype=dt)
        calls.append(lambda rows=rows, w40=w40, dt=dt: moe_grouped.unsort_weighted(
            torch.zeros(P, H, dtype=dt), rows, w40))
        calls.append(lambda rows=rows, w40=w40, dt=dt: moe_combine(
            torch.zeros(P, H, dtype=dt), K, torch.zeros(40, 1, dtype=dt),
            torch.zeros(40, H, dtype=dt), (torch.zeros(40, H, dtype=dt), torch.zeros(H, dtype=dt),
                                           1e-6), rows=rows, weights=w40))
        for gate_up, (n, kk) in ((True, (2 * I, H)), (False, (H, I))):
            calls.append(lambda gate_up=gate_up, n=n, kk=kk, dt=dt: moe_grouped.dequantize_experts(
                torch.zeros(2, n, kk, dtype=f8), torch.ones(2, n // 128, kk // 128), gate_up,
                dtype=dt))
        if dt == torch.bfloat16:  # the prefill experts over FP8 (W8A8, kb/0061) and NVFP4
            # (W4A16, kb/0067) weights; NVFP4's also with the bf16 dots its CUDA launcher takes
            # (the interpreter's branch dots in fp32: `interpreted()` stood in for as False)
            ids40 = torch.randint(0, E, (40, K))
            calls.append(lambda dt=dt, w40=w40, ids40=ids40: moe_w8a8.w8a8_experts_sorted(
                torch.randn(40, H, dtype=dt), w40, ids40,
                torch.zeros(E, 2 * I, H, dtype=f8), torch.zeros(E, H, I, dtype=f8),
                torch.ones(E, 2 * I // 128, H // 128), torch.ones(E, H // 128, I // 128)))

            def w4a16(served: bool, dt=dt, w40=w40, ids40=ids40):
                real = nvfp4_grouped.interpreted
                nvfp4_grouped.interpreted = (lambda: False) if served else real
                try:
                    return nvfp4_grouped.nvfp4_grouped_sorted(
                        torch.randn(40, H, dtype=dt), w40, ids40,
                        (torch.zeros(E, 2 * I, H // 2, dtype=torch.uint8),
                         torch.ones(E, 2 * I, H // 16).to(f8), torch.ones(E, 2)),
                        (torch.zeros(E, H, I // 2, dtype=torch.uint8),
                         torch.ones(E, H, I // 16).to(f8), torch.ones(E, 1)))
                finally:
                    nvfp4_grouped.interpreted = real

            calls += [lambda: w4a16(False), lambda: w4a16(True)]
            calls.append(lambda dt=dt: fused_moe(
                torch.randn(1600, H, dtype=dt), torch.rand(1600, K, dtype=dt),
                torch.randint(0, E, (1600, K)), torch.zeros(E, 2 * I, H, dtype=dt),
                torch.zeros(E, H, I, dtype=dt)))
        for T in (1, 32):  # one program; top-k programs + the sorting align (kb/0021)
            rl = torch.randn(T, E + 1, dtype=dt)
            calls.append(lambda rl=rl: route_align(rl[:, :E], K))
            calls.append(lambda rl=rl: route_align(rl[:, :E], K, shared_gate=rl[:, E:]))
            calls.append(lambda T=T, dt=dt: moe_combine_folded(torch.zeros(T * (K + 1), H), K, dt))
        if dt == torch.bfloat16:  # FP8 experts with float16 dots (kb/0029: bf16 activations)
            def f16_moe(x=torch.randn(40, H, dtype=dt)):
                from tailored import flags

                # the down GEMM's too (kb/0042): both switches on, as served
                with flags.override(moe_fp8_dot_f16=True, moe_fp8_down_f16=True):
                    fused_moe(x, torch.rand(40, K, dtype=dt), torch.randint(0, E, (40, K)),
                              torch.zeros(E, 2 * I, H, dtype=f8), torch.zeros(E, H, I, dtype=f8),
                              None, torch.ones(E, 2 * I // 128, H // 128),
                              torch.ones(E, H // 128, I // 128))
            calls.append(f16_moe)

            def down_shipped(dt=dt):  # tuned.json's float16 pick for B=8 / 32 (kb/0045)
                from tailored.kernels import dot_precision, moe
                from tailored.kernels.pdl import launch as pdl_launch

                act, y = torch.zeros(64, I, dtype=dt), torch.zeros(64, H)
                dn, sd = torch.zeros(E, H, I, dtype=f8), torch.ones(E, H // 128, I // 128)
                ids = torch.zeros(E + 1, dtype=torch.int32)
                moe._down_kernel[(64, H // 128)](
                    act, dn, ids, ids, ids, torch.ones(64), y, sd, act.stride(0),
                    dn.stride(0), dn.stride(1), y.stride(0), sd.stride(0), sd.stride(1), H=H,
                    I=I, BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, KB=128, DOT_PREC=dot_precision(dt),
                    PAIRS_BUCKET=64, W_FP8=True, COMPACT=True, DOT_F16=True, num_warps=4,
                    num_stages=4, **pdl_launch(act))
            calls.append(down_shipped)
        # the GDN prefill conv of all sequences, and the carried states (kb/0029)
        xs = torch.randn(50, 8192, dtype=dt)
        cs = torch.zeros(5, 8192, 3, dtype=dt)
        meta = torch.tensor([[0, 20], [20, 30], [0, 20], [1, 0]])
        sl = torch.tensor([1, 3])
        calls.append(lambda xs=xs, cs=cs, dt=dt: conv_prefill(
            xs, cs, torch.zeros(8192, 4, dtype=dt), meta, sl, 50, 30))
        calls.append(lambda xs=xs, cs=cs, dt=dt: conv_state_update(
            xs, cs, torch.zeros(8192, 4, dtype=dt), meta, sl))
        B, S = 3, 5
        qkv = torch.randn(B, 8192, dtype=dt)
        conv_state = torch.zeros(S, 8192, 3, dtype=dt)
        slots = torch.tensor([1, 2, 4], dtype=torch.int32)
        # default arguments bind this dtype's tensors (a bare closure would see the last loop's)
        calls.append(lambda qkv=qkv, conv_state=conv_state, dt=dt: conv_step(
            qkv, conv_state, torch.zeros(8192, 4, dtype=dt), slots))
        # with the snapshot of speculative verify steps (worker/spec_graphs.py)
        calls.append(lambda qkv=qkv, conv_state=conv_state, dt=dt: conv_step(
            qkv, conv_state, torch.zeros(8192, 4, dtype=dt), slots,
            snapshot=torch.zeros(B, 8192, 3, dtype=dt)))
        rec = torch.zeros(S, 32, 128, 128)
        # GDN states stored in bf16 too (--gdn-state-dtype, the default for bf16 models since
        # kb/0056): loads converted, stores rounded, verify rounding between tokens
        r16 = torch.zeros(S, 32, 128, 128, dtype=torch.bfloat16)
        s16 = torch.zeros(B, 32, 128, 128, dtype=torch.bfloat16)
        # 4: columns over programs + the gated-norm kernel (kb/0022)
        for split, st, snap in ((1, rec, None), (1, rec, torch.zeros(B, 32, 128, 128)),
                                (4, rec, None), (4, rec, torch.zeros(B, 32, 128, 128)),
                                (2, r16, s16)):
            calls.append(lambda split=split, dt=dt, qkv=qkv, st=st, snap=snap: recurrent_step(
                qkv, torch.randn(B, 32, dtype=dt), torch.randn(B, 32, dtype=dt),
                torch.randn(B, 4096, dtype=dt), st, slots, torch.zeros(32), torch.zeros(32),
                torch.ones(128, dtype=dt), 16, 1e-6, dv_split=split, snapshot=snap))
        # a verify step's GDN: 3 tokens of B sequences a launch (kernels/gdn_verify.py)
        for split, st in ((1, rec), (2, rec), (1, r16)):
            calls.append(lambda split=split, st=st, dt=dt, conv_state=conv_state: recurrent_verify(
                conv_verify(torch.randn(3 * B, 8192, dtype=dt), conv_state,
                            torch.zeros(8192, 4, dtype=dt), slots,
                            torch.zeros(2, B, 8192, 3, dtype=dt)),
                torch.randn(3 * B, 32, dtype=dt), torch.randn(3 * B, 32, dtype=dt),
                torch.randn(3 * B, 4096, dtype=dt), st, slots, torch.zeros(32), torch.zeros(32),
                torch.ones(128, dtype=dt), 16, 1e-6,
                torch.zeros((2, B, 32, 128, 128), dtype=st.dtype), dv_split=split))
        # the verify step's state commits (HybridCache.commit_many): conv (dt) and recurrent
        for st_dt, tail in ((dt, (8192, 3)), (torch.float32, (32, 128, 128))):
            calls.append(lambda st_dt=st_dt, tail=tail: commit_snapshots(
                torch.zeros((30, 2, 4) + tail, dtype=st_dt), torch.zeros((30, 5) + tail,
                                                                      dtype=st_dt),
                torch.tensor([[0, 1], [2, 3], [1, 4]])))
        kc = torch.zeros(9, 16, 2, 256, dtype=dt)
        for splits in (8, 32):  # 32: 32-key blocks, merge over D (kb/0019)
            calls.append(lambda splits=splits, dt=dt, kc=kc: paged_decode_attention(
                torch.randn(B, 16, 256, dtype=dt), kc, kc, torch.zeros(B, 4, dtype=torch.int32),
                torch.tensor([1, 17, 40], dtype=torch.int32), num_splits=splits))
        # the output gate in the merge (kb/0036): a strided view of the q|gate rows
        calls.append(lambda dt=dt, kc=kc: paged_decode_attention(
            torch.randn(B, 16, 256, dtype=dt), kc, kc, torch.zeros(B, 4, dtype=torch.int32),
            torch.tensor([1, 17, 40], dtype=torch.int32),
            gate=torch.randn(B, 16, 512, dtype=dt)[..., 256:]))
    return calls


KERNELS = {"_qk_norm_rope_kernel", "_moe_combine_kernel", "_silu_mul_kernel", "_gate_up_kernel",
           "_down_kernel", "_fp8_linear_kernel", "_add_rms_norm_kernel", "_attn_split_kernel",
           "_attn_merge_kernel", "_route_align_kernel", "_conv_step_kernel",
           "_conv_prefill_kernel", "_conv_state_kernel",
           "_recurrent_kernel", "_route_rows_kernel", "_align_sort_kernel",
           "gated_norm_kernel", "_dequant_kernel", "_unsort_weighted_kernel",
           "_conv_verify_kernel", "_recurrent_verify_kernel", "_commit_kernel",
           "_dequant_experts_kernel", "_route_gate_up_kernel",
           "_gemv_gate_up_kernel", "_gemv_down_kernel", "_fp8_gemv_kernel", "_splitk_kernel",
           "_reduce_kernel", "_blocks_kernel", "_quant_groups_kernel"}


def _compile(recs) -> list[dict]:
    """Compile the recorded launches for sm_90 in a subprocess without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # the repository first, then the caller's path: a Triton of the GPU's version (3.6)
    # installed apart compiles with PYTHONPATH=<its dir> (kb/0038: 3.9 here accepted a kernel
    # that 3.6 refused)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2])]
                                        + [p for p in [os.environ.get("PYTHONPATH")] if p])
    p = subprocess.run([sys.executable, "-c", COMPILE], input=json.dumps(recs), text=True,
                       capture_output=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    bad = [r for r in res if not r["ok"]]
    assert not bad, "\n".join(f"{r['key']}\n  {r['error']}" for r in bad)
    return res


def _need_ptxas():
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("Triton's bundled ptxas is not installed")


def _pdl_records(monkeypatch, switches) -> list[dict]:
    """The bf16 launches (the served dtype) recorded with PDL on as on sm_90+: every kernel
    of KERNELS is among them, each launch with the PDL constexpr and launch_pdl option."""
    from tailored.kernels import pdl

    switches(pdl=True)
    monkeypatch.setattr(pdl, "_on_sm90", lambda t: True)
    recs = _record(_calls((torch.bfloat16,)))
    assert KERNELS <= {r["name"] for r in recs}
    off = [r["key"] for r in recs if r["constexprs"].get("PDL") is not True
           or r["options"].get("launch_pdl") is not True]
    assert not off, f"launched without PDL: {off}"
    return recs


def test_every_kernel_launch_carries_pdl(monkeypatch, switches):
    """The recording alone (seconds; the compiles below take minutes with a cold Triton cache
    and run in the slow tier): every kernel is launched, and with PDL on each launch carries
    the PDL constexpr and Triton's launch_pdl option."""
    _pdl_records(monkeypatch, switches)


@pytest.mark.slow  # ~90 s of ptxas with a cold Triton cache (~7 s warm)
def test_every_kernel_compiles_for_sm90_with_pdl(monkeypatch, switches):
    """PDL on (kernels/pdl.py, the default on sm_90+): every kernel launch carries the PDL
    constexpr and Triton's launch_pdl option, and its PTX has the wait and the launch of
    dependents, the wait before any global store and (but in PDL_PREFETCH, which loads weights
    first) any global load (bf16 launches, the served dtype: half the compile time of the test
    below). The CUDA-only autotuned launchers share the kernels and pdl_launch calls with the
    interpreter branch recorded here."""
    _need_ptxas()
    recs = _pdl_records(monkeypatch, switches)
    res = _compile(recs)
    names = {r["key"]: r["name"] for r in recs}
    want = {k: [True, True, True, n not in PDL_PREFETCH] for k, n in names.items()}
    missing = [r["key"] for r in res if r["gdc"] != want[r["key"]]]
    assert not missing, f"griddepcontrol missing or misplaced in: {missing}"


@pytest.mark.slow  # ~300 s of ptxas with a cold Triton cache (~25 s warm), fp32 and bf16
def test_every_kernel_compiles_for_sm90():
    _need_ptxas()
    recs = _record(_calls())
    names = {r["name"] for r in recs}
    assert KERNELS <= names, names
    assert all(r["constexprs"].get("PDL") is False for r in recs)  # CPU tensors: no PDL
    res = _compile(recs)
    fma = [r["key"] for r in res if r["bf16_fma"] and json.loads(r["key"])[0] in NO_FMA]
    assert not fma, f"bf16 FMA in a kernel that must round like the eager ops: {fma}"
