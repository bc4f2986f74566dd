"""Models: loading a draft/target pair (the embedded GGUF parts, a hub id or a local directory), the vocabulary
check, the packed 4-bit weights and the CPU kernels' bindings (quantized matmul, batch-invariant attention),
the lean forward over them (lean.py), and the prompt cache.

Owns everything that turns files into `nn.Module`s and makes their forward fast on a CPU. Imports only
specviz's top-level modules (config, cache, machine, ...); nothing here knows about speculation.
"""
