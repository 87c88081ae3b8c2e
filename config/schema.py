"""The configuration tree: one frozen dataclass per section, one field per key.

Each field's metadata carries its help text and its bounds; the loader (config/loader.py) validates
against them once at start, and the CLI (daemon/cli.py) derives one flag per field from them, so a key
is declared exactly once, here. Per-rank copies are made with dataclasses.replace, never by mutation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def key(default: Any, help: str, *, min: float | None = None, max: float | None = None,
        choices: tuple[str, ...] | None = None, flag: str | None = None, secret: bool = False) -> Any:
    """A config key: its default, help text, bounds and (optionally) a CLI flag name."""
    meta = {"help": help, "min": min, "max": max, "choices": choices, "flag": flag, "secret": secret}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ServerConfig:
    host: str = key("127.0.0.1", "address the HTTP API binds to (loopback unless told otherwise)")
    port: int = key(8000, "TCP port of the HTTP API", min=1, max=65535)
    api_key: str = key("", "when set, every route but /health requires `Authorization: Bearer <key>`",
                       secret=True)
    served_model_name: str = key("", "model name reported by /v1/models (default: the model dir's name)")
    max_concurrent_requests: int = key(256, "requests in flight before new ones get 429", min=1)
    max_body_bytes: int = key(1 << 20, "largest request body accepted; larger gets 413", min=1024)
    max_top_logprobs: int = key(20, "largest top_logprobs / logprobs width a request may ask for",
                                min=0, max=20)
    max_n: int = key(16, "largest `n` (choices per request) a request may ask for", min=1, max=256)
    max_stop_strings: int = key(16, "most stop strings per request", min=0, max=256)
    max_prompts_per_request: int = key(64, "most prompts in one completions request", min=1,
                                       max=4096)
    drain_timeout: float = key(30.0, "seconds in-flight requests may run after SIGTERM", min=0.0)
    engine_ready_timeout: float = key(600.0, "seconds to wait for the engine at start", min=1.0)
    heartbeat_timeout: float = key(3.0, "seconds without an engine heartbeat (sent every 0.5 s) "
                                   "before /health turns 503 and the watchdog pings stop", min=1.0)


@dataclass(frozen=True)
class EngineConfig:
    model: str = key("", "model directory (Hugging Face layout); empty: the bundled default model")
    max_num_seqs: int = key(64, "requests decoded together at most", min=1, max=4096)
    max_num_batched_tokens: int = key(2048, "tokens per step at most (prefill chunks included)",
                                      min=16)
    max_model_len: int = key(0, "context length limit; 0: the model's own", min=0)
    max_prefill_chunk: int = key(512, "prompt tokens one request may prefill per step (chunked "
                                 "prefill keeps decodes flowing beside long prompts)", min=1)
    max_prefill_tokens_decoding: int = key(512, "prompt tokens a step carries at most while some request "
                                           "decodes (0: up to max_num_batched_tokens): a burst of prompts "
                                           "then stretches each of a stream's token gaps by one such step "
                                           "(~25 ms on a 2-core host), not by a whole budget's", min=0)
    block_size: int = key(64, "tokens per KV block. CPU attention reads a request's blocks wherever they "
                          "lie in the pool, and once the prefix cache has cycled it they are scattered: "
                          "64-token blocks served up to 1.06x of 16-token ones at 64 streams "
                          "(docs/architecture.md, Host memory); prefix hits come in whole blocks", min=1, max=1024)
    num_kv_blocks: int = key(0, "KV blocks to allocate; 0: derive from kv_cache_mb", min=0)
    kv_cache_mb: int = key(512, "memory for the KV cache when num_kv_blocks is 0 (MiB)", min=1)
    kv_cache_dtype: str = key("auto", "KV cache dtype; auto: the compute dtype. float16 halves the KV memory "
                              "(kv_cache_mb holds twice the blocks); K/V are rounded to it as they are "
                              "written, and attention per call is slower below ~2k keys on CPU hosts "
                              "(docs/architecture.md)", choices=("auto", "float32", "float16"))
    enable_overlap: bool = key(True, "schedule step N+1 while step N runs on the device")
    enable_prefix_caching: bool = key(True, "reuse the KV of full blocks whose tokens an earlier "
                                      "request already computed (docs/prefix-caching.md)",
                                      flag="--enable-prefix-caching")
    dtype: str = key("float32", "compute dtype: float32 (bfloat16 and float16 are refused at start: "
                     "Paddle's CPU build has no such matmul kernels and the model path is float32)",
                     choices=("float32", "bfloat16", "float16"))
    step_timeout: float = key(10.0, "seconds a step may run before a tensor-parallel group is "
                              "declared hung and the instance goes down (TP > 1 only)", min=0.1)
    seed: int = key(0, "seed for requests that give none", min=0)


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int = key(2, "MTP draft tokens per step; 0 turns speculation off",
                                      min=0, max=8)
    method: str = key("mtp", "draft source: the model's own MTP layers (the only method; a vLLM-style "
                      "setting so configurations carry over)", choices=("mtp",), flag="--speculative-method")
    adaptive: bool = key(True, "choose each request's drafts per step (0..num_speculative_tokens) from a "
                         "measured step-cost model and its acceptance; false: always draft "
                         "num_speculative_tokens", flag="--speculative-adaptive")
    draft_weight_dtype: str = key("float16", "dtype the CPU kernels read the MTP layers' and the draft head's "
                                  "weights in; float16 halves what a draft depth reads. Drafts are only "
                                  "guesses that the float32 main model verifies: this can change acceptance, "
                                  "never the output (docs/speculation.md)", choices=("float32", "float16"))
    prompt_window: int = key(64, "a prompt's last positions the MTP depths run over (from the block start at or "
                             "before them); drafts attend to the MTP KV from there on. A depth over a whole "
                             "prompt costs ~0.35x the target's prefill again; drafts over the last 64 positions "
                             "matched the main model 0.678 of the time on code, 0.682 over whole prompts. 0: whole "
                             "prompts "
                             "(docs/speculation.md)", min=0, flag="--speculative-prompt-window")
    profile_cache: str = key("", "directory keeping the start-up profile of step costs, so that a restart with "
                             "the same host, code, model and engine settings plans with it instead of profiling "
                             "again (a profile is kept a day); empty: $CACHE_DIRECTORY, else $XDG_CACHE_HOME/mtpserve "
                             "or ~/.cache/mtpserve; off: profile at every start (docs/speculation.md)",
                             flag="--speculative-profile-cache")


@dataclass(frozen=True)
class IpcConfig:
    transport: str = key("auto", "output-channel transport; auto: POSIX, or SysV when the user's "
                         "POSIX queue budget (RLIMIT_MSGQUEUE) is spent", choices=("auto", "posix", "sysv"),
                         flag="--ipc-transport")
    runtime_dir: str = key("", "directory for sockets and ownership records; empty: "
                           "$RUNTIME_DIRECTORY, else /tmp/mtpserve-<uid>")
    instance: str = key("", "instance name keying the IPC objects; empty: derived from the port")
    payload: str = key("ring", "how frames larger than one queue message travel: a shared-memory "
                       "ring with descriptors on the queue, or chunks on the queue",
                       choices=("ring", "chunked"), flag="--ipc-payload")
    ring_bytes: int = key(4 << 20, "size of the shared-memory ring (bytes)", min=64 << 10,
                          flag="--ipc-ring-bytes")
    max_msg_bytes: int = key(8192, "bytes per queue message (the stock kernel limit)", min=512,
                             flag="--ipc-max-msg-bytes")
    queue_depth: int = key(10, "POSIX queue depth in messages (the stock kernel limit)", min=1,
                           flag="--ipc-queue-depth")
    max_pending_bytes: int = key(64 << 20, "output frames the engine may hold while the reader is "
                                 "behind; past it the engine fails loudly (bytes)", min=1 << 20,
                                 flag="--ipc-max-pending-bytes")
    reader_max_buffered: int = key(64, "decoded frames the HTTP reader holds before it stops "
                                   "receiving (back-pressure reaches the engine)", min=1,
                                   flag="--ipc-reader-max-buffered")
    liveness_interval: float = key(0.5, "seconds between the reader's checks that the channel "
                                   "still exists", min=0.01, flag="--ipc-liveness-interval")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = key(1, "rank processes sharding the model", min=1, max=64)
    nnodes: int = key(1, "hosts the ranks span", min=1)
    node_rank: int = key(0, "this host's index among nnodes", min=0)
    master_addr: str = key("127.0.0.1", "address of rank 0's host for the collective runtime")
    master_port: int = key(29500, "port of the collective runtime's rendezvous", min=1, max=65535)
    cpu_threads: int = key(0, "threads each rank's CPU kernels use; 0: this host's CPUs (its affinity mask) "
                           "split among its ranks", min=0, max=1024)


@dataclass(frozen=True)
class PdConfig:
    role: str = key("mixed", "this instance's part in prefill/decode disaggregation",
                    choices=("mixed", "prefill", "decode"), flag="--role")
    transfer_protocol: str = key("tcp", "KV transfer transport", choices=("tcp", "rdma"))
    kv_lease_timeout: float = key(30.0, "seconds a prefilled KV waits for its decode instance",
                                  min=0.1)
    kv_host: str = key("127.0.0.1", "address other instances reach this rank's KV at (Mooncake)")
    transfer_threads: int = key(2, "decode role: KV reads running at once", min=1, max=64)
    transfer_delay: float = key(0.0, "testing aid: seconds each KV read waits before it starts",
                                min=0.0, max=60.0)


@dataclass(frozen=True)
class LoggingConfig:
    level: str = key("info", "log level", choices=("debug", "info", "warning", "error"),
                     flag="--log-level")
    format: str = key("auto", "auto: JSON lines unless stdout is a terminal",
                      choices=("auto", "json", "console"), flag="--log-format")


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    ipc: IpcConfig = field(default_factory=IpcConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    pd: PdConfig = field(default_factory=PdConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
