"""EAGLE-3 heads on disk and their paged forward.

Synthetic checkpoints are written from the published layouts, spelled out here (not taken from the
loader): the original EAGLE-3 release (``midlayer.*`` in ``pytorch_model.bin``, a llama
config.json) and speculators' format (``layers.{i}.*`` in safetensors; its config.json as
speculators 0.9.0's ``Eagle3SpeculatorConfig`` writes it). Both load as the same head; the paged
forward of a head over a batch of sequences — final slots, chained drafts, rejections rewriting the
chain's K/V — equals a plain dense reference of the published computation; ``d2t`` maps draft rows
to target ids; layer ids come from the config or vLLM's default; each missing piece is refused by name.

speculators itself imports in ~20 s here (transformers, datasets) and is not a project dependency,
so the default tier writes its format from the spelled-out config below; the ``slow`` test writes a
checkpoint with speculators' own classes and checks it loads as that one. To run it:
``pip install --no-deps --target DIR speculators==0.9.0 hs-connectors==0.9.0 loguru pydantic-settings``,
then ``PYTHONPATH=DIR .venv/bin/python -P -m pytest -m slow tests/test_eagle3_heads.py``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

import pytest
import torch
from safetensors.torch import save_file

from specdecode.runtime.engine.model_runner import Span, build_attention_batch
from specdecode.runtime.models.attention import kv_pool
from specdecode.runtime.models.decoder import DecoderLM
from specdecode.runtime.models.dummy import random_hf_weights
from specdecode.runtime.models.eagle3 import Eagle3Head
from specdecode.runtime.models.eagle3_checkpoint import load_eagle3_head
from specdecode.runtime.models.model_config import ModelConfig

TARGET_LAYERS = 8  # vLLM's default aux ids for it: (2, 4, 5)
BLOCK_SIZE = 4
K = 3


# --- a target and heads in the published layouts -------------------------------------------


@pytest.fixture(scope="module")
def target(tiny_hf_model_dir) -> DecoderLM:
    """The tiny llama's shapes with 8 layers (so vLLM's default aux ids fit), sharp random weights."""
    hf = json.loads((tiny_hf_model_dir / "config.json").read_text()) | {"num_hidden_layers": TARGET_LAYERS}
    cfg = ModelConfig.from_hf(hf)
    model = DecoderLM(cfg)
    model.load_weights(random_hf_weights(cfg, seed=2, std=0.3))
    return model.eval()


@dataclass
class HeadSpec:
    """A head's shapes and options, as a checkpoint states them."""

    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 96
    layers: int = 1
    draft_vocab: int | None = 96  # None: the full vocabulary (no d2t)
    aux_ids: list[int] | None = None  # None: not in the config (vLLM's default)
    norm_before_residual: bool = False
    norm_output: bool = False
    extra: dict = field(default_factory=dict)  # more config keys


def head_tensors(spec: HeadSpec, target: DecoderLM, first_block: str, seed: int) -> dict[str, torch.Tensor]:
    """The head's tensors under the published names; layer 0's prefix is ``first_block``."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape, s=0.2: torch.randn(*shape, generator=gen) * s  # noqa: E731
    h, ht, vocab = spec.hidden, target.config.hidden_size, target.config.vocab_size
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    out = {"fc.weight": r(h, 3 * ht, s=0.2 / math.sqrt(3 * ht)), "norm.weight": 1 + r(h),
           "lm_head.weight": r(spec.draft_vocab or vocab, h, s=0.5)}
    for i in range(spec.layers):
        p = first_block if i == 0 else f"layers.{i}."
        width = 2 * h if i == 0 else h  # the midlayer's q/k/v read cat[embedding, hidden]
        out |= {p + "input_layernorm.weight": 1 + r(h), p + "post_attention_layernorm.weight": 1 + r(h),
                p + "self_attn.q_proj.weight": r(q, width), p + "self_attn.k_proj.weight": r(kv, width),
                p + "self_attn.v_proj.weight": r(kv, width), p + "self_attn.o_proj.weight": r(h, q),
                p + "mlp.gate_proj.weight": r(spec.intermediate, h), p + "mlp.up_proj.weight": r(spec.intermediate, h),
                p + "mlp.down_proj.weight": r(h, spec.intermediate)}
    out[first_block + "hidden_norm.weight"] = 1 + r(h)
    if spec.draft_vocab is not None:
        ids = torch.randperm(vocab, generator=gen)[: spec.draft_vocab].sort().values
        out["d2t"] = ids - torch.arange(spec.draft_vocab)  # target id = draft id + d2t[draft id]
        out["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)
    if h != ht:
        out["embed_tokens.weight"] = r(vocab, h, s=1.0)  # a narrower head has its own embedding
    return out


def llama_block_config(spec: HeadSpec, target: DecoderLM) -> dict:
    c = target.config
    return {"hidden_size": spec.hidden, "intermediate_size": spec.intermediate, "num_attention_heads": spec.heads,
            "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_dim, "num_hidden_layers": spec.layers,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "vocab_size": c.vocab_size, "hidden_act": "silu"}


def write_original(folder, spec: HeadSpec, target: DecoderLM, seed: int, drop: tuple[str, ...] = (), **config) -> str:
    """The original EAGLE-3 release's layout: ``midlayer.*`` in pytorch_model.bin, a llama config.json
    (its ``vocab_size`` the target's) with ``draft_vocab_size``."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {n: t for n, t in head_tensors(spec, target, "midlayer.", seed).items() if n not in drop}
    hf = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **llama_block_config(spec, target),
          "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
          "draft_vocab_size": spec.draft_vocab or target.config.vocab_size}
    if spec.hidden != target.config.hidden_size:
        hf["target_hidden_size"] = target.config.hidden_size
    if spec.aux_ids is not None:
        hf["eagle_aux_hidden_state_layer_ids"] = spec.aux_ids
    if spec.norm_before_residual:
        hf["norm_before_residual"] = True
    (folder / "config.json").write_text(json.dumps(hf | spec.extra | config))
    torch.save(tensors, folder / "pytorch_model.bin")
    return str(folder)


def speculators_config(spec: HeadSpec, target: DecoderLM) -> dict:
    """config.json as speculators 0.9.0 writes an EAGLE-3 head (``Eagle3SpeculatorConfig`` with a
    ``LlamaConfig`` transformer layer, saved by ``save_pretrained``; the slow test checks it)."""
    block = llama_block_config(spec, target) | {
        "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
        "initializer_range": 0.02, "mlp_bias": False, "pad_token_id": None, "pretraining_tp": 1,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "tie_word_embeddings": False,
        "use_cache": True}
    return {
        "architectures": ["Eagle3DraftModel"], "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "draft_vocab_size": spec.draft_vocab or target.config.vocab_size, "dtype": "float32",
        "eagle_aux_hidden_state_layer_ids": spec.aux_ids, "embed_requires_grad": False, "fc_norm": False,
        "norm_before_fc": False, "norm_before_residual": spec.norm_before_residual, "norm_output": spec.norm_output,
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy", "proposal_methods": [
            {"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": K, "verifier_accept_k": 1}],
            "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": None}},
        "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
        "target_hidden_size": target.config.hidden_size, "tie_word_embeddings": False,
        "transformer_layer_config": block,
    }


def write_speculators(folder, spec: HeadSpec, target: DecoderLM, seed: int, drop: tuple[str, ...] = (),
                      **config) -> str:
    """speculators' format: ``layers.{i}.*``, the embedding it saves (the target's, for a head as wide),
    in model.safetensors beside its config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = head_tensors(spec, target, "layers.0.", seed)
    tensors.setdefault("embed_tokens.weight", target.model.embed_tokens.weight.detach().clone())
    save_file({n: t.contiguous() for n, t in tensors.items() if n not in drop}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(speculators_config(spec, target) | spec.extra | config))
    return str(folder)


WRITERS = {"original": write_original, "speculators": write_speculators}


# --- a dense reference of the published computation -----------------------------------------


def rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta=10000.0):  # x: [T, heads, hd]
    hd = x.shape[-1]
    ang = positions.float()[:, None] / theta ** (torch.arange(0, hd, 2).float() / hd)[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    return x * cos + torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1) * sin


def causal_attention(w, p, x, positions, spec: HeadSpec):
    """x: [T, in] rows in the order they ran, each attending itself and the rows before it."""
    q = rope((x @ w[p + "self_attn.q_proj.weight"].T).view(-1, spec.heads, spec.head_dim), positions)
    k = rope((x @ w[p + "self_attn.k_proj.weight"].T).view(-1, spec.kv_heads, spec.head_dim), positions)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(-1, spec.kv_heads, spec.head_dim)
    group = spec.heads // spec.kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(spec.head_dim)
    t = x.shape[0]
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, -1) @ w[p + "self_attn.o_proj.weight"].T


def mlp(w, p, x):
    gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T


def reference_outputs(w, spec: HeadSpec, embeds, hidden, positions):
    """Every row's ``out`` [T, H] for rows (embedding [T, H], input hidden [T, H], position [T]) of one
    sequence: the midlayer over cat[input_layernorm(e), hidden_norm(g)], residual g (or its norm),
    then plain blocks."""
    p = "layers.0."
    normed = rms(hidden, w[p + "hidden_norm.weight"])
    x = torch.cat([rms(embeds, w[p + "input_layernorm.weight"]), normed], -1)
    s = (normed if spec.norm_before_residual else hidden) + causal_attention(w, p, x, positions, spec)
    s = s + mlp(w, p, rms(s, w[p + "post_attention_layernorm.weight"]))
    for i in range(1, spec.layers):
        p = f"layers.{i}."
        s = s + causal_attention(w, p, rms(s, w[p + "input_layernorm.weight"]), positions, spec)
        s = s + mlp(w, p, rms(s, w[p + "post_attention_layernorm.weight"]))
    return s


def aux_states(target: DecoderLM, tokens: list[int], ids: tuple[int, ...]) -> torch.Tensor:
    """[T, 3·H_t]: the residual stream entering each of the target layers ``ids`` at every position
    (id 0: the embedding), by running the target's layers one after another over a fresh cache."""
    c = target.config
    blocks = -(-len(tokens) // BLOCK_SIZE)
    batch = build_attention_batch([Span(list(range(blocks)), 0, len(tokens))], BLOCK_SIZE, blocks, torch.device("cpu"))
    x = target.model.embed_tokens(torch.tensor(tokens))
    entering = []
    for layer in target.model.layers:
        entering.append(x)
        pool = kv_pool(blocks, BLOCK_SIZE, c.num_kv_heads, c.head_dim, dtype=torch.float32, device=torch.device("cpu"))
        x = layer(x, target.rope, pool, batch)
    return torch.cat([entering[i] for i in ids], -1)


class DenseSequence:
    """One sequence's head rows, recomputed from scratch: final slots 0..n−1 fed fc(aux(q − 1)) (zeros
    at 0), then chain slots fed the previous row's out (or its norm with ``norm_output``)."""

    def __init__(self, w, spec: HeadSpec, target: DecoderLM, tokens: list[int], ids, embedding):
        aux = aux_states(target, tokens[:-1], ids)
        fused = torch.cat([torch.zeros(1, spec.hidden), aux @ w["fc.weight"].T])
        self.w, self.spec, self.embedding = w, spec, embedding
        self.embeds, self.hidden = embedding[torch.tensor(tokens)], fused  # [n, H] each
        self.outs = self._run()

    def _run(self):
        positions = torch.arange(len(self.embeds))
        return reference_outputs(self.w, self.spec, self.embeds, self.hidden, positions)

    def chain(self, token: int) -> torch.Tensor:
        prev = self.outs[-1]
        fed = rms(prev, self.w["norm.weight"]) if self.spec.norm_output else prev
        self.embeds = torch.cat([self.embeds, self.embedding[token][None]])
        self.hidden = torch.cat([self.hidden, fed[None]])
        self.outs = self._run()
        return self.outs[-1]

    def draft(self, d2t_ids: torch.Tensor) -> int:  # argmax over the draft vocabulary, as a target id
        return int(d2t_ids[(rms(self.outs[-1], self.w["norm.weight"]) @ self.w["lm_head.weight"].T).argmax()])


# --- the paged head, driven as a proposer would drive it ------------------------------------


class PagedHead:
    """The head's slots for a batch of sequences under shuffled block tables."""

    def __init__(self, head: Eagle3Head, target: DecoderLM, num_seqs: int, blocks_per_seq: int):
        gen = torch.Generator().manual_seed(0)
        order = torch.randperm(num_seqs * blocks_per_seq, generator=gen).tolist()
        self.tables = [order[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(num_seqs)]
        self.null = num_seqs * blocks_per_seq
        self.head, self.target = head, target
        self.pools = head.new_kv_pools(self.null, BLOCK_SIZE, torch.float32, torch.device("cpu"))

    def final(self, seqs: list[list[int]], starts: list[int]) -> torch.Tensor:
        """Run slots starts[b]..len(seqs[b]) − 1 of every sequence as final slots (fed fc(aux(q − 1)));
        → out at each sequence's last slot [B, H]."""
        spans = [Span(self.tables[b], start, len(tokens) - start)
                 for b, (tokens, start) in enumerate(zip(seqs, starts))]
        ids = self.head.config.aux_layer_ids
        aux = torch.cat([torch.cat([torch.zeros(1, 3 * self.target.config.hidden_size),
                                    aux_states(self.target, tokens[:-1], ids)])[start:]
                         for tokens, start in zip(seqs, starts)])  # [T, 3·H_t]: row q holds aux(q − 1), zeros at 0
        tokens = torch.tensor([t for tokens, start in zip(seqs, starts) for t in tokens[start:]])
        out = self._forward(self.head.fuse(aux), tokens, spans)
        lasts = torch.tensor([s.count for s in spans]).cumsum(0) - 1
        return out[lasts]

    def chain(self, seqs: list[list[int]], j: int, prev: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """Chain step j ≥ 1: slot n − 1 + j of each sequence, fed draft j and the previous out."""
        spans = [Span(self.tables[b], len(tokens) - 1 + j, 1) for b, tokens in enumerate(seqs)]
        return self._forward(self.head.chain_hidden(prev), torch.tensor(drafts), spans)

    def _forward(self, hidden, tokens, spans):
        batch = build_attention_batch(spans, BLOCK_SIZE, self.null, torch.device("cpu"))
        return self.head(hidden, self.head.embed(self.target, tokens), self.pools, batch)

    def drafts(self, out: torch.Tensor) -> list[int]:  # [B, H] → each row's draft as a target id
        return self.head.target_ids()[self.head.draft_logits(out).argmax(-1)].tolist()


def paged_drafts(paged: PagedHead, seqs: list[list[int]], starts: list[int]) -> tuple[list[list[int]], torch.Tensor]:
    """K drafts per sequence from the paged head (final slots from ``starts``, then the chain) and the
    out of each step [K, B, H]."""
    out = paged.final(seqs, starts)
    drafts, outs = [[token] for token in paged.drafts(out)], [out]
    for j in range(1, K):
        out = paged.chain(seqs, j, out, [d[-1] for d in drafts])
        outs.append(out)
        for d, token in zip(drafts, paged.drafts(out)):
            d.append(token)
    return drafts, torch.stack(outs)


def dense_drafts(dense: DenseSequence, target_ids: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """K drafts of one sequence from the dense reference, fed its own drafts; the outs [K, H]."""
    drafts, outs = [dense.draft(target_ids)], [dense.outs[-1]]
    for _ in range(1, K):
        outs.append(dense.chain(drafts[-1]))
        drafts.append(dense.draft(target_ids))
    return drafts, torch.stack(outs)


def reference_weights(tensors: dict[str, torch.Tensor], target: DecoderLM) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(tensors under speculators' names, the embedding the head reads, the target id of each draft row)."""
    w = {"layers.0." + n.removeprefix("midlayer.") if n.startswith("midlayer.") else n: t for n, t in tensors.items()}
    rows = w["lm_head.weight"].shape[0]
    target_ids = torch.arange(rows) + w["d2t"] if "d2t" in w else torch.arange(rows)
    return w, w.get("embed_tokens.weight", target.model.embed_tokens.weight.detach()), target_ids


# --- tests ----------------------------------------------------------------------------------

VLLM_DEFAULT_IDS = (2, TARGET_LAYERS // 2, TARGET_LAYERS - 3)
# (layout, spec): a head as wide as the target sharing its embedding, vLLM's default aux ids and a
# reduced vocabulary; and a narrower two-block head with its own embedding, ids from its config,
# the full vocabulary, the normed residual and chaining on the normed output.
VARIANTS = {
    "original": ("original", HeadSpec()),
    "speculators-narrow-2-blocks": ("speculators", HeadSpec(
        hidden=48, head_dim=12, layers=2, draft_vocab=None, aux_ids=[1, 4, 6], norm_before_residual=True,
        norm_output=True)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_paged_head_over_a_batch_with_chains_and_rejections_equals_the_dense_reference(variant, target, tmp_path):
    """Three sequences in one batch: their final slots, then K chained drafts each; then the target
    accepts 0, 1 and all K drafts (a rejected one replaced by another token, plus a bonus token), the
    accepted slots run again as final slots over the chain's K/V, and K more drafts follow. Every
    draft and every step's output equal a dense reference recomputed from scratch on the final
    tokens (so no stale chain K/V is read)."""
    layout, spec = VARIANTS[variant]
    folder = WRITERS[layout](tmp_path / layout, spec, target, seed=5)
    head = load_eagle3_head(folder, target)
    ids = tuple(spec.aux_ids or VLLM_DEFAULT_IDS)
    assert head.config.aux_layer_ids == ids
    assert (head.embed_tokens is None) == (spec.hidden == target.config.hidden_size)
    w, embedding, target_ids = reference_weights(head_tensors(spec, target, "layers.0.", seed=5), target)
    gen = torch.Generator().manual_seed(1)
    vocab = target.config.vocab_size
    seqs = [torch.randint(vocab, (n,), generator=gen).tolist() for n in (5, 9, 14)]
    paged = PagedHead(head, target, len(seqs), blocks_per_seq=6)

    def check(starts: list[int]) -> list[list[int]]:
        drafts, outs = paged_drafts(paged, seqs, starts)
        for b, tokens in enumerate(seqs):
            dense = DenseSequence(w, spec, target, tokens, ids, embedding)
            expected, dense_outs = dense_drafts(dense, target_ids)
            assert drafts[b] == expected, f"sequence {b}"
            torch.testing.assert_close(outs[:, b], dense_outs, rtol=1e-4, atol=1e-4)
        return drafts

    with torch.inference_mode():
        drafts = check([0, 0, 0])
        starts = [len(tokens) for tokens in seqs]
        for tokens, accepted, d in zip(seqs, (0, 1, K), drafts):  # the verified tokens join each sequence
            rejected = [(d[accepted] + 1) % vocab] if accepted < K else []
            bonus = [int(torch.randint(vocab, (1,), generator=gen))]
            tokens += d[:accepted] + (rejected or bonus)
        check(starts)


def test_both_layouts_of_the_same_weights_load_as_the_same_head(target, tmp_path):
    spec = HeadSpec(aux_ids=[0, 3, 7])
    original = load_eagle3_head(write_original(tmp_path / "original", spec, target, seed=9), target)
    speculators = load_eagle3_head(write_speculators(tmp_path / "speculators", spec, target, seed=9), target)
    assert original.config == speculators.config
    assert original.state_dict().keys() == speculators.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(original.state_dict().values(), speculators.state_dict().values()))
    assert original.embed_tokens is None and speculators.embed_tokens is None  # speculators' copy is the target's


def test_d2t_maps_each_draft_row_to_its_target_id_and_no_d2t_is_the_identity(target, tmp_path):
    """target id = draft id + d2t[draft id]: the head's argmax over its rows, mapped, is the argmax of
    the target-vocabulary logits vLLM builds (the draft logits at those ids, −inf elsewhere)."""
    spec = HeadSpec()
    head = load_eagle3_head(write_original(tmp_path / "reduced", spec, target, seed=3), target)
    tensors = head_tensors(spec, target, "midlayer.", seed=3)
    chosen = torch.nonzero(tensors["t2d"]).flatten()
    assert torch.equal(head.target_ids(), chosen) and len(chosen) == spec.draft_vocab
    out = torch.randn(6, spec.hidden, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = head.draft_logits(out)  # [6, N]
        full = torch.full((6, target.config.vocab_size), float("-inf")).index_copy_(1, head.target_ids(), logits)
        assert torch.equal(head.target_ids()[logits.argmax(-1)], full.argmax(-1))
    whole = load_eagle3_head(write_original(tmp_path / "full", replace(spec, draft_vocab=None), target, seed=3), target)
    assert torch.equal(whole.target_ids(), torch.arange(target.config.vocab_size))


def test_aux_layer_ids_come_from_the_config_else_vllms_default(target, tmp_path):
    spec = HeadSpec()
    default = load_eagle3_head(write_speculators(tmp_path / "default", spec, target, seed=1), target)
    assert default.config.aux_layer_ids == VLLM_DEFAULT_IDS
    nested = write_original(tmp_path / "nested", spec, target, seed=1,
                            eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3]})
    assert load_eagle3_head(nested, target).config.aux_layer_ids == (1, 2, 3)
    top = write_speculators(tmp_path / "top", replace(spec, aux_ids=[7, 0, 5]), target, seed=1)
    assert load_eagle3_head(top, target).config.aux_layer_ids == (0, 5, 7)  # fused in layer order, as vLLM does


def test_norm_before_residual_defaults_as_vllm_reads_each_layout(target, tmp_path):
    """vLLM: off unless set in the original layout (a model-config attribute), on unless set in
    speculators' (``update_eagle3``); speculators itself always writes it."""
    spec = HeadSpec()
    original = load_eagle3_head(write_original(tmp_path / "o", spec, target, seed=1), target)
    assert not original.config.norm_before_residual
    folder = write_speculators(tmp_path / "s", spec, target, seed=1)
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    del config["norm_before_residual"]
    (tmp_path / "s" / "config.json").write_text(json.dumps(config))
    assert load_eagle3_head(folder, target).config.norm_before_residual


NARROW = HeadSpec(hidden=48, head_dim=12)
REFUSALS = {  # id: (layout, the head, tensors dropped, config keys set (None: removed), the refusal's words)
    "no-fc": ("original", HeadSpec(), ("fc.weight",), {}, r"original EAGLE-3 release checkpoint lacks fc\.weight"),
    "no-hidden-norm": ("original", HeadSpec(), ("midlayer.hidden_norm.weight",), {},
                       r"lacks midlayer\.hidden_norm\.weight"),
    "no-d2t": ("speculators", HeadSpec(), ("d2t",), {}, r"speculators EAGLE-3 checkpoint lacks d2t"),
    "no-lm-head-no-mlp": ("speculators", HeadSpec(), ("layers.0.mlp.down_proj.weight", "lm_head.weight"), {},
                          r"lacks lm_head\.weight, layers\.0\.mlp\.down_proj\.weight"),
    "narrow-without-embedding": ("original", NARROW, ("embed_tokens.weight",), {},
                                 r"hidden size 48 is not the target's 64, .*lacks embed_tokens\.weight"),
    "no-heads-key": ("original", HeadSpec(), (), {"num_attention_heads": None},
                     r"original EAGLE-3 release config lacks num_attention_heads in config\.json"),
    "no-layer-config": ("speculators", HeadSpec(), (), {"transformer_layer_config": None},
                        r"lacks transformer_layer_config"),
    "other-speculator": ("speculators", HeadSpec(), (), {"speculators_model_type": "mlp_speculator"},
                         r"'mlp_speculator' is not an EAGLE-3 head"),
    "norm-before-fc": ("speculators", HeadSpec(), (), {"norm_before_fc": True},
                       r"sets norm_before_fc: norms around fc"),
    "qwen3-blocks": ("original", HeadSpec(), (), {"model_type": "qwen3"},
                     r"model_type 'qwen3' in config\.json are not supported"),
    "target-hidden": ("original", HeadSpec(), (), {"target_hidden_size": 32},
                      r"target_hidden_size 32 is not the target's hidden size 64"),
    "vocab": ("original", HeadSpec(), (), {"vocab_size": 500}, r"vocab_size 500 is not the target's"),
    "draft-vocab-size": ("original", HeadSpec(), (), {"draft_vocab_size": 95}, r"shape mismatch .*lm_head"),
    "aux-id-range": ("original", HeadSpec(), (), {"eagle_aux_hidden_state_layer_ids": [2, 4, 8]},
                     r"\[8\] outside the target's layers 0\.\.7"),
    "aux-id-twice": ("original", HeadSpec(), (), {"eagle_aux_hidden_state_layer_ids": [2, 4, 4]},
                     r"exactly 3 distinct target layers"),
    "rope-scaling": ("original", HeadSpec(), (), {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
                     r"unsupported rope_scaling"),
    "no-aux": ("original", HeadSpec(), (), {"eagle_config": {"use_aux_hidden_state": False}},
               r"use_aux_hidden_state false"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_missing_or_unsupported_piece_is_refused_naming_it(case, target, tmp_path):
    layout, spec, drop, config, words = REFUSALS[case]
    folder = WRITERS[layout](tmp_path / "head", spec, target, seed=1, drop=drop, **config)
    written = json.loads((tmp_path / "head" / "config.json").read_text())
    (tmp_path / "head" / "config.json").write_text(json.dumps({k: v for k, v in written.items() if k not in config
                                                                or config[k] is not None}))
    with pytest.raises(ValueError, match=words):
        load_eagle3_head(folder, target)


def test_a_folder_without_a_head_is_refused_with_what_was_looked_for(target, tiny_hf_model_dir, tmp_path):
    looked_for = r"holds no EAGLE-3 head \(looked for .*speculators_model_type 'eagle3'.*midlayer"
    with pytest.raises(ValueError, match=looked_for):
        load_eagle3_head(tiny_hf_model_dir, target)
    folder = write_original(tmp_path / "extra", HeadSpec(), target, seed=1)
    tensors = torch.load(tmp_path / "extra" / "pytorch_model.bin", weights_only=True)
    torch.save(tensors | {"input_norm.weight": torch.ones(192)}, tmp_path / "extra" / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"tensors this head does not know: input_norm\.weight"):
        load_eagle3_head(folder, target)


@pytest.mark.slow
def test_a_checkpoint_written_by_speculators_own_classes_loads_as_the_spelled_out_one(target, tmp_path):
    """speculators' ``Eagle3SpeculatorConfig`` and ``Eagle3DraftModel.save_pretrained`` write the head;
    it loads as the head of the spelled-out writer with the same weights, and its config.json has
    every key and value the spelled-out one has (module docstring: how to install speculators)."""
    speculators_eagle3 = pytest.importorskip("speculators.models.eagle3")
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    spec = HeadSpec(aux_ids=[1, 4, 6])
    block = llama_block_config(spec, target) | {"tie_word_embeddings": False}
    config = speculators_eagle3.Eagle3SpeculatorConfig(
        transformer_layer_config=LlamaConfig(**block),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=K)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])),
        draft_vocab_size=spec.draft_vocab, eagle_aux_hidden_state_layer_ids=spec.aux_ids,
        target_hidden_size=target.config.hidden_size)
    model = speculators_eagle3.Eagle3DraftModel(config)
    tensors = head_tensors(spec, target, "layers.0.", seed=4)
    tensors["embed_tokens.weight"] = target.model.embed_tokens.weight
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and all(name.startswith("verifier_") for name in missing)
    model.save_pretrained(str(tmp_path / "theirs"))
    theirs = load_eagle3_head(tmp_path / "theirs", target)
    ours = load_eagle3_head(write_speculators(tmp_path / "ours", spec, target, seed=4), target)
    assert theirs.config == ours.config
    assert all(torch.equal(a, b) for a, b in zip(theirs.state_dict().values(), ours.state_dict().values()))
    written = json.loads((tmp_path / "theirs" / "config.json").read_text())
    spelled = speculators_config(spec, target)
    versions = {"transformers_version"}
    assert {k: v for k, v in spelled.items() if k not in versions and k != "transformer_layer_config"} == {
        k: written[k] for k in spelled if k not in versions and k != "transformer_layer_config"}
    assert spelled["transformer_layer_config"].items() <= written["transformer_layer_config"].items()
