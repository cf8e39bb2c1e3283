"""The train stage: EAGLE-3 training-time test (TTT) on stored target hidden states.

The target's next-token distribution p[t] is recomputed on the fly from the stored final state
through the target's frozen lm_head and restricted to the draft vocab (full logits are never
stored). The drafter unrolls `ttt_length` chained steps at every position (Drafter.forward):
step k at position t predicts token t+k+2, so its target is p[t+k+1], and it counts where
loss_mask[t+k+2] holds (an assistant token) and the target's argmax is in the draft vocab:

    loss = sum_k step_weight**k * sum_valid CE(p, q_k) / N_k      N_k = valid positions, step k

N_k counts the whole optimizer step (every micro-batch of every process), so gradient
accumulation and DDP give exactly the gradient of one big batch. AdamW, linear warmup then
cosine decay, gradient clipping, fp32 or bf16 autocast. Every `checkpoint_every` steps the model,
optimizer, scheduler, data position and RNG states go to a work directory beside the output; a
rerun resumes there. Under `torchrun` it runs DDP (gloo on CPU, nccl on GPU).
"""

from eaglet.graph.code import Code

# The code that shapes this stage's bytes (eaglet.graph.code): bump the version when they change.
CODE = Code(
    version=1,
    kernel=(
        "eaglet.stages.train.kernel",
        "eaglet.stages.train.data",
        "eaglet.stages.train.mixture",
        "eaglet.stages.train.warm_start:start_from",
        "eaglet.stages.train.dflash",
        "eaglet.model.ttt",
        "eaglet.model.drafter",
        "eaglet.model.target_head",
        "eaglet.model.arch",
        "eaglet.model.dflash.config",
        "eaglet.model.dflash.model",
        "eaglet.model.dflash.loss",
        "eaglet.model.dflash.train",
        "eaglet.formats.drafter:save_drafter",
        "eaglet.formats.vocab:load_vocab",
        "eaglet.formats.dflash",
        "eaglet.stages.hidden.read:is_heldout",
        "eaglet.stages.hidden.read:split",
    ),
)
