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

Layouts (our engine only): with ``--pipeline-parallel-size P`` > 1, ``ours-nospec`` and each
``ours-M`` (not the ``+lc`` ones) are followed by ``<name>-pp<P>``: the same engine config as a
group of P pipeline stages. With ``--compare-overlap`` every one of our systems is followed by
the same with overlap scheduling flipped from the runtime's default for its layout (off in one
process, on with pipeline stages): ``<name>-overlap`` at P = 1, ``<name>-no-overlap`` with stages. A
variant keeps its base's concurrencies and transformers peer, and its outputs at c > 1 must equal
its own variant of the base's reference (``ours-M+lc-overlap`` → ``ours-M-overlap``). Speedups stay
against ``ours-nospec`` (P = 1, the default: overlap off).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from specdecode.runtime.config import HEAD_METHODS, MTP_PIPELINE_GATE, LoadControl, SpeculativeConfig

NOSPEC = "ours-nospec"
PEER_PLAIN = "transformers-plain"
METHODS = ("none", "ngram", "suffix", "draft", "mtp", "eagle3")
PEER_MODES = {"ngram": "prompt-lookup", "suffix": "prompt-lookup", "draft": "assisted"}  # transformers: no MTP, no EAGLE-3

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
    pipeline_parallel_size: int = 1  # ours: pipeline stages (> 1: a process group, ``ours.py``)
    overlap: bool | None = None  # ours: SchedulerConfig.overlap (None: the runtime's default for the layout)


def build_systems(
    methods: list[str], k: int, draft_model: str | None, concurrency: list[int], with_peer: bool = True,
    load_control: LoadControl = LOAD_CONTROL_ON, mtp_path: str | None = None, pipeline_parallel_size: int = 1,
    compare_overlap: bool = False, eagle3_path: str | None = None,
) -> list[System]:
    """The systems for ``methods`` (``none`` adds nothing: ``ours-nospec`` always runs); the
    ``+lc`` ones run ``load_control``. ``mtp`` runs twice: ``ours-mtp`` with the head's reduced
    draft vocabulary (its default) and ``ours-mtp-fullvocab`` drafting over every token. Layout
    variants as the module docstring says; ValueError for suffix with pipeline stages."""
    if pipeline_parallel_size > 1 and "suffix" in methods:
        raise ValueError("--method suffix cannot run with --pipeline-parallel-size > 1 here: a pipeline system reuses "
                         "one engine across runs (starting its group costs seconds), and the suffix proposer's cache "
                         "of earlier outputs would carry each run's answers into the next; run suffix with P = 1")
    conc = tuple(sorted(set(concurrency)))
    loaded = tuple(c for c in conc if c > 1)
    spec_methods = list(dict.fromkeys(m for m in methods if m != "none"))
    peer_modes = list(dict.fromkeys(PEER_MODES[m] for m in spec_methods if m in PEER_MODES))
    nospec = System(NOSPEC, "ours", conc, peer=PEER_PLAIN, self_reference=NOSPEC)
    ours = [nospec, *_pipelined(nospec, pipeline_parallel_size)]
    for method in spec_methods:
        spec = speculative_config(method, k, draft_model, mtp_path, eagle3_path)
        variants = [(f"ours-{method}", spec)]
        if method == "mtp":
            variants.append(("ours-mtp-fullvocab", spec.model_copy(update={"draft_vocab_size": 0})))
        peer = f"transformers-{PEER_MODES[method]}" if method in PEER_MODES else None
        for name, variant in variants:
            system = System(name, "ours", conc, variant.model_dump(mode="json"), peer=peer, self_reference=name)
            ours.append(system)
            if loaded:
                with_lc = variant.model_copy(update={"load_control": load_control})
                ours.append(System(f"{name}+lc", "ours", loaded, with_lc.model_dump(mode="json"), peer=peer,
                                   self_reference=name))
            ours.extend(_pipelined(system, pipeline_parallel_size))
    if compare_overlap:
        ours = [v for s in ours for v in (s, _overlap_flipped(s))]
    if not with_peer:
        return ours
    single = tuple(c for c in conc if c == 1)
    peers = [System(f"transformers-{mode}", "peer_hf", single, peer_mode=mode) for mode in peer_modes if single]
    return ours + peers + [System(PEER_PLAIN, "peer_hf", conc)]


def _pipelined(system: System, pipeline_parallel_size: int) -> list[System]:
    """``system`` as ``pipeline_parallel_size`` stages (none for 1); MTP and EAGLE-3 heads get the
    experimental gate they need there (asking for the layout in the bench is asking for it)."""
    if pipeline_parallel_size == 1:
        return []
    spec = system.speculative
    if spec is not None and spec["method"] in {m.value for m in HEAD_METHODS}:
        spec = {**spec, "gates": sorted({*spec["gates"], MTP_PIPELINE_GATE})}
    return [_variant(system, f"-pp{pipeline_parallel_size}", pipeline_parallel_size=pipeline_parallel_size,
                     speculative=spec)]


def _overlap_flipped(system: System) -> System:
    """``system`` with overlap scheduling the other way from the runtime's default for its layout."""
    overlap = system.pipeline_parallel_size == 1  # the default is on with stages only
    return _variant(system, "-overlap" if overlap else "-no-overlap", overlap=overlap)


def _variant(system: System, suffix: str, **changes) -> System:
    """``system`` renamed ``<name><suffix>``, judged against its reference's variant of the same suffix."""
    return replace(system, name=system.name + suffix, self_reference=f"{system.self_reference}{suffix}", **changes)


def speculative_config(method: str, k: int, draft_model: str | None, mtp_path: str | None = None,
                       eagle3_path: str | None = None) -> SpeculativeConfig:
    """Raises pydantic's ValidationError (a ValueError) for an impossible combination."""
    return SpeculativeConfig(
        method=method, num_speculative_tokens=k, draft_model=draft_model if method == "draft" else None,
        mtp_path=mtp_path if method == "mtp" else None, eagle3_path=eagle3_path if method == "eagle3" else None,
    )
