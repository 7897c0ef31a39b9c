"""MTP heads on disk: the three published weight namings, our own head folders, and the checks.

Published namings (shared/MTP.md), all on llama/qwen2 bodies here; N = the target's
``num_hidden_layers``:

| naming | config | tensors | target hidden fed |
|---|---|---|---|
| DeepSeek-V3 / GLM | ``num_nextn_predict_layers`` = L | ``model.layers.{N+k}.{enorm, hnorm, eh_proj, shared_head.norm, shared_head.head, embed_tokens}`` + a decoder block under the same prefix; embedding first | post-norm |
| MiMo | ``num_nextn_predict_layers`` = L | ``model.mtp_layers.{k}.{token_layernorm, hidden_layernorm, input_proj, final_layernorm}`` + a decoder block; hidden first | pre-norm |
| Qwen3-Next / Qwen3.5 | ``num_nextn_predict_layers`` or ``mtp_num_hidden_layers`` = B | ``mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm}`` + ``mtp.layers.{i}.*``: one module of B blocks; embedding first | post-norm |

The hidden state each naming's layers were trained on is what its body's forward returns in vLLM,
whose runner hands that output to the MTP layers as ``target_hidden_states``:
``DeepseekV2Model.forward`` (deepseek_v2.py) and ``Qwen3NextModel.forward`` (qwen3_next.py) return
``self.norm(hidden_states, residual)``, the post-norm state (GLM-4.5's ``compute_logits`` likewise
applies no norm to its body's output); ``MiMoModel.forward`` (mimo.py) returns
``hidden_states + residual``, the residual stream before the final norm, which
``MiMoForCausalLM.compute_logits`` applies itself. ``Naming.tap`` is the one place this is decided.

Copies of the embedding and LM head that some checkpoints carry (``embed_tokens``,
``shared_head.head``) are not loaded: the head uses the target's own. The target loader skips
every MTP tensor (``is_mtp_weight``) so the target loads untouched.

A head folder written by ``specdecode train-mtp`` is a DeepSeek-V3-named ``model.safetensors`` (plus
``draft_vocab_ids``, the reduced draft vocabulary) and a ``config.json`` with the DeepSeek-V3
fields and an ``mtp`` section (``MtpConfig``): the target it was trained for, the hidden-state tap
(``train-mtp --hidden-tap``, post-norm by default) and the concatenation order. A head is refused
with a target it was not trained for, naming both.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdecode.runtime.models.decoder import DecoderLM, load_hf_weights
from specdecode.runtime.models.hf_loader import is_hf_folder, safetensors_files
from specdecode.runtime.models.mtp import ConcatOrder, HiddenTap, MtpConfig, MtpHead, TargetFingerprint, sign_sha256
from specdecode.runtime.models.tensor_parallel import TensorParallel

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DRAFT_VOCAB_KEY = "draft_vocab_ids"
_BLOCK_PARTS = ("input_layernorm.", "post_attention_layernorm.", "self_attn.", "mlp.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
LOOKED_FOR = ("num_nextn_predict_layers / mtp_num_hidden_layers in config.json with model.layers.{N+k}.eh_proj "
              "(DeepSeek-V3), model.mtp_layers.* (MiMo) or mtp.* (Qwen3-Next) tensors")


@dataclass(frozen=True)
class Naming:
    """How one published layout names a head's tensors: ``internal(name)`` maps a checkpoint name
    to the head's own (``layers.{ℓ}.…``), "" for shared copies it skips, None if not MTP."""

    name: str
    order: ConcatOrder
    tap: HiddenTap  # the target hidden state its layers read (module docstring)
    marker: str  # a tensor name (format: N) every checkpoint of this naming has

    def internal(self, name: str, num_hidden_layers: int) -> str | None:
        return _INTERNAL[self.name](name, num_hidden_layers)


def _deepseek(name: str, n: int) -> str | None:
    m = _LAYER.match(name)
    if m is None or int(m.group(1)) < n:
        return None
    k, rest = int(m.group(1)) - n, m.group(2)
    if rest.startswith(("embed_tokens.", "shared_head.head.")):
        return ""
    simple = {"enorm.": "enorm.", "hnorm.": "hnorm.", "eh_proj.": "eh_proj.", "shared_head.norm.": "final_norm."}
    return _module_name(k, rest, simple)


def _mimo(name: str, n: int) -> str | None:
    if not name.startswith("model.mtp_layers."):
        return None
    k, rest = name.removeprefix("model.mtp_layers.").split(".", 1)
    simple = {"token_layernorm.": "enorm.", "hidden_layernorm.": "hnorm.", "input_proj.": "eh_proj.",
              "final_layernorm.": "final_norm."}
    return _module_name(int(k), rest, simple)


def _qwen3_next(name: str, n: int) -> str | None:
    if not name.startswith("mtp."):
        return None
    rest = name.removeprefix("mtp.")
    if rest.startswith("layers."):
        block, inner = rest.removeprefix("layers.").split(".", 1)
        return f"layers.0.blocks.{block}.{inner}"
    simple = {"fc.": "eh_proj.", "pre_fc_norm_embedding.": "enorm.", "pre_fc_norm_hidden.": "hnorm.",
              "norm.": "final_norm."}
    return _module_name(0, rest, simple)


def _module_name(k: int, rest: str, simple: dict[str, str]) -> str:
    for prefix, ours in simple.items():
        if rest.startswith(prefix):
            return f"layers.{k}.{ours}{rest.removeprefix(prefix)}"
    if rest.startswith(_BLOCK_PARTS):
        return f"layers.{k}.blocks.0.{rest}"
    raise KeyError(f"unexpected MTP tensor part {rest!r}")


_INTERNAL = {"deepseek_v3": _deepseek, "mimo": _mimo, "qwen3_next": _qwen3_next}
NAMINGS = (
    Naming("deepseek_v3", ConcatOrder.EMBEDDING_FIRST, HiddenTap.POST_NORM, "model.layers.{N}.eh_proj.weight"),
    Naming("mimo", ConcatOrder.HIDDEN_FIRST, HiddenTap.PRE_NORM, "model.mtp_layers.0.input_proj.weight"),
    Naming("qwen3_next", ConcatOrder.EMBEDDING_FIRST, HiddenTap.POST_NORM, "mtp.fc.weight"),
)


def is_mtp_weight(name: str, num_hidden_layers: int) -> bool:
    """Whether a checkpoint tensor belongs to MTP layers in any published naming."""
    return any(naming.internal(name, num_hidden_layers) is not None for naming in NAMINGS)


def published_mtp_layers(hf_config: dict[str, Any]) -> int:
    """MTP layers a model's config.json declares (0: none)."""
    return int(hf_config.get("num_nextn_predict_layers") or hf_config.get("mtp_num_hidden_layers") or 0)


def load_mtp_head(folder: str | Path, target: DecoderLM, target_name: str) -> MtpHead:
    """The head in ``folder`` — a ``train-mtp`` output or a checkpoint carrying MTP layers — on the
    target's device in its dtype, frozen. Refuses (ValueError / FileNotFoundError / KeyError, with
    what was looked for) a folder without MTP layers, wrong shapes, missing layers, and a head
    trained for another target."""
    folder = Path(folder).expanduser()
    if not is_hf_folder(folder):
        raise FileNotFoundError(f"MTP heads: {folder} is not a folder with a config.json")
    hf_config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    n = target.config.num_layers
    keys = {name: file for file in safetensors_files(folder) for name in _keys(file)}
    naming = _detect_naming(keys, n)
    if naming is None or (published_mtp_layers(hf_config) == 0 and "mtp" not in hf_config):
        raise ValueError(f"{folder} carries no MTP layers (looked for {LOOKED_FOR}); train a head for this "
                         f"model with `specdecode train-mtp --model {target_name} --out DIR` and pass its "
                         "folder as mtp_path")
    cfg = _mtp_config(hf_config, naming, keys, n)
    _check_target(cfg, folder, hf_config, keys, target, target_name)
    vocab = _read(keys, DRAFT_VOCAB_KEY) if DRAFT_VOCAB_KEY in keys else None
    head = MtpHead(target.config, cfg, None if vocab is None else vocab.to(target.model.embed_tokens.weight.device))
    head.to(device=target.model.embed_tokens.weight.device, dtype=target.model.embed_tokens.weight.dtype)
    weights = _head_weights(keys, naming, n, target.model.embed_tokens.weight.dtype)
    load_hf_weights(head, weights, target.config, TensorParallel(), f"the MTP head in {folder}")
    head.eval()
    head.requires_grad_(False)
    return head


def save_mtp_head(folder: str | Path, head: MtpHead, target: DecoderLM) -> None:
    """Write ``head`` as a DeepSeek-V3-named ``model.safetensors`` + ``config.json`` (one block per module)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    c, n = target.config, target.config.num_layers
    if head.config.blocks_per_module != 1:
        raise ValueError("the DeepSeek-V3 layout has one decoder block per MTP module")
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in head.state_dict().items():
        k, rest = name.removeprefix("layers.").split(".", 1)
        prefix = f"model.layers.{n + int(k)}."
        rest = {"final_norm.weight": "shared_head.norm.weight"}.get(rest, rest.replace("blocks.0.", ""))
        tensors |= {prefix + part: t for part, t in unfused(rest, tensor, c).items()}
    if head.draft_vocab_ids is not None:
        tensors[DRAFT_VOCAB_KEY] = head.draft_vocab_ids.cpu()
    save_file({k: v.detach().float().cpu().contiguous() if v.is_floating_point() else v.contiguous()
               for k, v in tensors.items()}, str(folder / WEIGHTS_FILE))
    config = {**c.to_hf(), "num_nextn_predict_layers": head.config.num_modules, "mtp": head.config.model_dump(mode="json")}
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2), encoding="utf-8")


def unfused(rest: str, tensor: torch.Tensor, c) -> dict[str, torch.Tensor]:
    """Our fused q/k/v and gate/up back to the Hugging Face names (``c``: the blocks' head counts and size)."""
    if ".qkv_proj." in rest:
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        parts = tensor.split([q, kv, kv])
        return {rest.replace("qkv_proj", p): t for p, t in zip(("q_proj", "k_proj", "v_proj"), parts)}
    if ".gate_up_proj." in rest:
        gate, up = tensor.chunk(2)
        return {rest.replace("gate_up_proj", "gate_proj"): gate, rest.replace("gate_up_proj", "up_proj"): up}
    return {rest: tensor}


def _keys(file: Path) -> list[str]:
    with safe_open(file, framework="pt", device="cpu") as f:
        return list(f.keys())


def _read(keys: dict[str, Path], name: str) -> torch.Tensor:
    with safe_open(keys[name], framework="pt", device="cpu") as f:
        return f.get_tensor(name)


def _detect_naming(keys: dict[str, Path], n: int) -> Naming | None:
    for naming in NAMINGS:
        if naming.marker.format(N=n) in keys:
            return naming
    return None


def _mtp_config(hf_config: dict[str, Any], naming: Naming, keys: dict[str, Path], n: int) -> MtpConfig:
    if "mtp" in hf_config:  # written by train-mtp
        return MtpConfig.model_validate(hf_config["mtp"])
    declared = published_mtp_layers(hf_config)
    internal = {naming.internal(k, n) for k in keys} - {None, ""}
    modules = len({name.split(".")[1] for name in internal})
    if naming.name == "qwen3_next":
        blocks = len({name.split(".")[3] for name in internal if ".blocks." in name})
        if blocks != declared:
            raise ValueError(f"config declares {declared} MTP layers but the checkpoint has {blocks} (mtp.layers.*)")
        return MtpConfig(num_modules=1, blocks_per_module=blocks, concat_order=naming.order, hidden_tap=naming.tap)
    if modules != declared:
        raise ValueError(f"config declares num_nextn_predict_layers = {declared} but the checkpoint has {modules} "
                         f"MTP layers ({naming.name} naming)")
    return MtpConfig(num_modules=modules, concat_order=naming.order, hidden_tap=naming.tap)


def _check_target(
    cfg: MtpConfig, folder: Path, hf_config: dict[str, Any], keys: dict[str, Path], target: DecoderLM, target_name: str
) -> None:
    """Refuse a head trained for another target, naming both."""
    ours = TargetFingerprint.of(target, target_name)
    if cfg.target is not None:
        if not cfg.target.same_model(ours):
            raise ValueError(f"the MTP head in {folder} was trained for {cfg.target.describe()}, not for the target "
                             f"{ours.describe()}; train one for it with `specdecode train-mtp --model {target_name}`")
        return
    shape = (hf_config.get("vocab_size"), hf_config.get("hidden_size"), hf_config.get("num_hidden_layers"))
    embedding = _read(keys, "model.embed_tokens.weight") if "model.embed_tokens.weight" in keys else None
    if shape != (ours.vocab_size, ours.hidden_size, ours.num_hidden_layers) or (
        embedding is not None and sign_sha256(embedding) != ours.embedding_sign_sha256
    ):
        raise ValueError(f"the MTP layers in {folder} belong to a model with vocabulary {shape[0]}, hidden size "
                         f"{shape[1]}, {shape[2]} layers"
                         + ("" if embedding is None else f" and embedding {sign_sha256(embedding)[:12]}")
                         + f", not to the target {ours.describe()}")


def _head_weights(keys: dict[str, Path], naming: Naming, n: int, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, file in keys.items():
        internal = naming.internal(name, n)
        if internal:
            by_file.setdefault(file, []).append((name, internal))
    for file, names in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for name, internal in names:
                yield internal, f.get_tensor(name).to(dtype)
