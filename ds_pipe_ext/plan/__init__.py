"""The planner: the fastest PP x TP x DP x ZeRO x micro-batch x recompute layout of a model on a cluster.

Read top-down:

- ``space``: the layouts (``layout.Layout``) a cluster of N GPUs admits, and why the others are not
  layouts at all (indivisible); ``--only`` strings.
- ``model``: what one layout costs: per-layer analytic costs (cached per TP, SP, micro-batch and
  recompute), the exact memory-capped partition, the peak memory per rank, the step time from the
  event simulator with DP and ZeRO collectives, and a closed-form lower bound on that step.
- ``search``: prune by memory and by the lower bound, simulate only what can still reach the top K.
- ``render``: the table, JSON, Megatron's ``pipeline_model_parallel_layout`` and the ds.json.
"""
