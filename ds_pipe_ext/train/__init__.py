"""The trainer behind ``train.py``: a validated run config, ``build``, one step function, the loop.

    config.py      RunConfig: ds.json's "train", "tensor_parallel" and "pipeline" sections + CLI options
    data.py        micro-batch streams: synthetic tokens or a Megatron indexed dataset, resumable
    build.py       process group, topology, model (pipeline or data parallel), engine, data, sinks
    trainer.py     the step function chosen once, the loop, the summary
    checkpoint.py  per-step checkpoints, committed by a manifest, the ``latest`` pointer, keep-last-K
"""
