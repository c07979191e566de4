"""Image bytes in, the model's input out: format sniffing, limits, decode, resize, normalise.

Accepted: JPEG, PNG, WebP (by their magic bytes; anything else is `UnsupportedImage`, 415).
Checked before decoding: at most `max_pixels` pixels (the header's size; `ImageTooLarge`,
413), so a small file that declares a huge image (a decompression bomb) costs nothing. A file
that fails to decode or is truncated is `CorruptImage` (400). EXIF orientation is applied (a
phone photo comes out upright), then RGB.

Resize and normalise as transformers' Sam3ImageProcessor: bilinear with antialiasing to S x S
(aspect not kept), rounded back to 8 bits, x / 255, (x - mean) / std. On the CPU with PIL's
decoder; the GPU path (nvjpeg via torchvision.io.decode_jpeg on the device, resize there) is a
seam: `decode` takes the target device, and only the CPU branch exists yet (docs/sammie.md).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FORMATS = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp"}
DEFAULT_MAX_PIXELS = 40_000_000  # a 48 MP phone photo is 8000 x 6000 = 48e6: refused


class ImageError(ValueError):
    status = 400
    code = "invalid_image"


class UnsupportedImage(ImageError):
    status = 415
    code = "unsupported_image_format"


class ImageTooLarge(ImageError):
    status = 413
    code = "image_too_large"


class CorruptImage(ImageError):
    pass


def sniff(data: bytes) -> str:
    """The format of an image by its magic bytes; UnsupportedImage otherwise."""
    if data[:3] == b"\xff\xd8\xff":
        return "JPEG"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "PNG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if not data:
        raise CorruptImage("the image is empty (0 bytes)")
    raise UnsupportedImage("unsupported image format: send JPEG, PNG or WebP "
                           f"(the first bytes are {data[:8]!r})")


@dataclass
class Decoded:
    pixels: torch.Tensor  # [3, S, S] float32, normalised
    width: int
    height: int
    format: str


def decode(data: bytes, size: int, mean, std, *, max_pixels: int = DEFAULT_MAX_PIXELS,
           rescale: float = 1 / 255) -> Decoded:
    from PIL import Image, ImageOps

    fmt = sniff(data)
    try:
        img = Image.open(io.BytesIO(data), formats=[fmt])
        w, h = img.size
    except Exception as e:  # noqa: BLE001 - PIL raises many kinds for bad headers
        raise CorruptImage(f"cannot read the {fmt} image: {e}") from None
    if w * h > max_pixels:
        raise ImageTooLarge(f"the image is {w} x {h} = {w * h} pixels; the limit is "
                            f"{max_pixels} (--max-image-pixels)")
    try:
        img.load()
        img = ImageOps.exif_transpose(img).convert("RGB")
    except Exception as e:  # noqa: BLE001 - truncated data, bad chunks, ...
        raise CorruptImage(f"cannot decode the {fmt} image: {e}") from None
    w, h = img.size
    raw = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(h, w, 3)
    return Decoded(resize_normalise(raw.permute(2, 0, 1), size, mean, std, rescale), w, h, fmt)


def resize_normalise(chw_uint8: torch.Tensor, size: int, mean, std,
                     rescale: float = 1 / 255) -> torch.Tensor:
    """uint8 [3, H, W] (any device) -> float32 [3, size, size] as the reference prepares it."""
    x = chw_uint8[None].float()
    if x.shape[-2:] != (size, size):
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False,
                          antialias=True).round_().clamp_(0, 255)
    m = torch.tensor(mean, dtype=torch.float32, device=x.device).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device=x.device).view(1, 3, 1, 1)
    return ((x * rescale - m) / s)[0]
