"""The splits people set by hand, as DeepSpeed ``parts`` over [embedding, L blocks, head], to compare against.

Megatron's ``--account-for-embedding-in-pipeline-split`` and ``--account-for-loss-in-pipeline-split`` count
the embedding and the loss as one block each and divide the L + 2 evenly: every stage gets n = (L + 2) / p,
the first and the last one block fewer (megatron-core's ``get_num_layers_to_build``, which asserts that p
divides L + 2).  Llama 3's recipe, "one layer fewer on the first and the last stage" (126 blocks on 16
stages: 7, 8 x 14, 7), is the same rule.  Where p does not divide L + 2, a Megatron user sets
``num_layers_in_first/last_pipeline_stage`` instead; megatron asserts that the stages between divide
what is left, and ``fewer_at_the_ends`` takes the largest such count not above n - 1.

Pure functions of integers, no torch.
"""

from __future__ import annotations

from .algorithms import PartitionError


def parts_from_blocks(blocks: list[int]) -> list[int]:
    """Blocks per stage -> parts over [embedding, blocks, head]: the embedding on the first stage, the head on the last."""
    parts, at = [0], 1
    for k in blocks[:-1]:
        at += k
        parts.append(at)
    return parts + [sum(blocks) + 2]


def even_blocks(layers: int, chunks: int) -> list[int]:
    """Megatron-LM's default split: the blocks evenly over the model chunks (L // chunks each, the rest on the
    last), the embedding with the first, the head and loss with the last."""
    per = layers // chunks
    return [0, *(1 + per * k for k in range(1, chunks)), layers + 2]


def uniform_layers(pipeline_layers: int, chunks: int) -> list[int]:
    """DeepSpeed's ``partition_method="uniform"``: the pipeline's layers (embedding, blocks, head) evenly by
    count over the chunks, as ``ds_utils.partition_uniform`` rounds them."""
    return [round(k * pipeline_layers / chunks) for k in range(chunks + 1)]


def megatron_accounting(layers: int, stages: int) -> list[int]:
    """Embedding and loss counted as a block each, L + 2 divided evenly (Megatron's and Llama 3's rule)."""
    if stages < 2:
        return [0, layers + 2]
    if (layers + 2) % stages:
        raise PartitionError(f"Megatron's embedding-and-loss accounting needs the stages ({stages}) to divide "
                             f"blocks + 2 ({layers + 2}); megatron-core asserts it")
    n = (layers + 2) // stages
    return parts_from_blocks([n - 1] + [n] * (stages - 2) + [n - 1])


def fewer_at_the_ends(layers: int, stages: int) -> list[int]:
    """``num_layers_in_first/last_pipeline_stage`` = k, the rest evenly: the largest k <= round(L / p) - 1 for
    which the stages between divide the rest (megatron asserts it); at 2 stages, the even split."""
    if stages <= 2:
        half = layers // 2
        return parts_from_blocks([half, layers - half][:stages])
    for k in range(max(round(layers / stages) - 1, 0), -1, -1):
        if (layers - 2 * k) % (stages - 2) == 0:
            mid = (layers - 2 * k) // (stages - 2)
            return parts_from_blocks([k] + [mid] * (stages - 2) + [k])
    raise PartitionError(f"no first/last count lets {stages - 2} middle stages divide {layers} blocks")
