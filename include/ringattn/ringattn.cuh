#pragma once
//! \file
//! Umbrella header: everything public in ringattn except the transport-specific communicators
//! (`<ringattn/comm/mpi.cuh>`, `<ringattn/comm/nccl.cuh>`, `<ringattn/comm/nccl_mpi.cuh>`), which
//! need MPI or NCCL.
//!
//! \code
//! #include <ringattn/ringattn.cuh>
//! ringattn::partition_plan<ringattn::zigzag> plan(cu_seqlens, world_size);
//! \endcode

#include <ringattn/arguments.cuh>
#include <ringattn/block/device/backward.cuh>
#include <ringattn/block/device/backward_args.cuh>
#include <ringattn/block/device/block.cuh>
#include <ringattn/block/device/forward.cuh>
#include <ringattn/block/device/forward_args.cuh>
#include <ringattn/block/device/host_backward.cuh>
#include <ringattn/block/device/host_forward.cuh>
#include <ringattn/block/device/kv_quantize.cuh>
#include <ringattn/block_kernel.cuh>
#include <ringattn/comm/in_process.cuh>
#include <ringattn/concepts.cuh>
#include <ringattn/config.cuh>
#include <ringattn/core/block.cuh>
#include <ringattn/core/element.cuh>
#include <ringattn/core/kv_scales.cuh>
#include <ringattn/core/mask.cuh>
#include <ringattn/core/segment.cuh>
#include <ringattn/core/state.cuh>
#include <ringattn/core/tuning.cuh>
#include <ringattn/cuda_check.cuh>
#include <ringattn/error.cuh>
#include <ringattn/partition/balanced.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/device_plan.cuh>
#include <ringattn/partition/plan.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/scatter.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/reference/attention.cuh>
#include <ringattn/ring/schedule.cuh>
#include <ringattn/ring/workspace.cuh>
#include <ringattn/ring_attention.cuh>
#include <ringattn/sharded_attention.cuh>
#include <ringattn/tensor.cuh>
#include <ringattn/version.cuh>
