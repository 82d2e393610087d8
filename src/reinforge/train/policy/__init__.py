"""The policy's parts: loading it with its engine (`model`), LoRA (`lora`), PPO's value head
(`value`) and the optimizer (`optim`). It may import `train.packing` and the layers below
`train`."""
