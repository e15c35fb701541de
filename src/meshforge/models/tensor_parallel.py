"""How meshforge's models (the GPT and the Llama-style decoder) are spread over a
tensor-parallel mesh dimension (Megatron-LM's split, through DTensor's
`parallelize_module`). The models themselves never see this file.

Per block: q, k, v and the MLP's input projections (the GPT's fc; the Llama's gate
and up) are column-wise (each rank holds whole heads, whole key/value heads under
grouped-query attention, and a slice of the MLP width), the two output projections
row-wise (one all-reduce each in forward, one in backward). The token embedding and the
output head are split over the vocabulary; with loss parallel the logits stay
vocabulary-sharded into the cross-entropy, so the full (b, s, vocab) tensor never
exists on one rank.

Sequence parallel (Korthikanti et al. 2022) shards the activations between the
row-wise and the next column-wise projection along the sequence: the LayerNorms
and the dropout run on s/tp positions, and each all-reduce becomes a
reduce-scatter plus an all-gather.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshforge.models.gpt import DecoderLM


def apply_tensor_parallel(
    model: DecoderLM, tp_mesh: DeviceMesh, *, sequence_parallel: bool, loss_parallel: bool
) -> None:
    """Shard `model` (or the pipeline stage of it) in place over `tp_mesh`."""
    sp = sequence_parallel
    between = Shard(1) if sp else Replicate()  # layout of activations between blocks
    if model.embed is not None:
        # vocabulary-parallel lookup: masked gather, then all-reduce
        if hasattr(model.embed, "drop"):  # GPT: + position embedding, then dropout
            plan = {"tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())}
            if sp:  # the sum leaves the embeddings already cut along the sequence
                plan["drop"] = PrepareModuleInput(
                    input_layouts=(Replicate(),),
                    desired_input_layouts=(Shard(1),),
                    use_local_output=True,
                )
        else:  # Llama: the lookup is all; under SP it reduce-scatters along the sequence
            plan = {"tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=between)}
        parallelize_module(model.embed, tp_mesh, plan)
    for block in model.blocks.values():
        plan = {
            "attn": PrepareModuleInput(
                input_layouts=(between,),
                desired_input_layouts=(Replicate(),),
                use_local_output=True,
            ),
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=between),
            "mlp": PrepareModuleInput(
                input_layouts=(between,),
                desired_input_layouts=(Replicate(),),
                use_local_output=True,
            ),
            **{
                f"mlp.{n}": ColwiseParallel() for n in ("fc", "gate", "up") if hasattr(block.mlp, n)
            },
            "mlp.proj": RowwiseParallel(output_layouts=between),
        }
        if sp:
            plan["ln1"] = SequenceParallel()
            plan["ln2"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)
    if model.ln_f is not None and sp:
        parallelize_module(model.ln_f, tp_mesh, SequenceParallel())
    if model.head is not None:
        parallelize_module(
            model.head,
            tp_mesh,
            ColwiseParallel(
                input_layouts=between,
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
        )
    # Both halves of a tied pair were split the same way (Shard(0) over the
    # vocabulary), but each got its own Parameter: share one again.
    model.tie_weights()
