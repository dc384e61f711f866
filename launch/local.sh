#!/usr/bin/env bash
# Runs `erpo-jax train` on this machine: one process (optionally on fake CPU devices) or P local processes.
set -euo pipefail

prog=$(basename "$0")

usage() {
  cat <<EOF
Usage: $prog [options] [--] [key.sub=value ...]

Runs erpo-jax train on this machine.

  One process:      $prog --config configs/tiny.yaml train.steps=10
  8 fake CPU devs:  $prog --cpu-devices 8 --config configs/tiny.yaml
  2 CPU processes:  $prog --processes 2 --cpu-devices 2 --config configs/tiny.yaml

Options:
  --config FILE       YAML config or a name in configs/ (default: the CLI's default)
  --cpu-devices N     run on CPU with N fake devices per process
                      (XLA_FLAGS=--xla_force_host_platform_device_count=N, JAX_PLATFORMS=cpu)
  --processes P       start P processes with a coordinator on 127.0.0.1 (CPU unless
                      JAX_PLATFORMS is set); each logs to LOG_DIR/process-<i>.log; exits
                      non-zero if any process fails, after stopping the others
  --port PORT         coordinator port for --processes (default: a free port)
  --log-dir DIR       where --processes writes its logs (default: runs/logs/local)
  --dry-run           print every command instead of running it
  -h, --help          show this help
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

show() {
  echo "+ $(quote "$@")"
}

config=""
cpu_devices=""
processes=1
port=""
log_dir="runs/logs/local"
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
    --config | --cpu-devices | --processes | --port | --log-dir)
      [[ $# -gt 0 && $1 != --* ]] || die "$arg needs a value"
      case $arg in
        --config) config=$1 ;;
        --cpu-devices) cpu_devices=$1 ;;
        --processes) processes=$1 ;;
        --port) port=$1 ;;
        --log-dir) log_dir=$1 ;;
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
if [[ -n $cpu_devices && ! $cpu_devices =~ $positive ]]; then
  die "--cpu-devices: expected a positive integer, got '$cpu_devices'"
fi
[[ $processes =~ $positive ]] || die "--processes: expected a positive integer, got '$processes'"
if [[ -n $port ]] && ! { [[ $port =~ $positive ]] && ((port < 65536)); }; then
  die "--port: expected 1..65535, got '$port'"
fi

envs=()
if [[ -n $cpu_devices ]]; then
  # erpo-jax gives these devices their XLA threads itself (PJRT_NPROC, multihost.set_cpu_xla_threads).
  envs+=("XLA_FLAGS=${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=$cpu_devices" "JAX_PLATFORMS=cpu")
elif ((processes > 1)) && [[ -z ${JAX_PLATFORMS:-} ]]; then
  # Several processes on one machine would all claim the same accelerators.
  envs+=("JAX_PLATFORMS=cpu")
fi
train=(erpo-jax train)
[[ -z $config ]] || train+=(--config "$config")

if ((processes == 1)); then
  if ((dry_run)); then
    show env "${envs[@]}" "${train[@]}" "${overrides[@]}"
    exit 0
  fi
  exec env "${envs[@]}" "${train[@]}" "${overrides[@]}"
fi

if [[ -z $port ]]; then
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi
coordinator="127.0.0.1:$port"

pids=()
tail_pid=""
stop_all() {
  local pid
  for pid in "${pids[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  [[ -z $tail_pid ]] || kill "$tail_pid" 2>/dev/null || true
}
trap 'stop_all; exit 130' INT TERM

((dry_run)) || mkdir -p "$log_dir"
for ((i = 0; i < processes; i++)); do
  cmd=(env "${envs[@]}" "${train[@]}" --coordinator "$coordinator" --num-processes "$processes" --process-id "$i"
       "${overrides[@]}")
  log="$log_dir/process-$i.log"
  if ((dry_run)); then
    echo "$(show "${cmd[@]}") > $(quote "$log") 2>&1 &"
  else
    "${cmd[@]}" >"$log" 2>&1 &
    pids+=($!)
  fi
done
if ((dry_run)); then
  echo "+ wait  # for all $processes processes; exit 1 if any fails"
  exit 0
fi

echo "$prog: $processes processes, coordinator $coordinator, logs in $log_dir/process-<i>.log" >&2
tail -n +1 -F "$log_dir/process-0.log" 2>/dev/null &
tail_pid=$!

# Polls so that the first failure is seen whichever process it is; the others are
# then stopped rather than left waiting for their peer until the heartbeat times out.
# (bash reaps finished children at once, so `kill -0` fails for them; `wait` still
# returns their exit status.)
failed=()
stopped=0
running=("${!pids[@]}")
while ((${#running[@]})); do
  still=()
  for i in "${running[@]}"; do
    if kill -0 "${pids[i]}" 2>/dev/null; then
      still+=("$i")
      continue
    fi
    rc=0
    wait "${pids[i]}" || rc=$?
    if ((rc != 0 && !stopped)); then
      failed+=("$i")
      echo "$prog: process $i exited with $rc; stopping the others" >&2
      stopped=1
      stop_all
    fi
  done
  running=("${still[@]}")
  ((${#running[@]} == 0)) || sleep 0.5
done
kill "$tail_pid" 2>/dev/null || true
wait "$tail_pid" 2>/dev/null || true

if ((${#failed[@]})); then
  for i in "${failed[@]}"; do
    echo "---- last lines of process $i ($log_dir/process-$i.log)" >&2
    tail -n 20 "$log_dir/process-$i.log" >&2 || true
  done
  exit 1
fi
echo "$prog: all $processes processes finished" >&2
