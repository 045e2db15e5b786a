"""The framework seams: where the hooks reach into torch.distributed (``collectives``, ``async_done``),
DDP/FSDP (``ddp``), DeepSpeed (``deepspeed``, ``pipeline``, ``offload``), Hugging Face (``hf``) and
Lightning (``lightning``). Each talks to the Tracer through its public recording surface
(:class:`trainer_hooks.recorder.Recorder`), never through its private state.
"""
