"""Loading a SAM 3 checkpoint: config.json, safetensors (one file or shards with an index), the
tokenizer, the image processor's settings; or, with none given, the tiny synthetic one.

Names: transformers' Sam3Model state dict (what its conversion script writes). A `sam3_video`
checkpoint (`detector_model.*` beside `tracker_model.*`, `tracker_neck.*`) loads too: the
detector's tensors with the prefix dropped, the tracker's ignored. Any other missing or
unexpected name is an error that names it (a wrong file fails loudly, never half-loaded).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from sammie import flags
from sammie.config import SamConfig
from sammie.model.sam3 import Sam3

IGNORED_PREFIXES = ("tracker_model.", "tracker_neck.")
DETECTOR_PREFIX = "detector_model."


@dataclass(frozen=True)
class ImageSettings:
    size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale: float = 1 / 255

    @classmethod
    def from_dir(cls, ckpt: Path, cfg: SamConfig) -> "ImageSettings":
        p = Path(ckpt) / "preprocessor_config.json"
        d = json.loads(p.read_text()) if p.is_file() else {}
        size = d.get("size", {}).get("height", cfg.image_size)
        if size != cfg.image_size:
            raise ValueError(f"{p}: size {size} differs from the model's image_size "
                             f"{cfg.image_size}")
        return cls(size=size, mean=tuple(d.get("image_mean", [0.5] * 3)),
                   std=tuple(d.get("image_std", [0.5] * 3)),
                   rescale=d.get("rescale_factor", 1 / 255))


def _files(ckpt: Path) -> list[Path]:
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [ckpt / s for s in shards]
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{ckpt}: no *.safetensors files")
    return files


def read_state_dict(ckpt: str | Path) -> dict[str, torch.Tensor]:
    """The detector's tensors under Sam3Model's names (see the module docstring)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in _files(Path(ckpt)):
        for name, t in load_file(str(f)).items():
            if name.startswith(IGNORED_PREFIXES):
                continue
            out[name.removeprefix(DETECTOR_PREFIX)] = t
    return out


def load_model(ckpt: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> Sam3:
    cfg = SamConfig.from_dir(ckpt)
    model = Sam3(cfg)
    state = read_state_dict(ckpt)
    expected = set(model.state_dict())
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"{ckpt}: tensor names do not match SAM 3's: missing {missing[:5]}"
                         f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                         f"{'...' if len(unexpected) > 5 else ''}")
    model.load_state_dict(state)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def cache_dir() -> Path:
    return Path(flags.current().cache or Path.home() / ".cache" / "sammie")


def embedded_checkpoint() -> Path:
    """The tiny synthetic checkpoint (seed 0), written once into the cache directory."""
    from sammie.synth import write_synthetic_checkpoint

    path = cache_dir() / "tiny-synthetic-seed0"
    if not (path / "sammie_synthetic.json").is_file():
        tmp = path.with_name(f"{path.name}.partial-{os.getpid()}")
        write_synthetic_checkpoint(tmp, "tiny", seed=0)
        try:
            tmp.rename(path)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def synthetic_info(ckpt: str | Path) -> dict | None:
    """What `sammie synth` recorded about a synthetic checkpoint, else None (a real one)."""
    p = Path(ckpt) / "sammie_synthetic.json"
    return json.loads(p.read_text()) if p.is_file() else None
