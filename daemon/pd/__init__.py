"""Prefill/decode disaggregation, the rank side (docs/pd.md).

  kv_layout.py     which KV tensors a rank exposes, its KVLayout, the read descriptors between two ranks
  kv_transfer.py   KVTransferAgent: one Mooncake transfer engine, registered KV memory, one-sided reads
"""
