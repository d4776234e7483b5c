"""DeepSpeed integration: the ``"pipeline"`` settings and the PipelineModule subclass."""
