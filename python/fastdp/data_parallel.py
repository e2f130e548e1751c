"""``fastdp.DataParallel`` and ``fastdp.data_parallel``: drop-in replacements for torch.nn's, on fastdp.comm.

Same constructor, attributes, overridable ``scatter``/``replicate``/``parallel_apply``/``gather`` (called through
``self``) and errors as ``torch.nn.DataParallel`` (see docs/data_parallel.md). Additions: ``device_ids=["cpu"] * N``
runs N emulated replicas on the host; ``state_dict()`` has no ``module.`` prefix and ``load_state_dict`` accepts
both forms; attributes the wrapper lacks are read from the wrapped module.
"""

import contextlib
import sys
import threading
import warnings

import torch
from torch.nn.modules import Module

from ._wrapper import batch_major as _batch_major, call as _call, checkpoint as _checkpoint, checks as _checks
from ._wrapper import launch as _launch
from ._wrapper import upstream as _upstream
from ._native import fallback as _fallback
from ._platform import compiler as _compiler, devices as _devices, interrupts as _interrupts, streams as _streams
from ._step import idle_master as _idle_master, replicas as _replicas, step as _step
from ._balance import memory as _memory, rescue as _rescue, replica_loss as _replica_loss, split as _split
from ._report import recorder as _recorder, report as _report
from . import sync_batchnorm
from . import parallel_apply as _parallel_apply
from .parallel_apply import parallel_apply
from .replicate import replicate
from .scatter_gather import gather, scatter_kwargs

__all__ = ["DataParallel", "data_parallel"]


# forward enters record_function("DataParallel.forward") only while a profiler records (torch.profiler,
# torch.autograd.profiler, emit_nvtx/emit_itt): entering it costs more per forward + backward, even with no
# profiler, than the rest of the wrapper's own work (docs/benchmarks.md). Two cheap queries: torch's Python flag
# (set by its profiler start callbacks, global profiling included) and the C query of this thread's profiler state.
# A torch without either always records. The flag is read as an attribute of its module: no call per forward.
_profiler_module = torch.autograd.profiler
if not hasattr(_profiler_module, "_is_profiler_enabled"):
    _profiler_module = type("NoFlag", (), {"_is_profiler_enabled": False})
_profiler_enabled = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None) or (lambda: True)
_grad_enabled = torch.is_grad_enabled
# The innermost torch.func transform running in this thread (None outside any).
_transform_active = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None) or (lambda: None)


# What torch.compile keeps on the module it wraps: never answered from a wrapped compiled module, or compiling the
# wrapper itself would find them on it and refuse ("already has a get_compiler_config attribute").
_COMPILE_ATTRIBUTES = frozenset({"get_compiler_config", "dynamo_ctx", "_orig_mod", "_torchdynamo_orig_callable",
                                 "_torchdynamo_wrapper_id", "_torchdynamo_inline"})


def _run_single(module, args, kwargs, loss):
    """One device: the module on its one chunk (and the criterion on the target, the last argument)."""
    if loss is None:
        return module(*args, **kwargs)
    *args, target = args
    return loss.criterion(module(*args, **kwargs), target)


class DataParallel(_upstream.UPSTREAM):
    """A drop-in replacement for ``torch.nn.DataParallel``: the same constructor, attributes, overridable methods
    (``scatter``, ``replicate``, ``parallel_apply``, ``gather``, called through ``self``), errors and results; the data
    movement of each step runs in fastdp's C core (docs/data_parallel.md lists every difference).

    Each forward splits the batch along ``dim`` across ``device_ids``, runs a replica of the module on each device and
    gathers the outputs on ``output_device``; backward sums the gradients onto the module's own parameters on
    ``device_ids[0]``, each gradient bucket's sum starting while backward still runs. The replicas persist between
    steps: built at the first forward, they get the module's current values at every later one (one prepared copy,
    or an NCCL broadcast across GPUs), and the module's own tensors stay where you put them. With no GPU visible and
    no ``device_ids``, every call runs the module directly, as upstream's does.

    Arguments (torch.nn.DataParallel's, then fastdp's keyword-only ones):

    - ``module``: the ``nn.Module`` to run. Attributes the wrapper lacks are read from it (the wrapper's own win:
      ``dp.module.x`` reaches a model's ``x`` that the wrapper also has).
    - ``device_ids=None``: CUDA devices (ints or ``"cuda:k"``; by default every visible GPU), or ``["cpu"] * N`` for
      N emulated replicas on the host: the same code path without a GPU (they run one after another).
    - ``output_device=None``: where the outputs are gathered (``device_ids[0]`` by default).
    - ``dim=0``: the dimension the inputs are split along and the outputs gathered along.
    - ``mode='auto'``: under torchrun (WORLD_SIZE > 1) or with a default process group, builds a
      ``fastdp.DistributedDataParallel`` instead; ``"single"`` or ``"distributed"`` force the choice
      (docs/distributed.md).
    - ``bucket_cap_mb=25``: the size of the gradient buckets in MiB; each bucket's sum starts once its gradients
      exist.
    - ``chunk_sizes=None``: how each batch is split. None: torch.chunk's rule, as upstream; a list of ints (sizes
      that add up to the batch), a list of floats (weights), a float (device 0's share, the others 1), or
      ``"auto"`` (measured: device 0's memory, then the replicas' times) (docs/balance.md). ``dp.batch_split``
      shows the last forward's split.
    - ``criterion=None``: a loss; ``dp(x, target=y)`` then returns the loss, computed on each replica where that is
      exact (torch's own loss classes), so that only scalars travel to device 0. A training forward without
      ``target=`` warns once (the criterion does not run); without grad or in eval mode it returns the outputs.
    - ``criterion_reduction=None``: ``"mean"`` or ``"sum"`` declares another criterion decomposable over the batch.
    - ``broadcast=None``: names of keyword arguments every replica gets whole instead of split (a ``(T, T)`` mask).
    - ``report=False``: ``True`` (the last 20 steps) or N records the steps for ``dp.report()`` (docs/report.md);
      off, recording costs nothing.
    - ``oom=None``: ``"rebalance"``: an out-of-memory error in a replica moves rows away from its device and runs
      the step again, gradients unchanged (``dp.train_step`` rescues the backward too).

    Beyond upstream: ``state_dict()`` has no ``module.`` prefix and ``load_state_dict`` accepts both forms;
    ``no_sync()`` keeps each replica's gradients apart until a backward outside it, as DDP's does; ``report()``,
    ``enable_report()``, ``disable_report()``, ``train_step()`` and ``batch_split`` are described where they are
    defined.
    """

    def __new__(cls, *args, **kwargs):
        # Picks the class (docs/distributed.md); __init__ then runs on it with the same arguments. Unpickling and
        # copy.deepcopy call cls.__new__(cls) without arguments: they keep cls and never look at the environment.
        if args or kwargs:
            cls = _launch.choose_class(cls, kwargs.get("mode", "auto"), DataParallel, DataParallel._launch_class)
        return super().__new__(cls)

    def __init_subclass__(cls, distributed_launch=False, **kwargs):
        # fastdp.distributed's DistributedDataParallel declares itself with distributed_launch=True: the class that
        # __new__ builds in a distributed launch, known here without importing that module (which imports this one).
        super().__init_subclass__(**kwargs)
        if distributed_launch:
            DataParallel._launch_class = cls

    def __init__(self, module, device_ids=None, output_device=None, dim=0, *, mode="auto", bucket_cap_mb=25,
                 chunk_sizes=None, criterion=None, criterion_reduction=None, broadcast=None, report=False, oom=None):
        """Wraps ``module``; each argument is described in the class's docstring (``help(fastdp.DataParallel)``)."""
        Module.__init__(self)  # not torch.nn.DataParallel's (see NOTE [nn.DataParallel subclass])
        _checks.require_module(module, "DataParallel")
        if criterion is not None and not callable(criterion):
            raise TypeError(f"criterion must be callable (e.g. nn.CrossEntropyLoss()), got {type(criterion).__name__}")
        # Kept out of the module tree (not a submodule): the wrapper's state_dict and parameters stay the model's.
        _replica_loss.check_declared(criterion_reduction, criterion)
        self.__dict__["_criterion"] = criterion
        self._criterion_reduction = criterion_reduction
        self._broadcast = _split.parse_broadcast(broadcast)
        self._split = None  # the chunk_sizes rule (fastdp._balance.split), None for torch.chunk's
        self._last_step = None  # what the last forward found (fastdp._step.Outcome): its chunk sizes…
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}")
        self._bucket_bytes = max(1, int(bucket_cap_mb * 2**20))
        self.__dict__["_recording"] = _recorder.Recording(_recorder.parse_steps(report))  # whether steps are recorded
        self.__dict__["_oom"] = _rescue.parse(oom)
        self._replica_set = None  # persistent replicas (fastdp._step.replicas), built on first use
        self.__dict__["_forward_lock"] = threading.Lock()  # one forward at a time uses the kept replicas
        self._sync_enabled = True
        torch._C._log_api_usage_once("fastdp.DataParallel")
        mode, ids, out = _checks.resolve(device_ids, output_device)
        self.module = module
        self._register_load_state_dict_pre_hook(_checkpoint.nested_load_pre_hook, with_module=True)
        if mode is None:
            self.device_ids = []
            _split.parse_chunk_sizes(chunk_sizes, None)  # form checked; a pass-through has nothing to split
            return
        self.dim = dim
        self.device_ids = ids
        self.output_device = out
        self.src_device_obj = _devices.torch_device(ids[0])
        rule = _split.parse_chunk_sizes(chunk_sizes, len(ids))
        self._split = rule.bind(ids) if isinstance(rule, _split.AutoSplit) else rule
        self._update_recording()
        if isinstance(criterion, Module):
            criterion.to(self.src_device_obj)  # its tensors (class weights…) are replicated from device_ids[0]
        if mode == "cuda":
            _checks.check_balance(self.device_ids)
        if len(self.device_ids) == 1:
            self.module.to(self.src_device_obj)

    _launch_class = None  # set by __init_subclass__ (fastdp.DistributedDataParallel)

    __call__ = _call.call  # NOTE [the wrapper's own call]

    __new__.__wrapped__ = __init__  # inspect.signature(DataParallel) shows __init__'s parameters, not __new__'s

    def forward(self, *inputs, **kwargs):
        """``dp(*inputs, **kwargs)``: splits the inputs across ``device_ids``, runs each replica on its chunk and
        returns the outputs gathered on ``output_device``; with ``criterion=`` and ``target=``, the loss instead."""
        if _compiler.is_compiling() or _compiler.frame_hook() is not None:  # NOTE [compile boundary]
            return _forward_outside_dynamo(self, *inputs, **kwargs)
        grad_enabled = _grad_enabled()
        watch = _interrupts.watch()  # NOTE [an interrupt a finalizer swallowed] in fastdp/_platform/interrupts.py
        try:
            if _profiler_module._is_profiler_enabled or _profiler_enabled():
                with torch.autograd.profiler.record_function("DataParallel.forward"):
                    return self._forward(inputs, kwargs)
            d = self.__dict__
            if d.get("_criterion") is None and len(d["device_ids"]) == 1:  # one device: no frame of _forward's
                return self._over_devices(d["_modules"]["module"], inputs, kwargs, None)
            return self._forward(inputs, kwargs)
        except BaseException:
            # An interrupt can land inside a grad-mode switch (torch.no_grad().__enter__ after the mode changed),
            # which would leave the caller's thread without autograd: the caller's mode is put back.
            torch.set_grad_enabled(grad_enabled)
            raise
        finally:
            if watch is not None:
                sys.unraisablehook = watch.previous  # first, with no call before it
                if watch.interrupt is not None:
                    watch.raise_swallowed()

    def _forward(self, inputs, kwargs):
        """Upstream's forward: no devices, pass through; one device with the inputs there, call the module; else
        one step over the devices. With ``criterion`` and ``target=``, the loss instead of the outputs: computed on
        each replica when the criterion decomposes, else on the gathered output, as upstream's training loop does."""
        criterion = self.__dict__.get("_criterion")
        target = None
        module = self._modules["module"]  # not self.module: Module.__getattr__ searches three dicts per read
        if criterion is not None and "target" in kwargs:
            kwargs = dict(kwargs)  # the model never sees the target
            target = kwargs.pop("target")
        elif criterion is not None:
            self._warn_without_target(module)
        if not self.device_ids:
            return module(*inputs, **kwargs) if target is None else criterion(module(*inputs, **kwargs), target)
        if target is None:
            return self._over_devices(module, inputs, kwargs, None)
        rule = _replica_loss.loss_rule(criterion, target, self.dim, self.__dict__.get("_criterion_reduction"))
        if rule is None:  # not decomposable: the criterion on the gathered output, as upstream's loop computes it
            return criterion(self._over_devices(module, inputs, kwargs, None, avoided_gather_bytes=0), target)
        # The target is split like the inputs, as their last.
        return self._over_devices(module, inputs + (target,), kwargs, _replica_loss.PerReplicaLoss(criterion, rule))

    def _warn_without_target(self, module):
        """Warns once when a training forward of a wrapper with ``criterion=`` gets no ``target=``: the criterion
        does not run. A forward without grad or in eval mode is how such a wrapper gives its outputs: no warning."""
        if self.__dict__.get("_warned_without_target") or not (torch.is_grad_enabled() and module.training):
            return
        self.__dict__["_warned_without_target"] = True
        warnings.warn(_replica_loss.WITHOUT_TARGET, stacklevel=_fallback.user_stacklevel())

    def _over_devices(self, module, inputs, kwargs, loss, avoided_gather_bytes=None):
        """The forward over ``device_ids``: upstream's check that the module is on device_ids[0], then one step."""
        if loss is None and self._short_path(module, inputs, kwargs):
            if avoided_gather_bytes is not None:  # the criterion ran on the output: nothing split, nothing avoided
                self._keep_outcome(_step.Outcome(None if self._last_step is None else self._last_step.chunk_sizes, 0))
            return module(*inputs, **kwargs)
        _checks.check_module_device(module, self.src_device_obj)
        if self.src_device_obj.type == "cuda":
            _streams.refuse_capture("fastdp.DataParallel's forward over several devices")
        if _transform_active() is not None:
            raise RuntimeError(
                "fastdp.DataParallel cannot run inside a torch.func transform (grad, vjp, jacrev, vmap, ...): its "
                "replicas run on other threads and its data moves in C, which the transform cannot follow. Apply the "
                "transform to the wrapped module (dp.module), or take gradients with torch.autograd.grad or "
                "backward(inputs=...), which work through the wrapper."
            )
        if self.__dict__.get("_oom") is not None:
            return self._oom.run(self._rescue_context(inputs, kwargs),
                                 lambda: self._run_step(self._new_step(loss, avoided_gather_bytes), inputs, kwargs))
        return self._run_step(self._new_step(loss, avoided_gather_bytes), inputs, kwargs)

    def _short_path(self, module, inputs, kwargs):
        """Whether a forward without a per-replica loss takes the short path: one device, the class's own scatter
        (no override on the class or the instance: upstream calls self.scatter on one device too), and every input
        already there (scattering would only wrap each tensor in a view and an autograd node: the module gets them
        as they are). Where it does, upstream's check that the module is on device_ids[0] runs here; where it does
        not, the caller runs it (once)."""
        if len(self.device_ids) != 1 or type(self).scatter is not DataParallel.scatter or "scatter" in self.__dict__:
            return False
        if not _checks.inputs_on(inputs, kwargs, self.src_device_obj):
            return False
        _checks.check_module_device(module, self.src_device_obj)
        return True

    def _new_step(self, loss, avoided_gather_bytes):
        step = _step.Step(self, loss, self._keep_outcome)
        step.avoided_gather_bytes = avoided_gather_bytes
        step.recorder = self._recording.recorder
        return step

    def _keep_outcome(self, outcome):
        """What a forward found (fastdp._step.step.Outcome), kept until the next one: the step publishes it."""
        self.__dict__["_last_step"] = _step.merged(self.__dict__.get("_last_step"), outcome)

    def _rescue_context(self, inputs, kwargs):
        """What the out-of-memory rescue of one step needs (NOTE [out-of-memory rescue]): what the failed attempt ran
        is the Outcome its forward published (its step has ended by the time the rescue asks)."""
        return _rescue.Context(self.module, self.device_ids, self.dim, self.__dict__.get("_criterion") is None,
                               lambda: self.__dict__.get("_split"), self._set_split,
                               lambda: self.__dict__.get("_last_step"), inputs, kwargs, self._recording.mark,
                               lambda: self._on_kept(lambda kept: kept.flush_unsynced()),
                               lambda: self._on_kept(lambda kept: kept.reducer.settle()))

    def _on_kept(self, action):
        """``action(replica set)`` where kept replicas exist: the rescue's reach into the reduction (what no_sync
        kept, before train_step's first attempt; the reductions a failed attempt left in flight, before a retry)."""
        if self._replica_set is not None:
            action(self._replica_set)

    def _set_split(self, rule):
        self.__dict__["_split"] = rule

    def _run_step(self, step, inputs, kwargs):
        """Runs ``step`` on its thread's stack of running steps, holding the wrapper's kept replicas: one forward of
        a wrapper at a time uses them, and leaves what it found before the next one starts (docs/data_parallel.md,
        "Threads"). A call re-entered from inside the wrapper's own forward (this thread, or a replica's worker)
        finds them in use by the outer call, and the forward of a replicated wrapper (nested wrappers) has none:
        both replicate afresh and take no lock."""
        lock = self.__dict__.get("_forward_lock")
        step.fresh = bool(self.__dict__.get("_is_replica")) or _step.is_running(self)
        with contextlib.nullcontext() if step.fresh or lock is None else lock:
            outer = step.push()
            try:
                return self._four_steps(step, inputs, kwargs)
            finally:  # NOTE [an interrupt as a step ends] in fastdp/_step/step.py
                _step.running.steps = outer  # first, with no call before it
                step.finish()

    def _four_steps(self, step, inputs, kwargs):
        """scatter -> replicate -> parallel_apply -> gather (or combine the replicas' losses), as upstream. Each step's
        helper also times it while the step records (``step.recorder``)."""
        inputs, module_kwargs = self._scatter_step(step, inputs, kwargs)
        if len(self.device_ids) == 1:
            return _run_single(self.module, inputs[0], module_kwargs[0], step.loss)
        inputs, module_kwargs = self._plan_step(step, inputs, module_kwargs)
        replicas, watch, synced = self._replicate_step(step)
        outputs = self._apply_step(step, replicas, inputs, module_kwargs, watch, synced)
        return self._gather_step(step, outputs, inputs, module_kwargs)

    def _plan_step(self, step, inputs, module_kwargs):
        """Which devices run (those whose chunk is not empty): their chunks, and the scatter's record."""
        step.plan(len(inputs), self.device_ids)
        inputs, module_kwargs = step.chunks_that_run(inputs), step.chunks_that_run(module_kwargs)
        if step.recorder is not None:
            sizes, split = step.chunk_sizes, self.__dict__.get("_split")
            rows = {pos: sizes[pos] if sizes is not None else (_split.batch_size(inputs[i], module_kwargs[i], self.dim)
                                                                or 0) for i, pos in enumerate(step.run)}
            self._recording.scattered(step, rows, _recorder.nbytes(inputs) + _recorder.nbytes(module_kwargs),
                                      _split.memory_samplers(split), _split.timings_wanted(split, len(self.device_ids)))
        return inputs, module_kwargs

    def _scatter_step(self, step, inputs, kwargs):
        """The split's per-forward work (one call into fastdp._balance.split), then ``self.scatter``; a forward without
        inputs still runs once, on device_ids[0]. Keyword arguments named in ``broadcast`` skip the split: every
        replica gets them whole."""
        training = torch.is_grad_enabled() and self.module.training
        if step.recorder is not None:
            step.recorder.begin(self.device_ids, training)
        kwargs, whole = self._split_off_whole(kwargs)
        with_loss = step.loss is not None
        warned = _batch_major.warn_not_batch_major(inputs[:-1] if with_loss else inputs, kwargs, self.dim,
                                                   self.__dict__.get("_warned_not_batch_major"))
        if warned is not None:
            self.__dict__["_warned_not_batch_major"] = warned
        rule = self.__dict__.get("_split")
        # Else an override (a subclass's, or one set on the instance) is called, and its super().scatter asks for
        # the sizes itself.
        own = type(self).scatter is DataParallel.scatter and "scatter" not in self.__dict__
        sizes = _split.begin_forward(rule, inputs, kwargs, self.dim, len(self.device_ids), with_target=with_loss,
                                     training=training, sizes=own, recorder=step.recorder)
        if own:
            step.chunk_sizes = sizes
            inputs, module_kwargs = self._scatter_sized(inputs, kwargs, self.device_ids, rule, sizes)
        else:
            inputs, module_kwargs = self.scatter(inputs, kwargs, self.device_ids)
        if not inputs and not module_kwargs:
            inputs, module_kwargs = ((),), ({},)
        if whole:
            module_kwargs = tuple({**kw, **_checks.whole_on(whole, self.device_ids[i])}
                                  for i, kw in enumerate(module_kwargs))
        return inputs, module_kwargs

    def _split_off_whole(self, kwargs):
        """(the keyword arguments to split, those named in ``broadcast`` that every replica gets whole or None)."""
        names = self.__dict__.get("_broadcast")
        if not names or not kwargs:
            return kwargs, None
        return ({k: v for k, v in kwargs.items() if k not in names}, {k: v for k, v in kwargs.items() if k in names})

    def _replicate_step(self, step):
        """(what parallel_apply runs, the idle master's BufferWatch or None, the SyncBatchNorm session or None):
        ``self.replicate`` onto the step's positions, without the master's own replica when device 0 runs no chunk;
        with a per-replica loss, each replica paired with its criterion copy."""
        devices = step.replicated
        replicas = self.replicate(self.module, devices)
        skip = step.skip
        watch = _idle_master.BufferWatch(self.module, replicas[skip]) if skip else None
        # None: no SyncBatchNorm layer to synchronise (see NOTE [synced layers] in sync_batchnorm.py)
        synced = sync_batchnorm.begin(self.module, replicas[skip:], step.devices, self._replica_set)
        if step.loss is not None:
            replicas = _replica_loss.pair(replicas, step.loss, devices)
        replicas = replicas[skip:]
        if synced is not None:
            replicas = synced.track(replicas)
        if step.recorder is not None:
            self._recording.replicated(step, self.module, self._replica_set)
        return replicas, watch, synced

    def _apply_step(self, step, replicas, inputs, module_kwargs, watch, synced):
        """``self.parallel_apply``, then the replicas' buffers that the master takes (``watch``, when device 0 runs
        no chunk) copied back, after a replica failed too: a failed step leaves the buffers as the bare model's
        failed forward does (the layers that ran counted and updated, the others untouched)."""
        abandoned = False
        try:
            outputs = self.parallel_apply(replicas, inputs, module_kwargs)
        except BaseException as e:
            abandoned = getattr(e, "_fastdp_abandoned", False)
            if abandoned:
                # Interrupted twice: workers may still run the kept replicas, so they are not reused.
                self._replica_set = None
            raise
        finally:
            if synced is not None:
                synced.end()
            if watch is not None and not abandoned:
                watch.copy_back()
        split = self.__dict__.get("_split")
        if isinstance(split, _split.AutoSplit) and torch.is_grad_enabled() and self.module.training:
            split.sample()  # the step's activations are alive now: "auto" notes the memory they take
        if step.recorder is not None:
            step.recorder.lap("apply")
            step.recorder.sample_memory()
        return outputs

    def _gather_step(self, step, outputs, inputs, module_kwargs):
        """The forward's one result: the gathered outputs, or the replicas' losses combined by the loss's rule."""
        if step.loss is None:
            if type(self).gather is DataParallel.gather and len(outputs) > 1:
                warned = _batch_major.warn_unaligned(outputs, inputs, module_kwargs, self.dim,
                                                     self.__dict__.get("_warned_unaligned"))
                if warned is not None:
                    self.__dict__["_warned_unaligned"] = warned
            result = self.gather(outputs, self.output_device)
        else:
            step.avoided_gather_bytes = sum(o[2] for o in outputs)
            device = _devices.CPU if self.output_device == -1 else self.output_device
            result = _replica_loss.combine(outputs, [i[-1] for i in inputs], step.loss.rule, self.dim, device,
                                           lambda losses: self.gather(losses, self.output_device))
        if step.recorder is not None:
            step.recorder.lap("gather", _recorder.nbytes(result) if step.loss is None else 0)
        return result

    def replicate(self, module, device_ids):
        """The replicas of ``module`` on ``device_ids``: the kept ones, given the module's current values (another
        module, or one that cannot be kept, is replicated afresh, as upstream does every step)."""
        step = _step.current(self)
        if module is not self.module or self.__dict__.get("_is_replica") or (step is not None and step.fresh):
            return replicate(module, device_ids, not torch.is_grad_enabled())
        devices = _devices.normalize_list(device_ids, "device_ids")
        positions = None if step is None else step.positions  # which device_ids entries these devices are
        if positions is not None and step.replicated != devices:
            positions = None  # a call of its own (an override's, a user's): the devices as named
        cover = self._kept_cover(module, positions)
        kept = self._kept_replicas(module, devices if cover is None else [self.device_ids[i] for i in cover], cover)
        if kept is None:
            return replicate(module, device_ids, not torch.is_grad_enabled())
        kept.reducer.begin_step(self._sync_enabled, None if step is None else step.recorder)
        roots = kept.refresh()
        if cover is None or cover == positions:
            return roots
        return [roots[cover.index(i)] for i in positions]

    def _kept_cover(self, module, positions):
        """The positions the kept replicas serve: every position a forward ran on since they were built. A batch
        with fewer chunks than devices (torch.chunk's rule, chunk_sizes with zeros) runs on some of them, and what
        they keep (no_sync sums, buffers) carries on."""
        kept = self._replica_set
        if (positions is None or kept is None or kept.positions is None or kept.network is not module
                or max(kept.positions) >= len(self.device_ids)):  # (device_ids may have been shortened since)
            return positions
        return sorted(set(positions).union(kept.positions))

    def _kept_replicas(self, module, devices, cover):
        """The kept replicas of `module` on `devices` (positions `cover`), built when missing or stale; None for a
        module that replicates afresh every step."""
        kept = self._replica_set
        if kept is not None and kept.matches(module, devices):
            return kept
        self._replica_set = None
        if kept is not None:
            kept.flush_unsynced()  # what no_sync kept reaches the master's .grad before the set goes
        if _replicas.inference_made(module) or not _replicas.persistable(module):
            # Checked on (re)build only: tensor identities and module types are in the signature. Rebuilt every
            # step; under no_sync() each backward then reduces at once (same .grad in the end).
            return None
        _replicas.check_replicatable(module)
        kept = self._replica_set = _replicas.ReplicaSet(module, devices, self._bucket_bytes, cover)
        return kept

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside accumulates gradients on the replicas; the first backward outside reduces them all.

        Like DistributedDataParallel.no_sync: the master parameters' ``.grad`` is only updated by that backward,
        and ends equal to accumulating without ``no_sync`` (up to the order of floating-point addition).
        """
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous
            if self._replica_set is not None:
                self._replica_set.reducer.set_sync(previous)

    def _memory_facts(self):
        """What ``fastdp.memory_report`` asks the wrapper: (what the last forward found, what the kept replicas hold
        per position or None, the split rule's description or None)."""
        kept, split = self._replica_set, self._split
        return (self._last_step, None if kept is None else kept.held_bytes(),
                None if split is None else split.describe())

    @property
    def batch_split(self):
        """How this wrapper splits its batch: a ``fastdp.BatchSplit`` whose ``chunk_sizes`` are the rows each
        device_ids position got in the last forward (None before one, and under torch.chunk's default rule) and
        whose ``rule`` is the ``chunk_sizes=`` rule in words (for ``"auto"``: where it stands). Read-only. A name a
        model is unlikely to have: the wrapper's own attributes hide the wrapped model's (``dp.module.x`` reads it)."""
        last = self.__dict__.get("_last_step")
        rule = _split.describe(self.__dict__.get("_split")) if self.device_ids else "none: the module runs directly"
        return _split.BatchSplit(None if last is None else last.chunk_sizes, rule)

    # The report (docs/report.md): what the last steps measured, per replica and per phase, with advice.

    def enable_report(self, steps=_recorder.DEFAULT_STEPS):
        """Records the next steps for :meth:`report`, keeping the last ``steps`` of them (``report=`` at
        construction does the same)."""
        parsed = _recorder.parse_steps(steps, "steps")
        if parsed is None:
            raise ValueError(f"enable_report(steps={steps!r}): expected a positive int; disable_report() turns it off")
        self._recording.set_report_steps(parsed, self._timings_wanted())

    def disable_report(self):
        """Stops recording: the steps cost nothing to measure again. What was recorded is dropped."""
        self._recording.set_report_steps(None, self._timings_wanted())

    def _timings_wanted(self):
        return bool(self.device_ids) and _split.timings_wanted(self.__dict__.get("_split"), len(self.device_ids))

    def _update_recording(self):
        self._recording.update(self._timings_wanted())

    def _inject(self, injection):
        """Runs a test's out-of-memory injection (fastdp.inject_oom) in the replicas from the next step on (None:
        ends it)."""
        self._recording.inject(injection, self._timings_wanted())

    def _uninject(self, injection):
        """Ends `injection`, unless another one replaced it since."""
        self._recording.inject(None if self._recording.injection is injection else self._recording.injection,
                               self._timings_wanted())

    def report(self, steps=None):
        """What the last recorded steps measured (``steps``: how many of them; default all kept), as a
        ``fastdp.Report``: ``print()`` it, or ``.to_dict()``, ``.to_csv(path)``, ``.trace(path)``, ``.plot(path)``."""
        if not self.device_ids:
            raise RuntimeError(
                "dp.report(): this wrapper runs the module directly and records nothing: no GPU is visible and "
                "device_ids was not given, so, as torch.nn.DataParallel does, it passes every call through; pass "
                "device_ids=['cpu'] * N for N emulated replicas on the host, or run where a GPU is visible"
            )
        return _report.build(self._recording.recorder, self._report_setup(), lambda: _memory.memory_report(self),
                             steps)

    def _report_setup(self):
        """What the report reads of this wrapper besides its records (fastdp._report.report.Setup)."""
        return _report.Setup(self.device_ids, self.__dict__.get("_split"), self.__dict__.get("_criterion") is not None,
                             self._bucket_bytes)

    def train_step(self, *inputs, loss_fn=None, **kwargs):
        """Forward, loss and backward in one call; returns the loss, detached. The loss is the forward's result
        (``criterion=`` with ``target=``) or ``loss_fn(output)``. Gradients accumulate into ``.grad`` as
        ``loss.backward()`` does. With ``oom="rebalance"``, an out-of-memory error in forward or backward moves
        rows away from that device and runs the whole step again once, ``.grad`` and buffers untouched by the
        failed attempt (docs/balance.md)."""
        rescue = self._oom if self._sync_enabled else None  # no_sync's per-replica sums cannot be rolled back
        return _rescue.train_step(lambda: self(*inputs, **kwargs), loss_fn, rescue,
                                  self._rescue_context(inputs, kwargs))

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_replica_set"] = None  # kept replicas are a cache: never pickled or deep-copied
        recording = self.__dict__.get("_recording")  # (a DistributedDataParallel records nothing of its own)
        if recording is not None:
            state["_recording"] = recording.fresh()  # recorded steps hold hooks and events; a copy records afresh
        state.pop("_forward_lock", None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__["_forward_lock"] = threading.Lock()
        if self.__dict__.get("device_ids") and "_recording" in self.__dict__:
            self._update_recording()

    def scatter(self, inputs, kwargs, device_ids):
        """Splits ``inputs`` and ``kwargs`` across ``device_ids`` by the ``chunk_sizes=`` rule (torch.chunk's by
        default), as upstream's; returns (inputs per device, kwargs per device)."""
        rule = self.__dict__.get("_split")
        sizes = None if rule is None else _split.split_for(rule, inputs, kwargs, self.dim, len(device_ids))
        step = _step.current(self)
        if step is not None:
            step.chunk_sizes = sizes
        return self._scatter_sized(inputs, kwargs, device_ids, rule, sizes)

    def _scatter_sized(self, inputs, kwargs, device_ids, rule, sizes):
        """scatter with this batch's sizes already known (None: torch.chunk's rule)."""
        if rule is None:
            return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim, chunk_sizes=sizes)

    def parallel_apply(self, replicas, inputs, kwargs):
        """Runs each replica on its inputs (CUDA replicas on threads, emulated ones one after another); returns the
        outputs in order."""
        step = _step.current(self)
        devices = None if step is None else step.devices  # replicas may skip devices with no chunk
        if devices is None or len(devices) != len(replicas):
            devices = self.device_ids[: len(replicas)]
            return parallel_apply(replicas, inputs, kwargs, devices)
        return _parallel_apply.run(replicas, inputs, kwargs, devices, step.site)

    def gather(self, outputs, output_device):
        """Gathers the replicas' outputs on ``output_device`` along ``dim``, as upstream's."""
        return gather(outputs, output_device, dim=self.dim)

    # Checkpoints: the wrapper's state dict is the module's (no "module." prefix).

    def state_dict(self, *args, **kwargs):
        """The wrapped module's ``state_dict()``: keys carry no ``module.`` prefix (nor torch.compile's
        ``_orig_mod.``: a compiled module's checkpoint loads into the bare model)."""
        return _checkpoint.uncompiled(self.module).state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """Loads a plain or a ``module.``-prefixed state dict into the wrapped module (errors name plain keys);
        for a compiled module, ``_orig_mod.``-prefixed keys (torch.compile's own checkpoints) are accepted too."""
        return _checkpoint.load(self.module, state_dict, strict=strict, assign=assign)

    # Attribute forwarding: what the wrapper lacks is read from the wrapped module.

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if (name.startswith("__") and name.endswith("__")) or name in _COMPILE_ATTRIBUTES:
                raise
            modules = self.__dict__.get("_modules")
            if not modules or "module" not in modules:
                raise
            module = modules["module"]
            try:
                return getattr(module, name)
            except AttributeError as inner:
                raise AttributeError(
                    f"'{type(self).__name__}' object has no attribute '{name}', nor has its wrapped module "
                    f"('{type(module).__name__}')"
                ) from inner


_upstream.detach(DataParallel)
_forward_outside_dynamo = _compiler.outside_dynamo(_compiler.skip_frame(DataParallel.forward))


def data_parallel(module, inputs, device_ids=None, output_device=None, dim=0, module_kwargs=None):
    """Evaluates ``module(input)`` in parallel across ``device_ids``; the functional form of DataParallel."""
    _checks.require_module(module, "data_parallel")
    if not isinstance(inputs, tuple):
        inputs = (inputs,) if inputs is not None else ()
    if device_ids is not None:
        _devices.require_indexable(device_ids)
    emulated = device_ids is not None and any(_devices.is_cpu(d) for d in device_ids)
    if not emulated and not _devices.cuda_available():
        raise RuntimeError("device type could not be determined")  # Upstream's text.
    _, ids, out = _checks.resolve(device_ids, output_device)
    src_device_obj = _devices.torch_device(ids[0])
    _checks.check_module_device(module, src_device_obj)
    inputs, module_kwargs = scatter_kwargs(inputs, module_kwargs, ids, dim)
    if not inputs and not module_kwargs:
        inputs = ((),)
        module_kwargs = ({},)
    if len(ids) == 1:
        return module(*inputs[0], **module_kwargs[0])
    used = ids[: len(inputs)]
    replicas = replicate(module, used)
    synced = sync_batchnorm.begin(module, replicas, used)
    try:
        outputs = parallel_apply(synced.track(replicas) if synced else replicas, inputs, module_kwargs, used)
    finally:
        if synced is not None:
            synced.end()
    return gather(outputs, out, dim)

