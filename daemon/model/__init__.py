"""The Paddle models: MiMo/Qwen2 (a dense decoder with MTP layers), DeepSeek-V3 and ERNIE-4.5 MoE
(docs/models.md), each serving the one contract the engine is typed against (serving_model.py).

Rank processes only (imports paddle). Files, along the path of one step:
  config.py            model_config_from_file(config.json) -> the family's config; rejects unknown `architectures`
  loader.py            load_serving_model(model_dir, tp=SINGLE) -> the family's model (weights + tokenizer
                       check); load_model(...) -> MiMoForCausalLM for the tools that train/measure it
  serving_model.py     ServingModel / ServingConfig: what the engine needs of a model
  deepseek_config.py, deepseek_model.py, mla.py, moe.py   DeepSeek-V3: MLA over a latent cache, MoE, MTP
  ernie_config.py, ernie_model.py                         ERNIE-4.5 MoE and its MTP block
  checkpoint.py        save_checkpoint / load_weights; CheckpointError names missing/unexpected/mis-shaped
  safetensors_reader.py  memory-mapped safetensors reading (bf16 widened to fp32)
  forward_batch.py     ForwardBatch: one step's packed tokens + block tables
  kv_cache.py          KVCache: per-layer paged K/V, one scratch block for invalid slots
  attention_context.py PagedContext (serving) / DenseCausalContext (training): what attention sees
  attention_core.py    masked grouped-query attention over padded buffers
  decoder_layer.py     Attention, MLP, DecoderLayer
  mtp_layer.py         MTPLayer (model.mtp_layers.{i}); eval mode tabulates input_proj's token half
  draft_vocab.py       optional draft_vocab.json: MTP drafts argmax over a frequent-token subset
  mimo_model.py        MiMoForCausalLM: forward_step, draft_depth (heads inside the block calls on CPU
                       hosts), forward, mtp_forward, compute_logits; ComposedStep for the other families
  parallel.py          TensorParallel + Column/Row-parallel linears, vocab-parallel embedding and head
  norm.py, rotary.py   RMSNorm, RoPE

Serving interface (the engine builds against exactly this):

    model = load_serving_model(model_dir)                          # the family's class, eval mode
    kv = model.allocate_kv(cfg.num_hidden_layers, num_blocks, block_size)   # this rank's share
    mtp_kv = model.allocate_kv(model.num_mtp_layers, num_blocks, block_size)
    out = model.forward(batch: ForwardBatch, kv) -> ModelOutput(hidden_states [T, H], mtp_hidden [T, H])
    logits = model.compute_logits(out.hidden_states[rows])        # [N, V] float32
    d = model.mtp_forward(i, batch, token_ids_shifted [T], prev_hidden [T, H], mtp_kv)
        -> MTPOutput(hidden_states [T, H], mtp_hidden [T, H])
    draft_ids = model.draft_token_ids(d.hidden_states[rows], i)    # [N] int64 full-vocabulary ids

    # what a serving step calls: the same results, with the heads inside the block calls where they can be
    step = model.forward_step(input_ids, positions, ctx, rows)     # StepForward(mtp_hidden, logits [N, V], greedy)
    depth = model.draft_depth(i, token_ids_shifted, prev_hidden, positions, mtp_ctx, out_rows, draft_rows)
        -> DraftOutput(mtp_hidden, draft_ids [M])

Semantics and deviations from the first sketch of this interface:
  * ModelOutput.hidden_states is after the final norm (feed compute_logits); ModelOutput.mtp_hidden is
    what the first MTP depth reads: before the norm for MiMo, after it for DeepSeek-V3 and ERNIE (each
    config's `mtp_hidden_after_norm`, docs/models.md). MTPOutput has the same two fields: hidden_states
    ready for the depth's head (after MiMo's final_layernorm, DeepSeek's shared_head.norm, ERNIE's
    model.norm), mtp_hidden the prev_hidden of the next depth.
  * MTP depth i+1 at position t reads token t+i+1 (`token_ids_shifted`) and depth i's mtp_hidden at t,
    and predicts token t+i+2. It runs at the same positions and slots as the main model, so `batch`
    is reused; its KV goes to layer `i % num_mtp_layers` of `mtp_kv` (same block ids as the main
    cache: one allocator). k larger than the number of MTP layers reuses them cyclically; pass
    `kv_layer` explicitly then, so the depths do not share a KV layer.
  * ForwardBatch has one host field, `max_q_len: int` (the longest window this step), which sizes the
    padded query buffer without reading anything back from the device. The key range is
    block_tables.shape[1] * block_size: keep the table only as wide as the longest sequence needs.
  * KVCache tensors are stored flat, [(num_blocks + 1) * block_size, KVH, D]: row = slot number; the
    extra block is the sink for slot -1, so invalid tokens cost no branch and no host sync.
  * No per-request Python loop and no host sync in forward/mtp_forward: block tables are expanded to
    key slots and queries are scattered into a padded [B, max_q] buffer with device index tensors.
  * Eval mode (`model.eval()`, which load_model calls) serves from weight copies built at that
    moment: q/k/v and gate/up concatenated per rank into one matmul each, and every projection and
    the LM head transposed to [in, out] (Paddle's CPU matmul copies a `transpose_y` weight on every
    call). The cost is one extra copy of those weights; change weights only in train mode, or call
    eval() again after changing them. `run_mtp(..., out_rows=rows)` returns only those rows and runs
    the layer's MLP on them alone (the last drafting depth), while still writing every row's KV.
  * `draft_token_ids` is the argmax over `draft_vocab.json`'s tokens when the model directory has one
    (`load_model(..., draft_vocab=False)` or `model.set_draft_vocab(None)`: the full vocabulary).
    Drafts decide acceptance only; verification uses the full head, so output never changes.
"""
