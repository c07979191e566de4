"""Sammie's model against transformers' Sam3Model with the same weights (tiny synthetic
checkpoint), its tokenizer against transformers' CLIPTokenizer on the same files, RLE, the
frozen gate cases. The reference tests skip without transformers (CI has it: the test extra)."""

from __future__ import annotations

import hashlib
import io
import json

import numpy as np
import pytest
import torch

from sammie.checkpoint import load_model, read_state_dict
from sammie.engine import rle
from sammie.gate.cases import CASES_DIR, SPECS, draw
from sammie.model.geometry import roi_align
from sammie.synth import write_synthetic_checkpoint
from sammie.tokenizer import PromptTokenizer

PROMPTS = ["every car", "the Red  mug", "visual", "xylophone 42!", "dog"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("sam") / "tiny", "tiny", seed=3)


@pytest.fixture(scope="module")
def hf(ckpt):
    transformers = pytest.importorskip("transformers", reason="the reference is transformers'")
    return transformers.Sam3Model.from_pretrained(str(ckpt)).eval()


def test_synthetic_checkpoint_has_every_reference_name_and_loads_strictly(ckpt, hf):
    assert set(read_state_dict(ckpt)) == set(hf.state_dict())
    bad = ckpt.parent / "bad"
    write_synthetic_checkpoint(bad, "tiny")
    from safetensors.torch import load_file, save_file

    t = load_file(str(bad / "model.safetensors"))
    t["detr_decoder.extra.weight"] = torch.zeros(1)
    del t["mask_decoder.instance_projection.bias"]
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="instance_projection.bias.*detr_decoder.extra"):
        load_model(bad)


def test_video_checkpoint_layout_loads_the_detector(ckpt, tmp_path):
    """A sam3_video checkpoint: detector_model.* beside tracker tensors, detector_config."""
    from safetensors.torch import load_file, save_file

    t = {f"detector_model.{k}": v for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    t["tracker_model.x.weight"] = torch.zeros(2)
    save_file(t, str(tmp_path / "model.safetensors"))
    cfg = json.loads((ckpt / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "sam3_video",
                                                      "detector_config": cfg}))
    m = load_model(tmp_path)
    assert torch.equal(m.detr_decoder.query_embed.weight, load_model(ckpt).detr_decoder
                       .query_embed.weight)


def test_outputs_match_transformers_with_the_same_weights(ckpt, hf):
    m = load_model(ckpt)
    ids, mask = PromptTokenizer(ckpt).encode(PROMPTS[:3])
    px = torch.randn(3, 3, 168, 168, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(pixel_values=px, input_ids=ids, attention_mask=mask.long())
        det = m.detect(m.encode_images(px), torch.arange(3), m.encode_text(ids, mask), mask)
    masks = torch.einsum("pqc,pchw->pqhw", det.mask_embed, det.pixels)
    for ours, theirs in ((det.logits, ref.pred_logits), (det.boxes, ref.pred_boxes),
                         (det.presence, ref.presence_logits.view(-1)), (masks, ref.pred_masks)):
        assert theirs.std() > 0.1 or theirs.abs().max() > 0.3  # not a degenerate output
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)
    # the synthetic statistics spread the scores (most queries low, some high), not all ~0.5
    assert det.scores.std() > 0.02 and (det.scores > 0.3).float().mean() < 0.5


def test_one_batch_of_several_images_and_prompts_matches_rows_alone(ckpt):
    """Rows share a batch (images gathered by index, text-only rows beside box rows with
    masked-out box slots) and give what each row gives alone."""
    m = load_model(ckpt)
    tok = PromptTokenizer(ckpt)
    px = torch.randn(2, 3, 168, 168, generator=torch.Generator().manual_seed(1))
    ids, mask = tok.encode(["dog", "visual", "red mug"])
    boxes = torch.tensor([[[0.5, 0.5, 0.2, 0.3], [0, 0, 0, 0]], [[0.3, 0.4, 0.2, 0.2],
                                                                [0.7, 0.6, 0.1, 0.3]],
                          [[0, 0, 0, 0], [0, 0, 0, 0]]])
    labels = torch.tensor([[1, 0], [1, 0], [0, 0]])
    bmask = torch.tensor([[True, False], [True, True], [False, False]])
    index = torch.tensor([0, 1, 1])
    with torch.no_grad():
        levels = m.encode_images(px)
        text = m.encode_text(ids, mask)
        together = m.detect(levels, index, text, mask, boxes, labels, bmask)
        for r in range(3):
            lv = [x[index[r]:index[r] + 1] for x in levels]
            has = bool(bmask[r].any())
            n = int(bmask[r].sum())
            alone = m.detect(lv, torch.tensor([0]), text[r:r + 1], mask[r:r + 1],
                             boxes[r:r + 1, :n] if has else None, labels[r:r + 1, :n],
                             bmask[r:r + 1, :n])
            torch.testing.assert_close(together.logits[r], alone.logits[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(together.boxes[r], alone.boxes[0], atol=1e-5, rtol=0)


def test_box_prompts_match_transformers_given_the_same_roi_align(ckpt, hf, monkeypatch):
    """transformers' geometry encoder calls torchvision's roi_align; without torchvision it
    gets sammie's (same arguments), so the rest of the box path is compared."""
    from types import SimpleNamespace

    import transformers.models.sam3.modeling_sam3 as ms

    def tv_roi_align(features, boxes, out):
        return torch.cat([roi_align(features[i], b, out) for i, b in enumerate(boxes)])

    monkeypatch.setattr(ms, "torchvision", SimpleNamespace(ops=SimpleNamespace(
        roi_align=tv_roi_align)), raising=False)
    m = load_model(ckpt)
    ids, mask = PromptTokenizer(ckpt).encode(["visual"])
    px = torch.randn(1, 3, 168, 168, generator=torch.Generator().manual_seed(2))
    boxes = torch.tensor([[[0.4, 0.5, 0.3, 0.2], [0.7, 0.3, 0.2, 0.4]]])
    labels = torch.tensor([[1, 0]])
    with torch.no_grad():
        ref = hf(pixel_values=px, input_ids=ids, attention_mask=mask.long(), input_boxes=boxes,
                 input_boxes_labels=labels)
        det = m.detect(m.encode_images(px), torch.tensor([0]), m.encode_text(ids, mask), mask,
                       boxes, labels, torch.ones(1, 2, dtype=torch.bool))
    torch.testing.assert_close(det.logits, ref.pred_logits, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(det.boxes, ref.pred_boxes, atol=2e-5, rtol=1e-4)


def test_roi_align_averages_bilinear_samples():
    f = torch.arange(12.0)[None, None].expand(2, 8, 12).clone()  # value = x
    f[1] = 5.0
    out = roi_align(f, torch.tensor([[2.0, 1.0, 9.0, 8.0], [0.0, 0.0, 0.5, 0.5]]), 7)
    # x samples of bin j: 2 + j + 0.5 (one sample a bin: the box is 7 wide)
    assert torch.allclose(out[0, 0, 3], torch.arange(7.0) + 2.5)
    assert torch.allclose(out[:, 1], torch.full((2, 7, 7), 5.0))


def test_tokenizer_matches_transformers_clip_tokenizer(ckpt):
    transformers = pytest.importorskip("transformers")
    ours = PromptTokenizer(ckpt)
    ids, mask = ours.encode(PROMPTS)
    ref = transformers.AutoTokenizer.from_pretrained(str(ckpt))(
        PROMPTS, padding="max_length", max_length=32, return_tensors="pt")
    assert torch.equal(ids, ref["input_ids"]) and torch.equal(mask, ref["attention_mask"].bool())
    assert ids[0, 0] == 49406 and (ids[0, mask[0].sum() - 1]) == 49407
    with pytest.raises(ValueError, match="at most 32"):
        ours.encode(["word " * 40])


def test_rle_is_pycocotools_format_and_round_trips():
    assert rle.encode(np.array([[0, 1], [0, 1]], bool)) == {"size": [2, 2], "counts": "22"}
    assert rle.encode(np.array([[1]], bool))["counts"] == "01"
    rng = np.random.default_rng(0)
    for shape in ((1, 1), (7, 5), (64, 48), (300, 200)):
        m = rng.random(shape) > rng.random()
        enc = rle.encode(m)
        assert np.array_equal(rle.decode(enc), m)
        assert np.array_equal(rle.decode({"size": list(shape), "counts": rle.runs(m)}), m)
    try:
        from pycocotools import mask as cocomask
    except ImportError:
        return
    m = rng.random((97, 61)) > 0.6
    ref = cocomask.encode(np.asfortranarray(m.astype(np.uint8)))
    assert rle.encode(m)["counts"] == ref["counts"].decode()


def test_gate_cases_are_the_drawn_images():
    from PIL import Image

    cases = json.loads((CASES_DIR / "cases.json").read_text())["cases"]
    assert [c["id"] for c in cases] == [s[0] for s in SPECS]
    for (cid, w, h, seed, n), c in zip(SPECS, cases):
        png = (CASES_DIR / c["file"]).read_bytes()
        assert hashlib.sha256(png).hexdigest() == c["sha256"]
        drawn, _ = draw(w, h, seed, n)
        a = np.asarray(Image.open(io.BytesIO(png)))
        b = np.asarray(Image.open(io.BytesIO(drawn)))
        assert a.shape == (h, w, 3) and np.array_equal(a, b), cid
