"""Plugin wiring: the entry point, vLLM's plugin loader, idempotence, the off switch, and
the hand-back of what pagedattn cannot serve to vLLM's own implementation."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment; the vLLM "
                    "plugin tests run in .venv-vllm (make vllm-test)")

import torch  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import (  # noqa: E402
    CPUAttentionBackend,
    CPUAttentionMetadata,
)
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from conftest import make_vllm_config  # noqa: E402
from pagedattn import paging  # noqa: E402
from pagedattn.integrations import vllm as plugin  # noqa: E402
from pagedattn.integrations.vllm.backend import PagedAttnCPUBackend  # noqa: E402
from pagedattn.testing import BATCH_SPECS, make_paged_batch  # noqa: E402

ANNOUNCEMENT = "now runs on pagedattn"

# Loads plugins the way each vLLM process does, twice (idempotence), then reports.
_LOAD_SCRIPT = """
import vllm.plugins
from vllm.v1.attention.backends.registry import AttentionBackendEnum
vllm.plugins.load_general_plugins()
from pagedattn.integrations.vllm import register
register()
print("CPU_ATTN ->", AttentionBackendEnum.CPU_ATTN.get_path())
"""


def _load_plugins(pagedattn_vllm: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    env.pop(plugin.ENV_VAR, None)
    if pagedattn_vllm is not None:
        env[plugin.ENV_VAR] = pagedattn_vllm
    return subprocess.run([sys.executable, "-c", _LOAD_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)


def test_entry_point_in_package_metadata():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.name == "pagedattn"]
    assert [ep.value for ep in ours] == ["pagedattn.integrations.vllm:register"]
    assert ours[0].load() is plugin.register


def test_vllm_loads_the_plugin_once_per_process_and_it_can_be_switched_off():
    on = _load_plugins(None)
    assert on.returncode == 0, on.stderr
    assert f"CPU_ATTN -> {plugin.BACKEND_PATH}" in on.stdout
    assert (on.stdout + on.stderr).count(ANNOUNCEMENT) == 1, on.stdout + on.stderr

    off = _load_plugins("0")
    assert off.returncode == 0, off.stderr
    assert "CPU_ATTN -> vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend" in off.stdout
    assert ANNOUNCEMENT not in off.stdout + off.stderr


@pytest.mark.parametrize("value,expected", [("1", True), ("", True), ("0", False),
                                            ("false", False), ("OFF", False), ("no", False)])
def test_enabled_reads_the_env_var(monkeypatch, value, expected):
    monkeypatch.setenv(plugin.ENV_VAR, value)
    assert plugin.enabled() is expected


def _one_step(backend, cfg, head_size: int, block_size: int):
    """One decoder step (decodes + prefills) through ``backend``; returns the metadata and
    the output."""
    dtype = cfg.model_config.dtype
    num_heads, num_kv_heads = 2, 1
    spec = BATCH_SPECS["mixed"]
    pb = make_paged_batch(spec, num_heads=num_heads, num_kv_heads=num_kv_heads,
                          head_size=head_size, block_size=block_size, dtype=dtype, seed=3)
    with set_current_vllm_config(cfg):
        impl = backend.get_impl_cls()(num_heads, head_size, head_size ** -0.5, num_kv_heads,
                                      None, None, "auto")
        builder = backend.get_builder_cls()(
            FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads,
                              head_size=head_size, dtype=dtype), [], cfg, torch.device("cpu"))
    layer = SimpleNamespace(isa=builder.isa, _k_scale_float=1.0, _v_scale_float=1.0)
    kv_cache = torch.zeros(int(pb.block_table.max()) + 1, num_kv_heads, block_size,
                           2 * head_size, dtype=dtype)
    slots = paging.slot_mapping_for_new_tokens(pb.block_table, spec.seq_lens, spec.seq_lens,
                                               block_size)
    impl.do_kv_cache_update(layer, torch.cat(pb.keys), torch.cat(pb.values), kv_cache, slots)
    qsl = pb.query_start_loc
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=pb.seq_lens,
        num_reqs=len(spec.seq_lens), num_actual_tokens=int(qsl[-1]),
        max_query_len=max(spec.query_lens), max_seq_len=max(spec.seq_lens),
        block_table_tensor=pb.block_table, slot_mapping=pb.slot_mapping)
    metadata = builder.build(0, common)
    output = torch.zeros_like(pb.query)
    impl.forward(layer, pb.query, pb.new_keys, pb.new_values, kv_cache, metadata, output)
    return metadata, output


@pytest.mark.parametrize("head_size,block_size", [(512, 32), (64, 512)])
def test_sizes_beyond_vllms_old_limits_run_on_pagedattn_and_agree_with_vllm(tmp_path,
                                                                         head_size, block_size):
    # pagedattn's kernels take every head size vLLM's CPU backend takes (and more, up to
    # 512) and block sizes up to 512, so these groups are no longer handed back: they run
    # on pagedattn and agree with vLLM's own kernels within fp32 rounding.
    cfg = make_vllm_config(tmp_path, "float32", block_size, num_heads=2, num_kv_heads=1,
                           head_size=head_size)
    metadata, ours = _one_step(PagedAttnCPUBackend, cfg, head_size, block_size)
    assert not isinstance(metadata, CPUAttentionMetadata)  # pagedattn's plan
    _, theirs = _one_step(CPUAttentionBackend, cfg, head_size, block_size)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
