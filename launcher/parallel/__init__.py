"""Parallel layouts applied from outside to the plain model: the process layout (dims), Megatron-style tensor
parallelism (tensor), the model as pipeline stages (pipeline), the single-device model's parameter names (names),
and the engines behind one optimizer step (engine: DDP or DeepSpeed ZeRO; pipeline; build picks one).
launcher/parallelize.py applies them to the model in one fixed order."""
