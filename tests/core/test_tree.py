"""Tree verify in the contract (``hal.tree`` and ``build_metadata(tree_mask=...)``): the mask a list
of parents makes, by hand; every rule a tree mask must keep, refused by name before anything is
written; positions by depth; and the oracle's definition of a tree row: the last row of a chain
over its prefix and its own root-to-row path (checked against the independent per-row loop)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_metadata import assert_passes_the_constructors_checks

from hal.backends.cpu import CpuBackend
from hal.errors import SpecError, UnsupportedConfigError
from hal.graph_runner import pad_metadata
from hal.metadata import build_metadata
from hal.oracle import dense_attention
from hal.spec import ForwardMode, KVPoolSpec, LayerSpec
from hal.tools.conformance.attention_checks import random_tree_parents
from hal.tree import chain_tree_mask, check_tree_mask, tree_depths, tree_mask_from_parents

from test_oracle import dense_loop_oracle

M = ForwardMode


def rows(*masks: str) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in m] for m in masks])


def test_mask_from_parents_by_hand() -> None:
    # 0 is the root; 1 and 2 hang from it; 3 from 1; 4 from 3
    mask = tree_mask_from_parents([[-1, 0, 0, 1, 3]])
    assert torch.equal(mask[0], rows("10000", "11000", "10100", "11010", "11011"))
    assert tree_depths(mask).tolist() == [[0, 1, 1, 2, 3]]
    assert torch.equal(tree_mask_from_parents([[-1, 0, 1]]), chain_tree_mask(1, 3))
    # two roots: each sees the prefix and itself
    assert torch.equal(tree_mask_from_parents([[-1, -1, 1]])[0], rows("100", "010", "011"))


@pytest.mark.parametrize(
    "parents, fragment",
    [
        ([[-1, 2, 0]], "row 1 has parent 2"),  # a parent after its child (and a cycle's first step)
        ([[-1, 1]], "row 1 has parent 1"),  # its own parent
        ([[-1, -2]], "row 1 has parent -2"),
        ([[-1, 0], [-1]], "request 1 has 1 rows, request 0 has 2"),
        ([[-1, 0.0]], "must be an int"),
    ],
)
def test_parents_that_make_no_tree_are_refused(parents, fragment: str) -> None:
    with pytest.raises(SpecError, match=fragment):
        tree_mask_from_parents(parents)


@pytest.mark.parametrize(
    "mask, fragment",
    [
        (rows("10", "01")[None] & False, "row 0 does not see itself"),
        (rows("11", "01")[None], "row 0 sees row 1, which comes after it"),
        # row 3 sees row 1 but not row 1's parent 0 (an ancestor missing)
        (rows("1000", "1100", "1010", "0101")[None], r"row 3 sees rows \[1, 3\], but its parent row 1 sees \[0, 1\]"),
        # row 3 sees siblings 1 and 2 (two parents)
        (rows("1000", "1100", "1010", "1111")[None], r"row 3 sees rows \[0, 1, 2, 3\], but its parent row 2 sees \[0, 2\]"),
        (rows("10", "11")[None].int(), "must be a bool tensor"),
        (rows("10", "11"), r"shape \(2, 2\), expected \(1, 2, 2\)"),
    ],
)
def test_masks_that_are_no_tree_are_refused_by_request_and_row(mask, fragment: str) -> None:
    with pytest.raises(SpecError, match=fragment):
        check_tree_mask(mask, 1, 2 if mask.shape[-1] == 2 else 4, "here")


def pool(page_size: int = 4):
    return CpuBackend().create_kv_pool(KVPoolSpec(1, 16 * page_size, page_size, 1, 4, 4))


def test_build_metadata_takes_positions_from_depth_and_keeps_its_own_copy() -> None:
    p = pool()
    tree = tree_mask_from_parents([[-1, 0, 0, 2], [-1, 0, 1, 1]])
    md = build_metadata(M.TARGET_VERIFY, kv_lens=[9, 4], q_lens=[4, 4], page_table=[[1, 2, 3], [4]],
                        out_cache_loc=[9, 10, 11, 12, 16, 17, 18, 19], pool=p, tree_mask=tree)
    assert md.positions.tolist() == [5, 6, 6, 7, 0, 1, 2, 2]
    assert_passes_the_constructors_checks(md)
    tree[0, 1, 0] = False  # the caller's tensor changes; the record's does not
    assert bool(md.tree_mask[0, 1, 0]) and "tree_mask" in md.tensors()


@pytest.mark.parametrize(
    "mode, q_lens, tree, fragment",
    [
        (M.DRAFT_EXTEND_V2, [2, 2], chain_tree_mask(2, 2), "belongs to TARGET_VERIFY"),
        (M.TARGET_VERIFY, [2, 2], chain_tree_mask(2, 3), r"expected \(2, 2, 2\)"),
        (M.TARGET_VERIFY, [2, 2], rows("11", "01")[None].expand(2, 2, 2), "comes after it"),
    ],
)
def test_build_metadata_refuses_a_bad_tree(mode, q_lens, tree, fragment: str) -> None:
    with pytest.raises(SpecError, match=fragment):
        build_metadata(mode, kv_lens=[5, 2], q_lens=q_lens, page_table=[[1, 2], [3]], out_cache_loc=[4, 5, 12, 13],
                       pool=pool(), tree_mask=tree)


def test_padding_a_tree_batch_adds_chains() -> None:
    tree = tree_mask_from_parents([[-1, 0, 0]])
    md = build_metadata(M.TARGET_VERIFY, kv_lens=[5], q_lens=[3], page_table=[[1, 2]], out_cache_loc=[6, 7, 8],
                        pool=pool(), tree_mask=tree)
    padded = pad_metadata(md, 3, fill=1, max_pages=2)
    assert torch.equal(padded.tree_mask, torch.cat([tree, chain_tree_mask(2, 3)]))
    assert padded.positions.tolist() == [2, 3, 3, 0, 1, 2, 0, 1, 2]


def test_a_kernel_that_does_not_serve_trees_refuses_them_before_writing() -> None:
    from hal.backends.cpu.attention import CpuAttention

    class ChainsOnly(CpuAttention):
        serves_trees = False

    p = pool()
    layer = LayerSpec(0, 1, 1, 4, 4, scaling=0.5)
    md = build_metadata(M.TARGET_VERIFY, kv_lens=[3], q_lens=[3], page_table=[[1]], out_cache_loc=[4, 5, 6], pool=p,
                        tree_mask=tree_mask_from_parents([[-1, 0, 0]]))
    kernel = ChainsOnly(p)
    before = p.k_buffer(0).clone()
    x = torch.ones(3, 1, 4)
    with pytest.raises(UnsupportedConfigError, match="draft tree"):
        kernel.forward(x, x, x, layer, kernel.plan(md))
    assert torch.equal(p.k_buffer(0), before)


@st.composite
def tree_batches(draw: st.DrawFn):
    depth = draw(st.integers(1, 6))
    widths = tuple(draw(st.integers(1, 4)) for _ in range(depth))
    rng = random.Random(draw(st.integers(0, 2**31 - 1)))
    parents = [random_tree_parents(rng, depth, widths) for _ in range(draw(st.integers(1, 3)))]
    prefixes = [draw(st.integers(0, 9)) for _ in parents]
    layer = LayerSpec(0, 2 * draw(st.sampled_from([1, 2])), 2, 4, 3, scaling=draw(st.floats(0.1, 1.0)),
                      sliding_window=draw(st.one_of(st.none(), st.integers(0, 6))), has_sinks=draw(st.booleans()))
    return layer, parents, prefixes, draw(st.integers(0, 2**31 - 1))


@given(case=tree_batches())
def test_a_tree_row_is_the_last_row_of_the_chain_over_its_prefix_and_its_path(case) -> None:
    layer, parents, prefixes, seed = case
    gen = torch.Generator().manual_seed(seed)
    n = len(parents[0])
    keys = [torch.randn(p + n, layer.num_kv_heads, layer.head_dim, generator=gen, dtype=torch.float64) for p in prefixes]
    values = [torch.randn(p + n, layer.num_kv_heads, layer.v_head_dim, generator=gen, dtype=torch.float64) for p in prefixes]
    q = torch.randn(len(parents) * n, layer.num_q_heads, layer.head_dim, generator=gen, dtype=torch.float64)
    sinks = torch.randn(layer.num_q_heads, generator=gen, dtype=torch.float64) if layer.has_sinks else None
    trees = tree_mask_from_parents(parents)
    got = dense_attention(q, keys, values, [n] * len(parents), scaling=layer.scaling,
                          sliding_window=layer.sliding_window, sinks=sinks, trees=list(trees))
    for b, prefix in enumerate(prefixes):
        for i in range(n):
            path = trees[b, i].nonzero().flatten()  # ancestors in order, then the row itself
            index = torch.cat([torch.arange(prefix), prefix + path])
            chain = dense_loop_oracle(q[b * n + i : b * n + i + 1], [keys[b][index]], [values[b][index]], [1], layer, sinks)
            torch.testing.assert_close(got[b * n + i], chain[0], atol=1e-12, rtol=1e-12)
