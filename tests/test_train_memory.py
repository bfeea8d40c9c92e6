"""A model the node's memory cannot hold is refused before anything is allocated: one line, exit 2."""

from __future__ import annotations

import pytest

from zb.config import load_config
from zb.errors import InvalidInput
from zb.testing.procs import zb_process
from zb.train.memory import check_memory, needs

GB = 10**9


def cfg(*flags: str):
    return load_config([], dict(zip([f[2:] for f in flags[::2]], flags[1::2])), environ={})


def test_the_bound_counts_state_per_gpu_and_outer_state_on_the_host():
    plain, diloco = cfg(), cfg("--diloco.inner_steps", "5")
    assert needs(plain, 10**9, 4, "cuda") == (4 * GB, 0)                  # 16 bytes / param over 4 GPUs
    assert needs(diloco, 10**9, 4, "cuda") == (4 * GB, 12 * GB)           # + outer state on the host
    assert needs(diloco, 10**9, 2, "cpu") == (0, 28 * GB)                 # the ranks share the host's RAM
    offload = cfg("--train.fsdp_cpu_offload", "true")
    assert needs(offload, 10**9, 8, "cuda") == (0, 16 * GB)


def test_refusals_name_the_model_the_numbers_and_what_to_do():
    with pytest.raises(InvalidInput, match=r"need at least 4.0 GB per GPU .* this GPU has 3.0 GB: use more local ranks"):
        check_memory(cfg(), 10**9, 4, "cuda", 3 * GB, 100 * GB)
    with pytest.raises(InvalidInput, match=r"28.0 GB of this machine's memory .*DiLoCo outer state\), and it has 16.0 GB"):
        check_memory(cfg("--diloco.inner_steps", "5"), 10**9, 2, "cpu", None, 16 * GB)
    check_memory(cfg(), 10**9, 4, "cuda", 5 * GB, 100 * GB)               # fits: no error
    check_memory(cfg(), 10**12, 1, "cpu", None, None)                     # unknown totals: no guess


def test_a_model_too_big_for_this_machine_exits_2_before_allocating():
    # 405B: 6.5 TB of state at the very least, more than any machine this runs on
    out = zb_process("train", "--model.type", "llama3", "--model.name", "405B", "--data.fake", "true", timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model.name = '405B'" in errors[0] and "of this machine's memory" in errors[0]
    assert "Traceback" not in out.stderr
