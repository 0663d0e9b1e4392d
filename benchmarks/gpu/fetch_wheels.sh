#!/usr/bin/env bash
# Downloads, here, the wheels the GPU check needs that the device image lacks
# (gymnax for the examples and the PPO rows, and what gymnax imports that
# the image does not hold) into .whl/, which git ignores. The device run then
# names it in `carry` (see benchmarks/gpu/README.md); check.sh installs them.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl gymnax==1.0.1 gymnasium==1.3.0 farama-notifications==0.0.6
ls -la .whl
