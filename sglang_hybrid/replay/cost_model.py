"""TTFT cost model: prefill recompute, checkpoint copy and host restore, per model x GPU profile.

Every number is a public figure (model config.json, GPU datasheet) or a stated assumption; the
model is a roofline for a request served alone, which is what the sim replays:

  recompute(start, n) = (n * dense_flops_per_token + attention_flops(start, n)) / (peak * efficiency)
      dense part: 2 FLOPs per active parameter per token (matmuls, MoE counts only routed experts)
                  + the recurrent state update per linear-attention layer and token;
      attention part: per attention layer and token at position p, QK^T and PV cost 4*q_heads*head_dim*p.
  checkpoint_copy = 2 * checkpoint_bytes / hbm_bandwidth   (read + write, device to device)
  host_restore    = checkpoint_bytes / pcie_bandwidth      (host pinned memory -> device)
      pcie_bandwidth: achieved host-to-device rate of a PCIe x16 link from pinned memory, per the
      profile's GPU: Gen4 (32 GB/s raw) ~25 GB/s, Gen5 (64 GB/s raw) ~55 GB/s.

Prefill efficiency (achieved / peak FLOPs) is an assumption: 0.4 for a 3B-active MoE prefill in
bf16, the same on all three GPUs so profiles differ only by published hardware figures.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class ModelGeometry:
    """What the cost model needs from a hybrid model's config.json."""

    name: str
    active_params: float  # parameters touched per token (MoE: routed experts only)
    recurrent_layers: int
    recurrent_state_bytes_per_layer: int  # conv state (bf16) + temporal state (fp32, SGLang default)
    recurrent_flops_per_token_per_layer: float
    attention_layers: int
    attention_q_heads: int
    attention_kv_heads: int
    attention_head_dim: int

    @property
    def checkpoint_bytes(self) -> int:
        return self.recurrent_layers * self.recurrent_state_bytes_per_layer

    @property
    def kv_bytes_per_token(self) -> int:
        # K and V, bf16, over all attention layers.
        return self.attention_layers * 2 * self.attention_kv_heads * self.attention_head_dim * 2

    @property
    def dense_flops_per_token(self) -> float:
        return 2.0 * self.active_params + self.recurrent_layers * self.recurrent_flops_per_token_per_layer

    @property
    def attention_flops_per_context_token(self) -> float:
        return self.attention_layers * 4.0 * self.attention_q_heads * self.attention_head_dim


def _gdn_layer(key_heads: int, value_heads: int, head_dim: int, conv_kernel: int) -> tuple[int, float]:
    """Gated DeltaNet layer: (state bytes, FLOPs per token).

    conv state: (2*key_heads + value_heads)*head_dim channels x (kernel-1) taps, bf16;
    temporal state: value_heads x head_dim x head_dim, fp32. Per token the delta rule reads the
    state with k, writes a rank-1 update and reads it with q: about 6 FLOPs per state element.
    """
    conv_channels = (2 * key_heads + value_heads) * head_dim
    temporal_elements = value_heads * head_dim * head_dim
    return conv_channels * (conv_kernel - 1) * 2 + temporal_elements * 4, 6.0 * temporal_elements


def _mamba2_layer(heads: int, head_dim: int, state_size: int, groups: int, conv_kernel: int) -> tuple[int, float]:
    """Mamba-2 layer: conv over x, B, C channels (bf16) + SSM state heads x head_dim x state (fp32).

    Per token the SSD recurrence decays and updates the state and reads it with C: about 6 FLOPs
    per state element.
    """
    conv_channels = heads * head_dim + 2 * groups * state_size
    temporal_elements = heads * head_dim * state_size
    return conv_channels * (conv_kernel - 1) * 2 + temporal_elements * 4, 6.0 * temporal_elements


_QWEN3_NEXT_GDN = _gdn_layer(key_heads=16, value_heads=32, head_dim=128, conv_kernel=4)
_NEMOTRON_MAMBA2 = _mamba2_layer(heads=64, head_dim=64, state_size=128, groups=8, conv_kernel=4)

# Qwen/Qwen3-Next-80B-A3B-Instruct config.json: 48 layers (36 Gated DeltaNet + 12 gated attention),
# 3B activated parameters; attention 16 Q heads, 2 KV heads, head_dim 256. Checkpoint 73.7 MiB.
QWEN3_NEXT_80B = ModelGeometry(
    name="qwen3-next-80b-a3b",
    active_params=3.0e9,
    recurrent_layers=36,
    recurrent_state_bytes_per_layer=_QWEN3_NEXT_GDN[0],
    recurrent_flops_per_token_per_layer=_QWEN3_NEXT_GDN[1],
    attention_layers=12,
    attention_q_heads=16,
    attention_kv_heads=2,
    attention_head_dim=256,
)
# Qwen/Qwen3.5-35B-A3B config.json: 40 layers in the same 3:1 layout (30 GDN + 10 attention), same
# GDN and attention geometry as Qwen3-Next, 3B activated parameters.
QWEN35_35B_A3B = ModelGeometry(
    name="qwen3.5-35b-a3b",
    active_params=3.0e9,
    recurrent_layers=30,
    recurrent_state_bytes_per_layer=_QWEN3_NEXT_GDN[0],
    recurrent_flops_per_token_per_layer=_QWEN3_NEXT_GDN[1],
    attention_layers=10,
    attention_q_heads=16,
    attention_kv_heads=2,
    attention_head_dim=256,
)
# nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B config.json: 52 layers = 23 Mamba-2 + 23 MoE + 6 attention;
# Mamba-2 64 heads x 64, state 128, 8 groups, conv 4; attention 32 Q heads, 2 KV heads, head_dim 128;
# 3.2B activated parameters (without embeddings).
NEMOTRON3_NANO_30B = ModelGeometry(
    name="nemotron-3-nano-30b-a3b",
    active_params=3.2e9,
    recurrent_layers=23,
    recurrent_state_bytes_per_layer=_NEMOTRON_MAMBA2[0],
    recurrent_flops_per_token_per_layer=_NEMOTRON_MAMBA2[1],
    attention_layers=6,
    attention_q_heads=32,
    attention_kv_heads=2,
    attention_head_dim=128,
)


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_bf16_flops: float  # dense tensor-core bf16 with fp32 accumulation
    hbm_bytes_per_s: float
    pcie_bytes_per_s: float  # achieved host->device copy rate, pinned memory


# H200 SXM datasheet: 989 TFLOPS bf16 dense, 4.8 TB/s HBM3e; PCIe Gen5 x16 (64 GB/s raw, ~55 achieved).
H200 = Hardware("h200", peak_bf16_flops=989e12, hbm_bytes_per_s=4.8e12, pcie_bytes_per_s=55e9)
# RTX 4090 (Ada whitepaper): 165.2 TFLOPS bf16 with fp32 accumulate, 1,008 GB/s GDDR6X;
# PCIe Gen4 x16 (32 GB/s raw, ~25 achieved).
RTX4090 = Hardware("rtx4090", peak_bf16_flops=165.2e12, hbm_bytes_per_s=1008e9, pcie_bytes_per_s=25e9)
# RTX 5090 (Blackwell whitepaper): 209.5 TFLOPS bf16 with fp32 accumulate, 1,792 GB/s GDDR7;
# PCIe Gen5 x16 (64 GB/s raw, ~55 achieved).
RTX5090 = Hardware("rtx5090", peak_bf16_flops=209.5e12, hbm_bytes_per_s=1792e9, pcie_bytes_per_s=55e9)

PREFILL_EFFICIENCY = 0.4


@dataclass(frozen=True)
class CostProfile:
    name: str
    model: ModelGeometry
    hardware: Hardware
    # Attention block size vLLM uses for this model in mamba_cache_mode=align (one attention page
    # must hold at least one recurrent-state page), i.e. the spacing of vLLM's state checkpoints.
    vllm_block_size: int
    prefill_efficiency: float = PREFILL_EFFICIENCY

    @property
    def checkpoint_bytes(self) -> int:
        return self.model.checkpoint_bytes

    def prefill_flops(self, start: int, num_tokens: int) -> float:
        """FLOPs to prefill tokens [start, start+num_tokens) given the context before `start`."""
        if num_tokens <= 0:
            return 0.0
        # Sum over new tokens of the context each attends to: start+1 .. start+num_tokens.
        attended = num_tokens * start + num_tokens * (num_tokens + 1) / 2.0
        return num_tokens * self.model.dense_flops_per_token + attended * self.model.attention_flops_per_context_token

    def recompute_s(self, start: int, num_tokens: int) -> float:
        return self.prefill_flops(start, num_tokens) / (self.hardware.peak_bf16_flops * self.prefill_efficiency)

    def checkpoint_copy_s(self) -> float:
        return 2.0 * self.checkpoint_bytes / self.hardware.hbm_bytes_per_s

    def host_restore_s(self) -> float:
        return self.checkpoint_bytes / self.hardware.pcie_bytes_per_s

    def ttft_s(self, restored_depth: int, recomputed_tokens: int, restored_from_host: bool = False) -> float:
        """Time to first token of a request served alone: restore copy (if any) + recompute of the rest.

        A checkpoint restored from the host tier first crosses PCIe into a device slot (the
        promotion), then is copied into the request's slot like any device checkpoint.
        """
        if restored_from_host and restored_depth <= 0:
            raise ValueError("a restore from the host tier needs a restored depth > 0")
        restore = self.checkpoint_copy_s() if restored_depth > 0 else 0.0
        if restored_from_host:
            restore += self.host_restore_s()
        return restore + self.recompute_s(restored_depth, recomputed_tokens)

    def slots_for_gib(self, gib: float) -> int:
        return int(gib * GIB // self.checkpoint_bytes)


PROFILES: dict[str, CostProfile] = {
    # 528: the attention block vLLM logs for Qwen3.5-class GDN models (vLLM issue #40696);
    # Qwen3-Next has the same per-layer GDN and attention geometry.
    "qwen3-next-80b@h200": CostProfile("qwen3-next-80b@h200", QWEN3_NEXT_80B, H200, vllm_block_size=528),
    "qwen3.5-35b-a3b@rtx4090": CostProfile("qwen3.5-35b-a3b@rtx4090", QWEN35_35B_A3B, RTX4090, vllm_block_size=528),
    # 1072: vLLM's page rule applied to Nemotron-H: bf16 Mamba-2 page 1,085,440 B over 1,024 B of KV
    # per token and attention layer = 1,060 tokens, rounded up to a multiple of 16.
    "nemotron-3-nano-30b@rtx5090": CostProfile(
        "nemotron-3-nano-30b@rtx5090", NEMOTRON3_NANO_30B, RTX5090, vllm_block_size=1072
    ),
}
DEFAULT_PROFILE = "qwen3-next-80b@h200"


def get_profile(name: str) -> CostProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown cost profile {name!r}; known: {', '.join(PROFILES)}") from None
