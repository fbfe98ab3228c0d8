"""The strategies: ``offload/`` (``lowmem_offload``, ``lowmem_offload_params``: fp32 masters on the host, with its
precision plugin) and ``zero/`` (the ``lowmem_zero*`` DeepSpeed presets). The two never import each other."""
