"""Structured output overhead: 64 JSON-schema requests against the same 64 unconstrained.

One engine, one tiny model (or ``--model DIR``). The constrained run samples 64 requests under
SCHEMA (nested object, enum, array, bounded integer), seeded, up to ``--max-tokens`` each; the
unconstrained run then asks for exactly as many tokens per request (``ignore_eos``), so both
generate the same number of tokens and the throughput ratio is the grammar's cost alone (the
bitmask fill per sequence per step and its application). Runs alternate ``--repeats`` times,
each side keeps its best. The ratio is printed by wall clock and by this process's CPU time:
on a shared machine (other processes taking the cores) the CPU-time ratio is the steadier one,
as the engine and the grammar both run on this process's one thread. Also: the time to first token of one request with a schema never
seen (compiled while it waits) against the same schema again (cached), medians of
``--ttft-trials``; and the share of constrained outputs finishing with ``stop`` that validate
against SCHEMA with ``jsonschema``.

    python -m bench.structured [--model DIR] [--num 64] [--max-tokens 160] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "kind": {"type": "string", "enum": ["cache", "scheduler", "sampler", "proxy"]},
        "owner": {
            "type": "object",
            "properties": {
                "team": {"type": "string", "maxLength": 16},
                "oncall": {"type": "boolean"},
            },
            "required": ["team", "oncall"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "priority": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["name", "kind", "owner", "tags", "priority"],
    "additionalProperties": False,
}


def run(engine, prompts: list[list[int]], params: list) -> tuple[float, float, list]:
    """Wall seconds, this process's CPU seconds, and the outputs of one batch run."""
    from tandem.server.engine import RequestOutput

    engine.kv.pool.reset_prefix_cache()
    start, cpu = time.perf_counter(), time.process_time()
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return elapsed, cpu, [done[f"r{i}"].outputs[0] for i in range(len(prompts))]


def ttft(engine, prompt: list[int], params, rid: str) -> float:
    start = time.perf_counter()
    engine.add_request(rid, prompt, params, stream=True)
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter() - start
    return first


def main() -> None:
    import jsonschema
    import torch

    from tandem.server.engine import LLMEngine, SamplingParams
    from tandem.server.engine.config import EngineConfig
    from tandem.server.engine.structured import GrammarSpec

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--num", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ttft-trials", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from tandem.server.engine.tiny_model import TinyModelSpec, make_tiny_model

        model = str(make_tiny_model(tempfile.mkdtemp() + "/m", TinyModelSpec(arch="qwen2")))
    engine = LLMEngine(
        EngineConfig(
            model=model,
            kv_cache_tokens=args.num * (128 + args.max_tokens + 16),
            max_num_seqs=args.num,
            max_num_batched_tokens=4096,
        )
    )
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(32, 128))] for _ in range(args.num)
    ]
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    engine.grammars.submit(spec).result()
    constrained = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, structured=spec)
        for i in range(args.num)
    ]
    run(engine, prompts[:2], [p.clone(max_tokens=4) for p in constrained[:2]])  # warm-up
    best_c = best_u = cpu_c = cpu_u = float("inf")
    outs = []
    for _ in range(args.repeats):
        t, cpu, outs = run(engine, prompts, constrained)
        best_c, cpu_c = min(best_c, t), min(cpu_c, cpu)
        free = [
            SamplingParams(temperature=1.0, seed=i, max_tokens=len(o.token_ids), ignore_eos=True)
            for i, o in enumerate(outs)
        ]
        t, cpu, free_outs = run(engine, prompts, free)
        best_u, cpu_u = min(best_u, t), min(cpu_u, cpu)
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == sum(len(o.token_ids) for o in free_outs)
    stops = [o for o in outs if o.finish_reason == "stop"]
    valid = 0
    for o in stops:
        try:
            jsonschema.validate(json.loads(o.text), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    cold, warm = [], []
    for i in range(args.ttft_trials):
        fresh = GrammarSpec("json_schema", json.dumps({**SCHEMA, "description": f"trial {i}"}))
        one = SamplingParams(temperature=1.0, seed=i, max_tokens=4, structured=fresh)
        cold.append(ttft(engine, prompts[i], one, f"cold{i}"))
        warm.append(ttft(engine, prompts[i], one, f"warm{i}"))
    print(f"{args.num} requests, {tokens} tokens each side")
    print(f"constrained   {tokens / best_c:9.1f} tok/s")
    print(f"unconstrained {tokens / best_u:9.1f} tok/s")
    print(f"throughput ratio constrained/unconstrained = {best_u / best_c:.3f}x (wall clock)")
    print(f"throughput ratio constrained/unconstrained = {cpu_u / cpu_c:.3f}x (CPU time)")
    cold_ms, warm_ms = statistics.median(cold) * 1e3, statistics.median(warm) * 1e3
    print(
        f"TTFT cold schema {cold_ms:.1f} ms, cached {warm_ms:.1f} ms: cold/cached = {cold_ms / warm_ms:.2f}x"
    )
    print(
        f"finished with stop: {len(stops)}/{len(outs)}; valid against the schema: {valid}/{len(stops)} = {100 * valid / max(1, len(stops)):.1f}%"
    )


if __name__ == "__main__":
    main()
