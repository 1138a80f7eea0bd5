"""Parallel layouts applied from outside to the plain model: the process layout (dims), Megatron-style tensor
parallelism (tensor), and the engines behind one optimizer step (engine: DDP or DeepSpeed ZeRO)."""
