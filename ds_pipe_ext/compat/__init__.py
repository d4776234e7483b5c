"""The one door to DeepSpeed's and megatron-core's private state.

Everything in ds_pipe_ext that reads or replaces a private name of DeepSpeed or
megatron-core goes through this package, one module per concern, so that an
upgrade that renames one breaks here, visibly, and nowhere else.  The only
exception is ``pipe/module.py``'s override of ``PipelineModule._partition_layers``,
which subclassing requires.

Tested with DeepSpeed >=0.19.0,<0.20 (0.19.8) and megatron-core 0.16.x (pinned in
setup.py).  The private names relied on:

DeepSpeed ``runtime/pipe/module.py`` (``PipelineModule``), in ``compat.engine``:
    ``_topo``            the PipeModelDataParallelTopology: coordinates of a rank
    ``_grid``            the PipelineParallelGrid: this rank's data-parallel id
    ``_layer_specs``     the layer list as the user gave it
    ``_local_start``, ``_local_stop``, ``_set_bounds``   this rank's layer range
    ``str(idx)`` submodule names   where a built layer lives (``_build``'s ``add_module``)
    ``_partition_layers``  overridden in pipe/module.py

DeepSpeed ``runtime/pipe/engine.py`` (``PipelineEngine``), in ``compat.instructions``:
    ``_INSTRUCTION_MAP``   instruction class -> bound method; a timed copy is put on the instance
    ``_aggregate_total_loss``   the loss broadcast after the schedule (timed too)

DeepSpeed ``runtime/pipe/engine.py``, in ``compat.backward``:
    ``_INSTRUCTION_MAP[BackwardPass]``   wrapped in the class map: a tuple of outputs backpropagated in one pass
    ``pipe_buffers["outputs"]``, ``grad_layer``, ``is_pipe_partitioned``, ``is_grad_partitioned``   what it reads

DeepSpeed ``runtime/pipe/engine.py``, in ``compat.engine``:
    ``_train_schedule``    the PipeSchedule of each ``train_batch``; replaced on the instance for GPipe

DeepSpeed ``runtime/pipe/p2p.py`` (public module functions, replaced while emulating a slow
link), in ``compat.link_emulator``:
    ``send``, ``recv``     the pipeline's activation and gradient transfers

DeepSpeed optimizer wrappers (ZeRO, fp16), in ``compat.optimizer``:
    ``.optimizer``       the wrapped torch optimizer

DeepSpeed ZeRO optimizers (``runtime/zero/stage_1_and_2.py``, ``stage3.py``), in ``compat.zero``:
    ``ds_tensor``        a ZeRO-3 parameter's partition
    ``grads_in_partition``, ``ipg_buffer``, ``grad_partitions_flat_buffer``, ``averaged_gradients``
                         ZeRO's gradient buffers (counted when present)

DeepSpeed ``deepspeed.comm`` (public functions, replaced on the package while instrumenting a
data-parallel run), in ``compat.comm``:
    ``all_reduce``, ``reduce``, ``reduce_scatter_fn``, ``reduce_scatter_tensor``, ``allgather_fn``,
    ``all_gather_into_tensor``, ``all_gather``

DeepSpeed ``comm/torch.py``, in ``compat.cpu_shims``:
    ``build_shm_op``     the JIT build of the shared-memory op, skipped on CPU

DeepSpeed ``utils/groups.py``, in ``compat.engine``:
    ``_create_expert_and_data_parallel``   the expert groups, made on every rank before the engine
    ``_release_process_group_references``  forgotten between builds in one process
    ``mpu``              the model-parallel unit its MoE layer reads: megatron's ``parallel_state`` for a routed
                         layer profiled under TP before the engine sets its grid

DeepSpeed ``moe/mappings.py``, in ``compat.cpu_shims`` (CPU only):
    the module-level name ``deepspeed``, whose ``comm.all_gather_into_tensor`` gets DeepSpeed's flat buffer
    viewed as gloo requires it

glibc's malloc, in ``compat.cpu_shims`` (CPU only):
    ``mallopt`` M_MMAP_THRESHOLD and M_TRIM_THRESHOLD, fixed so that a step's page faults do not
    depend on what the process allocated before (``DS_PIPE_EXT_GLIBC_MALLOC=default`` opts out)

megatron-core, in ``compat.cpu_shims`` (CPU only):
    the module-level name ``torch`` of ``tensor_parallel.mappings``, ``tensor_parallel.layers``
    and ``utils``, whose ``torch.cuda.current_device()`` must name the CPU

transformers (optional: ``ds_pipe_ext.hf``, the ``hf`` extra), public names whose behaviour ``hf/`` relies on:
    ``masking_utils.create_causal_mask`` / ``create_sliding_window_causal_mask`` (keyword ``cache``), the
    decoder layers' ``position_embeddings`` / ``position_ids`` / ``attention_mask`` keywords, a ``*ForCausalLM``'s
    module paths (``hf/source.ARCHITECTURES``), the rotary module built from ``config=``
"""

DEEPSPEED_TESTED = ">=0.19.0,<0.20"
MEGATRON_CORE_TESTED = ">=0.16.0,<0.17"
TRANSFORMERS_TESTED = ">=5.23,<5.30"


def _warn_untested_versions() -> None:
    """Warn once, at import, for an installed DeepSpeed, megatron-core or transformers outside the tested
    range: the names above may have moved."""
    import warnings
    from importlib.metadata import PackageNotFoundError, version

    from packaging.specifiers import SpecifierSet

    for package, tested in (("deepspeed", DEEPSPEED_TESTED), ("megatron-core", MEGATRON_CORE_TESTED),
                            ("transformers", TRANSFORMERS_TESTED)):
        try:
            installed = version(package)
        except PackageNotFoundError:
            continue  # its absence is reported where it is first needed
        if installed not in SpecifierSet(tested):
            warnings.warn(f"ds_pipe_ext was tested with {package} {tested}, this is {package} {installed}: its "
                          f"names that ds_pipe_ext/compat relies on may have changed", stacklevel=2)


_warn_untested_versions()

