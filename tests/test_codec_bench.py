"""The codec benchmark and the diloco-bench dispatcher, on a tiny synthetic run."""

import json

import pytest

from bench import cli


def test_dispatcher_discovers_modules_defining_add_arguments_and_run():
    commands = cli.discover()
    assert commands["codec"][0] == "bench.codec"
    assert commands["codec"][1].startswith("Codec benchmark")
    assert "common" not in commands and "cli" not in commands


def test_unknown_subcommand_exits_with_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["no-such-command"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_codec_bench_quick_synthetic_prints_json(capsys):
    argv = ["codec", "--quick", "--no-real", "--elements", "65536", "--rounds", "4"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    synth = result["datasets"]["synthetic"]
    assert synth["elements"] == 65536 and synth["accumulation_rounds"] == 4
    schemes = synth["schemes"]
    assert {"raw-fp32", "raw-bf16", "int8", "int8+stochastic", "int4"} <= set(schemes)
    assert schemes["raw-fp32"]["rel_l2_per_round"] == 0.0
    assert (
        3.5 < schemes["int8"]["ratio"] < 8 and schemes["int4"]["ratio"] > schemes["int8"]["ratio"]
    )
    int8 = schemes["int8"]
    assert int8["accumulated_rel_error_ef"] < int8["accumulated_rel_error_no_ef"]
    assert int8["encode_gbps"]["median"] > 0 and int8["encode_over_memcpy"] > 0
    topk = schemes["topk"]
    assert topk["ratio"] > 50 and topk["ratio"] > schemes["topk-nozstd"]["ratio"]
    assert topk["accumulated_rel_error_ef"] < topk["accumulated_rel_error_no_ef"]
    even = synth["zstd_break_even"]["int8"]
    assert even["bytes_saved"] > 0 and "break_even_gbit_s_end_to_end" in even
