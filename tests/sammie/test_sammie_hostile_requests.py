"""`POST /v1/segment` against hostile bodies (a helper's attack, sammie-hard): each is a clear
4xx naming the fault, or the right answer; none is a 500, a hang or an unbounded cost."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import pytest
from fastapi.testclient import TestClient

from tailored.server.guard import AccessPolicy

from sammie.cli import build_server
from sammie.gate.cases import CASES_DIR
from sammie.server.app import ServeSettings
from sammie.server.intake import MAX_JSON_VALUES

PNG = (CASES_DIR / "shapes-square.png").read_bytes()  # 256 x 256
B64 = base64.b64encode(PNG).decode()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from sammie.synth import write_synthetic_checkpoint

    return write_synthetic_checkpoint(tmp_path_factory.mktemp("hostile") / "tiny", "tiny")


def make(ckpt, **kw):
    return TestClient(build_server(ckpt, "cpu", "float32", ServeSettings(**kw), AccessPolicy()))


@pytest.fixture(scope="module")
def client(ckpt):
    with make(ckpt, max_mask_pixels=256 * 256 * 3) as c:
        yield c


def post_raw(client, body: bytes):
    return client.post("/v1/segment", content=body, headers={"content-type": "application/json"})


@pytest.mark.parametrize("tail,needle", [
    (b'"prompts": ["\\ud800"]}', "lone surrogate"),  # was a 500 (the tokenizer's TypeError)
    (b'"prompt": 5}', "'prompt' must be a text"),  # was a 500
    (b'"boxes": [[0, 0, ' + b"9" * 400 + b', 5]]}', "finite numbers"),  # was a 500
    (b'"prompts": ["' + b"x" * 5000 + b'"]}', "5000 characters"),  # tokenized on the loop
    (b'"prompts": ["a\\u0000b"]}', "control character"),
    (b'"prompts": ["\\u200b\\u200b"]}', "empty text prompt"),
    (b'"prompts": ["a"], "labels": [1]}', "without 'boxes'"),  # was ignored
    (b'"prompts": [{"text": "a", "labels": [1]}]}', "labels but no boxes"),
    (b'"prompts": ["a"], "max_instances": 1.5}', "whole number"),  # was read as 1
    (b'"prompts": [' + b'"a",' * 100 + b'"a"]}', "101 prompts"),
    (b'"prompts": ["a"], "x": ' + b"[" * 100 + b"]" * 100 + b"}", "nested too deeply"),
    (b'"prompts": [' + b"0," * MAX_JSON_VALUES + b"0]}", "JSON body holds over"),
    (b'"boxes": [[1000, 1000, 2000, 2000]]}', "lies outside the 256 x 256 image"),
])
def test_hostile_json_fields_are_400s_naming_the_fault(client, tail, needle):
    t0 = time.perf_counter()
    r = post_raw(client, b'{"image": "' + B64.encode() + b'", ' + tail)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert time.perf_counter() - t0 < 2


def test_lenient_image_text_and_prompt_forms_are_answered(client):
    wrapped = "\n".join(B64[i:i + 76] for i in range(0, len(B64), 76)).rstrip("=")
    for image in (wrapped, "data:application/octet-stream;base64," + B64):
        r = client.post("/v1/segment", json={"image": image, "prompt": "car"})
        assert r.status_code == 200, r.text
        assert [x["prompt"]["text"] for x in r.json()["results"]] == ["car"]  # not c, a, r


def test_boxes_are_clipped_to_the_image(client):
    # 1e6 px boxes once made the ROI align ask for terabytes (a 500 for the whole batch)
    r = client.post("/v1/segment", json={"image": B64, "boxes": [[-50, -50, 1e6, 1e6]]})
    assert r.status_code == 200, r.text
    assert r.json()["results"][0]["prompt"]["boxes"] == [[0.0, 0.0, 256.0, 256.0]]


def test_an_answer_over_the_mask_budget_is_refused_and_names_the_way_out(client):
    body = {"image": B64, "prompts": ["a", "b"], "threshold": 0, "max_instances": 2}
    r = client.post("/v1/segment", json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_mask_pixels"
    assert "4 masks of 256 x 256" in r.json()["error"]["message"]
    r = client.post("/v1/segment", json={**body, "mask_format": "none"})
    assert r.status_code == 200 and len(r.json()["results"][1]["instances"]) == 2


def multipart(parts: list[bytes], charset: str = "") -> tuple[bytes, dict]:
    body = b"".join(b"--XyZ\r\n" + p for p in parts) + b"--XyZ--\r\n"
    return body, {"content-type": f"multipart/form-data; boundary=XyZ{charset}"}


def field(name: bytes, value: bytes) -> bytes:
    return b'Content-Disposition: form-data; name="' + name + b'"\r\n\r\n' + value + b"\r\n"


IMAGE = (b'Content-Disposition: form-data; name="image"; filename="a.png"\r\n'
         b"Content-Type: image/png\r\n\r\n" + PNG + b"\r\n")


@pytest.mark.parametrize("parts,needle", [
    ([IMAGE, field(b"prompt", b"caf\xe9")], "'prompt' is not utf-8 text"),  # was read as café
    ([IMAGE, field(b"prompt", b"a"), field(b"threshold", b"0.1"), field(b"threshold", b"0.9")],
     "'threshold' is given twice"),
    ([IMAGE, field(b"image", B64.encode()), field(b"prompt", b"a")], "two images"),
    ([IMAGE, field(b"prompts", b"[" * 5000 + b"]" * 5000)], "must be JSON text"),  # was a 500
    ([IMAGE, field(b"prompts", b'["\\ud800"]')], "lone surrogate"),  # was a 500
    ([field(b"image", PNG), field(b"prompt", b"a")], "file part (curl -F image=@photo.jpg)"),
])
def test_hostile_multipart_bodies_are_400s_naming_the_fault(client, parts, needle):
    body, headers = multipart(parts)
    r = client.post("/v1/segment", content=body, headers=headers)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_a_declared_charset_is_honoured_and_only_a_text_one(client):
    body, headers = multipart([IMAGE, field(b"prompt", b"caf\xe9")], "; charset=latin-1")
    r = client.post("/v1/segment", content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["results"][0]["prompt"]["text"] == "café"
    for charset in ("rot13", "zlib", "undefined", "unicode_escape", "x-nothing"):
        body, headers = multipart([IMAGE, field(b"prompt", b"car")], f"; charset={charset}")
        r = client.post("/v1/segment", content=body, headers=headers)
        assert r.status_code == 415, r.text  # "undefined" was a 500 in starlette's decode


def test_a_body_that_stops_arriving_gets_408(ckpt):
    import httpx

    app = build_server(ckpt, "cpu", "float32", ServeSettings(body_timeout_s=0.3), AccessPolicy())

    async def slow():
        yield b'{"image": "'
        await asyncio.sleep(5)
        yield b'"}'

    async def main():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://t") as c:
                t0 = time.perf_counter()
                r = await c.post("/v1/segment", content=slow(),
                                 headers={"content-type": "application/json"})
                return r, time.perf_counter() - t0

    r, took = asyncio.run(main())
    assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"
    assert took < 3


def test_a_json_body_with_a_bom_or_in_utf16_still_parses(client):
    body = json.dumps({"image": B64, "prompts": ["car"]})
    for raw in (b"\xef\xbb\xbf" + body.encode(), body.encode("utf-16")):
        assert post_raw(client, raw).status_code == 200
