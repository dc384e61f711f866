#!/usr/bin/env python3
"""CPU baseline: Hugging Face TRL GRPOTrainer on SmolLM2-135M-Instruct (fp32).

Fixed workload (keep identical when comparing other frameworks):
  * policy/ref model: SmolLM2-135M-Instruct, float32 HF folder (see smollm2_gguf_to_hf.py)
  * prompts: chat-format user turn "What is A+B? Put the final answer in \\boxed{}."
    with A, B uniform random 2-digit ints (10..99), tokenizer's default chat template
  * 4 prompts/step x num_generations=8 = 32 completions/step, max_completion_length=64,
    temperature=1.0 (top_p=1, top_k=0), plain HF `generate` (no vLLM)
  * reward: 1.0 if last \\boxed{...} (else last integer) in completion == A+B, else 0.0
  * one optimizer step per generation batch (num_iterations=1, the 32 completions are
    consumed by exactly one optimizer step), AdamW lr=1e-6 (constant), beta=0.01
    (KL vs. frozen reference model), loss_type="grpo", fp32, torch threads=2,
    no gradient checkpointing, no logging backends
  * 2 warm-up steps + 6 timed steps

Run (the lock keeps other benchmarks from running concurrently):
  flock /tmp/peer-bench.lock /tmp/peer-trl/venv/bin/python trl_grpo_bench.py

On an NVIDIA GPU: --device cuda (float32 weights, TF32 matmuls as JAX's default precision runs them). Where the
SmolLM2 weights are not at hand, --random-init --model TOKENIZER_FOLDER builds SmolLM2-135M's shape with random
weights (the workload of erpo-jax's configs/bench_reference_random.yaml: every completion runs its 64 tokens).

Prints per-step lines, then one final line starting with `SUMMARY_JSON ` followed by JSON.
"""
import argparse
import os
import sys

# Threads must be pinned before torch is imported.
_THREADS = "2"
for _v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_v] = _THREADS
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402

import torch  # noqa: E402

torch.set_num_threads(int(_THREADS))

import datasets  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

PROMPT_TMPL = "What is {a}+{b}? Put the final answer in \\boxed{{}}."
_BOXED_RE = re.compile(r"\\boxed\{([^{}]*)\}")
_INT_RE = re.compile(r"-?\d+")


def extract_answer(text: str):
    boxed = _BOXED_RE.findall(text)
    if boxed:
        ints = _INT_RE.findall(boxed[-1].replace(",", ""))
        return int(ints[-1]) if ints else None
    ints = _INT_RE.findall(text.replace(",", ""))
    return int(ints[-1]) if ints else None


LAST_SCORED = []  # (completion text, answer, reward) of the most recent reward call, for eyeballing


def sum_reward(completions, answer, **kwargs):
    out = []
    LAST_SCORED.clear()
    for comp, ans in zip(completions, answer):
        text = comp[-1]["content"] if isinstance(comp, list) else comp
        out.append(1.0 if extract_answer(text) == int(ans) else 0.0)
        LAST_SCORED.append((text, int(ans), out[-1]))
    return out


def save_random_smollm2(tokenizer_dir: str, out: str, seed: int) -> str:
    """A float32 HF folder of SmolLM2-135M's architecture with random weights and the given tokenizer."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, intermediate_size=1536, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, dtype="float32")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


def make_dataset(n: int, seed: int) -> Dataset:
    rng = random.Random(seed)
    rows = {"prompt": [], "answer": []}
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows["prompt"].append([{"role": "user", "content": PROMPT_TMPL.format(a=a, b=b)}])
        rows["answer"].append(a + b)
    return Dataset.from_dict(rows)


class RssSampler:
    """Samples process RSS every `period` s (ru_maxrss gives the lifetime peak as well)."""

    def __init__(self, period=0.05):
        import psutil

        self._p = psutil.Process()
        self.period = period
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._p.memory_info().rss)
            self._stop.wait(self.period)

    def reset(self):
        self.peak = self._p.memory_info().rss

    def start(self):
        self._t.start()

    def stop(self):
        self._stop.set()
        self._t.join()


def cpu_model():
    """The CPU's model name from /proc/cpuinfo (erpo-jax bench --against compares it with its own)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                    return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def allocator():
    """The malloc this process runs on: a preloaded library's name (mimalloc, tcmalloc, jemalloc) or "system".

    erpo-jax's command preloads mimalloc by itself; on the C library's malloc a process faults in the pages of
    each large buffer it frees and allocates again, so `bench --against` names both sides' allocators.
    """
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:  # not Linux: what LD_PRELOAD asks for
        maps = os.environ.get("LD_PRELOAD", "")
    for known in ("mimalloc", "tcmalloc", "jemalloc"):  # the names erpo_jax.allocator.in_use() gives
        if f"lib{known}" in maps:
            return known
    return "system"


def faults_and_system_s():
    """(minor page faults, kernel CPU s) of this process so far, all threads."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_minflt, ru.ru_stime


def cpu_snapshot():
    """(busy CPU s of all processes, hypervisor steal s, this process's CPU s, wall) from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]] + [0] * 8
    hz = os.sysconf("SC_CLK_TCK")
    busy = vals[0] + vals[1] + vals[2] + vals[5] + vals[6]  # user nice system irq softirq
    t = os.times()
    return busy / hz, vals[7] / hz, t.user + t.system, time.perf_counter()


class StepRecorder(TrainerCallback):
    def __init__(self, rss: RssSampler, warmup: int):
        self.rss = rss
        self.warmup = warmup
        self.cpu_at_timed_start = None
        self.cpu_at_end = None
        self.t_train_begin = None
        self.begin = {}
        self.end = {}
        self.rss_peak = {}
        self.logs = {}
        self.usage_begin = {}
        self.usage = {}  # step -> (page faults, kernel CPU s) within it

    def on_train_begin(self, args, state, control, **kw):
        self.t_train_begin = time.perf_counter()
        if self.warmup == 0:  # the timed steps start here
            self.cpu_at_timed_start = cpu_snapshot()

    def on_step_begin(self, args, state, control, **kw):
        self.begin[state.global_step + 1] = time.perf_counter()
        self.usage_begin[state.global_step + 1] = faults_and_system_s()
        self.rss.reset()

    def on_step_end(self, args, state, control, **kw):
        self.end[state.global_step] = time.perf_counter()
        (f0, s0), (f1, s1) = self.usage_begin[state.global_step], faults_and_system_s()
        self.usage[state.global_step] = (f1 - f0, s1 - s0)
        self.rss_peak[state.global_step] = self.rss.peak
        if state.global_step == self.warmup:
            self.cpu_at_timed_start = cpu_snapshot()
        self.cpu_at_end = cpu_snapshot()

    def on_log(self, args, state, control, logs=None, **kw):
        # Per-step GRPO metrics only (the end-of-train summary log shares the last global_step).
        if logs is not None and "reward" in logs:
            self.logs[state.global_step] = {k: float(v) for k, v in logs.items() if isinstance(v, (int, float))}


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with wall-clock accounting per optimizer step (keyed by 1-based step)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.timing = defaultdict(lambda: defaultdict(float))
        self.tok = defaultdict(dict)

    def _k(self):
        return self.state.global_step + 1

    def _generate(self, prompts):
        t0 = time.perf_counter()
        out = super()._generate(prompts)
        self.timing[self._k()]["generate"] += time.perf_counter() - t0
        prompt_ids_list, completion_ids_list = out[0], out[1]
        lens = [len(c) for c in completion_ids_list]
        self.tok[self._k()] = {
            "n_completions": len(lens),
            "completion_tokens": int(sum(lens)),  # incl. the EOS token when one was emitted
            "max_completion_len": int(max(lens)),
            "decode_steps_x_batch": int(max(lens) * len(lens)),  # what batched HF generate really computes
            "n_truncated": int(sum(1 for n in lens if n >= self.max_completion_length)),
            "prompt_tokens_mean": float(sum(len(p) for p in prompt_ids_list) / len(prompt_ids_list)),
            "prompt_tokens_max": int(max(len(p) for p in prompt_ids_list)),
        }
        return out

    def _generate_and_score_completions(self, inputs):
        t0 = time.perf_counter()
        out = super()._generate_and_score_completions(inputs)
        self.timing[self._k()]["rollout"] += time.perf_counter() - t0
        return out

    def _get_per_token_logps_and_entropies(self, model, *a, **kw):
        t0 = time.perf_counter()
        out = super()._get_per_token_logps_and_entropies(model, *a, **kw)
        key = "logps_fwd_grad" if torch.is_grad_enabled() else "logps_fwd_nograd"
        self.timing[self._k()][key] += time.perf_counter() - t0
        return out

    def _prepare_inputs(self, generation_batch):
        t0 = time.perf_counter()
        out = super()._prepare_inputs(generation_batch)
        self.timing[self._k()]["prepare_inputs"] += time.perf_counter() - t0
        return out

    def training_step(self, model, inputs, num_items_in_batch):
        t0 = time.perf_counter()
        out = super().training_step(model, inputs, num_items_in_batch)
        self.timing[self._k()]["training_step"] += time.perf_counter() - t0
        return out


def stats(xs):
    return {
        "median": round(statistics.median(xs), 4),
        "min": round(min(xs), 4),
        "max": round(max(xs), 4),
        "mean": round(statistics.fmean(xs), 4),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/smollm2-hf")
    ap.add_argument("--out-dir", default="/tmp/peer-trl/grpo-out")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timed", type=int, default=6)
    ap.add_argument("--per-device-batch", type=int, default=32,
                    help="completions per micro-batch; grad accumulation = 32 / this (32 -> GA 1)")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="TRL's default is on; the baseline keeps it off")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default=None, help="also write the summary JSON to this file")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--random-init", action="store_true",
                    help="--model is a tokenizer folder; the policy is SmolLM2-135M's shape with random weights")
    args = ap.parse_args()
    if args.device == "cuda":
        assert torch.cuda.is_available(), "--device cuda: torch sees no GPU"
        torch.set_float32_matmul_precision("high")  # TF32, as JAX's default precision on the GPU
    if args.random_init:
        args.model = save_random_smollm2(args.model, os.path.join(args.out_dir, "random-model"), args.seed)

    prompts_per_step, num_gen, max_len = 4, 8, 64
    completions_per_step = prompts_per_step * num_gen
    assert completions_per_step % args.per_device_batch == 0
    grad_accum = completions_per_step // args.per_device_batch
    total_steps = args.warmup + args.timed

    rss = RssSampler()
    rss.start()

    tok = AutoTokenizer.from_pretrained(args.model)
    train_ds = make_dataset(n=max(256, total_steps * prompts_per_step), seed=args.seed)

    cfg = GRPOConfig(
        output_dir=args.out_dir,
        # workload
        per_device_train_batch_size=args.per_device_batch,
        gradient_accumulation_steps=grad_accum,  # steps_per_generation defaults to this
        num_generations=num_gen,
        max_completion_length=max_len,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        num_iterations=1,
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        beta=0.01,
        loss_type="grpo",
        max_steps=total_steps,
        # precision / device
        bf16=False,
        fp16=False,
        use_cpu=args.device == "cpu",
        gradient_checkpointing=args.gradient_checkpointing,
        model_init_kwargs={"dtype": "float32"},
        use_vllm=False,
        # no logging backends, no checkpoints
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=args.seed,
        data_seed=args.seed,
    )
    assert cfg.generation_batch_size == completions_per_step, cfg.generation_batch_size
    assert cfg.steps_per_generation == grad_accum

    rec = StepRecorder(rss, args.warmup)
    t_init0 = time.perf_counter()
    trainer = TimedGRPOTrainer(
        model=args.model,
        reward_funcs=sum_reward,
        args=cfg,
        train_dataset=train_ds,
        processing_class=tok,
        callbacks=[rec],
    )
    t_init = time.perf_counter() - t_init0
    assert trainer.ref_model is not None, "beta>0 must create a reference model"
    print(f"[setup] trainer init {t_init:.1f}s; torch threads={torch.get_num_threads()} "
          f"interop={torch.get_num_interop_threads()}; optimizer={cfg.optim}; GA={grad_accum}; "
          f"gen_batch={cfg.generation_batch_size}; grad_ckpt={cfg.gradient_checkpointing}", flush=True)

    t0 = time.perf_counter()
    trainer.train()
    t_train = time.perf_counter() - t0
    rss.stop()

    per_step = []
    for k in range(1, total_steps + 1):
        prev_end = rec.end.get(k - 1, rec.t_train_begin)
        tm = trainer.timing[k]
        wall = rec.end[k] - prev_end
        inner = rec.end[k] - rec.begin[k]
        rollout = tm["rollout"]
        gen = tm["generate"]
        ref_fwd = tm["logps_fwd_nograd"]
        train_fwd_bwd = tm["training_step"] - tm["prepare_inputs"]
        update = inner - rollout  # policy fwd+bwd + grad clip + AdamW step + zero_grad
        lg = rec.logs.get(k, {})
        row = {
            "step": k,
            "timed": k > args.warmup,
            "wall_s": wall,
            "begin_to_end_s": inner,
            "generate_s": gen,
            "rollout_s": rollout,
            "ref_logps_fwd_s": ref_fwd,
            "reward_and_misc_s": rollout - gen - ref_fwd,
            "policy_fwd_bwd_s": train_fwd_bwd,
            "policy_logps_fwd_s": tm["logps_fwd_grad"],
            "update_s": update,
            "optimizer_and_misc_s": update - train_fwd_bwd,
            "outside_step_s": wall - inner,
            "rss_peak_mb": rec.rss_peak.get(k, 0) / 2**20,
            "page_faults": rec.usage[k][0],
            "system_s": rec.usage[k][1],
            **trainer.tok[k],
            "reward": lg.get("reward"),
            "kl": lg.get("kl"),
            "loss": lg.get("loss"),
            "grad_norm": lg.get("grad_norm"),
            "entropy": lg.get("entropy"),
            "trl_step_time_s": lg.get("step_time"),
        }
        per_step.append(row)
        print("[step] " + json.dumps({kk: (round(v, 3) if isinstance(v, float) else v) for kk, v in row.items()}),
              flush=True)

    shown = LAST_SCORED[:: max(1, len(LAST_SCORED) // 4)][:4]
    shown += [x for x in LAST_SCORED if x[2] > 0 and x not in shown][:1]
    for text, ans, r in shown:
        print(f"[sample] answer={ans} reward={r} completion={text!r}", flush=True)

    timed = [r for r in per_step if r["timed"]]
    (sb0, st0, pb0, w0), (sb1, st1, pb1, w1) = rec.cpu_at_timed_start, rec.cpu_at_end
    # CPU used by *other* processes during the timed steps, in cores (0.0 = quiet machine),
    # and CPU time the hypervisor stole from this VM.
    other_cores = max(0.0, ((sb1 - sb0) - (pb1 - pb0)) / (w1 - w0))
    steal_cores = (st1 - st0) / (w1 - w0)
    self_cores = (pb1 - pb0) / (w1 - w0)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    summary = {
        "framework": "trl.GRPOTrainer",
        "device": "gpu" if args.device == "cuda" else "cpu",
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "cpu_model": cpu_model(),
                 "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
                 "python": platform.python_version(),
                 # the vector ISA torch's CPU kernels dispatch to (ATEN_CPU_CAPABILITY lowers it), and the
                 # variables that hold its MKL and oneDNN products to an ISA, where set
                 "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                 "isa_env": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
                                                        "ONEDNN_MAX_CPU_ISA") if k in os.environ},
                 # the malloc under torch's CPU tensors, and its settings where given (THP_MEM_ALLOC_ENABLE:
                 # torch's own switch that asks for transparent huge pages for its large CPU tensors)
                 "allocator": allocator(),
                 "allocator_env": {k: v for k, v in os.environ.items()
                                   if k.startswith(("MIMALLOC_", "MALLOC_", "JE_MALLOC_", "TCMALLOC_"))
                                   or k == "THP_MEM_ALLOC_ENABLE"}},
        "versions": {
            "torch": torch.__version__, "trl": trl.__version__, "transformers": transformers.__version__,
            "datasets": datasets.__version__,
            "accelerate": __import__("accelerate").__version__,
        },
        "workload": {
            "model": ("SmolLM2-135M-Instruct's shape, random weights" if args.random_init
                      else "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to fp32)"),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "prompts_per_step": prompts_per_step, "num_generations": num_gen,
            "completions_per_step": completions_per_step, "max_completion_length": max_len,
            "temperature": 1.0, "num_iterations": 1, "per_device_train_batch_size": args.per_device_batch,
            "gradient_accumulation_steps": grad_accum, "learning_rate": 1e-6, "lr_scheduler": "constant",
            "beta": 0.01, "loss_type": "grpo", "epsilon": cfg.epsilon, "scale_rewards": cfg.scale_rewards,
            "max_grad_norm": cfg.max_grad_norm, "optimizer": str(cfg.optim), "dtype": "float32",
            "torch_threads": torch.get_num_threads(), "gradient_checkpointing": cfg.gradient_checkpointing,
            "use_vllm": False, "warmup_steps": args.warmup, "timed_steps": args.timed, "seed": args.seed,
        },
        "step_wall_s": stats([r["wall_s"] for r in timed]),
        "generate_s": stats([r["generate_s"] for r in timed]),
        "rollout_s": stats([r["rollout_s"] for r in timed]),
        "ref_logps_fwd_s": stats([r["ref_logps_fwd_s"] for r in timed]),
        "update_s": stats([r["update_s"] for r in timed]),
        "policy_fwd_bwd_s": stats([r["policy_fwd_bwd_s"] for r in timed]),
        "optimizer_and_misc_s": stats([r["optimizer_and_misc_s"] for r in timed]),
        "completion_tokens_per_step": stats([r["completion_tokens"] for r in timed]),
        "decode_steps_x_batch_per_step": stats([r["decode_steps_x_batch"] for r in timed]),
        "completion_tokens_per_s_of_generate": round(
            sum(r["completion_tokens"] for r in timed) / sum(r["generate_s"] for r in timed), 2),
        "reward_mean_timed": (round(statistics.fmean(rw), 4)
                              if (rw := [r["reward"] for r in timed if r["reward"] is not None]) else None),
        "prompt_tokens_mean": round(statistics.fmean(r["prompt_tokens_mean"] for r in timed), 2),
        "peak_rss_mb": round(peak_rss_mb, 1),
        # minor page faults and kernel CPU seconds of this process within each timed step
        "page_faults_per_step": stats([r["page_faults"] for r in timed]),
        "system_s_per_step": stats([r["system_s"] for r in timed]),
        "peak_rss_timed_steps_mb": round(max(r["rss_peak_mb"] for r in timed), 1),
        "timed_cpu_cores_self": round(self_cores, 3),
        "timed_cpu_cores_other_procs": round(other_cores, 3),
        "timed_cpu_cores_steal": round(steal_cores, 3),
        "loadavg_at_end": os.getloadavg(),
        "trainer_init_s": round(t_init, 2),
        "train_total_s": round(t_train, 2),
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"summary": summary, "per_step": per_step}, f, indent=1)
    print("SUMMARY_JSON " + json.dumps(summary, separators=(",", ":")), flush=True)


if __name__ == "__main__":
    sys.exit(main())
