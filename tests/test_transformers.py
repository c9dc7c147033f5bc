"""Hugging Face transformers models through weightcache.attach (weightcache/backends/transformers.py and
weightcache/loaders.py): tiny random models of eleven architectures (tests/hf_models.py), built on meta both ways
users build them (``from_config(config, dtype=...)`` as the README shows, and ``from_config(config)`` then
``.to(dtype)`` as PyTorch's guide shows), in modes off, daemon and client, each mode a new process
(tests/hf_worker.py)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_models  # noqa: E402

import weightcache as wc  # noqa: E402
from weightcache import loaders  # noqa: E402
from weightcache.pipeline import MAX_REASON  # noqa: E402
from weightcache.structure import structure_digest  # noqa: E402

HERE = Path(__file__).parent
ROOT = HERE.parent
MODES = ("off", "daemon", "client")
#: The ways tests/hf_worker.py builds each model on meta.
BUILDS = ("config", "to")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("hf")
    return {name: hf_models.save(name, directory) for name in hf_models.names()}


def worker(
    mode: str,
    socket_dir: Path,
    device: str,
    models: dict[str, Path],
    timeout: float = 400,
    env: dict[str, str] | None = None,
    builds: tuple[str, ...] = BUILDS,
) -> dict:
    """Run tests/hf_worker.py in a new process; return its results by ``architecture/build``. The Hub is off:
    nothing is downloaded (transformers' FP8 kernel included, whose absence the worker reports)."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", **(env or {})}
    out = subprocess.run(
        [sys.executable, str(HERE / "hf_worker.py"), mode, str(socket_dir), device, ",".join(builds)]
        + [f"{name}={path}" for name, path in models.items()],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert out.returncode == 0, f"mode {mode} failed:\n{out.stderr[-6000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_modes(models: dict[str, Path], socket_dir: Path, device: str) -> None:
    """Greedy tokens identical to transformers' own from_pretrained (``.to(dtype)``'d alike) in every mode, for
    both builds; served from the cache in modes daemon (after reading the disk once) and client (without reading
    it); nothing left on meta; computed buffers in the dtype the build gave them."""
    runs = {mode: worker(mode, socket_dir, device, models) for mode in MODES}
    for name in models:
        for how in BUILDS:
            key = f"{name}/{how}"
            got = {mode: runs[mode][key] for mode in MODES}
            assert [got[m]["source"] for m in MODES] == ["disk", "cache", "cache"], key
            # a second build of the same structure (no computed float32 buffers to convert: GPT-2) is a hit
            first = how == BUILDS[0] or got["daemon"]["digest"] != runs["daemon"][f"{name}/{BUILDS[0]}"]["digest"]
            assert [got[m]["read_disk"] for m in MODES] == [True, first, False], key
            assert all(got[m]["engine"] == "transformers" for m in MODES), key
            assert all(not got[m]["on_meta"] for m in MODES), (key, got)
            if how == "to":  # .to(bfloat16) converted the computed buffers (float32 as built); attach kept them so
                assert all(got[m]["computed"] in ([], ["torch.bfloat16"]) for m in MODES), (key, got)
            reference = got["off"]["reference"]
            assert len(reference) == len(got["off"]["tokens"]) > 5
            assert [got[m]["tokens"] for m in MODES] == [reference] * 3, key


def test_every_architecture_matches_transformers_in_every_mode(models: dict[str, Path], socket_dir: Path) -> None:
    check_modes(models, socket_dir, "cpu")


@pytest.mark.cuda
def test_every_architecture_matches_transformers_in_every_mode_on_gpu(
    models: dict[str, Path], socket_dir: Path
) -> None:
    check_modes(models, socket_dir, "cuda:0")


@pytest.mark.cuda
def test_a_block_fp8_model_through_transformers_fp8_path_on_gpu(tmp_path: Path, socket_dir: Path) -> None:
    """Weights in float8_e4m3fn with 32x32 block scales, as DeepSeek-V3 and Qwen3-FP8 ship: transformers' FP8
    quantizer substitutes FP8Linear modules and loads them; the entry (strategy fp8_block) holds the FP8 weights
    and scales; greedy tokens are identical in every mode and to transformers' own load."""
    models = {"qwen3-fp8": hf_models.save_fp8("qwen3", tmp_path)}
    runs = {mode: worker(mode, socket_dir, "cuda:0", models, builds=("config",))["qwen3-fp8/config"] for mode in MODES}
    assert [runs[m]["source"] for m in MODES] == ["disk", "cache", "cache"]
    assert [runs[m]["read_disk"] for m in MODES] == [True, True, False]
    assert all(runs[m]["quant"] == "fp8_block" and "torch.float8_e4m3fn" in runs[m]["dtypes"] for m in MODES), runs
    assert [runs[m]["tokens"] for m in MODES] == [runs["off"]["reference"]] * 3
    print("FP8 matmul:", runs["off"]["fp8_matmul"])


def test_a_block_fp8_model_on_cpu_is_dequantized_by_transformers(tmp_path: Path, socket_dir: Path) -> None:
    """On a CPU, transformers dequantizes block FP8 at load; the entry holds what it made, in every mode."""
    models = {"qwen3-fp8": hf_models.save_fp8("qwen3", tmp_path)}
    runs = {mode: worker(mode, socket_dir, "cpu", models, builds=("config",))["qwen3-fp8/config"] for mode in MODES}
    assert [runs[m]["source"] for m in MODES] == ["disk", "cache", "cache"]
    assert all(runs[m]["quant"] == "fp8_block" for m in MODES)
    assert [runs[m]["tokens"] for m in MODES] == [runs["off"]["reference"]] * 3


def meta_model(path: Path, **overrides: object) -> torch.nn.Module:
    config = transformers.AutoConfig.from_pretrained(path)
    for key, value in overrides.items():
        setattr(config, key, value)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def test_a_model_built_otherwise_is_a_miss_that_names_the_difference(models: dict[str, Path], socket_dir: Path) -> None:
    """Another configuration (here the RoPE base, which changes the computed inv_freq and no tensor's shape)
    and another structure (float32) miss the entry, and the fallback says which setting differs."""
    path = models["qwen3"]
    wc.attach(meta_model(path), path, mode="daemon", socket_dir=socket_dir).close()
    with wc.attach(meta_model(path), path, mode="client", socket_dir=socket_dir, strict=True) as handle:
        assert handle.source == "cache"

    config = transformers.AutoConfig.from_pretrained(path)
    rope = {**config.rope_parameters, "rope_theta": 500000.0}
    with pytest.warns(wc.FallbackWarning, match=r"extra\.transformers\.config\.rope_parameters\.rope_theta"):
        handle = wc.attach(meta_model(path, rope_parameters=rope), path, mode="client", socket_dir=socket_dir)
    assert handle.source == "disk"

    model = meta_model(path).to(torch.float32)
    with pytest.raises(wc.FingerprintMismatch, match=r"extra\.structure") as caught:
        wc.attach(model, path, mode="client", socket_dir=socket_dir, strict=True)
    assert "dtype" in {d[0] for d in caught.value.differences}


def test_weights_that_do_not_fit_the_model_are_never_published(models: dict[str, Path], socket_dir: Path) -> None:
    """What from_pretrained made is checked against the model before it is published: a model built in float32
    given dtype=bfloat16 is a BindError that names both dtypes, the keeper holds no entry afterwards, and the next
    model built right misses (and publishes) instead of meeting an entry no model can bind."""
    path = models["llama"]
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with pytest.raises(wc.BindError, match=r"dtype torch\.bfloat16 vs model torch\.float32"):
        wc.attach(model, path, mode="daemon", socket_dir=socket_dir, dtype=torch.bfloat16)
    assert wc.Cache(socket_dir).entries() == []
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(wc.EntryNotFound):
        wc.attach(meta_model(path), path, mode="client", socket_dir=socket_dir, strict=True)
    with wc.attach(meta_model(path), path, mode="daemon", socket_dir=socket_dir) as handle:
        assert handle.source == "cache" and handle.read_disk


def test_a_model_converted_on_meta_gets_its_computed_buffers_in_its_dtype(
    models: dict[str, Path], socket_dir: Path
) -> None:
    """``from_config`` on meta, then ``.to(dtype)`` (what PyTorch's guide shows): transformers computes rotary
    inv_freq in float32, the model now holds it in ``dtype``; every mode serves the values transformers computes,
    converted as the model's own ``.to()`` would (here float16, not the checkpoint's bfloat16). The model comes
    back in evaluation mode, as from ``from_pretrained`` (``from_config`` builds it in training mode)."""
    path = models["llama"]
    config = transformers.AutoConfig.from_pretrained(path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path).to(torch.float16)
    for mode in MODES:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float16)
        with wc.attach(model, path, mode=mode, socket_dir=socket_dir, strict=mode == "client") as handle:
            assert handle.source == ("disk" if mode == "off" else "cache")
            inv_freq = model.model.rotary_emb.inv_freq
            assert inv_freq.dtype == torch.float16 and torch.equal(inv_freq, reference.model.rotary_emb.inv_freq)
            assert all(p.dtype == torch.float16 for p in model.parameters())
            assert not any(m.training for m in model.modules())  # evaluation mode, as from_pretrained leaves it


def load_cli(*args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **extra_env}
    return subprocess.run(
        [sys.executable, "-m", "weightcache", "load", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_weightcache_load_engine_transformers_makes_the_entry_a_model_attaches(
    models: dict[str, Path], socket_dir: Path
) -> None:
    """`weightcache load` makes a plain module's entry, which a transformers model misses with a one-line reason
    that names the option; `--engine transformers` makes the entry that the README's model attaches."""
    path = models["qwen2"]
    # switched off, it refuses as the plain load does (it read the checkpoint and said "published" before)
    off = load_cli(str(path), "--engine", "transformers", "--socket-dir", str(socket_dir), WEIGHTCACHE_MODE="off")
    assert off.returncode == 1 and "WEIGHTCACHE_MODE=off" in off.stderr and not off.stdout, off
    assert not socket_dir.exists() or wc.Cache(socket_dir).entries() == []
    plain = load_cli(str(path), "--socket-dir", str(socket_dir))
    assert plain.returncode == 0 and plain.stdout.startswith("published "), plain.stderr
    with pytest.raises(wc.FingerprintMismatch) as caught:
        wc.attach(meta_model(path), path, mode="client", socket_dir=socket_dir, strict=True)
    reason = str(caught.value)
    assert "engine: requested 'transformers', cached 'torch'" in reason and "--engine transformers" in reason
    assert "\n" not in reason and len(reason) <= MAX_REASON, reason  # the configuration's diff is cut short

    out = load_cli(str(path), "--engine", "transformers", "--socket-dir", str(socket_dir))
    assert out.returncode == 0 and out.stdout.startswith("published ") and "Qwen2ForCausalLM" in out.stdout, out
    again = load_cli(str(path), "--engine", "transformers", "--dtype", "bf16", "--socket-dir", str(socket_dir))
    assert again.stdout.startswith(f"already cached: {out.stdout.split()[1]}"), again  # the config's dtype: the same
    with wc.attach(meta_model(path), path, mode="client", socket_dir=socket_dir, strict=True) as handle:
        assert handle.source == "cache" and not handle.read_disk and handle.fingerprint.engine == "transformers"
    refused = load_cli(str(path), "--engine", "transformers", "--quant", "fp8_block", "--socket-dir", str(socket_dir))
    assert refused.returncode == 1 and "leave out --quant" in refused.stderr


def test_load_engine_transformers_of_a_checkpoint_it_cannot_build_is_one_line(
    checkpoint: Path, socket_dir: Path, tmp_path: Path
) -> None:
    """`load --engine transformers` of a path that does not exist, of a directory without config.json and of a
    config.json transformers cannot read: a CheckpointError, printed as one line (`weightcache load: ...`, what was
    expected, what was found, what to do), exit status 1, no traceback, nothing started."""
    missing = tmp_path / "missing"
    out = load_cli(str(missing), "--engine", "transformers", "--socket-dir", str(socket_dir))
    assert out.returncode == 1 and "Traceback" not in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith(f"weightcache load: checkpoint {missing} does not exist; pass "), out.stderr

    (checkpoint / "config.json").rename(tmp_path / "config.json")  # a plain module's checkpoint: no config.json
    out = load_cli(str(checkpoint), "--engine", "transformers", "--socket-dir", str(socket_dir))
    assert out.returncode == 1 and "Traceback" not in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith(f"weightcache load: checkpoint directory {checkpoint} has no config.json"), out
    assert "found model.safetensors" in out.stderr and "save_pretrained" in out.stderr, out.stderr

    (tmp_path / "config.json").rename(checkpoint / "config.json")  # model_type "tiny": not a transformers model
    out = load_cli(str(checkpoint), "--engine", "transformers", "--socket-dir", str(socket_dir))
    assert out.returncode == 1 and "Traceback" not in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith(f"weightcache load: transformers cannot read {checkpoint / 'config.json'}: "), out
    assert "model type `tiny`" in out.stderr, out.stderr
    assert not socket_dir.exists()  # refused before any keeper was started


def test_the_structure_digest_is_the_same_in_every_process(models: dict[str, Path]) -> None:
    code = textwrap.dedent(
        """
        import sys, torch, transformers
        from weightcache.structure import structure_digest
        config = transformers.AutoConfig.from_pretrained(sys.argv[1])
        with torch.device("meta"):
            print(structure_digest(transformers.AutoModelForCausalLM.from_config(config)))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    digests = {
        subprocess.run(
            [sys.executable, "-c", code, str(models["mixtral"])], capture_output=True, text=True, env=env, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    assert len(digests) == 1 and digests == {structure_digest(meta_model(models["mixtral"]))}
    assert structure_digest(meta_model(models["mixtral"], num_local_experts=8)) not in digests


def test_each_start_logs_one_line(models: dict[str, Path], socket_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = models["gpt2"]
    caplog.set_level(logging.INFO, logger="weightcache")
    wc.attach(meta_model(path), path, mode="daemon", socket_dir=socket_dir).close()
    wc.attach(meta_model(path), path, mode="client", socket_dir=socket_dir).close()
    lines = [r.getMessage() for r in caplog.records if r.name == "weightcache"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("weightcache: miss, published (mode daemon)") and " MiB in " in lines[0]
    assert lines[1].startswith("weightcache: hit (mode client)") and " ms" in lines[1]


def test_from_pretrained_helper(models: dict[str, Path], socket_dir: Path) -> None:
    from weightcache.backends.transformers import from_pretrained

    path = models["llama"]
    reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([[1, 17, 42]])
    expected = reference.generate(ids, max_new_tokens=6, do_sample=False)
    for mode in ("daemon", "client"):
        model = from_pretrained(path, mode=mode, socket_dir=socket_dir, strict=mode == "client")
        assert model.weightcache_handle.source == "cache" and not model.training
        assert model.lm_head.weight is model.model.embed_tokens.weight  # tied weights stay tied
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), expected)


@pytest.mark.parametrize(
    ("quantization_config", "strategy"),
    [
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}, "fp8_block"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8_per_tensor"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "gptq"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, "awq"),
    ],
)
def test_quantization_configs_map_onto_strategies(quantization_config: dict, strategy: str) -> None:
    from weightcache.backends.transformers import quant_spec

    method, config = quant_spec(quantization_config)
    assert method == strategy and config is not None and config["quant_method"] == quantization_config["quant_method"]
    refused = wc.quant.get(method).ipc_safe is False
    assert refused == (strategy != "fp8_block")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", ["bitsandbytes", "gptq", "awq"])
def test_refused_quantization_raises_before_anything_loads(
    models: dict[str, Path], socket_dir: Path, tmp_path: Path, mode: str, method: str
) -> None:
    """bitsandbytes (no strategy), GPTQ and AWQ (strategies that refuse them) raise in every mode, before a
    keeper starts or a tensor is read (the checkpoint here has a config and no tensors at all)."""
    config = json.loads((models["llama"] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    model = meta_model(models["llama"])
    model.config.quantization_config = config["quantization_config"]
    expected = "no weightcache strategy" if method == "bitsandbytes" else "cannot be shared"
    with pytest.raises(wc.UnsupportedQuantError, match=expected):
        wc.attach(model, tmp_path, mode=mode, socket_dir=socket_dir)  # type: ignore[arg-type]
    assert not socket_dir.exists()
    assert all(p.is_meta for p in model.parameters())


def test_a_quant_argument_that_contradicts_the_configuration_is_refused(models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="configuration says 'none'"):
        wc.attach(meta_model(models["gpt2"]), models["gpt2"], quant="fp8_block")


def test_plain_modules_have_no_loader() -> None:
    assert loaders.for_model(torch.nn.Linear(2, 2)) is None
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(hf_models.config("gpt2"))
    assert loaders.for_model(model).name == "transformers"  # type: ignore[union-attr]
