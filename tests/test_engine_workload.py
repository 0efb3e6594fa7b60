"""Workloads: the synthetic chat trace's shape, JSONL prompts, and a local checkpoint with a
tokenizer served from text prompts (`--model PATH`, nothing downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.engine.workload import ChatTraceConfig, load_prompts_jsonl, synthetic_chat_trace
from pagedkv.vocab.errors import InvalidArgumentError


def test_the_chat_trace_shares_prefixes_and_spreads_arrivals() -> None:
    config = ChatTraceConfig.scaled(num_requests=40, max_prompt_tokens=120, max_tokens=20)
    trace = synthetic_chat_trace(config, vocab_size=100)
    assert len(trace) == 40
    assert synthetic_chat_trace(config, vocab_size=100)[7].prompt_token_ids == (
        trace[7].prompt_token_ids
    )  # one seed, one trace
    prompts = [item.prompt_token_ids for item in trace]
    system_lengths = config.system_prompt_tokens
    shared = sum(
        1
        for index, prompt in enumerate(prompts)
        if any(
            prompt[: system_lengths[0]] == other[: system_lengths[0]] for other in prompts[:index]
        )
    )
    assert shared >= 30  # most requests start with an earlier request's system prompt
    follow_ups = sum(
        1
        for index, prompt in enumerate(prompts)
        if any(len(o) < len(prompt) and prompt[: len(o)] == o for o in prompts[:index])
    )
    assert follow_ups >= 5  # some continue an earlier conversation
    assert all(5 <= item.max_tokens <= 20 for item in trace)
    arrivals = [item.arrival_step for item in trace]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0 and arrivals[-1] > 10
    assert all(0 <= token < 100 for prompt in prompts for token in prompt)
    assert [item.request_id for item in trace[:2]] == ["chat-000", "chat-001"]


def test_the_default_trace_is_the_scaled_one_at_384_tokens() -> None:
    assert ChatTraceConfig.scaled(num_requests=48, max_prompt_tokens=384, max_tokens=48) == (
        ChatTraceConfig()
    )
    with pytest.raises(InvalidArgumentError, match="prompts need at least 8 tokens"):
        ChatTraceConfig.scaled(num_requests=1, max_prompt_tokens=4, max_tokens=4)
    with pytest.raises(InvalidArgumentError, match="user_tokens must be"):
        ChatTraceConfig(user_tokens=(5, 2))


def test_jsonl_prompts_with_defaults_ids_and_stop_tokens(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt_token_ids": [1, 2], "id": "a", "max_tokens": 3, "arrival_step": 2}\n'
        "\n"
        '{"prompt": "x y"}\n'
    )
    items = load_prompts_jsonl(
        path,
        vocab_size=10,
        default_max_tokens=7,
        stop_token_ids=[9],
        tokenize=lambda text: [len(word) for word in text.split()],
    )
    assert [(i.request_id, i.prompt_token_ids, i.max_tokens, i.arrival_step) for i in items] == [
        ("a", (1, 2), 3, 2),
        ("line-3", (1, 1), 7, 0),
    ]
    assert all(item.stop_token_ids == frozenset({9}) for item in items)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "holds no request"),
        ("{not json\n", r"p\.jsonl:1: not JSON"),
        ('{"prompt_token_ids": [1], "prompt": "x"}\n', "exactly one of prompt_token_ids"),
        ('{"prompt_token_ids": []}\n', "non-empty list of token ids"),
        ('{"prompt_token_ids": [true]}\n', "non-empty list of token ids"),
        ('{"prompt_token_ids": [1], "temperature": 0.5}\n', r"unknown keys \['temperature'\]"),
        ('{"prompt_token_ids": [1], "id": 3}\n', "id must be a non-empty string"),
        ('{"prompt_token_ids": [1], "arrival_step": -1}\n', "arrival_step must be an int >= 0"),
        ('{"prompt_token_ids": [1], "id": "a"}\n{"prompt_token_ids": [1], "id": "a"}\n', ":2: id"),
    ],
)
def test_a_bad_jsonl_line_is_refused_by_file_and_line(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(InvalidArgumentError, match=message):
        load_prompts_jsonl(path, vocab_size=10, default_max_tokens=4)


def test_an_unreadable_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        load_prompts_jsonl(tmp_path / "missing.jsonl", vocab_size=10, default_max_tokens=4)


def test_a_local_checkpoint_serves_text_prompts_equal_to_dense(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from pagedkv.cli import main
    from pagedkv.engine.model import synthetic_llama

    words = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "rug", "and", "then"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="a"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    checkpoint = tmp_path / "tiny-llama"
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(checkpoint)
    synthetic_llama("tiny", seed=3).save_pretrained(checkpoint)
    prompts = tmp_path / "text.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "the cat sat on the mat and then the dog", "id": "cat"})
        + "\n"
        + json.dumps({"prompt": "the cat sat on the rug", "id": "rug", "max_tokens": 4})
        + "\n"
    )
    threads = torch.get_num_threads()
    try:
        status = main(
            [
                *("run", "--model", str(checkpoint), "--prompts", str(prompts)),
                *("--max-tokens", "6", "--block-size", "4", "--num-blocks", "16"),
                *("--check-dense", "--threads", "1"),
            ]
        )
    finally:
        torch.set_num_threads(threads)
    report = capsys.readouterr().out
    assert status == 0, report
    assert f"Llama from {checkpoint}: 2 layers" in report
    assert "tokens                 16 prompt, 10 generated" in report
    assert "dense check            OK: 2 of 2 requests" in report
