"""The README's snippet runs as written, .ci/run runs the README's commands, and the page reads as a newcomer's."""
import contextlib
import io
import os
import re

ROOT = os.path.join(os.path.dirname(__file__), "..")


def section(name: str) -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    start = text.index(f"\n## {name}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_use_it_runs_as_written():
    (code,) = blocks(section("Use it"), "python")
    out, names = io.StringIO(), {"__name__": "__readme__"}
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md: Use it", "exec"), names)
    lines = out.getvalue().splitlines()
    assert lines[0] == "['deepseek_v4_mhc_mxfp4', 'glm5_sparse_fp8', 'qwen3', 'qwen35_gdn']"
    assert re.fullmatch(r"\d+ sampled tokens, 0 differ in any bit, K3 max 0\.0", lines[1]), lines[1]
    assert lines[2].startswith("weight version 2: ") and names["pair"].last_sync.blocks_changed > 0  # the step shipped
    assert lines[3] == "2 True"


def test_ci_runs_the_readme_commands_in_order():
    """Every line of the "Two commands" blocks appears in .ci/run, in the README's order."""
    commands = [line.strip() for b in blocks(section("Two commands"), "bash") for line in b.splitlines() if line.strip()]
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = [line.strip() for line in f]
    at = [ci.index(c) if c in ci else -1 for c in commands]
    assert -1 not in at, [c for c, i in zip(commands, at) if i < 0]
    assert at == sorted(at)
    assert commands[0].startswith("python -m venv .venv")


def test_the_readme_is_a_page_not_a_log():
    """Short lines and no dated history: dates appear only in the link targets of the dated reports."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert max(map(len, lines)) < 400
    dated = [line for line in lines if re.search(r"\b20\d\d-\d\d-\d\d\b", re.sub(r"\([^)]*\.md[^)]*\)|\]: \S+", "", line))]
    assert dated == [], dated
