"""Data contracts in hal.spec: forward-mode helpers and spec validation."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hal.errors import KVLayoutError, SpecError
from hal.spec import ForwardMode, KVPoolSpec, LayerSpec, SWAPoolSpec, int_bounds

M = ForwardMode

# Truth table written out by hand: mode -> the helpers that must answer True.
HELPERS_TRUE = {
    M.EXTEND: {"is_extend", "is_extend+v2"},
    M.DECODE: {"is_decode", "is_decode_or_idle", "uniform"},
    M.TARGET_VERIFY: {"is_extend", "is_extend+v2", "is_target_verify", "uniform"},
    M.DRAFT_EXTEND_V2: {"is_extend+v2", "is_draft_extend_v2", "uniform"},
    M.IDLE: {"is_idle", "is_decode_or_idle", "uniform"},
}


def _helpers(mode: ForwardMode) -> dict[str, bool]:
    return {
        "is_extend": mode.is_extend(),
        "is_extend+v2": mode.is_extend(include_draft_extend_v2=True),
        "is_decode": mode.is_decode(),
        "is_target_verify": mode.is_target_verify(),
        "is_draft_extend_v2": mode.is_draft_extend_v2(),
        "is_idle": mode.is_idle(),
        "is_decode_or_idle": mode.is_decode_or_idle(),
        "uniform": mode.has_uniform_query_len(),
    }


@pytest.mark.parametrize("mode", list(ForwardMode))
def test_forward_mode_helpers_match_truth_table(mode: ForwardMode) -> None:
    got = {name for name, value in _helpers(mode).items() if value}
    assert got == HELPERS_TRUE[mode]


def test_truth_table_covers_every_mode() -> None:
    assert set(HELPERS_TRUE) == set(ForwardMode)


def _layer(**overrides: object) -> LayerSpec:
    fields: dict[str, object] = dict(
        layer_id=0, num_q_heads=8, num_kv_heads=2, head_dim=192, v_head_dim=128, scaling=0.1
    )
    fields.update(overrides)
    return LayerSpec(**fields)  # type: ignore[arg-type]


def test_layer_spec_derived_properties() -> None:
    layer = _layer(sliding_window=127, has_sinks=True)
    assert layer.group_size == 4
    assert layer.is_swa
    assert not _layer().is_swa
    assert _layer(sliding_window=0).is_swa  # W = 0: each query sees only itself, still a window


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"num_q_heads": 0}, "num_q_heads"),
        ({"num_kv_heads": -1}, "num_kv_heads"),
        ({"head_dim": 0}, "head_dim"),
        ({"v_head_dim": 2.5}, "v_head_dim"),
        ({"num_q_heads": True}, "num_q_heads"),
        ({"num_q_heads": 6, "num_kv_heads": 4}, "num_kv_heads"),  # 6 % 4 != 0: not GQA
        ({"scaling": 0.0}, "scaling"),
        ({"scaling": -1.0}, "scaling"),
        ({"scaling": "0.1"}, "scaling"),
        ({"sliding_window": -1}, "sliding_window"),
        ({"sliding_window": 3.0}, "sliding_window"),
        ({"layer_id": -1}, "layer_id"),
        ({"layer_id": True}, "layer_id"),
    ],
)
def test_layer_spec_rejects_bad_fields_naming_them(overrides: dict, field: str) -> None:
    with pytest.raises(SpecError, match=field):
        _layer(**overrides)


def test_specs_are_frozen() -> None:
    layer = _layer()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        layer.head_dim = 64  # type: ignore[misc]
    spec = KVPoolSpec(2, 32, 16, 2, 64, 32)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        spec.size = 64  # type: ignore[misc]


def test_kv_pool_spec_derived_values() -> None:
    swa = SWAPoolSpec(layer_ids=[1, 3], size=24, kv_heads=1, head_dim=16, v_head_dim=8)
    spec = KVPoolSpec(4, 64, 8, 2, 32, 16, torch.bfloat16, swa)
    assert swa.layer_ids == (1, 3)
    assert spec.num_pages == 8
    assert spec.swa_num_pages == 3
    assert spec.full_layer_ids == (0, 2)
    assert [spec.is_swa_layer(i) for i in range(4)] == [False, True, False, True]
    assert spec.layer_dims(0) == (2, 32, 16)
    assert spec.layer_dims(3) == (1, 16, 8)
    assert KVPoolSpec(2, 32, 16, 2, 64, 32).swa_num_pages == 0


@pytest.mark.parametrize("layer_id", [-1, 4])
def test_layer_dims_out_of_range(layer_id: int) -> None:
    spec = KVPoolSpec(4, 64, 8, 2, 32, 16)
    with pytest.raises(KVLayoutError, match=rf"layer must be an int in 0\.\.3, got {layer_id}"):
        spec.layer_dims(layer_id)


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: KVPoolSpec(2, 30, 16, 2, 64, 64), "size"),
        (lambda: KVPoolSpec(0, 32, 16, 2, 64, 64), "num_layers"),
        (lambda: KVPoolSpec(2, 32, 0, 2, 64, 64), "page_size"),
        (lambda: KVPoolSpec(2, 32, 16, 2, 64, 64, torch.int8), "dtype"),
        (lambda: KVPoolSpec(2, 32, 16, 2, 64, 64, torch.float64), "dtype"),
        (lambda: KVPoolSpec(2, 32, 16, 2, 64, 64, swa=SWAPoolSpec((2,), 16, 1, 8, 8)), "layer_ids"),
        (lambda: KVPoolSpec(2, 32, 16, 2, 64, 64, swa=SWAPoolSpec((1,), 8, 1, 8, 8)), "swa.size"),
        (lambda: SWAPoolSpec((), 16, 1, 8, 8), "layer_ids"),
        (lambda: SWAPoolSpec((1, 1), 16, 1, 8, 8), "layer_ids"),
        (lambda: SWAPoolSpec((-1,), 16, 1, 8, 8), "layer_ids"),
        (lambda: SWAPoolSpec((0,), 16, 0, 8, 8), "kv_heads"),
    ],
)
def test_pool_specs_reject_bad_fields_naming_them(make, field: str) -> None:
    with pytest.raises(SpecError, match=field):
        make()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_int_bounds_are_the_least_and_greatest_value(data: st.DataObject) -> None:
    """Either side of the size where ``int_bounds`` reads values into Python, over 0-d tensors,
    rows and strided views of tables (the engines' block tables are sliced), against torch's own
    reduction."""
    rows = data.draw(st.integers(1, 24))
    cols = data.draw(st.integers(1, 24))
    dtype = data.draw(st.sampled_from([torch.int32, torch.int64]))
    info = torch.iinfo(dtype)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    table = torch.randint(info.min, info.max, (rows, cols), dtype=dtype, generator=gen)
    view = data.draw(st.sampled_from(["whole", "columns", "row", "scalar", "transposed"]))
    tensor = {"whole": table, "columns": table[:, : max(cols // 2, 1)], "row": table[rows // 2],
              "scalar": table[0, 0], "transposed": table.t()}[view]
    lo, hi = torch.aminmax(tensor)
    assert int_bounds(tensor) == (int(lo), int(hi))
