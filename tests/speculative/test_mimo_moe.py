"""MiMo-V2-Flash's routed experts against a per-token loop written here: every token's output is
the sum over its chosen experts of weight x SwiGLU expert(token). Both dispatch paths (torch's
grouped GEMM, and the padded batch over experts used where it does not run) must agree with it."""

from __future__ import annotations

import pytest
import torch

import hal.speculative.mimo as mimo
from hal.speculative.mimo import MoE
from hal.speculative.mimo_config import MiMoConfig

RAW = {  # the published config.json form, one MoE layer
    "model_type": "mimo_v2_flash", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
    "hybrid_layer_pattern": [1], "moe_layer_freq": [1], "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 16, "v_head_dim": 8, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 16,
    "swa_v_head_dim": 8, "sliding_window_size": 4, "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
    "attention_value_scale": 0.707, "rope_theta": 5_000_000, "swa_rope_theta": 10_000, "partial_rotary_factor": 0.334,
    "layernorm_epsilon": 1e-5, "n_routed_experts": 8, "moe_intermediate_size": 24, "num_experts_per_tok": 3,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "n_shared_experts": None, "tie_word_embeddings": False, "max_position_embeddings": 128,
}  # fmt: skip


def per_token_oracle(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    experts, weights = moe.route(x)
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        for e, w in zip(experts[t].tolist(), weights[t].tolist()):
            xt = x[t].double()
            act = torch.nn.functional.silu(moe.gate_proj[e].double() @ xt) * (moe.up_proj[e].double() @ xt)
            out[t] += w * (moe.down_proj[e].double() @ act)
    return out


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped GEMM", "padded batch"])
@pytest.mark.parametrize("tokens", [1, 4, 37])
def test_routed_experts_match_a_per_token_loop(grouped: bool, tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    moe = MoE(MiMoConfig.from_dict(RAW))
    gen = torch.Generator().manual_seed(tokens)
    with torch.no_grad():
        for p in (moe.gate_weight, moe.gate_proj, moe.up_proj, moe.down_proj):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        moe.e_score_correction_bias.copy_(torch.randn(8, generator=gen) * 0.1)
        x = torch.randn(tokens, 32, generator=gen)
        if not grouped:
            monkeypatch.setattr(mimo, "_grouped_matmul_works", lambda x, *dims: False)
        else:
            assert mimo._grouped_matmul_works(x, 24), "torch's grouped GEMM does not run here"
        torch.testing.assert_close(moe(x).double(), per_token_oracle(moe, x), atol=1e-4, rtol=1e-4)
