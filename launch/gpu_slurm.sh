#!/usr/bin/env bash
# Runs `erpo-jax train` on a SLURM GPU cluster: one task per node, coordinator on the first node.
set -euo pipefail

prog=$(basename "$0")

usage() {
  cat <<EOF
Usage: $prog [options] [--] [key.sub=value ...]

Outside an allocation: writes an sbatch script (runs/logs/slurm/) and submits it.
Inside one (SLURM_JOB_ID set, e.g. under salloc): runs srun directly.
Each task runs
  erpo-jax train --coordinator <first node>:PORT --num-processes \$SLURM_NTASKS \\
                 --process-id \$SLURM_PROCID --config FILE overrides...
with \$SLURM_NTASKS and \$SLURM_PROCID read inside the task. The job inherits
this shell's environment (activate the Python environment first).

Options:
  --nodes N            nodes, one process each (default: the allocation's, else 1)
  --gpus-per-node G    GPUs per node, all visible to the node's process (default: 8)
  --partition NAME     SLURM partition
  --time T             time limit, e.g. 24:00:00
  --job-name NAME      job name (default: erpo-jax)
  --config FILE        YAML config or a name in configs/ (default: the CLI's default)
  --port PORT          coordinator port on the first node (default: 12355)
  --submit             write and submit an sbatch script even inside an allocation
  --dry-run            print the script and every command instead of running them
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

nodes=${SLURM_JOB_NUM_NODES:-1}
gpus_per_node=8
partition=""
time_limit=""
job_name="erpo-jax"
config=""
port=12355
submit=0
dry_run=0
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
    --submit) submit=1 ;;
    --nodes | --gpus-per-node | --partition | --time | --job-name | --config | --port)
      [[ $# -gt 0 && $1 != --* ]] || die "$arg needs a value"
      case $arg in
        --nodes) nodes=$1 ;;
        --gpus-per-node) gpus_per_node=$1 ;;
        --partition) partition=$1 ;;
        --time) time_limit=$1 ;;
        --job-name) job_name=$1 ;;
        --config) config=$1 ;;
        --port) port=$1 ;;
      esac
      shift
      ;;
    --) overrides+=("$@"); break ;;
    -*) die "unknown option '$arg' (see --help)" ;;
    *=*) overrides+=("$arg") ;;
    *) die "unexpected argument '$arg': overrides look like key.sub=value (see --help)" ;;
  esac
done

positive='^[1-9][0-9]*$'
[[ $nodes =~ $positive ]] || die "--nodes: expected a positive integer, got '$nodes'"
[[ $gpus_per_node =~ $positive ]] || die "--gpus-per-node: expected a positive integer, got '$gpus_per_node'"
if ! { [[ $port =~ $positive ]] && ((port < 65536)); }; then
  die "--port: expected 1..65535, got '$port'"
fi
[[ $job_name =~ ^[A-Za-z0-9_.-]+$ ]] || die "--job-name: expected letters, digits, '_', '.', '-', got '$job_name'"
if [[ -f $config ]]; then
  # Tasks may start in another directory on a compute node.
  config="$(cd "$(dirname "$config")" && pwd)/$(basename "$config")"
fi

# The job body: valid bash, run as is inside an allocation or as the sbatch script's body.
# The single-quoted task script is evaluated by each task, so $SLURM_NTASKS and
# $SLURM_PROCID are that task's; "$1" is the coordinator, the rest go to erpo-jax.
task_args=("\${hosts[0]}:$port")
[[ -z $config ]] || task_args+=(--config "$config")
task_args+=("${overrides[@]}")
body="mapfile -t hosts < <(scontrol show hostnames \"\$SLURM_JOB_NODELIST\")
task='exec erpo-jax train --coordinator \"\$1\" --num-processes \"\$SLURM_NTASKS\" --process-id \"\$SLURM_PROCID\" \"\${@:2}\"'
srun --nodes $nodes --ntasks-per-node 1 --gpus-per-node $gpus_per_node --kill-on-bad-exit=1 \\
  bash -c \"\$task\" erpo-jax-task \"${task_args[0]}\" $(quote "${task_args[@]:1}")"

if [[ -n ${SLURM_JOB_ID:-} ]] && ((!submit)); then
  if ((dry_run)); then
    while IFS= read -r line; do
      echo "+ $line"
    done <<<"$body"
    exit 0
  fi
  exec bash -c "set -euo pipefail
$body"
fi

header="#!/usr/bin/env bash
#SBATCH --job-name=$job_name
#SBATCH --nodes=$nodes
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=$gpus_per_node
#SBATCH --output=runs/logs/slurm/$job_name-%j.out"
[[ -z $partition ]] || header+=$'\n'"#SBATCH --partition=$partition"
[[ -z $time_limit ]] || header+=$'\n'"#SBATCH --time=$time_limit"
script="runs/logs/slurm/$job_name-$(date +%Y%m%d-%H%M%S).sbatch"
text="$header
set -euo pipefail
$body"

if ((dry_run)); then
  echo "# $script"
  echo "$text"
  echo "+ mkdir -p runs/logs/slurm"
  echo "+ sbatch $(quote "$script")"
  exit 0
fi
mkdir -p runs/logs/slurm
printf '%s\n' "$text" >"$script"
echo "$prog: wrote $script" >&2
sbatch "$script"
