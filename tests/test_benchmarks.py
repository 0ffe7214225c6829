"""benchmarks/run_suite.py's report on a synthetic result, the vendor server
(the engine benchmark's baseline) on the CPU, and CPU smoke runs of
profile_prefill.py, bench_sync.py, bench_moe_train.py and bench_http.py's OpenAI routes."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import run_suite  # noqa: E402


def _kernel(op, M, exact, aligned_ms, vendor_ms, shape="N=4096 K=4096"):
    return {"op": op, "shape": shape, "M": M, "exact": exact, "aligned_ms": aligned_ms if exact else None,
            "vendor": "torch", "vendor_ms": vendor_ms, "ratio": vendor_ms / aligned_ms if exact else None}


def _engine_row(batch, prefill, decode, step_ms):
    return {"batch": batch, "prompt": 512, "new": 256, "prefill_tok_s": prefill, "decode_tok_s": decode,
            "decode_step_ms": step_ms}


def _results(check_passed=True):
    return {
        "meta": {"gpu": "NVIDIA H200", "date": "2026-11-30", "commit": "abc1234", "torch": "2.11", "triton": "3.6",
                 "cuda": "13.0", "command": "python benchmarks/run_suite.py --out o", "budget_s": 460, "elapsed_s": 400},
        "steps": {"env": {"status": "ok", "seconds": 5.0}, "kernels": {"status": "timeout", "seconds": 90.0}},
        "env": {"copy_gbps": 4000.0},
        "kernel_shapes": {"hidden": 4096, "intermediate": 12288, "vocab": 151936},
        "kernels": [_kernel("matmul", 1, True, 0.0200, 0.0188),   # 0.94: under matmul's 0.95
                    _kernel("matmul", 8, True, 0.0180, 0.0188),   # 1.04
                    _kernel("rmsnorm", 1, True, 0.0110, 0.0100, "H=4096"),  # 0.91: over the others' 0.9
                    _kernel("swiglu", 1, False, 0.0100, 0.0100, "I=12288")],
        "engine": {"config": "qwen3-8b", "prompt": 512, "new": 256, "batches": [1, 8], "max_position": 768,
                   "cuda_graphs": "on", "weight_bytes": 16e9, "kv_bytes_per_token": 147456,
                   "check": {"passed": check_passed, "length": 768, "batch": 3,
                             "rows": [{"rung": 1, "check": "trainer, same batch twice", "passed": True,
                                       "compared": 10, "differing": 0},
                                      {"rung": 3, "check": "trainer == server prefill", "passed": bool(check_passed),
                                       "compared": 10, "differing": 0 if check_passed else 4}]},
                   "aligned": {"rows": [_engine_row(1, 10569.0, 117.0, 8.58), _engine_row(8, 37744.0, 852.0, 9.39)]},
                   "vendor": {"rows": [_engine_row(1, 11000.0, 120.0, 8.33), _engine_row(8, 40000.0, 870.0, 9.2)]}},
    }


def test_ratios_are_marked_met_or_missed_against_each_target():
    page = run_suite.render(_results())
    assert "| matmul | N=4096 K=4096 | ≥ 0.95 | 0.94x missed | 1.04x met |" in page
    assert "| rmsnorm | H=4096 | ≥ 0.9 | 0.91x met |" in page
    assert "| swiglu | I=12288 | ≥ 0.9 | not exact |" in page
    assert "2 of 4 rows meet their target" in page and "1 not exact" in page
    # engine: speed ratio aligned / vendor; prefill 10569 / 11000 = 0.96 >= 0.9, decode 117 / 120 = 0.975 >= 0.97
    assert "| 1 | 10,569 | 11,000 | 0.96x met | 117 | 120 | 0.97x met |" in page
    assert "| 8 | 37,744 | 40,000 | 0.94x met | 852 | 870 | 0.98x met |" in page
    assert "**bitwise exact**, 2/2 rungs passed" in page
    # bandwidth bound: (16e9 + 147456 * 640) B / 4000 GB/s = 4.024 ms; / 8.58 ms = 0.47
    assert "bound 4.024 ms per step" in page and "| aligned | 8.5800 | 0.47x missed |" in page
    for head in ("NVIDIA H200", "abc1234", "torch 2.11", "triton 3.6", "`python benchmarks/run_suite.py --out o`",
                 "kernels timeout (90 s)"):
        assert head in page


@pytest.mark.parametrize("passed, shown", [(False, "not exact"), (None, "not checked")], ids=["failed", "unfinished"])
def test_no_engine_speed_without_an_exact_check(passed, shown):
    page = run_suite.render(_results(check_passed=passed))
    engine = page[page.index("## Engine"):page.index("## Kernels")]
    assert f"| 1 | {shown} | 11,000 | {shown} | {shown} | 120 | {shown} | {shown} | 8.3300 |" in engine
    assert "10,569" not in engine and "117 " not in engine and "8.5800" not in engine
    assert f"| aligned | {shown} | {shown} |" in engine
    if passed is False:
        assert "rung 3 trainer == server prefill: 4 of 10 tokens differ" in engine


def test_the_committed_page_is_what_render_makes_of_its_results():
    """docs/PERFORMANCE.md, its opening note included, is render() of the results file named by its commit: a
    rerun writes the page again rather than dropping what was written by hand."""
    root = Path(__file__).resolve().parents[1]
    page = (root / "docs" / "PERFORMANCE.md").read_text()
    commit = page.split("commit `", 1)[1].split("`", 1)[0]
    (results,) = (root / "benchmarks" / "results").glob(f"*-suite-{commit}.json")
    assert run_suite.render(json.loads(results.read_text())) == page


def test_the_note_follows_the_sections_present():
    r = _results()
    r["trainer"] = {"rows": [{"config": "qwen3-0.6b"}, {"config": "qwen35_gdn/qwen3.5-35b-a3b-4l"}]}
    note = run_suite._render_note(r)[0]
    assert note.startswith("> What this page is: the output of `benchmarks/run_suite.py` on one H200 ")
    assert "one run at the commit named below. It covers qwen3 and qwen35_gdn: the qwen3-8b engine and the " \
           "kernels at Qwen3-8B shapes" in note and "at that commit;" in note
    assert "; the trainer (qwen3-0.6b, qwen35_gdn/qwen3.5-35b-a3b-4l) against transformers." in note
    assert " qwen35_gdn's engine and the MoE experts are timed in the dated reports" in note
    bare = run_suite.render({"meta": {"gpu": "X", "merged_from": {"file": "f.json"}}}).split("\n")[2]
    assert "taken from the earlier run it names. Its figures measure the code at those commits" in bare
    assert "qwen3's trainer, qwen35_gdn's engine and trainer, and the MoE experts are timed" in bare


def test_writer_is_incremental_and_partial_results_render(tmp_path):
    out, doc = tmp_path / "out", tmp_path / "docs" / "PERFORMANCE.md"
    results = {"meta": {"gpu": "X"}, "steps": {"env": {"status": "running", "seconds": None}}}
    run_suite.write_outputs(results, str(out), str(doc))
    assert "## Engine" not in doc.read_text() and json.loads((out / "results.json").read_text()) == results
    rows = tmp_path / "rows"
    emit = run_suite.Emitter(str(rows))
    emit("kernels", _kernel("rope", 1, True, 0.01, 0.012), append=True)
    emit("engine.check", {"passed": None, "batch": 3})
    emit("engine.check", {"passed": True})
    with open(rows, "a") as f:
        f.write('{"key": "kernels", "val')  # a child killed mid-line
    run_suite.apply_lines(results, str(rows))
    assert results["engine"]["check"] == {"passed": True, "batch": 3} and len(results["kernels"]) == 1
    run_suite.write_outputs(results, str(out), str(doc))
    assert (out / "PERFORMANCE.md").read_text() == doc.read_text()
    assert "1.20x met" in doc.read_text()


def test_vendor_server_generates_on_cpu():
    """The deliberately misaligned server still serves: prefill (SDPA over the
    packed batch) and decode (one query per sequence) agree with its own
    teacher-forced scores and stay near the trainer (not bitwise: the point)."""
    import alignzoo
    from alignzoo import SamplingParams

    pair = alignzoo.load_pair("qwen3", config="tiny", device="cpu", server_kernels="vendor")
    assert type(pair.server.model).__name__ == "Qwen3VendorServer"
    assert pair.server.model.inv_freq.shape == (pair.config.head_dim // 2,)
    prompts = [[1, 2, 3, 4, 5], list(range(10, 47)), [7]]
    sp = SamplingParams(temperature=0.8, max_new_tokens=6, seed=3, stop_token_ids=())
    outs = pair.server.generate(prompts, sp)
    assert [len(o.tokens) for o in outs] == [6, 6, 6] and not any(o.error for o in outs)
    seqs = [p + o.tokens for p, o in zip(prompts, outs)]
    scored = pair.server.score(seqs, [len(p) for p in prompts], sp)
    trained = pair.trainer.logprobs(seqs, [len(p) for p in prompts], [sp] * 3)
    for o, s, t in zip(outs, scored, trained):
        assert torch.isfinite(o.logprobs).all()
        assert (o.logprobs - s).abs().max() < 1e-2
        assert (o.logprobs - t.detach().cpu()).abs().max() < 5e-2


def test_profile_prefill_smoke_on_cpu(tmp_path):
    """benchmarks/profile_prefill.py end to end on the tiny preset (the code
    path, not a speed): both servers, every run listed, the table written,
    with the launch count and the host functions (--host)."""
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_prefill.py"
    run = subprocess.run([sys.executable, str(script), "--config", "tiny", "--device", "cpu", "--batches", "1",
                          "--prompt", "40", "--reps", "2", "--host", "5", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    md = (tmp_path / "profile_prefill.md").read_text()
    assert "| aligned | 1 |" in md and "| vendor | 1 |" in md and "top kernels of one prefill" in md
    assert "| launches |" in md and md.count("own host time by function") == 2


def test_bench_sync_smoke_on_cpu():
    """benchmarks/bench_sync.py (the sync timings at qwen3-8b shapes; it ships
    outside the package) end to end at its small shapes: FP8 codes from FP32
    masters, three Adam steps, each published and applied, end states equal."""
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_sync.py"
    run = subprocess.run([sys.executable, str(script), "--device", "cpu", "--small", "--adam", "1e-3", "--fp8"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "first (full) publish + apply" in run.stdout and "Adam step 3" in run.stdout


def test_bench_moe_train_smoke_on_cpu(tmp_path):
    """benchmarks/bench_moe_train.py (the experts' forward + backward against grouped experts under
    autograd) at its CPU shape, bf16 / FP8 / MXFP4, trained and frozen experts: a row each, the
    gradients of the two sides close (different functions: bf16 vs fp32 intermediates), ours repeating."""
    import bench_moe_train

    for frozen in (False, True):
        args = ["--device", "cpu", "--out", str(tmp_path), "--tokens", "37", "--warm", "0", "--reps", "1",
                "--formats", "bf16,fp8,mxfp4"]
        assert bench_moe_train.main(args + (["--frozen"] if frozen else [])) == 0
        rows = json.loads((tmp_path / "moe_train.json").read_text())["rows"]
        assert [r["format"] for r in rows] == ["bf16", "fp8", "mxfp4"]
        for r in rows:
            assert r["frozen"] == frozen and r["repeats"] and r["grad_rel_diff"] < 2e-2 and r["aligned_host_ops"] > 0
    assert "| smoke | mxfp4 | 37 | frozen |" in (tmp_path / "moe_train.md").read_text()


def test_matmul_rows_cover_the_mid_m_values_and_warm_them():
    """The suite's matmul rows include the M values between 64 and 1024 where
    128-row tiles fill SM waves badly (M = 128-768), and each gets a warm job;
    a one-M run (a warm job's) stays one M."""
    import bench_primitives as bp

    args = run_suite.parse_args(["--device", "cpu", "--steps", "kernels", "--ops", "matmul,rmsnorm"])
    assert bp.matmul_ms() == (1, 8, 64, 128, 192, 256, 384, 512, 768, 1024, 4096, 8192)
    warm = run_suite.warm_tasks(args)
    assert sorted(t["M"] for t in warm if t["op"] == "matmul") == list(bp.matmul_ms())
    assert sorted(t["M"] for t in warm if t["op"] == "rmsnorm") == list(bp.MS)
    old = bp.MS
    try:
        bp.MS = (384,)
        assert bp.matmul_ms() == (384,)
    finally:
        bp.MS = old


def test_trainer_rows_of_another_model_on_cpu():
    """bench_trainer on ``qwen35_gdn/tiny``: transformers' Qwen3_5MoeForCausalLM takes our weights
    through the model's name map and scores the same tokens to bf16 rounding; a missing Liger is a row."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_trainer

    assert bench_trainer.split_config("qwen35_gdn/tiny") == ("qwen35_gdn", "tiny")
    assert bench_trainer.split_config("qwen3-0.6b") == ("qwen3", "qwen3-0.6b")
    pytest.importorskip("transformers")
    rows = bench_trainer.measure("qwen35_gdn/tiny", torch.device("cpu"), 2, 24, sides=("aligned", "hf"), warm=0,
                                 steps=1)
    by = {r["side"]: r for r in rows}
    assert by["aligned"]["tokens"] == 48 and 0 < by["hf"]["max_abs_logprob_vs_aligned"] < 0.05
    assert run_suite.parse_trainer_shape("qwen35_gdn/qwen3.5-35b-a3b-4l:2x2048") == (
        "qwen35_gdn/qwen3.5-35b-a3b-4l", 2, 2048)


def test_trainer_step_smoke_on_cpu(tmp_path):
    """run_suite's trainer step (benchmarks/bench_trainer.py) end to end on the
    tiny preset: the aligned trainer and transformers' Qwen3 on our weights
    (their log-probs agree to bf16 rounding: the same model), each side's row
    on the page; a side whose package is missing is a row that says why."""
    import subprocess

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "run_suite.py"
    run = subprocess.run([sys.executable, str(script), "--device", "cpu", "--steps", "trainer", "--out", str(tmp_path),
                          "--trainer-shapes", "tiny:2x40"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["trainer"]["rows"]
    by = {r["side"]: r for r in rows}
    assert set(by) == {"aligned", "hf", "hf+liger"} and by["aligned"]["tokens"] == 80
    assert 0 < by["hf"]["max_abs_logprob_vs_aligned"] < 0.05
    page = (tmp_path / "PERFORMANCE.md").read_text()
    assert "## Trainer" in page and "| tiny | 2 | 80 | aligned |" in page and "| tiny | 2 | 80 | hf | " in page
    with pytest.raises(SystemExit):
        run_suite.parse_args(["--device", "cpu", "--trainer-shapes", "tiny:2by40"])


def test_engine_rows_of_qwen35_on_cpu():
    """bench_engine's load takes MODEL/PRESET; a row has the steady decode beside the old measure."""
    import bench_engine

    pair = bench_engine.load("qwen35_gdn/tiny", max_batch_size=3, cuda_graphs=False, device="cpu")
    row = bench_engine.measure(pair.server, pair.config.vocab_size, 3, 20, 6)
    assert row["batch"] == 3 and row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0
    assert row["steady_decode_step_ms"] is not None and row["steady_decode_tok_s"] > 0


@pytest.mark.parametrize("route,rows", [("completions", {"batched", "concurrent"}), ("chat", {"concurrent"})],
                         ids=["completions", "chat"])
def test_bench_http_openai_routes_smoke_on_cpu(tmp_path, capsys, route, rows):
    """benchmarks/bench_http.py through /v1/completions and /v1/chat/completions (a checkpoint built with a
    tokenizer and a chat template): every request its --new tokens, the tokens, the prompt ids the server
    rendered and the FP32 log-probs (the JSON floats exactly) equal to in-process generate's, the figures
    written (the /generate route's smoke test is tests/test_http.py's)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("transformers")
    import bench_http

    out = tmp_path / "http.json"
    report = bench_http.main(["--route", route, "--batch", "3", "--prompt-len", "9", "--new", "5", "--repeats", "1",
                              "--json", str(out)])
    assert report["tokens"] == 15 and set(report["ratio"]) == rows
    assert all(report["bitwise_equal"].values()) and all(report["logprobs_json_exact"].values())
    assert json.loads(out.read_text())["path"] == bench_http.PATHS[route]
    assert "bits equal" in capsys.readouterr().out
