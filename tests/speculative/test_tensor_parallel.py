"""Tensor parallelism on CPU over gloo: TP=2 decodes a tiny transformers-made MiMo-V2-Flash
checkpoint to exactly TP=1's tokens (greedy and MTP), counts that do not divide are refused by
name, and a failing or stalled rank ends the run within its time bound with the rank named."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from hal.distributed import TPGroup, init_tensor_parallel, launch_environment
from hal.errors import DistributedError, SpecError
from hal.tools.cli import main
from hal.tools.tp_launch import run_ranks

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tiny_mimo_checkpoints import add_mtp_layers, make_checkpoint  # noqa: E402  (after the importorskips)

from hal.speculative.mimo_config import MiMoConfig  # noqa: E402

PROMPTS = [[3, 7, 11, 2, 9, 14, 5, 8], [4, 5, 6]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("mimo-tp")
    make_checkpoint(directory, num_hidden_layers=6, sliding_window=5, attention_bias=True)  # biases shard with their heads
    add_mtp_layers(directory, 2)
    return directory


def generate_json(capsys: pytest.CaptureFixture[str], directory: Path, prompts_file: Path, *argv: str) -> dict:
    assert main(["generate", "--model", str(directory), "--prompts-file", str(prompts_file), "--max-new-tokens", "16",
                 "--json", "--threads", "1", *argv]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    return json.loads(line)


def test_tp2_tokens_equal_tp1_greedy_and_mtp(checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Full layers have 1 kv head (replicated on both ranks), SWA layers 2 (one each); MoE experts
    and dense MLPs are split by width; MTP layers the same."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    for mode in (["--speculative", "none"], ["--speculative", "mtp", "--num-draft-steps", "2"]):
        one = generate_json(capsys, checkpoint, prompts, *mode)
        start = time.perf_counter()
        two = generate_json(capsys, checkpoint, prompts, *mode, "--tp", "2")
        wall = time.perf_counter() - start
        assert two["tokens"] == one["tokens"], mode
        print(f"{mode[1]}: TP=1 {one['tokens_per_second']:.1f} tok/s, TP=2 {two['tokens_per_second']:.1f} tok/s "
              f"({wall:.1f} s with process start)", file=sys.stderr)


def test_shard_counts_that_do_not_divide_are_named(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = MiMoConfig.from_file(checkpoint / "config.json")
    with pytest.raises(SpecError, match=r"num_attention_heads=4 does not divide by the TP size 3"):
        config.for_tensor_parallel(TPGroup(rank=0, size=3))
    odd_kv = MiMoConfig.from_file(checkpoint / "config.json")
    import attrs

    odd_kv = attrs.evolve(odd_kv, swa=attrs.evolve(odd_kv.swa, num_q_heads=12, num_kv_heads=3),
                          full=attrs.evolve(odd_kv.full, num_q_heads=12))
    with pytest.raises(SpecError, match=r"num_key_value_heads=3 neither divides by nor divides the TP size 2"):
        odd_kv.for_tensor_parallel(TPGroup(rank=0, size=2))
    assert main(["generate", "--model", str(checkpoint), "--prompt-ids", "1,2", "--tp", "0"]) != 0
    assert "hal generate: argument --tp: must be an int >= 1, got '0'" in capsys.readouterr().err


def test_per_rank_kv_bytes_of_the_published_model() -> None:
    """MiMo-V2-Flash's published attention dims (tests/data/mimo_v2_flash_dims.json: 9 full layers
    with 4 kv heads, 39 SWA layers with 8, qk 192 + v 128), bf16."""
    published = Path(__file__).resolve().parents[1] / "data" / "mimo_v2_flash_dims.json"
    config = MiMoConfig.from_file(published)
    per_rank = {tp: config.for_tensor_parallel(TPGroup(0, tp)).kv_bytes_per_token(2) for tp in (1, 2, 4, 8)}
    per_layer = 320 * 2  # (192 + 128) x 2 bytes per kv head
    assert per_rank == {
        1: (9 * 4 + 39 * 8) * per_layer,
        2: (9 * 2 + 39 * 4) * per_layer,
        4: (9 * 1 + 39 * 2) * per_layer,
        8: (9 * 1 + 39 * 1) * per_layer,  # full layers' 4 kv heads replicated: one per rank
    }


def _join_then_fail(fail_rank: int, stall: bool) -> None:
    rank, size, local = launch_environment() or (0, 1, 0)
    tp = init_tensor_parallel("gloo", rank=rank, world_size=size, local_rank=local, timeout_s=3)
    if rank == fail_rank:
        if stall:
            time.sleep(120)  # never joins the collective; its peer's times out
        raise ValueError(f"injected failure on rank {rank}")
    tp.all_reduce(torch.ones(4))


@pytest.mark.parametrize("stall", [False, True], ids=["rank raises", "rank stalls"])
def test_a_failing_rank_ends_every_rank_in_bounded_time(stall: bool) -> None:
    start = time.perf_counter()
    with pytest.raises(DistributedError) as err:
        run_ranks(_join_then_fail, 2, 1, stall, timeout_s=60)
    elapsed = time.perf_counter() - start
    assert elapsed < 40, elapsed
    if stall:  # the waiting rank's collective timed out: it is the one reported
        assert "rank 0 failed" in str(err.value)
    else:
        assert "rank 1 failed: ValueError: injected failure on rank 1" in str(err.value)


def test_graph_runner_captures_after_a_barrier_on_the_tp_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each captured graph waits on the group's barrier (after its warm-up), so all ranks capture together."""
    import torch.distributed as dist

    import hal
    from hal.spec import ForwardMode, KVPoolSpec

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        barriers: list[object] = []
        real_barrier = dist.barrier
        monkeypatch.setattr(dist, "barrier", lambda group=None: (barriers.append(group), real_barrier(group=group)))
        backend = hal.get_backend("cpu")
        pool = backend.create_kv_pool(KVPoolSpec(1, 64, 16, 1, 8, 8))
        attn = backend.create_attention(pool)
        runner = hal.GraphRunner(backend, lambda inputs, md: inputs["x"] * 2, attention=attn, mode=ForwardMode.DECODE,
                                 tokens_per_request=1, batch_sizes=[1, 2], max_pages_per_request=2,
                                 inputs={"x": ((4,), torch.float32)}, replay_captured=True, tp_group=dist.group.WORLD)
        runner.capture()
        assert barriers == [dist.group.WORLD, dist.group.WORLD]  # one per captured batch size
    finally:
        dist.destroy_process_group()
