"""MTP heads on disk and their drafts: tiny synthetic checkpoints written from the published key
lists (shared/MTP.md, spelled out here, not taken from the loader's mapping) load in each naming,
the target loads untouched beside them, each naming's head reads the target hidden state vLLM's
wiring gives it, the drafts equal a plain-torch reference of the formula (taps, concatenation
orders, chaining one module and wrapping over two), and bad heads are refused with what to do."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdecode.runtime.config import CacheConfig, EngineConfig, LoadConfig, SchedulerConfig, SpeculativeConfig
from specdecode.runtime.engine.llm_engine import LLMEngine
from specdecode.runtime.engine.sequence import SamplingParams
from specdecode.runtime.models.loader import load_model
from specdecode.runtime.models.mtp import HiddenTap, MtpConfig, MtpHead, TargetFingerprint
from specdecode.runtime.models.mtp_checkpoint import save_mtp_head

PROMPT = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"
# The target hidden state each published naming's layers read (vLLM's wiring: the layout test).
TAP = {"deepseek_v3": "post_norm", "qwen3_next": "post_norm", "mimo": "pre_norm"}


# --- synthetic checkpoints, from the published key lists --------------------------------------


def block_tensors(prefix: str, cfg: dict, gen: torch.Generator, bias: bool) -> dict[str, torch.Tensor]:
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    r = lambda *shape, s=0.15: torch.randn(*shape, generator=gen) * s  # noqa: E731
    out = {prefix + "input_layernorm.weight": 1 + r(h), prefix + "post_attention_layernorm.weight": 1 + r(h),
           prefix + "self_attn.q_proj.weight": r(q, h), prefix + "self_attn.k_proj.weight": r(kv, h),
           prefix + "self_attn.v_proj.weight": r(kv, h), prefix + "self_attn.o_proj.weight": r(h, q),
           prefix + "mlp.gate_proj.weight": r(i, h), prefix + "mlp.up_proj.weight": r(i, h),
           prefix + "mlp.down_proj.weight": r(h, i)}
    if bias:
        out |= {prefix + "self_attn.q_proj.bias": r(q), prefix + "self_attn.k_proj.bias": r(kv),
                prefix + "self_attn.v_proj.bias": r(kv)}
    return out


def function_weights(cfg: dict, num_modules: int, seed: int, bias: bool = False) -> list[dict[str, torch.Tensor]]:
    """Per module, the weights of the formula: enorm, hnorm, eh [H, 2H] (embedding columns first),
    final_norm, and the block under ``block.`` in Hugging Face names."""
    gen = torch.Generator().manual_seed(seed)
    h = cfg["hidden_size"]
    return [{"enorm": 1 + 0.2 * torch.randn(h, generator=gen), "hnorm": 1 + 0.2 * torch.randn(h, generator=gen),
             "eh": torch.randn(h, 2 * h, generator=gen) / math.sqrt(2 * h),
             "final_norm": 1 + 0.2 * torch.randn(h, generator=gen),
             **block_tensors("block.", cfg, gen, bias)} for _ in range(num_modules)]


def naming_tensors(naming: str, weights: list[dict[str, torch.Tensor]], cfg: dict) -> dict[str, torch.Tensor]:
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    out: dict[str, torch.Tensor] = {}
    for k, w in enumerate(weights):
        block = {name.removeprefix("block."): t for name, t in w.items() if name.startswith("block.")}
        if naming == "deepseek_v3":
            p = f"model.layers.{n + k}."
            out |= {p + "enorm.weight": w["enorm"], p + "hnorm.weight": w["hnorm"], p + "eh_proj.weight": w["eh"],
                    p + "shared_head.norm.weight": w["final_norm"],
                    p + "shared_head.head.weight": torch.zeros(cfg["vocab_size"], h),  # a copy the head must not use
                    p + "embed_tokens.weight": torch.zeros(cfg["vocab_size"], h)}
            out |= {p + name: t for name, t in block.items()}
        elif naming == "mimo":
            p = f"model.mtp_layers.{k}."
            hidden_first = torch.cat([w["eh"][:, h:], w["eh"][:, :h]], dim=1)
            out |= {p + "token_layernorm.weight": w["enorm"], p + "hidden_layernorm.weight": w["hnorm"],
                    p + "input_proj.weight": hidden_first, p + "final_layernorm.weight": w["final_norm"]}
            out |= {p + name: t for name, t in block.items()}
        elif naming == "qwen3_next":
            assert len(weights) == 1
            out |= {"mtp.fc.weight": w["eh"], "mtp.pre_fc_norm_embedding.weight": w["enorm"],
                    "mtp.pre_fc_norm_hidden.weight": w["hnorm"], "mtp.norm.weight": w["final_norm"]}
            out |= {"mtp.layers.0." + name: t for name, t in block.items()}
    return out


def write_checkpoint(src, dst, naming: str, weights, **config_changes) -> str:
    """A copy of the target folder ``src`` whose safetensors also carry MTP layers in ``naming``."""
    dst.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    config = json.loads((src / "config.json").read_text())
    layers = {"num_nextn_predict_layers": len(weights)}
    config |= layers | config_changes
    (dst / "config.json").write_text(json.dumps(config))
    save_file(load_file(str(src / "model.safetensors")) | naming_tensors(naming, weights, config), str(dst / "model.safetensors"))
    return str(dst)


# --- a plain-torch reference of the formula ---------------------------------------------------


def ref_rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def ref_rope(x, positions, theta):  # x: [T, heads, hd]
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    ang = positions.float()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    return x * cos + torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1) * sin


def ref_block(w, x, positions, cfg):
    """x: [T, H], each row attending every row before it and itself (rows in the order they ran)."""
    eps, heads, kvh, hd = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    h = ref_rms(x, w["block.input_layernorm.weight"], eps)
    proj = lambda name: h @ w[f"block.self_attn.{name}.weight"].T + w.get(f"block.self_attn.{name}.bias", 0)  # noqa: E731
    q = ref_rope(proj("q_proj").view(-1, heads, hd), positions, cfg["rope_theta"])
    k = ref_rope(proj("k_proj").view(-1, kvh, hd), positions, cfg["rope_theta"]).repeat_interleave(heads // kvh, 1)
    v = proj("v_proj").view(-1, kvh, hd).repeat_interleave(heads // kvh, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    t = x.shape[0]
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, -1)
    x = x + attn @ w["block.self_attn.o_proj.weight"].T
    h2 = ref_rms(x, w["block.post_attention_layernorm.weight"], eps)
    mlp = (torch.nn.functional.silu(h2 @ w["block.mlp.gate_proj.weight"].T) * (h2 @ w["block.mlp.up_proj.weight"].T))
    return x + mlp @ w["block.mlp.down_proj.weight"].T


def target_hidden(target, tokens: list[int], full_forward_hidden) -> torch.Tensor:
    return full_forward_hidden(target, tokens)


def reference_drafts(target, weights, cfg, tokens: list[int], k: int, tap: str, pre_norm_hidden) -> list[int]:
    """Drafts 1..k for ``tokens`` (the last one not yet seen by the target), by the formula:
    in_0(q) = tap(h_{q-1}), in_m(q) = out_{m-1}(q-1), zeros at q = 0; draft 1 from module 0 at slot
    n−1; draft j+1 from module j mod L at slot n−1+j fed the previous output and draft j; each
    module attends the entries it ran, in order."""
    eps, hsize = cfg["rms_norm_eps"], cfg["hidden_size"]
    n, modules = len(tokens), len(weights)
    h = pre_norm_hidden(target, tokens[:-1])  # [n-1, H]
    if tap == "post_norm":
        h = ref_rms(h, target.model.norm.weight, eps)
    embed, lm = target.model.embed_tokens.weight, target.lm_head_weight
    entries = [[] for _ in range(modules)]  # per module: (position, x = eh_proj(...))
    outs = [[] for _ in range(modules)]

    def run(m, pos, hidden, token):
        w = weights[m]
        x = torch.cat([ref_rms(embed[token], w["enorm"], eps), ref_rms(hidden, w["hnorm"], eps)]) @ w["eh"].T
        entries[m].append((pos, x))
        xs = torch.stack([e[1] for e in entries[m]])
        return ref_block(w, xs, torch.tensor([e[0] for e in entries[m]]), cfg)[-1]

    zero = torch.zeros(hsize)
    for q in range(n):
        for m in range(modules):
            source = h if m == 0 else torch.stack(outs[m - 1]) if outs[m - 1] else None
            outs[m].append(run(m, q, source[q - 1] if q > 0 else zero, tokens[q]))
    draft_of = lambda m, out: int((ref_rms(out, weights[m]["final_norm"], eps) @ lm.T).argmax())  # noqa: E731
    prev = outs[0][n - 1]
    drafts = [draft_of(0, prev)]
    for j in range(1, k):
        m = j % modules
        prev = run(m, n - 1 + j, prev, drafts[-1])
        drafts.append(draft_of(m, prev))
    return drafts


@pytest.fixture(scope="module")
def pre_norm_hidden():
    from specdecode.runtime.engine.model_runner import Span, build_attention_batch
    from specdecode.runtime.models.attention import kv_pool

    def run(model, ids: list[int]) -> torch.Tensor:
        c = model.config
        blocks = -(-len(ids) // 16)
        pools = [kv_pool(blocks, 16, c.num_kv_heads, c.head_dim, dtype=torch.float32, device=torch.device("cpu"))
                 for _ in range(c.num_layers)]
        batch = build_attention_batch([Span(list(range(blocks)), 0, len(ids))], 16, blocks, torch.device("cpu"))
        with torch.inference_mode():
            return model(torch.tensor(ids), pools, batch).clone()

    return run


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_cfg(tiny_hf_model_dir) -> dict:
    return json.loads((tiny_hf_model_dir / "config.json").read_text())


def mtp_engine(folder: str, k: int, mtp_path: str | None = None, overlap: bool = True, **spec) -> LLMEngine:
    loaded = load_model(LoadConfig(model=folder, weight_cache_dir=None))
    cfg = EngineConfig(
        load=LoadConfig(model=folder, weight_cache_dir=None), cache=CacheConfig(num_blocks=64),
        scheduler=SchedulerConfig(overlap=overlap), speculative=SpeculativeConfig(method="mtp", num_speculative_tokens=k,
                                                                   mtp_path=mtp_path, verify="greedy", **spec),
    )
    return LLMEngine(loaded.model, loaded.tokenizer, cfg, 2048, torch.device("cpu"), torch.float32)


def drafts_along_generation(engine: LLMEngine, prompt: list[int], k: int, steps: int) -> list[tuple[list[int], list[int]]]:
    """Greedy decoding of ``prompt`` until the engine's own proposer has drafted ``steps`` times:
    each time, (the tokens so far, the drafts it made for them), seen by wrapping its ``propose``."""
    seen: list[tuple[list[int], list[int]]] = []
    propose = engine.proposer.propose

    def spy(seqs, max_drafts, guides=None):
        proposal = propose(seqs, max_drafts, guides)
        seen.extend((list(seq.token_ids), drafts) for seq, drafts in zip(seqs, proposal.token_ids))
        return proposal

    engine.proposer.propose = spy
    engine.add_request("r", prompt, SamplingParams(max_tokens=(steps + 1) * (k + 1) + 1, temperature=0.0, ignore_eos=True))
    while len(seen) < steps:
        engine.step()
    del engine.proposer.propose
    assert all(len(drafts) == k for _, drafts in seen)
    return seen


# --- tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("naming", ["deepseek_v3", "mimo", "qwen3_next"])
def test_each_naming_loads_beside_an_untouched_target_and_drafts_as_the_formula(
    naming, tiny_hf_model_dir, tiny_cfg, tmp_path, pre_norm_hidden
):
    weights = function_weights(tiny_cfg, 1, seed=3)
    folder = write_checkpoint(tiny_hf_model_dir, tmp_path / naming, naming, weights)
    plain = load_model(LoadConfig(model=str(tiny_hf_model_dir), weight_cache_dir=None)).model
    with_mtp = load_model(LoadConfig(model=folder, weight_cache_dir=None)).model
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), with_mtp.state_dict().values()))
    k = 3
    engine = mtp_engine(folder, k)  # no mtp_path: detected from the checkpoint's config
    prompt = engine.tokenizer.encode(PROMPT)
    for tokens, drafts in drafts_along_generation(engine, prompt, k, steps=4):
        assert drafts == reference_drafts(engine.runner.model, weights, tiny_cfg, tokens, k, TAP[naming], pre_norm_hidden)


def test_identical_weights_draft_identically_in_every_post_norm_naming(tiny_hf_model_dir, tiny_cfg, tmp_path):
    weights = function_weights(tiny_cfg, 1, seed=5)
    results = []
    for naming in ("deepseek_v3", "qwen3_next"):
        engine = mtp_engine(write_checkpoint(tiny_hf_model_dir, tmp_path / naming, naming, weights), 3)
        results.append(drafts_along_generation(engine, engine.tokenizer.encode(PROMPT), 3, steps=3))
    assert results[0] == results[1]


@pytest.mark.parametrize("naming", ["deepseek_v3", "mimo"])
def test_two_modules_wrap_around_with_either_tap(naming, tiny_hf_model_dir, tiny_cfg, tmp_path, pre_norm_hidden):
    """K = 5 over L = 2 modules: drafts 1..5 from modules 0, 1, 0, 1, 0; a wrapped module attends only
    the chain slots it ran. The tap is the naming's: post-norm (DeepSeek-V3), pre-norm (MiMo)."""
    weights = function_weights(tiny_cfg, 2, seed=7)
    folder = write_checkpoint(tiny_hf_model_dir, tmp_path / naming, naming, weights)
    k = 5
    engine = mtp_engine(folder, k)
    for tokens, drafts in drafts_along_generation(engine, engine.tokenizer.encode(PROMPT), k, steps=3):
        assert drafts == reference_drafts(engine.runner.model, weights, tiny_cfg, tokens, k, TAP[naming], pre_norm_hidden)


@pytest.mark.parametrize("naming", ["deepseek_v3", "qwen3_next", "mimo", "ours", "ours_pre_norm"])
def test_each_naming_feeds_its_head_the_hidden_state_its_body_hands_the_mtp_layers(
    naming, tiny_hf_model_dir, tiny_cfg, tmp_path, pre_norm_hidden
):
    """Which target hidden state reaches module 0, as vLLM wires each model: its runner hands the
    body's forward output to the MTP layers (``target_hidden_states`` in ``v1/worker/gpu_model_runner.py``).

    - DeepSeek-V3: ``DeepseekV2Model.forward`` (deepseek_v2.py) returns
      ``self.norm(hidden_states, residual)`` into ``deepseek_mtp.py``'s ``hnorm``: post-norm.
    - Qwen3-Next: ``Qwen3NextModel.forward`` (qwen3_next.py) returns the same into
      ``qwen3_next_mtp.py``'s ``pre_fc_norm_hidden``: post-norm.
    - MiMo: ``MiMoModel.forward`` (mimo.py) returns ``hidden_states + residual``, the residual
      stream before the final norm (``MiMoForCausalLM.compute_logits`` applies ``model.norm``
      itself), into ``mimo_mtp.py``'s ``hidden_layernorm``: pre-norm.
    - Ours (``train-mtp``): the tap its folder records (``--hidden-tap``, post-norm by default), the
      one its trainer recorded (``training/distill.py`` ``HiddenRecorder``, through the same
      ``HiddenTap.apply``).

    A hook on module 0 sees its inputs over a prompt's slots: slot q ≥ 1 must hold the target's own
    h_{q-1} before (pre-norm) or after (post-norm) its final norm, whose weight is not 1 here, so
    the two differ."""
    if naming.startswith("ours"):  # a train-mtp folder with the default tap, and one trained pre-norm
        tap = "pre_norm" if naming == "ours_pre_norm" else "post_norm"
        target = load_model(LoadConfig(model=str(tiny_hf_model_dir), weight_cache_dir=None)).model
        cfg = MtpConfig(num_modules=1, target=TargetFingerprint.of(target, "tiny"))
        if naming == "ours_pre_norm":
            cfg = cfg.model_copy(update={"hidden_tap": HiddenTap.PRE_NORM})
        save_mtp_head(tmp_path / "ours", MtpHead(target.config, cfg), target)
        engine = mtp_engine(str(tiny_hf_model_dir), 2, mtp_path=str(tmp_path / "ours"))
    else:
        tap = TAP[naming]
        weights = function_weights(tiny_cfg, 1, seed=13)
        engine = mtp_engine(write_checkpoint(tiny_hf_model_dir, tmp_path / naming, naming, weights), 2)
    seen: list[torch.Tensor] = []
    engine.proposer.head.layers[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].clone()))
    prompt = engine.tokenizer.encode(PROMPT)
    engine.add_request("r", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.step()
    target = engine.runner.model
    pre = pre_norm_hidden(target, prompt[:-1])  # [n-1, H]: h_0..h_{n-2}
    post = ref_rms(pre, target.model.norm.weight, tiny_cfg["rms_norm_eps"])
    assert not torch.allclose(pre, post, atol=1e-2)
    inputs = seen[0]  # [n, H]: module 0 over the prompt's slots, zeros at slot 0
    assert inputs.shape[0] == len(prompt) and not inputs[0].any()
    torch.testing.assert_close(inputs[1:], pre if tap == "pre_norm" else post, rtol=1e-4, atol=1e-5)


def test_a_prefix_cache_hit_and_a_preemption_restart_the_head_from_the_cached_prefix(
    tiny_hf_model_dir, tiny_cfg, tmp_path, pre_norm_hidden
):
    """A second request on a cached prefix starts its head slots after the prefix (their inputs were
    kept with the prefix's last block); a preempted one restarts the same way: drafts still equal
    the formula's. Overlap off: the test preempts by hand between steps and then drafts itself."""
    weights = function_weights(tiny_cfg, 1, seed=11)
    folder = write_checkpoint(tiny_hf_model_dir, tmp_path / "ds", "deepseek_v3", weights)
    k = 3
    engine = mtp_engine(folder, k, overlap=False)
    prompt = engine.tokenizer.encode(PROMPT * 2)
    assert len(prompt) > 2 * engine.blocks.block_size
    drafts_along_generation(engine, prompt, k, steps=2)
    engine.abort_request("r")
    hits = engine.scheduler.prefix_cache_hit_tokens
    for tokens, drafts in drafts_along_generation(engine, prompt, k, steps=3):
        assert drafts == reference_drafts(engine.runner.model, weights, tiny_cfg, tokens, k, "post_norm", pre_norm_hidden)
    assert engine.scheduler.prefix_cache_hit_tokens > hits
    seq = engine.requests["r"].completions[0].seq
    engine.scheduler._preempt(seq)
    engine.proposer.preempted(seq)
    engine.step()  # recomputes the sequence, on its cached prefix
    assert engine.blocks.grow(seq, len(seq) + k)
    drafts = engine.proposer.propose([seq], [k]).token_ids[0]
    assert drafts == reference_drafts(engine.runner.model, weights, tiny_cfg, list(seq.token_ids), k, "post_norm", pre_norm_hidden)


def test_broken_heads_and_models_without_heads_are_refused_with_what_to_do(tiny_hf_model_dir, tiny_cfg, tmp_path):
    weights = function_weights(tiny_cfg, 1, seed=1)
    with pytest.raises(ValueError, match=r"carries no MTP layers \(looked for num_nextn_predict_layers.*train-mtp"):
        mtp_engine(str(tiny_hf_model_dir), 2)
    misshapen = [dict(weights[0], eh=weights[0]["eh"][:, :32].contiguous())]
    folder = write_checkpoint(tiny_hf_model_dir, tmp_path / "shape", "deepseek_v3", misshapen)
    with pytest.raises(ValueError, match=r"shape mismatch for the MTP head in .*shape: 'layers.0.eh_proj.weight': checkpoint \(64, 32\)"):
        mtp_engine(folder, 2)
    folder = write_checkpoint(tiny_hf_model_dir, tmp_path / "missing", "mimo", weights, num_nextn_predict_layers=2)
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers = 2 but the checkpoint has 1"):
        mtp_engine(folder, 2)
    del weights[0]["block.mlp.down_proj.weight"]
    folder = write_checkpoint(tiny_hf_model_dir, tmp_path / "partial", "qwen3_next", weights)
    with pytest.raises(KeyError, match=r"lacks 1 weights.*down_proj"):
        mtp_engine(folder, 2)


def test_a_trained_heads_folder_is_refused_with_another_target_naming_both(tiny_hf_model_dir, sharp, tmp_path):
    head = MtpHead(sharp[0].config, MtpConfig(num_modules=1, target=TargetFingerprint.of(sharp[0], "sharp")))
    save_mtp_head(tmp_path / "head", head, sharp[0])
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["mtp"]["target"]["name"] == "sharp"
    assert config["mtp"]["hidden_tap"] == "post_norm" and config["mtp"]["concat_order"] == "embedding_first"
    names = set(load_file(str(tmp_path / "head" / "model.safetensors")))
    assert "model.layers.2.eh_proj.weight" in names and "model.layers.2.self_attn.q_proj.weight" in names
    assert not any("embed_tokens" in n or "shared_head.head" in n or n == "lm_head.weight" for n in names)
    with pytest.raises(ValueError, match=r"trained for 'sharp' \(llama, vocabulary \d+, .*not for the target 'tiny-llama"):
        mtp_engine(str(tiny_hf_model_dir), 2, mtp_path=str(tmp_path / "head"))
