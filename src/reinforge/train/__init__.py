"""Training: the RL loop and its step (`loop`), packed micro-batches and their forward
(`packing`), the memory plan made before any weights load (`planner`), the policy's parts
(`policy`: model, LoRA, value head, optimizer) and SFT (`sft`). It may import every layer below
it (`rollout`, `eval`, `run`, `models`, `engine`, ...), never a command's module (`cli`,
`preflight`, `doctor`, `server`)."""
