"""check_context_parallel.py on CPU: torch's ring attention has no CPU path, and the check says where torch stops —
so the day a torch release runs it here, this test fails and the CPU row of docs/context_parallel.md is due."""

from parity.commands.context_parallel import main


def test_context_parallelism_does_not_run_on_cpu_and_says_why(capsys):
    code = main(["--device", "cpu", "--cp_size", "2", "--seq_length", "64"])
    out = capsys.readouterr().out
    assert code == 1
    (line,) = out.strip().splitlines()
    assert line.startswith("context parallelism failed on 2 CPU processes (gloo): NotImplementedError: Operator "
                           "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy "
                           "registered. (torch/distributed/tensor/_sharding_prop.py:"), line
