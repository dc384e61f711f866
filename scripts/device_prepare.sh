#!/usr/bin/env bash
# Prepares, on a machine with PyPI, what scripts/device_check.sh needs on a GPU machine without it:
#   .whl/           wheels of erpo-jax's dependencies that the GPU machine's Python lacks (default: those the
#                   lent H200 image lacked: grain, tensorboardX, gguf, math-verify and their own needs, and
#                   TRL with datasets for the peer_trl phase)
#   .gpu/tokenizer  the builtin SmolLM2's tokenizer (tokenizer.json), in place of its 98 MB GGUF
# Both folders go into .git/info/exclude. Then, on the GPU machine (the folders carried along):
#   DEVICE_CHECK_TOKENIZER=.gpu/tokenizer bash scripts/device_check.sh
set -euo pipefail

prog=$(basename "$0")
python_version=${DEVICE_PYTHON_VERSION:-3.12}
packages=${DEVICE_WHEELS:-"grain==0.2.18 array-record portpicker tensorboardX==2.6.5 gguf==0.19.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19"}
py=${PYTHON:-python3}

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
  sed -n '2,8p' "$0" | cut -c3-
  echo "Environment: DEVICE_PYTHON_VERSION (default 3.12), DEVICE_WHEELS (the requirements), PYTHON."
  exit 0
fi
[[ $# -eq 0 ]] || { echo "$prog: error: unknown argument '$1' (see $prog --help)" >&2; exit 2; }
[[ -f pyproject.toml && -d erpo_jax ]] || { echo "$prog: error: run it from the repository root" >&2; exit 2; }

mkdir -p .git/info .whl .gpu
for path in /.whl/ /.gpu/; do
  grep -qxF "$path" .git/info/exclude 2>/dev/null || echo "$path" >>.git/info/exclude
done

platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
  manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
read -r -a reqs <<<"$packages"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
  "${platforms[@]}" -d .whl "${reqs[@]}"

"$py" - <<'PY'
from erpo_jax import config as config_lib
from erpo_jax.model.io.loading import load_tokenizer

load_tokenizer(config_lib.ModelSection()).save(".gpu/tokenizer")
PY
echo "$prog: $(find .whl -type f -name '*.whl' | wc -l) wheels in .whl ($(du -sh .whl | cut -f1)), tokenizer in .gpu/tokenizer"
