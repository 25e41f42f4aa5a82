"""The shard's STEP: when a fragment steps (`policy`), how much each delta counts (`weighting`),
the merge (`merge`, `sparse_merge`; a cut tensor's RDA groups: `paramserver.server.fragment`),
the outer optimizer (`outer`), the step of one fragment chunk by chunk (`fragment_step`; its
one compiled pass per chunk: `fused_kernels`) and
the quantized downlink it publishes (`downlink`). Pure rules and arithmetic over arrays: no
sockets, no files, no clock."""
