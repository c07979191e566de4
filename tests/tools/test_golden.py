"""The engine reproduces the committed goldens (eval/golden/tiny; policy kb/0002).

No transformers needed: the goldens are the reference's outputs (greedy ids, top-5 logprobs at
teacher-forced positions) stored once by lab/make_golden.py. Tolerances and why:
tailored/gate/golden.py (1e-3 nats per logprob; a divergence only where the golden top-2 gap is
≤ 2e-3).
"""

from __future__ import annotations

import pytest
import torch

from tailored.gate.engine_side import gate_engine_kwargs
from tailored.gate.golden import check_engine, read_golden
from tailored.gate.manifest import checkpoint_hashes
from tailored.gate.prompts import DEFAULT_PROMPTS, REPO, load_prompts, sha256_file
from tailored.gate.run import preset_checkpoint
from tailored.stack import build_stack

GOLDEN = REPO / "eval" / "golden" / "tiny"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()  # tiny model: 1 thread is far faster on a busy machine
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.usefixtures("gate_presets")  # written once under a lock (xdist workers)
def test_engine_reproduces_tiny_goldens():
    man, entries = read_golden(GOLDEN)
    ckpt = preset_checkpoint("tiny")
    ck = checkpoint_hashes(ckpt)
    assert (ck["sha256"], ck["data_sample_sha256"]) == (
        man["checkpoint"]["sha256"], man["checkpoint"]["data_sample_sha256"]), \
        "the tiny synthetic checkpoint changed: regenerate goldens with a kb/ reason"
    assert sha256_file(DEFAULT_PROMPTS) == man["prompt_set"]["sha256"]
    prompts = load_prompts()
    n = man["max_new_tokens"]
    lens = [e["prompt_tokens"] for e in entries]
    # a smaller step budget than the gate's 2048: the long prompt is prefilled in other chunks
    stack = build_stack(ckpt, device="cpu", dtype="float32", progress=False,
                        **gate_engine_kwargs(lens, n, max_num_batched_tokens=1024))
    fails = check_engine(stack.engine, stack.tokenizer, prompts, entries, n)
    assert not fails, "\n".join(fails)
