"""The accuracy gate (issue 4): the engine against transformers' Qwen3_5MoeForCausalLM.

    tailored gate --preset tiny                      # CPU, fp32, tiny synthetic model (CI)
    tailored gate /path/to/ckpt --device cuda        # H200, bf16

Modules:
  prompts.py      the frozen prompt set (eval/prompts/gate.jsonl) and how it was built
  reference.py    transformers' model with the engine's weights (shared storage or a fresh load),
                  teacher-forced hidden states and greedy continuations
  engine_side.py  the engine's greedy continuations (real Engine) and teacher-forced hidden states
                  (model forward over the runner's HybridCache, chunked prefill)
  metrics.py      top-1 agreement, KL(reference ‖ engine), max |logit error|, greedy match + ties
  golden.py       committed reference outputs (eval/golden/) and the check against them
  manifest.py     commit, versions, device, checkpoint and prompt-set hashes
  run.py          the `tailored gate` command: add_parser(subparsers), run(args) -> exit code
"""
