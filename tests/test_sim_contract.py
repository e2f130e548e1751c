"""The contract tests that compare fastdp with torch's CPU results, run a second time with their tensors on simulated
CUDA devices (tests/_places.py), so that the Python layer's multi-device CUDA paths are checked for their values,
through the real C core on the simulated driver (tests/sim/simcuda.py: CUDA tensors and torch.cuda for a CPU build of
torch; tests/sim/contract.py: the pytest plugin). Each run is one pytest process with the simulated libraries named
in its environment; FASTDP_STRICT makes a fallback to torch an error, so every value the core could move is moved
by it. Any misuse or race the simulator records fails the test it happened in."""

import functools
import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.sim

HERE = os.path.dirname(os.path.abspath(__file__))
SIM = os.path.join(HERE, "sim")

# tests/test_reduction.py's comparisons with the bare model through autograd's ways of taking gradients (the others
# watch the host reducer thread or time backward).
REDUCTION = ["test_hooks_on_master_parameters_see_the_sum_once",
             "test_autograd_grad_and_backward_inputs_on_master_parameters",
             "test_retained_graph_twice_and_double_backward", "test_optimizer_stepping_inside_backward",
             "test_parameters_some_or_all_replicas_leave_unused", "test_no_sync_keeps_only_what_autograd_accumulated",
             "test_functional_grad_around_the_wrapper_inside_no_sync", "test_the_sum_becomes_grad_without_a_copy",
             "test_no_replica_gradient_outlives_its_backward",
             "test_torch_func_transforms_around_the_wrapper_raise_a_clear_error",
             "test_autograd_backward_with_grad_tensors_and_inputs"]

# tests/test_comm.py's value tests: every parametrisation each one has on the CPU.
COMM = ["test_broadcast", "test_broadcast_out", "test_broadcast_coalesced", "test_reduce_add",
        "test_reduce_add_coalesced", "test_scatter", "test_scatter_layouts", "test_scatter_chunk_sizes",
        "test_scatter_chunk_rule", "test_scatter_out", "test_gather", "test_gather_destinations_and_out"]


@functools.lru_cache(maxsize=None)
def _env():
    spec = importlib.util.spec_from_file_location("fastdp_sim_build", os.path.join(SIM, "build.py"))
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    if build.compiler() is None:
        pytest.skip("no C compiler found (cc, gcc or clang; or set CC): the simulated GPU needs one")
    return dict(os.environ, **build.env())


@pytest.fixture(params=["default", "caller"], ids=["default-streams", "caller-streams"])
def streams(request):
    """Each DataParallel run twice: on the devices' default streams, and with a stream of the caller's own current
    on every device (everything fastdp does for the caller, in any thread, must be ordered on it)."""
    return request.param


def _run(items, allocator="caching", select="not threads", streams="default"):
    env = dict(_env(), PYTHONPATH=os.pathsep.join([SIM, HERE]), FASTDP_STRICT="1", SIMGPU_ALLOCATOR=allocator,
               SIMGPU_CALLER_STREAMS="1" if streams == "caller" else "0")
    # conftest.cpu_apply's two ways of running emulated replicas mean nothing on CUDA devices: one of them is enough.
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "contract",
                           "-k", select, *items],
                          env=env, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-20000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-5000:]


def test_the_bridge_to_simulated_devices():
    """Values, views and poisoned fresh memory; values crossing devices through the core; a missing wait and an
    unwritten buffer, planted, caught (tests/sim/bridge_cases.py)."""
    _run([os.path.join("sim", "bridge_cases.py")])


@pytest.mark.parametrize("allocator, streams", [("caching", "default"), ("pool", "default"), ("caching", "caller")])
def test_comm_values_on_simulated_devices(allocator, streams):
    """broadcast, broadcast_coalesced, scatter, gather, reduce_add and reduce_add_coalesced on up to four simulated
    devices (repeated ids beyond), against the same torch CPU references as on the host; the core's scratch memory
    from PyTorch's route (a caching allocator) and from the driver's pool; on the default streams and on a caller's
    own."""
    _run([f"test_comm.py::{name}" for name in COMM], allocator, streams=streams)



# tests/test_dp_forward.py's forward through the wrapper written with tests/_places.py (those with a "kind" run on
# CUDA in the gpu set below).
FORWARD = ["test_chunk_rule_decides_replica_count", "test_surplus_chunks_of_larger_inputs_are_dropped_like_upstream",
           "test_module_zero_inputs", "test_data_parallel_small_back", "test_device_args_as_torch_devices",
           "test_nested_input", "test_nested_output_types_and_values", "test_namedtuple_scatter_and_gather",
           "test_scatter_passes_other_objects_by_reference", "test_dict_inputs_are_scattered_into_same_type",
           "test_scatter_along_dim_1", "test_scatter_set_on_the_instance_is_called",
           "test_forward_label_is_recorded_only_while_a_profiler_runs"]

# tests/test_dp_replicate.py written with tests/_places.py (not the pickling of a replica, a lazy module's refusal and
# a scripted module replicated alone: they stay on "cpu").
REPLICATE = ["test_replicate_storage_sharing_and_parameters_inside_replicas",
             "test_replicate_accepts_any_iterable_and_tuple", "test_replicate_buffers_and_batchnorm_chunk0_semantics",
             "test_shared_submodules_and_tied_weights_stay_shared", "test_parameter_list_and_dict_inside_replica",
             "test_zero_grad_inside_replica_warns_upstream_text", "test_rnn_flatten_parameters_no_grad_and_one_step",
             "test_python_module_wrapping_script_module"]

# tests/test_dp_parallel_apply.py written with tests/_places.py (not autocast's, whose "cpu" device type is what they
# check).
PARALLEL_APPLY = ["test_grad_mode_reaches_replicas", "test_parallel_apply_two_modules",
                  "test_each_replica_starts_from_the_callers_grad_mode", "test_parallel_apply_passes_exception",
                  "test_lowest_failing_replica_wins", "test_forward_hooks_on_wrapper_run_once_and_on_module_per_replica"]

# tests/test_sync_batchnorm.py's training against the bare model's BatchNorm on the full batch, written with
# tests/_places.py (not the checkpointed and failing-replica cases, whose bodies still name "cpu").
SYNC_BATCHNORM = ["test_training_equals_full_batch", "test_uneven_chunks", "test_layer_settings",
                  "test_sequence_input_batchnorm1d", "test_channels_last", "test_layer_called_twice_and_no_grad",
                  "test_data_parallel_function", "test_criterion_path", "test_one_replica_is_plain_batchnorm"]

# DataParallel against the bare model: the tests and what each set covers.
DATA_PARALLEL = [
    # the forward: the chunk rule, inputs and outputs of every container kind, scatter along another dim
    *[f"test_dp_forward.py::{name}" for name in FORWARD],
    # replicas: parameters inside them, buffers and BatchNorm statistics from chunk 0, tied weights, an LSTM step
    *[f"test_dp_replicate.py::{name}" for name in REPLICATE],
    # what replicas run under: grad and inference mode, a replica's exception (naming its device), forward hooks
    *[f"test_dp_parallel_apply.py::{name}" for name in PARALLEL_APPLY],
    # SyncBatchNorm: statistics summed across the devices through the core, five SGD steps, uneven and empty chunks
    *[f"test_sync_batchnorm.py::{name}" for name in SYNC_BATCHNORM],
    # five SGD steps (forward, backward through the reduction's streams, optimizer step), one to four devices
    "test_dp_training.py::test_sgd_steps_match_full_batch",
    # every way of taking gradients through the wrapper, with a host batch scattered to the devices
    *[f"test_reduction.py::{name}" for name in REDUCTION],
    # a gradient penalty (double backward through the input and the parameters), unused and partly used
    # parameters, channels-last gradients, complex parameters, a buffer that requires grad (gradcheck), no
    # reference cycles left by a step (not sparse gradients: the bridge has no sparse tensors)
    *[f"test_dp_autograd.py::{name}" for name in (
        "test_double_backward_gradient_penalty", "test_unused_parameters_keep_grad_none_partially_used_get_sums",
        "test_strided_grad_layout_channels_last", "test_complex_parameters_and_inputs_stay_complex",
        "test_buffers_requiring_grad_gradcheck", "test_no_reference_cycles")],
    # the kept replicas across steps (every change to the master between steps, buckets, frozen parameters, the
    # replica count changing, two forwards before one backward, pooled buffers reused, channels-last gradients,
    # BatchNorm statistics, a deep copy, no reference cycles) and no_sync's unsynced sums (not a structure change
    # under no_sync, whose new host modules the test body adds as it goes, nor the worker-thread count of the
    # emulated replicas' two ways of running)
    *[f"test_dp_persistent.py::{name}" for name in (
        "test_replicas_are_kept_across_steps", "test_frozen_parameters_are_not_reduced",
        "test_master_changes_are_seen_like_fresh_replicas", "test_replica_only_attributes_do_not_persist",
        "test_changing_number_of_replicas_between_steps", "test_two_forwards_before_backward",
        "test_flat_buffers_are_reused_in_steady_state", "test_no_sync_equals_plain_accumulation",
        "test_grad_keeps_memory_format_and_matches_bare", "test_no_reference_cycles_with_kept_replicas",
        "test_pickle_and_deepcopy_drop_the_cache", "test_batchnorm_stats_from_chunk0_with_kept_replicas")],
    # scatter and gather between devices and the host, gradients checked to the second order
    "test_dp_scatter_gather.py::test_scatter_cpu", "test_dp_scatter_gather.py::test_gather_cpu",
    # chunk_sizes="auto" settling device 0's share by bisection with an injected memory reader (not the memory
    # report's tests: their figures are the host's, "n/a" for the allocator)
    *[f"test_memory_balance.py::{name}" for name in (
        "test_auto_settles_by_bisection_within_the_bound_and_stays",
        "test_auto_keeps_the_equal_split_when_device_0_is_within_the_bound",
        "test_auto_bounded_at_zero_and_skips_other_batch_sizes_and_eval")],
    # train_step's rescue of an out-of-memory error raised in backward (fastdp.inject_oom, which the other rescue
    # tests use, serves emulated replicas only)
    "test_rebalance.py::test_train_step_rescues_a_backward_oom_and_grads_count_each_step_once",
    "test_rebalance.py::test_train_step_drops_the_sums_a_failed_backward_started",
]


def test_data_parallel_matches_the_bare_model_on_simulated_devices(streams):
    """DataParallel's training, gradients, kept replicas, scatter and gather, and rescue on up to four simulated
    devices against the bare model on the host (DATA_PARALLEL says which tests)."""
    _run(DATA_PARALLEL, streams=streams)


def test_the_gpu_tests_on_simulated_devices(streams):
    """The tests written for a real GPU (marked gpu or multi_gpu) of the drop-in, training and balance files: one
    GPU listed several times, and every simulated device (device_count() is four here), against the bare model. Not
    those that run upstream's DataParallel beside fastdp's (a CPU build of torch has no CUDA collectives)."""
    _run(["-m", "gpu or multi_gpu", "test_dp_forward.py", "test_dp_devices.py", "test_dp_training.py",
          "test_memory_balance.py"], select="not threads and not side_by_side", streams=streams)
