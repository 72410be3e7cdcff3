"""`pagedserve generate`: the model's sampling defaults and the overrides apply as in LLM.generate (they were
ignored), the flags given win, and an embedding model is told apart."""

from __future__ import annotations

import json
import subprocess
import sys


def _generate(capsys, model: str, *flags: str) -> list[str]:
    """`pagedserve generate ... --json` in this process (five starts of a fresh one took ~13 s)."""
    from pagedserve.cli.main import main

    capsys.readouterr()
    code = main(["generate", model, "--prompt", "The quick brown", "--max-tokens", "12", "--max-model-len", "128",
                 "--dtype", "float32", "--seed", "3", "--json", *flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    return [json.loads(line)["text"] for line in out.splitlines()]


def test_sampling_defaults_overrides_and_flags(tiny_model_dir, capsys):
    model = tiny_model_dir("llama")
    greedy = _generate(capsys, model)
    assert _generate(capsys, model, "--temperature", "0") == greedy  # greedy unless something says a temperature
    sampled = _generate(capsys, model, "--temperature", "5")
    assert sampled != greedy  # (12 tokens at temperature 5 over a 512-token vocabulary)
    # top_k 1 from the overrides turns the flag's temperature back into greedy: the overrides apply
    assert _generate(capsys, model, "--temperature", "5", "--override-generation-config", '{"top_k": 1}') == greedy
    assert _generate(capsys, model, "--override-generation-config", '{"temperature": 5.0}') == sampled


def test_an_embedding_model_is_named_as_such():
    run = subprocess.run([sys.executable, "-m", "pagedserve", "generate", "all-minilm-l6-v2", "--prompt", "hi"],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode != 0 and "is an embedding model: it does not generate text" in run.stderr
    assert "Traceback" not in run.stderr


def test_bench_throughput_names_an_embedding_model(capsys):
    """It loaded the model, then its first prompt ended in a traceback ("give PoolingParams")."""
    from pagedserve.cli.main import main

    assert main(["bench", "throughput", "all-minilm-l6-v2", "--num-prompts", "2", "--input-len", "8",
                 "--output-len", "2", "--num-iters", "1"]) == 2
    err = capsys.readouterr().err
    assert "is an embedding model: bench throughput times text generation" in err and "Traceback" not in err


def test_chat_without_a_template_says_to_leave_out_chat(tiny_model_dir, tmp_path):
    """It named the Python API's way out (generate() or chat_template), which the command line has not."""
    import shutil

    model = tmp_path / "no-template"
    shutil.copytree(tiny_model_dir("llama"), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in model.glob("chat_template.*"):
        extra.unlink()
    run = subprocess.run([sys.executable, "-m", "pagedserve", "generate", str(model), "--prompt", "hi", "--chat",
                          "--max-model-len", "64"], capture_output=True, text=True, timeout=180)
    assert run.returncode != 0 and "leave out --chat" in run.stderr and "Traceback" not in run.stderr


def test_bad_sampling_flags_are_refused_before_the_model_loads(tmp_path, capsys):
    """They were checked only once the weights had loaded (seconds, or a fetch, for a typo)."""
    from pagedserve.cli.main import main

    missing = str(tmp_path / "no-model-here")  # never read: the flags fail first
    for flag, value, says in (("--top-p", "7", "top_p must be in (0, 1], got 7.0"),
                              ("--max-tokens", "0", "max_tokens must be >= 1, got 0"),
                              ("--temperature", "-1", "temperature")):
        assert main(["generate", missing, "--prompt", "hi", flag, value]) == 2
        err = capsys.readouterr().err
        assert says in err and "no-model-here" not in err, err


def test_ctrl_c_in_a_command_is_one_line_not_a_traceback(monkeypatch, capsys):
    """generate, run-batch and bench printed a KeyboardInterrupt traceback (serve and watch stop quietly)."""
    from pagedserve.cli import generate
    from pagedserve.cli.main import main

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "run", interrupted)
    assert main(["generate", "some-model", "--prompt", "hi"]) == 130
    assert capsys.readouterr().err.strip() == "pagedserve generate: interrupted"
