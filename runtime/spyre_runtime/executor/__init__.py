"""The executor layer: model loading, the compiled steps, the KV cache, tensor-parallel workers, warm-up and
the graph cache. Computes what the engine's step describes; makes no scheduling decisions."""
