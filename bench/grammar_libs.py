"""xgrammar against llguidance on this machine: the measurement behind docs/structured.md's choice.

For each library, with the tiny model's tokenizer (or ``--tokenizer DIR``): the time to
compile the bench's JSON schema cold, and the mean time per token to fill the next-token
bitmask and advance the matcher along a random walk of allowed tokens (the work the engine
does per constrained sequence per step). Prints both per library and the ratios.

    python -m bench.grammar_libs [--tokenizer DIR] [--tokens 2000]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

import torch

from bench.structured import SCHEMA


def walk(fill, accept, allowed_of, tokens: int, seed: int) -> float:
    """Seconds per token of fill + accept over ``tokens`` steps of a random allowed-token walk."""
    rng = random.Random(seed)
    spent = 0.0
    steps = 0
    while steps < tokens:
        reset = True
        while steps < tokens:
            t0 = time.perf_counter()
            fill(reset)
            reset = False
            allowed = allowed_of()
            if not allowed:
                break
            tok = rng.choice(allowed)
            done = accept(tok)
            spent += time.perf_counter() - t0
            steps += 1
            if done:
                break
    return spent / tokens


def bench_xgrammar(tok, vocab: int, eos: list[int], tokens: int) -> tuple[float, float]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, vocab)
    state = {"m": xgr.GrammarMatcher(compiled)}

    def fill(reset: bool) -> None:
        if reset:
            state["m"] = xgr.GrammarMatcher(compiled)
        state["m"].fill_next_token_bitmask(mask, 0)

    def allowed() -> list[int]:
        logits = torch.zeros(1, vocab)
        xgr.apply_token_bitmask_inplace(logits, mask)
        return torch.nonzero(logits[0] == 0).flatten().tolist()

    def accept(t: int) -> bool:
        state["m"].accept_token(t)
        return state["m"].is_terminated()

    return compile_s, walk(fill, accept, allowed, tokens, 0)


def bench_llguidance(tok, vocab: int, eos: list[int], tokens: int) -> tuple[float, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lgt

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos[0])
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t0
    assert not matcher.is_error(), matcher.get_error()
    mask = lgt.allocate_token_bitmask(1, vocab)
    state = {"m": matcher}

    def fill(reset: bool) -> None:
        if reset:
            state["m"] = llguidance.LLMatcher(lltok, grammar)
        lgt.fill_next_token_bitmask(state["m"], mask, 0)

    def allowed() -> list[int]:
        logits = torch.zeros(1, vocab)
        lgt.apply_token_bitmask_inplace(logits, mask)
        return torch.nonzero(logits[0] == 0).flatten().tolist()

    def accept(t: int) -> bool:
        state["m"].consume_token(t)
        return state["m"].is_stopped()

    return compile_s, walk(fill, accept, allowed, tokens, 0)


def main() -> None:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--tokens", type=int, default=2000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = args.tokenizer
    if path is None:
        from tandem.server.engine.tiny_model import TinyModelSpec, make_tiny_model

        path = str(make_tiny_model(tempfile.mkdtemp() + "/m", TinyModelSpec(arch="qwen2")))
    tok = AutoTokenizer.from_pretrained(path)
    vocab = len(tok)
    eos = [tok.eos_token_id if tok.eos_token_id is not None else vocab - 1]
    results = {
        "xgrammar": bench_xgrammar(tok, vocab, eos, args.tokens),
        "llguidance": bench_llguidance(tok, vocab, eos, args.tokens),
    }
    for name, (c, per) in results.items():
        print(f"{name:10s} compile {c * 1e3:8.2f} ms   fill+accept {per * 1e6:8.1f} us/token")
    (xc, xp), (lc, lp) = results["xgrammar"], results["llguidance"]
    print(
        f"compile llguidance/xgrammar = {lc / xc:.2f}x; per-token llguidance/xgrammar = {lp / xp:.2f}x"
    )


if __name__ == "__main__":
    main()
