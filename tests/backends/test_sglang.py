"""The SGLang adapter against the real `sglang` package, at its loader layer (SGLang cannot run an engine on
this CPU): the model WeightCacheLoader attaches, as daemon and as client in a new process, equals what SGLang's
own DefaultModelLoader loads, tensor by tensor (weightcache parity: name, shape, dtype, stride, bytes).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from engines import failing_publish, require_engine

require_engine("sglang")

import weightcache as wc  # noqa: E402
from weightcache import parity  # noqa: E402
from weightcache.backends import sglang_releases  # noqa: E402
from weightcache.backends.sglang import SglangBackend, WeightCacheLoader, uncounted_preload_warning  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from engine_models import make_tiny_deepseek_v2, make_tiny_llama  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def run_sglang(spec: dict, timeout: float = 300) -> dict:
    out = subprocess.run(
        [sys.executable, str(HERE / "sglang_worker.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    results = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not results:
        raise AssertionError(f"SGLang worker failed ({out.returncode}):\n{out.stderr[-6000:]}\n{out.stdout[-2000:]}")
    return json.loads(results[-1].removeprefix("RESULT "))


def attach_warnings(result: dict) -> list[str]:
    """The warnings a load that attached weights resident before it began gets from this SGLang: none where SGLang
    counts ``preloaded_weights_bytes`` (0.5.19 on); before, the one saying its KV cache keeps less headroom."""
    if result["preloaded_weights_bytes"] == 0 or sglang_releases.counts_preloaded_bytes():
        return []
    return [f"UserWarning: {uncounted_preload_warning(result['preloaded_weights_bytes'])}"]


def cli_parity(left: Path, right: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "weightcache", "parity", str(left), str(right)], capture_output=True, text=True
    )


def test_attached_model_equals_sglangs_own_load_tensor_by_tensor(
    tiny_llama: Path, socket_dir: Path, tmp_path: Path
) -> None:
    options = {"socket_dir": str(socket_dir)}
    disk = run_sglang({"model": str(tiny_llama), "table": str(tmp_path / "disk.json"), "loader": "default"})
    assert disk["loader"] == "DefaultModelLoader" and disk["resident_after_load"] > 0.9

    daemon = run_sglang(
        {
            "model": str(tiny_llama),
            "table": str(tmp_path / "daemon.json"),
            "loader": "weightcache",
            "options": {**options, "mode": "daemon"},
        }
    )
    assert daemon["source"] == "cache"
    [entry] = wc.Cache(socket_dir).entries()
    assert entry.fingerprint.engine == "sglang"
    axes = {axis for axis, _, _ in entry.fingerprint.parallel}
    assert {"tp", "pp", "ep", "attn_dp"} <= axes
    assert ("tp", 0, 1) in entry.fingerprint.parallel
    # published during this load_model: the segments were allocated after SGLang's pre-load memory baseline
    assert daemon["preloaded_weights_bytes"] == 0

    client = run_sglang(
        {
            "model": str(tiny_llama),
            "table": str(tmp_path / "client.json"),
            "loader": "weightcache",
            "options": {**options, "mode": "client", "strict": True},
            "evict": True,
        }
    )
    assert client["source"] == "cache" and client["warnings"] == attach_warnings(client)
    assert client["resident_after_load"] < 0.05, client  # only the header was read, for the fingerprint
    assert client["preloaded_weights_bytes"] == entry.bytes  # resident before the baseline: counted as loaded

    disk_table = parity.read_table(tmp_path / "disk.json")
    assert len(disk_table) == 17 and "model.layers.1.self_attn.rotary_emb.cos_sin_cache" in disk_table
    for name in ("daemon", "client"):
        assert parity.compare(disk_table, parity.read_table(tmp_path / f"{name}.json")) == []
        result = cli_parity(tmp_path / "disk.json", tmp_path / f"{name}.json")
        assert result.returncode == 0 and "identical" in result.stdout, result.stdout + result.stderr


def test_mla_model_attaches_with_the_tensors_post_load_weights_derives(socket_dir: Path, tmp_path: Path) -> None:
    """DeepSeek-V2's MLA attention keeps ``w_kc``/``w_vc`` (split from ``kv_b_proj`` by ``post_load_weights``)
    as plain attributes: they are published, and a client's meta-built model gets them set, layout included."""
    model = make_tiny_deepseek_v2(tmp_path / "tiny-ds2")
    options = {"socket_dir": str(socket_dir)}
    run_sglang({"model": str(model), "table": str(tmp_path / "disk.json"), "loader": "default"})
    for mode in ("daemon", "client"):
        spec = {"model": str(model), "table": str(tmp_path / f"{mode}.json"), "loader": "weightcache"}
        result = run_sglang({**spec, "options": {**options, "mode": mode, "strict": True}})
        assert result["source"] == "cache" and result["warnings"] == attach_warnings(result), result
    disk_table = parity.read_table(tmp_path / "disk.json")
    for layer in (0, 1):
        w_kc = disk_table[f"model.layers.{layer}.self_attn.w_kc"]
        assert w_kc.kind == "attribute" and w_kc.shape == (2, 32, 32)
    for mode in ("daemon", "client"):
        assert parity.compare(disk_table, parity.read_table(tmp_path / f"{mode}.json")) == []


def test_a_layout_setting_outside_the_identity_is_a_miss_naming_the_structure(
    tiny_llama: Path, socket_dir: Path, tmp_path: Path
) -> None:
    """The structure of the model SGLang built joins the fingerprint: a load whose adapter builds the model in
    another layout (bfloat16, a change the identity does not record: ``other_layout`` in sglang_worker.py; SGLang's
    own ``model_impl="transformers"`` would be one, but it materialises its parameters on an accelerator and cannot
    be built on meta here) misses the entry, with a FallbackWarning that names ``extra.structure``, and is SGLang's
    own load from disk (tensor by tensor); strict, it raises. It never attaches the entry."""
    options = {"socket_dir": str(socket_dir)}
    spec = {"model": str(tiny_llama), "loader": "weightcache"}
    daemon = run_sglang({**spec, "table": str(tmp_path / "daemon.json"), "options": {**options, "mode": "daemon"}})
    assert daemon["source"] == "cache"
    [entry] = wc.Cache(socket_dir).entries()
    assert len(json.loads(entry.fingerprint.extra)["structure"]) == 64
    other = {**spec, "other_layout": True, "table": str(tmp_path / "other.json")}
    result = run_sglang({**other, "options": {**options, "mode": "client"}})
    assert result["source"] == "disk" and len(result["warnings"]) == 1, result
    assert "FallbackWarning" in result["warnings"][0] and "extra.structure: requested" in result["warnings"][0]
    run_sglang({"model": str(tiny_llama), "loader": "default", "table": str(tmp_path / "disk.json")})
    assert parity.compare(*(parity.read_table(tmp_path / f) for f in ("disk.json", "other.json"))) == []
    with pytest.raises(AssertionError, match=r"FingerprintMismatch: .*extra\.structure"):
        run_sglang({**other, "options": {**options, "mode": "client", "strict": True}})
    assert [e.digest for e in wc.Cache(socket_dir).entries()] == [entry.digest]


def test_launch_server_takes_load_format_weightcache(tiny_llama: Path, socket_dir: Path, tmp_path: Path) -> None:
    """The ``sglang.srt.plugins`` entry point: after SGLang loads its plugins (as ``sglang.launch_server`` does
    first), ``--load-format weightcache --model-loader-extra-config '{...}'`` parses and loads through
    WeightCacheLoader, daemon then client, with the same tensors as SGLang's own load."""
    options = {"socket_dir": str(socket_dir)}
    run_sglang({"model": str(tiny_llama), "table": str(tmp_path / "disk.json"), "loader": "default"})
    for mode in ("daemon", "client"):
        spec = {"model": str(tiny_llama), "table": str(tmp_path / f"{mode}.json"), "loader": "launch_server"}
        result = run_sglang({**spec, "options": {**options, "mode": mode, "strict": True}})
        assert result["loader"] == "WeightCacheLoader" and result["source"] == "cache", result
    disk_table = parity.read_table(tmp_path / "disk.json")
    for mode in ("daemon", "client"):
        assert parity.compare(disk_table, parity.read_table(tmp_path / f"{mode}.json")) == []


def test_attached_bytes_count_in_the_calling_model_runners_memory_baseline(
    tiny_llama: Path, socket_dir: Path, tmp_path: Path
) -> None:
    """Loaded from ``load_model`` of SGLang's own ModelRunner class, as in an engine, a client's attached bytes
    count in the runner's pre-load memory baseline (``pre_model_load_memory``, GB), so its KV cache is sized as
    after a disk load: added by the adapter where SGLang does not count ``preloaded_weights_bytes`` itself (0.5.16
    to 0.5.18), left to SGLang where it does (0.5.19 on); no warning either way, and a reload does not add them
    twice. A daemon's load that published (nothing resident before it) adds nothing."""
    if sglang_releases.counts_preloaded_bytes():
        pytest.skip(
            "this SGLang counts preloaded_weights_bytes itself (0.5.19 on): the adapter adds nothing, and its "
            "ModelRunner module needs the whole engine's dependencies (uvicorn), which the loader-layer env lacks"
        )
    options = {"socket_dir": str(socket_dir)}
    baseline = 100.0
    spec = {"model": str(tiny_llama), "loader": "weightcache", "runner": baseline}
    daemon = run_sglang({**spec, "table": str(tmp_path / "daemon.json"), "options": {**options, "mode": "daemon"}})
    assert daemon["source"] == "cache" and daemon["preloaded_weights_bytes"] == 0, daemon
    assert daemon["pre_model_load_memory"] == baseline and daemon["warnings"] == []
    [entry] = wc.Cache(socket_dir).entries()

    client_options = {**options, "mode": "client", "strict": True}
    client = run_sglang({**spec, "table": str(tmp_path / "client.json"), "options": client_options, "runner_loads": 2})
    assert client["source"] == "cache" and client["preloaded_weights_bytes"] == entry.bytes > 0, client
    assert client["warnings"] == []
    counted_by_sglang = sglang_releases.counts_preloaded_bytes()
    expected = baseline if counted_by_sglang else baseline + entry.bytes / (1 << 30)
    assert client["pre_model_load_memory"] == pytest.approx(expected, abs=1e-9), (counted_by_sglang, client)
    assert parity.compare(*(parity.read_table(tmp_path / f) for f in ("daemon.json", "client.json"))) == []


def test_parity_reports_a_different_checkpoint(tiny_llama: Path, tmp_path: Path) -> None:
    other = make_tiny_llama(tmp_path / "other", seed=1)
    run_sglang({"model": str(tiny_llama), "table": str(tmp_path / "a.json"), "loader": "default"})
    run_sglang({"model": str(other), "table": str(tmp_path / "b.json"), "loader": "default"})
    result = cli_parity(tmp_path / "a.json", tmp_path / "b.json")
    assert result.returncode == 1
    assert "model.layers.0.self_attn.qkv_proj.weight: sha256" in result.stdout


def test_client_without_keeper_falls_back_to_sglangs_own_load(
    tiny_llama: Path, socket_dir: Path, tmp_path: Path
) -> None:
    result = run_sglang(
        {
            "model": str(tiny_llama),
            "table": str(tmp_path / "fallback.json"),
            "loader": "weightcache",
            "options": {"socket_dir": str(socket_dir), "mode": "client"},
        }
    )
    assert result["source"] == "disk" and result["preloaded_weights_bytes"] == 0
    assert len(result["warnings"]) == 1 and "no keeper" in result["warnings"][0]
    assert not socket_dir.exists()


@pytest.mark.parametrize("failure", ["budget", "allocation"])
def test_publish_failure_after_the_load_serves_the_loaded_weights(
    tiny_llama: Path, socket_dir: Path, tmp_path: Path, failure: str
) -> None:
    """Mode daemon loads, post-processes, then cannot publish: the engine gets what it loaded, and is told why."""
    options = {"socket_dir": str(socket_dir), "mode": "daemon"}
    with failing_publish(socket_dir, failure) as (worker, expected):
        table = str(tmp_path / "fallback.json")
        result = run_sglang(
            {"model": str(tiny_llama), "table": table, "loader": "weightcache", "options": options, **worker}
        )
        assert result["source"] == "disk" and result["preloaded_weights_bytes"] == 0
        assert len(result["warnings"]) == 1, result
        assert "FallbackWarning" in result["warnings"][0] and expected in result["warnings"][0]
        assert wc.Cache(socket_dir).entries() == []
        run_sglang({"model": str(tiny_llama), "table": str(tmp_path / "disk.json"), "loader": "default"})
        assert parity.compare(*(parity.read_table(tmp_path / f) for f in ("disk.json", "fallback.json"))) == []


# --- in this process: options and quantization (no model is loaded) ---------------------------------------------


def test_options_come_from_extra_config_or_configure() -> None:
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import get_model_loader

    loader = get_model_loader(LoadConfig(load_format=WeightCacheLoader, model_loader_extra_config={"mode": "client"}))
    assert isinstance(loader, WeightCacheLoader) and loader.options.mode == "client"
    configured = WeightCacheLoader.configure(mode="client", strict=True, socket_dir="/tmp/s")
    loader = get_model_loader(LoadConfig(load_format=configured))
    assert loader.options == wc.backends.LoaderOptions(mode="client", socket_dir="/tmp/s", strict=True)
    with pytest.raises(wc.BackendConfigError, match="unknown key"):
        get_model_loader(LoadConfig(load_format=WeightCacheLoader, model_loader_extra_config={"mod": "client"}))
    with pytest.raises(wc.BackendConfigError, match="mode must be one of"):
        WeightCacheLoader.configure(mode="off")


def test_quant_configs_map_to_strategies_and_refusals_raise() -> None:
    from sglang.srt.layers.quantization import get_quantization_config

    backend = SglangBackend()
    fp8 = get_quantization_config("fp8")
    block = backend.check_quant(fp8(is_checkpoint_fp8_serialized=True, weight_block_size=[128, 128]))
    assert block.method == "fp8_block"
    with pytest.raises(wc.UnsupportedQuantError, match="fp8_per_tensor"):
        backend.check_quant(fp8(is_checkpoint_fp8_serialized=True))
    awq = get_quantization_config("awq").from_config({"bits": 4, "group_size": 128, "zero_point": True})
    with pytest.raises(wc.UnsupportedQuantError, match="'awq' cannot be shared"):
        backend.check_quant(awq)
    w8a8 = get_quantization_config("w8a8_int8").from_config({})
    with pytest.raises(wc.UnsupportedQuantError, match="'w8a8_int8' has no weightcache strategy"):
        backend.check_quant(w8a8)
    # An fp8 config whose routed experts run MXFP4 kernels (SGLang sets is_fp4_experts from the checkpoint's
    # routed_experts_quant_method): the experts are not block FP8, so it is refused, not mapped to fp8_block.
    mixed = fp8(is_checkpoint_fp8_serialized=True, weight_block_size=[128, 128], is_fp4_experts=True)
    with pytest.raises(wc.UnsupportedQuantError, match="MXFP4"):
        backend.check_quant(mixed)


def test_refused_quant_raises_before_anything_is_loaded(tiny_llama: Path, tmp_path: Path) -> None:
    import torch
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig

    sys.path.insert(0, str(HERE / "sglang_shims"))  # SGLang's model registry imports it (see sglang_worker.py)
    model_config = ModelConfig(model_path=str(tiny_llama), dtype="float16")
    model_config.quantization = "awq"  # as if the checkpoint were AWQ-quantized
    model_config.dtype = torch.float16
    model_config.hf_config.quantization_config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 128,
        "zero_point": True,
    }
    socket_dir = tmp_path / "never"
    for mode in ("daemon", "client"):
        loader = WeightCacheLoader.configure(mode=mode, socket_dir=socket_dir)(LoadConfig(load_format="auto"))
        with pytest.raises(wc.UnsupportedQuantError, match="'awq' cannot be shared"):
            loader.load_model(model_config=model_config, device_config=DeviceConfig("cpu"))
    assert not socket_dir.exists()  # no keeper was started, nothing was read


def test_fp8_with_fp4_experts_is_refused_before_anything_is_loaded(tiny_llama: Path, tmp_path: Path) -> None:
    """A checkpoint declared fp8 whose routed experts are MXFP4 (``routed_experts_quant_method``): SGLang runs
    those experts with FP4 kernels, so the loader refuses it in both modes, before reading or spawning."""
    import shutil

    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig

    sys.path.insert(0, str(HERE / "sglang_shims"))  # SGLang's model registry imports it (see sglang_worker.py)
    mixed = tmp_path / "mixed"
    shutil.copytree(tiny_llama, mixed)
    config = json.loads((mixed / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "routed_experts_quant_method": "mxfp4",
    }
    (mixed / "config.json").write_text(json.dumps(config))
    model_config = ModelConfig(model_path=str(mixed), dtype="bfloat16")
    if not model_config.is_fp4_experts:
        pytest.skip(
            "this SGLang does not read routed_experts_quant_method (0.5.16 and 0.5.17 mark FP4 experts only for "
            "DeepSeek-V4's layout; 0.5.20 on read the key), so it runs these experts as FP8: nothing to refuse"
        )
    socket_dir = tmp_path / "never"
    for mode in ("daemon", "client"):
        loader = WeightCacheLoader.configure(mode=mode, socket_dir=socket_dir)(LoadConfig(load_format="auto"))
        with pytest.raises(wc.UnsupportedQuantError, match="MXFP4 kernels"):
            loader.load_model(model_config=model_config, device_config=DeviceConfig("cpu"))
    assert not socket_dir.exists()


def test_a_quantized_checkpoint_is_described_the_same_after_sglang_built_its_quant_config(
    tiny_llama: Path, tmp_path: Path
) -> None:
    """SGLang 0.5.17's ``get_quant_config`` writes the HF config itself into the checkpoint's own
    ``quantization_config`` dict: describing the model after that must neither fail (it did: JSON cannot hold the
    config, and the engine loaded from disk) nor differ from the description before it."""
    import shutil

    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import _get_quantization_config

    from weightcache.backends.sglang import model_identity

    sys.path.insert(0, str(HERE / "sglang_shims"))  # SGLang's model registry imports it (see sglang_worker.py)
    fp8 = tmp_path / "fp8"
    shutil.copytree(tiny_llama, fp8)
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (fp8 / "config.json").write_text(json.dumps(config))
    load_config = LoadConfig(load_format="auto")
    first = ModelConfig(model_path=str(fp8), dtype="bfloat16")
    before = model_identity(first, load_config)
    later = ModelConfig(model_path=str(fp8), dtype="bfloat16")
    _get_quantization_config(later, load_config)  # as SGLang's own loader does before weightcache is asked
    assert model_identity(later, load_config) == before
    assert before["hf_config"]["quantization_config"] == config["quantization_config"]


def test_load_format_choices_name_every_place_looked_in(monkeypatch: pytest.MonkeyPatch) -> None:
    choices, add = sglang_releases.load_format_choices()
    assert "auto" in choices and callable(add)
    monkeypatch.setattr(
        sglang_releases, "LOAD_FORMAT_CHOICES_API", (("sglang.srt.no_such_module", "CHOICES", "add_choices"),)
    )
    with pytest.raises(ImportError, match=r"none of sglang\.srt\.no_such_module\.add_choices .*LoadConfig"):
        sglang_releases.load_format_choices()


def test_a_model_with_views_to_rebuild_loads_from_disk_where_sglang_has_no_helper(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where SGLang has no ``IpcModelLoader._rebuild_stale_views`` (0.5.16), a model whose
    ``RadixLinearAttention`` layers keep views of their weights is not served cached weights (its views would
    point at meta storage): ``cannot_serve`` names the layers, and the load is SGLang's own, with a
    FallbackWarning. Where SGLang has the helper, it is served."""
    import torch.nn as nn
    from sglang.srt.layers.radix_linear_attention import RadixLinearAttention

    attn = RadixLinearAttention.__new__(RadixLinearAttention)
    nn.Module.__init__(attn)
    model = nn.Module()
    model.add_module("layer", nn.Module())
    model.layer.add_module("attn", attn)
    backend = SglangBackend()
    has_helper = sglang_releases.stale_views_rebuilder() is not None
    assert (backend.cannot_serve(model, None) is None) == has_helper
    monkeypatch.setattr(sglang_releases, "stale_views_rebuilder", lambda: None)
    reason = backend.cannot_serve(model, None)
    assert reason is not None and "1 RadixLinearAttention layers (e.g. layer.attn)" in reason
    assert backend.cannot_serve(nn.Linear(2, 2), None) is None
