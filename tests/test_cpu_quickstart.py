"""docs/serving.md's section for a machine without a GPU, run exactly as written, and the
requests that stop a stock SGLang server sent to the server it starts.

The section's first command starts ``sglang-hybrid launch --tiny-model ...`` (the
``documented_cpu_server`` fixture); every other command of the section is run by the shell
as written once the server is ready. The server
then gets each request that kills a stock server (or that once killed ours) on the native
and OpenAI routes: each must be answered 400 with a message naming the field, and a normal
request must still give the output it gave before them.
"""

from __future__ import annotations

import contextlib
import json
import subprocess

import pytest
import requests

from sglang_hybrid.harness.server_process import process_group_members
from sglang_hybrid.replay.prometheus import parse_cache_metrics
from tiny_server import SERVER_ON_CPU_HOST, documented_cpu_commands

pytestmark = list(SERVER_ON_CPU_HOST)

# The tiny model's vocabulary (sglang_hybrid.engine.tiny_model_dirs.TINY_VOCAB_SIZE).
VOCAB_SIZE = 512


def test_the_section_starts_a_tiny_model_and_queries_it():
    launch, *queries = documented_cpu_commands()
    assert launch.startswith("sglang-hybrid launch --tiny-model ")
    assert queries and all(q.startswith("curl ") for q in queries)


@pytest.fixture(scope="module")
def quickstart(documented_cpu_server):
    """(base url, what each documented query printed, the server log)."""
    _, *queries = documented_cpu_commands()
    outputs = [
        subprocess.run(q, shell=True, capture_output=True, text=True, timeout=300, check=True).stdout
        for q in queries
    ]
    return documented_cpu_server.base_url, outputs, documented_cpu_server.log_path


def test_the_documented_commands_run_as_written(quickstart):
    _, (generated, chat, metrics), log_path = quickstart
    assert json.loads(generated)["meta_info"]["completion_tokens"] == 8
    chat = json.loads(chat)
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    assert chat["choices"][0]["meta_info"]["semantic_cache"][0]["restored_tokens"] >= 0
    assert metrics.startswith("sglang:semantic_token_hit_rate{")
    log = log_path.read_text()
    assert "CPU-only host, the semantic state cache runs with" in log
    assert "--disable-overlap-schedule" in log and "--device cpu" in log


def test_the_schedulers_run_with_a_fixed_mmap_threshold(documented_cpu_server):
    """Without it glibc moves the activations of each new prompt length onto its heap and the
    scheduler's memory grows with every request (bench/soak.py)."""
    schedulers = []
    for entry in process_group_members(documented_cpu_server.process.pid):
        with contextlib.suppress(OSError):
            if (entry / "comm").read_text().startswith("sglang::schedul"):
                schedulers.append((entry / "environ").read_bytes().split(b"\0"))
    assert schedulers
    assert all(b"MALLOC_MMAP_THRESHOLD_=131072" in environ for environ in schedulers)


def _generate(base_url: str, payload: dict) -> requests.Response:
    return requests.post(f"{base_url}/generate", json=payload, timeout=300)


NORMAL_REQUEST = {"input_ids": [5, 6, 7, 8, 9, 10, 11, 12], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}

# (route, payload, what the 400 message names)
SERVER_KILLERS = [
    ("/generate", {"input_ids": [1, 2, 3, 4, 5], "sampling_params": {"max_new_tokens": 3, "custom_params": "x"}}, "custom_params"),
    ("/generate", {"input_ids": [1, 2, 3, 4, 5], "sampling_params": {"max_new_tokens": 3, "custom_params": [1]}}, "custom_params"),
    ("/generate", {"text": "", "sampling_params": {"max_new_tokens": 3}}, "empty"),
    ("/generate", {"input_ids": [1, 2, VOCAB_SIZE], "sampling_params": {"max_new_tokens": 3}}, "input_ids[2]"),
    ("/generate", {"input_ids": [1, -3], "sampling_params": {"max_new_tokens": 3}}, "input_ids[1]"),
    ("/v1/completions", {"model": "default", "prompt": "", "max_tokens": 3}, "empty"),
    ("/v1/completions", {"model": "default", "prompt": [1, 2, VOCAB_SIZE + 7], "max_tokens": 3}, "input_ids[2]"),
    (
        "/v1/chat/completions",
        {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "custom_params": "x"},
        "custom_params",
    ),
]


def test_no_request_stops_the_server(quickstart):
    base_url = quickstart[0]
    before = _generate(base_url, NORMAL_REQUEST)
    assert before.status_code == 200
    for route, payload, named in SERVER_KILLERS:
        response = requests.post(f"{base_url}{route}", json=payload, timeout=300)
        assert response.status_code == 400, (route, payload, response.status_code, response.text)
        assert named in response.text, (route, payload, response.text)
    assert requests.get(f"{base_url}/health_generate", timeout=120).ok
    after = _generate(base_url, NORMAL_REQUEST)
    assert after.status_code == 200
    assert after.json()["output_ids"] == before.json()["output_ids"]


def test_openai_clients_see_restores_and_the_hit_rate_follows_every_request(quickstart):
    base_url = quickstart[0]
    messages = [{"role": "user", "content": "Summarize the repository layout, briefly."}]
    replies = []
    for turn in range(2):
        response = requests.post(
            f"{base_url}/v1/chat/completions",
            json={"model": "default", "messages": messages, "max_tokens": 4, "temperature": 0, "return_meta_info": True},
            timeout=300,
        )
        response.raise_for_status()
        replies.append(response.json())
        messages += [
            {"role": "assistant", "content": replies[-1]["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And the tests?"},
        ]
        cached = replies[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
        [report] = replies[-1]["choices"][0]["meta_info"]["semantic_cache"]
        assert cached == report["restored_tokens"]
        metrics = parse_cache_metrics(requests.get(f"{base_url}/metrics", timeout=60).text)
        restored, recomputed = metrics["tokens_restored_total"], metrics["tokens_recomputed_total"]
        assert metrics["token_hit_rate"] == pytest.approx(restored / (restored + recomputed))
    # The second call extends the first: at least the first prompt's end state is restored.
    assert replies[1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= replies[0]["usage"]["prompt_tokens"]
