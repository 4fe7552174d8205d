#pragma once
//! \file
//! Umbrella header: everything public in ringattn.
//!
//! \code
//! #include <ringattn/ringattn.cuh>
//! ringattn::partition_plan<ringattn::zigzag> plan(cu_seqlens, world_size);
//! \endcode

#include <ringattn/arguments.cuh>
#include <ringattn/concepts.cuh>
#include <ringattn/config.cuh>
#include <ringattn/cuda_check.cuh>
#include <ringattn/error.cuh>
#include <ringattn/kernel/backward_args.cuh>
#include <ringattn/kernel/block.cuh>
#include <ringattn/kernel/forward.cuh>
#include <ringattn/kernel/forward_args.cuh>
#include <ringattn/kernel/host_backward.cuh>
#include <ringattn/kernel/host_forward.cuh>
#include <ringattn/kernel/state.cuh>
#include <ringattn/kernel/tuning.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/device_plan.cuh>
#include <ringattn/partition/plan.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/scatter.cuh>
#include <ringattn/partition/segment.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/reference/attention.cuh>
#include <ringattn/tensor.cuh>
#include <ringattn/version.cuh>
