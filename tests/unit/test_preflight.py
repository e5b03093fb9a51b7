"""The launcher's preflight refuses a config that some world size the job may run at
cannot train at, before torchrun starts."""

import pytest

from llmtrain.config import ConfigError, load_config
from llmtrain.launch.config import LaunchConfig
from llmtrain.launch.node import preflight


def test_a_size_between_min_and_max_that_cannot_train_is_refused_with_the_fix():
    # 2 to 4 nodes of 2 ranks: 16 sequences divide among 2, 4 and 8 ranks, not 6
    cfg = load_config("debug_cpu", [("training.global_batch_size", 16),
                                    ("training.micro_batch_size", 1)])
    lc = LaunchConfig(nnodes="1:4", nproc_per_node=2)
    assert lc.world_sizes == [2, 4, 6, 8]
    for world in (2, 8):
        cfg.validate(world)
    with pytest.raises(ConfigError) as e:
        preflight(cfg, lc)
    message = str(e.value)
    assert "\n" not in message
    assert "cannot train at [6] (at 6: training.global_batch_size=16" in message
    assert "set training.global_batch_size=24" in message
    assert "node counts it fits: [1, 2, 4]" in message


def test_replicas_of_a_fixed_size_that_some_world_size_cannot_hold_are_refused():
    cfg = load_config("debug_cpu", [("parallelism.dp_replicate", -1),
                                    ("parallelism.dp_shard", 2),
                                    ("training.global_batch_size", 12),
                                    ("training.micro_batch_size", 1)])
    preflight(cfg, LaunchConfig(nnodes="1:3", nproc_per_node=2))  # 2, 4, 6 ranks: fits
    with pytest.raises(ConfigError) as e:
        preflight(cfg, LaunchConfig(nnodes="1:3", nproc_per_node=1))  # 1 and 3 ranks: not
    assert "cannot train at [1, 3]" in str(e.value)
    assert "set parallelism.dp_shard=1 (or a divisor of it)" in str(e.value)


def test_a_tensor_parallel_group_that_would_span_nodes_is_refused():
    cfg = load_config("debug_cpu", [("parallelism.tp", 2)])
    preflight(cfg, LaunchConfig(nnodes="1:2", nproc_per_node=2))  # a group per node: fits
    with pytest.raises(ConfigError, match=r"parallelism.tp=2 does not divide "
                                          r"--nproc-per-node=1: a tensor-parallel group "
                                          r"would span nodes"):
        preflight(cfg, LaunchConfig(nnodes="2", nproc_per_node=1))


def test_tensor_parallel_counts_data_parallel_ranks_in_the_global_batch_fix():
    # tp 2 on 2 to 3 nodes of 2 ranks: 2 and 3 data-parallel ranks; 16 sequences of 2
    # fit 2 but not 3, and the fix names a batch that fits both (2 x 3 x 2 = 12 -> 24)
    cfg = load_config("debug_cpu", [("parallelism.tp", 2), ("training.global_batch_size", 16),
                                    ("training.micro_batch_size", 2)])
    with pytest.raises(ConfigError) as e:
        preflight(cfg, LaunchConfig(nnodes="2:3", nproc_per_node=2))
    assert "cannot train at [6]" in str(e.value)
    assert "3 data-parallel ranks (6 / parallelism.tp=2)" in str(e.value)
    assert "set training.global_batch_size=24 (a multiple of 12)" in str(e.value)
