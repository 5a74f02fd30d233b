"""lm-evaluation-harness against ``tandem serve`` on the shipped model, beside the same
harness on transformers (``--model hf``) in the same run: a small multiple-choice task the
test writes itself (the public datasets cannot be downloaded here), scored by loglikelihood
through ``local-completions`` (``echo`` + ``logprobs``) and by generation through
``local-chat-completions``. The accuracies must agree within one question."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tandem.server.engine.default_model import NAME, default_model_path

from ..utils import ENGINE_FLAGS, ServerProcess

pytestmark = pytest.mark.timeout(900)

CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Japan": "Tokyo",
    "England": "London",
    "Russia": "Moscow",
    "Egypt": "Cairo",
    "China": "Beijing",
    "Greece": "Athens",
    "Portugal": "Lisbon",
    "Austria": "Vienna",
}
CITIES = list(CAPITALS.values())

MULTIPLE_CHOICE = """task: tandem_capitals_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "The capital of {{{{country}}}} is"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""

GENERATION = """task: tandem_capitals_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "What is the capital of {{{{country}}}}?"
doc_to_target: "{{{{capital}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 24
  do_sample: false
  temperature: 0
filter_list:
  - name: city
    filter:
      - function: regex
        regex_pattern: "({cities})"
      - function: take_first
metric_list:
  - metric: exact_match
"""


def _write_tasks(root: Path) -> Path:
    """The data (a jsonl: four choices per country, the right one rotating) and both tasks."""
    rows = []
    for i, (country, capital) in enumerate(CAPITALS.items()):
        wrong = [c for c in CITIES if c != capital]
        choices = [wrong[(i + k) % len(wrong)] for k in range(3)]
        label = i % 4
        choices.insert(label, capital)
        rows.append(
            {
                "country": country,
                "capital": capital,
                "choices": [" " + c for c in choices],
                "label": label,
            }
        )
    data = root / "capitals.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "mc.yaml").write_text(MULTIPLE_CHOICE.format(data=data))
    (tasks / "gen.yaml").write_text(GENERATION.format(data=data, cities="|".join(CITIES)))
    return tasks


def _score(results: dict, task: str, metric: str) -> float:
    scores = results["results"][task]
    return next(v for k, v in scores.items() if k.startswith(metric + ",") and "stderr" not in k)


def _evaluate(model: str, model_args: dict, tasks: Path, names: list[str], **kw) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=names,
        task_manager=TaskManager(include_path=str(tasks)),
        num_fewshot=0,
        batch_size=1,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
        log_samples=False,
        **kw,
    )


@pytest.fixture(scope="module")
def offline(tmp_path_factory: pytest.TempPathFactory):
    """Nothing may reach a hub: the datasets and the tokenizer are local files."""
    saved = dict(os.environ)
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    os.environ["HF_DATASETS_CACHE"] = str(tmp_path_factory.mktemp("hf-datasets"))
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, offline):
    model = default_model_path()
    logs = tmp_path_factory.mktemp("lm-eval")
    srv = ServerProcess(str(model), *ENGINE_FLAGS, served_model_name=NAME, log_path=logs / "s.log")
    try:
        srv.wait_ready(timeout=400)
        yield model, srv, logs
    finally:
        srv.stop()


def test_lm_eval_accuracy_equals_transformers(served) -> None:
    from transformers import AutoTokenizer

    model, srv, root = served
    tasks = _write_tasks(root)
    tokenizer_dir = root / "tokenizer"  # the GGUF's own tokenizer, as HF files lm-eval reads
    AutoTokenizer.from_pretrained(str(model.parent), gguf_file=model.name).save_pretrained(
        tokenizer_dir
    )
    hf_args = {
        "pretrained": str(model.parent),
        "gguf_file": model.name,
        "tokenizer": str(tokenizer_dir),
        "dtype": "float32",
        "device": "cpu",
    }
    mc, gen = "tandem_capitals_mc", "tandem_capitals_gen"
    common = {"model": NAME, "max_retries": 1, "tokenizer": str(tokenizer_dir)}
    ours_mc = _evaluate(
        "local-completions",
        {**common, "base_url": srv.url + "/v1/completions", "tokenizer_backend": "huggingface"},
        tasks,
        [mc],
    )
    ours_gen = _evaluate(
        "local-chat-completions",
        {**common, "base_url": srv.url + "/v1/chat/completions", "tokenizer_backend": "none"},
        tasks,
        [gen],
        apply_chat_template=True,
    )
    ref_mc = _evaluate("hf", hf_args, tasks, [mc])
    ref_gen = _evaluate("hf", hf_args, tasks, [gen], apply_chat_template=True)
    n = len(CAPITALS)
    acc = (_score(ours_mc, mc, "acc"), _score(ref_mc, mc, "acc"))
    em = (_score(ours_gen, gen, "exact_match"), _score(ref_gen, gen, "exact_match"))
    print(f"lm-eval on {n} questions: acc tandem/hf {acc}, exact_match tandem/hf {em}")
    assert abs(acc[0] - acc[1]) * n <= 1 + 1e-9, acc
    assert abs(em[0] - em[1]) * n <= 1 + 1e-9, em
    assert acc[1] >= 0.5 and em[1] >= 0.5  # the task is one the model can do: not vacuous
