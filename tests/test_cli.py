"""The command line: a bad argument is one line on stderr and exit status 2, never a traceback;
``check`` says which rung it is on; ``generate`` says when its weights are random."""
import os
import subprocess
import sys

import pytest
import torch

import alignzoo
from alignzoo import cli


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    (root / "file.txt").write_text("not a checkpoint\n")
    (root / "empty").mkdir()
    (root / "badjson").mkdir()
    (root / "badjson" / "config.json").write_text("{not json")
    (root / "nofields").mkdir()
    (root / "nofields" / "config.json").write_text('{"model_type": "qwen3"}')
    return root


# Refused while parsing: nothing is built, and the message is argparse's one line.
PARSE_ERRORS = {
    "length-0": (["check", "qwen3", "--length", "0"], "--length"),
    "length-negative": (["check", "qwen3", "--length", "-5"], "--length"),
    "length-not-int": (["check", "qwen3", "--length", "x"], "--length"),
    "batch-0": (["check", "qwen3", "--batch", "0"], "--batch"),
    "device-tpu": (["check", "--device", "tpu"], "--device"),
    "device-bad-index": (["generate", "qwen3", "--prompt", "1", "--device", "cuda:x"], "--device"),
    "device-cuda-99": (["check", "qwen3", "--device", "cuda:99"], "--device"),
    "checkpoint-missing": (["check", "qwen3", "--checkpoint", "{root}/missing"], "does not exist"),
    "checkpoint-file": (["check", "qwen3", "--checkpoint", "{root}/file.txt"], "is a file"),
    "checkpoint-no-config": (["generate", "qwen3", "--prompt", "1", "--checkpoint", "{root}/empty"], "config.json"),
    "checkpoint-and-config": (["check", "qwen3", "--checkpoint", "{root}/badjson", "--config", "tiny"],
                              "not allowed with"),
    "prompt-words": (["generate", "qwen3", "--prompt", "a b c"], "not a token id"),
    "prompt-negative": (["generate", "qwen3", "--prompt", "1 -2"], "not a token id"),
    "prompt-empty": (["generate", "qwen3", "--prompt", ""], "empty"),
    "temperature-negative": (["generate", "qwen3", "--prompt", "1", "--temperature", "-1"], "temperature"),
    "temperature-nan": (["generate", "qwen3", "--prompt", "1", "--temperature", "nan"], "temperature"),
    "top-p-2": (["generate", "qwen3", "--prompt", "1", "--top-p", "2"], "top_p"),
    "top-k-negative": (["generate", "qwen3", "--prompt", "1", "--top-k", "-1"], "top_k"),
    "top-k-2**70": (["generate", "qwen3", "--prompt", "1", "--top-k", str(2**70)], "top_k"),
    "min-p-1.5": (["generate", "qwen3", "--prompt", "1", "--min-p", "1.5"], "min_p"),
    "max-new-tokens-0": (["generate", "qwen3", "--prompt", "1", "--max-new-tokens", "0"], "max_new_tokens"),
    "max-new-tokens-negative": (["generate", "qwen3", "--prompt", "1", "--max-new-tokens", "-3"], "max_new_tokens"),
    "seed-negative": (["generate", "qwen3", "--prompt", "1", "--seed", "-1"], "--seed"),
    "seed-past-int64": (["check", "qwen3", "--seed", str(2**63)], "int64"),
    "unknown-model": (["generate", "qwen9", "--prompt", "1"], "qwen9"),
    "no-prompt": (["generate", "qwen3"], "--prompt"),
    "no-command": ([], "required"),
    "threads-0": (["check", "qwen3", "--threads", "0"], "--threads"),
}


@pytest.mark.parametrize("case", PARSE_ERRORS, ids=list(PARSE_ERRORS))
def test_parse_errors_are_one_line_and_exit_2(capsys, dirs, case):
    argv, needle = PARSE_ERRORS[case]
    rc, out, err = run(capsys, *(a.format(root=dirs) for a in argv))
    assert rc == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("alignzoo") and ": error: " in err, err
    assert needle in err


# Refused by the library once the command runs: still one line of our own, exit 2.
RUN_ERRORS = {
    "config-unknown": (["check", "qwen3", "--config", "nope"], "preset 'nope'"),
    "generate-config-unknown": (["generate", "qwen3", "--prompt", "1", "--config", "nope"], "preset 'nope'"),
    "length-past-positions": (["check", "qwen3", "--length", "5000"], "4096 positions"),
    "checkpoint-bad-json": (["check", "qwen3", "--checkpoint", "{root}/badjson"], "JSON"),
    "checkpoint-missing-fields": (["check", "qwen3", "--checkpoint", "{root}/nofields"], "hidden_size"),
    "unknown-primitive": (["check", "nope"], "unknown primitive"),
    "model-and-primitive": (["check", "qwen3", "matmul"], "one model at a time"),
    "prompt-out-of-vocab": (["generate", "qwen3", "--prompt", "1 999999"], "outside the vocabulary"),
    "prompt-past-int64": (["generate", "qwen3", "--prompt", str(2**70)], "outside the vocabulary"),
}


@pytest.mark.parametrize("case", RUN_ERRORS, ids=list(RUN_ERRORS))
def test_library_errors_are_one_line_and_exit_2(capsys, dirs, case):
    argv, needle = RUN_ERRORS[case]
    rc, out, err = run(capsys, *(a.format(root=dirs) for a in argv))
    assert rc == 2
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("alignzoo: error: ") and needle in last, err


def test_generate_bad_prompt_fails_but_serves_the_good_one(capsys):
    rc, out, err = run(capsys, "generate", "qwen3", "--prompt", "1 2 3", "--prompt", "4 151", "--max-new-tokens", "3")
    assert rc == 2
    assert out.startswith("prompt [1, 2, 3] -> ") and "151" not in out
    assert "alignzoo: error: prompt 2: token id 151" in err


def test_an_internal_error_keeps_its_traceback(monkeypatch):
    """Only input errors become one line: a bug (here a RuntimeError) still raises."""
    def broken(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "cmd_models", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["models"])


def test_check_says_each_rung_as_it_starts(capsys):
    threads = torch.get_num_threads()
    rc, out, err = run(capsys, "check", "qwen3", "--length", "40", "--batch", "2")
    assert rc == 0
    rungs = [line for line in err.splitlines() if line.startswith("alignzoo: [") and "s] rung " in line]
    assert [line.split("] ")[1].split(":")[0] for line in rungs] == ["rung 1", "rung 2", "rung 3", "rung 4"]
    table = [line for line in out.splitlines() if line[:1] in "1234" and ("PASS" in line or "FAIL" in line)]
    assert len(table) == 9 and "9/9 checks passed" in out
    assert torch.get_num_threads() == threads  # the CLI's one-thread default does not leak into its caller


def test_generate_says_when_the_weights_are_random(capsys, tmp_path):
    rc, out, err = run(capsys, "generate", "qwen3", "--prompt", "1 2", "--max-new-tokens", "2", "--seed", "5")
    assert rc == 0 and out.startswith("prompt [1, 2] -> ")
    note = [line for line in err.splitlines() if line.startswith("alignzoo: note:")]
    assert len(note) == 1 and "random weights" in note[0] and "'tiny'" in note[0] and "sampling seed 5" in note[0]
    alignzoo.load_pair("qwen3", config="tiny", device="cpu").save_pretrained(tmp_path)
    rc, out, err = run(capsys, "generate", "qwen3", "--prompt", "1 2", "--max-new-tokens", "2",
                       "--checkpoint", str(tmp_path))
    assert rc == 0 and "random weights" not in err


def test_installed_command_shows_no_traceback(tmp_path):
    """The real entry point in a fresh process: a bad prompt exits 2 with one error line, no traceback."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    p = subprocess.run([sys.executable, "-m", "alignzoo.cli", "generate", "qwen3", "--prompt", "1 2",
                        "--prompt", "7 100000", "--max-new-tokens", "2"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("alignzoo: error: prompt 2: token id 100000")
    assert "random weights" in p.stderr and p.stdout.startswith("prompt [1, 2] -> ")
