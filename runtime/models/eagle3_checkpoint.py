"""EAGLE-3 heads on disk: the original release's layout and speculators' format, read as vLLM reads them.

| layout | config.json | tensors |
|---|---|---|
| original EAGLE-3 release | a llama config of the head (``hidden_size``, ``num_attention_heads``, …, ``vocab_size`` = the target's) plus ``draft_vocab_size``, optional ``target_hidden_size``, optional ``eagle_aux_hidden_state_layer_ids`` (or under ``eagle_config``) | ``midlayer.{input_layernorm, hidden_norm, self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``, optional ``embed_tokens`` |
| speculators (``speculators_model_type: eagle3``) | ``transformer_layer_config`` (the llama config of the blocks), ``draft_vocab_size``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids``, ``norm_before_residual``, ``norm_output``, ``norm_before_fc``, ``fc_norm``, ``speculators_config`` | ``layers.{i}.…`` (layer 0 the midlayer), ``fc``, ``norm``, ``lm_head``, ``embed_tokens``, and ``d2t``, ``t2d`` when the draft vocabulary is reduced |

What vLLM does and this loader mirrors: the aux layer ids are ``eagle_aux_hidden_state_layer_ids``
(top level, else in ``eagle_config``), else (2, L // 2, L − 3) for a target of L layers, fused in
ascending layer order (the order vLLM's forward appends them in);
``norm_before_residual`` defaults to false in the original layout (read off the model config) and
to true in speculators' (``update_eagle3`` in vLLM's speculators config); ``target_hidden_size``
defaults to the head's own; a missing ``draft_vocab_size`` means the full vocabulary; ``d2t``
(draft id → target id offsets) is required when the draft vocabulary is reduced, the identity
otherwise; ``t2d`` (which target ids the draft vocabulary holds) is redundant with it and not
read. The head's RoPE table covers the target's positions too (speculators' converter takes the
larger ``max_position_embeddings`` of the two).

Files: ``*.safetensors`` (sharded or not), else ``pytorch_model.bin`` (the original release's file;
read with ``weights_only``). Anything else — another ``speculators_model_type``, blocks that are not
llama's, speculators' ``norm_before_fc`` / ``fc_norm`` (norms this head does not have), a missing
config key or tensor, an unknown tensor, shapes or sizes that do not fit the target — is refused
with a ValueError naming what is missing or wrong.

``save_eagle3_head`` writes a head in speculators' format (its config as speculators 0.9.0 writes
it, ``norm_before_residual`` and the aux layer ids spelled out), without the embedding when the
head uses the target's: what ``specdecode train-eagle3`` writes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdecode.runtime.models.decoder import DecoderLM, load_hf_weights
from specdecode.runtime.models.eagle3 import Eagle3Config, Eagle3Head, default_aux_layer_ids
from specdecode.runtime.models.hf_loader import is_hf_folder, safetensors_files
from specdecode.runtime.models.model_config import ModelConfig
from specdecode.runtime.models.mtp_checkpoint import unfused
from specdecode.runtime.models.tensor_parallel import TensorParallel

BIN_FILE = "pytorch_model.bin"
REQUIRED_BLOCK_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
_BLOCK_TENSORS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                  "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                  "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
_QKV_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
_UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm")  # speculators' extra norms around fc
LOOKED_FOR = ("a config.json with speculators_model_type 'eagle3' (speculators' format), or midlayer.* tensors "
              "(the original EAGLE-3 release) beside fc.weight, norm.weight and lm_head.weight")


@dataclass(frozen=True)
class Layout:
    """One published layout: its name and the prefix of its first block's tensors."""

    name: str
    first_block: str

    def block_prefix(self, i: int) -> str:
        return self.first_block if i == 0 else f"layers.{i}."

    def internal(self, name: str) -> str:
        """A checkpoint tensor name → the head's parameter name (``layers.0.`` for the midlayer)."""
        return "layers.0." + name.removeprefix(self.first_block) if name.startswith(self.first_block) else name


ORIGINAL = Layout("original EAGLE-3 release", "midlayer.")
SPECULATORS = Layout("speculators EAGLE-3", "layers.0.")


def load_eagle3_head(folder: str | Path, target: DecoderLM) -> Eagle3Head:
    """The head in ``folder``, on the target's device in its dtype, frozen; refused with a ValueError
    (FileNotFoundError for a folder without config.json) naming what is missing or wrong."""
    folder = Path(folder).expanduser()
    if not is_hf_folder(folder):
        raise FileNotFoundError(f"EAGLE-3 head: {folder} is not a folder with a config.json")
    hf_config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    tensors = _read_tensors(folder)
    layout = _detect_layout(folder, hf_config, tensors)
    cfg = eagle3_config(hf_config, layout, target)
    _check_tensors(folder, layout, cfg, tensors)
    own = _own_embedding(folder, cfg, tensors.get("embed_tokens.weight"), target)
    head = Eagle3Head(cfg, own_embedding=own)
    weight = target.model.embed_tokens.weight
    weights = ((layout.internal(n), t.to(weight.dtype)) for n, t in tensors.items()
               if n not in ("d2t", "t2d") and (own or n != "embed_tokens.weight"))
    load_hf_weights(head, weights, cfg.block_config(), TensorParallel(), f"the EAGLE-3 head in {folder}")
    if "d2t" in tensors:
        _load_d2t(folder, head, tensors["d2t"])
    head.to(device=weight.device, dtype=weight.dtype)
    head.eval()
    head.requires_grad_(False)
    return head


def eagle3_config(hf_config: dict[str, Any], layout: Layout, target: DecoderLM) -> Eagle3Config:
    """The head's config from a config.json in ``layout``, checked against the target."""
    _refuse_unsupported(hf_config)
    block = _block_config(hf_config, layout)
    default_norm_before_residual = layout is SPECULATORS  # vLLM's defaults (module docstring)
    t = target.config
    cfg = Eagle3Config(
        hidden_size=block.hidden_size, target_hidden_size=hf_config.get("target_hidden_size") or block.hidden_size,
        intermediate_size=block.intermediate_size, num_layers=block.num_layers, num_heads=block.num_heads,
        num_kv_heads=block.num_kv_heads, head_dim=block.head_dim, rms_norm_eps=block.rms_norm_eps,
        rope_theta=block.rope_theta,
        max_position_embeddings=max(block.max_position_embeddings, t.max_position_embeddings),
        attention_bias=block.attention_bias, vocab_size=block.vocab_size,
        draft_vocab_size=hf_config.get("draft_vocab_size") or block.vocab_size,
        aux_layer_ids=_aux_layer_ids(hf_config, t.num_layers),
        norm_before_residual=bool(hf_config.get("norm_before_residual", default_norm_before_residual)),
        norm_output=bool(hf_config.get("norm_output", False)),
    )
    _check_target(cfg, target)
    return cfg


def _refuse_unsupported(hf_config: dict[str, Any]) -> None:
    flags = [f for f in _UNSUPPORTED_FLAGS if hf_config.get(f)]
    if flags:
        raise ValueError(f"EAGLE-3 config sets {', '.join(flags)}: norms around fc that this head does not have")
    if (hf_config.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        raise ValueError("EAGLE-3 config sets eagle_config.use_aux_hidden_state false: a head without fc "
                         "(EAGLE-1 style) is not an EAGLE-3 head")


def _block_config(hf_config: dict[str, Any], layout: Layout) -> ModelConfig:
    """The llama config of the head's blocks: speculators' ``transformer_layer_config``, or the
    original release's config.json itself (a llama config; ``model_type`` llama where it is left out)."""
    if layout is SPECULATORS:
        block, what = hf_config.get("transformer_layer_config"), "transformer_layer_config"
        if not isinstance(block, dict):
            raise ValueError("speculators EAGLE-3 config lacks transformer_layer_config (the blocks' llama config)")
    else:
        block, what = {"model_type": "llama", **hf_config}, "config.json"
    missing = [k for k in REQUIRED_BLOCK_KEYS if k not in block]
    if missing:
        raise ValueError(f"{layout.name} config lacks {', '.join(missing)} in {what}")
    if block.get("model_type") != "llama":
        raise ValueError(f"EAGLE-3 blocks of model_type {block.get('model_type')!r} in {what} are not supported: "
                         "llama blocks only")
    return ModelConfig.from_hf(block)


def _aux_layer_ids(hf_config: dict[str, Any], num_target_layers: int) -> tuple[int, int, int]:
    ids = hf_config.get("eagle_aux_hidden_state_layer_ids") or (hf_config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    source = ("eagle_aux_hidden_state_layer_ids" if ids
              else f"vLLM's default (2, L // 2, L - 3) for L = {num_target_layers}")
    ids = tuple(sorted(ids or default_aux_layer_ids(num_target_layers)))  # the order vLLM appends them in
    if len(set(ids)) != 3:
        raise ValueError(f"EAGLE-3 {source} {list(ids)}: fc fuses exactly 3 distinct target layers")
    outside = [i for i in ids if not 0 <= i < num_target_layers]
    if outside:
        raise ValueError(f"EAGLE-3 aux layer ids {list(ids)} ({source}): {outside} outside the target's layers "
                         f"0..{num_target_layers - 1}")
    return ids


def _check_target(cfg: Eagle3Config, target: DecoderLM) -> None:
    t = target.config
    if cfg.vocab_size != t.vocab_size:
        raise ValueError(f"EAGLE-3 head's vocab_size {cfg.vocab_size} is not the target's {t.vocab_size}")
    if cfg.target_hidden_size != t.hidden_size:
        raise ValueError(f"EAGLE-3 head's target_hidden_size {cfg.target_hidden_size} is not the target's hidden "
                         f"size {t.hidden_size}")
    if cfg.draft_vocab_size > cfg.vocab_size:
        raise ValueError(f"EAGLE-3 draft_vocab_size {cfg.draft_vocab_size} exceeds vocab_size {cfg.vocab_size}")


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the head (small: one block and two vocabulary matrices), on the CPU."""
    if not any(folder.glob("*.safetensors")) and (folder / BIN_FILE).is_file():
        return torch.load(folder / BIN_FILE, map_location="cpu", weights_only=True)
    tensors = {}
    for file in safetensors_files(folder):
        with safe_open(file, framework="pt", device="cpu") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}
    return tensors


def _detect_layout(folder: Path, hf_config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Layout:
    kind = hf_config.get("speculators_model_type")
    if kind is not None:
        if kind != "eagle3":
            raise ValueError(f"{folder}: speculators_model_type {kind!r} is not an EAGLE-3 head ('eagle3')")
        return SPECULATORS
    if any(name.startswith(ORIGINAL.first_block) for name in tensors):
        return ORIGINAL
    raise ValueError(f"{folder} holds no EAGLE-3 head (looked for {LOOKED_FOR})")


def expected_tensors(layout: Layout, cfg: Eagle3Config) -> list[str]:
    """The tensor names a checkpoint of ``layout`` must carry for ``cfg`` (``embed_tokens`` and ``t2d``
    are optional)."""
    names = ["fc.weight", "norm.weight", "lm_head.weight", layout.block_prefix(0) + "hidden_norm.weight"]
    if cfg.draft_vocab_size < cfg.vocab_size:
        names.append("d2t")
    parts = _BLOCK_TENSORS + (_QKV_BIASES if cfg.attention_bias else ())
    return names + [layout.block_prefix(i) + part for i in range(cfg.num_layers) for part in parts]


def _check_tensors(folder: Path, layout: Layout, cfg: Eagle3Config, tensors: dict[str, torch.Tensor]) -> None:
    expected = expected_tensors(layout, cfg)
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise ValueError(f"{folder}: the {layout.name} checkpoint lacks {', '.join(missing)}")
    unknown = sorted(set(tensors) - set(expected) - {"embed_tokens.weight", "t2d", "d2t"})
    if unknown:
        raise ValueError(f"{folder}: the {layout.name} checkpoint has tensors this head does not know: "
                         f"{', '.join(unknown[:5])}")


def _own_embedding(folder: Path, cfg: Eagle3Config, embedding: torch.Tensor | None, target: DecoderLM) -> bool:
    """Whether the head keeps the checkpoint's ``embed_tokens`` [V, H]: it has one that is not the
    target's (speculators saves the target's as a copy); a head narrower than its target must."""
    shared = target.model.embed_tokens.weight
    if embedding is None:
        if cfg.hidden_size != shared.shape[1]:
            raise ValueError(f"{folder}: the head's hidden size {cfg.hidden_size} is not the target's "
                             f"{shared.shape[1]}, so it needs its own embedding, and the checkpoint lacks "
                             "embed_tokens.weight")
        return False
    return not (embedding.shape == shared.shape and torch.equal(embedding.to(shared.device, shared.dtype), shared))


def _load_d2t(folder: Path, head: Eagle3Head, d2t: torch.Tensor) -> None:
    """Copy ``d2t`` [N] in, refusing one of another length or mapping outside the target's vocabulary."""
    n, vocab = head.config.draft_vocab_size, head.config.vocab_size
    if tuple(d2t.shape) != (n,):
        raise ValueError(f"{folder}: d2t has shape {tuple(d2t.shape)}, not ({n},) for draft_vocab_size {n}")
    head.d2t.copy_(d2t.long())
    ids = head.target_ids()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"{folder}: d2t maps draft ids outside the target's vocabulary 0..{vocab - 1}")


def save_eagle3_head(folder: str | Path, head: Eagle3Head, num_speculative_tokens: int) -> None:
    """``head`` in speculators' format: ``model.safetensors`` (q/k/v and gate/up split, ``d2t`` and
    ``t2d`` when the draft vocabulary is reduced) and ``config.json``, proposing
    ``num_speculative_tokens`` by default."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    c = head.config
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in head.state_dict().items():
        if name != "d2t":
            tensors |= unfused(name, tensor, c)
    if c.draft_vocab_size < c.vocab_size:
        tensors["d2t"] = head.d2t
        tensors["t2d"] = torch.zeros(c.vocab_size, dtype=torch.bool).index_fill_(0, head.target_ids().cpu(), True)
    save_file({n: t.detach().cpu().contiguous() for n, t in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(_speculators_config(c, num_speculative_tokens), indent=2),
                                        encoding="utf-8")


def _speculators_config(c: Eagle3Config, num_speculative_tokens: int) -> dict[str, Any]:
    block = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": c.hidden_size,
             "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
             "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "num_hidden_layers": c.num_layers,
             "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "hidden_act": "silu",
             "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
             "attention_bias": c.attention_bias, "mlp_bias": False, "tie_word_embeddings": False}
    proposal = {"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens, "accept_tolerance": 0.0,
                "verifier_accept_k": 1}
    return {
        "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
        "transformer_layer_config": block, "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size, "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "norm_before_residual": c.norm_before_residual, "norm_output": c.norm_output, "norm_before_fc": False,
        "fc_norm": False, "embed_requires_grad": False, "tie_word_embeddings": False,
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [proposal],
                               "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": None}},
    }
