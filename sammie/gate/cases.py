"""The gate's frozen cases: procedurally drawn images (coloured shapes on gradients, noise) with
text and box prompts, committed under eval/sammie/ (cases.json + PNGs, 8 images, ~150 KB).

`draw(spec)` makes an image from its spec (size, seed); `write_cases(dir)` writes the set and
`load_cases(dir)` reads it, checking each image's sha256 against cases.json. The images are
committed rather than drawn at gate time so the set stays the same if a library's drawing
changes; tests check that `draw` still reproduces them pixel for pixel.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CASES_DIR = REPO / "eval" / "sammie"

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220),
           "yellow": (235, 210, 40), "purple": (140, 60, 170), "orange": (245, 140, 30),
           "white": (245, 245, 245), "black": (20, 20, 20)}
SHAPES = ("circle", "square", "triangle", "ring")
SPECS = [  # (id, width, height, seed, shapes)
    ("shapes-small", 160, 120, 1, 3), ("shapes-square", 256, 256, 2, 5),
    ("shapes-wide", 320, 180, 3, 6), ("shapes-tall", 150, 300, 4, 4),
    ("shapes-many", 288, 288, 5, 12), ("shapes-one", 200, 200, 6, 1),
    ("noise", 224, 168, 7, 0), ("shapes-large", 480, 360, 8, 8),
]


@dataclass
class Case:
    id: str
    image: bytes  # PNG
    width: int
    height: int
    prompts: list  # texts, or {"text": ..., "boxes": [[x0, y0, x1, y1]], "labels": [1]}


def draw(width: int, height: int, seed: int, n_shapes: int) -> tuple[bytes, list]:
    """(PNG bytes, the drawn shapes [(colour, shape, xyxy)])."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 255 // max(width - 1, 1)), (y * 255 // max(height - 1, 1)),
                     np.full_like(x, rng.randrange(256))], axis=-1)
    noise = nrng.integers(-24, 25, size=(height // 8 + 1, width // 8 + 1, 3))
    noise = noise.repeat(8, axis=0).repeat(8, axis=1)[:height, :width]  # 8 px blocks
    img = Image.fromarray(np.clip(base // 2 + 64 + noise, 0, 255).astype("uint8"), "RGB")
    d = ImageDraw.Draw(img)
    shapes = []
    for _ in range(n_shapes):
        colour = rng.choice(sorted(COLOURS))
        shape = rng.choice(SHAPES)
        s = rng.randint(min(width, height) // 8, min(width, height) // 3)
        x0, y0 = rng.randint(0, width - s), rng.randint(0, height - s)
        box = [x0, y0, x0 + s, y0 + s]
        fill = COLOURS[colour]
        if shape == "circle":
            d.ellipse(box, fill=fill)
        elif shape == "square":
            d.rectangle(box, fill=fill)
        elif shape == "triangle":
            d.polygon([(x0 + s // 2, y0), (x0, y0 + s), (x0 + s, y0 + s)], fill=fill)
        else:
            d.ellipse(box, outline=fill, width=max(2, s // 6))
        shapes.append((colour, shape, box))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue(), shapes


def _prompts(shapes: list, seed: int) -> list:
    rng = random.Random(seed + 1000)
    out = ["every shape", "the red circle"]
    for colour, shape, box in shapes[:2]:
        out.append(f"{colour} {shape}")
    if shapes:
        colour, shape, box = shapes[0]
        out.append({"text": shape, "boxes": [box], "labels": [1]})
        out.append({"boxes": [box] + ([shapes[-1][2]] if len(shapes) > 1 else []),
                    "labels": [1] + ([rng.choice([0, 1])] if len(shapes) > 1 else [])})
    return out


def write_cases(out: Path = CASES_DIR) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    index = []
    for cid, w, h, seed, n in SPECS:
        png, shapes = draw(w, h, seed, n)
        (out / f"{cid}.png").write_bytes(png)
        index.append({"id": cid, "file": f"{cid}.png", "width": w, "height": h, "seed": seed,
                      "shapes": n, "sha256": hashlib.sha256(png).hexdigest(),
                      "prompts": _prompts(shapes, seed)})
    (out / "cases.json").write_text(json.dumps({"cases": index}, indent=1) + "\n")
    return index


def load_cases(path: Path = CASES_DIR) -> tuple[list[Case], str]:
    """(cases, sha256 of cases.json)."""
    raw = (path / "cases.json").read_bytes()
    cases = []
    for c in json.loads(raw)["cases"]:
        png = (path / c["file"]).read_bytes()
        if hashlib.sha256(png).hexdigest() != c["sha256"]:
            raise ValueError(f"{path / c['file']}: sha256 differs from cases.json")
        cases.append(Case(c["id"], png, c["width"], c["height"], c["prompts"]))
    return cases, hashlib.sha256(raw).hexdigest()
