#!/usr/bin/env python3
"""Import SGLang's serving path on the GPU machine and list every module it lacks, in one go.

A plain `import sglang.launch_server` stops at the first missing package. Here a last-resort
import hook records each top-level package that SGLang's own code imports and nothing on
sys.path provides, and hands back an empty stand-in, so the imports go on and every missing
name is reported; imports by other packages fail as usual (their `try: import x` fallbacks stay
as they are); errors other than a missing module are reported per root. The stand-ins exist
only in this process: it proves nothing about running, only what the kit must add (issue 57's
kit, remote.sh probe).

    python3 probe_imports.py [--roots a.b,c.d]      # exit 1 when something is missing
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from import_closure import ROOTS  # noqa: E402  (this folder's list of serving modules)

# optional by design, or not for CUDA: their absence is expected and not reported
EXPECTED_ABSENT = {"torch_npu", "sgl_kernel_npu", "mlx", "mlx_lm", "aiter", "mori", "vllm",
                   "deep_ep", "mate", "zbal", "kt_kernel", "nixl_ep", "petit_kernel",
                   "pplx_kernels", "setuptools_scm", "habana_frameworks",
                   "intel_extension_for_pytorch"}


class _StandInBase:
    """What a class deriving from a stand-in gets as its base: takes any arguments."""

    def __init_subclass__(cls, **kw):
        pass

    def __init__(self, *a, **k):
        pass


class _Anything(types.ModuleType):
    """A module whose every attribute is another stand-in (classes can derive from it)."""

    __path__: list = []

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        sub = _Anything(f"{self.__name__}.{name}")
        setattr(self, name, sub)
        return sub

    def __call__(self, *a, **k):
        return _Anything(f"{self.__name__}()")

    def __mro_entries__(self, bases):
        base = self.__dict__.get("_as_base")
        if base is None:  # one class per stand-in: two stand-in bases are two classes
            base = type(self.__name__.rsplit(".", 1)[-1], (_StandInBase,), {})
            self.__dict__["_as_base"] = base
        return (base,)

    def __or__(self, other):  # `Stub | None` in annotations
        return self

    __ror__ = __or__

    def __getitem__(self, key):  # `Stub[int]`
        return self

    def __iter__(self):
        return iter(())


def _asked_by_sglang() -> bool:
    """Whether the import being resolved comes from SGLang's own code (the first frame outside
    the import machinery and this file belongs to a module named sglang...)."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_globals.get("__name__", "")
        if not name.startswith(("importlib", "_frozen_importlib")) and name != __name__:
            return name.split(".")[0] in ("sglang", "sgl_kernel")
        f = f.f_back
    return False


class Recorder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self):
        self.missing: dict[str, str] = {}  # top-level name -> first full name asked for

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.split(".")[0]
        if top in ("sglang", "sgl_kernel"):
            return None  # the kit's own packages must import for real
        if top not in self.missing:  # a new name: only a whole package that is absent
            if "." in fullname or not _asked_by_sglang():
                return None  # a real package's missing submodule, or not SGLang asking
            self.missing[top] = fullname
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        return _Anything(spec.name)

    def exec_module(self, module):
        return None


def main(argv: list[str]) -> int:
    roots = list(ROOTS)
    if "--roots" in argv:
        roots = argv[argv.index("--roots") + 1].split(",")
    rec = Recorder()
    sys.meta_path.append(rec)  # last: only what no real finder provides
    errors = {}
    for r in roots:
        try:
            importlib.import_module(r)
        except Exception as e:  # noqa: BLE001 - reported, the probe goes on
            errors[r] = f"{type(e).__name__}: {e}"[:300]
    missing = {k: v for k, v in sorted(rec.missing.items()) if k not in EXPECTED_ABSENT}
    print(f"probe: {len(roots)} modules of SGLang's serving path imported; "
          f"{len(missing)} missing packages, {len(errors)} modules failed otherwise")
    for top, full in missing.items():
        print(f"  missing: {top} (first asked as {full})")
    for r, e in errors.items():
        print(f"  failed: {r}: {e}")
    return 1 if missing or errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
