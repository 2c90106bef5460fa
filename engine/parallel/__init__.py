"""Parallel execution of one engine over several processes (DESIGN §6).

    prefill PP = N    stage 0 (driver: scheduler + its layers) ─▶ stage 1 ─▶ ... ─▶ stage N-1
                      hidden states over torch.distributed, sampled tokens back to stage 0,
                      consecutive steps in flight at once (pp_engine.PipelinedEngine)
    decode TP x DCP   rank 0 (driver: scheduler) broadcasts each step; every rank runs its
                      shard (tp_model), attention merged by log-sum-exp across DCP groups

One scheduler (in the driver) decides for every process, so block ids are the same
everywhere. The rank / stage processes are started by the worker layer (prefill_worker/
stages.py, decode_worker/ranks.py) or by benchmarks/parallel_gpu_check.py.
"""
