"""The one weight-loading loop (pagedattn.models.loader.load_weights) on each model's
declared checkpoint naming: fused shards land in their rows, every tensor must be set,
a tensor with no place or the wrong shape is refused naming it."""

from __future__ import annotations

import pytest
import torch

from pagedattn.models.bert import BertConfig, BertModel
from pagedattn.models.llama import LlamaConfig, LlamaForCausalLM

LLAMA = {"model_type": "llama", "vocab_size": 11, "hidden_size": 8, "intermediate_size": 12,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 2}


def llama(tied: bool = False) -> LlamaForCausalLM:
    cfg = LlamaConfig.from_hf({**LLAMA, "tie_word_embeddings": tied})
    return LlamaForCausalLM(cfg, [None] * cfg.num_layers)


def hf_llama_weights(tied: bool = False) -> dict[str, torch.Tensor]:
    """Hugging Face names and shapes, each tensor a distinct constant."""
    h, i, q, kv = 8, 12, 8, 4
    shapes = {"model.embed_tokens.weight": (11, h), "model.norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (11, h)
    for n in range(2):
        p = f"model.layers.{n}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}
    return {name: torch.full(shape, float(k)) for k, (name, shape) in enumerate(shapes.items())}


def test_decoder_shards_land_in_their_rows():
    model, weights = llama(), hf_llama_weights()
    model.load_weights(weights.items())
    layer = model.layers[1]
    p = "model.layers.1."
    torch.testing.assert_close(layer.qkv_proj.weight, torch.cat(
        [weights[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]))
    torch.testing.assert_close(layer.gate_up_proj.weight, torch.cat(
        [weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]]))
    torch.testing.assert_close(layer.o_proj.weight, weights[p + "self_attn.o_proj.weight"])
    torch.testing.assert_close(layer.down_proj.weight, weights[p + "mlp.down_proj.weight"])
    torch.testing.assert_close(model.lm_head.weight, weights["lm_head.weight"])


def test_tied_head_and_rotary_buffers_are_skipped():
    model, weights = llama(tied=True), hf_llama_weights(tied=True)
    extra = {"lm_head.weight": torch.zeros(11, 8),
             "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(1)}
    model.load_weights([*weights.items(), *extra.items()])
    torch.testing.assert_close(model.lm_head.weight, weights["model.embed_tokens.weight"])


def test_missing_misplaced_and_misshapen_tensors_are_named():
    weights = hf_llama_weights()
    del weights["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"lacks 1 tensors, e.g. \['layers.0.qkv_proj.weight@8'\]"):
        llama().load_weights(weights.items())
    with pytest.raises(ValueError, match="tensor 'layers.0.mlp.extra.weight' has no place in llama"):
        llama().load_weights([*hf_llama_weights().items(),
                              ("model.layers.0.mlp.extra.weight", torch.zeros(1))])
    bad = hf_llama_weights()
    bad["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 8)
    with pytest.raises(ValueError, match=r"tensor 'layers.1.mlp.up_proj.weight' has shape \(3, 8\), "
                                         r"expected \(12, 8\)"):
        llama().load_weights(bad.items())


def test_bert_names_map_onto_the_encoder():
    cfg = BertConfig.from_hf({"model_type": "bert", "vocab_size": 9, "hidden_size": 4, "intermediate_size": 6,
                              "num_hidden_layers": 1, "num_attention_heads": 2,
                              "max_position_embeddings": 16, "type_vocab_size": 2,
                              "layer_norm_eps": 1e-12, "hidden_act": "gelu"})
    model = BertModel(cfg, [None])
    names = model.checkpoint_names()
    assert names.locate("encoder.layer.0.attention.self.key.weight") == ("layers.0.qkv.weight", 4, 4)
    assert names.locate("encoder.layer.0.attention.output.LayerNorm.bias") == \
        ("layers.0.attn_norm.bias", None, None)
    assert names.locate("encoder.layer.0.output.dense.weight") == ("layers.0.output.weight", None, None)
    assert names.locate("embeddings.LayerNorm.weight") == ("embed_norm.weight", None, None)
    assert names.skip("pooler.dense.weight") and names.skip("embeddings.position_ids")
