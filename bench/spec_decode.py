"""Speculative decoding's gain, in one invocation: output tok/s and ITL with and without n-gram
speculation at concurrency 1, 4 and 16, on two workloads, with a draft model (the target's
first layers, ``tandem make-draft``), and n-gram on vLLM's CPU build, with Tandem against it.

- ``edit``: chat requests asking SmolLM2-135M-Instruct to rewrite a given paragraph with its
  mistakes fixed (greedy, up to 160 tokens; the answer copies most of the paragraph, so prompt
  lookup guesses well). Goal: >= 1.5x at concurrency 1.
- ``random``: prompts of random token ids, 128 tokens each sampled at temperature 1 with a
  seed per request (``ignore_eos``): little to look up, so speculation must cost little when
  it misses (its length adapts). Goal: >= 0.95x. Seeded, the outputs are the same either way.

Tandem runs the shipped model (the Q4_1 GGUF ``tandem serve`` loads by default); vLLM (0.32.0
CPU, the peer ``bench/vllm_peer.py`` builds) runs the same model as a float32 HF folder with
its own n-gram speculation (``prompt_lookup_min`` 1, ``max`` 4, 4 tokens, as Tandem's), on
``edit`` only. Each engine, with and without speculation, runs in its own process; the two
alternate run by run and each keeps its best, after one unmeasured run of the row each (the
thread tuner's tries), over at least ``--repeats`` rounds and more while a row's runs took
under ``ROW_SECONDS`` (short rows are otherwise noise). A concurrency ``c`` is one wave of
``c`` requests added at once. ITL is each request's (last token - first token) / (tokens - 1),
averaged (tokens that arrive together share the time between arrivals). On a shared, noisy
machine only the ratios of one invocation mean anything; the CPU-seconds ratio (each side's
process tree, user + system) is printed beside the wall-clock one.

The draft rows (``tandem+d``) run ``--speculative-method draft`` with the target's first
``--draft-layers`` layers (Q4_1 blocks as the target's), made once under the bench cache.

    python bench/spec_decode.py [--repeats 2] [--concurrency 1,4,16] [--no-vllm]
           [--threads N] [--tokens 4] [--draft-layers 4] [--workloads edit,random]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import vllm_peer  # noqa: E402  (stdlib-only at import)
import vs_vllm  # noqa: E402  (stdlib-only at import; the same file is both venvs' child)

PARAGRAPHS = [
    "The library opens at nine in the morning and closes at six in the evening. Visitors can "
    "borrow up to five books at a time, and each loan lasts three weeks. Late returns cost ten "
    "cents a day. The reading room on the second floor is quiet, and the childrens section "
    "downstairs has story time every Saturday at eleven.",
    "Our team meets every Monday to plan the week. We review the open tickets, agree on who "
    "takes which task, and note any risks for the release. On Fridays we hold a short demo "
    "where everyone shows what they finished, and we write down what to improve next time.",
    "To bake the bread, mix the flour, water, salt and yeast in a large bowl. Knead the dough "
    "for ten minutes until it is smooth, then let it rise for an hour. Shape it into a loaf, "
    "let it rise again, and bake it at two hundred degrees for thirty five minutes.",
    "The city plans to add new bike lanes along the river next spring. The lanes will connect "
    "the train station with the university and the old market. Cars will still be allowed on "
    "the road, but the speed limit will drop to thirty kilometres an hour.",
]
INSTRUCTIONS = [
    "Rewrite the following text, fixing any mistakes, and keep everything else the same:",
    "Copy this text and correct its spelling:",
]
EDIT_TOKENS = 160
RANDOM_TOKENS = 128
# Each row runs until both sides' runs took this many seconds (and ``--repeats`` rounds).
ROW_SECONDS = 30.0
MAX_ROUNDS = 12


def edit_messages(num: int) -> list[list[dict[str, str]]]:
    pairs = [(i, p) for p in PARAGRAPHS for i in INSTRUCTIONS]
    return [
        [{"role": "user", "content": f"{pairs[j % len(pairs)][0]}\n\n{pairs[j % len(pairs)][1]}"}]
        for j in range(num)
    ]


def random_prompts(num: int, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(num)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(64, 128))] for _ in range(num)]


def wave(workload: str, c: int, tokenizer) -> tuple[list[list[int]], list[dict]]:
    """One wave of ``c`` requests: their prompts (token ids) and sampling arguments, the
    same for both engines."""
    if workload == "edit":
        texts = [
            tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
            for m in edit_messages(c)
        ]
        prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        return prompts, [{"temperature": 0.0, "max_tokens": EDIT_TOKENS}] * c
    # Sampled at temperature 1 with a seed each: text with little to look up (greedy decoding
    # of a small model falls into loops, which lookup guesses well), the same with speculation
    # on or off (one uniform per token either way).
    sampling = [
        {"temperature": 1.0, "seed": i, "max_tokens": RANDOM_TOKENS, "ignore_eos": True}
        for i in range(c)
    ]
    return random_prompts(c), sampling


# ----- children: one engine each, driven over stdin/stdout ----------------------------------
def child(side: str, model: str, spec: str | None, tokens: int) -> None:
    run = (_tandem_child if side == "tandem" else _vllm_child)(model, spec, tokens)
    run("random", 2)  # warm-up
    print("READY", flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        cpu = vs_vllm.tree_cpu_seconds(os.getpid())
        out = run(ask["workload"], ask["concurrency"])
        out["cpu"] = vs_vllm.tree_cpu_seconds(os.getpid()) - cpu
        print(json.dumps(out), flush=True)


def _tandem_child(model: str, spec: str | None, tokens: int):
    """``spec``: None, "ngram", or the path of a draft model."""
    from tandem.server.engine import LLM, SamplingParams

    draft = spec if spec not in (None, "ngram") else None
    llm = LLM(
        model,
        kv_cache_tokens=65536,
        max_num_seqs=64,
        speculative_method="draft" if draft else spec,
        speculative_model=draft,
        num_speculative_tokens=tokens,
    )

    def run(workload: str, c: int) -> dict:
        prompts, sampling = wave(workload, c, llm.tokenizer)
        params = [SamplingParams(**kw) for kw in sampling]
        llm.engine.kv.pool.reset_prefix_cache()
        before = llm.engine.stats()
        start = time.perf_counter()
        results = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        after = llm.engine.stats()
        itls = [
            (r.metrics["finished_time"] - r.metrics["first_token_time"]) / (len(r.token_ids) - 1)
            for r in results
            if len(r.token_ids) > 1
        ]
        drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
        accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
        return {
            "seconds": seconds,
            "tokens": sum(len(r.token_ids) for r in results),
            "itl": sum(itls) / len(itls) if itls else None,
            "acceptance": accepted / drafted if drafted else None,
            "outputs": [r.token_ids for r in results],
        }

    return run


def _vllm_child(model: str, spec: str | None, tokens: int):
    from vllm import LLM, SamplingParams

    speculative = {
        "method": "ngram",
        "num_speculative_tokens": tokens,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 4,
    }
    llm = LLM(
        model,
        dtype="float32",
        max_num_seqs=64,
        max_model_len=4096,
        enable_prefix_caching=True,
        seed=0,
        speculative_config=speculative if spec else None,
    )

    def run(workload: str, c: int) -> dict:
        prompts, sampling = wave(workload, c, llm.get_tokenizer())
        params = [SamplingParams(**kw) for kw in sampling]
        llm.reset_prefix_cache()
        start = time.perf_counter()
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        outs = [list(r.outputs[0].token_ids) for r in results]
        return {"seconds": seconds, "tokens": sum(map(len, outs)), "itl": None, "outputs": outs}

    return run


class Child:
    """One engine (with or without speculation) in its own process."""

    def __init__(self, python: str, side: str, model: str, spec: str | None, tokens: int) -> None:
        cmd = [python, "-P", __file__, "--child", side, "--model", model, "--tokens", str(tokens)]
        cmd += ["--spec", spec] if spec else []
        env = vs_vllm.side_env(side)
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.name = f"{side}{' +' + ('ngram' if spec == 'ngram' else 'draft') if spec else ''}"
        for line in self.proc.stdout:
            if line.strip() == "READY":
                return
        raise RuntimeError(f"{self.name} exited before it was ready")

    def run(self, workload: str, c: int) -> dict:
        self.proc.stdin.write(json.dumps({"workload": workload, "concurrency": c}) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"{self.name} died")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def compare(off: Child, on: Child, workload: str, c: int, repeats: int) -> dict:
    """Both alternate run by run; each keeps its best run. Outputs must agree (greedy).

    First one unmeasured run each: the engine's thread tuner tries every thread count on a
    shape of step it has not seen (one thread on a 16-prompt prefill is several times slower),
    and a row of two runs would keep one of those tries. Then at least ``repeats`` rounds, and
    more (``MAX_ROUNDS`` at most) until the row's runs took ``ROW_SECONDS`` in all: a row of
    one-second runs is otherwise decided by whichever side a burst of load hit, so short rows
    get as many chances at their best as long ones."""
    for child_ in (off, on):  # unmeasured: the thread tuner tries its counts on new shapes
        child_.run(workload, c)
    best: dict[str, dict] = {}
    spent, r = 0.0, 0
    while r < repeats or (spent < ROW_SECONDS and r < MAX_ROUNDS):
        for child_ in (off, on) if r % 2 == 0 else (on, off):
            out = child_.run(workload, c)
            spent += out["seconds"]
            if child_.name not in best or out["seconds"] < best[child_.name]["seconds"]:
                best[child_.name] = out
        r += 1
    a, b = best[off.name], best[on.name]
    same = sum(x == y for x, y in zip(a["outputs"], b["outputs"]))
    row = {
        "tok_s": (a["tokens"] / a["seconds"], b["tokens"] / b["seconds"]),
        "ratio": (b["tokens"] / b["seconds"]) / (a["tokens"] / a["seconds"]),
        "cpu_ratio": (b["tokens"] / b["cpu"]) / (a["tokens"] / a["cpu"]),
        "itl": (a["itl"], b["itl"]),
        "acceptance": b.get("acceptance"),
        "same": f"{same}/{len(a['outputs'])}",
    }
    return row


def _ms(x: float | None) -> str:
    return f"{x * 1000:7.1f}" if x is not None else "      -"


def report(side: str, workload: str, c: int, row: dict) -> str:
    acc = f"{row['acceptance']:.2f}" if row["acceptance"] is not None else "  - "
    return (
        f"{side:7s} {workload:7s} c={c:<3d} tok/s {row['tok_s'][0]:7.1f} -> {row['tok_s'][1]:7.1f}"
        f"  {row['ratio']:5.2f}x (cpu {row['cpu_ratio']:5.2f}x)  ITL ms {_ms(row['itl'][0])}"
        f" -> {_ms(row['itl'][1])}  accepted {acc}  same outputs {row['same']}"
    )


def run_side(
    python: str, side: str, model: str, workloads: list[str], conc: list[int], args, spec: str
) -> dict[tuple[str, int], dict]:
    """Every (workload, concurrency) row of one engine with and without ``spec`` ("ngram" or
    a draft model's path), printed as it lands."""
    off = Child(python, side, model, None, args.tokens)
    on = Child(python, side, model, spec, args.tokens)
    name = side if spec == "ngram" else f"{side}+d"
    rows = {}
    try:
        for w in workloads:
            for c in conc:
                rows[w, c] = compare(off, on, w, c, args.repeats)
                print(report(name, w, c, rows[w, c]), f"(load {vs_vllm.load()})", flush=True)
    finally:
        off.close()
        on.close()
    return rows


def draft_model(target: str, layers: int) -> str:
    """The target's first ``layers`` layers as a draft (``tandem make-draft``), made once."""
    from tandem.server.engine.spec_decode.layer_draft import make_layer_draft

    out = vllm_peer.CACHE / f"draft-{layers}-{Path(target).name}"
    if not out.exists():
        tmp = out.with_name(out.name + ".tmp")
        make_layer_draft(target, tmp, layers)
        tmp.rename(out)
    return str(out)


def versus(ours: dict, theirs: dict) -> list[str]:
    """Tandem against vLLM on the rows both ran: each side's tok/s with speculation, and the
    ratio of the two engines' speculation gains."""
    return [
        f"edit    c={c:<3d} tok/s with n-gram: tandem {ours[w, c]['tok_s'][1]:7.1f}  vllm "
        f"{row['tok_s'][1]:7.1f}  tandem/vllm {ours[w, c]['tok_s'][1] / row['tok_s'][1]:5.2f}x;"
        f"  speculation's gain: tandem {ours[w, c]['ratio']:5.2f}x  vllm {row['ratio']:5.2f}x"
        for (w, c), row in theirs.items()
        if (w, c) in ours
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", choices=("tandem", "vllm"), help=argparse.SUPPRESS)
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=4, help="num_speculative_tokens (both sides)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--workloads", default="edit,random")
    ap.add_argument("--threads", type=int, default=0, help="compute threads (0: every CPU)")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument(
        "--draft-layers",
        type=int,
        default=4,
        help="also run a draft model: the target's first N layers (0: none)",
    )
    args = ap.parse_args()
    if args.child:
        child(args.child, args.model, args.spec, args.tokens)
        return
    if args.threads:
        vs_vllm.THREADS = args.threads
    conc = [int(c) for c in args.concurrency.split(",")]
    workloads = args.workloads.split(",")
    print(vs_vllm.machine())
    print(f"threads per engine: {vs_vllm.THREADS}; ratios: with / without speculation")
    from tandem.server.engine.default_model import default_model_path

    print(f"load average at start: {vs_vllm.load()}")
    target = str(default_model_path())
    ours = run_side(sys.executable, "tandem", target, workloads, conc, args, "ngram")
    drafted: dict = {}
    if args.draft_layers:
        draft = draft_model(target, args.draft_layers)
        drafted = run_side(sys.executable, "tandem", target, workloads, conc, args, draft)
    theirs: dict = {}
    if not args.no_vllm and "edit" in workloads:
        try:
            peer = str(vllm_peer.build_peer())
            hf = str(vllm_peer.smollm2_dir())
            theirs = run_side(peer, "vllm", hf, ["edit"], conc, args, "ngram")
        except (vllm_peer.PeerUnavailable, RuntimeError) as exc:
            print(f"vLLM skipped: {exc}")
    print("summary (ratios: with / without speculation; tandem+d: a draft model):")
    for side, rows in (("tandem", ours), ("tandem+d", drafted), ("vllm", theirs)):
        for (w, c), row in rows.items():
            print(" ", report(side, w, c, row))
    for line in versus(ours, theirs):
        print(" ", line)
    print(f"load average at end: {vs_vllm.load()}")


if __name__ == "__main__":
    main()
