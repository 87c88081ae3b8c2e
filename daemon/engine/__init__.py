"""The rank processes: scheduler, KV blocks, model runner, MTP proposer, verifier, sampler.

Along a request's path:
  rank_main.py      the rank process; rank_setup.py builds what it serves with, rank_loop.py runs it
  rank_loop.py      rank 0's event loop: intake -> launch_next -> await the device -> finish_step -> emit
  request.py        EngineRequest (intake; SamplingParams is ipc's) and the engine-side Request state
  engine_core.py    EngineCore: intake, launch_next, finish_step (verify/update/emit); no I/O
  engine_factory.py the core around a model, from the configuration's engine/speculative sections
  kv_connector.py   the PD seam: hooks the core and scheduler call; the mixed role's do-nothing base
  kv_prefill.py     PrefillConnector: held prompt KV under a lease, FIRST_TOKEN handoffs
  kv_decode.py      DecodeConnector: reads prefilled KV into reserved blocks, or recomputes
  kv_mooncake.py    the connectors' I/O: Mooncake agent, reads on threads, KVHeld announcements
  scheduler.py      FCFS continuous batching, chunked prefill, k+1 reservation, preemption, abort
  block_manager.py  paged KV block free list and exact accounting
  step_plan.py      StepPlan (host -> device, staged inserts and block writes) and StepResult
  runner.py         the ModelRunner protocol both runners implement
  device_stream.py  a CPU host's "device": one execution thread running steps in launch order
  slot_state.py     device-resident per-slot state: decode windows, invalid rows, stop rules
  model_runner.py   the Paddle runner: target pass, verify rows, sampling, logprobs
  mtp_proposer.py   MTP drafting by depth, cyclic reuse of MTP layers
  slot_sampling.py  per-slot sampling parameters and penalty counts
  sampler.py        penalties, temperature, top-k/top-p/min-p, seeded draws, logprobs
  rng.py            counter-based uniforms per (request seed, output position, purpose)
  spec_verify.py    greedy verification and lossless rejection sampling
  spec_stats.py     acceptance counters per draft position
  spec_learning.py  what verified windows and decisions teach the policy's acceptance estimates
  synthetic_runner.py  fixed-step-time device with a set acceptance rate (scheduling benchmarks)
  engine_emitter.py builds one step's StepEmission row by row
  step_emission.py  StepEmission: flat arrays for the output-path op
  tp_*.py           tensor parallelism: group, plan channel and codec, leader/follower runners
"""
