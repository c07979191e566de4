"""`sammie serve` on the tiny synthetic model: the API (JSON, multipart, masks), its refusals,
keys / hosts / cross-site guard, batching across requests, the text cache; the CLI's start."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import subprocess
import sys

import numpy as np
import pytest
from fastapi.testclient import TestClient

from tailored.server.guard import AccessPolicy

from sammie.cli import build_server
from sammie.engine import rle
from sammie.gate.cases import CASES_DIR
from sammie.server.app import ServeSettings

PNG = (CASES_DIR / "shapes-square.png").read_bytes()
B64 = base64.b64encode(PNG).decode()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from sammie.synth import write_synthetic_checkpoint

    return write_synthetic_checkpoint(tmp_path_factory.mktemp("srv") / "tiny", "tiny")


def make(ckpt, access=None, **kw):
    return TestClient(build_server(ckpt, "cpu", "float32", ServeSettings(**kw),
                                   access or AccessPolicy()))


@pytest.fixture(scope="module")
def client(ckpt):
    with make(ckpt, max_body_bytes=2 * 2**20, max_image_pixels=300 * 300) as c:
        yield c


def test_json_request_gives_instances_per_prompt(client):
    r = client.post("/v1/segment", json={"image": B64, "threshold": 0.0, "max_instances": 3,
                                         "prompts": ["red circle", {"text": "square", "boxes":
                                                     [[160, 100, 220, 160]], "labels": [1]}]})
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["image"] == {"width": 256, "height": 256, "format": "PNG"}
    assert [x["prompt"]["text"] for x in d["results"]] == ["red circle", "square"]
    for res in d["results"]:
        assert len(res["instances"]) == 3  # threshold 0: every query, best 3
        scores = [i["score"] for i in res["instances"]]
        assert scores == sorted(scores, reverse=True)
        for inst in res["instances"]:
            m = rle.decode(inst["mask"])
            assert m.shape == (256, 256) and m.sum() == inst["area"]
            assert len(inst["box"]) == 4
    assert d["timing_ms"]["total_ms"] > 0


def test_multipart_with_png_masks_and_box_only_prompt(client):
    from PIL import Image

    r = client.post("/v1/segment", files={"image": ("a.png", PNG, "image/png")},
                    data={"prompt": ["every shape"], "boxes": "[[10, 10, 60, 90]]",
                          "mask_format": "png", "threshold": "0"})
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    assert [x["prompt"]["text"] for x in res] == ["every shape", "visual"]
    inst = res[0]["instances"][0]
    m = np.asarray(Image.open(io.BytesIO(base64.b64decode(inst["mask_png"]))))
    assert m.shape == (256, 256) and m.astype(bool).sum() == inst["area"]
    r = client.post("/v1/segment", json={"image": B64, "prompts": ["dog"], "mask_format": "none",
                                         "threshold": 0})
    assert "mask" not in r.json()["results"][0]["instances"][0]


@pytest.mark.parametrize("body,status,needle", [
    ({"image": "https://example.com/cat.jpg", "prompts": ["cat"]}, 400, "never fetches URLs"),
    ({"image": base64.b64encode(b"GIF89a......").decode(), "prompts": ["a"]}, 415, "JPEG, PNG"),
    ({"image": base64.b64encode(PNG[:300]).decode(), "prompts": ["a"]}, 400, "truncated"),
    ({"image": "not base64!", "prompts": ["a"]}, 400, "base64"),
    ({"image": B64, "prompts": ["  "]}, 400, "empty text prompt"),
    ({"image": B64, "prompts": []}, 400, "no prompt"),
    ({"image": B64}, 400, "no prompt"),
    ({"prompts": ["a"]}, 400, "missing 'image'"),
    ({"image": B64, "prompts": ["word " * 40]}, 400, "at most 32"),
    ({"image": B64, "prompts": [{"boxes": [[5, 5, 2, 9]]}]}, 400, "x1 > x0"),
    ({"image": B64, "prompts": ["a"], "threshold": 2}, 400, "threshold"),
    ({"image": B64, "prompts": ["a"], "mask_format": "bmp"}, 400, "mask_format"),
    ({"image": B64, "prompts": ["a"], "colour": 1}, 400, "unknown fields"),
])
def test_bad_requests_are_clear_4xx(client, body, status, needle):
    r = client.post("/v1/segment", json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_oversized_image_body_and_content_type(client):
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (400, 400)).save(buf, format="JPEG")
    r = client.post("/v1/segment", json={"image": base64.b64encode(buf.getvalue()).decode(),
                                         "prompts": ["a"]})
    assert r.status_code == 413 and r.json()["error"]["code"] == "image_too_large"
    r = client.post("/v1/segment", content=b"{" + b" " * (3 * 2**20) + b"}",
                    headers={"content-type": "application/json"})
    assert r.status_code == 413
    r = client.post("/v1/segment", content=b"x", headers={"content-type": "text/plain"})
    assert r.status_code == 415
    r = client.post("/v1/segment", content=b"--x\r\n", headers={
        "content-type": "multipart/form-data; boundary=x"})
    assert r.status_code == 400
    assert client.get("/v1/nothing").status_code == 404


def test_cross_site_posts_are_refused(client):
    r = client.post("/v1/segment", json={"image": B64, "prompts": ["a"]},
                    headers={"origin": "https://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site_request"
    r = client.post("/v1/segment", json={"image": B64, "prompts": ["a"]},
                    headers={"origin": "http://testserver"})
    assert r.status_code == 200


def test_api_keys_and_host_allow_list(ckpt):
    policy = AccessPolicy(api_keys=("k1",), allowed_hosts=frozenset({"localhost", "testserver"}))
    with make(ckpt, access=policy) as c:
        assert c.get("/health").status_code == 200  # exempt
        r = c.post("/v1/segment", json={"image": B64, "prompts": ["a"]})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = c.post("/v1/segment", json={"image": B64, "prompts": ["a"]},
                   headers={"Authorization": "Bearer k1"})
        assert r.status_code == 200
        r = c.get("/health", headers={"host": "evil.example"})
        assert r.status_code == 400


def test_requests_batch_together_and_text_features_are_cached(ckpt):
    import httpx

    app = build_server(ckpt, "cpu", "float32", ServeSettings(max_batch=4, max_wait_ms=200),
                       AccessPolicy())

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                rs = await asyncio.gather(*(c.post("/v1/segment", json={
                    "image": B64, "prompts": ["red circle", "dog"]}) for _ in range(4)))
                again = await c.post("/v1/segment", json={"image": B64, "prompts": ["dog"]})
                assert again.status_code == 200
                return [r.json() for r in rs], (await c.get("/metrics")).text

    out, metrics = asyncio.run(main())
    assert {o["timing_ms"]["batch_images"] for o in out} == {4}
    assert out[0]["results"] == out[3]["results"]
    seg = app.state.segmenter
    # one batch of 4, each string encoded once; the next request finds "dog" cached
    assert seg.batches == 2 and seg.cache.misses == 2 and seg.cache.hits == 1
    assert "sammie_batches_total 2" in metrics


def test_cli_refuses_a_bad_switch_before_loading(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAMMIE_")}
    env["SAMMIE_API_KY"] = "x"
    r = subprocess.run([sys.executable, "-m", "sammie", "serve", str(tmp_path / "none")],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "did you mean SAMMIE_API_KEY" in r.stderr, r.stderr[-400:]
