"""The rank processes: scheduler, KV blocks, model runner, MTP proposer, verifier, sampler."""
