"""The rank processes: scheduler, KV blocks, model runner, MTP proposer, verifier, sampler.

Along a request's path:
  request.py        EngineRequest (intake), SamplingParams, the engine-side Request state
  engine_core.py    EngineCore: intake -> schedule -> launch -> collect -> verify/update -> emit (no I/O)
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
  synthetic_runner.py  fixed-step-time device with a set acceptance rate (scheduling benchmarks)
  step_emission.py  StepEmission: flat arrays for the output-path op
"""
