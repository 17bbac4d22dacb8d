"""The torch_npu emulator on its own: hand-computed FIA v2 results, every rejection rule it
enforces, npu_scatter_nd_update_, and the NPUGraph capture/replay/update semantics."""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from hal.backends.npu import emulator
from hal.backends.npu.emulator import CaptureSyncError, NpuOpError

INT_MAX = 2147483647
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def torch_npu() -> Any:
    with emulator.emulated() as module:
        yield module


def template(dtype: torch.dtype = torch.bool) -> torch.Tensor:
    return torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1).to(dtype)


def paged(per_request: list[torch.Tensor], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack per-request rows [S_b, N, D] into a 3-D paged cache (blocks, bs, N*D) with a shuffled block table.

    Block 0 stays unused (as the padding page); requests get blocks in descending order so the
    table is not the identity.
    """
    n, d = per_request[0].shape[1], per_request[0].shape[2]
    need = [-(-x.shape[0] // block_size) for x in per_request]
    total = sum(need) + 1
    cache = torch.full((total, block_size, n, d), 99.0, dtype=per_request[0].dtype)
    table = torch.zeros(len(per_request), max(max(need), 1), dtype=torch.int32)
    free = list(range(total - 1, 0, -1))
    for b, rows in enumerate(per_request):
        for i in range(need[b]):
            blk = free.pop(0)
            table[b, i] = blk
            chunk = rows[i * block_size : (i + 1) * block_size]
            cache[blk, : chunk.shape[0]] = chunk
    return cache.reshape(total, block_size, n * d), table


def ramp(length: int, heads: int, dim: int, dtype: torch.dtype = BF16, scale: float = 1.0) -> torch.Tensor:
    """Row j of every head holds the constant j * scale: a mean over visible keys is easy to write down."""
    return (torch.arange(length, dtype=torch.float32) * scale).view(-1, 1, 1).expand(length, heads, dim).to(dtype)


def fia(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    q_lens: list[int],
    *,
    block_size: int = 16,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    k_cache, table = paged(keys, block_size)
    v_cache, _ = paged(values, block_size)
    cum = list(itertools.accumulate(q_lens))
    call: dict[str, Any] = {
        "atten_mask": template(),
        "actual_seq_qlen": cum,
        "actual_seq_kvlen": [k.shape[0] for k in keys],
        "block_table": table,
        "num_query_heads": q.shape[1],
        "num_key_value_heads": keys[0].shape[1],
        "softmax_scale": 1.0,
        "input_layout": "TND",
        "sparse_mode": 3,
        "block_size": block_size,
    }
    call.update(kwargs)
    return emulator.FIA_V2(q, k_cache, v_cache, **call)  # type: ignore[no-any-return]


def rows_equal(out: torch.Tensor, expected: list[list[float]], atol: float = 0.0) -> None:
    """out[t, h, :] must equal expected[t][h] on every dim."""
    want = torch.tensor(expected, dtype=torch.float32)[..., None].expand(out.shape[0], out.shape[1], out.shape[2])
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=0)


# ------------------------------------------------------------------------------ FIA results
def test_causal_mode3_is_bottom_right_aligned_per_request() -> None:
    # zero queries -> equal scores -> each row averages the V rows it may see (V row j == j).
    q = torch.zeros(3, 1, 128, dtype=BF16)
    keys = [torch.zeros(3, 1, 128, dtype=BF16), torch.zeros(2, 1, 128, dtype=BF16)]
    values = [ramp(3, 1, 128), ramp(2, 1, 128, scale=10.0) + 10]
    out, lse = fia(q, keys, values, [2, 1])
    # request 0: rows at positions 1, 2 see {0,1} and {0,1,2}; request 1 (V = 10, 20): row at 1 sees both
    rows_equal(out, [[0.5], [1.0], [15.0]])
    assert out.dtype == BF16 and out.shape == (3, 1, 128)
    assert lse.dtype == torch.float32 and lse.numel() == 0  # placeholder without return_softmax_lse


def test_band_mode4_window_is_pre_tokens_plus_diagonal() -> None:
    q = torch.zeros(2, 1, 128, dtype=BF16)
    out, _ = fia(q, [torch.zeros(5, 1, 128, dtype=BF16)], [ramp(5, 1, 128)], [2], sparse_mode=4, pre_tokens=1, next_tokens=0)
    # rows at positions 3 and 4 see [2, 3] and [3, 4]
    rows_equal(out, [[2.5], [3.5]])


def test_mode0_without_mask_sees_every_key() -> None:
    q = torch.zeros(2, 1, 128, dtype=BF16)
    out, _ = fia(q, [torch.zeros(3, 1, 128, dtype=BF16)], [ramp(3, 1, 128)], [2], sparse_mode=0, atten_mask=None)
    rows_equal(out, [[1.0], [1.0]])


def test_softmax_scale_weights_keys_by_exp_of_scaled_scores() -> None:
    # q = e0, k0 = 0, k1 = e0: scores 0 and ln 3 after scaling -> weights 1/4 and 3/4
    q = torch.zeros(1, 1, 128, dtype=torch.float16)
    q[0, 0, 0] = 1
    k = torch.zeros(2, 1, 128, dtype=torch.float16)
    k[1, 0, 0] = 1
    v = ramp(2, 1, 128, torch.float16, scale=4.0)
    out, lse = fia(q, [k], [v], [1], softmax_scale=math.log(3), return_softmax_lse=True)
    rows_equal(out, [[3.0]], atol=2e-3)
    torch.testing.assert_close(lse, torch.full((1, 1, 1), math.log(4.0)), atol=1e-4, rtol=0)


def test_gqa_query_head_h_reads_kv_head_h_div_group() -> None:
    q = torch.zeros(1, 4, 128, dtype=BF16)
    v = torch.stack([torch.full((2, 128), 1.0), torch.full((2, 128), 2.0)], dim=1).to(BF16)  # kv head h holds h+1
    out, _ = fia(q, [torch.zeros(2, 2, 128, dtype=BF16)], [v], [1])
    rows_equal(out, [[1.0, 1.0, 2.0, 2.0]])


def test_learnable_sink_only_enlarges_the_denominator() -> None:
    q = torch.zeros(1, 2, 128, dtype=BF16)
    sink = torch.tensor([1.0, -math.inf], dtype=BF16)
    out, lse = fia(
        q, [torch.zeros(3, 1, 128, dtype=BF16)], [ramp(3, 1, 128)], [1],
        learnable_sink=sink, softmax_scale=0.5, return_softmax_lse=True,
    )  # fmt: skip
    # head 0: (0 + 1 + 2) / (3 + e^1) -- the sink logit is not scaled; head 1: a -inf sink adds nothing
    rows_equal(out, [[3 / (3 + math.e), 1.0]], atol=4e-3)
    torch.testing.assert_close(lse[0, :, 0], torch.tensor([math.log(3 + math.e), math.log(3.0)]), atol=1e-5, rtol=0)


def test_fully_masked_rows_give_zero_and_infinite_lse() -> None:
    # band with next_tokens=-1, pre_tokens=2 (pre + next >= 0): the row at position 0 sees nothing
    q = torch.zeros(2, 1, 128, dtype=BF16)
    keys = [torch.zeros(1, 1, 128, dtype=BF16), torch.zeros(3, 1, 128, dtype=BF16)]
    values = [ramp(1, 1, 128) + 7, ramp(3, 1, 128)]
    out, lse = fia(q, keys, values, [1, 1], sparse_mode=4, pre_tokens=2, next_tokens=-1, return_softmax_lse=True)
    rows_equal(out, [[0.0], [0.5]])  # request 1: position 2 sees [0, 1]
    assert math.isinf(lse[0, 0, 0].item()) and lse[0, 0, 0] > 0


def test_qk_192_v_128_output_takes_the_value_head_dim() -> None:
    q = torch.zeros(3, 2, 192, dtype=BF16)
    keys = [torch.zeros(130, 1, 192, dtype=BF16), torch.zeros(2, 1, 192, dtype=BF16)]
    values = [ramp(130, 1, 128), ramp(2, 1, 128)]
    out, _ = fia(q, keys, values, [2, 1], block_size=128)
    assert out.shape == (3, 2, 128)
    # request 0 rows at positions 128, 129 average 0..128 and 0..129; request 1 row at 1 averages {0, 1}
    rows_equal(out, [[64.0, 64.0], [64.5, 64.5], [0.5, 0.5]], atol=0.25)


def test_four_dim_cache_layout_matches_three_dim() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 128, generator=g).to(BF16)
    keys = [torch.randn(20, 2, 128, generator=g).to(BF16), torch.randn(5, 2, 128, generator=g).to(BF16)]
    values = [torch.randn(20, 2, 128, generator=g).to(BF16), torch.randn(5, 2, 128, generator=g).to(BF16)]
    out3, _ = fia(q, keys, values, [2, 1], softmax_scale=0.1)
    k3, table = paged(keys, 16)
    v3, _ = paged(values, 16)
    k4 = k3.view(k3.shape[0], 16, 2, 128).transpose(1, 2).contiguous()
    v4 = v3.view(v3.shape[0], 16, 2, 128).transpose(1, 2).contiguous()
    out4, _ = emulator.FIA_V2(
        q, k4, v4, atten_mask=template(), actual_seq_qlen=[2, 3], actual_seq_kvlen=[20, 5], block_table=table,
        num_query_heads=2, num_key_value_heads=2, softmax_scale=0.1, input_layout="TND", sparse_mode=3, block_size=16,
    )  # fmt: skip
    assert torch.equal(out3, out4)


def test_int8_template_mask_and_tuple_lengths_are_accepted() -> None:
    q = torch.zeros(1, 1, 128, dtype=BF16)
    out, _ = fia(q, [torch.zeros(2, 1, 128, dtype=BF16)], [ramp(2, 1, 128)], [1], atten_mask=template(torch.int8), actual_seq_qlen=(1,))
    rows_equal(out, [[0.5]])


def test_block_size_16_is_legal_for_qk_192_single_token_queries() -> None:
    q = torch.zeros(2, 1, 192, dtype=BF16)
    keys = [torch.zeros(20, 1, 192, dtype=BF16), torch.zeros(3, 1, 192, dtype=BF16)]
    out, _ = fia(q, keys, [ramp(20, 1, 128), ramp(3, 1, 128)], [1, 1], block_size=16)
    rows_equal(out, [[9.5], [1.0]])


# ------------------------------------------------------------------------------ FIA rejections
def base_call() -> tuple[list[torch.Tensor], dict[str, Any]]:
    """A valid call: 2 requests (q 2/1, kv 3/2), 2 query heads on 1 kv head, D = 128, page 16."""
    q = torch.zeros(3, 2, 128, dtype=BF16)
    k_cache, table = paged([torch.zeros(3, 1, 128, dtype=BF16), torch.zeros(2, 1, 128, dtype=BF16)], 16)
    v_cache, _ = paged([torch.zeros(3, 1, 128, dtype=BF16), torch.zeros(2, 1, 128, dtype=BF16)], 16)
    kwargs: dict[str, Any] = {
        "atten_mask": template(),
        "actual_seq_qlen": [2, 3],
        "actual_seq_kvlen": [3, 2],
        "block_table": table,
        "num_query_heads": 2,
        "num_key_value_heads": 1,
        "softmax_scale": 0.1,
        "input_layout": "TND",
        "sparse_mode": 3,
        "block_size": 16,
    }
    return [q, k_cache, v_cache], kwargs


def with_dims(dk: int, dv: int, block_size: int = 16) -> Callable[[list, dict], None]:
    """The base call with other head dims (and cache shapes to match)."""

    def mutate(args: list, kwargs: dict) -> None:
        args[0] = torch.zeros(3, 2, dk, dtype=BF16)
        args[1] = torch.zeros(3, block_size, dk, dtype=BF16)
        args[2] = torch.zeros(3, block_size, dv, dtype=BF16)
        kwargs["block_size"] = block_size

    return mutate


def kw(**changes: Any) -> Callable[[list, dict], None]:
    def mutate(args: list, kwargs: dict) -> None:
        for name, value in changes.items():
            if value is _DROP:
                kwargs.pop(name)
            else:
                kwargs[name] = value(kwargs) if callable(value) else value

    return mutate


_DROP = object()


def arg(index: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[list, dict], None]:
    def mutate(args: list, kwargs: dict) -> None:
        args[index] = fn(args[index])

    return mutate


def both(*mutations: Callable[[list, dict], None]) -> Callable[[list, dict], None]:
    def mutate(args: list, kwargs: dict) -> None:
        for m in mutations:
            m(args, kwargs)

    return mutate


REJECTIONS: dict[str, tuple[Callable[[list, dict], None], str]] = {
    "unknown layout": (kw(input_layout="TNDX"), "layout only support"),
    "query dim vs layout": (arg(0, lambda q: q.unsqueeze(0)), "query's dim should be consistent"),
    "zero query heads": (kw(num_query_heads=0), "num_query_heads must be > 0"),
    "heads not divisible": (kw(num_key_value_heads=3), "must be a multiple of num_key_value_heads"),
    "gqa ratio above 64": (kw(num_query_heads=130), "exceeds 64"),
    "per-request (non-cumulative) actual_seq_qlen": (kw(actual_seq_qlen=[2, 1]), "must be cumulative"),
    "negative actual_seq_qlen": (kw(actual_seq_qlen=[-1, 3]), "negative"),
    "last cumulative q != T": (kw(actual_seq_qlen=[1, 2]), r"actual_seq_qlen\[-1\]=2 must equal the query's T=3"),
    "TND without actual_seq_qlen": (kw(actual_seq_qlen=_DROP), "requires actual_seq_qlen"),
    "paged without actual_seq_kvlen": (kw(actual_seq_kvlen=_DROP), "requires actual_seq_kvlen"),
    "actual_seq_kvlen length != B": (kw(actual_seq_kvlen=[3]), "actual_seq_kvlen has 1 entries"),
    "mode 3 without mask": (kw(atten_mask=None), "atten_mask should not be null"),
    "mode 3 mask not 2048": (kw(atten_mask=torch.ones(1024, 1024, dtype=torch.bool).triu(1)), r"needs a \(2048, 2048\)"),
    "mask float dtype": (kw(atten_mask=template(torch.float16)), "dtype must be bool, int8 or uint8"),
    "mask not the template": (kw(atten_mask=torch.ones(2048, 2048, dtype=torch.bool).tril()), "template"),
    "sparse_mode 5": (kw(sparse_mode=5), "not supported by FIA"),
    "sparse_mode 9": (kw(sparse_mode=9), r"must be in 0\.\.4"),
    "sparse_mode 1 in TND": (kw(sparse_mode=1), "TND supports sparse_mode 0"),
    "mode 0 with a mask in TND": (kw(sparse_mode=0), "TND supports sparse_mode 0"),
    "pre + next < 0": (kw(sparse_mode=4, pre_tokens=1, next_tokens=-2), "Nexttoken line should be higher"),
    "block_table int64": (kw(block_table=lambda k: k["block_table"].long()), "block_table must be int32"),
    "block_table 1-D": (kw(block_table=lambda k: k["block_table"][:, 0]), "must be 2-D"),
    "block_table rows != B": (kw(block_table=lambda k: k["block_table"][:1]), "1 rows for B=2"),
    "block_table too narrow": (kw(actual_seq_kvlen=[17, 2]), "fewer than maxBlockNumPerSeq=2"),
    "block_size 0": (kw(block_size=0), "block_size must be > 0"),
    "block_size 8 for D 128": (kw(block_size=8), "a multiple of 16 in \\[16, 1024\\]"),
    "block_size 2048 for D 128": (kw(block_size=2048), "a multiple of 16 in \\[16, 1024\\]"),
    "block_size 64 for D 192 multi-token": (with_dims(192, 128, block_size=64), "a multiple of 128 in \\[128, 512\\]"),
    "cache block dim != block_size": (kw(block_size=32), "3-D key cache must be"),
    "cache hidden != N_kv * D": (kw(num_key_value_heads=2), "3-D key cache must be"),
    "fp32 query": (
        both(arg(0, lambda x: x.float()), arg(1, lambda x: x.float()), arg(2, lambda x: x.float())),
        "query dtype must be float16 or bfloat16",
    ),
    "key dtype != query": (arg(1, lambda x: x.half()), "must equal the query dtype"),
    "sink not bf16": (kw(learnable_sink=torch.zeros(2)), "learnable_sink must be bfloat16"),
    "sink wrong shape": (kw(learnable_sink=torch.zeros(3, dtype=BF16)), r"shape \(num_query_heads,\)"),
    "sink with BSND": (
        both(arg(0, lambda q: q.unsqueeze(0)), kw(input_layout="BSND", learnable_sink=torch.zeros(2, dtype=BF16))),
        "only supported with input_layout TND",
    ),
    "sink needs inner_precise 0": (kw(learnable_sink=torch.zeros(2, dtype=BF16), inner_precise=1), "inner_precise=0"),
    "head dims 64/64 in TND": (with_dims(64, 64), "TND without rope needs"),
    "head dims 128/192 in TND": (with_dims(128, 192), "TND without rope needs"),
    "head dims 256/256 in TND": (with_dims(256, 256, block_size=128), "TND without rope needs"),
    "sink with v head dim 192": (
        both(with_dims(192, 192, block_size=128), kw(learnable_sink=torch.zeros(2, dtype=BF16))),
        "v head dim <= 128",
    ),
    "mode 3 with q_len > kv_len": (kw(actual_seq_kvlen=[1, 2]), "request 0 has 2 query tokens and kv length 1"),
    "rope without key_rope": (kw(query_rope=torch.zeros(3, 2, 64, dtype=BF16)), "must be given together"),
    "tensors on two devices": (kw(block_table=lambda k: k["block_table"].to("meta")), "one device"),
}


@pytest.mark.parametrize("name", list(REJECTIONS))
def test_fia_rejects_what_the_real_op_rejects(name: str) -> None:
    mutate, message = REJECTIONS[name]
    args, kwargs = base_call()
    emulator.FIA_V2(*args, **kwargs)  # the unmutated call is valid
    mutate(args, kwargs)
    with pytest.raises(NpuOpError, match=message):
        emulator.FIA_V2(*args, **kwargs)


def test_fia_rejects_more_than_4096_requests() -> None:
    b = 4097
    q = torch.zeros(b, 1, 128, dtype=BF16)
    cache = torch.zeros(2, 16, 128, dtype=BF16)
    with pytest.raises(NpuOpError, match="1..4096 entries"):
        emulator.FIA_V2(
            q, cache, cache, atten_mask=template(), actual_seq_qlen=list(range(1, b + 1)), actual_seq_kvlen=[1] * b,
            block_table=torch.ones(b, 1, dtype=torch.int32), num_query_heads=1, input_layout="TND", sparse_mode=3,
            block_size=16,
        )  # fmt: skip


@pytest.mark.parametrize(
    "mutate",
    [
        kw(pse_shift=torch.zeros(1)),
        kw(block_table=None),
        both(arg(0, lambda q: q.unsqueeze(0)), kw(input_layout="BNSD")),
        both(arg(1, lambda c: c.view(3, 1, 8, 16, 16)), arg(2, lambda c: c.view(3, 1, 8, 16, 16))),
    ],
    ids=["pse_shift", "contiguous KV", "BNSD layout", "NZ cache"],
)
def test_valid_but_unemulated_features_raise_not_implemented(mutate: Callable[[list, dict], None]) -> None:
    args, kwargs = base_call()
    mutate(args, kwargs)
    with pytest.raises(NotImplementedError, match="emulator"):
        emulator.FIA_V2(*args, **kwargs)


# ------------------------------------------------------------------------------ BSND, explicit masks
def bsnd_call(mask: torch.Tensor | None, **changes: Any) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """2 requests of 3 query rows (BSND), kv 4 and 5, V row j == j (request 1: 10 + j), page 16."""
    q = torch.zeros(2, 3, 1, 128, dtype=BF16)
    k_cache, table = paged([torch.zeros(4, 1, 128, dtype=BF16), torch.zeros(5, 1, 128, dtype=BF16)], 16)
    v_cache, _ = paged([ramp(4, 1, 128), ramp(5, 1, 128) + 10], 16)
    kwargs: dict[str, Any] = {
        "atten_mask": mask, "actual_seq_qlen": [3, 3], "actual_seq_kvlen": [4, 5], "block_table": table,
        "num_query_heads": 1, "num_key_value_heads": 1, "softmax_scale": 1.0, "input_layout": "BSND",
        "sparse_mode": 0, "block_size": 16,
    }  # fmt: skip
    kwargs.update(changes)
    return [q, k_cache, v_cache], kwargs


def tree_style_mask() -> torch.Tensor:
    """(B, 1, Q_S, 16), True = masked: request 0's rows see {0, 1}, {0, 2}, {0, 1, 3}; request 1's
    {0..2}, {0..2, 4}, {0..3}."""
    mask = torch.ones(2, 1, 3, 16, dtype=torch.bool)
    for b, rows in enumerate([[[0, 1], [0, 2], [0, 1, 3]], [[0, 1, 2], [0, 1, 2, 4], [0, 1, 2, 3]]]):
        for i, keys in enumerate(rows):
            mask[b, 0, i, keys] = False
    return mask


def test_bsnd_mode0_explicit_mask_hides_exactly_the_masked_keys() -> None:
    args, kwargs = bsnd_call(tree_style_mask(), return_softmax_lse=True)
    out, lse = emulator.FIA_V2(*args, **kwargs)
    assert out.shape == (2, 3, 1, 128) and lse.shape == (2, 1, 3, 1)
    expect = [[0.5, 1.0, 4 / 3], [11.0, 11.75, 11.5]]  # means of the visible V rows
    for b in range(2):
        rows_equal(out[b], [[x] for x in expect[b]], atol=0.02)
    # zero scores: lse is log(number of visible keys)
    counts = torch.tensor([[2, 2, 3], [3, 4, 4]], dtype=torch.float32).log().view(2, 1, 3, 1)
    torch.testing.assert_close(lse, counts, atol=1e-5, rtol=0)


def test_bsnd_one_query_row_applies_the_mask_as_is_whatever_the_mode() -> None:
    mask = torch.ones(2, 1, 1, 16, dtype=torch.bool)
    mask[0, 0, 0, [1, 3]] = False
    mask[1, 0, 0, [0]] = False
    args, kwargs = bsnd_call(mask, actual_seq_qlen=[1, 1], sparse_mode=3)
    args[0] = args[0][:, :1].contiguous()
    out, _ = emulator.FIA_V2(*args, **kwargs)
    rows_equal(out[:, 0], [[2.0], [10.0]], atol=0.02)


BSND_REJECTIONS: dict[str, tuple[dict[str, Any], str]] = {
    "2-D mask with several query rows": ({"atten_mask": torch.zeros(3, 16, dtype=torch.bool)}, "910B only"),
    "mask batch neither 1 nor B": ({"atten_mask": torch.zeros(3, 1, 3, 16, dtype=torch.bool)}, "batch dim must be 1 or B=2"),
    "mask head dim not 1": ({"atten_mask": torch.zeros(2, 2, 3, 16, dtype=torch.bool)}, "head dim 1"),
    "mask query dim below Q_S": ({"atten_mask": torch.zeros(2, 1, 2, 16, dtype=torch.bool)}, "query dim must be >= Q_S=3"),
    "mask narrower than the pages": ({"atten_mask": torch.zeros(2, 1, 3, 8, dtype=torch.bool)}, "maxBlockNumPerSeq"),
    "actual_seq_qlen above S": ({"actual_seq_qlen": [4, 3]}, "must be <= the tensor's S=3"),
    "actual_seq_qlen neither 1 nor B entries": ({"actual_seq_qlen": []}, "1 or at least B"),
    "actual_seq_kvlen negative": ({"actual_seq_kvlen": [4, -1]}, "negative"),
    "sinks in BSND": ({"learnable_sink": torch.zeros(1, dtype=BF16)}, "only supported with input_layout TND"),
}


@pytest.mark.parametrize("name", list(BSND_REJECTIONS))
def test_bsnd_rejects_what_the_real_op_rejects(name: str) -> None:
    changes, message = BSND_REJECTIONS[name]
    args, kwargs = bsnd_call(tree_style_mask())
    emulator.FIA_V2(*args, **kwargs)  # the unchanged call is valid
    kwargs.update(changes)
    with pytest.raises(NpuOpError, match=message):
        emulator.FIA_V2(*args, **kwargs)


# ------------------------------------------------------------------------------ scatter
def test_scatter_nd_update_writes_rows_in_place(torch_npu: Any) -> None:
    buf = torch.zeros(10, 2, 3)
    rows = torch.arange(18, dtype=torch.float32).view(3, 2, 3)
    for dtype in (torch.int32, torch.int64):
        buf.zero_()
        out = torch_npu.npu_scatter_nd_update_(buf, torch.tensor([[7], [0], [3]], dtype=dtype), rows)
        assert out is buf
        expect = torch.zeros(10, 2, 3)
        expect[[7, 0, 3]] = rows
        assert torch.equal(buf, expect)
    # a = 2: (slot, head) pairs address rows of the last dim
    buf.zero_()
    torch_npu.npu_scatter_nd_update_(buf, torch.tensor([[1, 1], [4, 0]]), torch.ones(2, 3))
    assert buf.sum() == 6 and buf[1, 1].sum() == 3 and buf[4, 0].sum() == 3


@pytest.mark.parametrize(
    "buf, idx, upd, message",
    [
        (torch.zeros(4, 3), torch.tensor([0, 1]), torch.zeros(2, 3), "at least 2-D"),
        (torch.zeros(4, 3), torch.tensor([[0.0]]), torch.zeros(1, 3), "int32 or int64"),
        (torch.zeros(4, 3), torch.tensor([[0], [1]]), torch.zeros(2, 4), "updates shape"),
        (torch.zeros(4, 3), torch.tensor([[0]]), torch.zeros(1, 3, dtype=torch.float16), "must equal the input dtype"),
        (torch.zeros(4, 3), torch.tensor([[0, 0, 0]]), torch.zeros(1), "last dim 3"),
        (torch.zeros(4, 3, dtype=torch.int32), torch.tensor([[0]]), torch.zeros(1, 3, dtype=torch.int32), "unsupported"),
    ],
)
def test_scatter_nd_update_rejects_bad_arguments(torch_npu: Any, buf: Any, idx: Any, upd: Any, message: str) -> None:
    before = buf.clone()
    with pytest.raises(NpuOpError, match=message):
        torch_npu.npu_scatter_nd_update_(buf, idx, upd)
    assert torch.equal(buf, before)


# ------------------------------------------------------------------------------ NPUGraph
def test_replay_reruns_captured_ops_into_the_same_outputs() -> None:
    npu = torch.npu  # type: ignore[attr-defined]
    x = torch.ones(4)
    g = npu.NPUGraph()
    with npu.graph(g):
        y = x * 2
        y.add_(1)
        tail = y[1:]
        z = torch.cat([tail, x])
    x.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    g.replay()
    assert torch.equal(y, torch.tensor([3.0, 5.0, 7.0, 9.0]))
    assert torch.equal(tail, y[1:]) and torch.equal(z, torch.cat([y[1:], x]))


def capture_fia(auto: bool) -> tuple[Any, torch.Tensor, list[torch.Tensor], dict[str, Any]]:
    npu = torch.npu  # type: ignore[attr-defined]
    g = torch.Generator().manual_seed(1)
    keys = [torch.randn(40, 1, 128, generator=g).to(BF16), torch.randn(20, 1, 128, generator=g).to(BF16)]
    values = [torch.randn(40, 1, 128, generator=g).to(BF16), torch.randn(20, 1, 128, generator=g).to(BF16)]
    k_cache, table = paged(keys, 16)
    v_cache, _ = paged(values, 16)
    q = torch.randn(2, 2, 128, generator=g).to(BF16)
    kwargs = {
        "atten_mask": template(), "actual_seq_qlen": [1, 2], "actual_seq_kvlen": [10, 5], "block_table": table,
        "num_query_heads": 2, "num_key_value_heads": 1, "softmax_scale": 0.1, "input_layout": "TND",
        "sparse_mode": 3, "block_size": 16,
    }  # fmt: skip
    graph = npu.NPUGraph()
    with npu.graph(graph, auto_dispatch_capture=auto):
        out, _ = emulator.FIA_V2(q, k_cache, v_cache, **kwargs)
    return graph, out, [q, k_cache, v_cache], kwargs


def eager(args: list[torch.Tensor], kwargs: dict[str, Any], **changes: Any) -> torch.Tensor:
    return emulator.FIA_V2(*args, **{**kwargs, **changes})[0]  # type: ignore[no-any-return]


def test_host_params_stay_baked_until_update_replaces_them() -> None:
    npu = torch.npu  # type: ignore[attr-defined]
    graph, out, args, kwargs = capture_fia(auto=True)
    kwargs["actual_seq_kvlen"][0] = 33  # the caller's list changing after capture changes nothing
    graph.update(cpu_update_input=[{}])
    graph.replay()
    assert torch.equal(out, eager(args, kwargs, actual_seq_kvlen=[10, 5]))
    npu.synchronize()
    graph.update(cpu_update_input=[{"actual_seq_kvlen": [37, 19]}])
    graph.replay()
    assert torch.equal(out, eager(args, kwargs, actual_seq_kvlen=[37, 19]))
    assert not torch.equal(out, eager(args, kwargs, actual_seq_kvlen=[10, 5]))
    npu.synchronize()
    graph.update(cpu_update_input=[{}])  # an update persists until the next one
    graph.replay()
    assert torch.equal(out, eager(args, kwargs, actual_seq_kvlen=[37, 19]))


def test_device_buffers_are_read_at_replay_time() -> None:
    graph, out, args, kwargs = capture_fia(auto=False)
    args[2].mul_(-1)  # the value cache changes in place
    graph.replay()  # no update needed without auto-dispatch capture; host params stay baked
    assert torch.equal(out, eager(args, kwargs))


def test_unknown_update_keys_are_silently_ignored_like_torch_npu() -> None:
    graph, out, args, kwargs = capture_fia(auto=True)
    graph.update(cpu_update_input=[{"actual_seq_lengths_kv": [37, 19]}])  # the FIA v1 name
    graph.replay()
    assert torch.equal(out, eager(args, kwargs, actual_seq_kvlen=[10, 5]))


def test_update_needs_auto_dispatch_capture() -> None:
    graph, _, _, _ = capture_fia(auto=False)
    with pytest.raises(NpuOpError, match="auto_dispatch_capture=True"):
        graph.update(cpu_update_input=[{}])
    fresh = torch.npu.NPUGraph()  # type: ignore[attr-defined]
    fresh.auto_dispatch_capture = True
    with pytest.raises(NpuOpError, match="does not support update"):
        fresh.update(cpu_update_input=[{}])


def test_update_list_is_one_dict_to_broadcast_or_one_per_handled_op() -> None:
    npu = torch.npu  # type: ignore[attr-defined]
    _, _, args, kwargs = capture_fia(auto=True)
    graph = npu.NPUGraph()
    with npu.graph(graph, auto_dispatch_capture=True):
        a, _ = emulator.FIA_V2(*args, **kwargs)
        b, _ = emulator.FIA_V2(*args, **{**kwargs, "softmax_scale": 0.05})
    assert graph.num_handled_ops == 2
    for bad in ([], [{}, {}, {}]):
        with pytest.raises(NpuOpError, match="there are 2 operators"):
            graph.update(cpu_update_input=bad)
    graph.update(cpu_update_input=[{"actual_seq_kvlen": [30, 6]}])  # broadcast
    graph.replay()
    assert torch.equal(a, eager(args, kwargs, actual_seq_kvlen=[30, 6]))
    assert torch.equal(b, eager(args, kwargs, actual_seq_kvlen=[30, 6], softmax_scale=0.05))
    npu.synchronize()
    graph.update(cpu_update_input=[{"actual_seq_kvlen": [11, 3]}, {"actual_seq_kvlen": [2, 20]}])
    graph.replay()
    assert torch.equal(a, eager(args, kwargs, actual_seq_kvlen=[11, 3]))
    assert torch.equal(b, eager(args, kwargs, actual_seq_kvlen=[2, 20], softmax_scale=0.05))


def test_update_revalidates_and_a_failed_update_aborts_the_replay() -> None:
    npu = torch.npu  # type: ignore[attr-defined]
    graph, out, args, kwargs = capture_fia(auto=True)
    with pytest.raises(NpuOpError, match="must equal the query's T=2"):
        graph.update(cpu_update_input=[{"actual_seq_qlen": [1, 1]}])  # per-request lengths
    with pytest.raises(NpuOpError, match="replay aborted at handled op"):
        graph.replay()
    graph.update(cpu_update_input=[{"actual_seq_kvlen": [8, 8]}])  # the failed values were not kept
    graph.replay()
    assert torch.equal(out, eager(args, kwargs, actual_seq_kvlen=[8, 8]))
    npu.synchronize()
    with pytest.raises(NpuOpError, match="fewer than maxBlockNumPerSeq"):
        graph.update(cpu_update_input=[{"actual_seq_kvlen": [100, 8]}])  # beyond the block table


def test_update_racing_an_unsynchronized_replay_raises() -> None:
    npu = torch.npu  # type: ignore[attr-defined]
    graph, _, _, _ = capture_fia(auto=True)
    graph.update(cpu_update_input=[{}])
    graph.replay()
    with pytest.raises(NpuOpError, match="synchronize before updating"):
        graph.update(cpu_update_input=[{}])
    npu.current_stream().synchronize()
    graph.update(cpu_update_input=[{}])
    graph.replay()


def test_replay_without_update_would_hang_and_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(emulator.runtime, "REPLAY_WAIT_TIMEOUT_S", 0.05)
    graph, _, _, _ = capture_fia(auto=True)
    with pytest.raises(NpuOpError, match="needs an update per replay"):
        graph.replay()


@pytest.mark.parametrize(
    "sync",
    [
        lambda x: x.sum().item(),
        lambda x: x.tolist(),
        lambda x: x.numpy(),
        lambda x: x.cpu(),
        lambda x: bool(x[0] > 0),
        lambda x: torch.nonzero(x),
        lambda x: x[x > 0],
        lambda x: torch.npu.synchronize(),  # type: ignore[attr-defined]
    ],
    ids=["item", "tolist", "numpy", "cpu", "bool", "nonzero", "boolean index", "synchronize"],
)
def test_host_sync_inside_capture_raises(sync: Callable[[torch.Tensor], Any]) -> None:
    npu = torch.npu  # type: ignore[attr-defined]
    x = torch.ones(4)
    graph = npu.NPUGraph()
    with pytest.raises(CaptureSyncError, match="Not allow to synchronize captured-stream"):
        with npu.graph(graph):
            y = x + 1
            sync(y)
    with pytest.raises(NpuOpError, match="before a successful capture"):
        graph.replay()
    sync(x)  # outside a capture the same call is fine


def test_integer_indexing_is_capturable() -> None:
    npu = torch.npu  # type: ignore[attr-defined]
    table = torch.tensor([0, 5, 7])
    idx = torch.tensor([2, 1])
    graph = npu.NPUGraph()
    with npu.graph(graph):
        picked = table[idx] * 10
    idx.copy_(torch.tensor([0, 2]))
    graph.replay()
    assert picked.tolist() == [0, 70]


def test_capture_misuse_raises() -> None:
    npu = torch.npu  # type: ignore[attr-defined]
    g = npu.NPUGraph()
    with pytest.raises(NpuOpError, match="before a successful capture"):
        g.replay()
    with npu.graph(g):
        inner = npu.NPUGraph()
        with pytest.raises(NpuOpError, match="another NPUGraph capture"):
            inner.capture_begin()
    with pytest.raises(NpuOpError, match="already captured"):
        g.capture_begin()
    g.reset()
    with npu.graph(g, capture_error_mode="relaxed"):
        pass
    with pytest.raises(NpuOpError, match="capture_error_mode"):
        npu.NPUGraph().capture_begin(capture_error_mode="strict")


# ------------------------------------------------------------------------------ install
def test_install_and_uninstall_revert_sys_modules_and_torch_npu() -> None:
    assert emulator.is_installed() and sys.modules["torch_npu"].IS_HAL_EMULATOR
    emulator.uninstall()
    assert "torch_npu" not in sys.modules and "torch_npu.npu" not in sys.modules
    assert not hasattr(torch, "npu")
    emulator.uninstall()  # idempotent
    with emulator.emulated() as module:
        assert torch.npu is module.npu  # type: ignore[attr-defined]
        with emulator.emulated():
            pass
        assert emulator.is_installed()  # the inner context did not remove the outer installation
    assert not emulator.is_installed()
    emulator.install()
    emulator.install()  # idempotent
    assert emulator.is_installed()
