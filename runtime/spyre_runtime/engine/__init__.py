"""The engine layer: requests and their outputs, the schedulers (static, continuous, pooling), the block
manager and the engine loop. Never touches tensors except to hand them on."""
