"""vLLM settings pagedserve takes without a setting of its own (engine/vllm_compat.py): a `vllm serve` command line
parses, each ignored flag is named in the log with why, and a refused one fails before anything loads."""

from __future__ import annotations

import argparse
import re
import shlex

import pytest

from pagedserve.cli import serve
from pagedserve.engine import vllm_compat
from pagedserve.engine.arg_utils import EngineArgs, RequestLimits
from pagedserve.entrypoints.openai.options import ServeOptions

VLLM_COMMAND = ("serve Qwen/Qwen2.5-0.5B-Instruct --host 0.0.0.0 --port 8001 --dtype bfloat16 --max-model-len 4096 "
                "--gpu-memory-utilization 0.9 --trust-remote-code --disable-log-requests --swap-space 4 "
                "--enable-prefix-caching --max-num-seqs 64 -tp 1 -pp 1 --served-model-name qwen -O3 "
                "--enable-auto-tool-choice --tool-call-parser hermes --distributed-executor-backend mp")


def parse(command: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    return parser.parse_args(shlex.split(command))


def test_a_vllm_serve_command_line_parses_and_each_ignored_flag_is_explained():
    args = parse(VLLM_COMMAND)
    engine = EngineArgs.from_cli_args(args)
    assert (engine.model, engine.dtype, engine.max_model_len, engine.max_num_seqs) == (
        "Qwen/Qwen2.5-0.5B-Instruct", "bfloat16", 4096, 64)
    options = ServeOptions.from_cli_args(args, limits=RequestLimits.from_cli_args(args))
    assert (options.port, options.active_tool_call_parser) == (8001, "hermes")
    notes = vllm_compat.check(vars(args))
    assert [note.split(" has no effect: ")[0] for note in notes] == [
        "--trust-remote-code", "--disable-log-requests", "--swap-space 4", "--compilation-config 3"]
    assert "KV cache is recomputed" in notes[2]
    assert vllm_compat.check(vars(parse("serve"))) == []  # nothing given, nothing said


@pytest.mark.parametrize("flags,message", [
    ("-pp 2", "--pipeline-parallel-size 2: pipeline parallelism is not supported: split a model with "
              "--tensor-parallel-size N (accepted: 1)"),
    ("--data-parallel-size 4", "--replicas N (Ray Serve)"),
    ("--tokenizer-mode mistral", "accepted: auto, hf"),
    ("--lora-modules sql=/adapters/sql", "--lora-modules sql=/adapters/sql: LoRA adapters are not supported"),
    ("--enable-lora", "merge_and_unload"),
    ("--revision v2", "huggingface-cli download MODEL --revision R --local-dir DIR"),
])
def test_a_refused_setting_names_the_flag_and_what_to_do(flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        vllm_compat.check(vars(parse(f"serve m {flags}")))


def test_accepted_values_that_contradict_the_command_line_are_refused(tmp_path):
    """Each was taken silently: one process for two ranks; a format the model's files are not."""
    with pytest.raises(ValueError, match="uni runs the model in one process"):
        vllm_compat.check(vars(parse("serve m --distributed-executor-backend uni -tp 2")))
    with pytest.raises(ValueError, match="the model smollm2-135m-instruct is gguf"):
        vllm_compat.check(vars(parse("serve smollm2-135m-instruct --load-format safetensors")))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="is safetensors"):
        vllm_compat.split_keywords({"load_format": "gguf"}, str(tmp_path))  # LLM(folder, load_format="gguf")
    other = tmp_path / "holds-a-gguf"  # not told "safetensors" (it is refused as a model, naming the file, later)
    other.mkdir()
    (other / "x.gguf").write_bytes(b"")
    assert vllm_compat.split_keywords({"load_format": "gguf"}, str(other)) is not None
    assert vllm_compat.check(vars(parse("serve smollm2-135m-instruct --load-format gguf -tp 1 "
                                        "--distributed-executor-backend uni"))) == []


def test_only_values_compare_case_insensitively_and_accept_numbers():
    assert vllm_compat.check({"pipeline_parallel_size": 1, "scheduling_policy": "FCFS", "load_format": "GGUF"}) == []


def test_llm_keywords_take_the_same_table():
    kwargs, notes = vllm_compat.split_keywords({"model": "m", "trust_remote_code": True, "swap_space": 4,
                                                "max_model_len": 512})
    assert kwargs == {"model": "m", "max_model_len": 512}
    assert notes[0].startswith("trust_remote_code=True has no effect") and notes[1].startswith("swap_space=4 ")
    with pytest.raises(ValueError, match="pipeline_parallel_size=2: pipeline parallelism is not supported"):
        vllm_compat.split_keywords({"pipeline_parallel_size": 2})


def test_the_table_never_shadows_a_setting_of_pagedserve():
    """A vLLM flag pagedserve implements is its own setting, never in the table (and no flag is listed twice)."""
    import dataclasses

    from pagedserve.entrypoints.ray_serve.args import ReplicaArgs

    own = {f.name for cls in (EngineArgs, ServeOptions, RequestLimits, ReplicaArgs) for f in dataclasses.fields(cls)}
    names = [setting.name for setting in vllm_compat.COMPAT_SETTINGS]
    assert len(names) == len(set(names)) and not own & set(names)


def test_reasoning_parser_is_the_server_s_flag_and_llm_s_keyword():
    args = parse("serve m --reasoning-parser qwen3")
    assert args.reasoning_parser == "qwen3" and vllm_compat.check(vars(args)) == []
    with pytest.raises(SystemExit):
        parse("serve m --reasoning-parser granite")  # a parser pagedserve has not: argparse's choices


# ---- vLLM's command-line forms (cli/argv.py, arg_utils.human_readable_int) --------------------------------
def _usage_error(capsys, call, message: str) -> None:
    """`call` exits as argparse does on a usage error: status 2, the message on stderr."""
    with pytest.raises(SystemExit) as info:
        call()
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_flags_with_underscores_and_a_yaml_config_file_read_as_vllm_reads_them(tmp_path, capsys):
    from pagedserve.cli.argv import normalize

    assert normalize(["serve", "m", "--max_model_len=512", "--max_num_seqs", "4"]) == [
        "serve", "m", "--max-model-len=512", "--max-num-seqs", "4"]
    config = tmp_path / "serve.yaml"
    config.write_text("model: smollm2-135m-instruct\nmax_model_len: 2048\nenable_prefix_caching: false\n"
                      "served_model_name: [a, b]\nstructured_outputs_config: {backend: xgrammar}\nport: 9000\n")
    argv = normalize(["serve", "--config", str(config), "--port", "8001"])
    args = parse(shlex.join(argv))
    engine = EngineArgs.from_cli_args(args)
    assert (engine.model, engine.max_model_len, engine.enable_prefix_caching) == ("smollm2-135m-instruct", 2048, False)
    assert engine.served_model_name == ["a", "b"] and args.port == 8001  # the command line wins
    assert '"backend": "xgrammar"' in argv[argv.index("--structured-outputs-config") + 1]
    assert EngineArgs.from_cli_args(parse(shlex.join(normalize(["serve", "other", f"--config={config}"])))).model == (
        "other")
    config.write_text("- just a list\n")
    _usage_error(capsys, lambda: normalize(["serve", "--config", str(config)]), "must be a YAML mapping")


def test_the_command_line_wins_over_a_config_file_under_any_name_of_the_flag(tmp_path, capsys):
    """-tp, -q and --kv-cache-memory-bytes set what the file's keys set: the file's value came after them and won."""
    from pagedserve.cli.argv import normalize
    from pagedserve.cli.main import build_parser, option_dests

    dests = option_dests(build_parser())
    config = tmp_path / "serve.yaml"
    config.write_text("tensor_parallel_size: 3\nquantization: int8\nkv_cache_memory: 1G\nmax_num_seqs: 4\n")
    argv = normalize(["plan", "m", "--config", str(config), "-tp", "1", "-q", "gguf", "--kv-cache-memory-bytes",
                      "2G"], dests)
    assert argv == ["plan", "m", "-tp", "1", "-q", "gguf", "--kv-cache-memory-bytes", "2G", "--max-num-seqs", "4"]
    for text, message in (("max_modle_len: 5\n", "'max_modle_len' is not a flag of `pagedserve serve`"),
                          ("max_model_len:\n", "'max_model_len' has no value")):
        config.write_text(text)
        _usage_error(capsys, lambda: normalize(["serve", "--config", str(config)], dests), message)
    _usage_error(capsys, lambda: normalize(["serve", "--config", str(config), f"--config={config}"], dests),
                 "--config is given twice")
    config.write_text("max_num_seqs: 4\n")  # run-batch and generate take serve's flags, and so the file
    assert normalize(["run-batch", "m", "-i", "x", "--config", str(config)], dests)[-2:] == ["--max-num-seqs", "4"]
    # a model named where the command takes it (after -i/-o for run-batch) wins over the file's (it was "given twice")
    config.write_text("model: from-file\nmax_num_seqs: 4\n")
    for argv in (["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "mine"], ["serve", "--port", "9", "mine"],
                 ["serve", "--served-model-name", "a", "--enable-prefix-caching", "mine"]):
        assert "--model" not in normalize([*argv, "--config", str(config)], dests), argv
    assert normalize(["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "--config", str(config)], dests)[-2:] == [
        "--model", "from-file"]


@pytest.mark.parametrize("text, value", [("4096", 4096), ("32k", 32000), ("32K", 32768), ("1.5k", 1500),
                                         ("1m", 1_000_000), ("2G", 2 << 30)])
def test_sizes_take_vllm_s_human_readable_forms(text, value):
    assert EngineArgs.from_cli_args(parse(f"serve m --max-model-len {text}")).max_model_len == value
    assert EngineArgs.from_cli_args(parse(f"serve m --kv-cache-memory-bytes {text}")).kv_cache_memory == value


def test_a_binary_suffix_with_a_decimal_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse("serve m --max-num-batched-tokens 1.5K")
    assert "did you mean 1.5k?" in capsys.readouterr().err


def test_no_flag_is_taken_by_a_prefix_of_its_name(capsys):
    from pagedserve.cli.main import build_parser

    for argv, prefix in ((["serve", "--max-model", "512"], "--max-model"),
                         (["bench", "serve", "--num-prom", "2"], "--num-prom"),  # bench's parsers abbreviated
                         (["bench", "startup", "--ready", "5", "m"], "--ready")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        assert f"unrecognized arguments: {prefix}" in capsys.readouterr().err


def test_a_command_line_error_is_short_and_names_the_closest_flag(capsys):
    """A mistyped flag gets serve's error (not the top-level usage) with the closest flag; a bad value one usage
    line, not serve's 130 lines of usage above the message; an unknown --tool-call-parser names what is."""
    from pagedserve.cli.main import main

    for argv, says in ((["serve", "m", "--enable-chunked-prefil"], "did you mean --enable-chunked-prefill?"),
                       (["plan", "m", "--max-model-le=3"], "did you mean --max-model-len?"),
                       (["serve", "m", "--block-size", "x"], "argument --block-size: invalid int value")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and says in err and len(err.splitlines()) <= 4, err
        assert f"pagedserve {argv[0]}: error:" in err
    with pytest.raises(ValueError, match="--tool-call-parser xlam is not supported: granite, hermes, llama3_json"):
        ServeOptions(tool_call_parser="xlam").check()
    # plan takes serve's command line: what serve refuses there (a server flag), plan refused neither
    assert main(["plan", "m", "--port", "99999"]) == 2
    assert "--port must be in 1..65535, got 99999" in capsys.readouterr().err


@pytest.mark.parametrize("command, message", [
    ("serve --served-model-name my-coder qwen2.5-coder-0.5b-instruct", "the model goes first, as in vLLM"),
    ("serve smollm2-135m-instruct --model qwen2.5-coder-0.5b-instruct", "the model is given twice"),
])
def test_a_command_line_whose_model_is_ambiguous_is_refused(command, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs.from_cli_args(parse(command))


def test_one_name_for_the_default_model_and_model_as_a_flag_still_work():
    assert EngineArgs.from_cli_args(parse("serve --served-model-name mine")).model is None
    assert EngineArgs.from_cli_args(parse("serve --model m --served-model-name a b")).model == "m"


@pytest.mark.parametrize("env, flags, keys", [
    ({"VLLM_API_KEY": "v"}, "", ["v"]), ({"PAGEDSERVE_API_KEY": "p", "VLLM_API_KEY": "v"}, "", ["p"]),
    ({"VLLM_API_KEY": "v"}, "--api-key k1 k2", ["k1", "k2"]), ({}, "", None),
    ({"OPENAI_API_KEY": "o"}, "", None),  # a client's variable: the server does not take its key from it
])
def test_api_keys_from_the_flag_or_pagedserve_s_or_vllm_s_variable(monkeypatch, env, flags, keys):
    for name in ("PAGEDSERVE_API_KEY", "VLLM_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert serve.checked_settings(parse(f"serve m {flags}"))[1].api_key == keys


def test_bench_sends_the_key_vllm_s_bench_does(monkeypatch):
    """$OPENAI_API_KEY, which vLLM's bench sends (and bench's own 401 message named), was not read."""
    from pagedserve.cli import bench

    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    for name in ("PAGEDSERVE_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "o")
    assert bench.serve_config_from_args(parser.parse_args(["bench", "serve"])).api_key == "o"
    monkeypatch.setenv("VLLM_API_KEY", "v")
    assert bench.serve_config_from_args(parser.parse_args(["bench", "serve"])).api_key == "v"


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_shutdown_grace_that_is_not_a_finite_number_of_seconds_is_refused(value):
    with pytest.raises(ValueError, match="--shutdown-grace-s must be a number of seconds >= 0"):
        serve.checked_settings(parse(f"serve m --shutdown-grace-s {value}"))


def test_vllm_s_no_forms_and_values_of_flags_without_effect():
    assert vllm_compat.check(vars(parse("serve m --no-trust-remote-code --no-enable-lora --no-async-scheduling"))) == []
    with pytest.raises(ValueError, match="--swap-space abc: not a number"):
        vllm_compat.check(vars(parse("serve m --swap-space abc")))
    with pytest.raises(ValueError, match="--prefix-caching-hash-algo bogus: not one of sha256"):
        vllm_compat.check(vars(parse("serve m --prefix-caching-hash-algo bogus")))


def test_tls_ciphers_reach_uvicorn(tmp_path):
    key, crt = tmp_path / "k.pem", tmp_path / "c.pem"
    key.write_text("x")
    crt.write_text("x")
    args = parse(f"serve m --ssl-keyfile {key} --ssl-certfile {crt} --ssl-ciphers ECDHE+AESGCM")
    options = ServeOptions.from_cli_args(args, limits=RequestLimits.from_cli_args(args))
    assert options.uvicorn_tls()["ssl_ciphers"] == "ECDHE+AESGCM"
    assert "ssl_ciphers" not in ServeOptions.from_cli_args(parse(f"serve m --ssl-keyfile {key} --ssl-certfile {crt}"),
                                                           limits=RequestLimits()).uvicorn_tls()


def test_access_log_filter_drops_named_paths_with_or_without_the_root_path():
    import logging

    from pagedserve.entrypoints.openai.api_server import _SkipPaths

    def kept(path: str, root_path: str = "") -> bool:
        record = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                                   ("127.0.0.1:5", "GET", path, "1.1", 200), None)
        return _SkipPaths({"/health", "/metrics"}, root_path).filter(record)

    assert not kept("/health") and not kept("/metrics?x=1") and kept("/v1/models")
    assert not kept("/llm/health", "/llm") and not kept("/health", "/llm/") and kept("/llm/v1/models", "/llm")
    assert kept("/llm/health")  # without --root-path, /llm/health is another path


def test_version_flag_and_an_ipv6_listen_address(capsys):
    from pagedserve import __version__
    from pagedserve.cli.main import build_parser
    from pagedserve.entrypoints.openai.options import ServeOptions

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--version"])
    assert capsys.readouterr().out.strip() == f"pagedserve {__version__}"
    assert ServeOptions(host="::1", port=8001).listen_address == "http://[::1]:8001"  # a URL that works


def test_a_hub_tokenizer_beside_a_gguf_says_to_leave_it_out():
    """vLLM's GGUF docs pass the hub's tokenizer (`--tokenizer org/name`); pagedserve downloads nothing, and a GGUF
    carries its own: the refusal says so. Beside another model it says only what --tokenizer takes."""
    from pagedserve.engine.setup import check_engine_args
    from pagedserve.formats.errors import ModelValidationError

    for model in ("smollm2-135m-instruct", "/models/x.Q8_0.gguf"):
        with pytest.raises(ModelValidationError, match="A GGUF carries its own tokenizer: leave --tokenizer out"):
            check_engine_args(EngineArgs(model=model, tokenizer="HuggingFaceTB/SmolLM2-135M-Instruct"))
    with pytest.raises(ModelValidationError, match="local path") as info:
        check_engine_args(EngineArgs(model="all-minilm-l6-v2", tokenizer="org/name"))
    assert "GGUF" not in str(info.value)
