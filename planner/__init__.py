"""dsplan: plan, configure and run distributed training with DeepSpeed and Megatron-style 3D parallelism.

Importing this package must stay cheap: no torch, no deepspeed (those live behind planner.run).
"""

__version__ = "0.1.0"
