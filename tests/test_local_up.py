"""``tandem up``: the plan it runs (from the operator's own plan()), and the real thing: the proxy and
a prefill and a decode engine as processes, answering the official ``openai`` client, all stopped by Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tandem.server import local
from tandem.server.net import reserve_port

from .utils import start_up, stop_up, up_args, wait_until

pytestmark = pytest.mark.timeout(300)


def _spec(tmp_path: Path, **spec) -> str:
    doc = {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "demo"},
        "spec": spec,
    }
    path = tmp_path / f"isvc{len(list(tmp_path.glob('isvc*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_default_plan_is_one_prefill_one_decode_on_the_given_model(llama_dir) -> None:
    topo = local.load_plan(up_args(model=str(llama_dir)))
    assert topo.mode == "Disaggregated" and topo.served_model_name == llama_dir.name
    roles = {r.role: r for r in topo.roles}
    assert (roles["prefill"].replicas, roles["decode"].replicas) == (1, 1)
    args = roles["prefill"].args
    assert args[:2] == ["serve", "--model"] and args[2] == str(llama_dir) and "--role" in args
    assert "--disagg-threshold" in roles["proxy"].args and "--discovery" not in roles["proxy"].args


def test_up_takes_spec_loras_as_the_file_its_engines_watch(tmp_path: Path, llama_dir) -> None:
    """``tandem up`` serves ``spec.loras`` as a cluster does: the engines' ``--lora-config``
    is a file in the run's folder, the operator's ConfigMap data, which may be edited live."""
    import json

    f = _spec(
        tmp_path,
        mode="Aggregated",
        model={"name": "m", "uri": str(llama_dir)},
        engine={"enableLora": True},
        loras=[{"name": "sql", "uri": "/adapters/sql"}],
    )
    topo = local.load_plan(up_args(file=f))
    logs = tmp_path / "logs"
    logs.mkdir()
    listener = reserve_port("127.0.0.1")
    children = local.build_children(topo, listener, logs, None, internal_key="k")
    engine = children[1].argv
    assert engine[engine.index("--lora-config") + 1] == str(logs / "loras.json")
    assert json.loads((logs / "loras.json").read_text()) == [
        {"name": "sql", "path": "/adapters/sql"}
    ]
    for c in children:
        c.listener.close()


def test_spec_file_overrides_and_errors(tmp_path: Path, llama_dir) -> None:
    f = _spec(
        tmp_path,
        mode="Disaggregated",
        model={"name": "m", "uri": str(llama_dir)},
        engine={"blockSize": 16, "kvCacheTokens": 2048},
        prefill={"replicas": 1, "gpus": 0},
    )
    topo = local.load_plan(up_args(file=f, prefill=2, decode=3))
    assert [(r.role, r.replicas) for r in topo.engines] == [("prefill", 2), ("decode", 3)]
    assert "--kv-cache-tokens" in topo.engines[0].args and "m" in topo.engines[0].args
    proxy_listener = reserve_port("127.0.0.1")
    proxy_port = proxy_listener.getsockname()[1]
    children = local.build_children(
        topo,
        proxy_listener,
        tmp_path,
        api_key="sk-client-secret",
        base_env={"PATH": "/bin", "TANDEM_API_KEY": "inherited"},
        internal_key="internal-secret",
    )
    assert [c.role for c in children] == [
        "proxy",
        "prefill",
        "prefill",
        "decode",
        "decode",
        "decode",
    ]
    assert len({c.port for c in children}) == len(children)
    # each port is held from the moment it is picked until its child serves on it: nothing
    # else on the machine can take it in between (the old pick-then-bind race)
    for c in children:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", c.port))
        c.listener.close()
    engine = children[1].argv
    assert engine[engine.index("--proxy-url") + 1] == f"http://127.0.0.1:{proxy_port}"
    assert engine[engine.index("--host") + 1] == "127.0.0.1"
    # keys travel in the environment, never on a command line; engines take only the
    # internal credential (not the client key, nor one inherited from the caller)
    assert not any("secret" in arg for c in children for arg in c.argv)
    assert children[0].env["TANDEM_PROXY_API_KEY"] == "sk-client-secret"
    assert all(c.env["TANDEM_INTERNAL_API_KEY"] == "internal-secret" for c in children)
    assert not any(
        name in c.env for c in children[1:] for name in ("TANDEM_API_KEY", "TANDEM_PROXY_API_KEY")
    )
    assert children[1].env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 5))

    hf = _spec(tmp_path, model={"name": "m", "uri": "hf://org/repo"})
    with pytest.raises(local.UpError, match="does not download"):
        local.load_plan(up_args(file=hf))
    assert local.load_plan(up_args(file=hf, model=str(llama_dir))).engines[0].args[2] == str(
        llama_dir
    )
    with pytest.raises(local.UpError, match="PersistentVolumeClaim"):
        local.load_plan(up_args(file=_spec(tmp_path, model={"name": "m", "uri": "pvc://claim/x"})))
    with pytest.raises(local.UpError, match="no model at"):
        local.load_plan(
            up_args(file=_spec(tmp_path, model={"name": "m", "uri": "/nonexistent/model"}))
        )
    agg = _spec(tmp_path, mode="Aggregated", model={"name": "m", "uri": str(llama_dir)})
    assert [r.role for r in local.load_plan(up_args(file=agg, decode=2)).engines] == ["both"]
    with pytest.raises(local.UpError, match="Aggregated"):
        local.load_plan(up_args(file=agg, prefill=1))
    with pytest.raises(local.UpError, match="invalid InferenceService"):
        local.load_plan(up_args(file=_spec(tmp_path, model={"name": "m", "uri": "relative/path"})))
    with pytest.raises(local.UpError, match="no decode"):
        local.load_plan(up_args(file=f, decode=0))
    with pytest.raises(local.UpError, match="cannot read"):
        local.load_plan(up_args(file=str(tmp_path / "missing.yaml")))


def test_engines_sharing_a_gpu_split_its_memory() -> None:
    """Left at the default each engine on a shared GPU sizes its cache from 0.9 of it, and
    the second to start runs out of memory (seen with one H200)."""
    from tandem.server.engine.config import EngineConfig

    default = EngineConfig.__dataclass_fields__["gpu_memory_utilization"].default
    assert local.GPU_MEMORY_UTILIZATION == default
    one_gpu = {("prefill", 0): "0", ("decode", 0): "0"}
    assert local.memory_shares(one_gpu) == {k: f"{default / 2:.3f}" for k in one_gpu}
    assert local.memory_shares({("prefill", 0): "0", ("decode", 0): "1"}) == {}
    three = {("prefill", 0): "0,1", ("decode", 0): "0", ("decode", 1): "1"}
    assert local.memory_shares(three) == {k: f"{default / 2:.3f}" for k in three}
    flag = "--gpu-memory-utilization"
    assert local._with_share(["serve"], "0.450") == ["serve", flag, "0.450"]
    for own in ([flag, "0.3"], [f"{flag}=0.3"]):  # the spec's own share wins
        assert local._with_share(["serve", *own], "0.450") == ["serve", *own]
    assert local._with_share(["serve"], None) == ["serve"]


def test_up_cli_error_exits_2(tmp_path: Path) -> None:
    f = _spec(tmp_path, model={"name": "m", "uri": "hf://org/repo"})
    r = subprocess.run(
        [sys.executable, "-m", "tandem.server.cli", "up", "-f", f],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "does not download" in r.stderr


def _port_open(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=1)
        return True
    except httpx.HTTPError:
        return False


def test_tandem_up_serves_the_openai_client_and_ctrl_c_stops_everything(
    tmp_path: Path, llama_dir: Path
) -> None:
    proc, base, lines = start_up(
        ["--model", str(llama_dir), "--port", "0", "--api-key", "sk-up"]
        + ["--log-dir", str(tmp_path / "logs"), "--grace", "10"],
        dict(os.environ, TANDEM_CACHE=str(tmp_path / "cache")),
        timeout=180,
    )
    try:
        engine_urls = [m.group(1) for ln in lines if (m := re.search(r"ready on (\S+)", ln))]
        assert len(engine_urls) == 2
        client = openai.OpenAI(base_url=base, api_key="sk-up", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [llama_dir.name]
        r = client.chat.completions.create(
            model=llama_dir.name,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=8,
            temperature=0,
        )
        assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1
        text = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model=llama_dir.name,
                prompt="Once upon a time",
                max_tokens=8,
                temperature=0,
                stream=True,
            )
            if c.choices
        )
        assert text
        metrics = httpx.get(base.removesuffix("/v1") + "/metrics", timeout=10).text
        assert (
            'mode="disaggregated"' in metrics
        )  # the default topology really ran prefill -> decode
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        for url in [base.removesuffix("/v1"), *engine_urls]:
            assert not _port_open(url), f"{url} still answers after Ctrl-C"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _pid_on_port(url: str) -> int:
    """The engine process started with ``--port`` of ``url`` (its own process group leader)."""
    port = url.rsplit(":", 1)[1]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--port" in argv and argv[argv.index(b"--port") + 1 :][:1] == [port.encode()]:
            if b"serve" in argv or b"tandem.server.cli" in argv:
                return int(entry.name)
    raise AssertionError(f"no process serves {url}")


def test_tandem_up_restarts_a_stopped_engine(tmp_path: Path, llama_dir: Path) -> None:
    """Issue 26: a SIGSTOPped engine never exits; tandem up notices it stopped answering its
    health check, kills it and restarts it, and the proxy takes it back."""
    proc, base, lines = start_up(
        ["--model", str(llama_dir), "--port", "0", "--admin-api-key", "sk-up-admin"]
        + ["--log-dir", str(tmp_path / "logs"), "--grace", "10", "--hang-timeout", "3"],
        dict(os.environ, TANDEM_CACHE=str(tmp_path / "cache")),
        timeout=180,
    )
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")))
    reader.start()
    try:
        urls = dict(re.findall(r"(\S+) ready on (\S+)", "".join(lines)))
        decode = urls["decode-0"]
        os.kill(_pid_on_port(decode), signal.SIGSTOP)
        wait_until(
            lambda: any("restarted decode-0" in ln for ln in lines),
            timeout=120,
            what="tandem up to restart the stopped engine",
        )
        assert any("decode-0 has not answered its health check" in ln for ln in lines)
        admin = {"Authorization": "Bearer sk-up-admin"}
        proxy = base.removesuffix("/v1")
        wait_until(
            lambda: (
                httpx.get(proxy + "/nodes/status", headers=admin, timeout=10)
                .json()
                .get(decode, {})
                .get("healthy", False)
            ),
            timeout=180,
            what="the restarted decode engine to rejoin the proxy",
        )
        r = httpx.post(  # no client key configured: clients need none
            base + "/completions",
            json={"model": llama_dir.name, "prompt": "Hello", "max_tokens": 4},
            timeout=120,
        )
        assert r.status_code == 200, r.text
    finally:
        stop_up(proc, reader)


def _children_of_up(up_pid: int) -> list[int]:
    """Processes started by ``tandem up`` (its direct children: the proxy and the engines)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == up_pid:
            pids.append(int(entry.name))
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_kill_9_of_tandem_up_leaves_no_process_behind(tmp_path: Path, llama_dir: Path) -> None:
    """Issue 32: SIGKILL runs none of tandem up's clean-up; its children go by themselves
    (the parent-death signal), and with them every port they held."""
    proc, base, lines = start_up(
        ["--model", str(llama_dir), "--port", "0", "--log-dir", str(tmp_path / "logs")],
        dict(os.environ, TANDEM_CACHE=str(tmp_path / "cache")),
        timeout=180,
    )
    engine_urls = [m.group(1) for ln in lines if (m := re.search(r"ready on (\S+)", ln))]
    children = _children_of_up(proc.pid)
    try:
        assert len(children) == 3, children  # the proxy, a prefill and a decode engine
        proc.kill()
        proc.wait(30)
        wait_until(lambda: not any(_alive(p) for p in children), 60, "tandem up's children to go")
        for url in [base.removesuffix("/v1"), *engine_urls]:
            assert not _port_open(url), f"{url} still answers after kill -9 of tandem up"
    finally:
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
