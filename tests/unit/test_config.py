"""services/config.py: strict typed config, plain-words errors, DFLASH_* environment overrides,
their precedence (flags > environment > YAML file > defaults), and the CLI flags generated from it."""

from __future__ import annotations

import os
import pickle

import pytest
import yaml

from dflash_serve.services.cli import build_parser
from dflash_serve.services.cli.flags import given_config_flags
from dflash_serve.services.cli.serve import _serve_config
from dflash_serve.services.config import EngineConfig, ServeConfig

BASE = {"engine": {"target": "t", "drafter": "d"}}


@pytest.fixture(autouse=True)
def no_dflash_environment(monkeypatch):
    """Whatever the shell running the tests has set must not leak in."""
    for name in list(os.environ):
        if name.upper().startswith("DFLASH_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(("raw", "says"), [
    ({"engine": {"target": "t", "max_num_seq": 8}},
     ["unknown config key(s) engine.max_num_seq; known: engine.async_scheduling,", "engine.max_num_seqs"]),
    ({**BASE, "topolgy": "split"}, ["unknown config key(s) topolgy; known: api_keys_file,", "topology"]),
    ({**BASE, "topology": "pipeline"}, ["topology='pipeline': choose one of split, colocated"]),
    ({**BASE, "num_replicas": "two"}, ["num_replicas='two': must be a valid integer"]),
    ({**BASE, "max_pending": 0}, ["max_pending=0: must be positive"]),
    ({"engine": {"target": "t", "max_num_seqs": "64"}}, ["engine.max_num_seqs='64': must be a valid integer"]),
    ({"engine": {"target": "t", "cuda_graphs": "no"}}, ["engine.cuda_graphs='no': must be a valid boolean"]),
    ({"engine": {"target": "t", "kv_block_size": 24}}, ["engine.kv_block_size=24: must be a positive power of two"]),
    ({"engine": {"target": "t", "kv_memory_fraction": 0}}, ["engine.kv_memory_fraction=0: must be positive"]),
    ({"engine": {"target": ""}}, ["engine.target='': empty: name a target model folder or hub repo id"]),
    ({"engine": {"target": "t"}}, ["topology=split needs engine.drafter"]),
    ({**BASE, "num_replicas": 3, "max_replicas": 2}, ["max_replicas=2 is below num_replicas=3"]),
    ({"engine": {"target": "t", "device": "cuda"}, "topology": "colocated", "verifier_num_gpus": 0},
     ["engine.device=cuda needs verifier_num_gpus > 0"]),
    ({"engine": {"target": "t", "tensor_parallel_size": 0}}, ["engine.tensor_parallel_size=0: must be positive"]),
    ({"engine": {"target": "t", "tensor_parallel_size": 2, "target_impl": "transformers"}},
     ["tensor_parallel_size=2 shards the fused target forward: set target_impl to auto or fused"]),
    ({"engine": {"target": "t", "tensor_parallel_size": 2, "deterministic": True}},
     ["deterministic=true with tensor_parallel_size=2: the all-reduce's summation order depends on the batch size"]),
])
def test_a_bad_config_is_refused_naming_the_key_and_the_reason(raw, says):
    with pytest.raises(ValueError) as raised:
        ServeConfig.from_dict(raw)
    assert type(raised.value) is ValueError  # plain words, not pydantic's ValidationError dump
    for words in says:
        assert words in str(raised.value)


def test_every_error_is_reported_at_once():
    with pytest.raises(ValueError) as raised:
        ServeConfig.from_dict({"engine": {"target": "t", "max_num_seq": 1, "dtype": 3}, "colour": "red"})
    message = str(raised.value)
    assert "unknown config key(s) colour;" in message and "unknown config key(s) engine.max_num_seq;" in message
    assert "engine.dtype=3: must be a valid string" in message


def test_constructing_in_code_is_checked_as_strictly():
    with pytest.raises(ValueError, match="target_impl='fast': choose one of auto, fused, transformers"):
        EngineConfig(target="t", target_impl="fast")
    with pytest.raises(ValueError, match="unknown config key"):
        EngineConfig(target="t", max_num_seq=3)


def test_configs_are_frozen_and_survive_a_dict_and_a_pickle():
    config = ServeConfig.from_dict({**BASE, "max_pending": 40, "engine": {**BASE["engine"], "max_num_seqs": 8}})
    with pytest.raises(ValueError):
        config.max_pending = 3
    assert ServeConfig.from_dict(config.to_dict()) == config  # what build_app hands the deployments
    assert pickle.loads(pickle.dumps(config)) == config  # what Ray does with it
    assert EngineConfig.from_dict({"target": "t", "kv_memory_fraction": 1}).kv_memory_fraction == 1.0  # int is a number


def test_the_environment_is_read_only_by_the_loading_path(monkeypatch):
    monkeypatch.setenv("DFLASH_ENGINE__MAX_NUM_SEQS", "64")
    assert ServeConfig.from_dict(BASE).engine.max_num_seqs == 32  # what deployments and tests do
    assert EngineConfig(target="t").max_num_seqs == 32
    assert ServeConfig.load(BASE).engine.max_num_seqs == 64  # dflash serve, serveConfigV2's app_from_config
    assert EngineConfig.load({"target": "t"}).max_num_seqs == 64  # dflash generate / bench


def test_environment_values_are_parsed_and_checked(monkeypatch):
    monkeypatch.setenv("DFLASH_ENGINE__CUDA_GRAPHS", "false")
    monkeypatch.setenv("dflash_engine__kv_memory_fraction", "0.5")  # names are case-insensitive
    monkeypatch.setenv("DFLASH_ENGINE__DRAFTER", "null")
    monkeypatch.setenv("DFLASH_TOPOLOGY", "colocated")
    monkeypatch.setenv("DFLASH_API_KEY", "not a config key")  # other DFLASH_ variables are left alone
    config = ServeConfig.load(BASE)
    assert (config.engine.cuda_graphs, config.engine.kv_memory_fraction, config.engine.drafter, config.topology) == \
        (False, 0.5, None, "colocated")
    assert config.engine.target == "t"  # nested keys merge: the rest of engine stays the file's

    monkeypatch.setenv("DFLASH_ENGINE__MAX_NUM_SEQS", "lots")
    with pytest.raises(ValueError, match="engine.max_num_seqs='lots': must be a valid integer"):
        ServeConfig.load(BASE)
    monkeypatch.setenv("DFLASH_ENGINE__MAX_NUM_SEQ", "8")
    with pytest.raises(ValueError, match=r"unknown config key\(s\) engine.max_num_seq;"):
        ServeConfig.load(BASE)


def test_flags_beat_the_environment_which_beats_the_file_which_beats_the_defaults(tmp_path, monkeypatch):
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({**BASE, "max_pending": 100, "default_max_tokens": 100,
                                    "engine": {**BASE["engine"], "max_num_seqs": 8, "max_prefill_tokens": 512,
                                               "num_kv_blocks": 64}}))
    monkeypatch.setenv("DFLASH_MAX_PENDING", "200")
    monkeypatch.setenv("DFLASH_ENGINE__MAX_NUM_SEQS", "16")
    monkeypatch.setenv("DFLASH_ENGINE__MAX_PREFILL_TOKENS", "1024")
    args = build_parser().parse_args(["serve", "--config", str(path), "--max-num-seqs", "24", "--no-cuda-graphs"])
    config = _serve_config(args)
    engine = config.engine
    assert engine.max_num_seqs == 24  # flag over environment over file
    assert engine.max_prefill_tokens == 1024 and config.max_pending == 200  # environment over file
    assert engine.num_kv_blocks == 64 and config.default_max_tokens == 100  # file over defaults
    assert engine.cuda_graphs is False and engine.max_model_len == 0  # a flag; a default
    assert engine.device == "cpu"  # with --config, the file's or the config's default, as before


def test_a_config_file_error_names_the_file(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("engine: {target: t, max_num_seq: 8}\n")
    with pytest.raises(ValueError, match=rf"{path}: unknown config key\(s\) engine.max_num_seq"):
        ServeConfig.from_yaml(str(path))
    path.write_text("- a list\n")
    with pytest.raises(ValueError, match=rf"{path}: expected a mapping at the top level"):
        ServeConfig.from_yaml(str(path))


@pytest.mark.parametrize("command", ["serve", "generate", "bench"])
def test_every_engine_field_is_a_flag_whose_help_shows_its_description_and_default(command):
    sub = build_parser()._subparsers._group_actions[0].choices[command]
    flags = {option: action for action in sub._actions for option in action.option_strings}
    text = sub.format_help()
    for name, field in EngineConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        assert flag in flags, flag
        if name not in ("target", "drafter", "device") and not (command == "bench" and name == "max_num_seqs"):
            first_words = " ".join(field.description.split()[:3])
            assert first_words in " ".join(text.split()), (flag, first_words)
            default = field.get_default(call_default_factory=True)
            assert f"(default: {default!r})" in " ".join(text.split()), flag
    assert "--no-cuda-graphs" in flags and "--no-enable-prefix-caching" in flags
    if command == "serve":
        for name in ServeConfig.model_fields:
            assert "--" + name.replace("_", "-") in flags or name == "engine"


def test_generated_flags_parse_to_typed_values_and_old_names_still_work():
    parse = build_parser().parse_args
    args = parse(["generate", "--prompt", "x", "--max-num-seqs", "4", "--kv-memory-fraction", "0.5",
                  "--target-impl", "fused", "--eager", "--sync-rounds", "--drafter", "none"])
    assert given_config_flags(args, EngineConfig) == {"drafter": None, "kv_memory_fraction": 0.5, "max_num_seqs": 4,
                                                      "cuda_graphs": False, "target_impl": "fused",
                                                      "async_scheduling": False}
    assert given_config_flags(parse(["generate", "--prompt", "x"]), EngineConfig) == {}  # left out: not given
    assert given_config_flags(parse(["generate", "--prompt", "x", "--cuda-graphs"]), EngineConfig) == \
        {"cuda_graphs": True}
    with pytest.raises(SystemExit):
        parse(["generate", "--prompt", "x", "--target-impl", "fast"])


def test_tensor_parallel_size_is_a_flag_and_an_environment_key(monkeypatch):
    args = build_parser().parse_args(["generate", "--prompt", "x", "--tensor-parallel-size", "2"])
    assert given_config_flags(args, EngineConfig) == {"tensor_parallel_size": 2}
    monkeypatch.setenv("DFLASH_ENGINE__TENSOR_PARALLEL_SIZE", "4")
    assert ServeConfig.load(BASE).engine.tensor_parallel_size == 4
    assert EngineConfig(target="t").tensor_parallel_size == 1


@pytest.mark.parametrize("value", ["{1: 15, 8: 7, 32: 0}", '{"1": 15, "8": 7, "32": 0}'])
def test_a_mapping_flag_parses_as_its_help_writes_it(value):
    """`--num-speculative-tokens-per-batch-size {1: 15, 8: 7, 32: 0}`, the help's own example
    (JSON too), reaches the config as its table; anything but a mapping is refused by argparse."""
    args = build_parser().parse_args(["generate", "--prompt", "x", "--num-speculative-tokens-per-batch-size", value])
    flags = given_config_flags(args, EngineConfig)
    assert EngineConfig(target="t", **flags).num_speculative_tokens_per_batch_size == {1: 15, 8: 7, 32: 0}


@pytest.mark.parametrize("value", ["1:15", "[1, 15]", "{1: 15"])
def test_a_mapping_flag_refuses_what_is_not_a_mapping(value, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--num-speculative-tokens-per-batch-size", value])
    assert "expected a mapping such as {1: 15, 8: 7, 32: 0}" in capsys.readouterr().err


def test_bench_refuses_engine_flags_for_a_server(capsys):
    from dflash_serve.services.cli import main

    assert main(["bench", "--backend", "grpc", "--max-num-seqs", "4", "--device", "cpu"]) == 2
    assert "--device, --max-num-seqs: the engine's flags go with --backend embedded" in capsys.readouterr().err


def test_serve_config_v2_args_take_the_environment_and_the_replicas_get_it_resolved(monkeypatch):
    """Kubernetes: the chart's pods.extraEnv reaches app_from_config, which builds the application."""
    from dflash_serve.services.app import app_from_config

    monkeypatch.setenv("DFLASH_ENGINE__MAX_NUM_SEQS", "48")
    router = app_from_config(BASE)._bound_deployment  # Ray 2.60's Application (ray is pinned)
    verifier = router.init_args[0]._bound_deployment
    assert verifier.init_args[0]["engine"]["max_num_seqs"] == 48 == router.init_args[1]["engine"]["max_num_seqs"]
