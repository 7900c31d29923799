"""Expert parallelism inside CUDA graphs: data-parallel attention, an MoE whose experts are shared out.

For an engine author: how the pieces meet when every rank's graph holds the
MoE's all-to-alls.

- ``moe``: the MoE layer (``ExpertParallelMoE``): router top-k, tokens packed
  per destination rank into static buffers sized for the padded key, dispatch
  and combine with ``all_to_all_single``, the weighted combine, the capacity
  (exact by default; a factor drops pairs and counts them on the device).
- ``decoder``: ``ExpertParallelDecoder``, attention per rank on its own
  requests and an MoE in every layer; where the all-to-all sits in FULL and
  PIECEWISE graphs, and how an eager step finds the ranks' common size.
- ``oracle``: ``oracle_step``, the same model on one process with every expert.
- ``steps``: build a rank's model and manager, draw random per-rank steps,
  check each rank's output against the oracle (``python -m examples.ep_moe``
  runs it on two ranks).

The ranks agree on every step through the manager
(``ManagerOptions(ranks=RankAgreement(...))``): every rank replays the same
key, an idle rank replays it on pad values (or runs one padding row when all
run eagerly), and a rank whose graphs are not all captured sends every rank
to the same eager step. Free the graphs (``manager.clear()``) before
``destroy_process_group``: a live graph holding NCCL work hangs the teardown.
"""
