"""Which systems one ``specdecode bench`` run measures, and what each is judged against.

For ``--method M…`` the systems are, in the order they run (one subprocess each):

- ``ours-nospec``: our engine without speculation — every speedup's baseline;
- ``ours-M``: our engine with method M, K = ``--num-speculative-tokens``, load control off
  (K at every batch size, no acceptance floor);
- ``ours-M+lc``: the same with ``--load-control`` (default ``LOAD_CONTROL_ON``), at the
  concurrencies above 1 only (load control exists for load: "≥ 0.98× of no-spec under load" is
  what it is judged on);
- ``transformers-prompt-lookup`` (for ngram and suffix: transformers has no suffix proposer,
  prompt lookup is its nearest) and ``transformers-assisted`` (for draft): concurrency 1 only,
  because transformers' candidate generators support batch size 1 only;
- ``transformers-plain`` last: it also computes the top-2 logits that prove (or refute) a near
  tie wherever another system's concurrency-1 output differs from its own.
"""
from __future__ import annotations

from dataclasses import dataclass

from specdecode.runtime.config import LoadControl, SpeculativeConfig

NOSPEC = "ours-nospec"
PEER_PLAIN = "transformers-plain"
METHODS = ("none", "ngram", "suffix", "draft", "mtp")
PEER_MODES = {"ngram": "prompt-lookup", "suffix": "prompt-lookup", "draft": "assisted"}  # transformers has no MTP

# Goodput rather than a fixed table: a table tuned on one machine (it was K=4 up to batch 4, K=2
# up to 8, off above, floor 0.2, from the verify-step cost ratios this 2-core CPU showed) fits
# neither another machine nor another prompt set — on ShareGPT "summarise" at concurrency 8 it
# measured 0.72-0.97x of no-spec in single runs. Goodput fits the step cost and acceptance
# where it runs.
LOAD_CONTROL_ON = LoadControl(goodput=True)


@dataclass(frozen=True)
class System:
    name: str
    runner: str  # the subprocess module: "ours" | "peer_hf"
    concurrency: tuple[int, ...]
    speculative: dict | None = None  # ours: SpeculativeConfig JSON; None = no speculation
    peer_mode: str = "plain"  # transformers: "plain" | "prompt-lookup" | "assisted"
    peer: str | None = None  # ours: the transformers system doing the same thing (speedup "vs transformers")
    self_reference: str | None = None  # ours: at c > 1 outputs must equal this system's c = 1 outputs


def build_systems(
    methods: list[str], k: int, draft_model: str | None, concurrency: list[int], with_peer: bool = True,
    load_control: LoadControl = LOAD_CONTROL_ON, mtp_path: str | None = None,
) -> list[System]:
    """The systems for ``methods`` (``none`` adds nothing: ``ours-nospec`` always runs); the
    ``+lc`` ones run ``load_control``. ``mtp`` runs twice: ``ours-mtp`` with the head's reduced
    draft vocabulary (its default) and ``ours-mtp-fullvocab`` drafting over every token."""
    conc = tuple(sorted(set(concurrency)))
    loaded = tuple(c for c in conc if c > 1)
    spec_methods = list(dict.fromkeys(m for m in methods if m != "none"))
    peer_modes = list(dict.fromkeys(PEER_MODES[m] for m in spec_methods if m in PEER_MODES))
    ours = [System(NOSPEC, "ours", conc, peer=PEER_PLAIN, self_reference=NOSPEC)]
    for method in spec_methods:
        spec = speculative_config(method, k, draft_model, mtp_path)
        variants = [(f"ours-{method}", spec)]
        if method == "mtp":
            variants.append(("ours-mtp-fullvocab", spec.model_copy(update={"draft_vocab_size": 0})))
        peer = f"transformers-{PEER_MODES[method]}" if method in PEER_MODES else None
        for name, variant in variants:
            ours.append(System(name, "ours", conc, variant.model_dump(mode="json"), peer=peer, self_reference=name))
            if loaded:
                with_lc = variant.model_copy(update={"load_control": load_control})
                ours.append(System(f"{name}+lc", "ours", loaded, with_lc.model_dump(mode="json"), peer=peer,
                                   self_reference=name))
    if not with_peer:
        return ours
    single = tuple(c for c in conc if c == 1)
    peers = [System(f"transformers-{mode}", "peer_hf", single, peer_mode=mode) for mode in peer_modes if single]
    return ours + peers + [System(PEER_PLAIN, "peer_hf", conc)]


def speculative_config(method: str, k: int, draft_model: str | None, mtp_path: str | None = None) -> SpeculativeConfig:
    """Raises pydantic's ValidationError (a ValueError) for an impossible combination."""
    return SpeculativeConfig(
        method=method, num_speculative_tokens=k, draft_model=draft_model if method == "draft" else None,
        mtp_path=mtp_path if method == "mtp" else None,
    )
