"""Sammie: a specialised server for SAM 3.1 image segmentation by text prompt (issue 52).

One model (SAM 3's image detector: ViT-L/14 at 1008 px, CLIP text encoder, DETR detector with a
presence head, mask decoder), one traffic shape (an image and a few concept prompts in,
instances with masks out), behind a small JSON HTTP API. docs/sammie.md is the manual.

Packages: model/ (the network in plain PyTorch, the checkpoint's tensor names), engine/
(decode, batching, text-embedding cache, post-processing, RLE), server/ (the FastAPI app),
gate/ (numerics against transformers' Sam3Model), bench/ (the load client and the reference
server). Modules: config.py (config.json in transformers' Sam3Config layout, tiny and full
presets), checkpoint.py (loading safetensors), synth.py (synthetic checkpoints),
tokenizer.py (the CLIP BPE tokenizer files), flags.py (the SAMMIE_* switch table), cli.py.
"""
