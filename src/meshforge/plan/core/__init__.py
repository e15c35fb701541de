"""The planner's pure core (no torch, no job config): memory, step time and layouts.

flops        parameter counts and FLOPs (one model-FLOP count: PaLM/torchtitan's is
             Megatron-LM's; hardware FLOPs add recomputation)
efficiency   the achievable fraction of peak, one calibrated curve
gpus         the one GPU table (datasheet peaks, memory, CUDA names), also for MFU
hardware     GPU catalogue (from gpus), link presets, the cluster
profile      a measured machine (the trainer's own host) as a cluster
layout       the planner's search point, the training shape; the layout rules in flags
memory       model states (meshforge / zero-paper conventions), activations, buffers
comm         ring collective costs and nccl-tests bus bandwidth
timing       the step-time model
predict      one layout evaluated (`evaluate`), and the trainer's `predict_run`
search       every valid layout, best first
validation   the time model against published runs: fit and leave-one-source-out
"""
