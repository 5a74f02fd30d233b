"""plan(): the topology for both modes, model sources, and argv that the real CLIs accept."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.operator.spec.inference_service import load_inference_service
from tandem.operator.topology import engine_flags, plan
from tandem.server.cli import build_parser


def isvc(name: str = "svc", namespace: str = "ml", **spec: Any):
    body = {"model": {"name": "tiny", "uri": "/models/tiny"}, **spec}
    return load_inference_service(
        {
            "apiVersion": "tandem.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": name, "namespace": namespace},
            "spec": body,
        }
    )


def parse(args: list[str]):
    """The argv as `tandem` itself parses it, with the host/port the caller adds."""
    return build_parser(only=args[0]).parse_args([*args, "--host", "127.0.0.1", "--port", "9000"])


def test_disaggregated_has_prefill_decode_and_proxy() -> None:
    topo = plan(isvc(prefill={"replicas": 2, "gpus": 2}, decode={"replicas": 3, "gpus": 4}))
    assert [(r.role, r.replicas, r.gpus) for r in topo.roles] == [
        ("prefill", 2, 2),
        ("decode", 3, 4),
        ("proxy", 1, 0),
    ]
    prefill = parse(topo.role("prefill").args)
    assert (prefill.command, prefill.role, prefill.tensor_parallel_size) == ("serve", "prefill", 2)
    assert (prefill.model, prefill.served_model_name) == ("/models/tiny", "tiny")
    decode = parse(topo.role("decode").args)
    assert (decode.role, decode.tensor_parallel_size) == ("decode", 4)


def test_disaggregated_without_prefill_section_gets_one_prefill_replica() -> None:
    topo = plan(isvc())
    assert (topo.role("prefill").replicas, topo.role("prefill").gpus) == (1, 1)


def test_aggregated_has_one_both_pool_and_no_prefill() -> None:
    topo = plan(isvc(mode="Aggregated", decode={"replicas": 2}))
    assert [r.role for r in topo.roles] == ["both", "proxy"]
    assert topo.role("prefill") is None
    assert parse(topo.role("both").args).role == "both"


def test_engine_spec_becomes_the_engine_flags_tandem_serve_parses() -> None:
    spec = {
        "blockSize": 32,
        "maxModelLen": 4096,
        "gpuMemoryUtilization": 0.7,
        "kvCacheTokens": 65536,
        "maxNumSeqs": 64,
        "maxNumBatchedTokens": 8192,
        "dtype": "bfloat16",
        "attentionBackend": "flashinfer",
        "enablePrefixCaching": False,
        "prefixCacheScope": "global",
        "enforceEager": True,
        "seed": 7,
        "kvLeaseSeconds": 12.5,
        "kvPullFallback": "recompute",
        "extraArgs": ["--max-waiting-requests", "17"],
        "shutdownTimeoutSeconds": 45,
    }
    topo = plan(isvc(engine=spec))
    args = parse(topo.role("decode").args)
    assert (
        args.block_size,
        args.max_model_len,
        args.gpu_memory_utilization,
        args.kv_cache_tokens,
    ) == (32, 4096, 0.7, 65536)
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.dtype, args.attention_backend) == (
        64,
        8192,
        "bfloat16",
        "flashinfer",
    )
    assert (args.enable_prefix_caching, args.enforce_eager, args.seed) == (False, True, 7)
    assert (args.kv_lease_seconds, args.kv_pull_fallback) == (12.5, "recompute")
    assert args.prefix_cache_scope == "global"
    assert args.max_waiting_requests == 17 and args.shutdown_timeout == 45.0
    # the EngineConfig the server would build from these flags validates
    from tandem.server.engine.engine_args import engine_config_from_args

    config = engine_config_from_args(args, "/models/tiny")
    assert config.block_size == 32 and config.tensor_parallel_size == 1


def test_unset_engine_fields_are_not_passed() -> None:
    assert engine_flags(isvc()) == []
    args = parse(plan(isvc()).role("decode").args)
    assert args.block_size is None and args.enable_prefix_caching is None


def test_proxy_discovers_only_this_services_engine_pods() -> None:
    topo = plan(
        isvc(name="llama", namespace="team-a", proxy={"replicas": 2, "routingPolicy": "least_load"})
    )
    proxy = topo.role("proxy")
    args = parse(proxy.args)
    assert (args.discovery, args.namespace, args.policy) == ("kubernetes", "team-a", "least_load")
    assert args.selector == "tandem.dev/inferenceservice=llama,app.kubernetes.io/component=engine"
    assert proxy.replicas == 2 and proxy.gpus == 0
    static = plan(isvc(), discovery="static").role("proxy")
    assert parse(static.args).discovery == "static"


@pytest.mark.parametrize(
    ("uri", "revision", "kind", "path"),
    [
        ("hf://Qwen/Qwen3-0.6B", None, "hf", "/models/cache/Qwen/Qwen3-0.6B/main"),
        ("hf://Qwen/Qwen3-0.6B", "v2", "hf", "/models/cache/Qwen/Qwen3-0.6B/v2"),
        ("pvc://weights/llama/8b", None, "pvc", "/models/pvc/llama/8b"),
        ("pvc://weights", None, "pvc", "/models/pvc"),
        ("/opt/models/tiny", None, "image", "/opt/models/tiny"),
    ],
)
def test_model_sources_map_to_the_path_the_engine_loads(
    uri: str, revision: str | None, kind: str, path: str
) -> None:
    model = {"name": "m", "uri": uri, **({"revision": revision} if revision else {})}
    topo = plan(isvc(model=model))
    assert (topo.model.kind, topo.model.path) == (kind, path)
    assert parse(topo.role("decode").args).model == path


def test_local_model_dir_overrides_the_in_cluster_path() -> None:
    topo = plan(isvc(model={"name": "m", "uri": "hf://a/b"}), model_dir="/tmp/b")
    assert all(parse(r.args).model == "/tmp/b" for r in topo.engines)


def test_autoscaled_role_starts_at_its_minimum() -> None:
    topo = plan(isvc(decode={"autoscaling": {"minReplicas": 2, "maxReplicas": 5}}))
    decode = topo.role("decode")
    assert (
        decode.replicas == 2
        and decode.autoscaling is not None
        and decode.autoscaling.max_replicas == 5
    )


def test_engine_env_is_passed_to_engines_only() -> None:
    topo = plan(isvc(engine={"env": {"NCCL_DEBUG": "INFO"}}))
    assert topo.role("decode").env == {"NCCL_DEBUG": "INFO"}
    assert topo.role("proxy").env == {}


def test_session_kv_fraction_reaches_the_engine_under_the_cli_flags_name() -> None:
    """``spec.engine.sessionKvFraction`` is ``tandem serve --session-kv-fraction`` is
    ``EngineConfig.session_kv_fraction`` (issue 16: sessions are a bounded cache)."""
    from tandem.server.engine.engine_args import engine_config_from_args

    topo = plan(isvc(engine={"sessionKvFraction": 0.25}))
    for role in ("prefill", "decode"):
        args = topo.role(role).args
        assert args[args.index("--session-kv-fraction") + 1] == "0.25"
        config = engine_config_from_args(parse(args), "/models/tiny")
        assert config.session_kv_fraction == 0.25
    assert "--session-kv-fraction" not in plan(isvc()).role("decode").args  # engine default
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="sessionKvFraction|session_kv_fraction"):
            isvc(engine={"sessionKvFraction": bad})


def test_lora_engine_fields_map_onto_the_engines_flags() -> None:
    """spec.engine's LoRA fields (lora.md) reach every engine as tandem serve's flags."""
    from tandem.server.engine.engine_args import engine_config_from_args

    spec = {
        "enableLora": True,
        "loraModules": ["sql=/adapters/sql", "chat=/adapters/chat"],
        "maxLoras": 2,
        "maxLoraRank": 32,
        "extraArgs": ["--max-waiting-requests", "17"],
    }
    args = parse(plan(isvc(engine=spec)).role("decode").args)
    config = engine_config_from_args(args, "/models/tiny")
    assert config.lora_paths == {"sql": "/adapters/sql", "chat": "/adapters/chat"}
    assert (config.lora_enabled, config.max_loras, config.max_lora_rank) == (True, 2, 32)
    assert args.max_waiting_requests == 17


def test_speculative_decoding_reaches_the_engine_under_the_cli_flags_names() -> None:
    """``spec.engine.speculativeMethod`` / ``numSpeculativeTokens`` are ``tandem serve
    --speculative-method`` / ``--num-speculative-tokens`` are ``EngineConfig``'s fields
    (issue 33); a value the engine refuses is refused by the spec first."""
    from tandem.server.engine.engine_args import engine_config_from_args

    topo = plan(isvc(engine={"speculativeMethod": "ngram", "numSpeculativeTokens": 3}))
    for role in ("prefill", "decode"):
        args = topo.role(role).args
        assert args[args.index("--speculative-method") + 1] == "ngram"
        config = engine_config_from_args(parse(args), "/models/tiny")
        assert (config.speculative_method, config.num_speculative_tokens) == ("ngram", 3)
    assert "--speculative-method" not in plan(isvc()).role("decode").args  # engine default
    for bad in ({"speculativeMethod": "eagle"}, {"numSpeculativeTokens": 0}):
        with pytest.raises(ValueError, match="(?i)speculative"):
            isvc(engine=bad)
