"""vLLM v0's graph-capture state (``CommonAttentionState``): the static decode buffers
a captured graph reads, and the per-step copies into them. Part of the v0 compatibility
layer (see :mod:`pagedattn.compat.vllm_v0`); re-exported by ``pagedattn.backends.utils``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from pagedattn.compat.runner_types import _check_int as _require_int
from pagedattn.compat.runner_types import _is_int
from pagedattn.paging import PAD_SLOT_ID

# Backends of this package whose metadata carries the encoder/cross-attention fields
# that graph capture fills (vLLM's list also names GPU backends this package lacks).
_ENC_DEC_GRAPH_BACKENDS = ("XFORMERS",)


class AttentionState(ABC):
    """Per-backend state that owns the static input buffers of captured graphs."""

    @abstractmethod
    def graph_capture(self, max_batch_size: int): ...

    @abstractmethod
    def graph_clone(self, batch_size: int) -> "AttentionState": ...

    @abstractmethod
    def graph_capture_get_metadata_for_batch(self, batch_size: int,
                                             is_encoder_decoder_model: bool = False): ...

    @abstractmethod
    def get_graph_input_buffers(self, attn_metadata,
                                is_encoder_decoder_model: bool = False) -> dict[str, Any]: ...

    @abstractmethod
    def prepare_graph_input_buffers(self, input_buffers, attn_metadata,
                                    is_encoder_decoder_model: bool = False) -> None: ...

    @abstractmethod
    def begin_forward(self, model_input) -> None: ...


class CommonAttentionState(AttentionState):
    """Static decode buffers for graph capture and replay.

    Inside ``with state.graph_capture(max_batch_size):`` the state owns

    * ``_graph_slot_mapping``  ``int64 [max_batch_size]`` filled with PAD_SLOT_ID,
    * ``_graph_seq_lens``      ``int32 [max_batch_size]`` filled with 1,
    * ``_graph_block_tables``  ``int32 [max_batch_size, max_blocks]`` from
      ``runner.graph_block_tables``,

    all on ``runner.device``. Metadata for a captured batch of ``b`` decodes holds views
    ``[:b]`` of them, so a graph captured over that metadata (e.g.
    ``torch.cuda.graph``) reads those addresses; before each replay
    ``prepare_graph_input_buffers`` copies the step's values into the same storage.
    The slot mapping is the runner's to copy (it lives beside input ids/positions).
    """

    def __init__(self, runner: Any):
        self.runner = runner
        self._is_graph_capturing = False

    def _require_capturing(self, what: str) -> None:
        if not self._is_graph_capturing:
            raise RuntimeError(f"{what} is only valid inside `with state.graph_capture(...)`")

    def _require_enc_dec_backend(self) -> None:
        name = self.runner.attn_backend.get_name()
        if name not in _ENC_DEC_GRAPH_BACKENDS:
            raise NotImplementedError(
                f"graph capture of encoder/decoder models needs one of the backends "
                f"{_ENC_DEC_GRAPH_BACKENDS}, got {name!r}"
            )

    @contextmanager
    def graph_capture(self, max_batch_size: int) -> Iterator[None]:
        _require_int("max_batch_size", max_batch_size, 1)
        template = self.runner.graph_block_tables
        if template.shape[0] < max_batch_size:
            raise ValueError(
                f"runner.graph_block_tables has {template.shape[0]} rows, fewer than "
                f"max_batch_size={max_batch_size}"
            )
        device = self.runner.device
        self._is_graph_capturing = True
        self._graph_slot_mapping = torch.full((max_batch_size,), PAD_SLOT_ID,
                                              dtype=torch.long, device=device)
        self._graph_seq_lens = torch.ones(max_batch_size, dtype=torch.int32, device=device)
        self._graph_block_tables = torch.from_numpy(
            np.ascontiguousarray(template[:max_batch_size], dtype=np.int32)).to(device)
        try:
            yield
        finally:
            self._is_graph_capturing = False
            del self._graph_slot_mapping
            del self._graph_seq_lens
            del self._graph_block_tables

    def graph_clone(self, batch_size: int) -> "CommonAttentionState":
        self._require_capturing("graph_clone")
        return self.__class__(self.runner)

    def graph_capture_get_metadata_for_batch(self, batch_size: int,
                                             is_encoder_decoder_model: bool = False):
        """Decode-only metadata over the first ``batch_size`` rows of the buffers."""
        self._require_capturing("graph_capture_get_metadata_for_batch")
        capacity = self._graph_seq_lens.shape[0]
        if not _is_int(batch_size) or not 1 <= batch_size <= capacity:
            raise ValueError(f"batch_size must be in [1, {capacity}], got {batch_size!r}")
        attn_metadata = self.runner.attn_backend.make_metadata(
            num_prefills=0,
            num_prefill_tokens=0,
            num_decode_tokens=batch_size,
            slot_mapping=self._graph_slot_mapping[:batch_size],
            multi_modal_placeholder_index_maps=None,
            enable_kv_scales_calculation=True,
            seq_lens=None,
            seq_lens_tensor=self._graph_seq_lens[:batch_size],
            max_query_len=1,
            max_decode_query_len=1,
            max_prefill_seq_len=0,
            max_decode_seq_len=self.runner.max_seq_len_to_capture,
            query_start_loc=None,
            seq_start_loc=None,
            context_lens_tensor=None,
            block_tables=self._graph_block_tables[:batch_size],
            use_cuda_graph=True,
        )
        if is_encoder_decoder_model:
            self._require_enc_dec_backend()
            self._update_captured_metadata_for_enc_dec_model(batch_size, attn_metadata)
        return attn_metadata

    def get_graph_input_buffers(self, attn_metadata,
                                is_encoder_decoder_model: bool = False) -> dict[str, Any]:
        decode = attn_metadata.decode_metadata
        input_buffers = {
            "slot_mapping": attn_metadata.slot_mapping,
            "seq_lens_tensor": decode.seq_lens_tensor,
            "block_tables": decode.block_tables,
        }
        if is_encoder_decoder_model:
            self._require_enc_dec_backend()
            self._add_additional_input_buffers_for_enc_dec_model(attn_metadata, input_buffers)
        return input_buffers

    def prepare_graph_input_buffers(self, input_buffers, attn_metadata,
                                    is_encoder_decoder_model: bool = False) -> None:
        """Copy this step's decode seq lens and block tables into the captured buffers
        (shapes must match the captured batch exactly)."""
        decode = attn_metadata.decode_metadata
        _copy_into(input_buffers, "seq_lens_tensor", decode.seq_lens_tensor)
        _copy_into(input_buffers, "block_tables", decode.block_tables)
        if is_encoder_decoder_model:
            self._require_enc_dec_backend()
            self._prepare_input_buffers_for_enc_dec_model(attn_metadata, input_buffers)

    def begin_forward(self, model_input) -> None:
        return

    def _update_captured_metadata_for_enc_dec_model(self, batch_size: int, attn_metadata) -> None:
        # Decode steps write no cross K/V, so the captured cross slot mapping is empty;
        # lengths of 1 and block 1 are placeholders replaced before every replay.
        device = self.runner.device
        attn_metadata.cross_slot_mapping = torch.tensor([], dtype=torch.int, device=device)
        attn_metadata.cross_block_tables = torch.full(
            (batch_size, self.runner.get_max_block_per_batch()), 1, dtype=torch.int,
            device=device)
        attn_metadata.encoder_seq_lens = torch.full((batch_size,), 1, dtype=torch.int,
                                                    device=device)
        attn_metadata.encoder_seq_lens_tensor = torch.full((batch_size,), 1, dtype=torch.int,
                                                           device=device)
        attn_metadata.max_encoder_seq_len = self.runner.max_seq_len_to_capture
        attn_metadata.num_encoder_tokens = 0

    def _add_additional_input_buffers_for_enc_dec_model(self, attn_metadata,
                                                        input_buffers: dict[str, Any]) -> None:
        decode = attn_metadata.decode_metadata
        input_buffers["encoder_seq_lens_tensor"] = decode.encoder_seq_lens_tensor
        input_buffers["cross_slot_mapping"] = decode.cross_slot_mapping
        input_buffers["cross_block_tables"] = decode.cross_block_tables

    def _prepare_input_buffers_for_enc_dec_model(self, attn_metadata,
                                                 input_buffers: dict[str, Any]) -> None:
        decode = attn_metadata.decode_metadata
        for name in ("encoder_seq_lens_tensor", "cross_slot_mapping", "cross_block_tables"):
            _copy_into(input_buffers, name, getattr(decode, name))


def _copy_into(input_buffers: dict[str, Any], name: str, src: torch.Tensor | None) -> None:
    dst = input_buffers[name]
    if src is None or tuple(src.shape) != tuple(dst.shape):
        raise ValueError(
            f"{name}: expected a tensor of the captured shape {tuple(dst.shape)}, got "
            f"{None if src is None else tuple(src.shape)}"
        )
    dst.copy_(src, non_blocking=True)
