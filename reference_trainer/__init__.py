"""A 3D-parallel (tensor x pipeline x data) GPT-style trainer on DeepSpeed, with fault injection."""
