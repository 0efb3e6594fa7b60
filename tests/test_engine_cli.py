"""`pagedkv run`: the dense check passes with evictions and preemptions in the report, TTFT and
TPOT in the report and the JSON, Prometheus metrics served during the run, a wrong executor
exits 1, bad input and missing dependencies exit 2 with a message naming the option or the cause,
argument errors before torch is imported, one torch thread by default for a small model."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedkv.cli import main

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

# The tiny synthetic Llama on a pool of 31 usable blocks of 4 tokens, prompts of at most ~80
# tokens, a 32-token budget: hits, chunked prefills, evictions and preemptions all happen.
TINY = [
    "run",
    "--preset",
    "tiny",
    "--requests",
    "20",
    "--prompt-tokens",
    "80",
    "--max-tokens",
    "16",
    "--num-blocks",
    "32",
    "--block-size",
    "4",
    "--max-num-batched-tokens",
    "32",
    "--max-num-seqs",
    "8",
    "--max-model-len",
    "128",
    "--threads",
    "1",
    "--no-progress",
]


@pytest.fixture(autouse=True)
def restore_threads() -> Iterator[None]:
    """`--threads` sets torch's global thread count; give other tests theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _field(report: str, name: str) -> str:
    match = re.search(rf"^  {name}\s+(.*)$", report, re.M)
    assert match, report
    return match.group(1)


def _count(report: str, name: str) -> int:
    return int(_field(report, name).split()[0].replace(",", ""))


def test_check_dense_passes_and_the_report_shows_evictions_and_preemptions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    figure, numbers = tmp_path / "run.png", tmp_path / "run.json"
    args = [*TINY, "--check-dense", "--runtime-checks", "1", "--plot", str(figure)]
    assert main([*args, "--json", str(numbers)]) == 0
    report = capsys.readouterr().out
    assert report.startswith("pagedkv run — 20 requests, synthetic chat trace")
    assert _field(report, "dense check").startswith("OK: 20 of 20 requests equal")
    assert _count(report, "preemptions") > 0
    assert _count(report, "evictions") > 0
    assert _field(report, "peak pool usage") == "100.0%"
    assert re.match(r"[1-9][\d.]*% \(", _field(report, "prefix-cache hits"))
    assert re.match(r"[\d,.]+ generated tokens/s", _field(report, "throughput"))
    assert re.match(r"[\d.]+% of the time", _field(report, "attention share"))
    assert re.match(
        r"TTFT median [\d.,]+ m?s, p90 [\d.,]+ m?s; TPOT median [\d.,]+ m?s, p90 [\d.,]+ m?s ",
        _field(report, "latency"),
    )
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figure.stat().st_size > 10_000
    document = json.loads(numbers.read_text())
    assert document["dense_check"]["passed"] is True
    assert document["summary"]["num_preemptions"] == _count(report, "preemptions")
    assert len(document["steps"]) == _count(report, "steps")
    assert document["config"]["runtime_checks"] == 1
    summary, requests = document["summary"], document["requests"]
    assert len(requests) == 20 and all(r["ttft"] > 0 for r in requests)
    ttfts = sorted(r["ttft"] for r in requests)
    assert summary["ttft_median"] == (ttfts[9] + ttfts[10]) / 2  # interpolated, as numpy's
    assert ttfts[0] <= summary["ttft_p90"] <= ttfts[-1]
    tpots = [r["tpot"] for r in requests if r["num_output_tokens"] >= 2]
    assert tpots and all(t > 0 for t in tpots) and summary["tpot_median"] > 0


def test_the_kernels_dry_run_passes_the_same_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*TINY, "--executor", "cupy-dry-run", "--check-dense"]) == 0
    report = capsys.readouterr().out
    assert _field(report, "executor") == "cupy-dry-run on cpu, 1 torch thread"
    assert _field(report, "dense check").startswith("OK")


def test_a_wrong_executor_fails_the_check_and_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pagedkv.engine.torch_executor import TorchReferenceExecutor

    attention = TorchReferenceExecutor.attention

    def off_by_a_bit(
        self: TorchReferenceExecutor, layer: int, query: object, scale: float
    ) -> object:
        return attention(self, layer, query, scale * 1.01)  # type: ignore[arg-type]

    monkeypatch.setattr(TorchReferenceExecutor, "attention", off_by_a_bit)
    assert main([*TINY, "--requests", "4", "--check-dense"]) == 1
    assert _field(capsys.readouterr().out, "dense check").startswith("FAILED")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt_token_ids": [1, 2, 3000]}', r"prompts\.jsonl:2: token id 3000 is outside"),
        ('{"prompt": "hello"}', r"prompts\.jsonl:2: a text prompt needs a tokenizer"),
        ('{"prompt_token_ids": [1], "max_tokens": 0}', r"prompts\.jsonl:2: max_tokens must be"),
        ("[1, 2]", r"prompts\.jsonl:2: a line must be a JSON object"),
    ],
)
def test_bad_prompts_exit_2_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, message: str
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2, 3]}\n' + line + "\n")
    assert main([*TINY, "--prompts", str(prompts)]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_prompts_from_a_jsonl_file_are_served(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt_token_ids": [5, 6, 7, 8, 9, 10], "max_tokens": 5, "id": "first"},
        {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12], "arrival_step": 3},
    ]
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    assert main([*TINY, "--prompts", str(prompts), "--check-dense"]) == 0
    report = capsys.readouterr().out
    assert report.startswith(f"pagedkv run — 2 requests from {prompts}")
    assert _field(report, "tokens").startswith("14 prompt, 21 generated")  # 5 + 16 (default)


BAD_ARGUMENTS = [
    (["--executor", "cupy"], "--executor cupy launches CUDA kernels: add --device cuda"),
    (["--block-size", "6"], "--block-size must be a power of two (the kernels shift by it), got 6"),
    (["--num-blocks", "1"], "--num-blocks must be >= 2, got 1"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1, got 0"),
    (["--max-model-len", "0"], "--max-model-len must be >= 1, got 0"),
    (["--max-model-len", "5000"], "--max-model-len 5000 exceeds the 'tiny' model's 1024 positions"),
    (["--runtime-checks", "-1"], "--runtime-checks must be >= 0, got -1"),
    (["--requests", "0"], "--requests must be >= 1, got 0"),
    (["--prompt-tokens", "4"], "--prompt-tokens must be >= 8, got 4"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--model", "/nonexistent"], "--model /nonexistent: no config.json there"),
    (["--prompts", "/nonexistent.jsonl"], "--prompts /nonexistent.jsonl: no such file"),
    (["--plot", "/nonexistent/run.png"], "--plot /nonexistent/run.png: the directory /nonexistent"),
    (["--json", "/nonexistent/run.json"], "--json /nonexistent/run.json: the directory"),
    (["--metrics-port", "70000"], "--metrics-port must be <= 65535, got 70000"),
    (["--metrics-port", "-1"], "--metrics-port must be >= 0, got -1"),
    (
        ["--prefix-cache-retention-interval", "-1"],
        "--prefix-cache-retention-interval must be >= 0, got -1",
    ),
]
"""Refused from the arguments alone, before torch is imported."""


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        *BAD_ARGUMENTS,
        pytest.param(
            ["--device", "cuda"],
            "--device cuda: torch sees no CUDA device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here"),
        ),
        (["--num-blocks", "8"], "'chat-000': a request must fit in the pool on its own"),
        # Known only once the model's layers are: the tiny model has no sliding window.
        (
            ["--prefix-cache-retention-interval", "16"],
            "prefix_cache_retention_interval=16 needs a sliding-window or Mamba group",
        ),
    ],
)
def test_bad_arguments_exit_2_naming_the_option(
    capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main([*TINY, *extra]) == 2
    assert message in capsys.readouterr().err


def test_sparse_retention_keeps_generation_exact_and_the_report_names_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A Gemma-3 model's window group caching only each prompt's replay-boundary run (vLLM
    0.33's engine default) serves the same tokens as transformers; a model without a window
    says nothing of retention."""
    gemma = [*TINY, "--preset", "gemma3-2group", "--requests", "8", "--check-dense"]
    assert main([*gemma, "--prefix-cache-retention-interval", "0"]) == 0
    report = capsys.readouterr().out
    assert _field(report, "prefix retention").startswith("0: a window group caches only")
    assert _field(report, "dense check").startswith("OK")
    assert main([*TINY, "--requests", "2"]) == 0
    assert "prefix retention" not in capsys.readouterr().out


def test_argument_errors_come_before_torch_is_imported() -> None:
    """Each refused at once, in a process that never imports torch (nor transformers)."""
    code = (
        "import contextlib, io, json, sys\n"
        "from pagedkv.cli import main\n"
        "statuses = []\n"
        "for extra in json.loads(sys.argv[1]):\n"
        "    with contextlib.redirect_stderr(io.StringIO()):\n"
        "        statuses.append(main([*json.loads(sys.argv[2]), *extra]))\n"
        "print(json.dumps([statuses, 'torch' in sys.modules, 'transformers' in sys.modules]))\n"
    )
    cases = [extra for extra, _ in BAD_ARGUMENTS]
    completed = subprocess.run(
        [sys.executable, "-c", code, json.dumps(cases), json.dumps(TINY)],
        capture_output=True,
        text=True,
        check=True,
    )
    statuses, torch_imported, transformers_imported = json.loads(completed.stdout)
    assert statuses == [2] * len(cases)
    assert not torch_imported and not transformers_imported


def test_an_unknown_preset_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*TINY, "--preset", "huge"])
    assert exited.value.code == 2
    assert "argument --preset: invalid choice: 'huge'" in capsys.readouterr().err


def test_a_small_model_runs_on_one_torch_thread_by_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    torch.set_num_threads(2)
    default = [arg for arg in TINY if arg not in ("--threads", "1")]
    assert main([*default, "--requests", "2"]) == 0
    assert _field(capsys.readouterr().out, "executor") == "reference on cpu, 1 torch thread"
    assert torch.get_num_threads() == 1
    assert main([*default, "--requests", "2", "--threads", "2"]) == 0  # a choice is kept
    assert _field(capsys.readouterr().out, "executor") == "reference on cpu, 2 torch threads"


def test_a_missing_dependency_names_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec

    def without_transformers(name: str, *args: object) -> object:
        return None if name == "transformers" else find_spec(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", without_transformers)
    assert main(TINY) == 2
    err = capsys.readouterr().err
    assert "needs transformers, which is not installed: pip install 'pagedkv[engine]'" in err


def test_the_run_command_imports_no_optional_dependency_until_it_runs() -> None:
    """So that a missing extra is reported as such, not as an ImportError traceback."""
    code = (
        "import sys, pagedkv.cli, pagedkv.engine, pagedkv.engine.run_command;"
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'torch', 'transformers', 'tqdm', 'matplotlib', 'numpy'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_metrics_are_served_under_vllms_names_during_the_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a Prometheus server scraping the run's endpoint reads at the end of the run."""
    prometheus_client = pytest.importorskip("prometheus_client")
    import urllib.request

    from pagedkv.events import metrics as metrics_module

    scraped: list[str] = []
    serve = metrics_module.serve_metrics

    def serve_and_scrape_before_closing(
        port: int, host: str = "127.0.0.1", registry: object = None
    ) -> metrics_module.MetricsServer:
        server = serve(port, host, registry)
        close = server.close

        def scrape_then_close() -> None:
            with urllib.request.urlopen(server.url, timeout=10) as response:
                scraped.append(response.read().decode())
            close()

        monkeypatch.setattr(server, "close", scrape_then_close)
        return server

    monkeypatch.setattr(metrics_module, "serve_metrics", serve_and_scrape_before_closing)
    name = "cli-metrics-test"
    args = [*TINY, "--metrics-port", "0", "--served-model-name", name]
    assert main(args) == 0
    report = capsys.readouterr().out
    assert re.match(
        rf"served at http://127\.0\.0\.1:\d+/metrics during the run \(model_name='{name}', "
        r"engine='0'\)",
        _field(report, "metrics"),
    )
    labels = f'{{engine="0",model_name="{name}"}}'
    text = scraped[0]
    assert f"vllm:num_preemptions_total{labels} {float(_count(report, 'preemptions'))}" in text
    assert f"vllm:kv_cache_usage_perc{labels}" in text
    queries = prometheus_client.REGISTRY.get_sample_value(
        "vllm:prefix_cache_queries_total", {"model_name": name, "engine": "0"}
    )
    hits = prometheus_client.REGISTRY.get_sample_value(
        "vllm:prefix_cache_hits_total", {"model_name": name, "engine": "0"}
    )
    assert queries is not None and hits is not None and 0 < hits < queries
    evictions = prometheus_client.REGISTRY.get_sample_value(
        "pagedkv_kv_cache_evictions_total", {"model_name": name, "engine": "0"}
    )
    assert evictions is not None and evictions > 0


def test_metrics_without_prometheus_client_name_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec

    def without_prometheus(name: str, *args: object) -> object:
        return None if name == "prometheus_client" else find_spec(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", without_prometheus)
    assert main([*TINY, "--metrics-port", "0"]) == 2
    assert (
        "pagedkv run --metrics-port needs prometheus_client, which is not installed: "
        "pip install 'pagedkv[metrics]'"
    ) in capsys.readouterr().err


def test_percentiles_interpolate_between_the_nearest_ranks() -> None:
    from pagedkv.engine.metrics import percentile

    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.9) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5  # unsorted input
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.9) == pytest.approx(3.7)
