"""Tests of the backend interface (pagedattn.backend) and the CP group state.

CommonAttentionMetadata has its own file, tests/test_common_metadata.py.
"""

from __future__ import annotations

from typing import Any, get_args

import numpy as np
import pytest
import torch

from pagedattn import distributed
from pagedattn.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MLAAttentionImpl,
    MultipleOf,
    is_quantized_kv_cache,
    subclass_attention_backend,
    subclass_attention_backend_with_overrides,
)
from pagedattn.config import (
    BlockSize,
    CacheDType,
    DeviceCapability,
    BuilderConfig,
    ParallelConfig,
    SpeculativeConfig,
)
from pagedattn.kv_cache_spec import AttentionSpec

# --------------------------------------------------------------------------- fixtures


class DummyMetadata(AttentionMetadata):
    def __init__(self, common_prefix_len: int, cam: CommonAttentionMetadata, fast: bool):
        self.common_prefix_len = common_prefix_len
        self.cam = cam
        self.fast_build = fast


class DummyImpl(AttentionImpl[DummyMetadata]):
    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, **kwargs):
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads or num_heads

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None,
                output_scale=None, output_block_scale=None):
        return query


class LseImpl(DummyImpl):
    can_return_lse_for_decode = True


class DummyBuilder(AttentionMetadataBuilder[DummyMetadata]):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.calls: list[tuple] = []

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        self.calls.append((common_prefix_len, common_attn_metadata, fast_build))
        return DummyMetadata(common_prefix_len, common_attn_metadata, fast_build)


class OtherBuilder(DummyBuilder):
    pass


class DummyBackend(AttentionBackend):
    """Takes every default of the interface."""

    @staticmethod
    def get_name() -> str:
        return "DUMMY"

    @staticmethod
    def get_impl_cls():
        return DummyImpl

    @staticmethod
    def get_builder_cls():
        return DummyBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size,
                           cache_dtype_str="auto"):
        return (2, num_blocks, block_size, num_kv_heads, head_size)


class StrictBackend(DummyBackend):
    """Narrow capabilities, so every check of validate_configuration can fail."""

    supported_kv_cache_dtypes = [CacheDType.AUTO, CacheDType.FP8]

    @classmethod
    def get_supported_head_sizes(cls):
        return [64, 128]

    @staticmethod
    def get_supported_kernel_block_sizes():
        return [16]

    @classmethod
    def supports_compute_capability(cls, capability):
        return capability.major >= 8

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla,
                             has_sink, use_sparse, device_capability):
        if head_size == 128 and dtype == torch.float16:
            return "head_size 128 needs bfloat16"
        return None


class MLASparseBackend(DummyBackend):
    @classmethod
    def is_mla(cls):
        return True

    @classmethod
    def is_sparse(cls):
        return True


GOOD = dict(
    head_size=64,
    dtype=torch.bfloat16,
    kv_cache_dtype="auto",
    block_size=16,
    use_mla=False,
    has_sink=False,
    use_sparse=False,
    use_mm_prefix=False,
    device_capability=DeviceCapability(9, 0),
    attn_type=AttentionType.DECODER,
)


@pytest.fixture(autouse=True)
def _no_cp_groups():
    distributed.destroy_context_parallel_groups()
    yield
    distributed.destroy_context_parallel_groups()


def make_builder(cls=DummyBuilder, *, num_spec=None, dcp=1, device="cpu"):
    spec = SpeculativeConfig(num_spec) if num_spec is not None else None
    config = BuilderConfig(
        parallel_config=ParallelConfig(decode_context_parallel_size=dcp),
        speculative_config=spec,
    )
    kv_spec = AttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    return cls(kv_spec, ["layers.0.attn", "layers.1.attn"], config, device)


# ------------------------------------------------------------------ capabilities


def test_defaults_of_the_interface():
    B = DummyBackend
    assert B.accept_output_buffer is False
    assert B.supported_dtypes == [torch.float16, torch.bfloat16]
    assert B.get_supported_kernel_block_sizes() == [MultipleOf(1)]
    assert B.get_required_kv_cache_layout() is None
    assert B.supports_head_size(1) and B.supports_head_size(576)
    assert B.supports_dtype(torch.float16) and B.supports_dtype(torch.bfloat16)
    assert not B.supports_dtype(torch.float32)
    assert not B.is_mla() and not B.is_sparse()
    assert not B.supports_sink() and not B.supports_mm_prefix()
    assert B.supports_compute_capability(DeviceCapability(0, 0))
    assert B.supports_combination(64, torch.bfloat16, "auto", 16, False, False, False,
                                  DeviceCapability(0, 0)) is None
    assert B.get_kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)
    with pytest.raises(NotImplementedError):
        B.get_kv_cache_stride_order()
    with pytest.raises(NotImplementedError):
        B.get_kv_cache_stride_order(include_num_layers_dimension=True)


def test_attn_type_defaults_to_decoder_only():
    assert DummyBackend.supports_attn_type(AttentionType.DECODER)
    assert DummyBackend.supports_attn_type("decoder")
    for t in ("encoder", "encoder_only", "encoder_decoder", AttentionType.ENCODER):
        assert not DummyBackend.supports_attn_type(t)


def test_abstract_backend_cannot_be_instantiated_without_methods():
    class Incomplete(AttentionBackend):
        pass

    with pytest.raises(TypeError):
        Incomplete()


def test_full_cls_name():
    assert DummyBackend.full_cls_name() == (__name__, "DummyBackend")

    class Local(DummyBackend):
        pass

    module, qualname = Local.full_cls_name()
    assert module == __name__
    assert qualname == "test_full_cls_name.<locals>.Local"


@pytest.mark.parametrize("value", ["auto", CacheDType.AUTO, None])
def test_kv_cache_dtype_default_accepts_auto_string_or_member(value):
    assert DummyBackend.supports_kv_cache_dtype(value)


@pytest.mark.parametrize("value", ["fp8", CacheDType.FP8_E4M3, "bfloat16"])
def test_kv_cache_dtype_default_rejects_quantized(value):
    assert not DummyBackend.supports_kv_cache_dtype(value)


def test_kv_cache_dtype_member_list_accepts_strings():
    assert StrictBackend.supports_kv_cache_dtype("auto")
    assert StrictBackend.supports_kv_cache_dtype("fp8")
    assert StrictBackend.supports_kv_cache_dtype(CacheDType.FP8)
    assert not StrictBackend.supports_kv_cache_dtype("fp8_e5m2")
    assert not StrictBackend.supports_kv_cache_dtype("not-a-dtype")


def test_kv_cache_dtype_empty_list_accepts_anything():
    Any_ = subclass_attention_backend_with_overrides(
        "Any", DummyBackend, {"supported_kv_cache_dtypes": []}
    )
    assert Any_.supports_kv_cache_dtype("fp8_e5m2")
    assert Any_.supports_kv_cache_dtype(CacheDType.FP8_DS_MLA)


# ------------------------------------------------------------------ block sizes


def _with_kernel_sizes(sizes):
    return subclass_attention_backend_with_overrides(
        "K", DummyBackend, {"get_supported_kernel_block_sizes": staticmethod(lambda: sizes)}
    )


def test_block_size_literal_is_what_the_default_accepts():
    assert get_args(BlockSize) == (1, 8, 16, 32, 64, 128, 256)
    for bs in (1, 8, 16, 32, 64, 128, 256):
        assert DummyBackend.supports_block_size(bs)
    # Sizes no CacheConfig takes are rejected even though MultipleOf(1) divides them.
    for bs in (0, 2, 12, 24, 40, 528):
        assert not DummyBackend.supports_block_size(bs)
    assert DummyBackend.supports_block_size(None)


def test_fixed_kernel_size_accepts_hybrid_multiples():
    B = _with_kernel_sizes([16])
    assert [bs for bs in get_args(BlockSize) if B.supports_block_size(bs)] == [16, 32, 64, 128,
                                                                              256]
    assert not B.supports_block_size(8)
    assert not B.supports_block_size(1)
    assert B.supports_block_size(48)  # not a BlockSize, but a configurable kernel size
    assert not B.supports_block_size(40)  # configurable by no one


def test_multiple_of_kernel_size():
    B = _with_kernel_sizes([MultipleOf(32)])
    assert [bs for bs in get_args(BlockSize) if B.supports_block_size(bs)] == [32, 64, 128, 256]


def test_mixed_kernel_sizes_any_one_suffices():
    B = _with_kernel_sizes([64, MultipleOf(8)])
    assert [bs for bs in get_args(BlockSize) if B.supports_block_size(bs)] == [8, 16, 32, 64,
                                                                              128, 256]


def test_empty_kernel_sizes_accept_every_block_size_literal():
    B = _with_kernel_sizes([])
    assert all(B.supports_block_size(bs) for bs in get_args(BlockSize))
    assert not B.supports_block_size(12)


def test_multiple_of_value_semantics():
    assert MultipleOf(16) == MultipleOf(16)
    assert MultipleOf(16) != MultipleOf(32)
    assert MultipleOf(16) != 16
    assert hash(MultipleOf(16)) == hash(MultipleOf(16))
    assert len({MultipleOf(16), MultipleOf(16), MultipleOf(8)}) == 2
    assert repr(MultipleOf(16)) == "MultipleOf(base=16)"
    assert MultipleOf(16).base == 16


@pytest.mark.parametrize("bad", [0, -16, 1.5, True, "16", None])
def test_multiple_of_rejects_bad_base(bad):
    with pytest.raises(ValueError, match="MultipleOf base must be an int >= 1"):
        MultipleOf(bad)


# ------------------------------------------------------------ validate_configuration


def test_validate_configuration_accepts_good_config():
    assert DummyBackend.validate_configuration(**GOOD) == []
    assert StrictBackend.validate_configuration(**GOOD) == []
    assert StrictBackend.validate_configuration(**{**GOOD, "kv_cache_dtype": None}) == []


@pytest.mark.parametrize(
    "backend, change, reason",
    [
        (StrictBackend, {"head_size": 80}, "head_size not supported"),
        (StrictBackend, {"dtype": torch.float32}, "dtype not supported"),
        (StrictBackend, {"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype not supported"),
        (StrictBackend, {"kv_cache_dtype": CacheDType.FP8_INC}, "kv_cache_dtype not supported"),
        (StrictBackend, {"block_size": 8}, "block_size not supported"),
        (StrictBackend, {"use_mm_prefix": True},
         "partial multimodal token full attention not supported"),
        (StrictBackend, {"use_mla": True}, "MLA not supported"),
        (MLASparseBackend, {"use_mla": True, "use_sparse": False}, "non-sparse not supported"),
        (MLASparseBackend, {"use_mla": False, "use_sparse": True}, "non-MLA not supported"),
        (StrictBackend, {"has_sink": True}, "sink setting not supported"),
        (StrictBackend, {"use_sparse": True}, "sparse not supported"),
        (StrictBackend, {"device_capability": DeviceCapability(7, 5)},
         "compute capability not supported"),
        (StrictBackend, {"attn_type": "encoder"}, "attention type encoder not supported"),
        (StrictBackend, {"attn_type": AttentionType.ENCODER_ONLY},
         "attention type encoder_only not supported"),
        (StrictBackend, {"head_size": 128, "dtype": torch.float16},
         "head_size 128 needs bfloat16"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_validate_configuration_single_reason(backend, change, reason):
    assert backend.validate_configuration(**{**GOOD, **change}) == [reason]


def test_validate_configuration_lists_all_reasons_in_order():
    bad = dict(
        head_size=96,
        dtype=torch.float32,
        kv_cache_dtype="fp8_e4m3",
        block_size=8,
        use_mla=True,
        has_sink=True,
        use_sparse=True,
        use_mm_prefix=True,
        device_capability=DeviceCapability(7, 0),
        attn_type="encoder_decoder",
    )
    assert StrictBackend.validate_configuration(**bad) == [
        "head_size not supported",
        "dtype not supported",
        "kv_cache_dtype not supported",
        "block_size not supported",
        "partial multimodal token full attention not supported",
        "MLA not supported",
        "sink setting not supported",
        "sparse not supported",
        "compute capability not supported",
        "attention type encoder_decoder not supported",
    ]


def test_validate_configuration_combination_reason_comes_last_and_gets_args():
    seen = []

    class Recording(StrictBackend):
        @classmethod
        def supports_combination(cls, *args):
            seen.append(args)
            return "bad combination"

    cfg = {**GOOD, "dtype": torch.float32, "has_sink": True}
    assert Recording.validate_configuration(**cfg) == [
        "dtype not supported", "sink setting not supported", "bad combination"
    ]
    assert seen == [(64, torch.float32, "auto", 16, False, True, False, DeviceCapability(9, 0))]


def test_mla_backend_accepts_mla_and_sparse():
    cfg = {**GOOD, "use_mla": True, "use_sparse": True}
    assert MLASparseBackend.validate_configuration(**cfg) == []
    assert MLASparseBackend.validate_configuration(**GOOD) == [
        "non-MLA not supported", "non-sparse not supported"
    ]


# ---------------------------------------------------------------- small helpers


@pytest.mark.parametrize("value, expected", [
    ("auto", False), (CacheDType.AUTO, False), ("fp8", True), (CacheDType.FP8_E5M2, True),
    ("bfloat16", True),
])
def test_is_quantized_kv_cache(value, expected):
    assert is_quantized_kv_cache(value) is expected


def test_is_quantized_kv_cache_rejects_unknown_name():
    with pytest.raises(ValueError, match=r"'fp9'.*'auto'"):
        is_quantized_kv_cache("fp9")


def test_attention_type_is_a_str_enum():
    assert [t.value for t in AttentionType] == [
        "decoder", "encoder", "encoder_only", "encoder_decoder"
    ]
    assert isinstance(AttentionType.DECODER, str)
    assert AttentionType.ENCODER_DECODER == "encoder_decoder"
    assert f"{AttentionType.ENCODER}" == "encoder"
    assert AttentionType.parse("encoder_only") is AttentionType.ENCODER_ONLY
    with pytest.raises(ValueError, match=r"'cross'.*'decoder'"):
        AttentionType.parse("cross")


def test_cudagraph_support_levels():
    assert [(m.name, m.value) for m in AttentionCGSupport] == [
        ("ALWAYS", 3), ("UNIFORM_BATCH", 2), ("UNIFORM_SINGLE_TOKEN_DECODE", 1), ("NEVER", 0)
    ]


def test_subclass_attention_backend():
    New = subclass_attention_backend("Prefixed", DummyBackend, OtherBuilder)
    assert New.__name__ == "PrefixedDummyBackend"
    assert issubclass(New, DummyBackend)
    assert New.get_builder_cls() is OtherBuilder
    assert DummyBackend.get_builder_cls() is DummyBuilder
    assert New.get_name() == "DUMMY"
    assert New.get_impl_cls() is DummyImpl


def test_subclass_attention_backend_with_overrides():
    New = subclass_attention_backend_with_overrides(
        "F32", DummyBackend,
        {"supported_dtypes": [torch.float32], "accept_output_buffer": True,
         "get_name": staticmethod(lambda: "F32_DUMMY")},
    )
    assert New.__name__ == "F32DummyBackend"
    assert New.supports_dtype(torch.float32) and not New.supports_dtype(torch.bfloat16)
    assert New.accept_output_buffer is True and New.get_name() == "F32_DUMMY"
    assert DummyBackend.accept_output_buffer is False and DummyBackend.get_name() == "DUMMY"
    assert New.validate_configuration(**GOOD) == ["dtype not supported"]


def test_subclass_helpers_reject_non_backends():
    with pytest.raises(TypeError, match="AttentionBackend subclass"):
        subclass_attention_backend("X", DummyBuilder, OtherBuilder)
    with pytest.raises(TypeError, match="AttentionBackend subclass"):
        subclass_attention_backend_with_overrides("X", object, {})
    with pytest.raises(TypeError, match="overrides must be a dict"):
        subclass_attention_backend_with_overrides("X", DummyBackend, [("a", 1)])


# -------------------------------------------------------- impl + parallel state


def test_impl_without_parallel_groups_is_single_rank():
    impl = LseImpl(8, 64, 0.125, num_kv_heads=2)
    assert (impl.dcp_world_size, impl.dcp_rank) == (1, 0)
    assert (impl.pcp_world_size, impl.pcp_rank) == (1, 0)
    assert (impl.total_cp_world_size, impl.total_cp_rank) == (1, 0)
    assert impl.need_to_return_lse_for_decode is False
    assert (impl.num_heads, impl.head_size, impl.scale, impl.num_kv_heads) == (8, 64, 0.125, 2)
    assert impl.fused_output_quant_supported(object()) is False
    assert impl.process_weights_after_loading(torch.bfloat16) is None


@pytest.mark.parametrize(
    "dcp, dcp_rank, pcp, pcp_rank, total_rank",
    [(4, 2, 2, 1, 6), (4, 3, 2, 0, 3), (2, 0, 3, 2, 4), (1, 0, 4, 3, 3), (8, 7, 1, 0, 7)],
)
def test_impl_reads_parallel_groups(dcp, dcp_rank, pcp, pcp_rank, total_rank):
    distributed.init_context_parallel_groups(dcp, dcp_rank, pcp, pcp_rank)
    impl = DummyImpl(8, 64, 0.125)
    assert (impl.dcp_world_size, impl.dcp_rank) == (dcp, dcp_rank)
    assert (impl.pcp_world_size, impl.pcp_rank) == (pcp, pcp_rank)
    assert impl.total_cp_world_size == dcp * pcp
    assert impl.total_cp_rank == total_rank


def test_total_cp_ranks_enumerate_the_world_once():
    ranks = []
    for p in range(3):
        for d in range(2):
            with distributed.context_parallel_groups(2, d, 3, p):
                ranks.append(DummyImpl(1, 8, 1.0).total_cp_rank)
    assert sorted(ranks) == list(range(6))


@pytest.mark.parametrize("impl_cls, dcp, expected", [
    (LseImpl, 2, True), (LseImpl, 1, False), (DummyImpl, 2, False),
])
def test_need_to_return_lse_for_decode(impl_cls, dcp, expected):
    distributed.init_context_parallel_groups(dcp_world_size=dcp, dcp_rank=dcp - 1)
    assert impl_cls(8, 64, 0.125).need_to_return_lse_for_decode is expected


def test_impl_missing_forward_is_abstract():
    class NoForward(AttentionImpl):
        def __init__(self, *a, **k):
            pass

    with pytest.raises(TypeError):
        NoForward()


def test_mla_impl_gets_cp_attributes():
    class MLA(MLAAttentionImpl):
        def __init__(self, *args, **kwargs):
            pass

        def forward(self, *args, **kwargs):
            return None

    distributed.init_context_parallel_groups(2, 1)
    impl = MLA()
    assert isinstance(impl, AttentionImpl)
    assert (impl.dcp_world_size, impl.dcp_rank, impl.total_cp_rank) == (2, 1, 1)


def test_attention_layer_protocol_is_structural():
    class Layer:
        _q_scale = _k_scale = _v_scale = _prob_scale = torch.tensor(1.0)
        _q_scale_float = _k_scale_float = _v_scale_float = 1.0

        def forward(self, query, key, value, kv_cache, attn_metadata):
            return query

    layer: AttentionLayer = Layer()  # type-checks structurally, no inheritance
    assert layer.forward(torch.ones(1), None, None, None, None).item() == 1.0


def test_parallel_group_state_lifecycle():
    assert not distributed.context_parallel_groups_initialized()
    with pytest.raises(distributed.ParallelStateNotInitializedError, match="DCP"):
        distributed.get_dcp_group()
    with pytest.raises(RuntimeError, match="PCP"):  # a RuntimeError subclass
        distributed.get_pcp_group()
    distributed.init_context_parallel_groups(dcp_world_size=2, dcp_rank=1)
    assert distributed.get_dcp_group() == distributed.ParallelGroup(2, 1)
    assert distributed.get_pcp_group() == distributed.ParallelGroup(1, 0)
    distributed.init_context_parallel_groups(2, 1)  # same layout: no-op
    with pytest.raises(RuntimeError, match="already initialised"):
        distributed.init_context_parallel_groups(4, 1)
    assert distributed.get_dcp_group().world_size == 2
    distributed.destroy_context_parallel_groups()
    assert not distributed.context_parallel_groups_initialized()
    distributed.destroy_context_parallel_groups()  # idempotent


def test_context_manager_leaves_existing_groups_alone():
    with distributed.context_parallel_groups(2, 0):
        assert distributed.get_dcp_group().world_size == 2
    assert not distributed.context_parallel_groups_initialized()
    distributed.init_context_parallel_groups(2, 0)
    with distributed.context_parallel_groups(2, 0):
        pass
    assert distributed.context_parallel_groups_initialized()


@pytest.mark.parametrize("ws, rank, exc, msg", [
    (0, 0, ValueError, "world_size must be >= 1"),
    (2, 2, ValueError, r"rank_in_group must be in \[0, 2\)"),
    (2, -1, ValueError, "rank_in_group"),
    (2.0, 0, TypeError, "world_size must be an int"),
    (True, 0, TypeError, "world_size must be an int"),
])
def test_parallel_group_validation(ws, rank, exc, msg):
    with pytest.raises(exc, match=msg):
        distributed.ParallelGroup(ws, rank)
    with pytest.raises(exc, match=msg):
        distributed.init_context_parallel_groups(pcp_world_size=ws, pcp_rank=rank)
    assert not distributed.context_parallel_groups_initialized()


# -------------------------------------------------------------------- builders


def test_builder_stores_its_inputs():
    b = make_builder()
    assert b.layer_names == ["layers.0.attn", "layers.1.attn"]
    assert b.device == torch.device("cpu")
    assert b.kv_cache_spec.block_size == 16
    assert isinstance(b.vllm_config, BuilderConfig)
    assert b.reorder_batch_threshold is None
    assert b.supports_update_block_table is False


def test_builder_rejects_wrong_inputs():
    spec = AttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="vllm_config must be a pagedattn.config.BuilderConfig"):
        DummyBuilder(spec, ["a"], {"block_size": 16}, "cpu")
    with pytest.raises(TypeError, match="kv_cache_spec must be an AttentionSpec"):
        DummyBuilder(object(), ["a"], BuilderConfig(), "cpu")
    with pytest.raises(TypeError, match="layer_names must be a list of str"):
        DummyBuilder(spec, "layers.0", BuilderConfig(), "cpu")


def test_cudagraph_support_is_per_class():
    class Uniform(DummyBuilder):
        _cudagraph_support = AttentionCGSupport.UNIFORM_BATCH

    spec = make_builder().kv_cache_spec
    assert DummyBuilder.get_cudagraph_support(BuilderConfig(), spec) is AttentionCGSupport.NEVER
    assert Uniform.get_cudagraph_support(BuilderConfig(), spec) is AttentionCGSupport.UNIFORM_BATCH


@pytest.mark.parametrize(
    "num_spec, dcp, kwargs, expected",
    [
        (None, 1, {}, 1),
        (3, 1, {}, 1),  # spec tokens ignored without spec-as-decode support
        (3, 1, {"supports_spec_as_decode": True}, 4),
        (None, 1, {"supports_spec_as_decode": True}, 1),
        (0, 1, {"supports_spec_as_decode": True}, 1),
        (3, 1, {"reorder_batch_threshold": 8, "supports_spec_as_decode": True}, 8),
        (3, 1, {"reorder_batch_threshold": None, "supports_spec_as_decode": True}, None),
        (3, 2, {"supports_spec_as_decode": True}, 1),  # DCP without varlen forces 1
        (None, 2, {"reorder_batch_threshold": None}, 1),
        (3, 2, {"supports_spec_as_decode": True, "supports_dcp_with_varlen": True}, 4),
        (None, 4, {"reorder_batch_threshold": 16, "supports_dcp_with_varlen": True}, 16),
    ],
)
def test_init_reorder_batch_threshold(num_spec, dcp, kwargs, expected):
    b = make_builder(num_spec=num_spec, dcp=dcp)
    b._init_reorder_batch_threshold(**kwargs)
    assert b.reorder_batch_threshold == expected


def test_speculative_config_without_token_count_keeps_threshold():
    spec = AttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    config = BuilderConfig(speculative_config=SpeculativeConfig(None))
    b = DummyBuilder(spec, ["l0"], config, "cpu")
    b._init_reorder_batch_threshold(2, supports_spec_as_decode=True)
    assert b.reorder_batch_threshold == 2


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_init_reorder_batch_threshold_rejects_bad_value(bad):
    with pytest.raises(ValueError, match="reorder_batch_threshold must be None or an int >= 1"):
        make_builder()._init_reorder_batch_threshold(bad)


def test_build_for_cudagraph_capture_and_drafting_call_build():
    b = make_builder()
    cam = CommonAttentionMetadata.from_lens([1, 1], [4, 9], block_size=16)
    md = b.build_for_cudagraph_capture(cam)
    assert b.calls == [(0, cam, False)]
    assert (md.common_prefix_len, md.cam, md.fast_build) == (0, cam, False)
    md = b.build_for_drafting(cam, draft_index=2)
    assert b.calls[1] == (0, cam, True)
    assert md.fast_build is True


def test_builder_default_hooks():
    b = make_builder()
    md = b.build(5, CommonAttentionMetadata.from_lens([1], [1], block_size=16))
    with pytest.raises(NotImplementedError, match="DummyBuilder does not implement"):
        b.update_block_table(md, torch.zeros(1, 1, dtype=torch.int32),
                             torch.zeros(1, dtype=torch.int64))
    assert b.use_cascade_attention(16, np.array([1, 1]), 8, 2, False, False, False, 132, 1) \
        is False
