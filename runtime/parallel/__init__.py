"""Tensor parallelism across processes: rendezvous, the per-step broadcast, worker processes.

Process model. Global rank 0 runs the scheduler, the proposer, the verifier and the HTTP
server; every other rank runs a worker loop that receives each step's model inputs from rank 0
(``step_channel``) and runs the same sharded forward, so the row-parallel all-reduces meet.
In one pod, ``specdecode serve`` spawns the other ranks itself (``workers``); across pods,
node 0 does that for its share and every other pod runs ``worker_pod``: its ranks plus
``/health`` and ``/ready``. ``leader`` is rank 0's side.
"""
