"""kernels/prefill_attention.py (a prompt chunk's causal attention, three ways) and kernels/fa3.py
(FlashAttention-3 through ctypes) against the fp32 reference: fresh prompts (L == S) and chunks
after a cached context (L < S, bottom-right mask), grouped heads, odd lengths, strided views of
one q|k|v projection output as the model passes them, a NaN-poisoned output buffer.

CPU: sdpa and flash in fp32 (SDPA's math kernels); fa3's refusals (no library, no CUDA, bad
shapes). GPU: all three in bf16 at head dim 256 (fa3 where lab/build_fa3.sh's library loads:
the device calls carry .fa3/), and fa3 inside a CUDA graph replayed on new inputs.
"""

from __future__ import annotations

import pytest
import torch

from tailored import flags
from tailored.kernels import fa3, prefill_attention

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
D = 256 if CUDA else 32
# (L, S, query heads, key heads): fresh prompts, chunks after a context, one-token chunks,
# the model's 16/2 heads and 4/2
CASES = [(1, 1, 16, 2), (7, 7, 16, 2), (129, 129, 4, 2), (200, 200, 16, 2), (5, 300, 16, 2),
         (1, 77, 16, 2), (129, 1000, 4, 2), (333, 334, 16, 2)]


def _qkv(L, S, Hq, Hkv, seed):
    """q [L, Hq, D] (the last L positions), k, v [S, Hkv, D]: strided views of one projection
    output of S rows, as the model's q|k|v GEMM gives them."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(S, (Hq + 2 * Hkv) * D, generator=g).to(DEV, DTYPE)
    q = w[S - L:, :Hq * D].view(L, Hq, D)
    k = w[:, Hq * D:(Hq + Hkv) * D].view(S, Hkv, D)
    v = w[:, (Hq + Hkv) * D:].view(S, Hkv, D)
    return q, k, v


def _fa3_loads() -> bool:
    try:
        fa3.load()
        return True
    except fa3.FA3Unavailable:
        return False


WAYS = ["sdpa", "flash"] + (["fa3"] if CUDA and _fa3_loads() else [])


@pytest.mark.parametrize("L,S,Hq,Hkv", CASES)
def test_each_way_matches_the_fp32_reference(L, S, Hq, Hkv, switches):
    q, k, v = _qkv(L, S, Hq, Hkv, seed=L * 1000 + S)
    ref = fa3.causal_attention_reference(q, k, v)
    errs = {}
    for way in WAYS:
        switches(prefill_attention=way)
        out = prefill_attention.causal_attention(q, k, v)
        assert out.shape == (L, Hq, D) and out.dtype == DTYPE
        errs[way] = (out.float() - ref).abs().max().item()
    if not CUDA:  # fp32 math kernels: the same sums
        assert max(errs.values()) < 1e-5, errs
    else:  # bf16: no way may be worse than twice today's SDPA, nor past bf16's resolution
        for way, e in errs.items():
            assert e <= 2 * errs["sdpa"] + 2e-3 and e < 3e-2, errs


def test_flash_repeats_the_heads_where_its_kernel_does_not_group_them(switches, monkeypatch):
    """Where this torch's flash kernel takes no grouped heads, the flash way repeats them
    (else SDPA would fall to its math kernel's [heads, L, S] scores): the same result."""
    q, k, v = _qkv(129, 1000, 16, 2, seed=9)
    switches(prefill_attention="flash")
    grouped = prefill_attention.causal_attention(q, k, v)
    monkeypatch.setattr(prefill_attention, "_flash_takes_grouped_heads", lambda d, t: False)
    repeated = prefill_attention.causal_attention(q, k, v)
    assert (repeated.float() - grouped.float()).abs().max() < (2e-2 if CUDA else 1e-6)


def test_a_chunk_sees_exactly_its_causal_past(switches):
    """Bottom-right mask: changing a key after the last query's position changes nothing;
    changing the first key changes every query's output."""
    q, k, v = _qkv(5, 40, 4, 2, seed=3)
    k, v = k.clone(), v.clone()
    for way in WAYS:
        switches(prefill_attention=way)
        base = prefill_attention.causal_attention(q, k, v)
        # a 41st key (a later position) must not be seen: drop it in, compare on the first 40
        k2, v2 = torch.cat([k, k[:1] * 5]), torch.cat([v, v[:1] * 5])
        later = prefill_attention.causal_attention(
            torch.cat([q, q[:1]]), k2, v2)[:5]  # queries at positions 35..39 of 41 keys
        assert (later.float() - base.float()).abs().max() < (1e-2 if CUDA else 1e-6), way
        v3 = v.clone()
        v3[0] += 3
        moved = prefill_attention.causal_attention(q, k, v3)
        assert (moved - base).abs().amax(dim=(1, 2)).min() > 0, way


def test_fa3_is_refused_clearly_where_it_cannot_run(tmp_path, switches):
    switches(prefill_attention="fa3")
    if not CUDA:
        with pytest.raises(fa3.FA3Unavailable, match="CUDA device"):
            prefill_attention.check_choice(torch.device("cpu"))
    missing = tmp_path / "none.so"
    with pytest.raises(fa3.FA3Unavailable, match="lab/build_fa3.sh"):
        fa3._load(str(missing))
    junk = tmp_path / "junk.so"
    junk.write_text("not a library")
    with pytest.raises(fa3.FA3Unavailable, match="does not load"):
        fa3._load(str(junk))
    switches(fa3_lib=str(missing))
    assert fa3.library_path() == missing


def test_fa3_refuses_shapes_it_was_not_built_for():
    """Refused in Python before the library is asked (no GPU needed); an `out` of the wrong
    shape too."""
    q = torch.zeros(4, 16, 128)
    with pytest.raises(ValueError, match="head dim 256"):
        fa3.attention(q, torch.zeros(4, 2, 128), torch.zeros(4, 2, 128))
    q = torch.zeros(4, 15, 256)
    with pytest.raises(ValueError, match="heads must divide"):
        fa3.attention(q, torch.zeros(4, 2, 256), torch.zeros(4, 2, 256))
    with pytest.raises(ValueError, match="0 < L <= S"):
        fa3.attention(torch.zeros(5, 16, 256), torch.zeros(4, 2, 256), torch.zeros(4, 2, 256))
    with pytest.raises(ValueError, match="bf16 on q's CUDA device"):
        fa3.attention(torch.zeros(4, 16, 256), torch.zeros(4, 2, 256), torch.zeros(4, 2, 256))
    with pytest.raises(ValueError, match="out"):
        fa3.attention(torch.zeros(4, 16, 256), torch.zeros(4, 2, 256), torch.zeros(4, 2, 256),
                      out=torch.zeros(3, 16, 256))


def test_the_switch_is_declared_with_its_ways():
    f = [f for f in flags.Flags.__dataclass_fields__.values() if f.name == "prefill_attention"]
    assert f[0].metadata["choices"] == ("sdpa", "flash", "fa3")
    assert flags.Flags().prefill_attention == "sdpa"  # the default until the GPU A/B


needs_fa3 = pytest.mark.skipif("fa3" not in WAYS, reason="CUDA and lab/build_fa3.sh's library")


@needs_fa3
def test_fa3_writes_every_output_row_over_a_nan_buffer():
    q, k, v = _qkv(333, 1000, 16, 2, seed=5)
    out = torch.full((333, 16, 256), float("nan"), dtype=torch.bfloat16, device="cuda")
    fa3.attention(q, k, v, out=out)
    assert torch.isfinite(out).all()
    ref = fa3.causal_attention_reference(q, k, v)
    assert (out.float() - ref).abs().max().item() < 3e-2


@needs_fa3
def test_fa3_replays_in_a_cuda_graph_on_new_inputs():
    """The prefill graphs capture the chunk's attention: the tile counter is reset inside the
    graph, so a replay over new inputs equals an eager call."""
    q, k, v = _qkv(200, 200, 16, 2, seed=6)
    fa3.attention(q, k, v)  # first call outside the capture (state, library)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        out = fa3.attention(q, k, v)
    torch.cuda.current_stream().wait_stream(s)
    for seed in (7, 8):
        q2, k2, v2 = _qkv(200, 200, 16, 2, seed=seed)
        q.copy_(q2)
        k.copy_(k2)
        v.copy_(v2)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fa3.attention(q, k, v))


@pytest.mark.skipif(not fa3.DEFAULT_LIB.is_file(), reason="lab/build_fa3.sh not run here")
def test_the_built_library_checks_its_arguments_before_any_cuda_call():
    """The C entry's own refusals, through the same ctypes signature `attention` uses: its
    argument list and the error text agree with kernels/fa3.py (runs without a GPU)."""
    lib = fa3._load(str(fa3.DEFAULT_LIB))
    zeros = [0] * 8

    def call(L, S, Hq, Hkv, D, ptr=None, strides=zeros):
        return lib.tailored_fa3_fwd(ptr, ptr, ptr, ptr, ptr, ptr, L, S, Hq, Hkv, D,
                                    *strides, 0.0625, 1, 132, 0, None)

    assert call(4, 4, 16, 2, 128) == 1
    assert b"head dim 256" in lib.tailored_fa3_error()
    assert call(5, 4, 16, 2, 256) == 1
    assert b"seqlen_q <= seqlen_k" in lib.tailored_fa3_error()
    assert call(4, 4, 15, 2, 256) == 1
    assert b"multiple of key heads" in lib.tailored_fa3_error()
    assert call(4, 4, 16, 2, 256) == 1  # null pointers
    assert b"null pointer" in lib.tailored_fa3_error()
    assert call(4, 4, 16, 2, 256, ptr=4096 + 8, strides=[4096, 256] * 4) == 1
    assert b"16-byte aligned" in lib.tailored_fa3_error()
    assert call(4, 4, 16, 2, 256, ptr=4096, strides=[4096, 252] * 4) == 1
    assert b"multiple of 8" in lib.tailored_fa3_error()


def _paged_case(C, T, n, seed, pages_total=48, ps=16, width=12):
    """A KV cache of `pages_total` pages with random content, one sequence of C + T keys on
    scattered pages, q of n rows (the chunk's T, then pads), the sequence's page table of
    `width` entries and its keys gathered in order (for the reference). The table past the
    sequence's pages holds out-of-range page numbers (a longer sequence's leftovers): a read
    there would fault."""
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(pages_total, ps, 2, 256, generator=g).to("cuda", torch.bfloat16)
    vc = torch.randn(pages_total, ps, 2, 256, generator=g).to("cuda", torch.bfloat16)
    npages = (C + T + ps - 1) // ps
    pages = (torch.randperm(pages_total - 1, generator=g)[:npages] + 1).tolist()
    table = torch.full((width,), 1 << 30, dtype=torch.int32)
    table[:npages] = torch.tensor(pages)
    q = torch.randn(n, 16, 256, generator=g).to("cuda", torch.bfloat16)
    rows = torch.arange(C + T)
    idx = (table.long()[rows // ps] * ps + rows % ps).cuda()
    kk = kc.view(-1, 2, 256)[idx]
    vv = vc.view(-1, 2, 256)[idx]
    return q, kc, vc, table.cuda(), kk, vv


@needs_fa3
@pytest.mark.parametrize("C,T,n,pages,width", [(1, 1, 4, 48, 12), (31, 17, 32, 48, 12),
                                               (100, 64, 64, 48, 12), (150, 5, 8, 48, 12),
                                               (8192, 2048, 2048, 700, 1100)])
def test_fa3_paged_chunk_matches_the_reference_over_its_pages(C, T, n, pages, width):
    q, kc, vc, table, kk, vv = _paged_case(C, T, n, seed=C + T, pages_total=pages, width=width)
    used_q = torch.tensor([T], dtype=torch.int32, device="cuda")
    used_k = torch.tensor([C + T], dtype=torch.int32, device="cuda")
    out = fa3.paged_attention(q, kc, vc, table, used_q, used_k)
    ref = fa3.causal_attention_reference(q[:T], kk, vv)
    sdpa = prefill_attention.causal_sdpa(q[:T], kk, vv)
    err, base = (out[:T].float() - ref).abs().max().item(), (sdpa.float() - ref).abs().max().item()
    assert err <= 2 * base + 2e-3 and err < 3e-2, (err, base)


@needs_fa3
def test_fa3_paged_replays_in_a_graph_for_any_context():
    """One captured graph of two calls (two layers) serves chunks of different lengths and
    contexts: only the device lengths and the page table change between replays."""
    n = 32
    q, kc, vc, table, _, _ = _paged_case(40, 20, n, seed=1)
    used_q = torch.tensor([20], dtype=torch.int32, device="cuda")
    used_k = torch.tensor([60], dtype=torch.int32, device="cuda")
    fa3.paged_attention(q, kc, vc, table, used_q, used_k)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        first = fa3.paged_attention(q, kc, vc, table, used_q, used_k)
        out = fa3.paged_attention(q, kc, vc, table, used_q, used_k)
    torch.cuda.current_stream().wait_stream(s)
    for C, T, seed in ((100, 7, 2), (3, 32, 3)):
        q2, kc2, vc2, table2, kk, vv = _paged_case(C, T, n, seed=seed)
        q.copy_(q2)
        kc.copy_(kc2)
        vc.copy_(vc2)
        table.copy_(table2)
        used_q.fill_(T)
        used_k.fill_(C + T)
        g.replay()
        torch.cuda.synchronize()
        ref = fa3.causal_attention_reference(q[:T], kk, vv)
        assert (out[:T].float() - ref).abs().max().item() < 3e-2
        assert torch.equal(first[:T], out[:T])


def test_fa3_paged_refuses_a_batch_of_tables_or_lengths():
    """One sequence a call: a [B, P] table or lengths of B > 1 are refused before the library
    is asked (a reshape would have read B tables as one)."""
    q = torch.zeros(4, 16, 256)
    cache = torch.zeros(3, 16, 2, 256)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="one sequence's page table"):
        fa3.paged_attention(q, cache, cache, torch.zeros(2, 5, dtype=torch.int32), one, one)
    with pytest.raises(ValueError, match="one-element lengths"):
        fa3.paged_attention(q, cache, cache, torch.zeros(5, dtype=torch.int32),
                            torch.ones(2, dtype=torch.int32), one)
    with pytest.raises(ValueError, match="bf16 on q's CUDA device"):
        fa3.paged_attention(q, cache, cache, torch.zeros(1, 5, dtype=torch.int32), one, one)


@pytest.mark.skipif(not fa3.DEFAULT_LIB.is_file(), reason="lab/build_fa3.sh not run here")
def test_the_built_library_checks_the_paged_call_before_any_cuda_call():
    lib = fa3._load(str(fa3.DEFAULT_LIB))
    assert lib.tailored_fa3_meta_ints() == 17

    def call(ptr, ints, strides):
        return lib.tailored_fa3_fwd_paged(*([ptr] * 9), *ints, *strides, 0.0625, 132, 0, None)

    good = [4096, 256, 512, 256, 8192, 512, 256, 8192, 4096, 256]
    assert call(4096, [32, 12, 16, 48, 16, 2, 128], good) == 1
    assert b"head dim 256" in lib.tailored_fa3_error()
    assert call(4096, [32, 0, 16, 48, 16, 2, 256], good) == 1
    assert b"positive seqlen_q, max_pages" in lib.tailored_fa3_error()
    assert call(None, [32, 12, 16, 48, 16, 2, 256], good) == 1
    assert b"null pointer" in lib.tailored_fa3_error()
    assert call(4104, [32, 12, 16, 48, 16, 2, 256], good) == 1
    assert b"16-byte aligned" in lib.tailored_fa3_error()
    assert call(4096, [32, 12, 16, 48, 16, 2, 256], good[:-1] + [250]) == 1
    assert b"multiple of 8" in lib.tailored_fa3_error()
