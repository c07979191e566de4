"""The NVFP4 format (spec §9.2, tailored/model/nvfp4.py) pinned against independent readings:
the code table, the nibble order and the global scale's direction as ModelOpt's NVFP4 export
defines them (constants read from its source, docs/nvfp4.md), and the whole quantize / pack /
dequantize chain against the compressed-tensors package (skipped when it is not installed:
`pip install compressed-tensors`)."""

from __future__ import annotations

import pytest
import torch

from tailored.model import nvfp4


def _weight(N, K, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g)
    w[: N // 4] *= 30.0  # a range of block scales
    w[N // 2, :16] = 0  # an all-zero block
    return w


def test_code_table_nibble_order_and_ties_as_modelopt_defines_them():
    # ModelOpt's e2m1 table: codes 0-7 = 0, .5, 1, 1.5, 2, 3, 4, 6; 8-15 their negatives
    assert nvfp4.E2M1_VALUES.tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, 0, -.5, -1, -1.5, -2, -3, -4, -6]
    codes = nvfp4.encode_e2m1(torch.tensor([0.5, -6.0, 0.0, 1.5]))
    assert codes.tolist() == [1, 15, 0, 3]
    # two codes a byte, the even element in the low nibble: (q[1::2] << 4) | q[0::2]
    assert nvfp4.pack(codes[None]).tolist() == [[0xF1, 0x30]]
    assert nvfp4.unpack(torch.tensor([[0xF1, 0x30]], dtype=torch.uint8)).tolist() == [[1, 15, 0, 3]]
    # round to nearest, ties to the even code (mantissa bit 0), saturate at 6
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, 0.26, -0.74, -0.1])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 0.5, -0.5, -0.0]
    got = nvfp4.E2M1_VALUES[nvfp4.encode_e2m1(x).long()]
    assert got.tolist() == want
    assert nvfp4.encode_e2m1(torch.tensor([-0.1])).item() == 8  # a negative that rounds to 0


def test_every_code_round_trips_and_odd_widths_are_refused():
    codes = torch.arange(16, dtype=torch.uint8).repeat(3, 2)  # [3, 32]
    assert torch.equal(nvfp4.unpack(nvfp4.pack(codes)), codes)
    vals = nvfp4.E2M1_VALUES[codes.long()]
    assert torch.equal(nvfp4.encode_e2m1(vals)[vals != 0], codes[vals != 0])
    with pytest.raises(ValueError, match="odd"):
        nvfp4.pack(codes[:, :3])
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize(torch.randn(4, 40))


@pytest.mark.parametrize("N,K", [(96, 160), (7, 16), (33, 2048)])
def test_quantize_scales_and_round_trip_error(N, K):
    w = _weight(N, K, N + K)
    packed, scale, s2 = nvfp4.quantize(w)
    assert packed.dtype == torch.uint8 and packed.shape == (N, K // 2)
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (N, K // 16) and s2.shape == ()
    # ModelOpt's direction: weight_scale_2 = amax / (6·448) is a multiplier
    assert torch.allclose(s2, w.abs().max() / (6 * 448))
    d = nvfp4.dequantize(packed, scale, s2, torch.float32)
    assert d.shape == w.shape and torch.isfinite(d).all()
    if N > 2:
        assert (d[N // 2, :16] == 0).all() and scale[N // 2, 0].float() == 1.0
    # every element within half an E2M1 step of its block: ≤ amax(block)/6 · 1 (the 4→6 gap)
    # plus the e4m3 rounding of the block scale (2^-4 relative)
    blocks_amax = w.abs().reshape(N, K // 16, 16).amax(-1).repeat_interleave(16, -1)
    assert ((d - w).abs() <= blocks_amax * (1 / 6 + 1 / 16) + 1e-6).all()
    # the largest element of the tensor comes back within e4m3 rounding of itself
    i = w.abs().argmax()
    assert abs(d.flatten()[i] - w.flatten()[i]) <= w.abs().max() / 16
    rel = ((d - w).norm() / w.norm()).item()
    assert 0.02 < rel < 0.15  # 4-bit rounding shows, and stays 4-bit sized


def test_zero_tensor_and_expert_layout():
    p, s, s2 = nvfp4.quantize(torch.zeros(4, 32))
    assert s2.item() == 1.0 and (nvfp4.dequantize(p, s, s2, torch.float32) == 0).all()
    w = torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(1))
    w[1, 4:] *= 100  # the up half of expert 1 has its own global scale
    packed, scale, scale_2 = nvfp4.quantize_experts(w, parts=2)
    assert packed.shape == (3, 8, 16) and scale.shape == (3, 8, 2) and scale_2.shape == (3, 2)
    assert scale_2[1, 1] > 50 * scale_2[1, 0]
    view = nvfp4.DequantExperts(packed, scale, scale_2, torch.float32)
    p1, s1, g1 = nvfp4.quantize(w[1, 4:])
    assert torch.equal(view[1][4:], nvfp4.dequantize(p1, s1, g1, torch.float32))
    assert torch.equal(view.all()[2], view[2])


def test_global_scale_conversions_are_inverses():
    s2 = torch.tensor(0.0123)
    g = nvfp4.global_to_compressed_tensors(s2)
    assert g.shape == (1,) and torch.allclose(g * s2, torch.ones(1))
    assert torch.allclose(nvfp4.global_from_compressed_tensors(g), s2, rtol=1e-7)


# ---- against compressed-tensors ---------------------------------------------------------
def _ct():
    return pytest.importorskip("compressed_tensors")


def _ct_args():
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16,
                            symmetric=True, dynamic=False, scale_dtype=torch.float8_e4m3fn)


def test_packing_matches_compressed_tensors():
    _ct()
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8

    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (9, 34), generator=g, dtype=torch.uint8)
    codes[codes == 8] = 0  # -0 and 0 are one value to a float packer
    vals = nvfp4.E2M1_VALUES[codes.long()]
    assert torch.equal(pack_fp4_to_uint8(vals), nvfp4.pack(codes))
    ours = nvfp4.pack(codes)
    assert torch.equal(unpack_fp4_from_uint8(ours, 9, 34, dtype=torch.float32), vals)


@pytest.mark.parametrize("N,K", [(96, 160), (5, 48)])
def test_quantization_matches_compressed_tensors(N, K):
    """compressed-tensors quantizes w with its own global and group scales: the same codes
    and e4m3 scales as ours (bar all-zero blocks: its scale there is e4m3's eps, ours 1 as
    ModelOpt's; both dequantize to 0), its global scale the inverse of our scale_2, and its
    fp32 dequantization ours."""
    _ct()
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    w = _weight(N, K, 3 * N + K)
    args = _ct_args()
    gs = generate_gparam(w.amin(), w.amax())
    b = w.reshape(N, K // 16, 16)
    s, zp = calculate_qparams(b.amin(-1), b.amax(-1), args, global_scale=gs)
    q = quantize(w, s, zp, args, global_scale=gs)
    packed, scale, s2 = nvfp4.quantize(w)
    nonzero = b.abs().amax(-1) > 0
    assert torch.equal(scale.float()[nonzero], s.float()[nonzero])
    assert torch.equal(packed, pack_fp4_to_uint8(q))
    assert torch.allclose(nvfp4.global_from_compressed_tensors(gs), s2, rtol=1e-6)
    theirs = dequantize(q, s, zp, args, dtype=torch.float32, global_scale=gs)
    ours = nvfp4.dequantize(packed, scale, nvfp4.global_from_compressed_tensors(gs), torch.float32)
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)


def test_compressed_tensors_decompresses_what_synth_writes():
    """The tensors `tailored synth --format compressed-tensors` writes for a linear, handed
    to compressed-tensors' own NVFP4 decompressor: the weight our loader dequantizes (the
    decompressor works in bf16)."""
    _ct()
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme

    from tailored.model import nvfp4_tensors

    w = _weight(64, 96, 11)
    sd = {k.rpartition(".")[2]: v for k, v in
          nvfp4_tensors.checkpoint_tensors("nvfp4", "compressed-tensors", "x.weight", w)}
    assert set(sd) == {"weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"}
    scheme = QuantizationScheme(targets=["Linear"], weights=_ct_args())
    got = NVFP4PackedCompressor.decompress(
        {k: sd[k] for k in ("weight_packed", "weight_scale", "weight_global_scale")}, scheme)
    s2 = nvfp4.global_from_compressed_tensors(sd["weight_global_scale"])
    ours = nvfp4.dequantize(sd["weight_packed"], sd["weight_scale"], s2, torch.bfloat16)
    assert torch.allclose(got["weight"].float(), ours.float(), rtol=2 ** -7, atol=0)
    # and it is w, to 4 bits
    assert ((ours.float() - w).norm() / w.norm()).item() < 0.15
