"""Loading of the native extension ``pagedattn._C`` and the fake (meta) implementations of
its ops, so they trace under ``torch.compile`` / ``torch.library.opcheck``.

Importing ``pagedattn._C`` runs its ``TORCH_LIBRARY`` registrations; the ops then live in
``torch.ops.pagedattn``. If the extension is missing or fails to load, :data:`AVAILABLE` is
False and :data:`LOAD_ERROR` says why (the public wrappers fall back to the reference).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

from pagedattn.ops.isa import METADATA_FIELDS_PER_REQ, METADATA_HEADER

AVAILABLE = False
LOAD_ERROR: str | None = None

try:
    if os.environ.get("PAGEDATTN_NATIVE_LIB"):
        # Another build of the extension (make test-sanitize: the ASan/UBSan one).
        _spec = importlib.util.spec_from_file_location("pagedattn._C",
                                                       os.environ["PAGEDATTN_NATIVE_LIB"])
        if _spec is None:
            raise ImportError(f"PAGEDATTN_NATIVE_LIB={os.environ['PAGEDATTN_NATIVE_LIB']!r} "
                              "is not a loadable extension")
        _C = importlib.util.module_from_spec(_spec)
        sys.modules["pagedattn._C"] = _C
        _spec.loader.exec_module(_C)
    else:
        from pagedattn import _C  # noqa: F401  (registers torch.ops.pagedattn.*)

    AVAILABLE = hasattr(torch.ops.pagedattn, "cpu_attention_with_kv_cache")
    if not AVAILABLE:
        LOAD_ERROR = "pagedattn._C loaded but registered no attention op"
except ImportError as exc:  # not built, or built against another torch
    LOAD_ERROR = f"{type(exc).__name__}: {exc}"


def build_identity() -> str:
    """The loaded extension's file size and modification time (a stat, not a hash: it
    runs once per model load); ``none`` when it is not loaded."""
    path = getattr(sys.modules.get("pagedattn._C"), "__file__", None)
    if not AVAILABLE or not path:
        return "none"
    try:
        st = os.stat(path)
    except OSError:
        return "unknown"
    return f"{st.st_size}-{st.st_mtime_ns}"


def metadata_numel(num_reqs: int) -> int:
    """Length of the scheduler metadata's header and per-request fields for ``num_reqs``
    requests: the whole tensor (the work partition follows) is at least this long."""
    return len(METADATA_HEADER) + len(METADATA_FIELDS_PER_REQ) * num_reqs


if AVAILABLE:

    @torch.library.register_fake("pagedattn::cpu_attn_get_scheduler_metadata")
    def _metadata_fake(num_reqs, num_heads, num_kv_heads, head_dim, seq_lens, dtype,
                       query_start_loc, causal, sliding_window_size, isa, enable_kv_split,
                       batch_invariant=False, block_table=None, block_size=0,
                       common_prefix_len=0):
        # The plan's length depends on the query lengths (data): a dynamic size.
        size = torch.library.get_ctx().new_dynamic_size(min=metadata_numel(num_reqs))
        return seq_lens.new_empty((size,), dtype=torch.int32)

    # The two mutating ops return nothing: their fakes only have to exist (the mutation is
    # declared in the schema with Tensor(a!), which functionalization relies on).
    @torch.library.register_fake("pagedattn::cpu_attn_reshape_and_cache")
    def _reshape_and_cache_fake(key, value, key_cache, value_cache, slot_mapping,
                                k_scale=1.0, v_scale=1.0):
        return None

    @torch.library.register_fake("pagedattn::cpu_attention_with_kv_cache")
    def _attention_fake(query, key_cache, value_cache, output, query_start_loc, seq_lens,
                        scale, causal, alibi_slopes, sliding_window_left,
                        sliding_window_right, block_table, softcap, scheduler_metadata,
                        s_aux, k_scale=1.0, v_scale=1.0):
        return None

    @torch.library.register_fake("pagedattn::packed_linear")
    def _packed_linear_fake(x, packed_weight, bias, out_features):
        return x.new_empty((x.shape[0], out_features))

    @torch.library.register_fake("pagedattn::packed_gated_linear")
    def _packed_gated_linear_fake(x, packed_weight, bias, out_features, activation):
        return x.new_empty((x.shape[0], out_features // 2))

    @torch.library.register_fake("pagedattn::packed_linear_dpbf16")
    def _packed_linear_dpbf16_fake(x, packed_weight, bias, out_features, out_dtype=None):
        return x.new_empty((x.shape[0], out_features), dtype=out_dtype or torch.float32)

    @torch.library.register_fake("pagedattn::packed_linear_amx")
    def _packed_linear_amx_fake(x, packed_weight, bias, out_features, out_dtype=None):
        return x.new_empty((x.shape[0], out_features), dtype=out_dtype or torch.float32)

    @torch.library.register_fake("pagedattn::packed_gated_linear_amx")
    def _packed_gated_linear_amx_fake(x, packed_weight, bias, out_features, activation,
                                      out_dtype=None):
        return x.new_empty((x.shape[0], out_features // 2), dtype=out_dtype or torch.float32)

    @torch.library.register_fake("pagedattn::rms_norm")
    def _rms_norm_fake(x, weight, eps, out_dtype=None):
        return x.new_empty(x.shape, dtype=out_dtype or x.dtype)

    @torch.library.register_fake("pagedattn::fused_add_rms_norm")
    def _fused_add_rms_norm_fake(x, residual, weight, eps, out_dtype=None):
        return x.new_empty(x.shape, dtype=out_dtype or x.dtype)

    @torch.library.register_fake("pagedattn::silu_and_mul")
    def _silu_and_mul_fake(x):
        return x.new_empty((x.shape[0], x.shape[1] // 2))

    @torch.library.register_fake("pagedattn::gelu_tanh_and_mul")
    def _gelu_tanh_and_mul_fake(x):
        return x.new_empty((x.shape[0], x.shape[1] // 2))

    @torch.library.register_fake("pagedattn::rotary_embedding")
    def _rotary_embedding_fake(positions, query, key, cos_sin_cache):
        return None

    @torch.library.register_fake("pagedattn::decoder_stack")
    def _decoder_stack_fake(style, x, positions, cos_sin, norm_weights, linear_weights,
                                  linear_biases, linear_paths, linear_out_features, kv_caches,
                                  slot_mapping, query_start_loc, seq_lens, block_table,
                                  scheduler_metadata, causal, attn_scalars, windows,
                                  output_rows, num_heads, num_kv_heads, eps, act_dtype,
                                  attn_dtype=None):
        rows = x.shape[0] if output_rows is None else output_rows.shape[0]
        return x.new_empty((rows, x.shape[1]), dtype=act_dtype)

    @torch.library.register_fake("pagedattn::argmax_rows")
    def _argmax_rows_fake(logits):
        return logits.new_empty((logits.shape[0],), dtype=torch.int64)

    @torch.library.register_fake("pagedattn::stream_read")
    def _stream_read_fake(buf):
        return buf.new_empty((), dtype=torch.int64)
