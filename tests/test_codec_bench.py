"""The codec benchmark and the diloco-bench dispatcher, on a tiny synthetic run."""

import importlib
import json

import pytest

from bench import cli


def test_dispatcher_table_names_modules_that_define_add_arguments_and_run():
    assert cli.COMMANDS["codec"] == (
        "bench.codec",
        "Codec benchmark: ratio, error, error feedback and throughput of every scheme.",
    )
    for name, (module_name, summary) in cli.COMMANDS.items():
        module = importlib.import_module(module_name)
        assert callable(module.add_arguments) and callable(module.run), name
        assert summary, name


def test_help_lists_every_subcommand_and_the_hyphenated_aliases_run(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert name in out
    assert "island-memory" in out
    for spelling in ("island-memory", "island_memory"):
        args = cli.build_parser([spelling, "--help"])
        with pytest.raises(SystemExit) as exc:
            args.parse_args([spelling, "--help"])
        assert exc.value.code == 0
        assert "--devices" in capsys.readouterr().out


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
