"""One configuration: flag > environment > config file > default, for both processes."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from pagedserve import cli
from pagedserve.cli import _forward, _parser
from pagedserve.core import config

ROOT = Path(__file__).resolve().parent.parent


def parse(argv: list[str], file_values: dict | None = None, env: dict | None = None):
    return _parser(file_values or {}, env or {}).parse_args(argv)


@pytest.mark.parametrize("command", ["serve", "scheduler"])
def test_precedence_flag_over_env_over_file_over_default(command):
    assert parse([command]).max_num_seqs == 0  # 0: by device (test_step_defaults.py)
    assert parse([command], {"max_num_seqs": 64}).max_num_seqs == 64
    env = {"PAGEDSERVE_MAX_NUM_SEQS": "32"}
    assert parse([command], {"max_num_seqs": 64}, env).max_num_seqs == 32
    assert parse([command, "--max-num-seqs", "16"], {"max_num_seqs": 64}, env).max_num_seqs == 16


def test_booleans_from_each_source():
    assert parse(["scheduler"]).enable_prefix_caching is True
    assert parse(["scheduler"], {"enable_prefix_caching": False}).enable_prefix_caching is False
    env = {"PAGEDSERVE_ENABLE_PREFIX_CACHING": "no"}
    assert parse(["scheduler"], {"enable_prefix_caching": True}, env).enable_prefix_caching is False
    args = parse(["scheduler", "--enable-prefix-caching"], {}, env)
    assert args.enable_prefix_caching is True
    assert parse(["executor"], {"enforce_eager": "true"}).enforce_eager is True


def test_vllm_swap_space_is_our_swap_space_gib(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("swap-space: 2\nmax_model_len: 1024\n")
    values = config.load_file(path)
    assert values == {"swap_space_gib": 2, "max_model_len": 1024}
    assert parse(["executor"], values).swap_space_gib == 2.0
    assert parse(["executor"], values, {"PAGEDSERVE_SWAP_SPACE": "3"}).swap_space_gib == 3.0
    env = {"PAGEDSERVE_SWAP_SPACE": "3", "PAGEDSERVE_SWAP_SPACE_GIB": "5"}
    assert parse(["executor"], values, env).swap_space_gib == 5.0  # the canonical name wins
    assert parse(["executor", "--swap-space", "1"], values, env).swap_space_gib == 1.0


def test_one_file_serves_both_processes():
    values = {"max_num_seqs": 8, "block_size": 32}  # a scheduler key and an executor key
    assert parse(["scheduler"], values).max_num_seqs == 8
    assert parse(["executor"], values).block_size == 32
    args = parse(["serve"], values)
    assert (args.max_num_seqs, args.block_size) == (8, 32)


@pytest.mark.parametrize("values, env, message", [
    ({"max_num_seq": 8}, {}, "unknown keys max_num_seq"),
    ({"max_num_seqs": "many"}, {}, "config file: max_num_seqs: invalid literal"),
    ({"max_num_seqs": 0.5}, {}, "max_num_seqs"),
    ({}, {"PAGEDSERVE_BLOCK_SIZE": "x"}, "PAGEDSERVE_BLOCK_SIZE"),
    ({"preemption_mode": "never"}, {}, "preemption_mode: must be one of auto, recompute, swap"),
    ({}, {"PAGEDSERVE_ENFORCE_EAGER": "maybe"}, "PAGEDSERVE_ENFORCE_EAGER: expected true"),
    ({"long_prefill_decode_share": -0.5}, {},
     "config file: long_prefill_decode_share: expected a number >= 0, got -0.5"),
])
def test_bad_values_name_their_source(values, env, message):
    with pytest.raises(config.ConfigError, match=message):
        parse(["serve"], values, env)


def test_main_reads_config_from_flag_or_env(tmp_path, monkeypatch, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("max_num_seqs: [1, 2]\n")
    assert config.config_path(["scheduler", "--config", str(path)], {}) == str(path)
    assert config.config_path(["scheduler"], {"PAGEDSERVE_CONFIG": "x.yaml"}) == "x.yaml"
    assert cli.main(["scheduler", "--config", str(path)]) == 2
    assert "max_num_seqs" in capsys.readouterr().err
    path.write_text("- a list\n")
    with pytest.raises(config.ConfigError, match="expected a mapping"):
        config.load_file(path)


def test_the_example_file_is_valid_and_complete():
    values = config.load_file(ROOT / "pagedserve.example.yaml")
    args = parse(["serve"], values)  # no unknown keys, every value converts
    vllm = {"gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
            "block_size", "enforce_eager", "quantization", "swap_space_gib",
            "enable_prefix_caching"}
    assert vllm <= set(values)
    assert args.metrics_port == 8000


@pytest.mark.parametrize("command", ["serve", "scheduler", "executor"])
def test_every_flag_explains_itself_and_names_its_env_var(command):
    parser = _parser({}, {})
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for action in sub.choices[command]._actions:
        if action.dest in ("help", "config"):
            continue
        assert action.help and f"[env PAGEDSERVE_{action.dest.upper()}]" in action.help, \
            action.dest


def test_serve_forwards_the_resolved_values_to_each_process():
    from pagedserve.executor import flags as executor
    from pagedserve.scheduler import flags as scheduler

    args = parse(["serve", "--max-num-seqs", "7"], {"swap_space": 2, "enforce_eager": True},
                 {"PAGEDSERVE_DRAIN_TIMEOUT_S": "5"})
    sched = parse(["scheduler", *_forward(scheduler.add_args, args)])
    execu = parse(["executor", *_forward(executor.add_args, args)])
    assert (sched.max_num_seqs, sched.drain_timeout_s) == (7, 5.0)
    assert (execu.swap_space_gib, execu.enforce_eager) == (2.0, True)


def test_lora_modules_come_as_a_list_from_each_source_and_reach_both_processes():
    from pagedserve.executor import flags as executor
    from pagedserve.scheduler import flags as scheduler

    from_file = parse(["serve"], {"enable_lora": True, "lora_modules": ["a=/x", "b=/y"]})
    from_env = parse(["serve"], {}, {"PAGEDSERVE_LORA_MODULES": "a=/x b=/y"})
    assert from_file.lora_modules == from_env.lora_modules == ["a=/x", "b=/y"]
    for add_args, command in ((scheduler.add_args, "scheduler"),
                              (executor.add_args, "executor")):
        args = parse([command, *_forward(add_args, from_file)])
        assert (args.enable_lora, args.lora_modules) == (True, ["a=/x", "b=/y"])
    assert "--lora-modules" not in _forward(executor.add_args, parse(["serve"]))


@pytest.mark.parametrize("argv, message", [
    (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "a"], "expected NAME=PATH, got 'a'"),
    (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "a named more than once"),
    (["--enable-lora", "--max-loras", "0"], "--max-loras must be at least 1"),
    (["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"],
     "--max-cpu-loras 1 is less than --max-loras 2"),
])
def test_contradictory_lora_flags_are_one_line(argv, message):
    from pagedserve.core.lora import lora_config

    with pytest.raises(ValueError, match=message):
        lora_config(parse(["serve", *argv]))


def test_api_server_count_is_auto_or_a_count_from_each_source(tmp_path, capsys):
    assert parse(["serve"]).api_server_count == "auto"
    assert parse(["serve"], {"api_server_count": 0}).api_server_count == 0
    assert parse(["serve"], {}, {"PAGEDSERVE_API_SERVER_COUNT": "AUTO"}).api_server_count == "auto"
    assert parse(["serve", "--api-server-count", "3"]).api_server_count == 3
    with pytest.raises(config.ConfigError, match="PAGEDSERVE_API_SERVER_COUNT: expected auto "
                       "or a count >= 0, got -1"):
        parse(["serve"], {}, {"PAGEDSERVE_API_SERVER_COUNT": "-1"})
    with pytest.raises(SystemExit):
        parse(["serve", "--api-server-count", "two"])
    assert "--api-server-count: expected auto or a count, got 'two'" in capsys.readouterr().err


def test_auto_api_server_count_follows_the_usable_cores(tmp_path, monkeypatch):
    from pagedserve.scheduler import flags

    assert [flags.auto_api_server_count(c) for c in (1, 2, 7.5, 8, 16, 24, 32, 128)] == [
        1, 1, 1, 1, 2, 3, 4, 4]
    affinity = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("max 100000\n")
    assert flags.usable_cores(cpu_max) == affinity
    cpu_max.write_text("150000 100000\n")  # a quota of 1.5 CPUs
    assert flags.usable_cores(cpu_max) == min(affinity, 1.5)
    assert flags.usable_cores(tmp_path / "absent") == affinity
    # 16 cores would give 2, but each API process would count a tenant's quota on its own
    monkeypatch.setattr(flags, "usable_cores", lambda: 16.0)
    args = parse(["serve"])
    assert cli._auto_api_servers(args) == 2
    keys = tmp_path / "keys.yaml"
    keys.write_text("tenants:\n  free: {priority: [0, 2], max_concurrent: 4}\n"
                    "keys:\n  - {key: sk-1, tenant: free}\n")
    assert cli._auto_api_servers(parse(["serve", "--api-keys", str(keys)])) == 1
    keys.write_text("tenants:\n  open: {priority: [0, 0]}\nkeys:\n  - {key: sk-1, tenant: open}\n")
    assert cli._auto_api_servers(parse(["serve", "--api-keys", str(keys)])) == 2
