"""`POST /v1/segment` bodies -> a validated request, or an error naming the field.

JSON (`Content-Type: application/json`):
    {"image": "<base64, or a data: URL>", "prompts": ["car", {"text": "mug", "boxes":
     [[x0, y0, x1, y1]], "labels": [1]}], "boxes": [[...]], "labels": [...],
     "threshold": 0.3, "mask_threshold": 0.5, "mask_format": "rle" | "png" | "none",
     "max_instances": 100}
Multipart (`multipart/form-data`, curl -F): an `image` file part; `prompt` fields (one text
prompt each, repeatable); the other fields as above, `prompts` / `boxes` / `labels` as JSON text.

A prompt is a text, a text with boxes, or boxes alone (then the model's text is "visual"); the
top-level `boxes` make one more prompt of boxes alone. Boxes are exemplars in image pixels,
xyxy; labels 1 (positive, the default) or 0 (negative). The server never fetches a URL: an
`image` that is one is refused, naming why.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from dataclasses import dataclass

from tailored.server.errors import OpenAIError, shown

from sammie.engine.postprocess import Options
from sammie.engine.segmenter import Prompt

MASK_FORMATS = ("rle", "png", "none")
URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]{1,15}://")
DATA_URL = re.compile(r"^data:image/[a-zA-Z0-9.+-]+;base64,", re.IGNORECASE)
EXAMPLES = {"prompts": '["car", "red mug"]', "boxes": "[[10, 20, 200, 240]]", "labels": "[1, 0]"}
FIELDS = {"image", "prompt", "prompts", "boxes", "labels", "threshold", "mask_threshold",
          "mask_format", "max_instances"}


@dataclass
class SegmentRequest:
    image: bytes
    prompts: list[Prompt]
    options: Options


def bad(msg: str, param: str | None = None, status: int = 400, code: str | None = None):
    return OpenAIError(msg, param=param, status=status, code=code)


def image_from_text(value) -> bytes:
    if not isinstance(value, str):
        raise bad("'image' must be a base64 string (or a data: URL)", "image")
    value = value.strip()
    if URL.match(value):
        raise bad("'image' is a URL: this server never fetches URLs; send the image's bytes "
                  "(multipart -F image=@file.jpg) or base64 in JSON", "image",
                  code="url_not_fetched")
    value = DATA_URL.sub("", value, count=1)
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise bad("'image' is not valid base64", "image") from None
    if not data:
        raise bad("'image' is empty", "image")
    return data


def _number(d: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = d.get(key, default)
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            raise bad(f"'{key}' must be a number in [{lo}, {hi}], got {shown(v)}", key) from None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise bad(f"'{key}' must be a number in [{lo}, {hi}], got {shown(v)}", key)
    return float(v)


def _boxes(value, labels, where: str) -> tuple[list[list[float]], list[int]]:
    if not isinstance(value, list) or not value:
        raise bad(f"'{where}' must be a non-empty list of [x0, y0, x1, y1] boxes", where)
    out = []
    for i, b in enumerate(value):
        if (not isinstance(b, list) or len(b) != 4
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                           and math.isfinite(v) for v in b)):
            raise bad(f"'{where}[{i}]' must be 4 finite numbers [x0, y0, x1, y1], got "
                      f"{shown(b)}", where)
        if not (b[2] > b[0] and b[3] > b[1]):
            raise bad(f"'{where}[{i}]' must have x1 > x0 and y1 > y0 (pixels, xyxy), got "
                      f"{shown(b)}", where)
        out.append([float(v) for v in b])
    if labels is None:
        labels = [1] * len(out)
    if (not isinstance(labels, list) or len(labels) != len(out)
            or any(lab not in (0, 1) or isinstance(lab, bool) for lab in labels)):
        raise bad(f"the labels of '{where}' must be a list of 0 / 1, one per box", where)
    return out, [int(lab) for lab in labels]


def _prompt(item, i: int) -> Prompt:
    where = f"prompts[{i}]"
    if isinstance(item, str):
        item = {"text": item}
    if not isinstance(item, dict):
        raise bad(f"'{where}' must be a text or an object with 'text' and/or 'boxes'", "prompts")
    unknown = set(item) - {"text", "boxes", "labels"}
    if unknown:
        raise bad(f"'{where}' has unknown fields {sorted(unknown)}", "prompts")
    text = item.get("text")
    if text is not None and (not isinstance(text, str) or not text.strip()):
        raise bad(f"'{where}' has an empty text prompt: give a phrase such as \"red mug\", or "
                  "boxes", "prompts", code="empty_prompt")
    boxes, labels = [], []
    if "boxes" in item:
        boxes, labels = _boxes(item["boxes"], item.get("labels"), f"{where}.boxes")
    if text is None and not boxes:
        raise bad(f"'{where}' has neither a text nor boxes", "prompts", code="empty_prompt")
    return Prompt(text=text.strip() if text is not None else None, boxes=boxes, labels=labels)


def parse(fields: dict, image: bytes | None, *, max_prompts: int, max_boxes: int,
          count_tokens) -> SegmentRequest:
    """fields: the JSON body, or the multipart fields (JSON text decoded); image: the
    multipart file's bytes (None for JSON)."""
    unknown = set(fields) - FIELDS
    if unknown:
        raise bad(f"unknown fields {sorted(unknown)}; known: {', '.join(sorted(FIELDS))}")
    if image is None:
        if "image" not in fields:
            raise bad("missing 'image': a base64 string in JSON, or a file part in multipart",
                      "image")
        image = image_from_text(fields["image"])
    items = fields.get("prompts", [])
    if not isinstance(items, list):
        raise bad("'prompts' must be a list of texts or {text, boxes, labels} objects",
                  "prompts")
    prompts = [_prompt(p, i) for i, p in enumerate(items)]
    for i, text in enumerate(fields.get("prompt", [])):
        prompts.append(_prompt(text, len(items) + i))
    if "boxes" in fields:
        boxes, labels = _boxes(fields["boxes"], fields.get("labels"), "boxes")
        prompts.append(Prompt(boxes=boxes, labels=labels))
    if not prompts:
        raise bad("no prompt: give 'prompts' (texts such as \"car\") and/or 'boxes'", "prompts",
                  code="empty_prompt")
    if len(prompts) > max_prompts:
        raise bad(f"{len(prompts)} prompts; at most {max_prompts} per image (--max-prompts)",
                  "prompts")
    for p in prompts:
        if len(p.boxes) > max_boxes:
            raise bad(f"{len(p.boxes)} boxes in one prompt; at most {max_boxes}", "boxes")
        n = count_tokens(p.query)
        if n > 32:
            raise bad(f"prompt {shown(p.query)} is {n} tokens with BOS and EOS; the model reads "
                      "at most 32", "prompts")
    fmt = fields.get("mask_format", "rle")
    if fmt not in MASK_FORMATS:
        raise bad(f"'mask_format' must be one of {', '.join(MASK_FORMATS)}, got {shown(fmt)}",
                  "mask_format")
    opt = Options(threshold=_number(fields, "threshold", 0.3, 0.0, 1.0),
                  mask_threshold=_number(fields, "mask_threshold", 0.5, 0.0, 1.0),
                  mask_format=fmt,
                  max_instances=int(_number(fields, "max_instances", 100, 1, 1000)))
    return SegmentRequest(image=image, prompts=prompts, options=opt)


def multipart_fields(form) -> tuple[dict, bytes | None, str | None]:
    """A parsed multipart form -> (fields, image bytes or None, its declared content type)."""
    fields: dict = {}
    image = ctype = None
    for key, value in form.multi_items():
        if key not in FIELDS:
            raise bad(f"unknown form field {shown(key)}; known: {', '.join(sorted(FIELDS))}")
        if hasattr(value, "read"):  # an UploadFile
            if key != "image":
                raise bad(f"form field {shown(key)} must be text, not a file", key)
            image, ctype = value, value.content_type
            continue
        if key == "image":
            fields["image"] = value
        elif key == "prompt":
            fields.setdefault("prompt", []).append(value)
        elif key in ("prompts", "boxes", "labels"):
            try:
                fields[key] = json.loads(value)
            except ValueError:
                example = EXAMPLES[key]
                raise bad(f"form field '{key}' must be JSON text, e.g. {example}", key) from None
        else:
            fields[key] = value
    return fields, image, ctype
