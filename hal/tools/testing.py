"""Building blocks of the conformance suite: random cases checked against the oracle.

A case fills a backend's pool and a CPU pool with the same prefix K/V (pages shuffled, so block
tables are not contiguous), runs one attention forward through the backend's kernel and through
``hal.oracle.OracleAttention`` on the CPU pool, and compares outputs and the written cache with a
per-dtype tolerance.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from collections.abc import Sequence
from typing import Any, cast

import attrs
import torch

from hal.allocator import KVAllocator, RequestPageTable
from hal.errors import UnsupportedConfigError
from hal.metadata import AttentionMetadata, build_metadata
from hal.oracle import OracleAttention
from hal.protocols import AttentionKernel, Backend, KVPool
from hal.spec import ForwardMode, KVPoolSpec, LayerSpec, SWAPoolSpec
from hal.tree import tree_depths, tree_mask_from_parents

# (atol, rtol) for outputs compared to the oracle's on the same stored inputs (rounded to the
# output dtype): about two ulps of the output dtype at magnitude 1.
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def _int_tuple(value: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(x) for x in value)


@attrs.frozen
class AttentionCase:
    """One attention forward to check. ``kv_lens`` include the ``q_lens`` new tokens."""

    mode: ForwardMode
    layer: LayerSpec
    kv_lens: tuple[int, ...] = attrs.field(converter=_int_tuple)
    q_lens: tuple[int, ...] = attrs.field(converter=_int_tuple)
    page_size: int = 16
    dtype: torch.dtype = torch.float32
    hybrid: bool = False  # put the layer in the SWA sub-pool of a hybrid pool
    seed: int = 0
    # TARGET_VERIFY over draft trees: each request's verify rows' parents (hal.tree_mask_from_parents)
    tree_parents: tuple[tuple[int, ...], ...] | None = attrs.field(
        default=None, converter=lambda v: None if v is None else tuple(_int_tuple(p) for p in v)
    )

    def describe(self) -> str:
        """A short label of the case for reports."""
        lay = self.layer
        parts = [
            self.mode.name,
            f"q{lay.num_q_heads}/kv{lay.num_kv_heads}",
            f"d{lay.head_dim}/{lay.v_head_dim}",
            f"ps{self.page_size}",
            str(self.dtype).replace("torch.", ""),
        ]
        if lay.sliding_window is not None:
            parts.append(f"swa{lay.sliding_window}{'-hybrid' if self.hybrid else ''}")
        if lay.has_sinks:
            parts.append("sinks")
        if self.tree_parents is not None:
            depth = int(tree_depths(tree_mask_from_parents(self.tree_parents)).max()) if self.q_lens[0] else 0
            parts.append(f"tree depth {depth}")
        return " ".join(parts) + f" kv={list(self.kv_lens)} q={list(self.q_lens)}"


@attrs.define
class CaseResult:
    """Outcome of ``run_attention_case``: passed, the largest output error, what differed."""

    case: AttentionCase
    passed: bool
    max_abs_err: float
    detail: str = ""


@attrs.define
class PreparedCase:
    """A case materialised on one backend (and its CPU twin)."""

    pool: KVPool
    kernel: AttentionKernel
    metadata: AttentionMetadata
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    sinks: torch.Tensor | None
    # Full-pool slot of every token the case stores (prefix and new tokens, request after request).
    slots: torch.Tensor = attrs.field(factory=lambda: torch.zeros(0, dtype=torch.int64))


def kv_rows(pool: KVPool, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """Row indices into the layer's buffers viewed as ``[slots, heads, dim]`` for full-pool ``slots``.

    Uses only the ``KVPool`` protocol (``swa_block_table`` routes SWA layers), so it is an
    independent check of where a backend's pool put each token.
    """
    slots = slots.to("cpu", torch.int64).reshape(-1)
    ps = pool.spec.page_size
    pages, offsets = torch.div(slots, ps, rounding_mode="floor"), slots % ps
    if pool.is_swa_layer(layer):
        table = pages.view(1, -1).to(device=pool.device, dtype=torch.int32)
        pages = pool.swa_block_table(table).view(-1).to("cpu", torch.int64)
    return pages * ps + offsets


def read_kv(pool: KVPool, layer: int, slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Host copies of one layer's K and V as ``[slots, heads, dim]``, all rows or those of ``slots``."""
    out = []
    for buf in (pool.k_buffer(layer), pool.v_buffer(layer)):
        rows = buf.detach().to("cpu").reshape(-1, buf.shape[-2], buf.shape[-1])
        out.append(rows.clone() if slots is None else rows[kv_rows(pool, layer, slots)])
    return out[0], out[1]


def pool_spec_for(case: AttentionCase, extra_pages: int = 3) -> KVPoolSpec:
    """A pool just big enough for ``case`` (hybrid: the layer in the SWA part, odd full dims)."""
    lay = case.layer
    pages = sum(-(-n // case.page_size) for n in case.kv_lens) + extra_pages
    size = pages * case.page_size
    num_layers = lay.layer_id + 1
    if case.hybrid:
        swa = SWAPoolSpec(
            layer_ids=(lay.layer_id,), size=size, kv_heads=lay.num_kv_heads, head_dim=lay.head_dim, v_head_dim=lay.v_head_dim
        )
        # The full part gets other dims so a layer routed to the wrong sub-pool fails loudly.
        return KVPoolSpec(num_layers + 1, size + 2 * case.page_size, case.page_size, lay.num_kv_heads + 1, 16, 16, case.dtype, swa)
    return KVPoolSpec(num_layers, size, case.page_size, lay.num_kv_heads, lay.head_dim, lay.v_head_dim, case.dtype)


def prepare_case(backend: Backend, case: AttentionCase) -> tuple[PreparedCase, PreparedCase]:
    """Materialise ``case`` on ``backend`` and on a CPU pool whose kernel is the oracle, with
    identical contents: (the backend's, the oracle's)."""
    from hal.backends.cpu import CpuBackend

    oracle_side = cast(Backend, CpuBackend())
    lay = case.layer
    spec = pool_spec_for(case)
    gen = torch.Generator().manual_seed(case.seed)
    rng = random.Random(case.seed)
    prepared = []
    # Same page assignment in both pools: allocate, then shuffle identically.
    page_lists: list[list[int]] | None = None
    for be in (backend, oracle_side):
        pool = be.create_kv_pool(spec)
        table = RequestPageTable(KVAllocator(pool))
        for r, n in enumerate(case.kv_lens):
            table.reserve(r, n)
        if page_lists is None:
            all_pages = [p for r in range(len(case.kv_lens)) for p in table.pages(r)]
            shuffled = all_pages[:]
            rng.shuffle(shuffled)
            remap = dict(zip(all_pages, shuffled))
            page_lists = [[remap[p] for p in table.pages(r)] for r in range(len(case.kv_lens))]
        for r, pages in enumerate(page_lists):
            table._pages[r] = list(pages)  # noqa: SLF001 - same pages, permuted order
        prepared.append((be, pool, table))
    assert page_lists is not None

    heads, dk, dv = lay.num_kv_heads, lay.head_dim, lay.v_head_dim
    prefix = [n - q for n, q in zip(case.kv_lens, case.q_lens)]
    prefix_k = [torch.randn(p, heads, dk, generator=gen).to(case.dtype) for p in prefix]
    prefix_v = [torch.randn(p, heads, dv, generator=gen).to(case.dtype) for p in prefix]
    t = sum(case.q_lens)
    q = torch.randn(t, lay.num_q_heads, dk, generator=gen).to(case.dtype)
    k = torch.randn(t, heads, dk, generator=gen).to(case.dtype)
    v = torch.randn(t, heads, dv, generator=gen).to(case.dtype)
    # bf16-representable sinks: every backend sees the same values, whatever dtype its op wants.
    sinks = (torch.randn(lay.num_q_heads, generator=gen) * 2).bfloat16().float() if lay.has_sinks else None

    out = []
    for be, pool, table in prepared:
        dev = pool.device
        for r, p in enumerate(prefix):
            if p:
                pool.set_kv(lay.layer_id, table.slots(r, range(p)).to(dev), prefix_k[r].to(dev), prefix_v[r].to(dev))
        loc = torch.cat(
            [table.slots(r, range(n - ql, n)) for r, (n, ql) in enumerate(zip(case.kv_lens, case.q_lens))]
            or [torch.zeros(0, dtype=torch.int64)]
        )
        stored = torch.cat(
            [table.slots(r, range(n)) for r, n in enumerate(case.kv_lens)] or [torch.zeros(0, dtype=torch.int64)]
        )
        md = build_metadata(
            case.mode, kv_lens=case.kv_lens, q_lens=case.q_lens, page_table=page_lists, out_cache_loc=loc, pool=pool,
            tree_mask=None if case.tree_parents is None else tree_mask_from_parents(case.tree_parents),
        )
        out.append(
            PreparedCase(
                pool,
                OracleAttention(pool) if be is oracle_side else be.create_attention(pool),
                md,
                q.to(dev),
                k.to(dev),
                v.to(dev),
                None if sinks is None else sinks.to(dev),
                stored,
            )
        )
    return out[0], out[1]


def poison_unseen_rows(pool: KVPool, layer: int, stored: torch.Tensor) -> None:
    """Fill every K row of ``layer`` that holds none of the ``stored`` slots' tokens with NaN and
    every such V row with inf (what an earlier owner of a reused page may have left there), the
    padding page included."""
    rows = kv_rows(pool, layer, stored)
    for buf, value in ((pool.k_buffer(layer), float("nan")), (pool.v_buffer(layer), float("inf"))):
        flat = buf.view(-1, buf.shape[-2], buf.shape[-1])
        unseen = torch.ones(flat.shape[0], dtype=torch.bool)
        unseen[rows] = False
        flat[unseen.to(flat.device)] = value


def poisoned_new_rows(case: AttentionCase) -> list[int]:
    """The new rows ``run_attention_case(..., poison_new_key=True)`` gives a NaN key: each
    request's second new row (its first row, and a chain's, do not see it; a tree's siblings and
    their subtrees neither)."""
    rows, start = [], 0
    for q in case.q_lens:
        if q >= 2:
            rows.append(start + 1)
        start += q
    return rows


def run_attention_case(
    backend: Backend, case: AttentionCase, *, poison_unseen: bool = False, poison_new_key: bool = False
) -> CaseResult:
    """Run ``case`` on ``backend`` and through the oracle; compare outputs and the written cache.

    The cache check needs no zero-initialised pool: the rows of every stored token must equal
    the oracle pool's, and every other row must be what it was before the forward. With
    ``poison_unseen`` the backend's pool holds NaN/inf in every row no token of the case owns
    (``poison_unseen_rows``); nothing a row cannot see may reach its output, so the output must
    still equal the oracle's over a clean pool. With ``poison_new_key`` the key of one new row per
    request is NaN (``poisoned_new_rows``) in both runs: exactly the rows that see it must come
    out NaN, as the oracle's do, and every other row must equal the oracle's.
    """
    got, ref = prepare_case(backend, case)
    lay = case.layer
    if poison_unseen:
        poison_unseen_rows(got.pool, lay.layer_id, got.slots)
    if poison_new_key:
        for prepared in (got, ref):
            prepared.k[poisoned_new_rows(case)] = float("nan")
    before_k, before_v = read_kv(got.pool, lay.layer_id)
    out = got.kernel.forward(got.q, got.k, got.v, lay, got.kernel.plan(got.metadata), sinks=got.sinks)
    expect = ref.kernel.forward(ref.q, ref.k, ref.v, lay, ref.kernel.plan(ref.metadata), sinks=ref.sinks)
    atol, rtol = TOLERANCE[case.dtype]
    out_c = out.detach().to("cpu").float()
    exp_c = expect.float()
    if out_c.shape != exp_c.shape:
        return CaseResult(case, False, float("inf"), f"output shape {tuple(out_c.shape)} != {tuple(exp_c.shape)}")
    err = (out_c - exp_c).abs()
    max_err = float(err.nan_to_num(0.0).max()) if err.numel() else 0.0
    ok = bool(torch.allclose(out_c, exp_c, atol=atol, rtol=rtol, equal_nan=True))  # NaN only where the oracle's is
    detail = "" if ok else f"output differs: max |err| {max_err:.3g} > atol {atol} + rtol {rtol}"
    if poison_new_key and not torch.equal(out_c.isnan(), exp_c.isnan()):
        wrong = (out_c.isnan() != exp_c.isnan()).flatten(1).any(1).nonzero().flatten().tolist()
        detail += f"; rows {wrong[:8]} are NaN where the oracle's are not, or finite where a NaN key they see must reach them"
    elif not bool(torch.isfinite(out_c).all()) and not poison_new_key:
        detail += f"; {int((~torch.isfinite(out_c)).sum())} output values are not finite (NaN/inf from slots no row sees?)"
    got_rows = kv_rows(got.pool, lay.layer_id, got.slots)
    ref_k, ref_v = read_kv(ref.pool, lay.layer_id, ref.slots)
    after_k, after_v = read_kv(got.pool, lay.layer_id)
    for name, before, after, expected in (("K", before_k, after_k, ref_k), ("V", before_v, after_v, ref_v)):
        if not _same_with_nan(after[got_rows], expected):  # a poisoned new key is stored as NaN
            ok = False
            detail += f"; cached {name} of the case's tokens differs from the oracle pool's"
        untouched = torch.ones(after.shape[0], dtype=torch.bool)
        untouched[got_rows] = False
        if not _same_with_nan(after[untouched], before[untouched]):
            ok = False
            detail += f"; the forward changed {name} rows that belong to no token of the case"
    return CaseResult(case, ok, max_err, detail.lstrip("; "))


def _same_with_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal`` that counts NaN as equal to NaN (a poisoned row left as it was)."""
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)))


def standard_attention_cases(
    *,
    dtypes: Sequence[torch.dtype] = (torch.float32,),
    page_sizes: Sequence[int] = (16,),
    head_dims: Sequence[tuple[int, int]] = ((64, 32), (64, 64)),
    heads: Sequence[tuple[int, int]] = ((4, 1), (4, 4)),
    seed: int = 0,
) -> list[AttentionCase]:
    """Every forward mode crossed with window/sinks/hybrid, on ragged batches crossing page edges."""
    cases: list[AttentionCase] = []
    spec_tokens = 4
    for dtype in dtypes:
        for ps in page_sizes:
            for dk, dv in head_dims:
                for hq, hkv in heads:
                    for window, sinks, hybrid in ((None, False, False), (None, True, False), (5, False, False), (5, True, True)):
                        layer = LayerSpec(0, hq, hkv, dk, dv, scaling=dk**-0.5, sliding_window=window, has_sinks=sinks)
                        long = 2 * ps + 3
                        shapes = {
                            ForwardMode.EXTEND: ((long, 7, ps), (long, 3, ps)),  # prefix + new, incl. a full prefill
                            ForwardMode.DECODE: ((long, 1, ps + 1, 2), (1, 1, 1, 1)),
                            ForwardMode.TARGET_VERIFY: ((long, ps + 2, spec_tokens), (spec_tokens,) * 3),
                            ForwardMode.DRAFT_EXTEND_V2: ((ps, long, spec_tokens + 1), (spec_tokens,) * 3),
                        }
                        for mode, (kv, q) in shapes.items():
                            cases.append(AttentionCase(mode, layer, kv, q, ps, dtype, hybrid, seed + len(cases)))
    return cases


def spread_sinks_and_router(model: torch.nn.Module) -> None:
    """Draw a transformers MiMo-V2-Flash model's attention sinks, q/k/v biases (with
    ``attention_bias``) and expert-router biases at random (their initialisation leaves them 0), so
    that sinks, biases and the choice of experts matter in tests."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("sinks") or name.endswith("_proj.bias"):
                parameter.normal_(0, 1)
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.normal_(0, 0.5)


def module_from_file(name: str, path: Path | str) -> Any:
    """The module ``name`` executed from the source file ``path``, put in ``sys.modules`` (a pinned
    engine file before or after a patch, loaded beside or in place of the installed one)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def pinned_source(tree: Path, installed: Path, target: str, patch: Path) -> Path:
    """``tree`` holding an engine's installed source file at ``target`` (its path in the engine's
    repository), with ``patch`` reversed when the installation carries it: the pinned release's
    file, on which an upstream patch's test runs before and after. Returns ``tree``."""
    import shutil
    import subprocess

    dest = tree / target
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(installed, dest)
    reverse = ["git", "apply", "--reverse", str(patch)]
    if subprocess.run([*reverse, "--check"], cwd=tree, capture_output=True).returncode == 0:  # installed patched
        subprocess.run(reverse, cwd=tree, capture_output=True, check=True)
    return tree


def save_published_copy(checkpoint: Path | str, directory: Path | str) -> Path:
    """A copy of a MiMo-V2-Flash checkpoint (single safetensors file) with its config.json in the
    published key names (``MiMoConfig.published_dict``), the form SGLang reads; returns ``directory``."""
    import json
    import shutil

    from hal.speculative.mimo_config import MiMoConfig

    source, target = Path(checkpoint), Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / "model.safetensors", target / "model.safetensors")
    (target / "config.json").write_text(json.dumps(MiMoConfig.from_file(source / "config.json").published_dict()))
    return target


def save_random_llama(directory: Path | str, *, initializer_range: float = 0.3, **sizes: int) -> Path:
    """A random fp32 Llama saved by transformers, its weights drawn with a large spread
    (``initializer_range=0.3``) so that attention decides the greedy tokens (a smaller spread
    leaves the tokens more predictable from the last one, as a draft model needs)."""
    import transformers

    fields: dict[str, Any] = {
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 512, **sizes,
        "initializer_range": initializer_range, "architectures": ["LlamaForCausalLM"], "torch_dtype": "float32",
    }  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).save_pretrained(directory)
    return Path(directory)


#: The largest possible gap between two of the draft's logits (a float32 probability stays under 1: 1 - 3e-7 at most).
EAGLE_DRAFT_MAX_LOGIT_GAP = 15.0


#: The architecture an EAGLE draft's config names, per engine (vLLM names the target's and maps it
#: to ``EagleLlamaForCausalLM`` itself).
EAGLE_DRAFT_ARCHITECTURES = {"sglang": "LlamaForCausalLMEagle", "vllm": "LlamaForCausalLM"}


def save_distilled_eagle_draft(target: Path | str, directory: Path | str, *, sequences: int = 256, length: int = 48, steps: int = 400,
                               seed: int = 0, engine: str = "sglang") -> Path:
    """A small EAGLE draft model for a target Llama, in ``engine``'s format (SGLang's
    ``LlamaForCausalLMEagle``, or vLLM's ``EagleLlamaForCausalLM``: the same layout, ``fc`` without
    a bias, the target's architecture named in the config), distilled from the target so that its drafts are often (not always) right.

    EAGLE's draft reads, at position ``p``, the embedding of token ``p + 1`` and the target's last
    hidden state at ``p`` (after the final norm), mixes them with ``fc`` and runs one Llama decoder
    layer without its input norm and without a final norm (SGLang's ``LlamaForCausalLMEagle``); the
    target's embedding and LM head are shared (SGLang's EAGLE worker hands them to the draft, so the
    checkpoint holds neither). Here the layer's attention is random and its MLP silent, and ``fc`` is
    trained to the target's greedy token at ``p + 1``.

    Its probabilities stay away from 1 whatever it reads: EAGLE's tree scores are products of them,
    and a probability that rounds to 1 in float32 lets a child tie its parent and be chosen without
    it, a tree SGLang's tree kernel does not define (it warns and reads past the row). Every input
    row has a bounded norm (an embedding row; a hidden state after an RMS norm), attention mixes
    value rows, so the draft's output norm is at most ``|fc(x)| * (1 + |o_proj| |v_proj|)`` (spectral
    norms); ``fc`` is scaled after each step so that no two logits can differ by more than
    ``EAGLE_DRAFT_MAX_LOGIT_GAP``.
    """
    import transformers
    from safetensors.torch import save_file

    if engine not in EAGLE_DRAFT_ARCHITECTURES:
        raise UnsupportedConfigError(f"engine={engine!r}: expected one of {sorted(EAGLE_DRAFT_ARCHITECTURES)}")
    directory = Path(directory)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(target, use_kernels=False).eval()
    model.generation_config.eos_token_id = None  # every sequence runs its full length
    model.generation_config.pad_token_id = 0
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = 1
    with torch.no_grad():
        prompts = torch.randint(0, config.vocab_size, (sequences, length // 3))
        tokens = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=length - prompts.shape[1],
                                do_sample=False)
        outputs = model.model(input_ids=tokens)
        hidden = outputs.last_hidden_state  # after the final norm, as SGLang's Llama hands it on
        labels = model.lm_head(hidden).argmax(-1)  # the target's greedy token after each position
    embed, head = model.model.embed_tokens, model.lm_head

    config.initializer_range = 0.02
    draft: Any = transformers.LlamaModel(config)
    layer: Any = draft.layers[0]
    draft.embed_tokens = None
    layer.input_layernorm = torch.nn.Identity()
    draft.norm = torch.nn.Identity()
    attention = layer.self_attn
    with torch.no_grad():
        layer.mlp.down_proj.weight.zero_()
    draft.requires_grad_(False)
    fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=engine == "sglang")
    optimizer = torch.optim.Adam(fc.parameters(), lr=3e-3)
    # Row p: token p + 1 and the target's hidden state at p; the label is the target's token after p + 1.
    inputs = torch.cat([embed(tokens[:, 1:]).detach(), hidden[:, :-1]], dim=-1)
    positions = torch.arange(length - 1).expand(sequences, -1)
    target_tokens = labels[:, 1:]

    def spectral(w: torch.Tensor) -> float:
        return float(torch.linalg.matrix_norm(w, ord=2))

    with torch.no_grad():
        row_bound = (float(embed.weight.norm(dim=1).max()) ** 2
                     + config.hidden_size * float(model.model.norm.weight.abs().max()) ** 2) ** 0.5
        mixing = 1 + spectral(attention.o_proj.weight) * spectral(attention.v_proj.weight)
        logit_per_norm = 2 * float(head.weight.norm(dim=1).max())
    for _ in range(steps):
        optimizer.zero_grad()
        out = draft(inputs_embeds=fc(inputs), position_ids=positions).last_hidden_state
        loss = torch.nn.functional.cross_entropy(head(out).flatten(0, 1), target_tokens.flatten())
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            bias_norm = float(fc.bias.norm()) if fc.bias is not None else 0.0
            gap = (spectral(fc.weight) * row_bound + bias_norm) * mixing * logit_per_norm
            if gap > EAGLE_DRAFT_MAX_LOGIT_GAP:
                for parameter in fc.parameters():
                    parameter.mul_(EAGLE_DRAFT_MAX_LOGIT_GAP / gap)

    weights = {name: t.detach().contiguous() for name, t in draft.state_dict().items() if not name.startswith("rotary")}
    weights.update({f"fc.{name}": t.detach().contiguous() for name, t in fc.state_dict().items()})
    directory.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(directory / "model.safetensors"))
    fields = json.loads((Path(target) / "config.json").read_text())
    fields.update(architectures=[EAGLE_DRAFT_ARCHITECTURES[engine]], num_hidden_layers=1)
    (directory / "config.json").write_text(json.dumps(fields, indent=2))
    return directory
