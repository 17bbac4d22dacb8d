"""The test site's stand-ins for the sgl_kernel CPU ops of SGLang's speculative path, each against
a hand computation, and the inputs each refuses (``site/sgl_kernel_cpu_standins.py``)."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402

import sgl_kernel  # noqa: E402
import sgl_kernel_cpu_standins as ops  # noqa: E402


def test_sgl_kernel_exports_the_standins() -> None:
    for name in ("copy_all_layer_kv_cache_cpu", "rotate_input_ids_cpu", "fill_bonus_tokens_cpu", "fill_accept_out_cache_loc_cpu",
                 "assign_draft_cache_locs_contiguous_cpu", "assign_req_to_token_pool_cpu", "assign_extend_cache_locs_cpu",
                 "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu"):  # fmt: skip
        assert getattr(sgl_kernel, name) is getattr(ops, name)


def test_copy_all_layer_kv_cache_moves_rows_of_every_buffer() -> None:
    k = torch.arange(24, dtype=torch.float32).view(6, 4)
    v = torch.arange(100, 112, dtype=torch.int16).view(6, 2)
    ptrs = torch.tensor([k.data_ptr(), v.data_ptr()], dtype=torch.uint64)
    strides = torch.tensor([16, 4], dtype=torch.int64)
    ops.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([1, 4]), torch.tensor([3, 5]))
    assert k.tolist()[1] == [12, 13, 14, 15] and k.tolist()[4] == [20, 21, 22, 23] and k.tolist()[3] == [12, 13, 14, 15]
    assert v.tolist()[1] == [106, 107] and v.tolist()[4] == [110, 111]
    # Sources are read before any target is written: row 3 moves to 2 before row 0 lands on 3;
    # a slot written twice (the padding slot 0, as a verify's padded rows give) keeps the later row.
    k.copy_(torch.arange(24, dtype=torch.float32).view(6, 4))
    ops.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([3, 2, 0, 0]), torch.tensor([0, 3, 5, 1]))
    assert k.tolist()[2] == [12, 13, 14, 15] and k.tolist()[3] == [0, 1, 2, 3] and k.tolist()[0] == [4, 5, 6, 7]
    with pytest.raises(ops.StandInError, match="data_ptrs must be torch.uint64"):
        ops.copy_all_layer_kv_cache_cpu(ptrs.long(), strides, torch.tensor([1]), torch.tensor([2]))
    with pytest.raises(ops.StandInError, match="src_loc must be torch.int64"):
        ops.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([1]), torch.tensor([2], dtype=torch.int32))


def test_rotate_input_ids_shifts_each_request_and_appends_its_token() -> None:
    ids = torch.tensor([10, 11, 12, 20, 21, 30])
    ops.rotate_input_ids_cpu(ids, torch.tensor([0, 3, 5]), torch.tensor([3, 2, 1], dtype=torch.int32), torch.tensor([[7], [8], [9]]), None)
    assert ids.tolist() == [11, 12, 7, 21, 8, 9]
    ids = torch.tensor([10, 11, 12, 13])
    ops.rotate_input_ids_cpu(ids, torch.tensor([0]), torch.tensor([4]), torch.tensor([5]), torch.tensor([1]))
    assert ids.tolist() == [11, 5, 13, 13]  # the token goes to the selected row, after the shift


def test_rotate_input_ids_reads_a_2d_topk_index_flat_as_the_real_op_does() -> None:
    """The real op reads element ``b`` of the topk tensor's memory for request ``b``: with
    ``[bs, topk]`` choices, request 1 gets row 0's second choice, not row 1's first."""
    ids = torch.tensor([10, 11, 20, 21])
    ops.rotate_input_ids_cpu(ids, torch.tensor([0, 2]), torch.tensor([2, 2]), torch.tensor([[7, 70], [8, 80]]), None)
    assert ids.tolist() == [11, 7, 21, 70]


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.zeros(3, dtype=torch.long), torch.tensor([2]), torch.tensor([2]), torch.tensor([1]), None), "outside input_ids"),
        ((torch.zeros(3, dtype=torch.int16), torch.tensor([0]), torch.tensor([2]), torch.tensor([1]), None),
         "input_ids must be torch.int32 or torch.int64"),
        ((torch.zeros(3, dtype=torch.long), torch.tensor([0]), torch.tensor([2]), torch.tensor([1], dtype=torch.int32), None),
         "topk_index must be torch.int64"),
        ((torch.zeros(3, dtype=torch.long), torch.tensor([0, 1]), torch.tensor([1, 1]), torch.tensor([1]), None),
         "topk_index has 1 elements; the op reads one per request of 2"),
        ((torch.zeros(3, dtype=torch.long), torch.tensor([0]), torch.tensor([2]), torch.tensor([[1, 2], [3, 4]]).t(), None), "contiguous"),
    ],
)
def test_rotate_input_ids_refuses_what_the_real_op_refuses(args, message: str) -> None:
    with pytest.raises(ops.StandInError, match=message):
        ops.rotate_input_ids_cpu(*args)


def test_reconstruct_indices_from_a_branching_ngram_mask() -> None:
    """Nodes 0 (root), 1 and 2 its children, 3 under 1, 4 under 3, 5 under 2 (each row sees its
    ancestors and itself), in two requests whose verified lengths are 7 and 4."""
    parents = [-1, 0, 0, 1, 3, 2]
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    seq = torch.tensor([7, 4])
    positions = torch.zeros(2 * n, dtype=torch.long)
    ri, nt, ns = (torch.zeros(2, n, dtype=torch.long) for _ in range(3))
    ops.reconstruct_indices_from_tree_mask(torch.stack([mask, mask]).flatten(), seq, positions, ri, nt, ns, 2, n)
    assert positions.tolist() == [7, 8, 8, 9, 10, 9, 4, 5, 5, 6, 7, 6]
    assert ri.tolist() == [list(range(n)), list(range(n, 2 * n))]
    assert nt.tolist() == [[1, 3, 5, 4, -1, -1]] * 2  # first child
    assert ns.tolist() == [[-1, 2, -1, -1, -1, -1]] * 2  # node 1's next sibling is 2
    with pytest.raises(ops.StandInError, match="positions must be torch.int64"):
        ops.reconstruct_indices_from_tree_mask(mask.flatten(), seq[:1], positions.int(), ri, nt, ns, 1, n)
    with pytest.raises(ops.StandInError, match="for a batch of 3"):
        ops.reconstruct_indices_from_tree_mask(mask.flatten(), torch.tensor([1, 2, 3]), positions, ri, nt, ns, 3, n)


def test_sglangs_import_of_the_tree_op_gets_the_standin() -> None:
    from sgl_kernel.speculative import reconstruct_indices_from_tree_mask

    assert reconstruct_indices_from_tree_mask is ops.reconstruct_indices_from_tree_mask


def test_fill_bonus_tokens_takes_each_requests_last_accepted_token() -> None:
    accept = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    bonus = torch.zeros(2, dtype=torch.long)
    ops.fill_bonus_tokens_cpu(accept, torch.tensor([3, 1]), bonus, 4)
    assert bonus.tolist() == [7, 9]
    with pytest.raises(ops.StandInError, match="accept_len 5 outside 1..4"):
        ops.fill_bonus_tokens_cpu(accept, torch.tensor([5, 1]), bonus, 4)


def test_fill_accept_out_cache_loc_packs_accepted_slots() -> None:
    out = torch.full((5,), -7)
    ops.fill_accept_out_cache_loc_cpu(torch.tensor([[0, 2, -1], [3, -1, -1]]), torch.tensor([40, 41, 42, 43]), out)
    assert out.tolist() == [40, 42, 43, -7, -7]
    with pytest.raises(ops.StandInError, match="outside -1..3"):
        ops.fill_accept_out_cache_loc_cpu(torch.tensor([4]), torch.tensor([40, 41, 42, 43]), out)


def test_request_table_reads_and_writes() -> None:
    table = torch.arange(30, dtype=torch.int32).view(3, 10)
    out = torch.zeros(6, dtype=torch.int64)
    ops.assign_draft_cache_locs_contiguous_cpu(torch.tensor([2, 0]), table, torch.tensor([4, 7]), out, 10, 1, 3)
    assert out.tolist() == [24, 25, 26, 7, 8, 9]
    out = torch.zeros(5, dtype=torch.int64)
    ops.assign_extend_cache_locs_cpu(torch.tensor([1, 2]), table, torch.tensor([2, 8]), torch.tensor([5, 10]), out, 10)
    assert out.tolist() == [12, 13, 14, 28, 29]
    ops.assign_req_to_token_pool_cpu(torch.tensor([0, 1]), table, torch.tensor([1, 5]), torch.tensor([3, 6]), torch.tensor([91, 92, 93]), 10)
    assert table[0, :4].tolist() == [0, 91, 92, 3] and table[1, 4:7].tolist() == [14, 93, 16]
    with pytest.raises(ops.StandInError, match="positions 8..10 outside"):
        ops.assign_extend_cache_locs_cpu(torch.tensor([0]), table, torch.tensor([8]), torch.tensor([11]), out, 10)


def test_build_tree_of_a_chain_and_of_a_branching_tree() -> None:
    """Hand-built trees: a topk=1 chain of 4 tokens, and topk=2 where tokens 1, 2 are the root's
    two children and token 3 is token 1's child."""
    n = 4
    tree_mask = torch.ones(2 * n + n * n, dtype=torch.bool)  # one request, seq_len 2, FULL_MASK
    positions = torch.zeros(n, dtype=torch.long)
    ri, nt, ns = (torch.full((1, n), -1, dtype=torch.long) for _ in range(3))
    # chain: step s chose column 0 of parent s (parent_list indices count from 1 after the root)
    ops.build_tree_kernel_efficient_cpu(torch.tensor([[-1, 0, 1, 2]]), torch.tensor([[0, 1, 2]]), torch.tensor([2]), tree_mask,
                                        positions, ri, nt, ns, 1, 3, n, 0)  # fmt: skip
    assert positions.tolist() == [2, 3, 4, 5]
    assert ri.tolist() == [[0, 1, 2, 3]] and nt.tolist() == [[1, 2, 3, -1]] and ns.tolist() == [[-1, -1, -1, -1]]
    rows = tree_mask.view(n, 2 + n).int().tolist()
    assert rows == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    # topk=2: selected draft choices 0, 1 (root's children) and 2 (child of choice 0, parent index 1)
    tree_mask = torch.ones(n * n, dtype=torch.bool)  # QLEN_ONLY
    ri, nt, ns = (torch.full((1, n), -1, dtype=torch.long) for _ in range(3))
    ops.build_tree_kernel_efficient_cpu(torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1, 2]]), torch.tensor([5]), tree_mask,
                                        positions, ri, nt, ns, 2, 2, n, 1)  # fmt: skip
    assert positions.tolist() == [5, 6, 6, 7]
    # the root's first child is token 1, whose next sibling is token 2; token 3 is token 1's child
    assert nt.tolist() == [[1, 3, -1, -1]] and ns.tolist() == [[-1, 2, -1, -1]]
    assert tree_mask.view(n, n).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    with pytest.raises(ops.StandInError, match="bit-packed"):
        ops.build_tree_kernel_efficient_cpu(torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1, 2]]), torch.tensor([5]), tree_mask,
                                            positions, ri, nt, ns, 2, 2, n, 2)  # fmt: skip



def test_build_tree_refuses_a_token_whose_parent_was_not_selected() -> None:
    """topk 2, 3 steps, 6 tree tokens: choice 8 (step 2) descends from choice 2 (step 1), which a
    tie left out of the selection (SGLang's kernel warns and reads past the row for it)."""
    n = 6
    tree_mask = torch.ones(n * n, dtype=torch.bool)
    positions = torch.zeros(n, dtype=torch.long)
    ri, nt, ns = (torch.full((1, n), -1, dtype=torch.long) for _ in range(3))
    with pytest.raises(ops.StandInError, match="draft token 5's parent 2 is not among the selected tokens"):
        ops.build_tree_kernel_efficient_cpu(torch.tensor([[-1, 0, 1, 4, 2]]), torch.tensor([[0, 1, 4, 6, 8]]), torch.tensor([7]),
                                            tree_mask, positions, ri, nt, ns, 2, 3, n, 1)  # fmt: skip


def test_verify_tree_greedy_accepts_the_matching_path() -> None:
    """Chain 0 -> 1 -> 2 -> 3: the target agrees with drafts 1 and 2, not 3."""
    candidates = torch.tensor([[50, 51, 52, 53]])
    target = torch.tensor([[51, 52, 60, 61]])  # the target's next token after each node
    ri = torch.tensor([[0, 1, 2, 3]])
    nt = torch.tensor([[1, 2, 3, -1]])
    ns = torch.full((1, 4), -1)
    predicts = torch.zeros(4, dtype=torch.long)
    accept_index = torch.full((1, 4), -1)
    accept_num = torch.zeros(1, dtype=torch.long)
    ops.verify_tree_greedy_cpu(predicts, accept_index, accept_num, candidates, ri, nt, ns, target)
    assert accept_num.tolist() == [2] and accept_index.tolist() == [[0, 1, 2, -1]]
    assert predicts.tolist() == [51, 52, 60, 0]  # the target's token at each accepted node, its bonus last
