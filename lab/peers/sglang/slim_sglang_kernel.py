#!/usr/bin/env python3
"""Repack the sglang-kernel 0.4.5 wheel (383 MB) for one Hopper GPU (sm_90).

What goes, and why it is safe on an H100/H200 serving Qwen3.6-35B-A3B:
  sgl_kernel/sm100/                     loaded only when the GPU is not sm_90 (load_utils.py)
  sgl_kernel/flashmla_ops.abi3.so       FlashMLA, MLA models only; its import is try/except
  sgl_kernel/infllm_ops*.so             InfLLM-V2 attention, loaded on first use (_loader.py)
  non-sm_90 cubins inside flash_ops.abi3.so (FA3: sm_80, sm_86 and sm_90 copies of 372
  kernels) and sm90/common_ops.abi3.so (sm_80/89/100/103/120 beside sm_90): an sm_90 GPU runs
  sm_90 SASS or JITs PTX, never another arch's SASS. Each fatbin of the .nv_fatbin section is
  rewritten in place with only its sm_90 ELF entries and every PTX entry, its size field
  shortened, the freed tail zeroed: file size and every offset stay, so nothing is relinked,
  and the zeros compress to nothing.
With --drop-fa3, flash_ops.abi3.so goes too (SGLang then needs --attention-backend
flashinfer or triton; sgl_kernel.flash_attn raises ImportError only when imported, which the
fa3 backend does lazily).

The result is a valid wheel (RECORD rewritten) for `pip install --no-deps`. --lzma stores its
members LZMA-compressed (zipfile and pip read them), smaller than deflate.

    python3 slim_sglang_kernel.py IN.whl OUTDIR [--lzma] [--drop-fa3]
"""
from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import struct
import sys
import zipfile
from pathlib import Path

DROP = ("sgl_kernel/sm100/", "sgl_kernel/flashmla_ops.abi3.so", "sgl_kernel/infllm_ops")
FA3 = "sgl_kernel/flash_ops.abi3.so"
PRUNE = (FA3, "sgl_kernel/sm90/common_ops.abi3.so")
FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2


def fatbin_section(elf: bytes) -> tuple[int, int] | None:
    """(offset, size) of the .nv_fatbin section of a little-endian ELF64 file."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)

    def header(i):
        return struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize)

    names_at = header(shstrndx)[4]
    for i in range(shnum):
        name, _, _, _, off, size, *_ = header(i)
        end = elf.index(b"\0", names_at + name)
        if elf[names_at + name:end] == b".nv_fatbin":
            return off, size
    return None


def keep_sm90(data: bytes, arch: int = 90) -> tuple[bytes, dict]:
    """The file with every fatbin holding only its `arch` cubins and its PTX; stats by arch."""
    sec = fatbin_section(data)
    if sec is None:
        return data, {}
    start, size = sec
    buf = bytearray(data)
    stats: dict[str, int] = {}
    p = start
    while p + 16 <= start + size:
        magic, _ver, hsize, fsize = struct.unpack_from("<IHHQ", buf, p)
        if magic != FATBIN_MAGIC:
            p += 8  # fatbins are 8-byte aligned; padding between them
            continue
        q, end = p + hsize, p + hsize + fsize
        kept = []
        while q < end:
            kind, _v, ehsize, psize = struct.unpack_from("<HHIQ", buf, q)
            sm, = struct.unpack_from("<I", buf, q + 28)
            n = ehsize + psize
            if n % 8:
                raise ValueError(f"fatbin entry of {n} bytes at {q}: not 8-byte aligned")
            keep = kind == KIND_PTX or kind not in (KIND_PTX, KIND_ELF) or sm == arch
            key = f"{'kept' if keep else 'dropped'}_{'ptx' if kind == KIND_PTX else 'sm'}{sm}"
            stats[key] = stats.get(key, 0) + n
            if keep:
                kept.append(bytes(buf[q:q + n]))
            q += n
        new = b"".join(kept)
        if not new:
            raise ValueError(f"fatbin at {p} has no sm_{arch} or PTX entry: nothing would run")
        buf[p + hsize:end] = new + bytes(fsize - len(new))
        struct.pack_into("<Q", buf, p + 8, len(new))
        p = end
    return bytes(buf), stats


def record_row(name: str, content: bytes) -> list[str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
    return [name, f"sha256={digest}", str(len(content))]


def slim(src: Path, outdir: Path, *, lzma: bool = False, drop_fa3: bool = False,
         log=print) -> Path:
    zin = zipfile.ZipFile(src)
    record = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
    outdir.mkdir(parents=True, exist_ok=True)
    out = outdir / src.name
    comp = zipfile.ZIP_LZMA if lzma else zipfile.ZIP_DEFLATED
    drop = DROP + ((FA3,) if drop_fa3 else ())
    rows, dropped = [], 0
    with zipfile.ZipFile(out, "w", compression=comp,
                         compresslevel=None if lzma else 9) as zout:
        for info in zin.infolist():
            name = info.filename
            if name == record:
                continue
            if name.startswith(drop):
                dropped += info.file_size
                continue
            data = zin.read(name)
            if name in PRUNE:
                data, stats = keep_sm90(data)
                log(f"{name}: " + ", ".join(f"{k} {v / 2**20:.1f} MiB"
                                             for k, v in sorted(stats.items())))
            zi = zipfile.ZipInfo(name, date_time=info.date_time)
            zi.external_attr = info.external_attr
            zi.compress_type = comp
            zout.writestr(zi, data)
            rows.append(record_row(name, data))
        rows.append([record, "", ""])
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(rows)
        zi = zipfile.ZipInfo(record, date_time=(2026, 1, 1, 0, 0, 0))
        zi.compress_type = comp
        zout.writestr(zi, text.getvalue())
    log(f"wrote {out}: {out.stat().st_size / 2**20:.1f} MiB (from {src.stat().st_size / 2**20:.1f}"
        f" MiB); files dropped whole: {dropped / 2**20:.1f} MiB unpacked")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("wheel", type=Path)
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--lzma", action="store_true", help="LZMA zip members (smaller)")
    ap.add_argument("--drop-fa3", action="store_true", help="leave flash_ops.abi3.so out")
    a = ap.parse_args()
    slim(a.wheel, a.outdir, lzma=a.lzma, drop_fa3=a.drop_fa3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
