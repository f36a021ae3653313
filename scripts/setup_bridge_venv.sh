#!/usr/bin/env bash
# Build the Python 3.12 environment in which Megatron-Bridge 0.6.2's own config code runs on a CPU, for the
# differential test against Megatron-Bridge (tests/unit_tests/training/test_bridge_differential.py), the
# bridge_fuzz benchmark, --check_with_bridge and scripts/extract_bridge_recipe_facts.py (the recipe-facts
# fixture). About 5 GB (the index has only the CUDA build of torch for
# 3.12; it imports and runs on a CPU). Usage: scripts/setup_bridge_venv.sh [VENV_DIR] (default .bridge-venv);
# then export MBRIDGE_EPOVERLAP_BRIDGE_PYTHON=VENV_DIR/bin/python.
set -euo pipefail
venv="${1:-.bridge-venv}"
python="${PYTHON312:-python3.12}"
"$python" -m venv "$venv"
"$venv/bin/pip" install --quiet torch==2.13.0 numpy packaging omegaconf 'hydra-core>=1.3.4,<1.4' einops rich \
    pyyaml tqdm regex six typing-extensions 'transformers>=5.8,<=5.12.1'
# Neither wheel's dependencies are wanted: Megatron-Core would pull Transformer Engine's CUDA build, and
# Megatron-Bridge pins packages the config code does not import. Transformer Engine itself is faked
# (mbridge_epoverlap/config/bridge_cpu.py).
"$venv/bin/pip" install --quiet --no-deps megatron-core==0.19.2
wheels="$(mktemp -d)"
"$venv/bin/pip" download --quiet --no-deps --python-version 3.12 --only-binary=:all: megatron-bridge==0.6.2 -d "$wheels"
"$venv/bin/pip" install --quiet --no-deps "$wheels"/megatron_bridge-0.6.2-*.whl
# Building recipes (--check_with_bridge, its tests) imports megatron.bridge.recipes, which needs these too;
# the differential test alone does not.
"$venv/bin/pip" install --quiet datasets pillow tensorboard megatron-energon diffusers nvidia-modelopt
echo "export MBRIDGE_EPOVERLAP_BRIDGE_PYTHON=$(cd "$venv" && pwd)/bin/python"
