"""A real ``sglang.launch_server`` on this host, serving a tiny random-weight Qwen3-Next.

The model is generated on the spot (``write_tiny_qwen3_next``) and the server runs in its
own process group (``SGLangServer``) so that every process it forks (scheduler,
detokenizer) dies with it. The launch flags are the ones a CPU-only host needs
(docs: /work/shared/notes/sglang-cpu-server-probe.md); the CPU fallbacks themselves load in
every SGLang process through our plugin, not from here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import pytest
import requests
import torch

from sglang_hybrid.replay.shared_data import QWEN3_TEMPLATE

# The marks of a test that starts these servers: slow, and only on a host without CUDA,
# whose code paths (TRITON_INTERPRET, the torch fallbacks) it exercises.
SERVER_ON_CPU_HOST = (
    pytest.mark.slow,
    pytest.mark.skipif(
        torch.cuda.is_available(),
        reason="exercises the CPU-host path (TRITON_INTERPRET, torch fallbacks)",
    ),
)

TINY_VOCAB_SIZE = 512
EOS_TOKEN_ID = TINY_VOCAB_SIZE - 1
# SGLang's Qwen3-Next config derives its layer kinds from this field; transformers 5.x
# writes only ``layer_types``, so it has to be added (and must agree with layer_types).
FULL_ATTENTION_INTERVAL = 2
ROPE_THETA = 10000.0

# Start-up on two cores takes ~35 s (most of it allocating the KV and state pools).
STARTUP_TIMEOUT_S = 240.0

# Stands in for the Qwen3 chat template (QWEN3_TEMPLATE, in the shared data checkout, never
# copied into this repository) where that checkout is absent.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen3's added tokens that chat prompts use. As in Qwen3, these two and <|im_end|> are
# special (left out of decoded text); the tags decode as text.
CHAT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>")
CHAT_TAG_TOKENS = (
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)  # fmt: skip
# Qwen3's end of turn, at the model's EOS id so that SGLang stops on it.
END_OF_TURN_TOKEN = "<|im_end|>"
UNKNOWN_TOKEN = "<unk>"


def write_tiny_qwen3_next(model_dir: Path, seed: int = 0) -> Path:
    """Save a 4-layer (GDN, attention, GDN, attention) MoE Qwen3-Next with random weights."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    num_layers = 4
    config = Qwen3NextConfig(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        layer_types=[
            "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
            for i in range(num_layers)
        ],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        max_position_embeddings=2048,
        eos_token_id=EOS_TOKEN_ID,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(model_dir, safe_serialization=True)

    config_path = model_dir / "config.json"
    saved = json.loads(config_path.read_text())
    saved["full_attention_interval"] = FULL_ATTENTION_INTERVAL
    saved["rope_theta"] = ROPE_THETA
    saved["eos_token_id"] = EOS_TOKEN_ID
    config_path.write_text(json.dumps(saved, indent=2))
    return model_dir


def _character_vocabulary(size: int) -> list[str]:
    """Tab, newline, printable ASCII, then Latin-1 letters and onwards: ``size`` characters."""
    characters = ["\t", "\n", *map(chr, range(0x20, 0x7F))]
    codepoint = 0xA1  # past the C1 controls, which str.splitlines() would treat as breaks
    while len(characters) < size:
        characters.append(chr(codepoint))
        codepoint += 1
    return characters


def write_chat_tokenizer(model_dir: Path, template_path: Path = QWEN3_TEMPLATE) -> Path:
    """Save an offline character-level tokenizer with Qwen3's chat tokens into ``model_dir``.

    Every one of the ``TINY_VOCAB_SIZE`` ids decodes to text that encodes back to that id
    alone (one character per id, no merges), so whatever a random-weight model generates
    survives the text round trip an agent makes when it re-sends its history: the prompt it
    sends next begins with exactly the tokens the server generated, as with a real model.
    The unknown token, ``<|endoftext|>`` and ``<|im_start|>`` are the exceptions (special,
    dropped from decoded text); ``<|im_end|>`` ends generation. The chat template is Qwen3's
    (``template_path``) or, when that file is absent, plain ChatML.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    added = [UNKNOWN_TOKEN, *CHAT_SPECIAL_TOKENS, *CHAT_TAG_TOKENS, END_OF_TURN_TOKEN]
    characters = _character_vocabulary(TINY_VOCAB_SIZE - len(added))
    vocab = {token: index for index, token in enumerate([*characters, *added])}
    assert vocab[END_OF_TURN_TOKEN] == EOS_TOKEN_ID

    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNKNOWN_TOKEN))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (UNKNOWN_TOKEN, *CHAT_SPECIAL_TOKENS)]
    )
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in CHAT_TAG_TOKENS])
    backend.add_special_tokens([AddedToken(END_OF_TURN_TOKEN, special=True, normalized=False)])

    template_path = Path(template_path)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token=UNKNOWN_TOKEN,
        eos_token=END_OF_TURN_TOKEN,
        pad_token="<|endoftext|>",
        # Decoding must not rewrite text (" ." -> "."), or the round trip breaks.
        clean_up_tokenization_spaces=False,
        chat_template=template_path.read_text() if template_path.exists() else CHATML_TEMPLATE,
    )
    assert len(tokenizer) == TINY_VOCAB_SIZE
    tokenizer.save_pretrained(model_dir)
    return model_dir


def free_local_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


CPU_LAUNCH_FLAGS = [
    "--device", "cpu",
    "--dtype", "bfloat16",
    "--skip-tokenizer-init",
    "--attention-backend", "torch_native",
    "--disable-cuda-graph",
    "--disable-overlap-schedule",
    "--page-size", "1",
    "--mamba-radix-cache-strategy", "no_buffer",
    "--sampling-backend", "pytorch",
    "--grammar-backend", "none",
    "--max-total-tokens", "4096",
    "--chunked-prefill-size", "512",
    "--max-running-requests", "4",
    # An idle scheduler busy-polls its sockets otherwise, which on two cores starves
    # whichever server is working.
    "--sleep-on-idle",
]  # fmt: skip
# For servers that take text: the model directory then needs ``write_chat_tokenizer``.
CPU_CHAT_LAUNCH_FLAGS = [flag for flag in CPU_LAUNCH_FLAGS if flag != "--skip-tokenizer-init"]


class SGLangServer:
    """One ``python -m sglang.launch_server`` subprocess, in a process group of its own."""

    def __init__(
        self,
        model_dir: Path,
        extra_args: list[str],
        env: Optional[dict[str, str]] = None,
        log_path: Optional[Path] = None,
        launch_flags: Sequence[str] = CPU_LAUNCH_FLAGS,
    ):
        self.port = free_local_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", str(model_dir),
            "--host", "127.0.0.1",
            "--port", str(self.port),
            *launch_flags,
            *extra_args,
        ]  # fmt: skip
        # The interpreter runs the Triton kernels that have no torch fallback (there is
        # no Triton driver without a GPU).
        full_env = {**os.environ, "TRITON_INTERPRET": "1", **(env or {})}
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(
            command,
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.startup_s: Optional[float] = None

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> float:
        """Block until the server answers /health_generate; return the start-up time."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"sglang server exited with {self.process.returncode} during start-up; "
                    f"log: {self.log_tail()}"
                )
            try:
                if requests.get(f"{self.base_url}/health_generate", timeout=30).ok:
                    self.startup_s = time.monotonic() - started
                    return self.startup_s
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"sglang server not ready after {timeout_s} s; log: {self.log_tail()}")

    def generate(self, input_ids: list[int], max_new_tokens: int, **extra) -> dict:
        payload = {
            "input_ids": input_ids,
            "sampling_params": {
                "temperature": 0.0,
                "max_new_tokens": max_new_tokens,
                "ignore_eos": True,
            },
            **extra,
        }
        response = requests.post(f"{self.base_url}/generate", json=payload, timeout=300)
        response.raise_for_status()
        return response.json()

    def num_running_requests(self) -> int:
        loads = requests.get(f"{self.base_url}/v1/loads", timeout=30).json()["loads"]
        return sum(load["num_running_reqs"] for load in loads)

    def log_tail(self, num_chars: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self) -> None:
        """Kill the whole process group: the launcher, scheduler and detokenizer."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=20)
            except ProcessLookupError:
                pass
        # Children re-parented after the launcher exited still carry its group id.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self._log is not subprocess.DEVNULL:
            self._log.close()
