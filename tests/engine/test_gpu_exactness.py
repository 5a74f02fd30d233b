"""On a GPU: the engine against transformers on the same device, in bfloat16 and float16.

The reference is transformers in float32 on the GPU. A 16-bit model differs from it by its
rounding, and transformers' own 16-bit run shows how much: per case, its largest logit and
log-probability error against float32 over the steps where the two agree. The engine in the
same 16-bit dtype is held to twice that (``FACTOR``): every greedy token equals float32's
until the first step where they differ, and there float32's margin between its pick and ours
is within that logit error (a near-tie that 16-bit rounding may flip; after it the two are
different texts and are not compared); log-probabilities of the shared steps are within
that log-probability error. Each scenario (a batch in CUDA graphs, eager FlashInfer, the
torch backend, chunked prefill, prefix-cache hits, preemption, ``n > 1``) must also keep
most tokens (half, or half as many as transformers' own 16-bit run keeps where that keeps
fewer, as through a LoRA adapter on random weights): a run that parts at step 0 everywhere
proves nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tandem.server.engine import LLM, SamplingParams
from tandem.server.engine.tiny_lora import TARGETS, TinyLoraSpec, make_tiny_lora

from .test_spec_decode import Oracle, accepted_and_rejected, constant_costs
from .utils import PROMPTS

NEW_TOKENS = 16
FACTOR = 2.0
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@dataclass
class Reference:
    tokens: list[list[int]]
    logits: list[torch.Tensor]  # [steps, vocab] per prompt, float32 on the host


@dataclass
class Case:
    model_dir: Path
    dtype: str
    prompt_ids: list[list[int]]
    ref: Reference  # transformers in float32
    tie: float  # logits: FACTOR x transformers' own 16-bit error
    logprob_tol: float
    keep: float = 0.5  # the share of tokens a run must keep before its first near-tie

    def llm(self, **kw: object) -> LLM:
        kw = {"kv_cache_tokens": 16384, **kw}
        return LLM(str(self.model_dir), device="cuda", dtype=self.dtype, **kw)


def _hf_reference(
    model_dir: Path, dtype: torch.dtype, prompt_ids: list[list[int]], adapter: Path | None = None
) -> Reference:
    """transformers' greedy tokens and logits on the GPU; through PEFT when ``adapter`` is set."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()
    if adapter is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, str(adapter)).to("cuda", dtype).eval()
    tokens, logits = [], []
    with torch.no_grad():
        for ids in prompt_ids:
            out = model.generate(
                torch.tensor([ids], device="cuda"),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                return_dict_in_generate=True,
                output_logits=True,
            )
            tokens.append(out.sequences[0, len(ids) :].tolist())
            logits.append(torch.stack([lg[0] for lg in out.logits]).float().cpu())
    del model
    torch.cuda.empty_cache()
    return Reference(tokens, logits)


def leading_agreement(got: list[int], want: list[int]) -> int:
    return next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), len(want))


def errors_against(ref: Reference, half: Reference) -> tuple[float, float, float]:
    """transformers' own 16-bit error against float32: the largest logit and log-probability
    differences over the steps where both picked the same tokens, and the share of tokens
    it keeps before it first parts from float32."""
    logit_err = logprob_err = 0.0
    kept = 0
    for i, want in enumerate(ref.tokens):
        steps = leading_agreement(half.tokens[i], want)
        kept += steps
        a, b = ref.logits[i][:steps], half.logits[i][:steps]
        if steps:
            logit_err = max(logit_err, (a - b).abs().max().item())
            lp = (torch.log_softmax(a, -1) - torch.log_softmax(b, -1)).abs().max().item()
            logprob_err = max(logprob_err, lp)
    return logit_err, logprob_err, kept / sum(map(len, ref.tokens))


def _case(model_dir: Path, dtype: str, adapter: Path | None = None) -> Case:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    ref = _hf_reference(model_dir, torch.float32, prompt_ids, adapter)
    logit_err, logprob_err, kept = errors_against(
        ref, _hf_reference(model_dir, getattr(torch, dtype), prompt_ids, adapter)
    )
    print(
        f"{model_dir.name} {dtype} adapter {adapter}: transformers' error against float32: "
        f"logits {logit_err:.4f}, logprobs {logprob_err:.4f}, {kept:.0%} of tokens kept"
    )
    tol = FACTOR * logit_err, FACTOR * logprob_err
    return Case(model_dir, dtype, prompt_ids, ref, *tol, keep=min(0.5, kept / FACTOR))


@pytest.fixture(
    scope="module",
    params=[(a, d) for a in ("llama", "qwen2", "qwen3") for d in ("bfloat16", "float16")],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def case(request: pytest.FixtureRequest, gpu_models: dict[str, Path]) -> Case:
    arch, dtype = request.param
    return _case(gpu_models[arch], dtype)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def lora_case(
    request: pytest.FixtureRequest, gpu_models: dict[str, Path], tmp_path_factory
) -> tuple[Case, Case, Path]:
    """The base model's case and an adapter's (every target module, rank 8), bfloat16."""
    model_dir = gpu_models[request.param]
    spec = TinyLoraSpec(rank=8, alpha=8, targets=TARGETS, seed=12)
    adapter = make_tiny_lora(model_dir, tmp_path_factory.mktemp("gpu-lora") / "all-r8", spec)
    return _case(model_dir, "bfloat16"), _case(model_dir, "bfloat16", adapter), adapter


def shared_steps(case: Case, i: int, got: list[int]) -> int:
    """How many leading tokens equal float32's; where they first differ, float32 must be near a tie."""
    want, logits = case.ref.tokens[i], case.ref.logits[i]
    step = leading_agreement(got, want)
    if step < len(want):
        margin = (logits[step, want[step]] - logits[step, got[step]]).item()
        assert margin <= case.tie, (
            f"prompt {i} step {step}: ours {got[step]}, float32 {want[step]}, "
            f"margin {margin:.3f} > {case.tie:.3f}"
        )
    return step


def _check(case: Case, outputs) -> float:
    """Tie-aware equality for every output; the share of tokens before the first near-tie."""
    kept = sum(shared_steps(case, i, out.token_ids) for i, out in enumerate(outputs))
    share = kept / (NEW_TOKENS * len(outputs))
    assert share >= case.keep, f"only {share:.0%} of the tokens before the first near-tie"
    return share


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_a_batch_in_cuda_graphs_matches_transformers(case: Case) -> None:
    llm = case.llm()
    runner = llm.engine.worker.runner
    assert runner.backend.name == "flashinfer" and runner.graph_sizes
    _check(case, llm.generate(case.prompt_ids, GREEDY))
    llm.engine.kv.pool.check_all_free()


def test_eager_flashinfer_matches_transformers(case: Case) -> None:
    llm = case.llm(attention_backend="flashinfer", enforce_eager=True)
    assert not llm.engine.worker.runner.graph_sizes
    _check(case, llm.generate(case.prompt_ids, GREEDY))


def test_torch_backend_matches_transformers(case: Case) -> None:
    llm = case.llm(attention_backend="torch")
    _check(case, llm.generate(case.prompt_ids, GREEDY))


def test_chunked_prefill_matches_transformers(case: Case) -> None:
    llm = case.llm(max_num_batched_tokens=7, enable_prefix_caching=False)
    assert max(len(p) for p in case.prompt_ids) > 21
    _check(case, llm.generate(case.prompt_ids, GREEDY))


def test_prefix_hits_match_transformers(case: Case) -> None:
    llm = case.llm()
    llm.generate(case.prompt_ids, GREEDY)
    outputs = llm.generate(case.prompt_ids, GREEDY)
    assert sum(o.num_cached_tokens for o in outputs) > 0
    _check(case, outputs)


def test_preemption_matches_transformers(case: Case) -> None:
    tokens = max(len(p) for p in case.prompt_ids) + NEW_TOKENS + 16
    llm = case.llm(kv_cache_tokens=tokens, block_size=16, max_num_seqs=8)
    outputs = llm.generate(case.prompt_ids, GREEDY)
    assert llm.engine.stats().num_preemptions > 0
    _check(case, outputs)
    llm.engine.kv.pool.check_all_free()


def test_n_greedy_choices_each_match_transformers(case: Case) -> None:
    llm = case.llm()
    outputs = llm.generate(case.prompt_ids[:4], GREEDY.clone(n=3))
    for i, out in enumerate(outputs):
        assert len(out.outputs) == 3
        for choice in out.outputs:
            shared_steps(case, i, choice.token_ids)


def test_logprobs_match_transformers(case: Case) -> None:
    llm = case.llm()
    params = GREEDY.clone(logprobs=5)
    outputs = llm.generate(case.prompt_ids, params)
    worst = 0.0
    for i, out in enumerate(outputs):
        ref = torch.log_softmax(case.ref.logits[i], dim=-1)
        steps = shared_steps(case, i, out.token_ids)
        for step, lp in enumerate(out.logprobs[:steps]):
            worst = max(worst, abs(lp.logprob - ref[step, lp.token_id].item()))
    print(
        f"{case.dtype}: ours against float32: logprobs {worst:.4f} (bound {case.logprob_tol:.4f})"
    )
    assert worst <= case.logprob_tol


def test_speculative_verification_matches_transformers(case: Case) -> None:
    """Proposals verified in one forward (eager, several query rows a sequence) on the GPU:
    float32's own continuation, spoiled now and then, so steps both accept and reject."""
    llm = case.llm(speculative_method="ngram")
    llm.engine.speculator.proposer = Oracle(case.prompt_ids, case.ref.tokens)
    constant_costs(llm.engine)
    _check(case, llm.generate(case.prompt_ids, GREEDY))
    accepted, rejected = accepted_and_rejected(llm.engine)
    assert accepted > 0 and rejected > 0
    llm.engine.kv.pool.check_all_free()


def test_a_lora_adapter_matches_peft_beside_the_base_model(lora_case) -> None:
    """One batch mixing the base model (its decode steps in CUDA graphs when no adapter row
    is in them) and an adapter (eager) against transformers and PEFT in float32."""
    base, tuned, adapter = lora_case
    moved = sum(a != b for a, b in zip(base.ref.tokens, tuned.ref.tokens))
    assert moved >= len(PROMPTS) // 2, "the adapter hardly changes the reference"
    llm = base.llm(lora_modules=(f"tuned={adapter}",))
    n = len(base.prompt_ids)
    outputs = llm.generate(base.prompt_ids * 2, GREEDY, lora=[None] * n + ["tuned"] * n)
    _check(base, outputs[:n])
    _check(tuned, outputs[n:])
    only_base = llm.generate(base.prompt_ids, GREEDY)  # every decode step in a graph
    assert llm.engine.worker.runner.graph_sizes
    _check(base, only_base)
    llm.engine.kv.pool.check_all_free()
