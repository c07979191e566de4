#!/usr/bin/env python3
"""Which third-party modules does SGLang's serving path import at module level?

Reads an unpacked sglang wheel (no import, no GPU): starting from the modules SGLang loads to
serve one text model (ROOTS), follows every `import` at module level of sglang's own files,
the ones inside `if`/`try` blocks too (a `try` whose handler catches the ImportError marks the
import optional), and prints the top-level names of the other packages it reaches. Imports
inside functions are lazy: they matter only if that function runs, so they are left out (the
GPU run shows any that do; `remote.sh install` probes the list below).

    python3 import_closure.py UNPACKED_SGLANG_DIR [--json]

The kit's lock (wheels.lock) was built from this list: each required name is either on the GPU
machine already (torch, numpy, ...) or has a wheel there.
"""
from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

ROOTS = (
    "sglang.launch_server",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.entrypoints.openai.serving_completions",
    "sglang.srt.entrypoints.openai.serving_chat",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.model_loader.loader",
    "sglang.srt.models.qwen3_5",
    "sglang.srt.models.qwen3_5_mtp",
    "sglang.srt.layers.attention.flashattention_backend",
    "sglang.srt.layers.attention.hybrid_linear_attn_backend",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.layers.moe.fused_moe_triton.layer",
    "sglang.srt.layers.quantization.fp8",
    "sglang.srt.constrained.xgrammar_backend",
    "sglang.srt.speculative.eagle_worker_v2",
)


def module_file(root: Path, mod: str) -> Path | None:
    p = root / Path(*mod.split("."))
    for cand in (p.with_suffix(".py"), p / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def catches_import_error(t: ast.Try) -> bool:
    for h in t.handlers:
        names = [] if h.type is None else (
            [ast.unparse(e) for e in h.type.elts] if isinstance(h.type, ast.Tuple)
            else [ast.unparse(h.type)])
        if h.type is None or any(n.split(".")[-1] in ("ImportError", "ModuleNotFoundError",
                                                       "Exception", "BaseException")
                                 for n in names):
            return True
    return False


def top_imports(tree: ast.Module, mod: str, is_pkg: bool):
    """(module name, optional, line, under an `if`) of each import outside function and class
    bodies."""
    out = []
    cond = [False]

    def walk(nodes, optional):
        for n in nodes:
            if isinstance(n, ast.Import):
                out.extend((a.name, optional, n.lineno, cond[0]) for a in n.names)
            elif isinstance(n, ast.ImportFrom):
                if n.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - (n.level - 1)]
                    name = ".".join(base + ([n.module] if n.module else []))
                else:
                    name = n.module or ""
                out.append((name, optional, n.lineno, cond[0]))
                out.extend((f"{name}.{a.name}", optional, n.lineno, cond[0])
                           for a in n.names)  # submodules
            elif isinstance(n, ast.Try):
                opt = optional or catches_import_error(n)
                walk(n.body, opt)
                for h in n.handlers:
                    walk(h.body, optional)
                walk(n.orelse, optional)
                walk(n.finalbody, optional)
            elif isinstance(n, ast.If):
                was, cond[0] = cond[0], True
                walk(n.body, optional)
                walk(n.orelse, optional)
                cond[0] = was
            elif isinstance(n, (ast.With,)):
                walk(n.body, optional)

    walk(tree.body, False)
    return out


def closure(root: Path) -> dict[str, dict]:
    """{third-party top-level name: {required: not only in try/except ImportError, where: the
    first import found (module:line), conditional: every import of it is under an `if`}}."""
    seen: dict[str, bool] = {}
    third: dict[str, dict] = {}
    todo = [(m, False) for m in ROOTS]
    while todo:
        mod, optional = todo.pop()
        if mod in seen and (seen[mod] is False or optional):
            continue
        seen[mod] = optional
        f = module_file(root, mod)
        if f is None:
            continue
        parents = mod.split(".")
        for i in range(1, len(parents)):  # importing a.b.c runs a/__init__ and a/b/__init__
            todo.append((".".join(parents[:i]), optional))
        tree = ast.parse(f.read_text(errors="replace"))
        for name, opt, line, under_if in top_imports(tree, mod, f.name == "__init__.py"):
            top = name.split(".")[0]
            if not top:
                continue
            if top == "sglang":
                if module_file(root, name):
                    todo.append((name, optional or opt))
            elif top not in sys.stdlib_module_names:
                t = third.setdefault(top, {"required": False, "where": f"{mod}:{line}",
                                           "conditional": True})
                t["required"] = t["required"] or not (optional or opt)
                if not under_if and t["conditional"]:
                    t["conditional"], t["where"] = False, f"{mod}:{line}"
    return third


def main() -> int:
    root = Path(sys.argv[1])
    got = closure(root)
    if "--json" in sys.argv:
        print(json.dumps(dict(sorted(got.items())), indent=1))
    else:
        for name, t in sorted(got.items(), key=lambda kv: (not kv[1]["required"],
                                                          kv[1]["conditional"], kv[0])):
            kind = "required" if t["required"] else "optional"
            print(f"{kind:<9} {'if-only' if t['conditional'] else '':<8} {name:<22} {t['where']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
