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
xyxy; labels 1 (positive, the default) or 0 (negative); once the image is decoded they are
clipped to it (`fit_boxes`). The server never fetches a URL: an `image` that is one is refused,
naming why.

Hostile input is refused before any costly work, each with a 400 naming the field: counts over
the limits before their items are read (a million prompts once took 5 s of the event loop); a
prompt over MAX_PROMPT_CHARS characters before it is tokenized (10 MB took 29 s); lone
surrogates, control characters and prompts with nothing visible in them; numbers too large for
a float (a 400-digit integer box was a 500).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import unicodedata
from dataclasses import dataclass, replace

from tailored.server.errors import OpenAIError, shown

from sammie.engine.postprocess import Options
from sammie.engine.segmenter import Prompt

MASK_FORMATS = ("rle", "png", "none")
URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]{1,15}://")
DATA_URL = re.compile(r"^data:([^,]{0,200}),", re.IGNORECASE)
NOT_BASE64 = re.compile(r"[^A-Za-z0-9+/=]")
MAX_PROMPT_CHARS = 1000  # 32 tokens are far fewer; checked before the tokenizer runs
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
    """base64 (whitespace and missing padding forgiven: `base64` wraps lines at 76 columns; the
    URL-safe alphabet too), or a `data:...;base64,` URL of any media type; the format is sniffed
    from the bytes anyway."""
    if not isinstance(value, str):
        raise bad("'image' must be a base64 string (or a data: URL)", "image")
    value = value.strip()
    if URL.match(value):
        raise bad("'image' is a URL: this server never fetches URLs; send the image's bytes "
                  "(multipart -F image=@file.jpg) or base64 in JSON", "image",
                  code="url_not_fetched")
    if value[:5].lower() == "data:":
        m = DATA_URL.match(value)
        if m is None or not m.group(1).lower().endswith(";base64"):
            raise bad("'image' is a data: URL that is not base64: send data:image/png;base64,... "
                      "or the base64 text alone", "image")
        value = value[m.end():]
    value = "".join(value.split()).translate(_URLSAFE)
    if (m := NOT_BASE64.search(value)) is not None:
        raise bad(f"'image' is not valid base64: {shown(m.group())} at character {m.start()} "
                  "(in multipart, send the image as a file part: -F image=@photo.jpg)", "image")
    value = value.rstrip("=")
    try:
        data = base64.b64decode(value + "=" * (-len(value) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise bad("'image' is not valid base64 (its length or padding is wrong)", "image") from None
    if not data:
        raise bad("'image' is empty", "image")
    return data


_URLSAFE = str.maketrans("-_", "+/")


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


def _integer(d: dict, key: str, default: int, lo: int, hi: int) -> int:
    v = _number(d, key, default, lo, hi)
    if v != int(v):
        raise bad(f"'{key}' must be a whole number in [{lo}, {hi}], got {shown(d[key])}", key)
    return int(v)


def _finite(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)  # an integer of 400 digits overflows here
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _boxes(value, labels, where: str, max_boxes: int) -> tuple[list[list[float]], list[int]]:
    if not isinstance(value, list) or not value:
        raise bad(f"'{where}' must be a non-empty list of [x0, y0, x1, y1] boxes", where)
    if len(value) > max_boxes:
        raise bad(f"{len(value)} boxes in '{where}'; at most {max_boxes} in one prompt", where)
    out = []
    for i, b in enumerate(value):
        box = [_finite(v) for v in b] if isinstance(b, list) and len(b) == 4 else [None]
        if None in box:
            raise bad(f"'{where}[{i}]' must be 4 finite numbers [x0, y0, x1, y1], got "
                      f"{shown(b)}", where)
        if not (box[2] > box[0] and box[3] > box[1]):
            raise bad(f"'{where}[{i}]' must have x1 > x0 and y1 > y0 (pixels, xyxy), got "
                      f"{shown(b)}", where)
        out.append(box)
    if labels is None:
        labels = [1] * len(out)
    if (not isinstance(labels, list) or len(labels) != len(out)
            or any(lab not in (0, 1) or isinstance(lab, bool) for lab in labels)):
        raise bad(f"the labels of '{where}' must be a list of 0 / 1, one per box", where)
    return out, [int(lab) for lab in labels]


def _text(text, where: str) -> str:
    if not isinstance(text, str):
        raise bad(f"'{where}' text must be a string, got {shown(text)}", "prompts")
    text = text.strip()
    if len(text) > MAX_PROMPT_CHARS:
        raise bad(f"'{where}' is {len(text)} characters; a prompt is a short phrase (at most "
                  f"{MAX_PROMPT_CHARS} characters, 32 tokens)", "prompts")
    visible = False
    for k, ch in enumerate(text):
        cat = unicodedata.category(ch)
        if cat == "Cs":
            raise bad(f"'{where}' holds a lone surrogate (U+{ord(ch):04X} at character {k}); "
                      "text must be valid Unicode", "prompts")
        if cat == "Cc" and ch not in "\t\n\r":
            raise bad(f"'{where}' holds a control character (U+{ord(ch):04X} at character {k})",
                      "prompts")
        visible = visible or cat[0] in "LNPSM"
    if not visible:
        raise bad(f"'{where}' has an empty text prompt: give a phrase such as \"red mug\", or "
                  "boxes", "prompts", code="empty_prompt")
    return text


def _prompt(item, i: int, max_boxes: int) -> Prompt:
    where = f"prompts[{i}]"
    if isinstance(item, str):
        item = {"text": item}
    if not isinstance(item, dict):
        raise bad(f"'{where}' must be a text or an object with 'text' and/or 'boxes'", "prompts")
    unknown = set(item) - {"text", "boxes", "labels"}
    if unknown:
        raise bad(f"'{where}' has unknown fields {shown(sorted(unknown))}", "prompts")
    text = _text(item["text"], where) if item.get("text") is not None else None
    if "labels" in item and "boxes" not in item:
        raise bad(f"'{where}' has labels but no boxes", "prompts")
    boxes, labels = [], []
    if "boxes" in item:
        boxes, labels = _boxes(item["boxes"], item.get("labels"), f"{where}.boxes", max_boxes)
    if text is None and not boxes:
        raise bad(f"'{where}' has neither a text nor boxes", "prompts", code="empty_prompt")
    return Prompt(text=text, boxes=boxes, labels=labels)


def parse(fields: dict, image: bytes | None, *, max_prompts: int, max_boxes: int,
          count_tokens) -> SegmentRequest:
    """fields: the JSON body, or the multipart fields (JSON text decoded); image: the
    multipart file's bytes (None for JSON)."""
    unknown = set(fields) - FIELDS
    if unknown:
        names = sorted(unknown)
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        raise bad(f"unknown fields {shown(names[:5], 200)}{more}; known: "
                  f"{', '.join(sorted(FIELDS))}")
    if image is None:
        if "image" not in fields:
            raise bad("missing 'image': a base64 string in JSON, or a file part in multipart",
                      "image")
        image = image_from_text(fields["image"])
    items = fields.get("prompts", [])
    if not isinstance(items, list):
        raise bad("'prompts' must be a list of texts or {text, boxes, labels} objects",
                  "prompts")
    texts = fields.get("prompt", [])
    texts = [texts] if isinstance(texts, str) else texts
    if not isinstance(texts, list):
        raise bad("'prompt' must be a text (or a list of texts)", "prompt")
    n = len(items) + len(texts) + ("boxes" in fields)
    if n > max_prompts:
        raise bad(f"{n} prompts; at most {max_prompts} per image (--max-prompts)", "prompts")
    prompts = [_prompt(p, i, max_boxes) for i, p in enumerate(items + texts)]
    if "boxes" in fields:
        boxes, labels = _boxes(fields["boxes"], fields.get("labels"), "boxes", max_boxes)
        prompts.append(Prompt(boxes=boxes, labels=labels))
    elif "labels" in fields:
        raise bad("'labels' given without 'boxes'", "labels")
    if not prompts:
        raise bad("no prompt: give 'prompts' (texts such as \"car\") and/or 'boxes'", "prompts",
                  code="empty_prompt")
    for p in prompts:
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
                  max_instances=_integer(fields, "max_instances", 100, 1, 1000))
    return SegmentRequest(image=image, prompts=prompts, options=opt)


def fit_boxes(prompts: list[Prompt], width: int, height: int) -> list[Prompt]:
    """The prompts with their boxes clipped to the decoded image (the reference does not clip;
    a box reaching far outside made the ROI align sample all of it: 1e5 px asked for 6 TB); a
    box with no area inside the image is a 400 naming it."""
    out = []
    for i, p in enumerate(prompts):
        boxes = []
        for k, (x0, y0, x1, y1) in enumerate(p.boxes):
            w, h = float(width), float(height)
            c = [min(max(x0, 0.0), w), min(max(y0, 0.0), h), min(max(x1, 0.0), w),
                 min(max(y1, 0.0), h)]
            if not (c[2] > c[0] and c[3] > c[1]):
                raise bad(f"box {k} of prompt {i}, {shown(p.boxes[k])}, lies outside the "
                          f"{width} x {height} image (boxes are image pixels, xyxy)", "boxes")
            boxes.append(c)
        out.append(replace(p, boxes=boxes) if boxes else p)
    return out


def multipart_fields(form, charset: str = "utf-8") -> tuple[dict, object | None]:
    """A multipart form parsed as Latin-1 text (intake.read_fields parses it so) -> (fields,
    the image's file part or None).

    The form's text arrives decoded as Latin-1 (intake.py asks the parser for that: on bytes
    that are not its charset it would fall back to Latin-1 silently, and a prompt "caf\\xe9"
    became "café"); here it is decoded as `charset`, and bytes that are not are a 400 naming
    the field. Each field but `prompt` may come once."""
    fields: dict = {}
    upload = None
    for raw_key, value in form.multi_items():
        key = _decoded(raw_key, charset, "a form field name", None)
        if key not in FIELDS:
            raise bad(f"unknown form field {shown(key)}; known: {', '.join(sorted(FIELDS))}")
        if hasattr(value, "read"):  # an UploadFile
            if key != "image":
                raise bad(f"form field {shown(key)} must be text, not a file", key)
            upload = value
            continue
        value = _decoded(value, charset, f"form field '{key}'", key)
        if key == "prompt":
            fields.setdefault("prompt", []).append(value)
            continue
        if key in fields:
            raise bad(f"form field '{key}' is given twice", key)
        if key in ("prompts", "boxes", "labels"):
            try:
                fields[key] = json.loads(value)
            except (ValueError, RecursionError):
                example = EXAMPLES[key]
                raise bad(f"form field '{key}' must be JSON text, e.g. {example}", key) from None
        else:
            fields[key] = value
    if upload is not None and "image" in fields:
        raise bad("two images: a file part and a text field both named 'image'", "image")
    return fields, upload


def _decoded(text: str, charset: str, what: str, param: str | None) -> str:
    raw = text.encode("latin-1")  # the bytes as sent
    try:
        return raw.decode(charset)
    except UnicodeDecodeError as e:
        hint = ("; an image goes in a file part (curl -F image=@photo.jpg), base64 in a text one"
                if param == "image" else "; send UTF-8")
        raise bad(f"{what} is not {charset} text (byte {raw[e.start]:#04x} at {e.start}){hint}",
                  param) from None
