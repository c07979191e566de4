"""Image bytes in, the model's input out: format sniffing, limits, decode, resize, normalise.

Accepted: JPEG, PNG, WebP (by their magic bytes; anything else is `UnsupportedImage`, 415).
Checked before decoding: at most `max_pixels` pixels (the header's size; `ImageTooLarge`,
413, also when PIL's own bomb check refuses the header first), so a small file that declares a
huge image (a decompression bomb) costs nothing. A file that fails to decode or is truncated is
`CorruptImage` (400). EXIF orientation is applied (a phone photo comes out upright), then RGB.

CPU: a progressive JPEG's every scan passes over the whole image, and nothing bounds how many
it has: 260 KB repeating one tiny scan 2000 times over 6000 x 6000 took 42 s to decode (a
helper's attack, sammie-hard). A JPEG with more than MAX_JPEG_SCANS SOS markers (encoders
write about 10; an EXIF thumbnail's count too) is `TooManyScans` (400), before decoding.

Memory: a 35 KB PNG may hold 36 MP of zeros, so what one decode holds is kept small: PIL's
image is dropped once its bytes are out, and the resize runs one channel at a time in float32
(the same numbers: each channel is resized on its own anyway). Peak for 40 MP: ~0.3 GB, not the
1.2 GB it was (the server also bounds how many decodes run at once: --decode-workers).

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
MAX_JPEG_SCANS = 100


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


class TooManyScans(ImageError):
    code = "too_many_jpeg_scans"


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
    from PIL import Image, ImageOps, UnidentifiedImageError

    fmt = sniff(data)
    scans = data.count(b"\xff\xda") if fmt == "JPEG" else 0  # 0xFF in scan data is 0xFF00
    if scans > MAX_JPEG_SCANS:
        raise TooManyScans(f"the JPEG has {scans} scans; at most {MAX_JPEG_SCANS} are decoded "
                           "(encoders write about 10): re-encode it")
    try:
        img = Image.open(io.BytesIO(data), formats=[fmt])
        w, h = img.size
    except Image.DecompressionBombError:
        raise ImageTooLarge(f"the image's header declares over {2 * Image.MAX_IMAGE_PIXELS} "
                            f"pixels; the limit is {max_pixels} (--max-image-pixels)") from None
    except UnidentifiedImageError:
        raise CorruptImage(f"cannot read the {fmt} image: its header is not valid") from None
    except Exception as e:  # noqa: BLE001 - PIL raises many kinds for bad headers
        raise CorruptImage(f"cannot read the {fmt} image: {e}") from None
    if w * h > max_pixels:
        raise ImageTooLarge(f"the image is {w} x {h} = {w * h} pixels; the limit is "
                            f"{max_pixels} (--max-image-pixels)")
    try:
        img.load()
        img = ImageOps.exif_transpose(img)
        if img.mode != "RGB":
            img = img.convert("RGB")
        w, h = img.size
        rgb = img.tobytes()
    except Exception as e:  # noqa: BLE001 - truncated data, bad chunks, ...
        raise CorruptImage(f"cannot decode the {fmt} image: {e}") from None
    del img
    raw = bytearray(rgb)  # writable, as torch.frombuffer wants
    del rgb
    raw = torch.frombuffer(raw, dtype=torch.uint8).view(h, w, 3)
    return Decoded(resize_normalise(raw.permute(2, 0, 1), size, mean, std, rescale), w, h, fmt)


def resize_normalise(chw_uint8: torch.Tensor, size: int, mean, std,
                     rescale: float = 1 / 255) -> torch.Tensor:
    """uint8 [3, H, W] (any device) -> float32 [3, size, size] as the reference prepares it
    (one channel at a time: the same numbers, a third of the float memory)."""
    planes = []
    for c in range(chw_uint8.shape[0]):
        x = chw_uint8[c][None, None].float()
        if x.shape[-2:] != (size, size):
            x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False,
                              antialias=True).round_().clamp_(0, 255)
        planes.append(x[0, 0])
    x = torch.stack(planes)
    m = torch.tensor(mean, dtype=torch.float32, device=x.device).view(3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device=x.device).view(3, 1, 1)
    return (x * rescale - m) / s
