"""The offline training corpus: files every one of our machines has, read in a fixed order.

Sources (`--corpus`, comma separated):
  stdlib     every ``*.py`` file of the running interpreter's standard library
             (``sysconfig.get_paths()["stdlib"]``), tests included when installed; excluded:
             site-/dist-packages, ``_sysconfigdata*`` (build paths of this machine), generated
             charmap codecs (files defining ``decoding_table``/``decoding_map``), files that are
             not valid UTF-8.
  copyright  the Debian package licence texts ``/usr/share/doc/*/copyright`` (English prose),
             de-duplicated by content (first path in sorted order kept).
  transformers  ``*.py`` files of the installed ``transformers`` package (same files on every
             machine with the same version), de-duplicated by content, at most
             TRANSFORMERS_CAP_BYTES taken in sha256(relative path) order.
  auto       stdlib + copyright, plus transformers when the stdlib has no test suite (Debian's
             python3 ships it separately), so that the corpus stays ≳ 30 MB.

Each document is one file. The held-out split is by file and independent of the seed:
a file is held out iff the first byte of sha256(source + ":" + relative path) is < 13
(≈ 5 %). The corpus hash is sha256 over (source, relative path, sha256(content)) of every
document in order, so two machines with the same files get the same hash.
"""

from __future__ import annotations

import glob
import hashlib
import platform
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HELDOUT_THRESHOLD = 13  # of 256 → 5.1 % of files
TRANSFORMERS_CAP_BYTES = 16_000_000


@dataclass
class Doc:
    source: str
    rel: str
    text: str

    @property
    def heldout(self) -> bool:
        h = hashlib.sha256(f"{self.source}:{self.rel}".encode()).digest()
        return h[0] < HELDOUT_THRESHOLD


def _read_utf8(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def stdlib_docs() -> tuple[list[Doc], dict]:
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    docs, skipped = [], {"not_utf8": 0, "charmap_codec": 0, "sysconfigdata": 0}
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        parts = rel.split("/")
        if parts[0] in ("site-packages", "dist-packages") or "__pycache__" in parts:
            continue
        if parts[-1].startswith("_sysconfigdata") or parts[0].startswith("config-"):
            skipped["sysconfigdata"] += 1
            continue
        text = _read_utf8(p)
        if text is None:
            skipped["not_utf8"] += 1
            continue
        if "decoding_table = " in text or "decoding_map = " in text:
            skipped["charmap_codec"] += 1
            continue
        docs.append(Doc("stdlib", rel, text))
    info = {"root": str(root), "python": platform.python_version(),
            "implementation": sys.implementation.name, "skipped": skipped,
            "has_test_suite": any(d.rel.startswith("test/") for d in docs)}
    return docs, info


def copyright_docs() -> tuple[list[Doc], dict]:
    docs, seen, dup = [], set(), 0
    for f in sorted(glob.glob("/usr/share/doc/*/copyright")):
        text = _read_utf8(Path(f))
        if text is None:
            continue
        h = hashlib.sha256(text.encode()).hexdigest()
        if h in seen:
            dup += 1
            continue
        seen.add(h)
        docs.append(Doc("copyright", Path(f).parent.name + "/copyright", text))
    return docs, {"root": "/usr/share/doc/*/copyright", "duplicates_dropped": dup}


def transformers_docs() -> tuple[list[Doc], dict]:
    import transformers

    root = Path(transformers.__file__).resolve().parent
    files = sorted(root.rglob("*.py"),
                   key=lambda p: hashlib.sha256(p.relative_to(root).as_posix().encode()).digest())
    docs, seen, n = [], set(), 0
    for p in files:
        if n >= TRANSFORMERS_CAP_BYTES:
            break
        text = _read_utf8(p)
        if text is None or "__pycache__" in p.parts:
            continue
        h = hashlib.sha256(text.encode()).hexdigest()
        if h in seen:
            continue
        seen.add(h)
        docs.append(Doc("transformers", p.relative_to(root).as_posix(), text))
        n += len(text.encode())
    docs.sort(key=lambda d: d.rel)
    return docs, {"root": str(root), "version": transformers.__version__,
                  "cap_bytes": TRANSFORMERS_CAP_BYTES}


SOURCES = {"stdlib": stdlib_docs, "copyright": copyright_docs, "transformers": transformers_docs}


def resolve_sources(spec: str) -> list[str]:
    """`auto` → stdlib, copyright (+ transformers when the stdlib lacks its test suite)."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if names != ["auto"]:
        return names
    root = Path(sysconfig.get_paths()["stdlib"])
    return ["stdlib", "copyright"] + ([] if (root / "test").is_dir() else ["transformers"])


def build_corpus(sources: list[str]) -> tuple[list[Doc], dict]:
    """All documents of the named sources, in order, and a description for the manifest."""
    docs, desc = [], {"sources": {}}
    for s in sources:
        if s not in SOURCES:
            raise SystemExit(f"unknown corpus source {s!r}; choose from {sorted(SOURCES)}")
        d, info = SOURCES[s]()
        nb = sum(len(x.text.encode()) for x in d)
        held = [x for x in d if x.heldout]
        info.update(files=len(d), bytes=nb, heldout_files=len(held),
                    heldout_bytes=sum(len(x.text.encode()) for x in held))
        desc["sources"][s] = info
        docs += d
    h = hashlib.sha256()
    for x in docs:
        h.update(f"{x.source}\0{x.rel}\0{hashlib.sha256(x.text.encode()).hexdigest()}\n".encode())
    desc["sha256"] = h.hexdigest()
    desc["files"] = len(docs)
    desc["bytes"] = sum(v["bytes"] for v in desc["sources"].values())
    desc["heldout_rule"] = ("file held out iff sha256(source:relpath)[0] < "
                            f"{HELDOUT_THRESHOLD} (of 256)")
    desc["heldout_files_list"] = [f"{x.source}:{x.rel}" for x in docs if x.heldout]
    return docs, desc
