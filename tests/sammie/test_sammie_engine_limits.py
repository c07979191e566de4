"""The engine under hostile input (a helper's attack, sammie-hard): one request's fault stays
its own in a batch; decoding and masks stay within bounded memory and a mask budget."""

from __future__ import annotations

import asyncio
import io
import struct
import zlib

import pytest
import torch
import torch.nn.functional as F

from sammie.engine import postprocess
from sammie.engine.batcher import Batcher
from sammie.engine.images import MAX_JPEG_SCANS, CorruptImage, ImageTooLarge, TooManyScans, \
    decode, resize_normalise
from sammie.engine.postprocess import MaskBudgetExceeded, Options, check_mask_budget, instances, \
    kept
from sammie.model.sam3 import Detections


def test_a_failing_job_does_not_fail_its_batch_mates():
    calls = []

    def run(jobs):
        calls.append(list(jobs))
        if "boom" in jobs:
            raise RuntimeError("can't allocate memory")
        return [ValueError("own fault") if j == "own" else j.upper() for j in jobs]

    async def main():
        b = Batcher(run, max_batch=8, max_wait_ms=200)
        b.start()
        try:
            return await asyncio.gather(*(b.submit(j) for j in ("a", "boom", "b", "own")),
                                        return_exceptions=True)
        finally:
            await b.stop()

    out = asyncio.run(main())
    assert out[0] == "A" and out[2] == "B"
    assert isinstance(out[1], RuntimeError) and isinstance(out[3], ValueError)
    assert calls[0] == ["a", "boom", "b", "own"]  # one batch, then each job alone
    assert calls[1:] == [["a"], ["boom"], ["b"], ["own"]]


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _png_declaring(width: int, height: int) -> bytes:
    def chunk(kind, data):
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0"))
            + chunk(b"IEND", b""))


def _progressive_jpeg_repeating_its_last_scan(times: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (64, 64)).save(buf, format="JPEG", progressive=True)
    data = buf.getvalue()
    last = data.rindex(b"\xff\xda")
    scan = data[last:data.rindex(b"\xff\xd9")]
    return data[:-2] + scan * times + b"\xff\xd9"


MEAN = STD = (0.5, 0.5, 0.5)


def test_a_header_over_pils_bomb_limit_is_413_not_400():
    for data in (_png_declaring(100_000, 100_000), _png_declaring(7000, 7000)):
        with pytest.raises(ImageTooLarge, match="--max-image-pixels"):
            decode(data, 56, MEAN, STD, max_pixels=40_000_000)


def test_a_jpeg_with_too_many_scans_is_refused_before_decoding():
    ok = _progressive_jpeg_repeating_its_last_scan(10)
    assert decode(ok, 56, MEAN, STD).width == 64  # repeated scans decode (slowly when many)
    with pytest.raises(TooManyScans, match="scans") as e:
        decode(_progressive_jpeg_repeating_its_last_scan(MAX_JPEG_SCANS), 56, MEAN, STD)
    assert e.value.status == 400


def test_a_bad_header_names_no_object_address():
    with pytest.raises(CorruptImage) as e:
        decode(b"\x89PNG\r\n\x1a\n" + b"\0" * 30, 56, MEAN, STD)
    assert "0x" not in str(e.value) and "header" in str(e.value)


def test_resizing_one_channel_at_a_time_gives_the_joint_resize_numbers():
    torch.manual_seed(0)
    for h, w in ((37, 301), (256, 256), (480, 640)):
        img = torch.randint(0, 256, (3, h, w), dtype=torch.uint8)
        joint = F.interpolate(img[None].float(), size=(56, 56), mode="bilinear",
                              align_corners=False, antialias=True).round_().clamp_(0, 255)
        m = s = torch.tensor(MEAN).view(1, 3, 1, 1)
        want = ((joint * (1 / 255) - m) / s)[0]  # the joint recipe, as it was written
        assert torch.equal(resize_normalise(img, 56, MEAN, STD), want)


def _detections(q: int = 6, side: int = 12):
    g = torch.Generator().manual_seed(0)
    return Detections(logits=torch.full((1, q), 5.0), presence=torch.full((1,), 5.0),
                      boxes=torch.rand(1, q, 4, generator=g),
                      mask_embed=torch.randn(1, q, 8, generator=g),
                      pixels=torch.randn(1, 8, side, side, generator=g))


def test_masks_resized_in_chunks_are_the_masks_resized_at_once(monkeypatch):
    det, opt = _detections(), Options(threshold=0.0)
    whole = instances(det, 0, 50, 40, opt)
    monkeypatch.setattr(postprocess, "MASK_CHUNK_ELEMENTS", 50 * 40 * 2)  # 2 masks a chunk
    assert instances(det, 0, 50, 40, opt) == whole and len(whole) == 6


def test_the_mask_budget_counts_every_kept_mask_before_any_is_made():
    det = _detections()
    opt = Options(threshold=0.0, max_instances=4, max_mask_pixels=4 * 50 * 40)
    assert kept(det, 0, opt) == 4
    check_mask_budget(4, 50, 40, opt)
    with pytest.raises(MaskBudgetExceeded, match="--max-mask-pixels"):
        check_mask_budget(5, 50, 40, opt)
    check_mask_budget(5, 50, 40, Options(mask_format="none", max_mask_pixels=1))
