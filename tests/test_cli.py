"""The `pagedattn` command line."""

import subprocess
import sys

from pagedattn.cli import main


def test_info_prints_versions_isa_and_backends(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("pagedattn ")
    assert "torch     2." in out
    assert "CPU ISA" in out
    assert "CPU_ATTN" in out and "usable" in out


def test_info_reports_why_a_backend_is_not_usable(capsys):
    assert main(["info", "--head-size", "36"]) == 0
    assert "CPU_ATTN           not usable: head_size not supported" in capsys.readouterr().out


def test_module_entry_point_and_argument_errors():
    ok = subprocess.run([sys.executable, "-m", "pagedattn", "info"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run([sys.executable, "-m", "pagedattn", "info", "--dtype", "int8"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "invalid choice: 'int8'" in bad.stderr


def test_info_lists_the_gpu_backends_with_their_reasons(capsys):
    assert main(["info", "--dtype", "float16", "--head-size", "64"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "device type cpu not supported (needs cuda)" in lines["XFORMERS_VLLM_V1"]
    if not __import__("torch").cuda.is_available():
        assert "TRITON_INTERPRET=1" in lines["TRITON_ATTN"]


def test_serve_admits_shortest_first_in_small_steps_and_offline_keeps_fcfs():
    from pagedattn.cli import build_parser
    from pagedattn.engine.cli import engine_args

    served = engine_args(build_parser().parse_args(["serve"]))
    assert (served.scheduling_policy, served.max_num_batched_tokens) == ("shortest_first", 512)
    offline = engine_args(build_parser().parse_args(["generate", "--prompt", "x"]))
    assert (offline.scheduling_policy, offline.max_num_batched_tokens) == ("fcfs", 2048)
    told = engine_args(build_parser().parse_args(
        ["serve", "--scheduling-policy", "fcfs", "--max-num-batched-tokens", "2048"]))
    assert (told.scheduling_policy, told.max_num_batched_tokens) == ("fcfs", 2048)
