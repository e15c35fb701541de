"""The planner: pure maths (no torch import) for memory, step time and layouts.

flops        parameter counts and FLOPs (one model-FLOP count: PaLM/torchtitan's is
             Megatron-LM's; hardware FLOPs add recomputation)
efficiency   the achievable fraction of peak, one calibrated curve
gpus         the one GPU table (datasheet peaks, memory, CUDA names), also for MFU
hardware     GPU catalogue (from gpus), link presets, the cluster
profile      a measured machine (the trainer's own host) as a cluster
layout       a parallel layout, the training shape, and their validity rules
memory       model states (meshforge / zero-paper conventions), activations, buffers
comm         ring collective costs and nccl-tests bus bandwidth
timing       the step-time model
predict      one layout evaluated (`evaluate`), and the trainer's `predict_run`
job          a job config's prediction (`predict_for_job`: report.json's `predicted`)
machine_fit  a measured machine (train.calibration) fitted into a profile, and cached
search       every valid layout, best first
validation   the time model against published runs: fit and leave-one-source-out
request      command-line inputs to model, cluster and plan (shared by plan and cost)
"""
