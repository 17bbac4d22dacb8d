"""The plan step: ``kernel.plan(metadata)`` once per forward, the plan handed to every layer.

The metadata stays a record (no state a forward leaves behind); the plan is checked against the
pool it was made for and the capture it was made in, before anything is written."""

from __future__ import annotations

import attrs
import pytest
import torch

import hal
from hal.backends.cpu import CpuBackend
from hal.errors import CacheLocationError, GraphError, SpecError
from hal.metadata import AttentionMetadata, build_metadata
from hal.plan import ForwardPlan
from hal.spec import ForwardMode, KVPoolSpec, LayerSpec, SWAPoolSpec

LAYER = LayerSpec(0, 2, 1, 4, 4, 0.5)
SWA_LAYERS = [LayerSpec(i, 2, 1, 4, 4, 0.5, sliding_window=3) for i in (1, 2)]


def _hybrid_pool(backend: hal.Backend) -> hal.KVPool:
    spec = KVPoolSpec(3, 64, 4, 1, 4, 4, swa=SWAPoolSpec(layer_ids=(1, 2), size=32, kv_heads=1, head_dim=4, v_head_dim=4))
    pool = backend.create_kv_pool(spec)
    pool.map_swa_pages(torch.tensor([1, 2]), torch.tensor([1, 2]))
    return pool


def _decode(pool: hal.KVPool) -> AttentionMetadata:
    return build_metadata(ForwardMode.DECODE, kv_lens=[6], q_lens=[1], page_table=[[1, 2]], out_cache_loc=[9], pool=pool)


def _qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 2, 4, generator=g), torch.randn(1, 1, 4, generator=g), torch.randn(1, 1, 4, generator=g)


def _snapshot(pool: hal.KVPool) -> list[torch.Tensor]:
    return [pool.k_buffer(i).clone() for i in range(3)] + [pool.v_buffer(i).clone() for i in range(3)]


def _unchanged(pool: hal.KVPool, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(_snapshot(pool), before))


def test_metadata_is_a_record_a_forward_leaves_as_it_was() -> None:
    assert all(field.init for field in attrs.fields(AttentionMetadata)), "no hidden per-forward state"
    backend = CpuBackend()
    pool = _hybrid_pool(backend)
    attn = backend.create_attention(pool)
    md = _decode(pool)
    before = attrs.asdict(md, recurse=False)
    plan = attn.plan(md)
    q, k, v = _qkv()
    for layer in (LAYER, *SWA_LAYERS):
        attn.forward(q, k, v, layer, plan)
    after = attrs.asdict(md, recurse=False)
    assert before.keys() == after.keys()
    for name, value in before.items():
        assert after[name] is value, name


def test_layers_of_one_kind_share_what_the_plan_derives() -> None:
    backend = CpuBackend()
    pool = _hybrid_pool(backend)
    plan = backend.create_attention(pool).plan(_decode(pool))
    calls: list[str] = []

    def derive(kind: str) -> object:
        calls.append(kind)
        return object()

    first = plan.per_layer_kind("swa", lambda: derive("swa"))
    assert plan.per_layer_kind("swa", lambda: derive("swa")) is first
    assert plan.per_layer_kind("full", lambda: derive("full")) is not first
    assert calls == ["swa", "full"]
    # A new plan of the same record derives again: nothing is kept on the record between forwards.
    again = backend.create_attention(pool).plan(plan.metadata)
    assert again.per_layer_kind("swa", lambda: derive("swa")) is not first


def test_forward_takes_a_plan_not_the_metadata() -> None:
    backend = CpuBackend()
    pool = _hybrid_pool(backend)
    attn = backend.create_attention(pool)
    before = _snapshot(pool)
    with pytest.raises(SpecError, match=r"kernel\.plan\(metadata\).*got AttentionMetadata"):
        attn.forward(*_qkv(), LAYER, _decode(pool))  # type: ignore[arg-type]
    assert _unchanged(pool, before)


def test_a_plan_for_another_pool_is_refused_before_writing() -> None:
    backend = CpuBackend()
    pool, other = _hybrid_pool(backend), _hybrid_pool(backend)
    plan = backend.create_attention(other).plan(_decode(other))
    before = _snapshot(pool)
    with pytest.raises(SpecError, match="another KV pool"):
        backend.create_attention(pool).forward(*_qkv(), LAYER, plan)
    with pytest.raises(SpecError, match="another KV pool"):
        pool.set_kv_for_forward(0, plan, *_qkv()[1:])
    assert _unchanged(pool, before)


def test_the_plan_step_checks_slots_against_the_pool() -> None:
    backend = CpuBackend()
    pool = _hybrid_pool(backend)
    outside = build_metadata(ForwardMode.DECODE, kv_lens=[6], q_lens=[1], page_table=[[1, 2]], out_cache_loc=[64 * 4],
                             page_size=4)
    with pytest.raises(CacheLocationError, match=str(64 * 4)):
        backend.create_attention(pool).plan(outside)
    # A slot in a full page with no SWA page behind it: refused for the hybrid pool.
    unmapped = build_metadata(ForwardMode.DECODE, kv_lens=[1], q_lens=[1], page_table=[[5]], out_cache_loc=[20], pool=pool)
    with pytest.raises(CacheLocationError, match="no SWA page mapped"):
        backend.create_attention(pool).plan(unmapped)


def test_metadata_built_for_a_pool_is_checked_once_and_only_for_that_pool() -> None:
    """build_metadata with a pool that has no SWA part checks the record's slots against it then
    (the plan step for that pool has nothing left to check); another pool's plan, and a record made
    from the checked one, are checked at the plan step."""
    backend = CpuBackend()
    small, large = (backend.create_kv_pool(KVPoolSpec(1, pages * 4, 4, 1, 4, 4)) for pages in (2, 16))
    with pytest.raises(CacheLocationError, match="cache location 12 out of range"):
        build_metadata(ForwardMode.DECODE, kv_lens=[1], q_lens=[1], page_table=[[1]], out_cache_loc=[12], pool=small)
    fits_large = build_metadata(ForwardMode.DECODE, kv_lens=[1], q_lens=[1], page_table=[[1]], out_cache_loc=[40], pool=large)
    backend.create_attention(large).plan(fits_large)
    with pytest.raises(CacheLocationError, match="cache location 40 out of range"):
        backend.create_attention(small).plan(fits_large)
    fits_small = build_metadata(ForwardMode.DECODE, kv_lens=[1], q_lens=[1], page_table=[[1]], out_cache_loc=[4], pool=small)
    moved = attrs.evolve(fits_small, out_cache_loc=torch.tensor([40]), out_cache_loc_host=torch.tensor([40]))
    with pytest.raises(CacheLocationError, match="cache location 40 out of range"):
        backend.create_attention(small).plan(moved)


def test_a_plan_made_before_a_capture_is_refused_inside_it() -> None:
    """The capture would keep what the plan derived as constants: stale on every replay."""
    backend = CpuBackend()
    pool = _hybrid_pool(backend)
    attn = backend.create_attention(pool)
    md = _decode(pool)
    stale = attn.plan(md)
    before = _snapshot(pool)
    with pytest.raises(GraphError, match="outside the graph capture"):
        backend.create_graph().capture(lambda: attn.forward(*_qkv(), SWA_LAYERS[0], stale))
    assert _unchanged(pool, before)
    # Planned inside the capture, the same forward captures and replays.
    graph = backend.create_graph()
    out = graph.capture(lambda: attn.forward(*_qkv(), SWA_LAYERS[0], attn.plan(md)))
    graph.replay()
    assert torch.allclose(out, attn.forward(*_qkv(), SWA_LAYERS[0], attn.plan(md)))


def test_plan_is_exported_where_backend_authors_and_engines_look() -> None:
    from hal import sdk

    assert hal.ForwardPlan is ForwardPlan is sdk.ForwardPlan


def test_a_kind_of_call_that_passed_is_not_checked_again_in_later_forwards(monkeypatch) -> None:
    """A kernel and its pool remember the kinds of call (signature and the plan's call facts) that
    passed their checks: the next forward's calls of those kinds run no checks; a call of another
    signature, or the same one against a plan of other facts, is checked."""
    backend = CpuBackend()
    pool = _hybrid_pool(backend)
    attn = backend.create_attention(pool)
    checks: list[str] = []
    check_call, validate = type(attn)._check_call, type(pool)._validate
    monkeypatch.setattr(type(attn), "_check_call", lambda self, *a: (checks.append("call"), check_call(self, *a))[1])
    monkeypatch.setattr(type(pool), "_validate", lambda self, *a: (checks.append("write"), validate(self, *a))[1])
    q, k, v = _qkv()
    for step in range(3):
        plan = attn.plan(_decode(pool))
        for layer in (LAYER, *SWA_LAYERS):
            attn.forward(q, k, v, layer, plan)
        # forward 0 checks each kind (full and SWA layers) once; the later ones nothing
        assert checks == (["call", "write"] * 2 if step == 0 else []), step
        checks.clear()
    wide = build_metadata(ForwardMode.EXTEND, kv_lens=[6], q_lens=[2], page_table=[[1, 2]], out_cache_loc=[8, 9], pool=pool)
    attn.forward(torch.cat([q, q]), torch.cat([k, k]), torch.cat([v, v]), LAYER, attn.plan(wide))
    assert checks == ["call", "write"]  # another signature (two rows)


def test_the_same_call_against_other_facts_is_checked_and_refused_before_writing() -> None:
    """An SWA layer's call passed with metadata that carries the SWA block table; the same call
    against a plan whose metadata has none (its facts differ) is checked again and refused."""
    backend = CpuBackend()
    pool = _hybrid_pool(backend)
    attn = backend.create_attention(pool)
    q, k, v = _qkv()
    attn.forward(q, k, v, SWA_LAYERS[0], attn.plan(_decode(pool)))
    no_swa_table = attrs.evolve(_decode(pool), swa_block_table=None)
    before = _snapshot(pool)
    with pytest.raises(SpecError, match="has no swa_block_table"):
        attn.forward(q, k, v, SWA_LAYERS[0], attn.plan(no_swa_table))
    assert _unchanged(pool, before)


def test_the_memory_of_passed_checks_is_bounded(monkeypatch) -> None:
    """Past PASSED_CHECKS_LIMIT remembered kinds the memory starts afresh, and calls stay checked."""
    import hal.plan as plan_module

    monkeypatch.setattr(plan_module, "PASSED_CHECKS_LIMIT", 3)
    backend = CpuBackend()
    pool = backend.create_kv_pool(KVPoolSpec(1, 64, 4, 1, 4, 4))
    attn = backend.create_attention(pool)
    g = torch.Generator().manual_seed(1)
    for rows in range(1, 9):  # a new signature each forward
        md = build_metadata(ForwardMode.EXTEND, kv_lens=[rows], q_lens=[rows], page_table=[[1, 2]], out_cache_loc=list(range(4, 4 + rows)),
                            pool=pool)
        attn.forward(torch.randn(rows, 2, 4, generator=g), torch.randn(rows, 1, 4, generator=g), torch.randn(rows, 1, 4, generator=g),
                     LAYER, attn.plan(md))
        assert len(attn._passed_calls()) <= 3 and len(pool._passed_writes) <= 3
    with pytest.raises(SpecError, match="q has shape"):
        attn.forward(torch.randn(2, 2, 4), torch.randn(1, 1, 4), torch.randn(1, 1, 4), LAYER, attn.plan(_decode_plain(pool)))


def _decode_plain(pool: hal.KVPool) -> AttentionMetadata:
    return build_metadata(ForwardMode.DECODE, kv_lens=[6], q_lens=[1], page_table=[[1, 2]], out_cache_loc=[9], pool=pool)
